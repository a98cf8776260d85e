"""Calibration of the environment's global significance on background-only data.

The toys and the analysis are `bench/bench_lee.py`'s (`make bench-lee`): background-only
spectra of every null configuration (the curated null scenarios' channels, every procedural
configuration's channels with the particle removed), recorded as the environment records
them in the analysis states agents use (calibrated once or twice, standard or tight
reconstruction, the whole luminosity cap or 40% of it), histogrammed with the environment's
default binning; analysed as the environment analyses them (`cernenv.analysis`, the code its
actions and grader call): background fit, default bump scan, and at the scan's best mass
(a) `estimate_significance`'s global Z after the scan, (b) the grader's path without the
spurious-signal systematic, (c) the grader's call with it.

Under the null the fraction of toys with global Z >= 2 (>= 3) must be 1 - Phi(2) = 2.28%
(1 - Phi(3) = 0.135%): a check asks that the Clopper-Pearson interval of the observed
fraction contain it, or for (c), which is conservative by design, that its lower end not
exceed it. The checks of one test are Bonferroni-corrected (95% for all of them together).
The suite draws 600 toys per channel family; `make bench-lee` runs the same checks on 2,000 per
family (24 of them) and exits 1 if one fails. Toy seeds are fixed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from scipy.stats import binomtest, norm, poisson

from bench import bench_lee
from bench.bench_lee import toy_spectrum
from cernenv import analysis

LIGHT_TOYS_PER_FAMILY = 600


def test_the_significance_of_a_spectrum_is_the_same_with_its_regions_cached(monkeypatch):
    """`analysis.global_significance` keeps the mass-independent part of the last few spectra
    and fits (`_spectrum_regions`): whatever was computed before, every significance equals the
    one computed from nothing, and another fit of the same spectrum is not served another's."""
    spectra = [toy_spectrum((105.0, 160.0), "diphoton", 13.0, 40.0, seed) for seed in (1, 2)]
    spectra.append(toy_spectrum((300.0, 900.0), "dielectron", 13.0, 20.0, 3))
    work = [(spectrum, mass) for spectrum in spectra for mass in np.linspace(*spectrum.edges_gev[[5, -5]], 3)]
    fits = {id(spectrum): analysis.background_fit(spectrum) for spectrum in spectra}

    def one(spectrum, mass, background):
        return analysis.significance(spectrum, mass, True, None, background)

    monkeypatch.setattr(analysis, "_REGIONS_KEPT", 2)  # the first spectrum's regions are dropped and made again
    warm = [one(spectrum, mass, fits[id(spectrum)]) for spectrum, mass in work + work[::-1]]
    cold = []
    for spectrum, mass in work + work[::-1]:
        analysis._REGIONS.clear()
        cold.append(one(spectrum, mass, fits[id(spectrum)]))
    assert warm == cold
    assert len(analysis._REGIONS) <= 2
    assert analysis._spectrum_regions(spectra[2], fits[id(spectra[2])]).counting_upcrossings > 0  # a sparse tail
    spectrum, mass = work[0]
    other_fit = dataclasses.replace(fits[id(spectrum)], p1=fits[id(spectrum)].p1 + 0.5)
    analysis._REGIONS.clear()
    alone = analysis._spectrum_regions(spectrum, other_fit).expected_upcrossings
    one(spectrum, mass, fits[id(spectrum)])
    assert analysis._spectrum_regions(spectrum, other_fit).expected_upcrossings == alone
    assert alone != analysis._spectrum_regions(spectrum, fits[id(spectrum)]).expected_upcrossings


def _check(label, k, n, z, confidence, two_sided=True):
    nominal = float(norm.sf(z))
    interval = binomtest(int(k), int(n)).proportion_ci(confidence)
    line = (
        f"{label}: global Z >= {z:g} in {k}/{n} = {100 * k / n:.2f}% "
        f"[{100 * interval.low:.2f}, {100 * interval.high:.2f}]% at {100 * confidence:.2f}% CL "
        f"(nominal {100 * nominal:.3f}%{'' if two_sided else ', upper check only'})"
    )
    return interval.low <= nominal and (nominal <= interval.high or not two_sided), line


@pytest.mark.slow
def test_global_significance_is_calibrated_on_background_only_toys():
    """600 toys per family (2,400 in all, ~30 s): per family and path (a), (b) at Z >= 2; pooled,
    (a) and (b) at Z >= 2 and Z >= 3, and (c) from above."""
    results = {family: bench_lee.family_toys(family, LIGHT_TOYS_PER_FAMILY)[1] for family in bench_lee.FAMILIES}
    pooled = np.concatenate(list(results.values()))
    plan = [(family, path, 2.0, True) for family in results for path in "ab"]
    plan += [("pooled", path, level, path != "c") for path in "abc" for level in (2.0, 3.0)]
    confidence = 1.0 - 0.05 / len(plan)
    checks = []
    for group, path, level, two_sided in plan:
        rows = pooled if group == "pooled" else results[group]
        k = int(np.sum(rows[:, bench_lee.PATHS.index(path)] >= level))
        checks.append(_check(f"({path}) {group}", k, len(rows), level, confidence, two_sided))
    report = "\n".join(line for _, line in checks)
    print(f"\n{len(pooled)} toys, {100 * pooled[:, 3].mean():.0f}% analysed with the low-count rule\n{report}")
    assert all(ok for ok, _ in checks), report


@pytest.mark.parametrize("n, b", [(24, 0.05), (8, 0.4), (3, 0.01), (15, 7.0), (1, 0.3)])
def test_low_count_p_value_of_a_count_is_its_exact_poisson_tail(n, b):
    """The low-count local p-value (`log_p_counting_equivalent`) of the likelihood ratio of a
    count n over a known background b is the exact P(N >= n), N ~ Poisson(b)."""
    from cernenv.physics.significance import log_p_counting_equivalent

    q0 = 2.0 * (n * np.log(n / b) - n + b)
    assert np.exp(log_p_counting_equivalent(q0, b)) == pytest.approx(poisson.sf(n - 1, b), rel=1e-9)


def test_low_count_p_value_is_valid_on_poisson_toys():
    """Counts over a known background: P(p <= alpha) <= alpha (the p-value of a count is exact;
    discreteness only makes it conservative)."""
    from cernenv.physics.significance import log_p_counting_equivalent

    rng = np.random.default_rng(5)
    for b in (0.3, 2.0, 8.0):
        n = rng.poisson(b, 200_000)
        p = {
            k: np.exp(log_p_counting_equivalent(2.0 * (k * np.log(k / b) - k + b), b)) if k > b else 1.0 for k in set(n)
        }
        p = np.array([p[k] for k in n])
        for alpha in (0.0228, 0.00135):
            assert np.mean(p <= alpha) <= alpha * 1.05, (b, alpha)


def _clean_peak(events: int):
    window, channel = (2500.0, 4600.0), "diphoton"
    spectrum = toy_spectrum(window, channel, 13.6, 10.0, [3, 1])  # a handful of background events
    assert spectrum.counts.sum() < 15  # 10 fb^-1 at 13.6 TeV
    rng = np.random.default_rng(2)
    histogram = spectrum.histogram.copy()
    histogram.fill(rng.normal(3645.0, float(spectrum.resolution_gev(3645.0)), events), rng.integers(0, 10, events))
    return dataclasses.replace(spectrum, histogram=histogram)


def test_a_clean_low_count_peak_is_a_discovery():
    """24 events at one mass on an empty spectrum: a physicist calls it a discovery, so the
    low-count test must too (an earlier rule, with the background's uncertainty taken from a
    fit of empty sidebands, gave Z = 2.8 here)."""
    result = analysis.significance(_clean_peak(24), 3645.0, True)
    assert result["local_p_method"] == "poisson_count"
    assert result["z_global"] >= 5.0, result


def test_the_global_significance_of_a_clean_low_count_peak_grows_with_its_events():
    """3 to 24 events at one mass on an empty spectrum: local and global Z grow with the events,
    the look-elsewhere correction lowers Z by less as Z grows (the trials factor grows only as
    ~Z), and 12 events are past 5 sigma globally."""
    results = [analysis.significance(_clean_peak(events), 3645.0, True) for events in (3, 5, 8, 12, 24)]
    z_local = [r["z_local"] for r in results]
    z_global = [r["z_global"] for r in results]
    assert all(r["local_p_method"] == "poisson_count" for r in results)
    assert np.all(np.diff(z_local) > 0) and np.all(np.diff(z_global) > 0), results
    assert all(g <= loc for g, loc in zip(z_global, z_local))
    assert np.all(np.diff(np.array(z_local) - np.array(z_global))[1:] < 0), results
    assert z_global[3] >= 5.0, results
