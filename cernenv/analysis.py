"""The environment's reference analysis of a spectrum, as pure functions of a `Spectrum`.

The environment's actions (`scan_bump`, `estimate_significance`) and its grader call
these, and so do the calibration tests: one code path. No random numbers: every result
is a function of the spectrum.

Test statistic: the profile-likelihood q0 of a narrow resonance (width 0, Gaussian
resolution σ_m, the background's normalisation and shape profiled), with the mass floated
within ±2σ_m of the requested mass (Cowan, Cranmer, Gross, Vitells, EPJC 71 (2011) 1554);
the bump scan shows √q0 along the window and its best mass.

Local p-value. Where the background-only fit expects >= `LOW_COUNT_BACKGROUND` events
within ±2σ_m of the mass, the asymptotic 1 - Φ(√q0). With fewer, √q0 overstates small-count
excesses, and the local p-value is exact for counts instead: that of the counting
experiment with the same likelihood ratio, P(N >= n) for N ~ Poisson(b), b the background-
only expectation within ±2σ_m and n solving 2 (n ln(n/b) - n + b) = q0
(`log_p_counting_equivalent`; for an observed count over a known background, its exact
Poisson p-value).

Global significance (look-elsewhere effect; Gross & Vitells, EPJC 70 (2010) 525): the
probability that the scan's maximum of q0 over the window reaches the observed u = q0,
p_global = p_local + N(u0) e^{-(u - u0)/2}, with N(u0) the expected number of upcrossings of
the level u0 = Z_REF² = 1 by √q0 along the window under the background-only fit, computed
once per spectrum and fit (`cernenv.physics.significance.look_elsewhere`: the formula's one
implementation, which the physics module's `global_significance_from_upcrossings` calls too).
Where the window around a mass expects >= `LOW_COUNT_BACKGROUND` events the process is
Gaussian and N(u0) is Rice's formula (`rice_density`: binned templates of σ(m), background
profiled). Where it expects fewer, the process is a few
Poisson counts, flat at 0 between isolated events, with fewer upcrossings than a Gaussian
process of the same correlation; there N(u0) is the exact expectation of the upcrossings of
u0 by the counting windows (`counting_scan_upcrossings`, at the counts whose likelihood
ratio over the fitted background reaches u0). The counts are taken at the level u0, where
the fit barely follows them, and GV's χ² law carries them to u: at the observed level the
background fit (three parameters, few events) follows an excess in a sparse tail as the
profiling in q0 does, and a count over the fitted background taken as known does not, so
it would overstate p_global. After a bump scan, the upcrossings the scan shows (GV's
data-driven N(u0)) replace the expectation where they exceed it by more than two Poisson
standard deviations: the background model then misses structure that the scan sees.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Optional

import numpy as np
from scipy.special import log_ndtr

from cernenv.detector import CHANNELS
from cernenv.physics import portable
from cernenv.physics.fitting import BackgroundFit, fit_background_only
from cernenv.physics.scan import BumpScan, resolutions_on_grid, scan_local_significance
from cernenv.physics.shapes import background_bin_fractions
from cernenv.physics.significance import (
    LocalSignificance,
    count_upcrossings,
    counting_scan_upcrossings,
    counting_windows,
    likelihood_ratio_thresholds,
    log_p_counting_equivalent,
    look_elsewhere,
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
instead of asymptotic, and the expected upcrossings are counted instead of taken from Rice's
formula (see the module docstring). From 25 events on, √q0 of a counting experiment is
within 0.05 of its exact Z at Z = 3-4 and the local-Z process of the scan is close to
Gaussian (its upcrossings follow Rice's formula); below, single events in a falling tail
make both √q0 and Rice's count overstate."""

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
    info = portable.matmul(jac * w, jac.T)
    proj = portable.matmul(portable.pinv(info), jac * w)  # (3, n)
    s_perp = templ - portable.matmul(portable.matmul(templ, proj.T), jac)
    d_perp = deriv - portable.matmul(portable.matmul(deriv, proj.T), jac)
    ss = np.einsum("kn,kn->k", s_perp * w, s_perp)
    dd = np.einsum("kn,kn->k", d_perp * w, d_perp)
    sd = np.einsum("kn,kn->k", s_perp * w, d_perp)
    with np.errstate(divide="ignore", invalid="ignore"):
        lam2 = np.where(ss > 0, (dd * ss - sd**2) / ss**2, 0.0)
    return np.sqrt(np.maximum(lam2, 0.0)) / (2.0 * np.pi)


def background_under_peak(spectrum, mass_gev: float, sigma_gev: float, background: BackgroundFit) -> float:
    """Expected background in the bins whose centres lie within ±2σ_m of `mass_gev`."""
    expected = background_expectation(background, spectrum.edges_gev, spectrum.sqrt_s_tev)
    return _sum_under_peak(expected, spectrum.edges_gev, mass_gev, sigma_gev)


def _sum_under_peak(per_bin: np.ndarray, edges_gev: np.ndarray, mass_gev: float, sigma_gev: float) -> float:
    """The sum of `per_bin` over the bins whose centres lie within ±2σ_m of `mass_gev`."""
    centres = 0.5 * (edges_gev[:-1] + edges_gev[1:])
    return float(per_bin[np.abs(centres - mass_gev) <= PEAK_HALF_WIDTH_SIGMA * sigma_gev].sum())


def scan_grid(edges_gev: np.ndarray, step_gev: float) -> np.ndarray:
    """The bump scan's masses: evenly spaced about `step_gev` apart inside the spectrum, one step
    from its edges, and at least three of them."""
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
        background_shape=simulated_background_shape(spectrum),
    )


def default_bump_scan(spectrum, background: Optional[BackgroundFit] = None) -> BumpScan:
    """The bump scan `scan_bump` runs with its default step, over the whole spectrum."""
    background = background if background is not None else background_fit(spectrum)
    return bump_scan(spectrum, scan_grid(spectrum.edges_gev, default_scan_step(spectrum)), background)


def spurious_signal_events(spectrum, mass_gev: float, background: BackgroundFit) -> float:
    """The spurious-signal systematic at `mass_gev`: 0.2·√B (see SPURIOUS_SIGNAL_STAT_FRACTION)."""
    sigma = float(spectrum.resolution_gev(mass_gev))
    return SPURIOUS_SIGNAL_STAT_FRACTION * float(np.sqrt(background_under_peak(spectrum, mass_gev, sigma, background)))


def simulated_background_shape(spectrum) -> tuple[float, float]:
    """The dijet shape (p1, p2) the channel's simulation gives its background: what a fit holds the
    shape at where a window has too few events to set it (`fitting.SHAPE_FIT_MIN_EVENTS`)."""
    channel = CHANNELS[spectrum.channel]
    return channel.background_p1, channel.background_p2


def local_significance(
    spectrum, mass_gev: float, spurious_events: float, background: BackgroundFit
) -> LocalSignificance:
    """Profile-likelihood local significance, mass floated within ±2σ_m of `mass_gev` (the shape
    held at `simulated_background_shape` under few events)."""
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
        background_shape=simulated_background_shape(spectrum),
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
    upcrossings_z1: float  # N(u0), the upcrossings of Z_REF the global p-value used
    upcrossings_source: str  # "scan" (the scan's own count) or "analytic" (the expectation)


@dataclass(frozen=True)
class _SpectrumRegions:
    """What `global_significance` needs of a spectrum and its background-only fit at any mass:
    the expected background per bin (read-only), and the expected upcrossings of Z_REF along
    the window, by Rice's formula where it expects >= LOW_COUNT_BACKGROUND events within
    ±2σ_m and counted exactly over the counting windows where it expects fewer."""

    expected: np.ndarray
    rice_upcrossings: float
    counting_upcrossings: float

    @property
    def expected_upcrossings(self) -> float:
        return self.rice_upcrossings + self.counting_upcrossings


_REGIONS: "OrderedDict[tuple, _SpectrumRegions]" = OrderedDict()
_REGIONS_KEPT = 8
_REGIONS_LOCK = threading.Lock()  # environments may run in threads


def _region_masses(edges_gev: np.ndarray) -> np.ndarray:
    """The masses on which Rice's region is decided: the coarsest even grid from the spectrum's
    low edge to its high edge whose step is at most a quarter of its narrowest bin."""
    step = 0.25 * float(np.min(np.diff(edges_gev)))
    return np.linspace(edges_gev[0], edges_gev[-1], int(np.ceil((edges_gev[-1] - edges_gev[0]) / step)) + 1)


def _background_in_windows(
    cumulative: np.ndarray, edges_gev: np.ndarray, masses_gev: np.ndarray, resolution_gev
) -> np.ndarray:
    """`_sum_under_peak` of the per-bin expectation at every mass of `masses_gev` at once, from
    `cumulative` (0 followed by the running sum of the expectation per bin)."""
    half = PEAK_HALF_WIDTH_SIGMA * resolutions_on_grid(resolution_gev, masses_gev)
    centres = 0.5 * (edges_gev[1:] + edges_gev[:-1])
    return (
        cumulative[np.searchsorted(centres, masses_gev + half, side="right")]
        - cumulative[np.searchsorted(centres, masses_gev - half, side="left")]
    )


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
    # Rice's region: masses whose ±2σ_m window holds >= LOW_COUNT_BACKGROUND events
    masses = _region_masses(edges)
    b_at = _background_in_windows(cum, edges, masses, spectrum.resolution_gev)
    nodes = np.linspace(edges[0], edges[-1], RICE_NODES)
    node_dense = np.interp(nodes, masses, (b_at >= LOW_COUNT_BACKGROUND).astype(float)) > 0.5
    density = np.where(node_dense, rice_density(spectrum, background, nodes), 0.0) if node_dense.any() else 0.0 * nodes
    rice = float(np.sum(0.5 * (density[1:] + density[:-1]) * np.diff(nodes))) * float(portable.exp(-0.5 * Z_REF**2))
    # the counting region: windows (one per bin) that expect fewer events
    windows = counting_windows(edges, spectrum.resolution_gev, PEAK_HALF_WIDTH_SIGMA)
    window_b = cum[windows.stop] - cum[windows.first]
    sparse = window_b < LOW_COUNT_BACKGROUND
    counted = 0.0
    if sparse.any():
        thresholds = likelihood_ratio_thresholds(window_b, Z_REF**2)
        counted = counting_scan_upcrossings(expected, windows, None, use=sparse, thresholds=thresholds)
    expected.setflags(write=False)
    regions = _SpectrumRegions(expected, rice, float(counted))
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
) -> GlobalSignificance:
    """Local and look-elsewhere-corrected significance at `mass_gev` given its profile-likelihood
    `local` significance (see the module docstring); `scan_z`, the local Z of a bump scan of the
    same spectrum in the order of its masses (its count of upcrossings replaces the expected one
    where it exceeds it by more than two Poisson standard deviations)."""
    regions = _spectrum_regions(spectrum, background)
    sigma = float(spectrum.resolution_gev(mass_gev))
    u = float(local.q0) if np.isfinite(local.q0) and local.q0 > 0.0 else 0.0  # a failed fit shows no excess
    b_peak = _sum_under_peak(regions.expected, spectrum.edges_gev, mass_gev, sigma)
    if b_peak < LOW_COUNT_BACKGROUND:
        log_p_local = min(log_p_counting_equivalent(u, b_peak), 0.0)
        method = "poisson_count"
    else:
        log_p_local = float(log_ndtr(-np.sqrt(u)))
        method = "asymptotic"
    z_local = max(z_from_log_p(log_p_local), 0.0) if log_p_local < 0 else 0.0

    n_ref = regions.expected_upcrossings
    source = "analytic"
    if scan_z is not None:
        n_scan = float(count_upcrossings(scan_z, Z_REF))
        if n_scan > n_ref + 2.0 * np.sqrt(n_ref):
            n_ref, source = n_scan, "scan"
    log_p_global, z_global = look_elsewhere(log_p_local, u, z_local, n_ref, Z_REF)
    return GlobalSignificance(
        z_local=z_local,
        p_local=float(portable.exp(log_p_local)),
        local_method=method,
        z_global=z_global,
        p_global=float(portable.exp(log_p_global)),
        trials_factor=float(portable.exp(log_p_global - log_p_local)),
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
