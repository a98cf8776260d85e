"""Discovery significance: profile-likelihood q0, look-elsewhere effect, Asimov sensitivity.

References
----------
CCGV: G. Cowan, K. Cranmer, E. Gross, O. Vitells, "Asymptotic formulae for
    likelihood-based tests of new physics", Eur. Phys. J. C71 (2011) 1554.
GV:   E. Gross, O. Vitells, "Trial factors for the look elsewhere effect in high
    energy physics", Eur. Phys. J. C70 (2010) 525.
Cowan, "Discovery sensitivity for a counting experiment with background
    uncertainty", www.pp.rhul.ac.uk/~cowan/stat/medsig/medsigNote.pdf (2012).
Rice, "Mathematical analysis of random noise", Bell Syst. Tech. J. 23 (1944) 282.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import gammainc, gammaln, log_ndtr, ndtr, ndtri, pdtr

from . import portable
from .fitting import (
    SHAPE_FIT_MIN_EVENTS,
    BackgroundFit,
    background_fit_with_shape,
    fit_background_on_template,
    fit_resonance_on_template,
)
from .likelihood import NB, NS, M, as_counts, template
from .scan import gaussian_bin_fractions, resolutions_on_grid, scan_q0

# The standard normal's tail functions, as scipy.stats.norm computes them (sf(z) = ndtr(-z),
# logsf(z) = log_ndtr(-z), isf(p) = -ndtri(p)) without its per-call argument handling.
_LOG_SQRT_2PI = float(portable.log(np.sqrt(2 * np.pi)))

_LOG_TINY = -700.0  # below this, exp() would underflow: work with log p


def p_from_z(z):
    """One-sided p-value of a Z-sigma upward fluctuation: p = 1 - Phi(z) (scipy norm.sf)."""
    p = ndtr(-np.asarray(z, dtype=float))
    return float(p) if np.ndim(p) == 0 else p


def z_from_log_p(log_p: float) -> float:
    """Z with log(1 - Phi(Z)) = log_p; Newton on norm.logsf beyond double-precision p."""
    if log_p > _LOG_TINY:
        return float(-ndtri(portable.exp(log_p)))
    z = np.sqrt(-2.0 * log_p)  # start above the root; the iteration converges monotonically
    for _ in range(50):
        f = log_ndtr(-z) - log_p
        dz = f / (-portable.exp((-(z**2) / 2.0 - _LOG_SQRT_2PI) - log_ndtr(-z)))
        z -= dz
        if abs(dz) < 1e-12 * z:
            break
    return float(z)


def z_from_p(p):
    """One-sided significance Z = Phi^-1(1 - p) (scipy norm.isf; inf for p = 0)."""
    z = -ndtri(np.asarray(p, dtype=float))
    return float(z) if np.ndim(z) == 0 else z


@dataclass(frozen=True)
class LocalSignificance:
    """Local discovery significance at (the best-fit) mass.

    q0 = 2 (NLL_b(theta-hat-hat) - NLL_s+b(mu-hat, theta-hat)) if mu-hat > 0 else 0
    (CCGV eq. 12); z_local = sqrt(q0) (CCGV eq. 53), p_local = 1 - Phi(z_local).
    """

    mass_gev: float
    q0: float
    z_local: float
    p_local: float
    signal_yield: float
    spurious_signal_events: float
    nll_background: float
    nll_signal_plus_background: float
    converged: bool


def profile_likelihood_significance(
    edges,
    counts,
    sqrt_s_tev: float,
    resolution_gev: float,
    mass_gev: float,
    *,
    spurious_signal_events: float = 0.0,
    mass_bounds_gev: tuple[float, float] | None = None,
    background: BackgroundFit | None = None,
    background_shape: tuple[float, float] | None = None,
) -> LocalSignificance:
    """Profile-likelihood local significance of a narrow resonance (width 0).

    Nuisances: N_b, p1, p2 and, if ``spurious_signal_events`` > 0, theta ~ N(0,1)
    scaling a signal-shaped spurious component (ATLAS, Phys. Lett. B 716 (2012) 1).
    Under s+b the spurious term is degenerate with N_s, so theta-hat = 0 exactly and
    it is fixed there; under H0 theta floats (with the spurious signal at the fitted
    mass) and absorbs part of the excess at a cost theta^2/2: q0 honestly drops.

    Mass: fixed at ``mass_gev`` unless ``mass_bounds_gev`` is given, then floated in
    it (starting from the best of ``mass_gev`` and a fast scan of the bounds); q0 is
    then the local significance at the best mass -- correct for the look-elsewhere
    effect with ``global_significance_from_upcrossings``. With the mass floated, N_s is held >= 0: q0 is
    one-sided (0 wherever N_s-hat <= 0, CCGV eq. 12), so its maximum over the masses is the
    best minimum with N_s > 0, and a deeper deficit within the bounds (a lower NLL at
    N_s < 0) must not hide it; a fit that ends at N_s = 0 while the scan of the bounds shows
    an excess is restarted from the scan's best mass. ``background``: a background-only fit of the
    same histogram to start from (it is refitted if the s+b fit finds a better H0
    minimum). ``background_shape`` (p1, p2: the channel's simulated shape): where the window holds
    fewer than ``fitting.SHAPE_FIT_MIN_EVENTS`` events or the s+b fit leaves fewer to the
    background, both hypotheses hold the background's shape there (nuisance N_b alone), as a
    resonance fit does. The width is fixed to 0: with a floating
    width (undefined under H0) q0 would not follow the half-chi2 law.
    """
    edges, counts = as_counts(edges, counts)
    tmpl = template(edges, sqrt_s_tev)
    res = float(resolution_gev)
    spur = float(spurious_signal_events)
    if spur < 0:
        raise ValueError("spurious_signal_events must be >= 0")
    bkg = background if background is not None else fit_background_on_template(tmpl, counts)
    fix_mass = mass_bounds_gev is None
    starts = [float(mass_gev)]
    m_scan = None
    if not fix_mass:
        lo, hi = sorted(map(float, mass_bounds_gev))
        starts = [float(np.clip(mass_gev, lo, hi))]
        grid = np.linspace(lo, hi, max(int(np.ceil((hi - lo) / (0.25 * res))) + 1, 2))
        signal = gaussian_bin_fractions(tmpl, grid, np.full(grid.size, res))
        _, q0_scan = scan_q0(tmpl, counts, bkg, signal, background_shape)
        if np.nanmax(q0_scan) > 0.0:
            m_scan = float(grid[int(np.nanargmax(q0_scan))])
            if abs(m_scan - starts[0]) > 0.5 * res:
                starts.append(m_scan)
        bounds = (lo, hi)
    else:
        bounds = None

    def fit_from(m0, fit_shape, reference):
        return fit_resonance_on_template(
            tmpl,
            counts,
            reference,
            res,
            m0,
            mass_bounds_gev=bounds,
            fix_mass=fix_mass,
            max_width_gev=0.0,
            spurious_events=spur,
            fit_theta=False,
            signal_yield_min=None if fix_mass else 0.0,
            fit_background_shape=fit_shape,
            shape_after_signal=True,
        )

    def lowest(fit_shape, reference):
        best = best_cost = None
        for m0 in starts:
            fit, cost = fit_from(m0, fit_shape, reference)
            if best is None or fit.fval < best.fval:
                best, best_cost = fit, cost
        if m_scan is not None and not float(best.values[NS]) > 0.0 and m_scan not in starts:
            fit, cost = fit_from(m_scan, fit_shape, reference)  # the start's fit stopped at N_s = 0, next to an excess
            if fit.fval < best.fval:
                best, best_cost = fit, cost
        return best, best_cost

    # the background's shape floats only over enough background events (as a resonance fit's does,
    # `fitting.SHAPE_FIT_MIN_EVENTS`); held, the s+b fit with N_s = 0 is the held background's fit
    held = None if background_shape is None else background_fit_with_shape(tmpl, counts, *background_shape)
    fit_shape = held is None or float(np.sum(counts)) >= SHAPE_FIT_MIN_EVENTS
    reference = bkg if fit_shape else held
    best, best_cost = lowest(fit_shape, reference)
    if fit_shape and held is not None and best.values[NB] < SHAPE_FIT_MIN_EVENTS:
        fit_shape, reference = False, held
        best, best_cost = lowest(fit_shape, reference)
    mu_hat = float(best.values[NS])
    m_hat = float(best.values[M])
    nll1 = 0.5 * float(best.fval)
    converged = bool(best.valid and reference.converged)
    if spur > 0.0:
        h0, _ = fit_resonance_on_template(
            tmpl,
            counts,
            reference,
            res,
            m_hat,
            mass_bounds_gev=None,
            fix_mass=True,
            max_width_gev=0.0,
            spurious_events=spur,
            fix_signal_zero=True,
            fit_background_shape=fit_shape,
        )
        nll0 = 0.5 * float(h0.fval)
        converged = converged and bool(h0.valid)
    elif not fit_shape:
        nll0 = reference.nll  # with the shape held, N_b alone is fitted: no other H0 minimum
    else:
        # H0 must be at least as good as the s+b background with N_s set to 0: if not,
        # the background-only fit stopped in a worse local minimum -> refit from there
        par = list(best.values)
        par[NS] = 0.0
        if 0.5 * best_cost(*par) < bkg.nll - 1e-6:
            p1, p2 = best_cost.shape_params(par[1], par[2])
            refit = fit_background_on_template(tmpl, counts, starts=[(p1, p2)])
            if refit.nll < bkg.nll:
                bkg = refit
        nll0 = bkg.nll
    q0 = max(2.0 * (nll0 - nll1), 0.0) if mu_hat > 0 else 0.0
    z = float(np.sqrt(q0))
    return LocalSignificance(
        mass_gev=m_hat,
        q0=q0,
        z_local=z,
        p_local=p_from_z(z),
        signal_yield=mu_hat,
        spurious_signal_events=spur,
        nll_background=nll0,
        nll_signal_plus_background=nll1,
        converged=converged,
    )


def look_elsewhere(
    log_p_local: float, q0: float, z_local: float, n_upcrossings_ref: float, z_ref: float = 1.0
) -> tuple[float, float]:
    """The look-elsewhere correction of Gross & Vitells for s = 1 dof and a one-sided q0, in log
    space so that large Z are safe: the one implementation of the global significance, which
    the grader's reference analysis (``cernenv.analysis.global_significance``) and
    ``global_significance_from_upcrossings`` both call.

    p_global = p_local + N(u0) exp(-(u - u0)/2), u = q0 the observed test statistic, u0 = z_ref²,
    N(u0) the number of upcrossings of level z_ref by the local-Z scan (observed on data or
    expected). `log_p_local` is the local p-value's log, asymptotic (log(1 - Φ(√q0))) or exact for
    counts; `z_local` its significance, which caps the global one. Returns (log p_global <= 0,
    z_global in [0, z_local]).
    """
    n_up = float(n_upcrossings_ref)
    if n_up < 0:
        raise ValueError("n_upcrossings_ref must be >= 0")
    log_p_global = float(log_p_local)
    if n_up > 0:
        log_term = float(portable.log(n_up)) - 0.5 * (float(q0) - float(z_ref) ** 2)
        log_p_global = float(portable.logaddexp(log_p_global, log_term))
    log_p_global = min(log_p_global, 0.0)
    z_global = min(max(z_from_log_p(log_p_global), 0.0), z_local) if log_p_global < 0 else 0.0
    return log_p_global, z_global


def global_significance_from_upcrossings(z_local: float, n_upcrossings_ref: float, z_ref: float = 1.0):
    """The look-elsewhere correction (``look_elsewhere``) of an asymptotic local significance:
    p_local = 1 - Φ(z_local), u = z_local². Returns (p_global <= 1, z_global in [0, z_local],
    trials_factor = p_global/p_local).
    """
    z_local = max(float(z_local), 0.0)
    log_p_local = float(log_ndtr(-z_local))
    log_p_global, z_global = look_elsewhere(log_p_local, z_local**2, z_local, n_upcrossings_ref, z_ref)
    p_global = float(portable.exp(log_p_global))
    trials = float(portable.exp(log_p_global - log_p_local))
    return p_global, z_global, trials


def upcrossing_density(mass_gev, resolution_gev, bin_width_gev=0.0):
    """Rice density of upcrossings per GeV at level 0, 1 / (2 sqrt(2) pi sigma_eff(m)).

    The signed local significance of a narrow Gaussian peak over a smooth background is
    asymptotically a unit-variance Gaussian process with correlation
    rho(dm) = exp(-dm^2 / (4 sigma^2)) (overlap of two Gaussian templates), so
    sqrt(-rho''(0)) = 1 / (sqrt(2) sigma) and Rice's formula gives this density times
    exp(-z^2/2) for level z. In a histogram the template is the Gaussian convolved with
    the bin (a uniform of variance w^2/12): to leading order in w^2/sigma^2,
    -rho''(0) = 1 / (2 (sigma^2 + w^2/12)), hence sigma_eff^2 = sigma^2 + w^2/12.
    """
    sigma = np.asarray(resolution_gev, dtype=float)
    sigma_eff = np.sqrt(sigma**2 + float(bin_width_gev) ** 2 / 12.0)
    return 1.0 / (2.0 * np.sqrt(2.0) * np.pi * sigma_eff) + 0.0 * np.asarray(mass_gev, dtype=float)


def expected_upcrossings(
    window_width_gev, resolution_gev, z_ref: float = 1.0, *, bin_width_gev: float = 0.0, nodes: int = 401
) -> float:
    """Expected number of upcrossings of level z_ref by the local-Z scan, no toys needed.

    Rice's formula (Rice 1944) for the Gaussian process of ``upcrossing_density``:
        E[N] = exp(-u0/2) / (2 sqrt(2) pi) * integral dm / sigma_eff(m),   u0 = z_ref^2,
    the exp(-u0/2) scaling of GV for a chi2 with 1 dof (upcrossings of Z at z_ref are
    upcrossings of q0 at u0). ``window_width_gev``: the window length L (then
    ``resolution_gev`` is one sigma and the integral is L / sigma_eff), or its mass range
    (lo, hi); ``resolution_gev``: sigma [GeV] or a function sigma(m) (array or scalar
    argument), integrated by the trapezoid rule on ``nodes`` masses. ``bin_width_gev``:
    the histogram's bin width (sigma_eff^2 = sigma^2 + w^2/12). ~ 0.11 L/sigma: fewer
    than the naive L/(2 sigma) "independent regions". Neglects the profiling of the
    background, which removes the template's smooth part and sharpens Z(m): by ~10% in a
    window of 40 sigma, by up to ~70% in one of a few sigma (``cernenv.analysis.rice_density``
    computes the density of the profiled, binned process itself).
    """
    if np.ndim(window_width_gev) == 0:
        lo, hi = 0.0, float(window_width_gev)
        if callable(resolution_gev):
            raise ValueError("a resolution function needs the mass range (lo, hi), not only its width")
    else:
        lo, hi = (float(v) for v in window_width_gev)
    width = hi - lo
    if width <= 0:
        raise ValueError("the window must have a positive width")
    if callable(resolution_gev):
        masses = np.linspace(lo, hi, max(int(nodes), 2))
        sigma = resolutions_on_grid(resolution_gev, masses)
    else:
        masses = np.array([lo, hi])
        sigma = np.full(2, float(resolution_gev))
    if np.any(sigma <= 0):
        raise ValueError("resolution_gev must be > 0")
    density = upcrossing_density(masses, sigma, bin_width_gev)
    integral = float(np.sum(0.5 * (density[1:] + density[:-1]) * np.diff(masses)))
    return integral * float(portable.exp(-0.5 * float(z_ref) ** 2))


# Small counts: the exact Poisson counting scan ------------------------------------------


def log_poisson_tail(n, b):
    """log P(Poisson(b) >= n), elementwise; 0 for n <= 0, -inf for b = 0 < n.

    P(Poisson(b) >= n) is the regularised lower incomplete gamma function P(n, b); where
    that underflows, the leading term b^n e^-b / n! times its first correction is used."""
    n, b = np.broadcast_arrays(np.asarray(n, dtype=float), np.asarray(b, dtype=float))
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = gammainc(np.maximum(n, 1.0), b)
        leading = n * portable.log(b) - b - gammaln(n + 1.0) + portable.log1p(b / (n + 1.0 - np.minimum(b, n)))
        out = np.where(tail > 1e-280, portable.log(tail), leading)
    out = np.where(n <= 0, 0.0, np.where(b <= 0, -np.inf, out))
    return float(out) if out.ndim == 0 else out


@dataclass(frozen=True)
class CountingWindows:
    """Counting windows centred on bins: window j holds the bins first[j] .. stop[j]-1 whose
    centres lie within half_width_sigma * sigma(m_j) of bin j's centre m_j = centre_gev[j].
    Centring on bins makes consecutive windows shifts of one bin (plus a bin where sigma
    grows), so their expected contents, and the count thresholds of one p-value, change
    smoothly along the scan: no spurious re-crossings of a level from edge effects."""

    first: np.ndarray
    stop: np.ndarray
    centre_gev: np.ndarray


def counting_windows(edges, resolution_gev_fn, half_width_sigma: float = 2.0) -> CountingWindows:
    """The ``CountingWindows`` of a histogram with ``edges``, one per bin."""
    edges = np.asarray(edges, dtype=float)
    centres = 0.5 * (edges[1:] + edges[:-1])
    half = half_width_sigma * resolutions_on_grid(resolution_gev_fn, centres)
    first = np.searchsorted(centres, centres - half, side="left")
    stop = np.searchsorted(centres, centres + half, side="right")
    return CountingWindows(first, stop, centres)


def count_thresholds(expected, log_p_level: float) -> np.ndarray:
    """k_j, the smallest count n with P(Poisson(expected_j) >= n) <= exp(log_p_level) < 1, per
    entry (floats). The log tail decreases in n, so k_j is found among the 8 counts from 6 below
    to 1 above the Cornish-Fisher guess ceil(b + z sqrt(b) + (z^2 + 2) / 6) (where k_j is in
    over 99.9% of the windows of heuristic episodes) by one evaluation of the tail, and by
    bisection on the integer count where it is not."""
    big = np.asarray(expected, dtype=float)
    z = z_from_log_p(log_p_level)
    guess = np.ceil(big + z * np.sqrt(big) + (z * z + 2.0) / 6.0)
    counts = np.maximum(guess + np.arange(-6.0, 2.0)[:, None], 0.0)  # (8, n)
    above = log_poisson_tail(counts, big[None, :]) > log_p_level
    found = above[0] & ~above[-1]  # the crossing lies among these counts
    k = counts[np.sum(above, axis=0).clip(max=7), np.arange(big.size)]
    if found.all():
        return k
    rest = np.flatnonzero(~found)
    b = big[rest]
    lo = np.zeros(rest.size)
    hi = np.ceil(b + 10.0 + 10.0 * np.sqrt(b))
    for _ in range(60):
        short = log_poisson_tail(hi, b) > log_p_level
        if not short.any():
            break
        hi = np.where(short, 2.0 * hi, hi)
    while np.any(hi - lo > 1):
        mid = np.floor(0.5 * (lo + hi))
        ok = log_poisson_tail(mid, b) <= log_p_level
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    k[rest] = hi
    return k


def likelihood_ratio_thresholds(expected, level: float) -> np.ndarray:
    """k_j, the smallest count n > expected_j whose counting likelihood ratio
    2 (n ln(n / b) - n + b), b = expected_j, reaches ``level`` (q0 of a count over a known
    background; it increases with n above b), per entry (floats)."""
    b = np.maximum(np.asarray(expected, dtype=float), 1e-300)
    low = np.floor(b) + 1.0  # the smallest count above b

    def short(n):
        return 2.0 * (n * portable.log(n / b) - n + b) < level

    k = np.maximum(low, np.floor(b + np.sqrt(max(level, 0.0) * b)) - 2.0)  # q0 ~ (n - b)^2 / b
    while True:
        back = (k > low) & ~short(np.maximum(k - 1.0, low))
        if not back.any():
            break
        k = np.where(back, k - 1.0, k)
    while True:
        more = short(k)
        if not more.any():
            return k
        k = np.where(more, k + 1.0, k)


def log_p_counting_equivalent(q0: float, background_events: float) -> float:
    """log p of the counting experiment over a known background b whose likelihood ratio is
    ``q0``: p = P(N >= n), N ~ Poisson(b), with n > b solving 2 (n ln(n / b) - n + b) = q0.

    For a count n observed over a known b this is its exact Poisson p-value; for q0 of a fit,
    the exact p-value of the count that shows the same evidence. n is real-valued (the
    regularised incomplete gamma P(n, b), the Poisson tail at integer n, continuous in
    between), so the p-value is a smooth, decreasing function of q0; for large b it tends
    to the asymptotic 1 - Phi(sqrt(q0)) (CCGV), for few events it is larger: sqrt(q0)
    overstates a small count (1 event over b = 0.001: sqrt(q0) = 3.44, exact Z = 3.09).
    Newton's method from above the root (2 (n ln(n/b) - n + b) is convex in n)."""
    u = float(q0)
    if not u > 0.0:
        return 0.0
    b = max(float(background_events), 1e-300)
    n = b + np.sqrt(u * b) + u  # a start above the root, moved away from b until it is
    while 2.0 * (n * portable.log(n / b) - n + b) < u:
        n = b + 2.0 * (n - b)
    for _ in range(100):
        step = (2.0 * (n * portable.log(n / b) - n + b) - u) / (2.0 * portable.log(n / b))
        n -= step
        if step < 1e-12 * n:
            break
    tail = float(gammainc(n, b))
    if tail > 1e-280:
        return float(portable.log(tail))
    return float(n * portable.log(b) - b - gammaln(n + 1.0) + portable.log1p(b / (n + 1.0 - min(b, n))))


def counting_scan_upcrossings(
    expected, windows: CountingWindows, log_p_level: float | None, use=None, thresholds=None
) -> float:
    """Expected number of windows, taken in order, at which the count first reaches its
    threshold k_j, for Poisson bins of mean ``expected``: the thresholds of local p-value
    exp(log_p_level) (``count_thresholds``), or ``thresholds`` given per window (e.g.
    ``likelihood_ratio_thresholds`` of a level of q0).

    The local p-value of window j is P(Poisson(B_j) >= n_j); it is <= p* iff n_j >= k_j,
    the smallest such count. Consecutive windows share bins C, the earlier one alone holds
    A, the later one alone D (independent Poisson counts), so
        P(n_{j-1} < k_{j-1}, n_j >= k_j) = sum_c Pois(c; B_C) P(A < k_{j-1} - c) P(D >= k_j - c),
    and P(some window reaches its level) <= P(the first does) + sum_j of these (the
    upcrossing bound that GV use for the continuous process, here exact for the discrete
    counting process: no asymptotics). ``use``: a mask of the windows to count (default
    all); a window whose predecessor is not used counts P(n_j >= k_j) (it starts a run).
    """
    b = np.asarray(expected, dtype=float)
    cum = np.concatenate([[0.0], np.cumsum(b)])
    first, stop = windows.first, windows.stop
    big = cum[stop] - cum[first]
    used = np.ones(first.size, dtype=bool) if use is None else np.asarray(use, dtype=bool)
    if thresholds is None:
        if not used.any() or log_p_level >= 0.0:
            return float(used.any()) * (1.0 if log_p_level >= 0.0 else 0.0)
        k = count_thresholds(big, log_p_level)
    else:
        if not used.any():
            return 0.0
        k = np.asarray(thresholds, dtype=float)
    rows = np.flatnonzero(used)
    prev = rows - 1
    starts = (prev < 0) | ~used[np.maximum(prev, 0)]
    total = float(np.sum(portable.exp(log_poisson_tail(k[rows[starts]], big[rows[starts]]))))
    rows, prev = rows[~starts], prev[~starts]
    if rows.size:
        c_first = np.maximum(first[rows], first[prev])
        c_stop = np.maximum(np.minimum(stop[rows], stop[prev]), c_first)
        b_c = cum[c_stop] - cum[c_first]
        b_a = np.maximum(big[prev] - b_c, 0.0)
        b_d = np.maximum(big[rows] - b_c, 0.0)
        k_prev, k_now = k[prev], k[rows]
        c = np.arange(int(k_prev.max()))[None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            log_pc = c * portable.log(np.maximum(b_c[:, None], 1e-300)) - b_c[:, None] - gammaln(c + 1.0)
        p_c = np.where(b_c[:, None] > 0, portable.exp(log_pc), (c == 0).astype(float))
        below = k_prev[:, None] - 1 - c  # A <= below
        p_a = np.where(below >= 0, pdtr(np.maximum(below, 0), b_a[:, None]), 0.0)
        p_d = portable.exp(log_poisson_tail(k_now[:, None] - c, b_d[:, None]))
        total += float(np.sum(p_c * p_a * p_d))
    return total


def count_upcrossings(z_scan, z_ref: float = 1.0) -> int:
    """Number of i with z[i-1] < z_ref <= z[i] along a scan (GV's N(u0))."""
    z = np.asarray(z_scan, dtype=float)
    if z.size < 2:
        return 0
    return int(np.count_nonzero((z[:-1] < z_ref) & (z[1:] >= z_ref)))


def asimov_significance(s, b, sigma_b=0.0):
    """Median discovery significance of a counting experiment (Asimov data set).

    sigma_b = 0: Z = sqrt(2 ((s + b) ln(1 + s/b) - s))        (CCGV eq. 97)
    sigma_b > 0 (background known to +- sigma_b from a Poisson side measurement):
        Z = sqrt(2 [(s+b) ln((s+b)(b+sb^2) / (b^2 + (s+b) sb^2))
                    - (b^2/sb^2) ln(1 + sb^2 s / (b (b + sb^2)))])   (Cowan 2012)
    Returns 0 for s <= 0. Array inputs broadcast.
    """
    s_arr, b_arr, sb_arr = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (s, b, sigma_b)))
    if np.any(b_arr <= 0) or np.any(sb_arr < 0):
        raise ValueError("need b > 0 and sigma_b >= 0")
    s_pos = np.maximum(s_arr, 0.0)
    z2 = 2.0 * ((s_pos + b_arr) * portable.log1p(s_pos / b_arr) - s_pos)
    var = sb_arr**2
    has_unc = var > 0
    if np.any(has_unc):
        v = np.where(has_unc, var, 1.0)
        t1 = (s_pos + b_arr) * portable.log((s_pos + b_arr) * (b_arr + v) / (b_arr**2 + (s_pos + b_arr) * v))
        t2 = b_arr**2 / v * portable.log1p(v * s_pos / (b_arr * (b_arr + v)))
        z2 = np.where(has_unc, 2.0 * (t1 - t2), z2)
    z = np.sqrt(np.maximum(z2, 0.0))
    return float(z) if z.ndim == 0 else z
