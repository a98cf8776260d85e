"""Arithmetic whose bits do not depend on the processor: what the environment computes with,
wherever a result decides what an agent sees or earns.

The same seed must be the same episode on every x86-64 machine. numpy picks its kernels for the
processor it runs on: its float64 ``exp``, ``log``, ``log1p``, ``expm1``, ``power``, ``arctan``,
``tanh``... have AVX2 or AVX-512 versions whose last bits differ from the C library's (and from
each other), and ``@``, ``np.dot`` and ``np.linalg`` go to OpenBLAS, which picks its kernels per
processor family too (and sums in another order on each). A fit started from values that differ in
their last bit can stop one Newton iteration earlier, so an episode's significance, and its grade,
came out differently on a machine with AVX-512 than on one without (15 of 313 committed evaluation
episodes).

So the environment takes these from here:

- elementwise ``exp``, ``log``, ``log1p``, ``expm1``, ``power`` and ``logaddexp``: numpy ufuncs
  compiled by numba, one C-library call per element (the same call numpy makes where it has no
  vector kernel, and the one numba's compiled physics makes), never a vector kernel; and the
  complex product ``cmul`` (numpy's uses fused multiply-adds where the processor has them);
- ``vecdot``, ``matvec``, ``matmul``, ``solve``, ``inv``, ``cholesky``, ``eigh``, ``svd``,
  ``pinv`` and ``lstsq``: loops in a fixed order, compiled by numba (Gaussian elimination with
  partial pivoting, Cholesky-Banachiewicz, cyclic Jacobi rotations, one-sided Jacobi SVD), for the
  small matrices of the fits (at most 7 x 7, or a few hundred rows of 3 or 4 columns).

numba compiles without fused multiply-adds or reassociation (no ``fastmath``), so the same loop
makes the same bits whatever vector units the processor has. What is left to the processor is the C
library's own choice between its implementations of ``exp``, ``log`` and ``pow``: glibc has one for
processors with FMA and AVX2 (every x86-64 processor since 2013-2015) and one for those without,
which differ in rare last bits; the fits are made to give one answer under either
(``cernenv.physics.fitting``: no parameter left where rounding stopped it). Sums (``np.sum``),
``np.sqrt``, ``np.sin``/``np.cos`` and ``np.einsum`` (without ``optimize``) are the same on every
processor already: numpy compiles them once for its baseline. tests/test_portable.py holds every
function here to numpy/LAPACK's result and scans the environment's source for the calls this module
replaces; tests/test_evidence_replay.py replays the committed episodes with numpy's vector kernels
and OpenBLAS's processor-specific kernels turned off, and glibc's ``exp`` and ``log`` for a
processor without FMA.
"""

from __future__ import annotations

import logging
import math

import numpy as np
from numba import njit as _njit
from numba import vectorize as _vectorize
from numba.core import event as _numba_event

# ----------------------------------------------------------------------------- compiling

COMPILING_NOTICE = "compiling the physics kernels once (about a minute); later runs load them from the cache"
"""Said (a warning of the `cernenv.physics` logger: on stderr where logging is not set up) when numba
first compiles one of the environment's kernels in a process, which only a cache miss does: the
first episode on a fresh install, or after the kernels' source changed."""


class _FirstCompileNotice(_numba_event.Listener):
    """Says `COMPILING_NOTICE` once, when numba first runs a compiler pass on a function of this
    package (numba's "numba:run_pass" event: it comes for a compilation, a `vectorize` ufunc's too,
    never for a function loaded from numba's cache)."""

    said = False

    def on_start(self, event) -> None:
        if self.said:
            return
        module = str((event.data or {}).get("module") or "")
        if module.startswith(__package__ or "cernenv.physics"):
            type(self).said = True
            logging.getLogger(__package__ or "cernenv.physics").warning(COMPILING_NOTICE)

    def on_end(self, event) -> None:
        pass


_numba_event.register("numba:run_pass", _FirstCompileNotice())


def njit(cache: bool = True):
    """numba's ``njit``, cached on disk where numba finds a writable cache folder (beside this
    file, ``NUMBA_CACHE_DIR``, or the user's cache folder); where none is writable (a read-only
    install and home), compiled in each process instead of failing at import."""

    def compile_(function):
        try:
            return _njit(cache=cache)(function)
        except RuntimeError as error:
            if "cannot cache" not in str(error):
                raise
            return _njit(cache=False)(function)

    return compile_


def _ufunc(*signatures: str):
    """numba's ``vectorize`` (a numpy ufunc of these signatures), cached on disk where it can be."""

    def compile_(function):
        try:
            return _vectorize(list(signatures), cache=True)(function)
        except RuntimeError as error:
            if "cannot cache" not in str(error):
                raise
            return _vectorize(list(signatures))(function)

    return compile_


@_ufunc("float64(float64)")
def exp(x):
    """e**x, elementwise (the C library's exp)."""
    return math.exp(x)


@_ufunc("float64(float64)")
def log(x):
    """ln x, elementwise (-inf at 0, nan below)."""
    if x < 0.0:
        return math.nan
    if x == 0.0:
        return -math.inf
    return math.log(x)


@_ufunc("float64(float64)")
def log1p(x):
    """ln(1 + x), elementwise, accurate for small x (-inf at -1, nan below)."""
    if x < -1.0:
        return math.nan
    if x == -1.0:
        return -math.inf
    return math.log1p(x)


@_ufunc("float64(float64)")
def expm1(x):
    """e**x - 1, elementwise, accurate for small x."""
    return math.expm1(x)


@_ufunc("float64(float64, float64)")
def power(x, y):
    """x**y, elementwise (the C library's pow: nan for a negative x and a non-integer y)."""
    return math.pow(x, y)


@_ufunc("float64(float64, float64)")
def logaddexp(x, y):
    """ln(e**x + e**y) without overflow, elementwise (numpy's ``logaddexp``)."""
    if x == y:
        return x + math.log(2.0)
    d = x - y
    if d > 0.0:
        return x + math.log1p(math.exp(-d))
    if d <= 0.0:
        return y + math.log1p(math.exp(d))
    return d  # nan


@_ufunc("complex128(complex128, complex128)")
def cmul(a, b):
    """a b of complex numbers, elementwise, from their real and imaginary parts (numpy's complex
    product uses fused multiply-adds where the processor has them, and rounds otherwise)."""
    return complex(a.real * b.real - a.imag * b.imag, a.real * b.imag + a.imag * b.real)


def logsumexp(values) -> float:
    """ln(sum e**v) of a sequence, folded from the left with ``logaddexp`` (numpy's
    ``logaddexp.reduce``)."""
    values = np.asarray(values, dtype=np.float64).ravel()
    total = values[0]
    for value in values[1:]:
        total = logaddexp(total, value)
    return float(total)


# ----------------------------------------------------------------------------- linear algebra


@njit(cache=True)
def vecdot(a, b):
    """a . b of two vectors, summed from the first element to the last."""
    total = 0.0
    for i in range(a.size):
        total += a[i] * b[i]
    return total


@njit(cache=True)
def matvec(m, v):
    """m v (m of shape (R, C), v of C): each row summed from its first column."""
    rows, cols = m.shape
    out = np.zeros(rows)
    for r in range(rows):
        total = 0.0
        for c in range(cols):
            total += m[r, c] * v[c]
        out[r] = total
    return out


@njit(cache=True)
def matmul(a, b):
    """a b of two matrices, each element summed over the inner index in order."""
    rows, inner = a.shape
    cols = b.shape[1]
    out = np.zeros((rows, cols))
    for r in range(rows):
        for c in range(cols):
            total = 0.0
            for k in range(inner):
                total += a[r, k] * b[k, c]
            out[r, c] = total
    return out


@njit(cache=True)
def _solve_columns(a, b):
    """x with a x = b (b of shape (n, k)) by Gaussian elimination with partial pivoting (LAPACK's
    gesv); (x, False) where a pivot is exactly 0."""
    n = a.shape[0]
    m = a.copy()
    x = b.copy()
    k = x.shape[1]
    for col in range(n):
        pivot = col
        for row in range(col + 1, n):
            if abs(m[row, col]) > abs(m[pivot, col]):
                pivot = row
        if m[pivot, col] == 0.0:
            return x, False
        if pivot != col:
            for j in range(n):
                m[col, j], m[pivot, j] = m[pivot, j], m[col, j]
            for j in range(k):
                x[col, j], x[pivot, j] = x[pivot, j], x[col, j]
        for row in range(col + 1, n):
            factor = m[row, col] / m[col, col]
            for j in range(col, n):
                m[row, j] -= factor * m[col, j]
            for j in range(k):
                x[row, j] -= factor * x[col, j]
    for col in range(n - 1, -1, -1):
        for j in range(k):
            acc = x[col, j]
            for i in range(col + 1, n):
                acc -= m[col, i] * x[i, j]
            x[col, j] = acc / m[col, col]
    return x, True


def solve(a, b) -> np.ndarray:
    """x with a x = b (b a vector or a matrix of columns); ``numpy.linalg.LinAlgError`` where a is
    singular (a pivot exactly 0), as ``numpy.linalg.solve``."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    columns = np.ascontiguousarray(b.reshape(b.shape[0], -1))
    x, ok = _solve_columns(a, columns)
    if not ok:
        raise np.linalg.LinAlgError("Singular matrix")
    return x.reshape(b.shape)


def inv(a) -> np.ndarray:
    """a^-1 (``solve`` of the identity); ``numpy.linalg.LinAlgError`` where a is singular."""
    a = np.asarray(a, dtype=np.float64)
    return solve(a, np.eye(a.shape[0]))


@njit(cache=True)
def _cholesky(a):
    """Lower-triangular L with L L^T = a (row by row); (L, False) where a is not positive definite."""
    n = a.shape[0]
    low = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1):
            total = a[i, j]
            for k in range(j):
                total -= low[i, k] * low[j, k]
            if i == j:
                if not total > 0.0:
                    return low, False
                low[i, i] = math.sqrt(total)
            else:
                low[i, j] = total / low[j, j]
    return low, True


def cholesky(a) -> np.ndarray:
    """The lower Cholesky factor of a symmetric matrix; ``numpy.linalg.LinAlgError`` where it is
    not positive definite, as ``numpy.linalg.cholesky``."""
    low, ok = _cholesky(np.ascontiguousarray(a, dtype=np.float64))
    if not ok:
        raise np.linalg.LinAlgError("Matrix is not positive definite")
    return low


JACOBI_SWEEPS = 60
"""Most sweeps of Jacobi rotations (each sweep rotates every pair once; 6 to 10 reach rounding)."""


@njit(cache=True)
def eigh(a):
    """Eigenvalues (ascending) and eigenvectors (columns) of a symmetric matrix, by cyclic Jacobi
    rotations (Rutishauser's formulas) until the off-diagonal part is below rounding."""
    n = a.shape[0]
    m = a.copy()
    vectors = np.eye(n)
    for _sweep in range(JACOBI_SWEEPS):
        off = 0.0
        scale = 0.0
        for p in range(n):
            scale += m[p, p] * m[p, p]
            for q in range(p + 1, n):
                off += m[p, q] * m[p, q]
        if off <= 1e-34 * scale or off == 0.0:
            break
        for p in range(n - 1):
            for q in range(p + 1, n):
                apq = m[p, q]
                if apq == 0.0:
                    continue
                theta = (m[q, q] - m[p, p]) / (2.0 * apq)
                t = 1.0 / (abs(theta) + math.sqrt(theta * theta + 1.0))
                if theta < 0.0:
                    t = -t
                c = 1.0 / math.sqrt(t * t + 1.0)
                s = t * c
                for k in range(n):  # columns p and q
                    mkp, mkq = m[k, p], m[k, q]
                    m[k, p] = c * mkp - s * mkq
                    m[k, q] = s * mkp + c * mkq
                for k in range(n):  # rows p and q
                    mpk, mqk = m[p, k], m[q, k]
                    m[p, k] = c * mpk - s * mqk
                    m[q, k] = s * mpk + c * mqk
                m[p, q] = 0.0
                m[q, p] = 0.0
                for k in range(n):
                    vkp, vkq = vectors[k, p], vectors[k, q]
                    vectors[k, p] = c * vkp - s * vkq
                    vectors[k, q] = s * vkp + c * vkq
    values = np.empty(n)
    for i in range(n):
        values[i] = m[i, i]
    order = np.argsort(values, kind="mergesort")
    out_vectors = np.empty((n, n))
    out_values = np.empty(n)
    for j in range(n):
        out_values[j] = values[order[j]]
        for i in range(n):
            out_vectors[i, j] = vectors[i, order[j]]
    return out_values, out_vectors


@njit(cache=True)
def svd(a):
    """Thin singular value decomposition a = u diag(s) vt (s descending) of a matrix with at least as
    many rows as columns, by one-sided Jacobi rotations (Hestenes) of its columns."""
    rows, cols = a.shape
    u = a.copy()
    v = np.eye(cols)
    for _sweep in range(JACOBI_SWEEPS):
        rotated = False
        for p in range(cols - 1):
            for q in range(p + 1, cols):
                alpha = 0.0
                beta = 0.0
                gamma = 0.0
                for k in range(rows):
                    alpha += u[k, p] * u[k, p]
                    beta += u[k, q] * u[k, q]
                    gamma += u[k, p] * u[k, q]
                if gamma == 0.0 or abs(gamma) <= 1e-17 * math.sqrt(alpha * beta):
                    continue
                rotated = True
                zeta = (beta - alpha) / (2.0 * gamma)
                t = 1.0 / (abs(zeta) + math.sqrt(1.0 + zeta * zeta))
                if zeta < 0.0:
                    t = -t
                c = 1.0 / math.sqrt(1.0 + t * t)
                s = c * t
                for k in range(rows):
                    ukp, ukq = u[k, p], u[k, q]
                    u[k, p] = c * ukp - s * ukq
                    u[k, q] = s * ukp + c * ukq
                for k in range(cols):
                    vkp, vkq = v[k, p], v[k, q]
                    v[k, p] = c * vkp - s * vkq
                    v[k, q] = s * vkp + c * vkq
        if not rotated:
            break
    norms = np.empty(cols)
    for j in range(cols):
        total = 0.0
        for k in range(rows):
            total += u[k, j] * u[k, j]
        norms[j] = math.sqrt(total)
    order = np.argsort(-norms, kind="mergesort")
    s_out = np.empty(cols)
    u_out = np.zeros((rows, cols))
    vt_out = np.empty((cols, cols))
    for j in range(cols):
        col = order[j]
        s_out[j] = norms[col]
        for k in range(rows):
            u_out[k, j] = u[k, col] / norms[col] if norms[col] > 0.0 else 0.0
        for k in range(cols):
            vt_out[j, k] = v[k, col]
    return u_out, s_out, vt_out


@njit(cache=True)
def _pinv(a, rcond):
    """The pseudo-inverse of a (rows >= columns) from ``svd``, singular values at or below
    ``rcond`` times the largest counted as 0."""
    u, s, vt = svd(a)
    rows, cols = a.shape
    out = np.zeros((cols, rows))
    cut = rcond * s[0]
    for j in range(cols):
        if s[j] > cut:
            for r in range(cols):
                for c in range(rows):
                    out[r, c] += vt[j, r] * (u[c, j] / s[j])
    return out


PINV_RCOND = 1e-15
"""Singular values at or below this fraction of the largest count as 0 (``numpy.linalg.pinv``'s default)."""


def pinv(a, rcond: float = PINV_RCOND) -> np.ndarray:
    """The Moore-Penrose pseudo-inverse of a matrix (``numpy.linalg.pinv``)."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    if a.shape[0] >= a.shape[1]:
        return _pinv(a, rcond)
    return np.ascontiguousarray(_pinv(np.ascontiguousarray(a.T), rcond).T)


def lstsq(a, b, rcond: float | None = None) -> np.ndarray:
    """The minimum-norm least-squares solution of a x = b (``numpy.linalg.lstsq``'s first result;
    by default singular values at or below max(rows, cols) machine epsilons of the largest are 0)."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    cut = max(a.shape) * np.finfo(np.float64).eps if rcond is None else rcond
    return matvec(pinv(a, cut), np.ascontiguousarray(b, dtype=np.float64))
