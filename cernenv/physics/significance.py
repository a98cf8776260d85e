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
from scipy.special import log_ndtr, ndtr, ndtri

# The standard normal's tail functions, as scipy.stats.norm computes them (sf(z) = ndtr(-z),
# logsf(z) = log_ndtr(-z), isf(p) = -ndtri(p)) without its per-call argument handling.
_LOG_SQRT_2PI = float(np.log(np.sqrt(2 * np.pi)))

from .fitting import BackgroundFit, _as_counts, _fit_background, _fit_sb, _template, _NS, _M
from .scan import gaussian_bin_fractions, local_q0

_LOG_TINY = -700.0  # below this, exp() would underflow: work with log p


def p_from_z(z):
    """One-sided p-value of a Z-sigma upward fluctuation: p = 1 - Phi(z) (scipy norm.sf)."""
    p = ndtr(-np.asarray(z, dtype=float))
    return float(p) if np.ndim(p) == 0 else p


def _z_from_log_p(log_p: float) -> float:
    """Z with log(1 - Phi(Z)) = log_p; Newton on norm.logsf beyond double-precision p."""
    if log_p > _LOG_TINY:
        return float(-ndtri(np.exp(log_p)))
    z = np.sqrt(-2.0 * log_p)  # start above the root; the iteration converges monotonically
    for _ in range(50):
        f = log_ndtr(-z) - log_p
        dz = f / (-np.exp((-z**2 / 2.0 - _LOG_SQRT_2PI) - log_ndtr(-z)))
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
    effect with ``global_significance``. ``background``: a background-only fit of the
    same histogram to start from (it is refitted if the s+b fit finds a better H0
    minimum). The width is fixed to 0: with a floating
    width (undefined under H0) q0 would not follow the half-chi2 law.
    """
    edges, counts = _as_counts(edges, counts)
    tmpl = _template(edges, sqrt_s_tev)
    res = float(resolution_gev)
    spur = float(spurious_signal_events)
    if spur < 0:
        raise ValueError("spurious_signal_events must be >= 0")
    bkg = background if background is not None else _fit_background(tmpl, counts)
    fix_mass = mass_bounds_gev is None
    starts = [float(mass_gev)]
    if not fix_mass:
        lo, hi = sorted(map(float, mass_bounds_gev))
        starts = [float(np.clip(mass_gev, lo, hi))]
        grid = np.linspace(lo, hi, max(int(np.ceil((hi - lo) / (0.25 * res))) + 1, 2))
        _, q0_scan = local_q0(tmpl, counts, bkg, gaussian_bin_fractions(tmpl, grid, np.full(grid.size, res)))
        m_scan = float(grid[int(np.argmax(q0_scan))])
        if abs(m_scan - starts[0]) > 0.5 * res:
            starts.append(m_scan)
        bounds = (lo, hi)
    else:
        bounds = None
    best = best_cost = None
    for m0 in starts:
        fit, cost = _fit_sb(tmpl, counts, bkg, res, m0, mass_bounds_gev=bounds, fix_mass=fix_mass,
                         max_width_gev=0.0, spurious_events=spur, fit_theta=False)
        if best is None or fit.fval < best.fval:
            best, best_cost = fit, cost
    mu_hat = float(best.values[_NS])
    m_hat = float(best.values[_M])
    nll1 = 0.5 * float(best.fval)
    converged = bool(best.valid and bkg.converged)
    if spur > 0.0:
        h0, _ = _fit_sb(tmpl, counts, bkg, res, m_hat, mass_bounds_gev=None, fix_mass=True,
                        max_width_gev=0.0, spurious_events=spur, fix_signal_zero=True)
        nll0 = 0.5 * float(h0.fval)
        converged = converged and bool(h0.valid)
    else:
        # H0 must be at least as good as the s+b background with N_s set to 0: if not,
        # the background-only fit stopped in a worse local minimum -> refit from there
        par = list(best.values)
        par[_NS] = 0.0
        if 0.5 * best_cost(*par) < bkg.nll - 1e-6:
            p1, p2 = best_cost.shape_params(par[1], par[2])
            refit = _fit_background(tmpl, counts, starts=[(p1, p2)])
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


def global_significance(z_local: float, n_upcrossings_ref: float, z_ref: float = 1.0):
    """Look-elsewhere correction of Gross & Vitells for s = 1 dof and a one-sided q0.

    p_global ~= p_local + N(u0) exp(-(u - u0)/2), u = z_local^2, u0 = z_ref^2, where
    N(u0) is the number of upcrossings of level z_ref by the local-Z scan (observed on
    data or from ``expected_upcrossings``). Computed in log space so large Z are safe.
    Returns (p_global <= 1, z_global in [0, z_local], trials_factor = p_global/p_local).
    """
    z_local = max(float(z_local), 0.0)
    n_up = float(n_upcrossings_ref)
    if n_up < 0:
        raise ValueError("n_upcrossings_ref must be >= 0")
    log_p_local = float(log_ndtr(-z_local))
    if n_up > 0:
        log_term = np.log(n_up) - 0.5 * (z_local**2 - float(z_ref) ** 2)
        log_p_global = float(np.logaddexp(log_p_local, log_term))
    else:
        log_p_global = log_p_local
    log_p_global = min(log_p_global, 0.0)
    p_global = float(np.exp(log_p_global))
    z_global = min(max(_z_from_log_p(log_p_global), 0.0), z_local) if log_p_global < 0 else 0.0
    trials = float(np.exp(log_p_global - log_p_local))
    return p_global, z_global, trials


def expected_upcrossings(window_width_gev: float, resolution_gev: float, z_ref: float = 1.0) -> float:
    """Expected number of upcrossings of level z_ref by the local-Z scan, no toys needed.

    For a narrow Gaussian peak of resolution sigma over a smooth background, the
    signed local significance Z(m) is asymptotically a unit-variance Gaussian process
    with correlation rho(dm) = exp(-dm^2 / (4 sigma^2)) (overlap of two Gaussian
    templates). Rice's formula for upcrossings of level z over a length L gives
        E[N] = L / (2 pi) * sqrt(-rho''(0)) * exp(-z^2/2) = L / (2 sqrt(2) pi sigma) * exp(-u0/2),
    which is the exp(-u0/2) scaling of GV for a chi2 with 1 dof (upcrossings of Z at
    z_ref are upcrossings of q0 at u0 = z_ref^2). ~ 0.11 L/sigma: fewer than the
    naive L/(2 sigma) "independent regions". Neglects binning (sigma_eff^2 = sigma^2
    + bin^2/12), edge effects and the growth of sigma with mass (then use L/sigma ->
    integral of dm/sigma(m)).
    """
    width = float(window_width_gev)
    sigma = float(resolution_gev)
    if width <= 0 or sigma <= 0:
        raise ValueError("window_width_gev and resolution_gev must be > 0")
    return width / (2.0 * np.sqrt(2.0) * np.pi * sigma) * float(np.exp(-0.5 * float(z_ref) ** 2))


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
    z2 = 2.0 * ((s_pos + b_arr) * np.log1p(s_pos / b_arr) - s_pos)
    var = sb_arr**2
    has_unc = var > 0
    if np.any(has_unc):
        v = np.where(has_unc, var, 1.0)
        t1 = (s_pos + b_arr) * np.log((s_pos + b_arr) * (b_arr + v) / (b_arr**2 + (s_pos + b_arr) * v))
        t2 = b_arr**2 / v * np.log1p(v * s_pos / (b_arr * (b_arr + v)))
        z2 = np.where(has_unc, 2.0 * (t1 - t2), z2)
    z = np.sqrt(np.maximum(z2, 0.0))
    return float(z) if z.ndim == 0 else z
