"""Discovery campaigns: curated ones modelled on real LHC results, and procedural ones.

A `Scenario` holds what the agent is told (window, channels, beams, resources) and,
separately, the hidden `ParticleTruth` (None for a null scenario: nothing there).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

import numpy as np

from cernenv.detector import (
    BEAM_ENERGIES,
    CHANNELS,
    PILEUP_SETTINGS,
    PRODUCTION_REFERENCES,
    TRIGGERS,
    cross_section_scale,
    expected_background_events,
    mass_resolution_gev,
)
from cernenv.seeding import particle_rng, task_rng

DIFFICULTIES = ("easy", "medium", "hard")
DEFAULT_MAX_STEPS = 30


@dataclass(frozen=True)
class ParticleTruth:
    """The hidden resonance. `sigma_br_fb[channel]` is σ·B at √s = 13 TeV [fb]."""

    mass_gev: float
    width_gev: float
    spin: int
    production: str
    sigma_br_fb: Dict[str, float]

    def cross_section_fb(self, sqrt_s_tev: float = 13.0) -> float:
        """Total σ·B summed over the channels the particle decays to, at `sqrt_s_tev` [fb]."""
        return sum(self.sigma_br_fb.values()) * cross_section_scale(self.mass_gev, sqrt_s_tev, self.production)


@dataclass(frozen=True)
class Scenario:
    name: str
    difficulty: str
    summary: str
    """Problem statement shown to the agent: context only, never the answer (no citation
    either: naming the paper a campaign is modelled on would name the particle)."""
    search_window_gev: Tuple[float, float]
    channels: Tuple[str, ...]
    beam_energies_tev: Tuple[float, ...]
    budget_musd: float
    luminosity_fb: float
    time_days: float
    truth: Optional[ParticleTruth]
    triggers: Tuple[str, ...] = tuple(TRIGGERS)
    max_steps: int = DEFAULT_MAX_STEPS
    curated: bool = True
    reference: str = ""
    """Where the numbers come from: for people and graders, never shown to the agent."""
    configuration: Optional["TaskConfiguration"] = None
    """The procedural configuration the task was drawn from (None for a curated campaign)."""

    def signal_capacity_per_fb(self, channel: str, sqrt_s_tev: float) -> float:
        """The most signal events per fb^-1 (before trigger efficiency) that any hidden world of
        this visible task can record in `channel` at `sqrt_s_tev`: the simulation draws this
        many signal candidates whatever the truth (`cernenv.simulation`), so how long taking
        data takes does not depend on the hidden signal. A curated campaign's particle is its own
        bound; a procedural task's, the strongest its difficulty and configuration can draw."""
        if self.configuration is None:
            return 0.0 if self.truth is None else _signal_events_per_fb(self.truth, channel, sqrt_s_tev)
        return _procedural_capacity_per_fb(self.configuration, self.difficulty, channel, float(sqrt_s_tev))

    def hidden_truth(self) -> Dict[str, object]:
        if self.truth is None:
            return {
                "exists": False,
                "mass_gev": None,
                "width_gev": None,
                "spin": None,
                "channels": [],
                "cross_section_fb": 0.0,
            }
        return {
            "exists": True,
            "mass_gev": self.truth.mass_gev,
            "width_gev": self.truth.width_gev,
            "spin": self.truth.spin,
            "channels": sorted(ch for ch, xs in self.truth.sigma_br_fb.items() if xs > 0),
            "cross_section_fb": round(self.truth.cross_section_fb(13.0), 6),
        }


# Higgs: m = 125.09 GeV (ATLAS+CMS, PRL 114 (2015) 191803), Γ = 4.1 MeV (SM, YR4),
# σ(pp→H, 13 TeV) = 55.1 pb (YR4), B(γγ) = 2.27e-3, B(ZZ*→4ℓ, ℓ=e,μ) = 1.25e-4.
_HIGGS_13TEV_FB = PRODUCTION_REFERENCES["gg"][1][13.0] * 1e3
_HIGGS = ParticleTruth(
    125.09, 0.0041, 0, "gg", {"diphoton": _HIGGS_13TEV_FB * 2.27e-3, "four_lepton": _HIGGS_13TEV_FB * 1.25e-4}
)
# Z: m = 91.1876 GeV, Γ = 2.4952 GeV (PDG); σ·B(ℓℓ) = 1.981 nb per flavour at 13 TeV
# (ATLAS, PLB 759 (2016) 601; other energies: `detector.PRODUCTION_REFERENCES`).
_Z_13TEV_FB = PRODUCTION_REFERENCES["qq"][1][13.0] * 1e6
_Z = ParticleTruth(91.1876, 2.4952, 1, "qq", {"dimuon": _Z_13TEV_FB, "dielectron": _Z_13TEV_FB})

CURATED: Dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "higgs_diphoton_125",
            "medium",
            "Search for a new resonance decaying to two photons between 110 and 160 GeV; the "
            "four-lepton channel is also available. There may be a particle in the window, or nothing at all.",
            (110.0, 160.0),
            ("diphoton", "four_lepton"),
            (13.0, 13.6),
            budget_musd=180.0,
            luminosity_fb=60.0,
            time_days=200.0,
            truth=_HIGGS,
            reference="The Higgs boson: ATLAS, PLB 716 (2012) 1; CMS, PLB 716 (2012) 30.",
        ),
        Scenario(
            "higgs_4l_125",
            "easy",
            "Search for a new resonance decaying to four charged leptons between 110 and 160 GeV: few "
            "events, almost no background. There may be a particle in the window, or nothing at all.",
            (110.0, 160.0),
            ("four_lepton",),
            (13.0, 13.6),
            budget_musd=90.0,
            luminosity_fb=30.0,
            time_days=120.0,
            reference="H→ZZ*→4ℓ: CMS, PLB 716 (2012) 30; JHEP 11 (2017) 047.",
            truth=replace(_HIGGS, sigma_br_fb={"four_lepton": _HIGGS_13TEV_FB * 1.25e-4}),
        ),
        Scenario(
            "z_mumu_91",
            "easy",
            "Early-data search for a resonance decaying to a lepton pair between 60 and 120 GeV, with at "
            "most 50 pb^-1 at 7 TeV. There may be a particle in the window, or nothing at all.",
            (60.0, 120.0),
            ("dimuon", "dielectron"),
            (7.0,),
            budget_musd=20.0,
            luminosity_fb=0.05,
            time_days=40.0,
            truth=_Z,
            reference="The Z boson in CMS's first 36 pb^-1: JHEP 10 (2011) 132.",
        ),
        Scenario(
            "zprime_dilepton_4000",
            "medium",
            "High-mass search for a new resonance decaying to a lepton pair between 1.5 and 6 TeV. "
            "There may be a particle in the window, or nothing at all.",
            (1500.0, 6000.0),
            ("dielectron", "dimuon"),
            (13.0, 13.6),
            budget_musd=400.0,
            luminosity_fb=200.0,
            time_days=400.0,
            reference="A sequential-SM-like Z' (Γ/m = 3%); resolution and acceptance from ATLAS, PLB 796 (2019) "
            "68; σ·B set near that search's 139 fb^-1 sensitivity.",
            truth=ParticleTruth(4000.0, 120.0, 1, "qq", {"dielectron": 0.12, "dimuon": 0.12}),
        ),
        Scenario(
            "dijet_2500",
            "hard",
            "Search for a new resonance decaying to two jets between 1.5 and 4 TeV: a huge QCD "
            "continuum and 7% mass resolution. There may be a particle in the window, or nothing at all.",
            (1500.0, 4000.0),
            ("dijet",),
            (13.0, 13.6),
            budget_musd=200.0,
            luminosity_fb=80.0,
            time_days=200.0,
            reference="A W'/Z'-like qq̄ resonance; resolution from CMS, JHEP 08 (2018) 130; σ·B·A near that "
            "search's 36 fb^-1 sensitivity.",
            truth=ParticleTruth(2500.0, 25.0, 1, "qq", {"dijet": 60.0}),
        ),
        Scenario(
            "null_diphoton_750",
            "medium",
            "Search for a new resonance decaying to two photons between 500 and 1500 GeV. There may be "
            "a particle in the window, or nothing at all.",
            (500.0, 1500.0),
            ("diphoton",),
            (13.0, 13.6),
            budget_musd=150.0,
            luminosity_fb=60.0,
            time_days=200.0,
            truth=None,
            reference="The 750 GeV diphoton excess of 2015 that vanished with more data: ATLAS, JHEP 09 (2016) "
            "001; CMS, PLB 767 (2017) 147.",
        ),
        Scenario(
            "null_dilepton_highmass",
            "medium",
            "High-mass search for a new resonance decaying to a lepton pair between 1 and 5 TeV. There "
            "may be a particle in the window, or nothing at all.",
            (1000.0, 5000.0),
            ("dielectron", "dimuon"),
            (13.0, 13.6),
            budget_musd=300.0,
            luminosity_fb=150.0,
            time_days=350.0,
            truth=None,
            reference="The Drell–Yan tail alone: ATLAS, PLB 796 (2019) 68 saw no excess.",
        ),
    ]
}


def list_scenarios() -> List[str]:
    """Names of the curated scenarios (procedural ones are made by `procedural_scenario`)."""
    return list(CURATED)


# Procedural generation ---------------------------------------------------------------
#
# A procedural task is drawn from two independent random streams of its seed (`cernenv.seeding`):
#   * the *task stream* picks what the agent is told: one configuration from the small,
#     fixed set `PROCEDURAL_CONFIGURATIONS[difficulty]` (window, channels, beams, resources);
#   * the *particle stream* draws the hidden world: whether a particle exists, its mass (a
#     fraction of the window), width, spin, decay channels and signal strength.
# Neither stream reads the other, and the particle stream makes the same draws whether or
# not a particle exists, so nothing the agent sees at reset (nor how long reset takes) says
# anything about the particle beyond its documented prior (`PROCEDURAL_PRIOR`). Many seeds
# share each configuration, so the visible numbers cannot identify a seed either.

EVALUATION_SEED_START = 900_000
"""Seeds from here on are evaluation seeds: their procedural particles lie in the evaluation
mass bands (`mass_bands`), which no training seed's particle comes near."""

SPLITS = ("training", "evaluation")
"""Which particles a seed may hold: training seeds (below `EVALUATION_SEED_START`) draw their
procedural masses from the training bands, evaluation seeds from the evaluation bands."""

MASS_FRACTION_RANGE = (0.1, 0.9)
"""A procedural particle's mass lies in this part of its search window (as fractions of it)."""

SPLIT_GAP_SIGMA = 2.2
"""Training and evaluation masses of one family are more than this many mass resolutions
apart (2σ_m and a 10% margin): the resolution is the standard analysis's (calibrated once,
standard reconstruction, nominal pileup) of the family's coarser channel at the higher mass."""

MIN_BAND_WIDTH_LOG = 0.06
"""Each mass band spans at least this much in ln(mass) (6%), and at least 0.7 of the gap that
follows it, so every search window holds masses of both splits."""

_BAND_RANGE_GEV = (50.0, 10_000.0)


def seed_split(seed: int) -> str:
    """ "evaluation" for an evaluation seed (≥ `EVALUATION_SEED_START`), else "training"."""
    return SPLITS[int(seed >= EVALUATION_SEED_START)]


@dataclass(frozen=True)
class TaskConfiguration:
    """What the agent is told about a procedural campaign (the same for every seed that draws it)."""

    family: str
    search_window_gev: Tuple[float, float]
    luminosity_fb: float
    beam_energies_tev: Tuple[float, ...] = (13.0, 13.6)

    @property
    def channels(self) -> Tuple[str, ...]:
        return _FAMILIES[self.family].channels

    @property
    def budget_musd(self) -> float:
        """Enough for the luminosity cap at 13 TeV with 25% to spare, plus 30 M$ of analysis."""
        return round(self.luminosity_fb * BEAM_ENERGIES[13.0].cost_musd_per_fb * 1.25 + 30.0, 1)

    @property
    def time_days(self) -> float:
        """Enough for the luminosity cap at 13 TeV and nominal pileup with 20% to spare, plus 40 days."""
        return round(self.luminosity_fb * BEAM_ENERGIES[13.0].days_per_fb * 1.2 + 40.0, 1)


@dataclass(frozen=True)
class _Family:
    """A family of procedural searches: the two channels offered, and what the problem
    statement calls them."""

    channels: Tuple[str, str]
    description: str


_FAMILIES: Dict[str, _Family] = {
    # A scalar or tensor decaying to photon pairs and/or ZZ* → 4ℓ (the Higgs-like signature).
    "diboson": _Family(("diphoton", "four_lepton"), "two photons or four charged leptons"),
    # A Z'-like vector or a graviton decaying to electron and/or muon pairs (non-universal
    # couplings, e.g. L_μ − L_τ, give one flavour only).
    "dilepton": _Family(("dielectron", "dimuon"), "an electron or muon pair"),
    # A heavy resonance decaying to jets and/or photon pairs (an RS graviton does both).
    "heavy": _Family(("dijet", "diphoton"), "two jets or two photons"),
}

# The visible task set: per difficulty, two windows per family, each with its luminosity cap
# [fb^-1] and beam energies [TeV]. Every window spans at least 12 mass resolutions of its
# coarsest channel (dijet: 7%), so there are sidebands to fit. Harder tasks have wider
# windows (more look-elsewhere) and weaker signals (`_DIFFICULTY`).
PROCEDURAL_CONFIGURATIONS: Dict[str, Tuple[TaskConfiguration, ...]] = {
    "easy": (
        TaskConfiguration("diboson", (120.0, 170.0), 80.0),
        TaskConfiguration("diboson", (300.0, 420.0), 140.0),
        TaskConfiguration("dilepton", (400.0, 560.0), 80.0),
        TaskConfiguration("dilepton", (1500.0, 2100.0), 140.0, (8.0, 13.0, 13.6)),
        TaskConfiguration("heavy", (1500.0, 2800.0), 140.0),
        TaskConfiguration("heavy", (2500.0, 4600.0), 200.0),
    ),
    "medium": (
        TaskConfiguration("diboson", (110.0, 220.0), 80.0, (8.0, 13.0, 13.6)),
        TaskConfiguration("diboson", (250.0, 500.0), 140.0),
        TaskConfiguration("dilepton", (300.0, 600.0), 80.0),
        TaskConfiguration("dilepton", (1200.0, 2600.0), 200.0),
        TaskConfiguration("heavy", (1500.0, 3000.0), 140.0, (8.0, 13.0, 13.6)),
        TaskConfiguration("heavy", (2200.0, 4500.0), 200.0),
    ),
    "hard": (
        TaskConfiguration("diboson", (110.0, 300.0), 140.0),
        TaskConfiguration("diboson", (200.0, 600.0), 200.0, (8.0, 13.0, 13.6)),
        TaskConfiguration("dilepton", (250.0, 700.0), 140.0),
        TaskConfiguration("dilepton", (1000.0, 3000.0), 200.0, (8.0, 13.0, 13.6)),
        TaskConfiguration("heavy", (1500.0, 4000.0), 200.0),
        TaskConfiguration("heavy", (1800.0, 5000.0), 200.0),
    ),
}


@dataclass(frozen=True)
class _DifficultySettings:
    null_probability: float
    target_z: Tuple[float, float]
    """Expected local Z of a standard analysis at 70% of the luminosity cap, in the strongest channel."""
    relative_widths: Tuple[float, ...]
    """Γ/m drawn from these."""


_DIFFICULTY: Dict[str, _DifficultySettings] = {
    "easy": _DifficultySettings(0.15, (7.0, 12.0), (0.002,)),
    "medium": _DifficultySettings(0.25, (5.0, 8.0), (0.0005, 0.005, 0.02, 0.05)),
    "hard": _DifficultySettings(0.35, (4.0, 6.5), (0.0005, 0.005, 0.02, 0.05)),
}

DECAY_PATTERNS = ("first", "second", "both")
"""Which of the two offered channels a procedural particle decays to, drawn uniformly: "both"
gives the stronger one the target significance and the other 30-100% of its own."""

PROCEDURAL_PRIOR = {
    difficulty: {
        "particle_probability": 1.0 - settings.null_probability,
        "mass_fraction_of_window": MASS_FRACTION_RANGE,
        "decay_patterns": DECAY_PATTERNS,
    }
    for difficulty, settings in _DIFFICULTY.items()
}
"""What an agent may know about a procedural particle before it takes data, per difficulty:
the same for every configuration (tested: a classifier on the reset observation does no better)."""


def _family_resolution_frac(family: str, mass_gev: float) -> float:
    """σ_m/m of the standard analysis (calibrated once, standard reconstruction, nominal pileup)
    in the coarser of the family's two channels at `mass_gev`."""
    return max(
        float(mass_resolution_gev(CHANNELS[channel], mass_gev, 1, "standard", "nominal")) / mass_gev
        for channel in _FAMILIES[family].channels
    )


def _gap_above(family: str, mass_gev: float) -> float:
    """The lightest mass [GeV] more than `SPLIT_GAP_SIGMA` of its own resolutions above `mass_gev`
    (the resolution grows with the mass, so that is more than as many of `mass_gev`'s too)."""
    upper = mass_gev
    for _ in range(30):  # a fixed point: the resolution grows slowly with the mass
        upper = mass_gev / (1.0 - SPLIT_GAP_SIGMA * _family_resolution_frac(family, upper))
    return upper


def _subtract(intervals: List[Tuple[float, float]], cut: Tuple[float, float]) -> List[Tuple[float, float]]:
    out = []
    for lo, hi in intervals:
        if hi <= cut[0] or lo >= cut[1]:
            out.append((lo, hi))
            continue
        if lo < cut[0]:
            out.append((lo, cut[0]))
        if hi > cut[1]:
            out.append((cut[1], hi))
    return out


@functools.lru_cache(maxsize=None)
def mass_bands(family: str) -> Dict[str, Tuple[Tuple[float, float], ...]]:
    """The mass intervals [GeV] each split's particles of `family` come from: alternating
    training and evaluation bands in ln(mass), each followed by a gap of more than
    `SPLIT_GAP_SIGMA` resolutions; the evaluation bands also keep that distance from every
    curated particle decaying to the family's channels (curated campaigns are played in
    training). So no evaluation particle lies within 2σ_m of any particle training can produce."""
    from cernenv.physics import portable

    bands: Dict[str, List[Tuple[float, float]]] = {split: [] for split in SPLITS}
    lo, index = _BAND_RANGE_GEV[0], 0
    while lo < _BAND_RANGE_GEV[1]:
        gap_log = float(portable.log(_gap_above(family, lo) / lo))
        hi = lo * float(portable.exp(max(MIN_BAND_WIDTH_LOG, 0.7 * gap_log)))
        bands[SPLITS[index % 2]].append((lo, hi))
        lo, index = _gap_above(family, hi), index + 1
    channels = set(_FAMILIES[family].channels)
    for scenario in CURATED.values():
        truth = scenario.truth
        if truth is None or not channels & {ch for ch, xs in truth.sigma_br_fb.items() if xs > 0}:
            continue
        below = truth.mass_gev * (1.0 - SPLIT_GAP_SIGMA * _family_resolution_frac(family, truth.mass_gev))
        bands["evaluation"] = _subtract(bands["evaluation"], (below, _gap_above(family, truth.mass_gev)))
    return {split: tuple(intervals) for split, intervals in bands.items()}


def split_mass_intervals(config: "TaskConfiguration", split: str) -> Tuple[Tuple[float, float], ...]:
    """The masses [GeV] a particle of `split` may have in `config`: its window's
    `MASS_FRACTION_RANGE` within the split's bands (`mass_bands`)."""
    lo, hi = config.search_window_gev
    a, b = lo + MASS_FRACTION_RANGE[0] * (hi - lo), lo + MASS_FRACTION_RANGE[1] * (hi - lo)
    return tuple((max(a, x), min(b, y)) for x, y in mass_bands(config.family)[split] if min(b, y) > max(a, x))


def _draw_mass(intervals: Tuple[Tuple[float, float], ...], u: float) -> float:
    """The mass at quantile `u` of the uniform distribution over `intervals`."""
    lengths = np.array([y - x for x, y in intervals])
    position = u * float(lengths.sum())
    for (x, y), length in zip(intervals, lengths):
        if position <= length:
            return x + position
        position -= length
    return intervals[-1][1]


def _allowed_spins(decays_to: Tuple[str, ...]) -> Tuple[int, ...]:
    """Spins a resonance decaying to `decays_to` may have: Landau-Yang forbids spin 1 → γγ;
    the Higgs-like ZZ* → 4ℓ search is for spin 0 or 2."""
    return (0, 2) if {"diphoton", "four_lepton"} & set(decays_to) else (1, 2)


def _production(spin: int) -> str:
    """A vector is made from quarks (qq̄ → Z'), a scalar or tensor mostly from gluons."""
    return "qq" if spin == 1 else "gg"


@functools.lru_cache(maxsize=None)
def split_configurations(split: str, difficulty: str) -> Tuple[TaskConfiguration, ...]:
    """The configurations of `difficulty` whose window holds masses of `split`
    (`split_mass_intervals`): the task stream of a training or evaluation seed picks among these
    (worked out on first use: the mass bands take the portable logarithm, compiled by numba)."""
    return tuple(config for config in PROCEDURAL_CONFIGURATIONS[difficulty] if split_mass_intervals(config, split))


def procedural_scenario(seed: int, difficulty: str, secret_salt: Optional[str] = None) -> Scenario:
    """A random campaign of the given difficulty, reproducible from `seed` (and the secret).

    The visible task comes from `PROCEDURAL_CONFIGURATIONS[difficulty]` through the task
    stream; the particle from the particle stream, which makes the same draws whether or not
    a particle exists (see the section comment above)."""
    if difficulty not in _DIFFICULTY:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    level = DIFFICULTIES.index(difficulty)
    split = seed_split(seed)
    configurations = split_configurations(split, difficulty)
    config = configurations[int(task_rng(seed, level).integers(len(configurations)))]
    settings = _DIFFICULTY[difficulty]
    rng = particle_rng(seed, level, secret_salt)

    exists = bool(rng.random() >= settings.null_probability)
    mass = round(_draw_mass(split_mass_intervals(config, split), float(rng.random())), 1)
    lo, hi = config.search_window_gev
    relative_width = float(rng.choice(settings.relative_widths))
    pattern = DECAY_PATTERNS[int(rng.integers(len(DECAY_PATTERNS)))]
    decays_to = {"first": config.channels[:1], "second": config.channels[1:], "both": config.channels}[pattern]
    spin = int(rng.choice(_allowed_spins(decays_to)))
    target_z = float(rng.uniform(*settings.target_z))
    other_fraction = float(rng.uniform(0.3, 1.0))  # of its own target strength, for the weaker of "both"
    # The signal strength is solved for every draw, particle or not: reset takes the same work.
    unit = ParticleTruth(mass, round(mass * relative_width, 3), spin, _production(spin), {})
    needed = {
        ch: _sigma_br_for_target(unit, ch, 13.0, 0.7 * config.luminosity_fb, config.search_window_gev, target_z)
        for ch in config.channels
    }
    # The channel that reaches the target with the least σ·B gets it; the same operations
    # for every decay pattern (no timing difference between hidden worlds either).
    strongest = min(config.channels, key=lambda ch: needed[ch] if ch in decays_to else np.inf)
    scaled = {ch: round(needed[ch] * (1.0 if ch == strongest else other_fraction), 6) for ch in config.channels}
    sigma_br = {ch: scaled[ch] for ch in config.channels if ch in decays_to}
    particle = replace(unit, sigma_br_fb=sigma_br)
    truth = particle if exists else None

    description = _FAMILIES[config.family].description
    summary = (
        f"Search for a new resonance decaying to {description} between {lo:g} and {hi:g} GeV. "
        "There may be a particle in the window, or nothing at all."
    )
    return Scenario(
        name=f"procedural_{difficulty}",
        difficulty=difficulty,
        summary=summary,
        search_window_gev=config.search_window_gev,
        channels=config.channels,
        beam_energies_tev=config.beam_energies_tev,
        budget_musd=config.budget_musd,
        luminosity_fb=config.luminosity_fb,
        time_days=config.time_days,
        truth=truth,
        curated=False,
        configuration=config,
    )


def _standard_analysis(
    truth: ParticleTruth, channel: str, sqrt_s_tev: float, luminosity_fb: float, window_gev: Tuple[float, float]
) -> Tuple[Tuple[float, ...], float]:
    """What `expected_local_significance` multiplies σ·B by to get the signal (in order), and
    the background it counts within ±2σ of the true mass."""
    spec = CHANNELS[channel]
    sigma = mass_resolution_gev(spec, truth.mass_gev, 1, "standard", "nominal")
    half = float(np.hypot(2.0 * sigma, truth.width_gev))
    lo, hi = max(window_gev[0], truth.mass_gev - half), min(window_gev[1], truth.mass_gev + half)
    trigger = (
        max(TRIGGERS[t].get(channel, 0.0) for t in TRIGGERS) * PILEUP_SETTINGS["nominal"].trigger_efficiency_factor
    )
    background = float(expected_background_events(spec, np.array([lo, hi]), sqrt_s_tev, luminosity_fb)[0]) * trigger
    factors = (
        cross_section_scale(truth.mass_gev, sqrt_s_tev, truth.production),
        luminosity_fb,
        spec.signal_efficiency,
        trigger,
        0.9,
    )
    return factors, max(background, 1e-3)


def _asimov_z(sigma_br_fb: float, factors: Tuple[float, ...], background: float) -> float:
    """`asimov_significance(s, b)` (σ_b = 0) for s = σ·B times `factors`, in scalar arithmetic
    (the same operations, so the same value, without the array overhead)."""
    from cernenv.physics import portable

    signal = sigma_br_fb
    for factor in factors:
        signal = signal * factor
    s = np.maximum(np.float64(signal), 0.0)
    z2 = 2.0 * ((s + background) * portable.log1p(s / background) - s)
    return float(np.sqrt(np.maximum(z2, 0.0)))


def expected_local_significance(
    truth: ParticleTruth, channel: str, sqrt_s_tev: float, luminosity_fb: float, window_gev: Tuple[float, float]
) -> float:
    """Asimov expected local Z of a standard analysis (calibrated, standard reconstruction,
    nominal pileup, best trigger) counting events within ±2σ of the true mass."""
    factors, background = _standard_analysis(truth, channel, sqrt_s_tev, luminosity_fb, window_gev)
    return _asimov_z(truth.sigma_br_fb.get(channel, 0.0), factors, background)


def _sigma_br_for_target(
    unit: ParticleTruth,
    channel: str,
    sqrt_s_tev: float,
    luminosity_fb: float,
    window: Tuple[float, float],
    target_z: float,
) -> float:
    """σ·B [fb] at which `expected_local_significance` equals `target_z`: the signal s with
    Asimov Z(s, b) = target, by Newton's method on Z² (convex and increasing in s, so from a start
    above the root it converges monotonically: 8 steps reach 1e-12 over Z 2-13 and b 1e-3-1e8,
    the same 8 in every hidden world), divided by what multiplies σ·B into s."""
    factors, background = _standard_analysis(unit, channel, sqrt_s_tev, luminosity_fb, window)  # σ·B-independent
    target2 = target_z * target_z
    signal = target_z * math.sqrt(background) + 0.5 * target2
    for _ in range(8):
        ratio = signal / background
        z2 = 2.0 * ((signal + background) * math.log1p(ratio) - signal)
        signal = max(signal - (z2 - target2) / (2.0 * math.log1p(ratio)), 1e-12)
    per_unit = 1.0
    for factor in factors:
        per_unit *= factor
    return signal / per_unit


def _signal_events_per_fb(truth: ParticleTruth, channel: str, sqrt_s_tev: float) -> float:
    """Expected signal events per fb^-1 of `truth` in `channel` at `sqrt_s_tev`, before trigger
    efficiency (what `CollisionRecorder` multiplies by the luminosity and the trigger)."""
    return (
        truth.sigma_br_fb.get(channel, 0.0)
        * cross_section_scale(truth.mass_gev, sqrt_s_tev, truth.production)
        * CHANNELS[channel].signal_efficiency
    )


@functools.lru_cache(maxsize=None)
def _procedural_capacity_per_fb(config: TaskConfiguration, difficulty: str, channel: str, sqrt_s_tev: float) -> float:
    """`Scenario.signal_capacity_per_fb` of a procedural task: the largest expected signal per
    fb^-1 over a grid of masses of the window's `MASS_FRACTION_RANGE`, every width and production
    mode the difficulty draws, at its strongest target significance (10% above, for the grid)."""
    settings = _DIFFICULTY[difficulty]
    lo, hi = config.search_window_gev
    masses = lo + (hi - lo) * np.linspace(*MASS_FRACTION_RANGE, 41)
    best = 0.0
    for mass in masses:
        for relative_width in settings.relative_widths:
            for spin in (0, 1):
                unit = ParticleTruth(float(mass), float(mass) * relative_width, spin, _production(spin), {})
                needed = _sigma_br_for_target(
                    unit, channel, 13.0, 0.7 * config.luminosity_fb, config.search_window_gev, settings.target_z[1]
                )
                best = max(
                    best, _signal_events_per_fb(replace(unit, sigma_br_fb={channel: needed}), channel, sqrt_s_tev)
                )
    return 1.1 * best


def make_scenario(
    seed: int, scenario: Optional[str] = None, difficulty: Optional[str] = None, secret_salt: Optional[str] = None
) -> Scenario:
    """The scenario an episode plays: a curated one by name, else a procedural one.

    With neither given, the difficulty is drawn from the seed. `secret_salt` (an evaluation
    secret) changes the procedural particle, never the visible task."""
    if scenario is not None:
        if scenario in CURATED:
            return CURATED[scenario]
        raise ValueError(
            f"unknown scenario {scenario!r}; choose one of {list_scenarios()} "
            "or pass difficulty='easy'|'medium'|'hard' for a procedural one"
        )
    if difficulty is None:
        difficulty = DIFFICULTIES[seed % 3]
    return procedural_scenario(seed, difficulty, secret_salt)
