"""The reference analysis's bookkeeping (`cernenv.analysis`), each rule read from its documentation:
which bins a ±2σ_m window holds, where Rice's region ends and counting begins (`LOW_COUNT_BACKGROUND`:
fewer events are counted, as many or more are not), the cache of a spectrum's regions, what a failed
or negative q0 gives, that a fit handed in is not made again, what `significance` makes when it is not
given it, and when a bump scan's upcrossings replace the expected ones.

The numbers the analysis produces are checked against independent tools in `tests/test_physics.py`
and `tests/test_scan_crosscheck.py`, and its global significance on background-only toys in
`tests/test_lee_calibration.py`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from bench.bench_lee import toy_spectrum
from cernenv import analysis
from cernenv.physics import fitting


@pytest.fixture(autouse=True)
def _fresh_regions():
    """Every test starts and ends with no cached regions (some change the threshold they were made with)."""
    analysis._REGIONS.clear()
    yield
    analysis._REGIONS.clear()


@pytest.fixture(scope="module")
def dense_spectrum():
    """A background-only diphoton spectrum, 105-160 GeV, 40 fb⁻¹ at 13 TeV: thousands of events a window."""
    return toy_spectrum((105.0, 160.0), "diphoton", 13.0, 40.0, 1)


@pytest.fixture(scope="module")
def sparse_tail_spectrum():
    """A background-only dielectron spectrum, 300-900 GeV, 20 fb⁻¹: its high-mass windows expect a few events."""
    return toy_spectrum((300.0, 900.0), "dielectron", 13.0, 20.0, 3)


def _quarter_gev_histogram():
    """25 bins of 1 GeV from 100 GeV, bin j expecting 2**j events (every sum of bins exact and telling which
    bins it holds), and a constant resolution of 0.5 GeV: a ±2σ_m window spans ±1 GeV, so masses on a
    quarter-GeV grid put bin centres exactly on the window's edges."""
    edges = np.arange(100.0, 125.5, 1.0)
    per_bin = 2.0 ** np.arange(25)
    return edges, per_bin, lambda masses: np.full_like(np.asarray(masses, dtype=float), 0.5)


def test_a_window_holds_the_bins_whose_centres_lie_within_two_sigma_its_edges_included():
    edges, per_bin, _ = _quarter_gev_histogram()
    # centres 109.5, 110.5, 111.5 lie within 110.5 ± 1.0, the outer two exactly on its edges: bins 9, 10, 11
    assert analysis._sum_under_peak(per_bin, edges, 110.5, 0.5) == 2.0**9 + 2.0**10 + 2.0**11
    # a window that reaches no centre holds nothing
    assert analysis._sum_under_peak(per_bin, edges, 110.0, 0.2) == 0.0


def test_the_windows_of_rices_region_hold_what_a_window_holds_at_every_mass():
    """The region's cumulative sums give, at every mass of its grid, the sum over the bins whose centres
    lie within ±2σ_m (`_sum_under_peak`), also where a centre lies exactly on a window's edge."""
    edges, per_bin, resolution = _quarter_gev_histogram()
    masses = analysis._region_masses(edges)
    cumulative = np.concatenate([[0.0], np.cumsum(per_bin)])
    windows = analysis._background_in_windows(cumulative, edges, masses, resolution)
    one_by_one = [analysis._sum_under_peak(per_bin, edges, m, 0.5) for m in masses]
    assert windows.tolist() == one_by_one
    centres = 0.5 * (edges[1:] + edges[:-1])
    assert np.isin(masses + 1.0, centres).sum() > 10  # the edge cases are there


@pytest.mark.parametrize("edges", [np.arange(100.0, 125.5, 1.0), np.array([300.0, 301.0, 303.5, 310.0, 322.0, 340.0])])
def test_rices_region_is_decided_on_the_coarsest_grid_of_quarter_bins(edges):
    """From the low edge to the high edge, evenly, the step at most a quarter of the narrowest bin, and
    one point fewer would make it longer."""
    masses = analysis._region_masses(edges)
    quarter = 0.25 * np.min(np.diff(edges))
    assert masses[0] == edges[0] and masses[-1] == edges[-1]
    assert np.allclose(np.diff(masses), np.diff(masses)[0])
    assert np.diff(masses)[0] <= quarter * (1 + 1e-12)
    assert (edges[-1] - edges[0]) / (len(masses) - 2) > quarter


def test_a_spectrums_regions_are_read_only(dense_spectrum):
    """The cached expectation is shared by every later call: nobody may change it."""
    regions = analysis._spectrum_regions(dense_spectrum, analysis.background_fit(dense_spectrum))
    assert not regions.expected.flags.writeable
    with pytest.raises(ValueError):
        regions.expected[0] = 0.0


def test_the_last_few_spectra_and_fits_are_kept_and_the_oldest_dropped(dense_spectrum, monkeypatch):
    monkeypatch.setattr(analysis, "_REGIONS_KEPT", 2)
    fit = analysis.background_fit(dense_spectrum)
    fit_a, fit_b, fit_c = (dataclasses.replace(fit, p1=fit.p1 + shift) for shift in (0.0, 0.3, 0.6))
    first_a = analysis._spectrum_regions(dense_spectrum, fit_a)
    first_b = analysis._spectrum_regions(dense_spectrum, fit_b)
    assert analysis._spectrum_regions(dense_spectrum, fit_a) is first_a  # two kept: both served again
    assert analysis._spectrum_regions(dense_spectrum, fit_b) is first_b
    first_c = analysis._spectrum_regions(dense_spectrum, fit_c)  # the oldest, a, is dropped
    assert analysis._spectrum_regions(dense_spectrum, fit_b) is first_b
    assert analysis._spectrum_regions(dense_spectrum, fit_c) is first_c
    again_a = analysis._spectrum_regions(dense_spectrum, fit_a)
    assert again_a is not first_a
    assert again_a.expected_upcrossings == first_a.expected_upcrossings


def _regions_at_threshold(monkeypatch, spectrum, fit, threshold):
    monkeypatch.setattr(analysis, "LOW_COUNT_BACKGROUND", threshold)
    analysis._REGIONS.clear()
    return analysis._spectrum_regions(spectrum, fit)


def test_a_counting_window_expecting_exactly_the_threshold_is_not_counted(sparse_tail_spectrum, monkeypatch):
    """Windows expecting fewer than `LOW_COUNT_BACKGROUND` events are counted; one expecting exactly as many
    is treated as those expecting more."""
    spectrum = sparse_tail_spectrum
    fit = analysis.background_fit(spectrum)
    expected = analysis.background_expectation(fit, spectrum.edges_gev, spectrum.sqrt_s_tev)
    cumulative = np.concatenate([[0.0], np.cumsum(expected)])
    windows = analysis.counting_windows(spectrum.edges_gev, spectrum.resolution_gev, analysis.PEAK_HALF_WIDTH_SIGMA)
    window_b = cumulative[windows.stop] - cumulative[windows.first]
    level = float(np.sort(window_b)[3])  # a window of the sparse tail; three expect fewer
    at = _regions_at_threshold(monkeypatch, spectrum, fit, level).counting_upcrossings
    below = _regions_at_threshold(monkeypatch, spectrum, fit, math.nextafter(level, -math.inf)).counting_upcrossings
    above = _regions_at_threshold(monkeypatch, spectrum, fit, math.nextafter(level, math.inf)).counting_upcrossings
    assert above > below  # one more window counted
    assert at == below


def test_a_mass_whose_window_expects_exactly_the_threshold_is_in_rices_region(dense_spectrum, monkeypatch):
    """Rice's region holds the masses whose window expects at least `LOW_COUNT_BACKGROUND` events: set the
    threshold to what the window of the grid mass nearest a node expects, and that node counts as it does
    for any lower threshold."""
    spectrum = dense_spectrum
    fit = analysis.background_fit(spectrum)
    edges = spectrum.edges_gev
    expected = analysis.background_expectation(fit, edges, spectrum.sqrt_s_tev)
    masses = analysis._region_masses(edges)
    in_windows = analysis._background_in_windows(
        np.concatenate([[0.0], np.cumsum(expected)]), edges, masses, spectrum.resolution_gev
    )
    node = np.linspace(edges[0], edges[-1], analysis.RICE_NODES)[analysis.RICE_NODES // 2]
    nearest = int(np.argmin(np.abs(masses - node)))
    level = float(in_windows[nearest])
    at = _regions_at_threshold(monkeypatch, spectrum, fit, level).rice_upcrossings
    below = _regions_at_threshold(monkeypatch, spectrum, fit, math.nextafter(level, -math.inf)).rice_upcrossings
    above = _regions_at_threshold(monkeypatch, spectrum, fit, math.nextafter(level, math.inf)).rice_upcrossings
    assert above < below  # the node leaves the region
    assert at == below


def test_a_mass_whose_window_expects_exactly_the_threshold_gets_the_asymptotic_p_value(dense_spectrum, monkeypatch):
    spectrum = dense_spectrum
    fit = analysis.background_fit(spectrum)
    mass = 130.0
    local = analysis.local_significance(spectrum, mass, 0.0, fit)
    regions = analysis._spectrum_regions(spectrum, fit)
    b_peak = analysis._sum_under_peak(regions.expected, spectrum.edges_gev, mass, float(spectrum.resolution_gev(mass)))
    monkeypatch.setattr(analysis, "LOW_COUNT_BACKGROUND", b_peak)
    analysis._REGIONS.clear()
    assert analysis.global_significance(spectrum, mass, local, fit).local_method == "asymptotic"
    monkeypatch.setattr(analysis, "LOW_COUNT_BACKGROUND", math.nextafter(b_peak, math.inf))
    analysis._REGIONS.clear()
    assert analysis.global_significance(spectrum, mass, local, fit).local_method == "poisson_count"


@pytest.mark.parametrize("q0", [math.nan, -1e-9, -math.inf, math.inf])
def test_a_failed_or_negative_q0_reads_as_no_excess(dense_spectrum, q0):
    fit = analysis.background_fit(dense_spectrum)
    measured = analysis.local_significance(dense_spectrum, 130.0, 0.0, fit)
    result = analysis.global_significance(dense_spectrum, 130.0, dataclasses.replace(measured, q0=q0), fit)
    none = analysis.global_significance(dense_spectrum, 130.0, dataclasses.replace(measured, q0=0.0), fit)
    assert result == none
    assert (none.z_local, none.p_local, none.z_global) == (0.0, 0.5, 0.0)  # 1 - Φ(√0): no excess


def test_a_small_positive_q0_is_its_square_root_in_sigma(dense_spectrum):
    """Where the window expects many events the local Z is √q0 (Wilks), below 1σ as above."""
    fit = analysis.background_fit(dense_spectrum)
    local = dataclasses.replace(analysis.local_significance(dense_spectrum, 130.0, 0.0, fit), q0=0.5)
    result = analysis.global_significance(dense_spectrum, 130.0, local, fit)
    assert result.local_method == "asymptotic"
    assert result.z_local == pytest.approx(math.sqrt(0.5), rel=1e-9)


def test_rices_density_is_zero_and_quiet_where_the_template_vanishes(dense_spectrum):
    """A narrow peak hundreds of σ_m outside the spectrum puts nothing in its bins: no upcrossings there,
    and no warning of 0/0 either."""
    fit = analysis.background_fit(dense_spectrum)
    masses = np.array([2000.0, 3000.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        density = analysis.rice_density(dense_spectrum, fit, masses)
    assert density.tolist() == [0.0, 0.0]


def test_a_scan_grid_has_at_least_three_masses():
    grid = analysis.scan_grid(np.array([100.0, 101.0]), 0.4)
    assert len(grid) == 3
    assert grid[0] == pytest.approx(100.4) and grid[-1] == pytest.approx(100.6)


def _count_background_fits(monkeypatch):
    """Counts the background-only fits made from nothing (a fit from given starting shapes is a refinement)."""
    made = []
    real = fitting.fit_background_on_template

    def counted(tmpl, counts, *args, **kwargs):
        if "starts" not in kwargs:
            made.append(1)
        return real(tmpl, counts, *args, **kwargs)

    from cernenv.physics import scan, significance

    for module in (fitting, scan, significance):
        monkeypatch.setattr(module, "fit_background_on_template", counted)
    return made


def test_a_background_fit_handed_in_is_not_made_again(dense_spectrum, monkeypatch):
    fit = analysis.background_fit(dense_spectrum)
    made = _count_background_fits(monkeypatch)
    grid = analysis.scan_grid(dense_spectrum.edges_gev, 1.0)
    analysis.bump_scan(dense_spectrum, grid, fit)
    analysis.local_significance(dense_spectrum, 130.0, 0.0, fit)
    analysis.default_bump_scan(dense_spectrum, fit)
    assert made == []
    analysis.default_bump_scan(dense_spectrum)
    assert len(made) == 1


def test_significance_makes_no_fit_it_is_handed(dense_spectrum, monkeypatch):
    fit = analysis.background_fit(dense_spectrum)
    made = _count_background_fits(monkeypatch)
    analysis.significance(dense_spectrum, 130.0, True, None, fit)
    assert made == []
    analysis.significance(dense_spectrum, 130.0, True)
    assert len(made) == 1


def test_the_default_bump_scan_is_the_scan_at_the_default_step_over_the_whole_spectrum(dense_spectrum):
    fit = analysis.background_fit(dense_spectrum)
    step = analysis.default_scan_step(dense_spectrum)
    assert step == pytest.approx(0.5 * float(dense_spectrum.resolution_gev(132.5)))
    expected = analysis.bump_scan(dense_spectrum, analysis.scan_grid(dense_spectrum.edges_gev, step), fit)
    for scan in (analysis.default_bump_scan(dense_spectrum), analysis.default_bump_scan(dense_spectrum, fit)):
        assert np.array_equal(scan.mass_grid_gev, expected.mass_grid_gev)
        assert np.array_equal(scan.z_local, expected.z_local)


def test_significance_makes_the_fit_and_the_local_significance_it_is_not_given(dense_spectrum):
    """`significance` fits the background and computes the local significance, with the spurious-signal
    systematic or without, when they are not passed: the same result as when they are, and the systematic
    lowers q0 at a mass with an excess."""
    fit = analysis.background_fit(dense_spectrum)
    mass = analysis.default_bump_scan(dense_spectrum, fit).best_mass_gev
    spurious = analysis.spurious_signal_events(dense_spectrum, mass, fit)
    assert spurious > 0
    with_systematics = analysis.local_significance(dense_spectrum, mass, spurious, fit)
    without = analysis.local_significance(dense_spectrum, mass, 0.0, fit)
    assert 0 < with_systematics.q0 < without.q0
    assert analysis.significance(dense_spectrum, mass, True) == analysis.significance(
        dense_spectrum, mass, True, None, fit, with_systematics
    )
    assert analysis.significance(dense_spectrum, mass, False) == analysis.significance(
        dense_spectrum, mass, False, None, fit, without
    )


def test_a_scans_upcrossings_replace_the_expected_ones_only_when_far_more(dense_spectrum):
    """After a bump scan, its count of upcrossings of Z = 1 replaces the expected count where it exceeds it by
    more than two Poisson standard deviations: more trials, a lower global Z. A scan that crosses less leaves
    the expectation."""
    fit = analysis.background_fit(dense_spectrum)
    mass = analysis.default_bump_scan(dense_spectrum, fit).best_mass_gev
    expected_upcrossings = analysis._spectrum_regions(dense_spectrum, fit).expected_upcrossings
    threshold = expected_upcrossings + 2.0 * math.sqrt(expected_upcrossings)
    assert 2.0 < expected_upcrossings and math.floor(threshold) > expected_upcrossings + 1.0  # room on both sides
    crossing = SimpleNamespace(z_local=tuple([0.0, 2.0] * (math.floor(threshold) + 1)))  # just more upcrossings of 1
    quiet = SimpleNamespace(z_local=tuple([0.0, 2.0] * math.floor(threshold)))  # just not
    without_scan = analysis.significance(dense_spectrum, mass, True, None, fit)
    after_crossing = analysis.significance(dense_spectrum, mass, True, crossing, fit)
    after_quiet = analysis.significance(dense_spectrum, mass, True, quiet, fit)
    assert without_scan["upcrossings_source"] == after_quiet["upcrossings_source"] == "analytic"
    assert after_quiet == without_scan
    assert after_crossing["upcrossings_source"] == "scan"
    upcrossings = analysis.global_significance(
        dense_spectrum,
        mass,
        analysis.local_significance(dense_spectrum, mass, 0.0, fit),
        fit,
        np.asarray(crossing.z_local),
    ).upcrossings_z1
    assert upcrossings == math.floor(threshold) + 1
    assert after_crossing["z_local"] == without_scan["z_local"] > 0
    assert after_crossing["trials_factor"] > without_scan["trials_factor"]
    assert after_crossing["z_global"] < without_scan["z_global"]


def test_no_excess_in_a_sparse_window_is_a_local_z_of_zero(sparse_tail_spectrum):
    """Where the window expects fewer than 25 events the local p-value is the counting experiment's: with
    q0 = 0 it is 1 and the local Z 0."""
    fit = analysis.background_fit(sparse_tail_spectrum)
    mass = 850.0
    local = dataclasses.replace(analysis.local_significance(sparse_tail_spectrum, mass, 0.0, fit), q0=0.0)
    result = analysis.global_significance(sparse_tail_spectrum, mass, local, fit)
    assert result.local_method == "poisson_count"
    assert (result.z_local, result.p_local, result.z_global, result.p_global) == (0.0, 1.0, 0.0, 1.0)
