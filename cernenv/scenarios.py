"""Discovery campaigns: curated ones modelled on real LHC results, and procedural ones.

A `Scenario` holds what the agent is told (window, channels, beams, resources) and,
separately, the hidden `ParticleTruth` (None for a null scenario: nothing there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

import numpy as np

from cernenv.detector import (
    BEAM_ENERGIES,
    CHANNELS,
    PILEUP_SETTINGS,
    TRIGGERS,
    cross_section_scale,
    expected_background_events,
    mass_resolution_gev,
)

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

    def hidden_truth(self) -> Dict[str, object]:
        if self.truth is None:
            return {"exists": False, "mass_gev": None, "width_gev": None, "spin": None,
                    "channels": [], "cross_section_fb": 0.0}
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
_HIGGS = ParticleTruth(125.09, 0.0041, 0, "gg", {"diphoton": 55.1e3 * 2.27e-3, "four_lepton": 55.1e3 * 1.25e-4})
# Z: m = 91.1876 GeV, Γ = 2.4952 GeV (PDG); σ·B(ℓℓ) = 1.91 nb per flavour at 13 TeV (ATLAS 2016).
_Z = ParticleTruth(91.1876, 2.4952, 1, "qq", {"dimuon": 1.91e6, "dielectron": 1.91e6})

CURATED: Dict[str, Scenario] = {
    s.name: s
    for s in [
        Scenario(
            "higgs_diphoton_125", "medium",
            "Search for a new resonance decaying to two photons between 110 and 160 GeV; the "
            "four-lepton channel is also available. There may be a particle in the window, or nothing at all.",
            (110.0, 160.0), ("diphoton", "four_lepton"), (13.0, 13.6),
            budget_musd=180.0, luminosity_fb=60.0, time_days=200.0, truth=_HIGGS,
            reference="The Higgs boson: ATLAS, PLB 716 (2012) 1; CMS, PLB 716 (2012) 30.",
        ),
        Scenario(
            "higgs_4l_125", "easy",
            "Search for a new resonance decaying to four charged leptons between 110 and 160 GeV: few "
            "events, almost no background. There may be a particle in the window, or nothing at all.",
            (110.0, 160.0), ("four_lepton",), (13.0, 13.6),
            budget_musd=90.0, luminosity_fb=30.0, time_days=120.0,
            reference="H→ZZ*→4ℓ: CMS, PLB 716 (2012) 30; JHEP 11 (2017) 047.",
            truth=replace(_HIGGS, sigma_br_fb={"four_lepton": 55.1e3 * 1.25e-4}),
        ),
        Scenario(
            "z_mumu_91", "easy",
            "Early-data search for a resonance decaying to a lepton pair between 60 and 120 GeV, with at "
            "most 50 pb^-1 at 7 TeV. There may be a particle in the window, or nothing at all.",
            (60.0, 120.0), ("dimuon", "dielectron"), (7.0,),
            budget_musd=20.0, luminosity_fb=0.05, time_days=40.0, truth=_Z,
            reference="The Z boson in CMS's first 36 pb^-1: JHEP 10 (2011) 132.",
        ),
        Scenario(
            "zprime_dilepton_4000", "medium",
            "High-mass search for a new resonance decaying to a lepton pair between 1.5 and 6 TeV. "
            "There may be a particle in the window, or nothing at all.",
            (1500.0, 6000.0), ("dielectron", "dimuon"), (13.0, 13.6),
            budget_musd=400.0, luminosity_fb=200.0, time_days=400.0,
            reference="A sequential-SM-like Z' (Γ/m = 3%); resolution and acceptance from ATLAS, PLB 796 (2019) "
                      "68; σ·B set near that search's 139 fb^-1 sensitivity.",
            truth=ParticleTruth(4000.0, 120.0, 1, "qq", {"dielectron": 0.12, "dimuon": 0.12}),
        ),
        Scenario(
            "dijet_2500", "hard",
            "Search for a new resonance decaying to two jets between 1.5 and 4 TeV: a huge QCD "
            "continuum and 7% mass resolution. There may be a particle in the window, or nothing at all.",
            (1500.0, 4000.0), ("dijet",), (13.0, 13.6),
            budget_musd=200.0, luminosity_fb=80.0, time_days=200.0,
            reference="A W'/Z'-like qq̄ resonance; resolution from CMS, JHEP 08 (2018) 130; σ·B·A near that "
                      "search's 36 fb^-1 sensitivity.",
            truth=ParticleTruth(2500.0, 25.0, 1, "qq", {"dijet": 60.0}),
        ),
        Scenario(
            "null_diphoton_750", "medium",
            "Search for a new resonance decaying to two photons between 500 and 1500 GeV. There may be "
            "a particle in the window, or nothing at all.",
            (500.0, 1500.0), ("diphoton",), (13.0, 13.6),
            budget_musd=150.0, luminosity_fb=60.0, time_days=200.0, truth=None,
            reference="The 750 GeV diphoton excess of 2015 that vanished with more data: ATLAS, JHEP 09 (2016) "
                      "001; CMS, PLB 767 (2017) 147.",
        ),
        Scenario(
            "null_dilepton_highmass", "medium",
            "High-mass search for a new resonance decaying to a lepton pair between 1 and 5 TeV. There "
            "may be a particle in the window, or nothing at all.",
            (1000.0, 5000.0), ("dielectron", "dimuon"), (13.0, 13.6),
            budget_musd=300.0, luminosity_fb=150.0, time_days=350.0, truth=None,
            reference="The Drell–Yan tail alone: ATLAS, PLB 796 (2019) 68 saw no excess.",
        ),
    ]
}


def list_scenarios() -> List[str]:
    """Names of the curated scenarios (procedural ones are made by `procedural_scenario`)."""
    return list(CURATED)


# Procedural generation ---------------------------------------------------------------

# Channel families: decay channels, allowed spins (Landau–Yang: no spin 1 → γγ),
# production mode and the mass range of the search window [GeV].
_FAMILIES = {
    "diphoton": (("diphoton",), (0, 2), "gg", (100.0, 2000.0)),
    "four_lepton": (("four_lepton",), (0, 2), "gg", (110.0, 600.0)),
    "dilepton": (("dielectron", "dimuon"), (1, 2), "qq", (200.0, 4500.0)),
    "dijet": (("dijet",), (1, 2), "qq", (1500.0, 5000.0)),
}
# (null probability, target expected local Z at the luminosity cap, window width factor hi/lo)
_DIFFICULTY = {
    "easy": (0.15, (7.0, 12.0), (1.3, 1.6)),
    "medium": (0.25, (4.5, 7.5), (1.5, 2.2)),
    "hard": (0.35, (2.5, 5.0), (2.0, 3.0)),
}


def _standard_analysis(truth: ParticleTruth, channel: str, sqrt_s_tev: float, luminosity_fb: float,
                       window_gev: Tuple[float, float]) -> Tuple[Tuple[float, ...], float]:
    """What `expected_local_significance` multiplies σ·B by to get the signal (in order), and
    the background it counts within ±2σ of the true mass."""
    spec = CHANNELS[channel]
    sigma = mass_resolution_gev(spec, truth.mass_gev, 1, "standard", "nominal")
    half = float(np.hypot(2.0 * sigma, truth.width_gev))
    lo, hi = max(window_gev[0], truth.mass_gev - half), min(window_gev[1], truth.mass_gev + half)
    trigger = max(TRIGGERS[t].get(channel, 0.0) for t in TRIGGERS) * PILEUP_SETTINGS["nominal"].trigger_efficiency_factor
    background = float(expected_background_events(spec, np.array([lo, hi]), sqrt_s_tev, luminosity_fb)[0]) * trigger
    factors = (cross_section_scale(truth.mass_gev, sqrt_s_tev, truth.production), luminosity_fb,
               spec.signal_efficiency, trigger, 0.9)
    return factors, max(background, 1e-3)


def _asimov_z(sigma_br_fb: float, factors: Tuple[float, ...], background: float) -> float:
    """`asimov_significance(s, b)` (σ_b = 0) for s = σ·B times `factors`, in scalar arithmetic
    (the same operations, so the same value, without the array overhead)."""
    signal = sigma_br_fb
    for factor in factors:
        signal = signal * factor
    s = np.maximum(np.float64(signal), 0.0)
    z2 = 2.0 * ((s + background) * np.log1p(s / background) - s)
    return float(np.sqrt(np.maximum(z2, 0.0)))


def expected_local_significance(truth: ParticleTruth, channel: str, sqrt_s_tev: float, luminosity_fb: float,
                                window_gev: Tuple[float, float]) -> float:
    """Asimov expected local Z of a standard analysis (calibrated, standard reconstruction,
    nominal pileup, best trigger) counting events within ±2σ of the true mass."""
    factors, background = _standard_analysis(truth, channel, sqrt_s_tev, luminosity_fb, window_gev)
    return _asimov_z(truth.sigma_br_fb.get(channel, 0.0), factors, background)


def procedural_scenario(seed: int, difficulty: str) -> Scenario:
    """A random campaign of the given difficulty, reproducible from `seed`."""
    if difficulty not in _DIFFICULTY:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    rng = np.random.default_rng([seed, DIFFICULTIES.index(difficulty), 7919])
    null_probability, z_range, window_factor = _DIFFICULTY[difficulty]
    family = str(rng.choice(sorted(_FAMILIES)))
    channels, spins, production, (mass_lo, mass_hi) = _FAMILIES[family]
    # A search window spans at least ~12 mass resolutions, or there is no sideband to fit.
    widest_resolution = max(CHANNELS[ch].resolution_frac for ch in channels)
    factor = max(float(rng.uniform(*window_factor)), 1.0 + 12.0 * widest_resolution)
    lo = float(np.exp(rng.uniform(np.log(mass_lo), np.log(mass_hi / factor))))
    window = (round(lo, -1) if lo > 300 else round(lo), round(lo * factor, -1) if lo > 300 else round(lo * factor))
    energies = (13.0, 13.6) if rng.random() < 0.7 else (8.0, 13.0, 13.6)
    luminosity_cap = float(rng.choice([40.0, 80.0, 140.0, 200.0]))
    beam = BEAM_ENERGIES[13.0]
    budget = round(luminosity_cap * beam.cost_musd_per_fb * rng.uniform(1.0, 1.5) + 30.0, 1)
    time_days = round(luminosity_cap * beam.days_per_fb * rng.uniform(1.0, 1.4) + 40.0, 1)

    truth: Optional[ParticleTruth] = None
    if rng.random() >= null_probability:
        width_lo, width_hi = window[0] + 0.1 * (window[1] - window[0]), window[1] - 0.1 * (window[1] - window[0])
        mass = round(float(rng.uniform(width_lo, width_hi)), 1)
        relative_width = float(rng.choice([0.0005, 0.005, 0.02, 0.05])) if difficulty != "easy" else 0.002
        spin = int(rng.choice(spins))
        unit = ParticleTruth(mass, round(mass * relative_width, 3), spin, production, {ch: 1.0 for ch in channels})
        # Scale σ·B so that the best channel reaches the drawn target significance at 70% of the cap.
        target_z = float(rng.uniform(*z_range))
        best = max(channels, key=lambda ch: CHANNELS[ch].signal_efficiency / CHANNELS[ch].resolution_frac)
        scale = _sigma_br_for_target(unit, best, 13.0, 0.7 * luminosity_cap, window, target_z)
        truth = replace(unit, sigma_br_fb={ch: round(scale, 6) for ch in channels})

    kind = {"diphoton": "two photons", "four_lepton": "four charged leptons",
            "dilepton": "a lepton pair", "dijet": "two jets"}[family]
    summary = (f"Search for a new resonance decaying to {kind} between {window[0]:g} and {window[1]:g} GeV. "
               "There may be a particle in the window, or nothing at all.")
    return Scenario(
        name=f"procedural_{difficulty}", difficulty=difficulty, summary=summary,
        search_window_gev=(float(window[0]), float(window[1])), channels=channels, beam_energies_tev=energies,
        budget_musd=float(budget), luminosity_fb=luminosity_cap, time_days=float(time_days), truth=truth,
        curated=False,
    )


def _sigma_br_for_target(unit: ParticleTruth, channel: str, sqrt_s_tev: float, luminosity_fb: float,
                         window: Tuple[float, float], target_z: float) -> float:
    """σ·B [fb] at which `expected_local_significance` equals `target_z` (bisection in log σ·B)."""
    factors, background = _standard_analysis(unit, channel, sqrt_s_tev, luminosity_fb, window)  # σ·B-independent
    lo, hi = -8.0, 8.0
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if _asimov_z(10.0 ** mid, factors, background) < target_z:
            lo = mid
        else:
            hi = mid
    return 10.0 ** hi


def make_scenario(seed: int, scenario: Optional[str] = None, difficulty: Optional[str] = None) -> Scenario:
    """The scenario an episode plays: a curated one by name, else a procedural one.

    With neither given, the difficulty is drawn from the seed."""
    if scenario is not None:
        if scenario in CURATED:
            return CURATED[scenario]
        raise ValueError(f"unknown scenario {scenario!r}; choose one of {list_scenarios()} "
                         "or pass difficulty='easy'|'medium'|'hard' for a procedural one")
    if difficulty is None:
        difficulty = DIFFICULTIES[seed % 3]
    return procedural_scenario(seed, difficulty)
