"""Calibration of the global significance (look-elsewhere corrected) on background-only toys.

    make bench-lee                        # 2,000 toys per channel family
    python bench/bench_lee.py --toys 500  # fewer (or more) toys per family

A toy is a background-only spectrum recorded as the environment records it
(`CollisionRecorder` with no particle, at the configuration's highest beam energy, nominal
pileup, the best trigger of the channel) in one of the analysis states agents use:
calibrated once or twice, standard or tight reconstruction, the whole luminosity cap or 40%
of it; histogrammed with the environment's default binning over the whole search window
(`CERNCollisionEnvironment._default_bin_width` for that state). It is analysed as the
environment analyses it (`cernenv.analysis`): background-only fit, default bump scan, and at
the scan's best mass

  (a) ``significance(spectrum, mass, with_systematics=False, scan=scan)``: what
      `estimate_significance` reports after a scan;
  (b) ``significance(spectrum, mass, with_systematics=False, scan=None)``: the grader's path,
      statistical uncertainty only;
  (c) ``significance(spectrum, mass, with_systematics=True, scan=None)``: the grader's own
      call, with the spurious-signal systematic.

Families: diboson, dilepton and heavy (every procedural configuration of that family and
each of its channels, the particle removed) and the curated null scenarios (each channel).
A family's toys cycle over its (configuration, channel, state) combinations; a toy whose
spectrum is empty (nothing recorded: 40% of a small cap in a far tail) is not a test and is
replaced by the next one. Seeds are fixed: the same command prints the same table.

Checks, per family and level: for (a) and (b) the fraction of toys at global Z >= 2 (Z >= 3)
must be 1 - Φ(2) = 2.28% (1 - Φ(3) = 0.135%), its Clopper-Pearson interval containing it;
for (c) the interval's lower end must not exceed it (the systematic is conservative by
design; it must not make the test liberal). Bonferroni correction: with K checks, each
interval is taken at confidence 1 - 0.05/K, so that a calibrated method fails one of them in
at most 5% of runs; the table also shows each fraction's 95% interval. Exit status 1 when a
check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("OMP_NUM_THREADS", "1")  # single core: no BLAS threads
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from scipy.stats import binomtest, norm  # noqa: E402

from cernenv import analysis  # noqa: E402
from cernenv.detector import CHANNELS, TRIGGERS, mass_resolution_gev  # noqa: E402
from cernenv.scenarios import CURATED, PROCEDURAL_CONFIGURATIONS  # noqa: E402
from cernenv.simulation import CollisionRecorder  # noqa: E402

FAMILIES = ("diboson", "dilepton", "heavy", "curated_null")
NULL_SCENARIOS = ("null_diphoton_750", "null_dilepton_highmass")
STATES = tuple(
    (level, reconstruction, fraction)
    for level in (1, 2)
    for reconstruction in ("standard", "tight")
    for fraction in (1.0, 0.4)
)
"""(calibration level, reconstruction, fraction of the luminosity cap) of the analysed spectra."""
LEVELS = (2.0, 3.0)
PATHS = ("a", "b", "c")
PATH_NAMES = {
    "a": "scan, stat only (estimate_significance)",
    "b": "no scan, stat only (grader path)",
    "c": "no scan, with systematics (grader)",
}
DEFAULT_TOYS = 2000
DEFAULT_SEED = 20101525


@dataclass(frozen=True)
class NullConfiguration:
    family: str
    window_gev: tuple[float, float]
    channel: str
    sqrt_s_tev: float
    luminosity_fb: float
    label: str


def null_configurations(family: str | None = None) -> list[NullConfiguration]:
    """Every null configuration (of `family`): the curated null scenarios' channels and every
    procedural task configuration's channels, at the highest beam energy and the luminosity cap."""
    out = []
    for name in NULL_SCENARIOS:
        scenario = CURATED[name]
        assert scenario.truth is None
        out += [
            NullConfiguration(
                "curated_null",
                scenario.search_window_gev,
                channel,
                max(scenario.beam_energies_tev),
                scenario.luminosity_fb,
                name,
            )
            for channel in scenario.channels
        ]
    for difficulty, configurations in PROCEDURAL_CONFIGURATIONS.items():
        out += [
            NullConfiguration(
                config.family,
                config.search_window_gev,
                channel,
                max(config.beam_energies_tev),
                config.luminosity_fb,
                f"{difficulty} {config.search_window_gev[0]:g}-{config.search_window_gev[1]:g}",
            )
            for config in configurations
            for channel in config.channels
        ]
    return [config for config in out if family is None or config.family == family]


def default_bin_width(channel: str, lo: float, hi: float, calibration_level: int = 1, reconstruction="standard"):
    """`CERNCollisionEnvironment._default_bin_width` for a channel in that detector state,
    nominal pileup: half the resolution at the window centre, 20 to 100 bins, never wider than
    the resolution at the low edge."""

    def resolution(mass):
        return float(mass_resolution_gev(CHANNELS[channel], mass, calibration_level, reconstruction, "nominal"))

    span = hi - lo
    return min(resolution(lo), span / 20, max(0.5 * resolution(0.5 * (lo + hi)), span / 100))


def toy_spectrum(
    window, channel, sqrt_s_tev, luminosity_fb, seed, calibration_level: int = 1, reconstruction: str = "standard"
):
    """A background-only spectrum of `channel` over `window`, recorded and histogrammed as the
    environment does (see the module docstring)."""
    recorder = CollisionRecorder(window, (channel,), None, np.random.default_rng(seed))
    record = recorder.records[channel]
    record.calibration_level, record.reconstruction = calibration_level, reconstruction
    best_trigger = max(trigger.get(channel, 0.0) for trigger in TRIGGERS.values())
    recorder.collect(luminosity_fb, sqrt_s_tev, "nominal", {channel: best_trigger})
    width = default_bin_width(channel, *window, calibration_level, reconstruction)
    return recorder.build_spectrum(channel, window, width, sqrt_s_tev, "nominal")


def analyse(spectrum) -> tuple[float, float, float, float]:
    """Global Z at the default bump scan's best mass by paths (a), (b), (c) of the module
    docstring, and 1.0 if that mass was analysed with the low-count rule (else 0.0)."""
    background = analysis.background_fit(spectrum)
    scan = analysis.default_bump_scan(spectrum, background)
    mass = scan.best_mass_gev
    a = analysis.significance(spectrum, mass, False, scan, background)
    b = analysis.significance(spectrum, mass, False, None, background)
    c = analysis.significance(spectrum, mass, True, None, background)
    return a["z_global"], b["z_global"], c["z_global"], float(b["local_p_method"] == "poisson_count")


def family_toys(family: str, n_toys: int, seed: int = DEFAULT_SEED):
    """(toy count, (n_toys, 4) array of `analyse` results, (n_toys,) state index) for `family`:
    its (configuration, state) combinations in turn, empty spectra replaced."""
    configurations = null_configurations(family)
    combos = [(config, state) for state in range(len(STATES)) for config in range(len(configurations))]
    family_index = FAMILIES.index(family)
    rows, states, drawn = [], [], 0
    while len(rows) < n_toys:
        config_index, state_index = combos[drawn % len(combos)]
        config = configurations[config_index]
        level, reconstruction, fraction = STATES[state_index]
        spectrum = toy_spectrum(
            config.window_gev,
            config.channel,
            config.sqrt_s_tev,
            config.luminosity_fb * fraction,
            [seed, family_index, config_index, state_index, drawn],
            level,
            reconstruction,
        )
        drawn += 1
        if spectrum.counts.sum() == 0:
            continue
        rows.append(analyse(spectrum))
        states.append(state_index)
    return drawn, np.array(rows), np.array(states)


def _family_job(arguments):
    family, n_toys, seed = arguments
    return family, family_toys(family, n_toys, seed)


@dataclass(frozen=True)
class Check:
    family: str
    path: str
    level: float
    k: int
    n: int
    ci95: tuple[float, float]
    ci: tuple[float, float]
    two_sided: bool

    @property
    def nominal(self) -> float:
        return float(norm.sf(self.level))

    @property
    def ok(self) -> bool:
        return self.ci[0] <= self.nominal and (self.nominal <= self.ci[1] or not self.two_sided)


def interval(k: int, n: int, confidence: float) -> tuple[float, float]:
    ci = binomtest(int(k), int(n)).proportion_ci(confidence, method="exact")
    return float(ci.low), float(ci.high)


def checks(results: dict) -> list[Check]:
    """The checks of the module docstring on `results` (family -> `analyse` rows), Bonferroni-corrected."""
    plan = [(family, path, level) for family in results for path in PATHS for level in LEVELS]
    confidence = 1.0 - 0.05 / len(plan)
    out = []
    for family, path, level in plan:
        rows = results[family]
        k, n = int(np.sum(rows[:, PATHS.index(path)] >= level)), len(rows)
        out.append(Check(family, path, level, k, n, interval(k, n, 0.95), interval(k, n, confidence), path != "c"))
    return out


def report(results: dict, states: dict, drawn: dict, elapsed_s: float) -> tuple[str, bool]:
    """The tables (per family and path; per analysis state) and whether every check passed."""
    found = checks(results)
    confidence = 1.0 - 0.05 / len(found)
    lines = [
        f"global Z of background-only toys at the default bump scan's best mass "
        f"({sum(len(r) for r in results.values())} toys, {elapsed_s:.0f} s)",
        f"checks: {len(found)}, Bonferroni: each interval at {100 * confidence:.2f}% (95% for all together); "
        "(c) is checked from above only",
        "",
        f"{'family':<13}{'path':<42}{'Z>=':>4}{'toys':>6}{'k':>5}{'rate %':>8}{'95% CP %':>16}"
        f"{'Bonferroni CP %':>17}{'nominal %':>11}  verdict",
    ]
    for check in found:
        lo95, hi95 = check.ci95
        lo, hi = check.ci
        lines.append(
            f"{check.family:<13}{'(' + check.path + ') ' + PATH_NAMES[check.path]:<42}{check.level:>4g}{check.n:>6}"
            f"{check.k:>5}{100 * check.k / check.n:>8.3f}{f'[{100 * lo95:.2f}, {100 * hi95:.2f}]':>16}"
            f"{f'[{100 * lo:.2f}, {100 * hi:.2f}]':>17}{100 * check.nominal:>11.3f}  "
            f"{'ok' if check.ok else 'FAIL'}{'' if check.two_sided else ' (upper)'}"
        )
    lines += ["", "low-count share (best mass analysed with the counting rule) and empty spectra replaced:"]
    for family, rows in results.items():
        lines.append(
            f"  {family:<13} {100 * rows[:, 3].mean():5.1f}% low-count, {drawn[family] - len(rows)} empty of "
            f"{drawn[family]} drawn"
        )
    lines += ["", "per analysis state, all families pooled (no check; rate % at Z>=2 / Z>=3):"]
    pooled = np.concatenate(list(results.values()))
    pooled_states = np.concatenate([states[family] for family in results])
    for index, (level, reconstruction, fraction) in enumerate(STATES):
        rows = pooled[pooled_states == index]
        if not len(rows):
            continue
        rates = "  ".join(
            f"({path}) {100 * np.mean(rows[:, PATHS.index(path)] >= 2):.2f} / "
            f"{100 * np.mean(rows[:, PATHS.index(path)] >= 3):.3f}"
            for path in PATHS
        )
        state = f"calibration {level}, {reconstruction:<8}, {100 * fraction:3.0f}% of the cap"
        lines.append(f"  {state}: {len(rows):5d} toys  {rates}")
    return "\n".join(lines), all(check.ok for check in found)


def run(n_toys: int = DEFAULT_TOYS, seed: int = DEFAULT_SEED, families=FAMILIES, jobs: int = 1):
    """(results, states, drawn) per family: `family_toys` of each family, in `jobs` processes."""
    work = [(family, n_toys, seed) for family in families]
    if jobs > 1:
        from multiprocessing import Pool

        with Pool(min(jobs, len(work))) as pool:
            done = dict(pool.imap_unordered(_family_job, work))
    else:
        done = dict(map(_family_job, work))
    results = {family: done[family][1] for family in families}
    states = {family: done[family][2] for family in families}
    drawn = {family: done[family][0] for family in families}
    return results, states, drawn


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--toys", type=int, default=DEFAULT_TOYS, help="toys per family (default %(default)s)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="base seed of the toys (default %(default)s)")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--jobs", type=int, default=1, help="processes, one family each (default %(default)s)")
    args = parser.parse_args()
    start = time.perf_counter()
    results, states, drawn = run(args.toys, args.seed, tuple(args.families), args.jobs)
    text, ok = report(results, states, drawn, time.perf_counter() - start)
    print(text)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
