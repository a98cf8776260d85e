"""The environment's processor-independent arithmetic (cernenv/physics/portable.py): each function
against numpy's and LAPACK's results, and the environment's source free of the numpy calls whose
bits depend on the processor."""

import ast
import math
from pathlib import Path

import numpy as np
import pytest

from cernenv.physics import portable

ROOT = Path(__file__).resolve().parents[1]

DISPATCHED_UFUNCS = {
    "exp", "exp2", "expm1", "log", "log10", "log2", "log1p", "power", "float_power", "logaddexp", "logaddexp2",
    "sin", "cos", "tan", "arcsin", "arccos", "arctan", "arctan2", "sinh", "cosh", "tanh", "arcsinh", "arccosh",
    "arctanh", "cbrt",
}  # fmt: skip
"""numpy float64 functions with processor-specific kernels (AVX2, AVX-512), or that may get them
(sin and cos are the same on every x86-64 processor in numpy 2.4, but nothing promises it)."""
BLAS_CALLS = {"dot", "matmul", "inner", "vdot", "tensordot", "kron", "linalg"}
"""numpy calls that go to OpenBLAS (per-processor kernels); ``np.linalg.LinAlgError`` is allowed."""
COMPILED_MODULES = {"kernels.py", "portable.py"}
"""Modules compiled by numba: there ``np.exp``, ``np.log``... are the C library's, one call per element."""


def _unportable(path: Path):
    """(line, what) of each call in `path` whose result depends on the processor."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            what = "@ (BLAS): portable.matmul / matvec / vecdot"
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            exponent = node.right.operand if isinstance(node.right, ast.UnaryOp) else node.right
            if not (isinstance(exponent, ast.Constant) and isinstance(exponent.value, int)):
                what = f"** {ast.unparse(node.right)} (np.power on arrays): portable.power, or math.pow for numbers"
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "np":
            if node.attr in BLAS_CALLS:
                what = f"np.{node.attr} (BLAS): cernenv.physics.portable"
            elif node.attr in DISPATCHED_UFUNCS and path.name not in COMPILED_MODULES:
                what = f"np.{node.attr}: portable.{node.attr}"
        elif isinstance(node, ast.Attribute) and node.attr == "dot":
            what = ".dot (BLAS): portable.vecdot / matvec"
        elif isinstance(node, ast.keyword) and node.arg == "optimize":
            what = "einsum(optimize=...) may call BLAS"
        if what:
            found.append((node.lineno, what))
    allowed = {
        n.value.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "LinAlgError"
    }  # `except np.linalg.LinAlgError` names an exception, it computes nothing
    return sorted((line, what) for line, what in found if not (line in allowed and what.startswith("np.linalg")))


def test_the_environment_computes_nothing_with_processor_specific_kernels():
    """Every module that decides what an agent sees or earns (all of cernenv but the server, which
    only carries the environment's results)."""
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {what}"
        for path in sorted((ROOT / "cernenv").rglob("*.py"))
        if "server" not in path.parts
        for line, what in _unportable(path)
    ]
    assert not offenders, "\n".join(offenders)


def test_the_scan_finds_what_it_looks_for(tmp_path):
    source = tmp_path / "example.py"
    source.write_text(
        "import numpy as np\n"
        "a = np.exp(x)\n"
        "b = m @ v\n"
        "c = x ** p\n"
        "d = np.linalg.inv(m)\n"
        "e = x ** 2 + x ** -1\n"
        "try:\n    pass\nexcept np.linalg.LinAlgError:\n    pass\n"
    )
    assert sorted(line for line, _ in _unportable(source)) == [2, 3, 4, 5]


def test_elementwise_functions_are_the_c_librarys_one_call_per_element():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(-40.0, 40.0, 2000), [0.0, -0.0, 1e-300, 709.0, -745.0, np.inf, -np.inf]])
    positive = np.concatenate([rng.uniform(1e-9, 1e4, 2000), [0.0, 1.0, np.inf]])
    for name, arguments, reference in (
        ("exp", x, math.exp),
        ("expm1", x, math.expm1),
    ):
        got = getattr(portable, name)(arguments)
        finite = np.abs(arguments) < 700
        want = np.array([reference(v) for v in arguments[finite]])
        assert np.array_equal(got[finite], want), name
    assert np.array_equal(portable.log(positive[:-3]), [math.log(v) for v in positive[:-3]])
    assert np.array_equal(portable.log1p(positive[:-3] - 0.5), [math.log1p(v - 0.5) for v in positive[:-3]])
    assert np.array_equal(portable.power(positive[:-3], 1.7), [math.pow(v, 1.7) for v in positive[:-3]])
    with np.errstate(all="ignore"):  # numpy's own values at the edges, without numpy's warnings
        assert portable.log(0.0) == -np.inf and np.isnan(portable.log(-1.0)) and portable.log1p(-1.0) == -np.inf
        assert np.isnan(portable.log1p(-2.0)) and portable.exp(-np.inf) == 0.0 and portable.exp(1e4) == np.inf
        np.testing.assert_allclose(portable.exp(x[:2000]), np.exp(x[:2000]), rtol=4e-16)
        np.testing.assert_allclose(portable.log(positive), np.log(positive), rtol=4e-16)
    pairs = rng.uniform(-800.0, 800.0, (2, 500))
    np.testing.assert_allclose(portable.logaddexp(*pairs), np.logaddexp(*pairs), rtol=1e-15)
    assert portable.logaddexp(-np.inf, -np.inf) == -np.inf and portable.logaddexp(3.0, 3.0) == 3.0 + math.log(2.0)
    assert portable.logsumexp([-1000.0, -1000.0, -999.0]) == pytest.approx(
        float(np.logaddexp.reduce([-1000.0, -1000.0, -999.0]))
    )
    a, b = rng.normal(size=300) + 1j * rng.normal(size=300), rng.normal(size=300) + 1j * rng.normal(size=300)
    product = portable.cmul(a, b)
    assert np.array_equal(product.real, a.real * b.real - a.imag * b.imag)
    assert np.array_equal(product.imag, a.real * b.imag + a.imag * b.real)
    assert np.shape(portable.exp(1.0)) == () and portable.exp(np.ones((2, 3))).shape == (2, 3), "numpy's broadcasting"


def test_products_sum_in_order():
    rng = np.random.default_rng(2)
    a, b, v = rng.normal(size=(5, 7)), rng.normal(size=(7, 4)), rng.normal(size=7)
    assert portable.vecdot(v, v) == sum(x * x for x in v.tolist())  # first element to last
    np.testing.assert_allclose(portable.matmul(a, b), a @ b, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(portable.matvec(a, v), a @ v, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(portable.matmul(a.T, a[:, :3]), a.T @ a[:, :3], rtol=1e-13, atol=1e-14)  # any layout


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_factorisations_agree_with_lapack(n):
    rng = np.random.default_rng(n)
    m = rng.normal(size=(n, n))
    spd = m @ m.T + n * np.eye(n)
    b = rng.normal(size=(n, 3))
    np.testing.assert_allclose(portable.solve(spd, b), np.linalg.solve(spd, b), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(portable.solve(m, b[:, 0]), np.linalg.solve(m, b[:, 0]), rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(portable.inv(spd), np.linalg.inv(spd), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(portable.cholesky(spd), np.linalg.cholesky(spd), rtol=1e-12, atol=1e-13)
    symmetric = m + m.T
    values, vectors = portable.eigh(symmetric)
    np.testing.assert_allclose(values, np.linalg.eigvalsh(symmetric), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(vectors @ np.diag(values) @ vectors.T, symmetric, atol=1e-12)
    np.testing.assert_allclose(vectors.T @ vectors, np.eye(n), atol=1e-13)
    tall = rng.normal(size=(n + 4, n))
    u, s, vt = portable.svd(tall)
    np.testing.assert_allclose(s, np.linalg.svd(tall, compute_uv=False), rtol=1e-12)
    np.testing.assert_allclose(u @ np.diag(s) @ vt, tall, atol=1e-12)
    y = rng.normal(size=n + 4)
    np.testing.assert_allclose(portable.lstsq(tall, y), np.linalg.lstsq(tall, y, rcond=None)[0], rtol=1e-10, atol=1e-12)


def test_singular_and_rank_deficient_matrices_are_treated_as_numpy_treats_them():
    singular = np.array([[1.0, 2.0], [2.0, 4.0]])
    with pytest.raises(np.linalg.LinAlgError):
        portable.solve(singular, np.ones(2))
    with pytest.raises(np.linalg.LinAlgError):
        portable.inv(np.zeros((3, 3)))
    with pytest.raises(np.linalg.LinAlgError):
        portable.cholesky(np.array([[1.0, 0.0], [0.0, -1.0]]))
    rank_one = np.outer([1.0, 2.0, 3.0], [1.0, -1.0, 0.5])
    np.testing.assert_allclose(portable.pinv(rank_one), np.linalg.pinv(rank_one), atol=1e-12)
    np.testing.assert_allclose(portable.pinv(rank_one.T), np.linalg.pinv(rank_one.T), atol=1e-12)
    wide = np.array([[1.0, 1.0, 0.0]])  # min-norm solution of an underdetermined system
    np.testing.assert_allclose(portable.lstsq(wide, [2.0]), np.linalg.lstsq(wide, [2.0], rcond=None)[0], atol=1e-14)
    assert not np.any(portable.pinv(np.zeros((2, 2))))
