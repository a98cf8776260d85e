"""Fast bump hunt: local significance of a narrow resonance on a grid of mass hypotheses.

No approximation beyond the narrow-width hypothesis (width 0, Gaussian resolution):
one background-only fit, then, for every mass on the grid at once, the full
profile of (N_b, p1, p2, N_s) by Fisher scoring on the exact Poisson likelihood,
for each mass of the grid (compiled loops, ``kernels.profile_rows``), started at the
background-only fit (the s+b optimum at fixed mass is a small displacement from it, so
3-5 iterations suffice). Only masses
with an excess are profiled: where the score in N_s at the background-only optimum
points down, N_s-hat <= 0 and q0 = 0 without iterating (``local_q0``); on a sparse
spectrum those deficits, pinned at the bin-positivity boundary, were the slow part.
Each point agrees with an independent iminuit fit of the same likelihood
(tests/test_scan_crosscheck.py); the scan is just far cheaper than one fit per mass. Mass is not fitted
between grid points: use a grid step <= resolution / 2.

q0 and Z follow Cowan, Cranmer, Gross, Vitells, Eur. Phys. J. C71 (2011) 1554,
eq. 12: q0 = -2 ln lambda(0) for N_s-hat > 0, else 0; Z = sqrt(q0).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

from . import portable
from .fitting import SHAPE_FIT_MIN_EVENTS, BackgroundFit, fit_background_on_template, fit_signal_plus_background
from .kernels import profile_rows
from .likelihood import BinnedTemplate, as_counts, template

_SQRT2PI = float(np.sqrt(2.0 * np.pi))


@dataclass(frozen=True)
class BumpScan:
    """Local significance along a mass grid.

    ``candidates_gev``: local maxima with z_local >= 2, strongest first, at most 5,
    pairwise separated by >= 2 resolutions. ``signal_yield``: N_s-hat per mass, profiled
    where there is an excess; at a deficit (q0 = 0) the one-step score estimate, <= 0.
    """

    mass_grid_gev: tuple[float, ...]
    z_local: tuple[float, ...]
    best_mass_gev: float
    best_z_local: float
    candidates_gev: tuple[float, ...]
    signal_yield: tuple[float, ...]
    background: BackgroundFit


def gaussian_bin_fractions(tmpl: BinnedTemplate, mass_gev: np.ndarray, resolution_gev: np.ndarray) -> np.ndarray:
    """(K, n_bins) signal fractions for K narrow-resonance hypotheses.

    Same numbers as shapes.signal_bin_fractions(edges, m, 0.0, sigma) (a width-0
    Voigt is a Gaussian), vectorised over the grid (the exponentials are the work).
    """
    m = np.asarray(mass_gev, dtype=float)[:, None]
    sig = np.maximum(np.asarray(resolution_gev, dtype=float), 1e-6)[:, None]
    dens = portable.exp(-0.5 * ((tmpl.nodes[None, :] - m) / sig) ** 2) / (sig * _SQRT2PI)
    return tmpl.simpson(dens)


def _profile(
    tmpl: BinnedTemplate, n: np.ndarray, start: np.ndarray, s: np.ndarray | None, n_iter: int, positive: bool = False
):
    """Fisher scoring of (N_b, p1, p2[, N_s]) from ``start`` ((4,), or (K, 4): one start per row)
    for each row of ``s`` (None: background only, one row). Returns theta (K, 4), mu (K, n),
    f, df/dp1, df/dp2 at theta, and whether each row converged (K,). ``positive``: a row is
    given up (not converged) once its N_s is <= 0 (a search for a maximum at N_s > 0).

    Each row: the score and expected information J diag(1/mu) J^T of the Poisson likelihood,
    the step -info^-1 score (``kernels.wall_step``), cut where it would cross the falling-shape
    floor and halved until every bin expectation is valid and the NLL does not rise (a row that no
    step along its direction lowers stops where it is); converged once the Newton decrement
    is below 1e-7 (NLL within ~5e-8 of its maximum: q0 to ~1e-7). The background stays falling
    (``likelihood.SHAPE_PENALTY``): the log-log slopes at the window edges, linear in (p1, p2),
    stay >= min(their value at the start, 0) - 1e-9; at that floor a constraint is held (the
    step projected onto its face in the metric of the information, through its Lagrange
    multiplier; of the subsets of walls held, the feasible step with the largest decrement:
    the exact minimiser of the quadratic model on the feasible cone). The loops are compiled
    (``kernels.profile_rows``)."""
    free_signal = s is not None
    signal = np.zeros((1, n.size)) if not free_signal else np.array(s, dtype=float)
    starts = np.empty((signal.shape[0], 4))
    starts[:] = start
    return profile_rows(
        tmpl.log_1mx,
        tmpl.log_x,
        tmpl.w6,
        tmpl.slope_matrix,
        np.array(n, dtype=float),  # writable copies: one compiled specialisation for every call
        starts,
        signal,
        free_signal,
        int(n_iter),
        bool(positive),
    )


def _nll(mu: np.ndarray, n: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):  # a failed row gives NaN: no excess
        return np.sum(mu - np.where(n > 0, n * portable.log(mu), 0.0), axis=-1)


@lru_cache(maxsize=8)
def _background_profile(tmpl: BinnedTemplate, counts_bytes: bytes, start: tuple):
    """The background-only maximum from a background fit's (N_b, p1, p2), for ``local_q0``:
    computed once per spectrum and fit (the bump scan and the significance both need it);
    read-only arrays."""
    arrays = _profile(tmpl, np.frombuffer(counts_bytes, dtype=float), np.array([*start, 0.0]), None, 25)
    for a in arrays:
        a.setflags(write=False)
    return arrays


RETRY_ITERATIONS = 100
"""Fisher-scoring iterations of a row refitted from inside the excess (``local_q0``): such a row
starts far from its maximum, often in a valley of the background's shape that a sparse spectrum
does not close, where the monotone steps take tens of iterations. A row that has not converged by
then keeps its last NLL, never above the start's: its q0 is a lower bound."""

MIN_EXPECTED_EVENTS = 1e-12
"""Expected events per bin below which a bin's Fisher information is computed as if it held this many."""


def scan_q0(tmpl: BinnedTemplate, counts: np.ndarray, bkg: BackgroundFit, signal_fractions, background_shape=None):
    """(N_s-hat, q0) per signal shape: ``held_shape_q0`` at ``background_shape`` where one is given and
    the window holds fewer than ``fitting.SHAPE_FIT_MIN_EVENTS`` events, else ``local_q0``."""
    if background_shape is not None and float(np.sum(counts)) < SHAPE_FIT_MIN_EVENTS:
        return held_shape_q0(tmpl, counts, *background_shape, signal_fractions)
    return local_q0(tmpl, counts, bkg, signal_fractions)


def local_q0(tmpl: BinnedTemplate, counts: np.ndarray, bkg: BackgroundFit, signal_fractions: np.ndarray):
    """(N_s-hat, q0) per signal shape; q0 = 2 (NLL_b - NLL_s+b) if N_s-hat > 0 else 0 (CCGV eq. 12).

    Only the hypotheses with an excess are profiled. At the background-only optimum
    (N_s = 0, nuisances theta-hat-hat) the slope of the profile log-likelihood in N_s is
    the partial score U_s = sum_i s_i (n_i / mu_i - 1) (envelope theorem; the nuisances
    are already optimal), so U_s <= 0 means N_s-hat <= 0 and q0 = 0 exactly, for a
    profile likelihood unimodal in N_s. Rows with U_s > 0 are profiled in full from N_s = 0;
    those that end at N_s <= 0 or do not converge, and the deficits with a cluster of events
    under the signal's shape (where the profile may have a second maximum), are refitted
    from N_s > 0 (see the code). For a deficit the returned N_s-hat is the one-step (score)
    estimate from the background-only optimum, U_s over the Schur complement of the Fisher
    information (<= 0, it only indicates the deficit), unless a refit found a better maximum.
    """
    n = np.asarray(counts, dtype=float)
    s = np.asarray(signal_fractions, dtype=float)
    theta0, mu0, f0, df1_0, df2_0, _ = _background_profile(tmpl, n.tobytes(), (bkg.background_yield, bkg.p1, bkg.p2))
    nll0 = float(_nll(mu0, n)[0])
    mu0, nb0 = mu0[0], theta0[0, 0]
    k = s.shape[0]
    ns = np.zeros(k)
    q0 = np.zeros(k)
    if not (np.isfinite(nll0) and np.all(mu0 > 0)):
        return np.full(k, np.nan), q0
    resid = n / mu0 - 1.0
    jac = np.stack([f0[0], nb0 * df1_0[0], nb0 * df2_0[0]])  # (3, n) nuisances at the background-only fit
    u_b, u_s = portable.matvec(jac, resid), portable.matvec(s, resid)
    # Fisher information from expected counts floored at MIN_EXPECTED_EVENTS: a background fit to
    # a handful of events can put ~1e-320 events in a bin, whose 1/mu overflows; such a bin holds
    # no information either way, and the floor keeps every term finite.
    inv_mu = 1.0 / np.maximum(mu0, MIN_EXPECTED_EVENTS)
    info_bb = portable.matmul(jac * inv_mu, jac.T)
    info_sb = portable.matmul(s * inv_mu, jac.T)  # (K, 3)
    info_ss = np.einsum("kn,kn->k", s * inv_mu, s)
    try:
        solved = portable.solve(info_bb, np.column_stack([u_b, info_sb.T]))
    except np.linalg.LinAlgError:
        solved = portable.matmul(portable.pinv(info_bb), np.column_stack([u_b, info_sb.T]))
    schur = info_ss - np.einsum("kp,pk->k", info_sb, solved[:, 1:])
    with np.errstate(divide="ignore", invalid="ignore"):
        one_step = (u_s - portable.matvec(info_sb, solved[:, 0])) / schur
    ns = np.minimum(one_step, 0.0)
    nll1 = np.full(k, nll0)  # the best s+b NLL found per hypothesis (N_s = 0 until profiled)
    retry = np.zeros(k, dtype=bool)
    excess = np.flatnonzero(u_s > 0)
    if excess.size:
        theta1, mu1, _, _, _, converged = _profile(tmpl, n, theta0[0], s[excess], 25)
        ns[excess] = theta1[:, 3]
        nll1[excess] = np.where(np.isfinite(_nll(mu1, n)), _nll(mu1, n), np.inf)
        retry[excess] = ~(theta1[:, 3] > 0) | ~converged
    # Refit from inside the excess: an excess whose profile ended at N_s <= 0 or did not
    # converge (a wall, or a likelihood far from quadratic, as on a sparse spectrum), and a
    # deficit at N_s = 0 with events over the background where the signal's shape is above the
    # background's (s_i > f_i): on a sparse spectrum with a wide resolution the profile in N_s
    # can have a second maximum at N_s > 0 (a steeper background, the signal taking a cluster
    # of events). Starts: N_s at the one-step estimate and at that excess (at most the events
    # in the window), N_b lowered to keep the total; the lowest minimum is kept.
    core = s > mu0 / nb0
    b_core, n_core = portable.matvec(core.astype(float), mu0), portable.matvec(core.astype(float), n)
    retry |= (u_s <= 0) & (n_core - b_core > np.sqrt(b_core))
    rows = np.flatnonzero(retry)
    if rows.size:  # one batch: every retried row from its core excess, the excesses also one-step
        core_excess = (n_core - b_core)[rows] / np.maximum(np.sum(core[rows] * s[rows], axis=1), 1e-12)
        also = rows[u_s[rows] > 0]
        rows = np.concatenate([rows, also])
        guess = np.concatenate([core_excess, one_step[also]])
        s_rows = s[rows]
        s_sum = s_rows.sum(axis=1)
        cap = np.minimum(n.sum(), 0.5 * nb0 / np.maximum(s_sum, 1e-12))
        ns_start = np.clip(np.nan_to_num(guess, nan=0.0), 1e-3 * np.sqrt(n.sum()), cap)
        starts = np.tile(theta0[0], (rows.size, 1))
        starts[:, 3] = ns_start
        starts[:, 0] = nb0 - ns_start * s_sum
        theta2, mu2, *_ = _profile(tmpl, n, starts, s_rows, RETRY_ITERATIONS, positive=True)
        nll2 = np.where(theta2[:, 3] > 0, _nll(mu2, n), np.inf)  # only a maximum at N_s > 0 is sought
        for part in (slice(0, rows.size - also.size), slice(rows.size - also.size, rows.size)):
            better = nll2[part] < nll1[rows[part]]
            ns[rows[part][better]], nll1[rows[part][better]] = theta2[part][better, 3], nll2[part][better]
    q0 = np.where(ns > 0, np.maximum(2.0 * (nll0 - nll1), 0.0), 0.0)
    return ns, q0


HELD_SHAPE_ITERATIONS = 100
"""Newton iterations of ``held_shape_q0`` (a concave problem in two unknowns: ~5-10 suffice)."""


def held_shape_q0(tmpl: BinnedTemplate, counts: np.ndarray, p1: float, p2: float, signal_fractions: np.ndarray):
    """(N_s-hat, q0) per signal shape with the background's shape held at (p1, p2), N_b and N_s >= 0
    profiled: what ``local_q0`` gives where a window holds too few events to set the shape
    (``fitting.SHAPE_FIT_MIN_EVENTS``). The NLL is convex in (N_b, N_s) (a sum of -n ln(linear)
    and linear terms), so its minimum over the quadrant is one point that every start reaches: a
    projected Newton iteration from the background-only optimum (N_b = the window's events, N_s = 0),
    with Armijo halving. Where the score in N_s points down there, N_s-hat = 0 and q0 = 0 exactly;
    such a row's N_s-hat is returned as the one-step estimate (<= 0), as ``local_q0`` does."""
    n = np.asarray(counts, dtype=float)
    s = np.asarray(signal_fractions, dtype=float)
    k = s.shape[0]
    f = tmpl.background(float(p1), float(p2))[0]
    total = float(np.sum(n))
    mu0 = total * f
    nll0 = float(_nll(mu0, n))
    totals = np.sum(s, axis=1)
    u_s = np.sum(s * (n / mu0), axis=1) - totals  # the score in N_s at N_s = 0
    w0 = n / mu0**2
    h_bb, h_bs, h_ss = np.sum(w0 * f * f), np.sum(w0 * f * s, axis=1), np.sum(w0 * s * s, axis=1)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        one_step = u_s / (h_ss - h_bs * h_bs / h_bb)
    ns = np.where(np.isfinite(one_step), np.minimum(one_step, 0.0), 0.0)
    q0 = np.zeros(k)
    rows = np.flatnonzero(u_s > 0)
    if rows.size:
        x, fval = _convex_minima(n, f, s[rows], totals[rows], total, nll0)
        ns[rows] = x[:, 1]
        q0[rows] = np.where(x[:, 1] > 0, np.maximum(2.0 * (nll0 - fval), 0.0), 0.0)
    return ns, q0


def _convex_minima(n, f, s, signal_totals, nb_start, nll_start):
    """Per row of ``s``, the minimum over N_b, N_s >= 0 of NLL = N_b + N_s signal_total - sum n
    ln(N_b f + N_s s), from (``nb_start``, 0) with NLL ``nll_start``: projected Newton steps (a
    bound held where its gradient points out; the diagonal's steps where the Hessian is singular),
    each row cut by Armijo halving; all rows at once. Returns (x (K, 2), NLL (K,))."""
    k = s.shape[0]
    x = np.zeros((k, 2))
    x[:, 0] = nb_start
    fval = np.full(k, float(nll_start))
    going = np.ones(k, dtype=bool)
    for _ in range(HELD_SHAPE_ITERATIONS):
        rows = np.flatnonzero(going)
        if not rows.size:
            break
        xr, sr = x[rows], s[rows]
        mu = xr[:, :1] * f + xr[:, 1:] * sr
        with np.errstate(divide="ignore", invalid="ignore"):  # mu > 0 wherever n > 0 (the NLL is finite)
            ratio = np.where(n > 0, n / mu, 0.0)
            w = np.where(n > 0, ratio / mu, 0.0)
        g_b, g_s = 1.0 - np.sum(ratio * f, axis=1), signal_totals[rows] - np.sum(ratio * sr, axis=1)
        h_bb, h_bs, h_ss = np.sum(w * f * f, axis=1), np.sum(w * f * sr, axis=1), np.sum(w * sr * sr, axis=1)
        free_b, free_s = ~((xr[:, 0] <= 0.0) & (g_b > 0.0)), ~((xr[:, 1] <= 0.0) & (g_s > 0.0))
        det = h_bb * h_ss - h_bs * h_bs
        newton = free_b & free_s & (det > 1e-12 * h_bb * h_ss)
        with np.errstate(divide="ignore", invalid="ignore"):
            d_b = np.where(
                newton, (h_bs * g_s - h_ss * g_b) / det, np.where(free_b, -g_b / np.maximum(h_bb, 1e-300), 0.0)
            )
            d_s = np.where(
                newton, (h_bs * g_b - h_bb * g_s) / det, np.where(free_s, -g_s / np.maximum(h_ss, 1e-300), 0.0)
            )
        descent = -(g_b * d_b + g_s * d_s)
        stepping = descent > 1e-12
        going[rows[~stepping]] = False
        rows, xr, sr = rows[stepping], xr[stepping], sr[stepping]
        step, descent, fr = np.stack([d_b, d_s], axis=1)[stepping], descent[stepping], fval[rows]
        t = np.ones(rows.size)
        accepted = np.zeros(rows.size, dtype=bool)
        trial, ftrial = xr.copy(), fr.copy()
        for _halving in range(60):
            todo = ~accepted
            if not todo.any():
                break
            candidate = np.maximum(xr[todo] + t[todo, None] * step[todo], 0.0)
            f_candidate = _nll(candidate[:, :1] * f + candidate[:, 1:] * sr[todo], n)
            ok = f_candidate <= fr[todo] - 1e-4 * t[todo] * descent[todo]
            idx = np.flatnonzero(todo)[ok]
            trial[idx], ftrial[idx], accepted[idx] = candidate[ok], f_candidate[ok], True
            t[todo] *= 0.5
        x[rows[accepted]], fval[rows[accepted]] = trial[accepted], ftrial[accepted]
        going[rows[~accepted]] = False  # no step along its direction lowers the NLL
    return x, fval


def resolutions_on_grid(resolution_gev_fn, masses):
    """σ(m) on the grid: one vectorised call when the function takes arrays, else one per mass."""
    try:
        res = np.asarray(resolution_gev_fn(masses), dtype=float)
        if res.shape == masses.shape:
            return res
    except (TypeError, ValueError):
        pass
    return np.array([float(resolution_gev_fn(float(m))) for m in masses])


def find_candidates(mass_grid_gev, z_local, resolutions_gev, z_min: float = 2.0, max_candidates: int = 5):
    """Local maxima of z >= z_min, strongest first, pairwise >= 2 resolutions apart."""
    m = np.asarray(mass_grid_gev, dtype=float)
    z = np.asarray(z_local, dtype=float)
    res = np.asarray(resolutions_gev, dtype=float)
    if z.size == 0:
        return ()
    left = np.concatenate([[-np.inf], z[:-1]])
    right = np.concatenate([z[1:], [-np.inf]])
    peaks = np.flatnonzero((z >= left) & (z >= right) & (z >= z_min))
    chosen: list[int] = []
    for i in peaks[np.argsort(-z[peaks], kind="stable")]:
        if all(abs(m[i] - m[j]) >= 2.0 * max(res[i], res[j]) for j in chosen):
            chosen.append(int(i))
        if len(chosen) == max_candidates:
            break
    return tuple(float(m[i]) for i in chosen)


def scan_local_significance(
    edges,
    counts,
    sqrt_s_tev: float,
    resolution_gev_fn: Callable[[float], float],
    mass_grid_gev,
    background: BackgroundFit | None = None,
    background_shape: tuple[float, float] | None = None,
) -> BumpScan:
    """Local significance Z(m) of a narrow resonance for each mass in ``mass_grid_gev``.

    ``resolution_gev_fn(mass_gev) -> sigma_gev`` (called on the whole grid if it accepts
    arrays, else once per grid point);
    ``background``: a background-only fit of the same histogram, to save refitting it.
    Narrow-width hypothesis; all background parameters profiled at every mass (see
    the module docstring), except over fewer than ``fitting.SHAPE_FIT_MIN_EVENTS`` events with a
    ``background_shape`` (p1, p2: the channel's simulated shape) given: then the shape is held
    there and N_b and N_s profiled (``held_shape_q0``). Candidates: see ``BumpScan``.
    """
    edges, counts = as_counts(edges, counts)
    grid = np.asarray(mass_grid_gev, dtype=float).ravel()
    if grid.size == 0:
        raise ValueError("mass_grid_gev is empty")
    tmpl = template(edges, sqrt_s_tev)
    bkg = background if background is not None else fit_background_on_template(tmpl, counts)
    res = resolutions_on_grid(resolution_gev_fn, grid)
    ns, q0 = scan_q0(tmpl, counts, bkg, gaussian_bin_fractions(tmpl, grid, res), background_shape)
    # A hypothesis whose profile failed numerically (empty high-mass bins) shows no excess.
    z = np.where(np.isfinite(q0), np.sqrt(np.where(np.isfinite(q0), q0, 0.0)), 0.0)
    best = int(np.argmax(z))
    return BumpScan(
        mass_grid_gev=tuple(float(v) for v in grid),
        z_local=tuple(float(v) for v in z),
        best_mass_gev=float(grid[best]),
        best_z_local=float(z[best]),
        candidates_gev=find_candidates(grid, z, res),
        signal_yield=tuple(float(v) for v in ns),
        background=bkg,
    )


def warm_up() -> None:
    """Compile the physics kernels (or load them from numba's cache: a few seconds the first time
    on a machine, then ~0.3 s) on a small spectrum, so that no environment step pays for it: the
    scan's, the compiled fits' (background only) and the cost a Voigt fit calls from Python."""
    edges = np.linspace(100.0, 160.0, 31)
    counts = np.round(400.0 * portable.exp(-0.03 * (edges[:-1] - 100.0)))
    counts[14] += 40.0  # an excess: the signal rows are profiled too
    scan_local_significance(edges, counts, 13.0, lambda m: 0.01 * m, np.linspace(105.0, 155.0, 26))
    fit_signal_plus_background(edges, counts, 13.0, 1.3, 129.0)
