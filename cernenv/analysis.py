"""The environment's reference analysis of a spectrum, as pure functions of a `Spectrum`.

The environment's actions (`scan_bump`, `estimate_significance`) and its grader call
these, and so do the calibration tests: one code path. No random numbers: every result
is a function of the spectrum.

Local significance. Asymptotic regime: the profile-likelihood q0 of a narrow resonance,
mass floated within ±2σ_m of the requested mass, Z = √q0 (Cowan, Cranmer, Gross, Vitells,
EPJC 71 (2011) 1554). With few events under the peak that law fails (√q0 overstates
small-count excesses), so where the background-only fit expects fewer than
`LOW_COUNT_BACKGROUND` events within ±2σ_m of the mass the local p-value is exact for
counts instead: the on/off problem, with the n_on events counted within ±2σ_m, the n_off
events of the sidebands (the bins farther than 4σ_m) as the background's measurement, and
tau, the sideband-to-window ratio of the fitted background shape, through the Z_Bi
binomial test of Cousins, Linnemann, Tucker, NIM A 595 (2008) 480 (exact given
n_on + n_off; no asymptotics, and it stays right when the sidebands are empty); the
smallest p of the counting windows centred within ±2σ_m of the mass (the mass freedom of the fit).

Global significance (look-elsewhere effect; Gross & Vitells, EPJC 70 (2010) 525):
p_global = p_local + the expected number of upcrossings of the observed local
significance elsewhere in the spectrum. Asymptotic region (masses whose ±2σ_m window
expects >= `LOW_COUNT_BACKGROUND` events): N(u0) e^{-(u-u0)/2} with u = Z_local², u0 = 1,
and N(u0) from Rice's formula for this spectrum's local-Z process (`rice_density`:
binned templates of σ(m), background profiled), or, after a bump scan, the upcrossings
the scan shows there but never fewer than that expectation (a scan is a finite grid and
its fits can fail). Low-count region: the windows' counts are Poisson and their expected
upcrossings are counted exactly (`counting_scan_upcrossings`, with the background-only fit).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np
from scipy.special import betainc, log_ndtr

from cernenv.physics.fitting import BackgroundFit, fit_background_only
from cernenv.physics.scan import BumpScan, resolutions_on_grid, scan_local_significance
from cernenv.physics.shapes import background_bin_fractions
from cernenv.physics.significance import (
    LocalSignificance,
    counting_scan_upcrossings,
    counting_windows,
    profile_likelihood_significance,
    z_from_log_p,
)

SPURIOUS_SIGNAL_STAT_FRACTION = 0.2
"""Spurious-signal systematic: background mismodelling can fake a signal. ATLAS's H→γγ
analysis accepted a background function only if its spurious signal stayed below 20% of
the statistical uncertainty of the fitted signal (PLB 716 (2012) 1, Sect. 5.4); we take
that largest allowed value, 0.2·√B with B the background within ±2σ_m."""

LOW_COUNT_BACKGROUND = 25.0
"""Expected background events within ±2σ_m below which the local p-value is exact for counts
instead of asymptotic (see the module docstring). From 25 events on, √q0 of a counting
experiment is within 0.05 of its exact Z at Z = 3-4, the background fit's statistical
uncertainty under the peak is below 20%, and a bump-scan toy ensemble follows the
asymptotic look-elsewhere correction (tests/test_lee_calibration.py); below, single
events in a falling tail make both the fit and √q0 unreliable."""

PEAK_HALF_WIDTH_SIGMA = 2.0
RICE_NODES = 201  # masses on which the upcrossing density is integrated (trapezoid rule)
Z_REF = 1.0  # level u0 = Z_REF² of the upcrossings counted on a scan (Gross & Vitells)


def background_expectation(fit: BackgroundFit, edges_gev: np.ndarray, sqrt_s_tev: float) -> np.ndarray:
    """Expected background per bin from a background-only fit."""
    return fit.background_yield * background_bin_fractions(edges_gev, sqrt_s_tev, fit.p1, fit.p2)


def background_fit(spectrum) -> BackgroundFit:
    """The background-only fit of the whole spectrum."""
    return fit_background_only(spectrum.edges_gev, spectrum.counts, spectrum.sqrt_s_tev)


def _background_jacobian(tmpl, fit: BackgroundFit):
    """Expected background per bin and its derivatives (3, n_bins) in (N_b, p1, p2), the shape
    derivatives analytic (``BinnedTemplate.background``)."""
    fractions, d_p1, d_p2 = tmpl.background(fit.p1, fit.p2, grad=True)
    mu = fit.background_yield * fractions
    return mu, np.array(
        [mu / max(fit.background_yield, 1e-12), fit.background_yield * d_p1, fit.background_yield * d_p2]
    )


def rice_density(spectrum, fit: BackgroundFit, masses_gev: np.ndarray) -> np.ndarray:
    """Upcrossings per GeV, at level 0, of the asymptotic local-Z process of this spectrum's bump scan.

    Z(m) is the score of the narrow-peak template s(m) (binned Gaussian of σ(m)) made
    orthogonal, in the metric W = diag(1/μ) of the background-only fit, to the profiled
    background directions J = dμ/d(N_b, p1, p2): s⊥ = s - Jᵀ(J W Jᵀ)⁻¹ J W s. Its correlation
    is ρ(m, m') = <s⊥(m), s⊥(m')>_W / (|s⊥(m)| |s⊥(m')|), and Rice's density is
    √λ2 / 2π with λ2 = -∂²ρ = (|s⊥'|²|s⊥|² - <s⊥, s⊥'>²) / |s⊥|⁴ (s⊥' = ∂s⊥/∂m). For fine
    bins, a flat background and no profiling, λ2 = 1/(2σ²): `upcrossing_density`; this form
    also holds for coarse bins, σ(m) and the window edges, where profiling sharpens Z(m)."""
    from cernenv.physics.likelihood import template
    from cernenv.physics.scan import gaussian_bin_fractions

    masses = np.asarray(masses_gev, dtype=float)
    tmpl = template(spectrum.edges_gev, spectrum.sqrt_s_tev)
    sigma = resolutions_on_grid(spectrum.resolution_gev, masses)
    step = 1e-3 * sigma
    sig_up = resolutions_on_grid(spectrum.resolution_gev, masses + step)
    sig_down = resolutions_on_grid(spectrum.resolution_gev, masses - step)
    templ = gaussian_bin_fractions(tmpl, masses, sigma)
    deriv = (
        gaussian_bin_fractions(tmpl, masses + step, sig_up) - gaussian_bin_fractions(tmpl, masses - step, sig_down)
    ) / (2.0 * step[:, None])
    mu, jac = _background_jacobian(tmpl, fit)
    w = 1.0 / np.maximum(mu, 1e-12)
    info = (jac * w) @ jac.T
    proj = np.linalg.pinv(info) @ (jac * w)  # (3, n)
    s_perp = templ - (templ @ proj.T) @ jac
    d_perp = deriv - (deriv @ proj.T) @ jac
    ss = np.einsum("kn,kn->k", s_perp * w, s_perp)
    dd = np.einsum("kn,kn->k", d_perp * w, d_perp)
    sd = np.einsum("kn,kn->k", s_perp * w, d_perp)
    with np.errstate(divide="ignore", invalid="ignore"):
        lam2 = np.where(ss > 0, (dd * ss - sd**2) / ss**2, 0.0)
    return np.sqrt(np.maximum(lam2, 0.0)) / (2.0 * np.pi)


def log_p_on_off(n_on, n_off, tau):
    """log p of n_on counts in a window whose background is measured by n_off counts in
    sidebands that expect tau times as much: the Z_Bi test (Cousins, Linnemann, Tucker,
    NIM A 595 (2008) 480), the binomial tail P(k >= n_on | k ~ Bin(n_on + n_off, 1/(1+tau))),
    which is exact for Poisson counts given their sum: p = I_{1/(1+tau)}(n_on, n_off + 1)."""
    n_on, n_off, tau = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (n_on, n_off, tau)))
    with np.errstate(divide="ignore"):
        p = betainc(np.maximum(n_on, 1.0), n_off + 1.0, 1.0 / (1.0 + np.maximum(tau, 1e-300)))
        out = np.log(np.maximum(p, 1e-300))
    return np.where(n_on <= 0, 0.0, out)


def background_under_peak(spectrum, mass_gev: float, sigma_gev: float, background: BackgroundFit) -> float:
    """Expected background in the bins whose centres lie within ±2σ_m of `mass_gev`."""
    expected = background_expectation(background, spectrum.edges_gev, spectrum.sqrt_s_tev)
    return _sum_under_peak(expected, spectrum.edges_gev, mass_gev, sigma_gev)


def _sum_under_peak(per_bin: np.ndarray, edges_gev: np.ndarray, mass_gev: float, sigma_gev: float) -> float:
    """The sum of `per_bin` over the bins whose centres lie within ±2σ_m of `mass_gev`."""
    centres = 0.5 * (edges_gev[:-1] + edges_gev[1:])
    return float(per_bin[np.abs(centres - mass_gev) <= PEAK_HALF_WIDTH_SIGMA * sigma_gev].sum())


def scan_grid(edges_gev: np.ndarray, step_gev: float) -> np.ndarray:
    """The bump scan's masses: every `step_gev` inside the spectrum, one step from its edges."""
    n_points = int((edges_gev[-1] - edges_gev[0]) / step_gev)
    return np.linspace(edges_gev[0] + step_gev, edges_gev[-1] - step_gev, max(n_points - 1, 3))


def default_scan_step(spectrum) -> float:
    """Half the resolution at the spectrum's centre: a grid that misses no narrow peak."""
    edges = spectrum.edges_gev
    return 0.5 * float(spectrum.resolution_gev(0.5 * (edges[0] + edges[-1])))


def bump_scan(spectrum, grid_gev: np.ndarray, background: BackgroundFit) -> BumpScan:
    """Local significance of a narrow resonance at every mass of `grid_gev` (`scan_local_significance`)."""
    return scan_local_significance(
        spectrum.edges_gev,
        spectrum.counts,
        spectrum.sqrt_s_tev,
        spectrum.resolution_gev,
        grid_gev,
        background=background,
    )


def default_bump_scan(spectrum, background: Optional[BackgroundFit] = None) -> BumpScan:
    """The bump scan `scan_bump` runs with its default step, over the whole spectrum."""
    background = background if background is not None else background_fit(spectrum)
    return bump_scan(spectrum, scan_grid(spectrum.edges_gev, default_scan_step(spectrum)), background)


def spurious_signal_events(spectrum, mass_gev: float, background: BackgroundFit) -> float:
    """The spurious-signal systematic at `mass_gev`: 0.2·√B (see SPURIOUS_SIGNAL_STAT_FRACTION)."""
    sigma = float(spectrum.resolution_gev(mass_gev))
    return SPURIOUS_SIGNAL_STAT_FRACTION * float(np.sqrt(background_under_peak(spectrum, mass_gev, sigma, background)))


def local_significance(
    spectrum, mass_gev: float, spurious_events: float, background: BackgroundFit
) -> LocalSignificance:
    """Profile-likelihood local significance, mass floated within ±2σ_m of `mass_gev`."""
    sigma = float(spectrum.resolution_gev(mass_gev))
    half = PEAK_HALF_WIDTH_SIGMA * sigma
    return profile_likelihood_significance(
        spectrum.edges_gev,
        spectrum.counts,
        spectrum.sqrt_s_tev,
        sigma,
        mass_gev,
        spurious_signal_events=spurious_events,
        mass_bounds_gev=(mass_gev - half, mass_gev + half),
        background=background,
    )


@dataclass(frozen=True)
class GlobalSignificance:
    """Local and global significance at one mass (see the module docstring)."""

    z_local: float
    p_local: float
    local_method: str  # "asymptotic" or "poisson_count"
    z_global: float
    p_global: float
    trials_factor: float
    upcrossings_z1: float  # N(u0) used in the asymptotic region (0 when it is empty)
    upcrossings_source: str  # "scan" or "analytic"


@dataclass(frozen=True)
class _SpectrumRegions:
    """What `global_significance` needs of a spectrum and its background-only fit at any mass
    (read-only arrays): the expected background per bin and its cumulative sum, the counting
    windows and which are sparse, the fine mass grid and which of its masses are in the
    asymptotic region, and there Rice's expected upcrossings of Z_REF."""

    expected: np.ndarray
    cumulative: np.ndarray
    windows: Any  # CountingWindows
    sparse: np.ndarray
    masses_gev: np.ndarray
    dense: np.ndarray
    rice_upcrossings: float


_REGIONS: "OrderedDict[tuple, _SpectrumRegions]" = OrderedDict()
_REGIONS_KEPT = 8
_REGIONS_LOCK = threading.Lock()  # environments may run in threads


def _spectrum_regions(spectrum, background: BackgroundFit) -> _SpectrumRegions:
    """`_SpectrumRegions` of `spectrum` and `background`, computed once for the last few
    (spectrum, fit) pairs: an episode asks for the significance of one spectrum at several
    masses, and the grader again."""
    key = (spectrum.fit_key, background)
    with _REGIONS_LOCK:
        if key in _REGIONS:
            _REGIONS.move_to_end(key)
            return _REGIONS[key]
    edges = spectrum.edges_gev
    expected = background_expectation(background, edges, spectrum.sqrt_s_tev)
    cum = np.concatenate([[0.0], np.cumsum(expected)])
    windows = counting_windows(edges, spectrum.resolution_gev, PEAK_HALF_WIDTH_SIGMA)
    window_b = cum[windows.stop] - cum[windows.first]
    # asymptotic region: masses whose ±2σ_m window holds >= LOW_COUNT_BACKGROUND events
    step = 0.25 * float(np.min(np.diff(edges)))
    masses = np.linspace(edges[0], edges[-1], int(np.ceil((edges[-1] - edges[0]) / step)) + 1)
    res = resolutions_on_grid(spectrum.resolution_gev, masses)
    centres = 0.5 * (edges[1:] + edges[:-1])
    b_at = (
        cum[np.searchsorted(centres, masses + PEAK_HALF_WIDTH_SIGMA * res, side="right")]
        - cum[np.searchsorted(centres, masses - PEAK_HALF_WIDTH_SIGMA * res, side="left")]
    )
    dense = b_at >= LOW_COUNT_BACKGROUND
    nodes = np.linspace(edges[0], edges[-1], RICE_NODES)
    node_dense = np.interp(nodes, masses, dense.astype(float)) > 0.5
    density = np.where(node_dense, rice_density(spectrum, background, nodes), 0.0) if node_dense.any() else 0.0 * nodes
    n_ref = float(np.sum(0.5 * (density[1:] + density[:-1]) * np.diff(nodes))) * float(np.exp(-0.5 * Z_REF**2))
    regions = _SpectrumRegions(expected, cum, windows, window_b < LOW_COUNT_BACKGROUND, masses, dense, n_ref)
    for array in (expected, cum, regions.sparse, masses, dense):
        array.setflags(write=False)
    with _REGIONS_LOCK:
        _REGIONS[key] = regions
        while len(_REGIONS) > _REGIONS_KEPT:
            _REGIONS.popitem(last=False)
    return regions


def global_significance(
    spectrum,
    mass_gev: float,
    local: LocalSignificance,
    background: BackgroundFit,
    scan_z: Optional[np.ndarray] = None,
    scan_grid_gev: Optional[np.ndarray] = None,
) -> GlobalSignificance:
    """Local and look-elsewhere-corrected significance at `mass_gev` given its profile-likelihood
    `local` significance; `scan_z` (with its `scan_grid_gev`) from a bump scan of the same
    spectrum, else the analytic upcrossing count."""
    edges, counts = spectrum.edges_gev, np.asarray(spectrum.counts, dtype=float)
    regions = _spectrum_regions(spectrum, background)
    expected, cum, windows, sparse = regions.expected, regions.cumulative, regions.windows, regions.sparse

    sigma = float(spectrum.resolution_gev(mass_gev))
    if _sum_under_peak(expected, edges, mass_gev, sigma) < LOW_COUNT_BACKGROUND:  # background under the peak
        count_cum = np.concatenate([[0.0], np.cumsum(counts)])
        half = PEAK_HALF_WIDTH_SIGMA * sigma
        near = np.abs(windows.centre_gev - mass_gev) <= half
        n_on = count_cum[windows.stop[near]] - count_cum[windows.first[near]]
        sidebands = np.abs(0.5 * (edges[1:] + edges[:-1]) - mass_gev) > 2.0 * half
        n_off = float(counts[sidebands].sum())
        b_on = np.maximum(cum[windows.stop[near]] - cum[windows.first[near]], 1e-300)
        tau = float(expected[sidebands].sum()) / b_on  # sideband-to-window ratio of the background shape
        log_p_local = float(np.min(log_p_on_off(n_on, n_off, tau))) if near.any() else 0.0
        method = "poisson_count"
    else:
        log_p_local = float(log_ndtr(-max(local.z_local, 0.0)))
        method = "asymptotic"
    z_local = max(z_from_log_p(log_p_local), 0.0) if log_p_local < 0 else 0.0

    masses, dense, n_ref = regions.masses_gev, regions.dense, regions.rice_upcrossings
    source = "analytic"
    if scan_z is not None and scan_grid_gev is not None and n_ref > 0:
        z = np.asarray(scan_z, dtype=float)
        grid = np.asarray(scan_grid_gev, dtype=float)
        grid_dense = np.interp(grid, masses, dense.astype(float)) > 0.5
        ups = (z[:-1] < Z_REF) & (z[1:] >= Z_REF) & grid_dense[:-1] & grid_dense[1:]
        n_ref = max(float(np.count_nonzero(ups)), n_ref)
        source = "scan"
    log_terms = [log_p_local]
    if n_ref > 0:
        log_terms.append(float(np.log(n_ref)) - 0.5 * (z_local**2 - Z_REF**2))
    if sparse.any():
        if log_p_local > -600.0:
            ups_sparse = counting_scan_upcrossings(expected, windows, log_p_local, use=sparse)
            if ups_sparse > 0:
                log_terms.append(float(np.log(ups_sparse)))
        else:  # beyond double precision: Bonferroni over the windows
            log_terms.append(log_p_local + float(np.log(np.count_nonzero(sparse))))
    log_p_global = min(float(np.logaddexp.reduce(log_terms)), 0.0)
    z_global = min(max(z_from_log_p(log_p_global), 0.0), z_local) if log_p_global < 0 else 0.0
    return GlobalSignificance(
        z_local=z_local,
        p_local=float(np.exp(log_p_local)),
        local_method=method,
        z_global=z_global,
        p_global=float(np.exp(log_p_global)),
        trials_factor=float(np.exp(log_p_global - log_p_local)),
        upcrossings_z1=n_ref,
        upcrossings_source=source,
    )


def significance(
    spectrum,
    mass_gev: float,
    with_systematics: bool,
    scan: Optional[BumpScan] = None,
    background: Optional[BackgroundFit] = None,
    local: Optional[LocalSignificance] = None,
) -> Dict[str, Any]:
    """What `estimate_significance` reports at `mass_gev` (and what the grader uses, with
    systematics and without a scan). `background` and `local` may be passed when already
    computed (they must be `background_fit(spectrum)` and `local_significance(...)` with the
    spurious signal of `with_systematics`)."""
    background = background if background is not None else background_fit(spectrum)
    if local is None:
        spurious = spurious_signal_events(spectrum, mass_gev, background) if with_systematics else 0.0
        local = local_significance(spectrum, mass_gev, spurious, background)
    result = global_significance(
        spectrum,
        mass_gev,
        local,
        background,
        scan_z=None if scan is None else np.asarray(scan.z_local),
        scan_grid_gev=None if scan is None else np.asarray(scan.mass_grid_gev),
    )
    return {
        "q0": local.q0,
        "z_local": result.z_local,
        "p_local": result.p_local,
        "local_p_method": result.local_method,
        "z_global": result.z_global,
        "p_global": result.p_global,
        "trials_factor": result.trials_factor,
        "upcrossings_source": result.upcrossings_source,
    }
