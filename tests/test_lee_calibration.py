"""Calibration of the environment's global significance on background-only data.

A toy is a background-only spectrum of one null configuration, recorded as the
environment records it (`CollisionRecorder` with no particle, the whole luminosity cap at
the highest beam energy, nominal pileup, the best trigger, calibrated once, standard
reconstruction, the environment's default binning) and analysed as the environment
analyses it (`cernenv.analysis`, the code its actions and grader call): background fit,
bump scan over the window, `estimate_significance` at the scan's best mass (scan
upcrossings, no systematics) and the grader's reference significance there (analytic
upcrossings, spurious-signal systematic).

Configurations: the curated null scenarios (each channel) and every procedural task
configuration (each channel) with the particle removed. Under the null the fraction of toys
with global Z >= 2 (>= 3) must be 1 - Phi(2) = 2.28% (1 - Phi(3) = 0.135%): a check asks
that the Clopper-Pearson 95% interval of the observed fraction contain it. Configurations
analysed asymptotically (most toys' best mass with >= `LOW_COUNT_BACKGROUND` background
events within ±2σ_m): Z >= 2 and Z >= 3 pooled, both ways, and Z >= 2 per configuration
family, both ways, with Bonferroni-corrected intervals (95% for those checks together: at
95% each, eight checks of a calibrated method would fail one a third of the time).
Low-count configurations (down to 7 events in the whole window), where the counting test
with an uncertain background is conservative by construction: the fraction may not exceed
the nominal one (the interval's lower end at most nominal), for Z >= 2 and Z >= 3 pooled.
Toy seeds are fixed.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import numpy as np
import pytest
from scipy.stats import binomtest, norm

from cernenv import analysis
from cernenv.detector import CHANNELS, TRIGGERS, mass_resolution_gev
from cernenv.scenarios import CURATED, PROCEDURAL_CONFIGURATIONS
from cernenv.simulation import CollisionRecorder

TOYS_PER_CONFIGURATION = 100
NULL_SCENARIOS = ("null_diphoton_750", "null_dilepton_highmass")


def null_configurations():
    """(family, window, channel, sqrt_s [TeV], luminosity [fb^-1]) of every null configuration."""
    out = []
    for name in NULL_SCENARIOS:
        scenario = CURATED[name]
        assert scenario.truth is None
        out += [
            (
                "curated_null",
                scenario.search_window_gev,
                channel,
                max(scenario.beam_energies_tev),
                scenario.luminosity_fb,
            )
            for channel in scenario.channels
        ]
    for configurations in PROCEDURAL_CONFIGURATIONS.values():
        out += [
            (config.family, config.search_window_gev, channel, max(config.beam_energies_tev), config.luminosity_fb)
            for config in configurations
            for channel in config.channels
        ]
    return out


def default_bin_width(channel: str, lo: float, hi: float) -> float:
    """`CERNCollisionEnvironment._default_bin_width` for a channel calibrated once, standard
    reconstruction, nominal pileup."""

    def resolution(mass):
        return float(mass_resolution_gev(CHANNELS[channel], mass, 1, "standard", "nominal"))

    span = hi - lo
    return min(resolution(lo), span / 20, max(0.5 * resolution(0.5 * (lo + hi)), span / 100))


def toy_spectrum(window, channel, sqrt_s_tev, luminosity_fb, seed):
    recorder = CollisionRecorder(window, (channel,), None, np.random.default_rng(seed))
    record = recorder.records[channel]
    record.calibration_level, record.reconstruction = 1, "standard"
    best_trigger = max(trigger.get(channel, 0.0) for trigger in TRIGGERS.values())
    recorder.collect(luminosity_fb, sqrt_s_tev, "nominal", {channel: best_trigger})
    return recorder.build_spectrum(channel, window, default_bin_width(channel, *window), sqrt_s_tev, "nominal")


def analyse(spectrum):
    """(global Z of estimate_significance after a scan, the grader's reference global Z at the
    scan's best mass, 1 if that mass was analysed with the low-count rule else 0)."""
    background = analysis.background_fit(spectrum)
    scan = analysis.default_bump_scan(spectrum, background)
    mass = scan.best_mass_gev
    agent = analysis.significance(spectrum, mass, False, scan, background)
    reference = analysis.significance(spectrum, mass, True, None, background)
    return agent["z_global"], reference["z_global"], float(agent["local_p_method"] == "poisson_count")


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
    spectrum, mass = work[0]
    other_fit = dataclasses.replace(fits[id(spectrum)], p1=fits[id(spectrum)].p1 + 0.5)
    analysis._REGIONS.clear()
    alone = analysis._spectrum_regions(spectrum, other_fit).rice_upcrossings
    one(spectrum, mass, fits[id(spectrum)])
    assert analysis._spectrum_regions(spectrum, other_fit).rice_upcrossings == alone
    assert alone != analysis._spectrum_regions(spectrum, fits[id(spectrum)]).rice_upcrossings


def _check(label, k, n, z, two_sided=True, confidence=0.95):
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
    start = time.perf_counter()
    results = defaultdict(list)
    for index, (family, window, channel, sqrt_s, luminosity) in enumerate(null_configurations()):
        toys = np.array(
            [
                analyse(toy_spectrum(window, channel, sqrt_s, luminosity, [index, toy, 20101525]))
                for toy in range(TOYS_PER_CONFIGURATION)
            ]
        )
        results["low-count" if toys[:, 2].mean() > 0.5 else family].append(toys)
    z = {group: np.concatenate(values) for group, values in results.items()}
    asymptotic = np.concatenate([values for group, values in z.items() if group != "low-count"])
    checks = []
    families = [group for group in z if group != "low-count"]
    per_family = 1.0 - 0.05 / (2 * len(families))  # Bonferroni: 95% for the per-family checks together
    for path, column in (("estimate_significance", 0), ("grader reference", 1)):
        for group in families:
            values = z[group]
            checks.append(
                _check(
                    f"{path}, {group}", int(np.sum(values[:, column] >= 2.0)), len(values), 2.0, confidence=per_family
                )
            )
        for level in (2.0, 3.0):
            checks.append(
                _check(
                    f"{path}, asymptotic pooled", int(np.sum(asymptotic[:, column] >= level)), len(asymptotic), level
                )
            )
            if "low-count" in z:
                low = z["low-count"]
                checks.append(
                    _check(
                        f"{path}, low-count pooled",
                        int(np.sum(low[:, column] >= level)),
                        len(low),
                        level,
                        two_sided=False,
                    )
                )
    report = "\n".join(line for _, line in checks)
    n_toys = sum(len(values) for values in z.values())
    print(f"\n{n_toys} toys in {time.perf_counter() - start:.0f} s\n{report}")
    assert all(ok for ok, _ in checks), report


@pytest.mark.parametrize("n_on, n_off, tau", [(24, 0, 10.0), (8, 3, 4.0), (3, 40, 12.5), (15, 7, 1.7), (1, 0, 0.3)])
def test_on_off_p_value_is_the_exact_binomial_test(n_on, n_off, tau):
    """The low-count local p-value against scipy's exact binomial test: given n_on + n_off
    events, each is in the window with probability 1/(1 + tau) under the background alone."""
    expected = binomtest(n_on, n_on + n_off, 1.0 / (1.0 + tau), alternative="greater").pvalue
    assert np.exp(analysis.log_p_on_off(n_on, n_off, tau)) == pytest.approx(expected, rel=1e-9)
    assert analysis.log_p_on_off(0, n_off, tau) == 0.0


def test_on_off_p_value_is_valid_on_poisson_toys():
    """Under the background alone (n_on ~ Pois(b), n_off ~ Pois(tau b)), P(p <= alpha) <= alpha."""
    rng = np.random.default_rng(5)
    for b, tau in ((0.3, 10.0), (2.0, 5.0), (8.0, 2.0)):
        n_on, n_off = rng.poisson(b, 200_000), rng.poisson(tau * b, 200_000)
        p = np.exp(analysis.log_p_on_off(n_on, n_off, tau))
        for alpha in (0.0228, 0.00135):
            assert np.mean(p <= alpha) <= alpha * 1.05, (b, tau, alpha)


def test_a_clean_low_count_peak_is_a_discovery():
    """24 events at one mass on an empty spectrum: a physicist calls it a discovery, so the
    low-count test must too (the earlier rule, with the background's uncertainty taken from a
    fit of empty sidebands, gave Z = 2.8 here)."""
    window, channel = (2500.0, 4600.0), "diphoton"
    spectrum = toy_spectrum(window, channel, 13.6, 10.0, [3, 1])  # a handful of background events
    assert spectrum.counts.sum() < 15  # 10 fb^-1 at 13.6 TeV
    rng = np.random.default_rng(2)
    histogram = spectrum.histogram.copy()
    histogram.fill(rng.normal(3645.0, float(spectrum.resolution_gev(3645.0)), 24), rng.integers(0, 10, 24))
    spectrum = dataclasses.replace(spectrum, histogram=histogram)
    result = analysis.significance(spectrum, 3645.0, True)
    assert result["local_p_method"] == "poisson_count"
    assert result["z_global"] >= 5.0, result
