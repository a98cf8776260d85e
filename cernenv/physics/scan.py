"""Fast bump hunt: local significance of a narrow resonance on a grid of mass hypotheses.

No approximation beyond the narrow-width hypothesis (width 0, Gaussian resolution):
one background-only fit, then, for every mass on the grid at once, the full
profile of (N_b, p1, p2, N_s) by Fisher scoring on the exact Poisson likelihood,
vectorised over the grid and started at the background-only fit (the s+b optimum at
fixed mass is a small displacement from it, so 3-5 iterations suffice). Only masses
with an excess are profiled: where the score in N_s at the background-only optimum
points down, N_s-hat <= 0 and q0 = 0 without iterating (``local_q0``); on a sparse
spectrum those deficits, pinned at the bin-positivity boundary, were the slow part.
The result equals ``profile_likelihood_significance`` at fixed mass to ~1e-4
in Z (tested); it is just ~60x cheaper than 60 separate fits. Mass is not fitted
between grid points: use a grid step <= resolution / 2.

q0 and Z follow Cowan, Cranmer, Gross, Vitells, Eur. Phys. J. C71 (2011) 1554,
eq. 12: q0 = -2 ln lambda(0) for N_s-hat > 0, else 0; Z = sqrt(q0).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

from .fitting import BackgroundFit, fit_background_on_template
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
    Voigt is a Gaussian), vectorised over the grid.
    """
    m = np.asarray(mass_gev, dtype=float)[:, None]
    sig = np.maximum(np.asarray(resolution_gev, dtype=float), 1e-6)[:, None]
    dens = np.exp(-0.5 * ((tmpl.nodes[None, :] - m) / sig) ** 2) / (sig * _SQRT2PI)
    return tmpl.simpson(dens)


def _background_grid(tmpl: BinnedTemplate, p1: np.ndarray, p2: np.ndarray):
    """Background fractions f and df/dp1, df/dp2 for K shape-parameter pairs: (K, n_bins) each."""
    phi = p1[:, None] * tmpl.log_1mx[None, :] - p2[:, None] * tmpl.log_x[None, :]
    e = np.exp(phi - phi.max(axis=1, keepdims=True))
    b = tmpl.simpson(e[:, None, :] * tmpl._logs[None, :, :])  # (K, 3, n)
    total = b.sum(axis=2)  # (K, 3)
    f = b[:, 0] / total[:, :1]
    df1 = (b[:, 1] - f * total[:, 1:2]) / total[:, :1]
    df2 = (b[:, 2] - f * total[:, 2:3]) / total[:, :1]
    return f, df1, df2


def _wall_steps(info: np.ndarray, score: np.ndarray, normals: np.ndarray, on_wall: np.ndarray):
    """Fisher-scoring steps that keep the falling-shape constraints: (step (K, P), Newton decrement (K,)).

    ``normals`` (2, P): gradients of the log-log slopes at the window edges (linear constraints
    slope >= floor); ``on_wall`` (K, 2): constraints holding with equality at the start of the step.
    For each subset of the constraints on the wall, the step minimising the quadratic model
    with those held (slope unchanged: the step is projected onto the constraint's face in the
    metric of the information, via its Lagrange multiplier) is computed; of those that do not
    push another constraint on the wall outwards, the one with the largest decrement (the
    lowest quadratic model, -decrement / 2) is taken: the exact minimiser of the model on the
    feasible cone. A constraint off the wall is left to the step-length limit."""
    try:
        free_step = -np.linalg.solve(info, score[..., None])[..., 0]
        inverse = None
    except np.linalg.LinAlgError:
        inverse = np.linalg.pinv(info)
        free_step = -np.einsum("kpq,kq->kp", inverse, score)
    decrement = -np.einsum("kp,kp->k", free_step, score)
    c_step = free_step @ normals.T  # (K, 2)
    need = np.flatnonzero(np.any(on_wall & (c_step < 0.0), axis=1))  # the free step leaves the cone
    if need.size == 0:
        return free_step, decrement
    k, p = need.size, score.shape[1]
    hinv_c = (
        np.linalg.solve(info[need], np.broadcast_to(normals.T, (k, p, 2)))
        if inverse is None
        else inverse[need] @ normals.T
    )  # (k, P, 2)
    m = np.einsum("jp,kpi->kji", normals, hinv_c)  # C H^-1 C^T, (k, 2, 2)
    walls, c_need, score_need, free_need = on_wall[need], c_step[need], score[need], free_step[need]
    # the multipliers of each subset held (the 2 x 2 systems solved in closed form): one wall, the
    # other, both; a subset is possible where its walls are all on
    lam_0 = np.stack([c_need[:, 0] / m[:, 0, 0], np.zeros(need.size)], axis=1)
    lam_1 = np.stack([np.zeros(need.size), c_need[:, 1] / m[:, 1, 1]], axis=1)
    det = m[:, 0, 0] * m[:, 1, 1] - m[:, 0, 1] * m[:, 1, 0]
    lam_both = (
        np.stack(
            [
                m[:, 1, 1] * c_need[:, 0] - m[:, 0, 1] * c_need[:, 1],
                m[:, 0, 0] * c_need[:, 1] - m[:, 1, 0] * c_need[:, 0],
            ],
            axis=1,
        )
        / det[:, None]
    )
    best_step = np.zeros_like(free_need)  # held on both walls without a better choice: no shape move left
    best_dec = np.full(need.size, -np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):  # a singular subset gives NaN and is not taken
        for held, lam, possible in (
            (0, lam_0, walls[:, 0]),
            (1, lam_1, walls[:, 1]),
            (None, lam_both, walls[:, 0] & walls[:, 1]),
        ):
            step = free_need - np.einsum("kpi,ki->kp", hinv_c, lam)
            dec = -np.einsum("kp,kp->k", step, score_need)
            if held is None:  # both held: no other wall to push
                pushes = np.zeros(need.size, dtype=bool)
            else:  # the step must not push the other wall, where the shape is on it, outwards
                pushes = walls[:, 1 - held] & (step @ normals[1 - held] < 0.0)
            better = possible & ~pushes & (dec > best_dec)
            best_step[better], best_dec[better] = step[better], dec[better]
    free_step = free_step.copy()
    free_step[need], decrement[need] = best_step, np.maximum(best_dec, 0.0)
    return free_step, decrement


def _profile(
    tmpl: BinnedTemplate, n: np.ndarray, start: np.ndarray, s: np.ndarray | None, n_iter: int, positive: bool = False
):
    """Fisher scoring of (N_b, p1, p2[, N_s]) from ``start`` ((4,), or (K, 4): one start per row)
    for each row of ``s`` (None: background only, one row). Returns theta (K, 4), mu (K, n),
    f, df/dp1, df/dp2 at theta, and whether each row converged (K,). ``positive``: a row is
    given up (not converged) once its N_s is <= 0 (a search for a maximum at N_s > 0).

    The background stays falling (``likelihood.SHAPE_PENALTY``): the log-log slopes at the window
    edges, linear in (p1, p2), stay >= min(their value at the start, 0) - 1e-9. A step is cut
    where it would cross that floor, and at the floor the constraint is held (``_wall_steps``)."""
    free_signal = s is not None
    s = np.zeros((1, n.size)) if not free_signal else s
    k = s.shape[0]
    theta = np.array(np.broadcast_to(np.asarray(start, dtype=float), (k, 4)))
    if not free_signal:
        theta[:, 3] = 0.0
    n_par = 4 if free_signal else 3
    normals = np.zeros((2, n_par))
    normals[:, 1:3] = tmpl.slope_matrix

    def model(th, rows):
        f, df1, df2 = _background_grid(tmpl, th[:, 1], th[:, 2])
        mu = th[:, :1] * f + th[:, 3:4] * s[rows]
        return mu, f, df1, df2

    def valid(mu):  # positive where there are events, not negative anywhere (0: underflow)
        return (mu > 0) | ((mu == 0) & (n == 0))

    slope_floor = np.minimum(theta[:, 1:3] @ tmpl.slope_matrix.T, 0.0) - 1e-9
    mu, f, df1, df2 = model(theta, np.arange(k))
    active = np.ones(k, dtype=bool)
    given_up = np.zeros(k, dtype=bool)
    for _ in range(n_iter):
        rows = np.flatnonzero(active)  # converged rows are left alone
        if rows.size == 0:
            break
        th, mu_a, f_a, df1_a, df2_a = theta[rows], mu[rows], f[rows], df1[rows], df2[rows]
        jac = np.stack([f_a, th[:, :1] * df1_a, th[:, :1] * df2_a, s[rows]][:n_par], axis=1)  # (K, P, n)
        mu_a = np.maximum(mu_a, 1e-300)  # an empty bin's expectation may underflow to 0 (with its jac)
        score = (jac @ (1.0 - n / mu_a)[:, :, None])[..., 0]
        info = (jac / mu_a[:, None, :]) @ jac.transpose(0, 2, 1)
        gap = th[:, 1:3] @ tmpl.slope_matrix.T - slope_floor[rows]  # distance to the floor, (K, 2)
        on_wall = gap <= 1e-9
        step, decrement = _wall_steps(info, score, normals, on_wall)  # decrement: Newton decrement^2
        # the constraints are linear in (p1, p2): the longest step that keeps those off the wall is exact
        slope_step = step @ normals.T
        with np.errstate(divide="ignore", invalid="ignore"):
            limit = np.where((slope_step < 0) & ~on_wall, -gap / slope_step, np.inf)
        alpha = np.clip(limit.min(axis=1), 0.0, 1.0)
        trial = th.copy()
        trial[:, :n_par] += alpha[:, None] * step
        mu_t, f_t, df1_t, df2_t = model(trial, rows)
        bad = np.flatnonzero(~np.all(valid(mu_t), axis=1))
        for _ in range(30):  # halve until all expectations are valid (only the rows that need it)
            if bad.size == 0:
                break
            alpha[bad] *= 0.5
            trial[bad, :n_par] = th[bad, :n_par] + alpha[bad, None] * step[bad]
            mu_t[bad], f_t[bad], df1_t[bad], df2_t[bad] = model(trial[bad], rows[bad])
            bad = bad[~np.all(valid(mu_t[bad]), axis=1)]
        theta[rows], mu[rows], f[rows], df1[rows], df2[rows] = trial, mu_t, f_t, df1_t, df2_t
        active[rows] = decrement > 1e-7  # NLL within ~5e-8 of its maximum: q0 to ~1e-7
        if positive:
            lost = rows[trial[:, 3] <= 0]
            active[lost], given_up[lost] = False, True
    return theta, mu, f, df1, df2, ~active & ~given_up


def _nll(mu: np.ndarray, n: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):  # a failed row gives NaN: no excess
        return np.sum(mu - np.where(n > 0, n * np.log(mu), 0.0), axis=-1)


def profile_fixed_mass(
    tmpl: BinnedTemplate, counts: np.ndarray, bkg: BackgroundFit, signal_fractions: np.ndarray | None, n_iter: int = 25
):
    """Maximise the Poisson likelihood over (N_b, p1, p2[, N_s]) for K fixed signal shapes.

    Fisher scoring (expected information J diag(1/mu) J^T, positive definite),
    vectorised over the K rows of ``signal_fractions`` (None: background only, one
    row), started at the background-only fit, with step halving that keeps every bin
    expectation positive (N_s may go negative down to that physical boundary).
    Returns (N_s, NLL) per row, NLL = sum(mu - n ln mu) (same constant for all rows).
    """
    n = np.asarray(counts, dtype=float)
    s = None if signal_fractions is None else np.asarray(signal_fractions, dtype=float)
    start = np.array([bkg.background_yield, bkg.p1, bkg.p2, 0.0])
    theta, mu, *_ = _profile(tmpl, n, start, s, n_iter)
    return theta[:, 3], _nll(mu, n)


@lru_cache(maxsize=8)
def _background_profile(tmpl: BinnedTemplate, counts_bytes: bytes, start: tuple):
    """The background-only maximum from a background fit's (N_b, p1, p2), for ``local_q0``:
    computed once per spectrum and fit (the bump scan and the significance both need it);
    read-only arrays."""
    arrays = _profile(tmpl, np.frombuffer(counts_bytes, dtype=float), np.array([*start, 0.0]), None, 25)
    for a in arrays:
        a.setflags(write=False)
    return arrays


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
    u_b, u_s = jac @ resid, s @ resid
    info_bb = (jac / mu0) @ jac.T
    info_sb = (s / mu0) @ jac.T  # (K, 3)
    info_ss = np.einsum("kn,kn->k", s / mu0, s)
    try:
        solved = np.linalg.solve(info_bb, np.column_stack([u_b, info_sb.T]))
    except np.linalg.LinAlgError:
        solved = np.linalg.pinv(info_bb) @ np.column_stack([u_b, info_sb.T])
    schur = info_ss - np.einsum("kp,pk->k", info_sb, solved[:, 1:])
    with np.errstate(divide="ignore", invalid="ignore"):
        one_step = (u_s - info_sb @ solved[:, 0]) / schur
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
    b_core, n_core = core @ mu0, core @ n
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
        theta2, mu2, *_ = _profile(tmpl, n, starts, s_rows, 25, positive=True)
        nll2 = np.where(theta2[:, 3] > 0, _nll(mu2, n), np.inf)  # only a maximum at N_s > 0 is sought
        for part in (slice(0, rows.size - also.size), slice(rows.size - also.size, rows.size)):
            better = nll2[part] < nll1[rows[part]]
            ns[rows[part][better]], nll1[rows[part][better]] = theta2[part][better, 3], nll2[part][better]
    q0 = np.where(ns > 0, np.maximum(2.0 * (nll0 - nll1), 0.0), 0.0)
    return ns, q0


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
) -> BumpScan:
    """Local significance Z(m) of a narrow resonance for each mass in ``mass_grid_gev``.

    ``resolution_gev_fn(mass_gev) -> sigma_gev`` (called on the whole grid if it accepts
    arrays, else once per grid point);
    ``background``: a background-only fit of the same histogram, to save refitting it.
    Narrow-width hypothesis; all background parameters profiled at every mass (see
    the module docstring). Candidates: see ``BumpScan``.
    """
    edges, counts = as_counts(edges, counts)
    grid = np.asarray(mass_grid_gev, dtype=float).ravel()
    if grid.size == 0:
        raise ValueError("mass_grid_gev is empty")
    tmpl = template(edges, sqrt_s_tev)
    bkg = background if background is not None else fit_background_on_template(tmpl, counts)
    res = resolutions_on_grid(resolution_gev_fn, grid)
    ns, q0 = local_q0(tmpl, counts, bkg, gaussian_bin_fractions(tmpl, grid, res))
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
