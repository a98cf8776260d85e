"""The collider and detector: beam settings, triggers, decay channels and their response.

Numbers marked *published* come from the cited papers; the rest are modelling
choices, stated as such, that keep the campaign's trade-offs realistic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Mapping, Tuple

import numpy as np

REFERENCE_SQRT_S_TEV = 13.0

# Published σ(√s) of one process per production mode, at its mass: the energy dependence
# of every cross section is anchored on these, so the simulated Higgs and Z rates are the
# cited ones at each √s the campaigns offer (tests/test_detector.py checks each to 2%).
# gg → H (m_H = 125.09 GeV), total σ(pp → H) [pb]: CERN Yellow Report 4, arXiv:1610.07922
# (7, 8, 13, 14 TeV); at 13.6 TeV the prediction quoted by ATLAS, EPJC 84 (2024) 78.
# qq̄ → Z → ℓℓ, σ·B per lepton flavour [nb]: CMS, JHEP 10 (2011) 132 (7 TeV, 60 < m_ℓℓ <
# 120 GeV); CMS, PRL 112 (2014) 191802 (8 TeV, same window); ATLAS, PLB 759 (2016) 601
# (13 TeV, 66 < m_ℓℓ < 116 GeV: ~1% less than the wider window).
PRODUCTION_REFERENCES: Dict[str, Tuple[float, Dict[float, float]]] = {
    "gg": (125.09, {7.0: 19.1, 8.0: 24.3, 13.0: 55.1, 13.6: 59.9, 14.0: 62.1}),
    "qq": (91.1876, {7.0: 0.974, 8.0: 1.15, 13.0: 1.981}),
}
# Exponent `b` of the high-x fall-off (1 - x)^b, x = m/√s, that carries the energy
# dependence from the reference mass to heavier states: a modelling choice that makes a
# 4 TeV resonance gain ~30% from 13 to 13.6 TeV, as the PDFs do.
HIGH_X_EXPONENT = 10.0


@lru_cache(maxsize=None)
def _log_energy_table(production: str) -> Tuple[np.ndarray, np.ndarray]:
    """(ln √s, ln σ/σ(13 TeV)) of the references, in increasing √s (made on first use: the
    portable logarithm is compiled by numba, which `import cernenv` does not load)."""
    from cernenv.physics import portable

    _, points = PRODUCTION_REFERENCES[production]
    energies = sorted(points)
    return (
        portable.log(np.array(energies)),
        portable.log(np.array([points[e] / points[REFERENCE_SQRT_S_TEV] for e in energies])),
    )


def _reference_ratio(production: str, sqrt_s_tev: float) -> float:
    """σ(√s) / σ(13 TeV) of the production mode's reference process: a power law in √s
    between neighbouring references (log-log interpolation), the outer segments extended."""
    from cernenv.physics import portable

    log_s, log_ratio = _log_energy_table(production)
    t = float(portable.log(sqrt_s_tev))
    i = int(np.clip(np.searchsorted(log_s, t) - 1, 0, log_s.size - 2))
    slope = (log_ratio[i + 1] - log_ratio[i]) / (log_s[i + 1] - log_s[i])
    return float(portable.exp(log_ratio[i] + slope * (t - log_s[i])))


def cross_section_scale(mass_gev: float, sqrt_s_tev: float, production: str) -> float:
    """σ(√s) / σ(13 TeV) for producing mass `mass_gev` through `production` ("gg" or "qq"):
    the reference process's measured ratio, times the high-x fall-off of a heavier state
    relative to the reference mass's (1 at the reference mass)."""
    reference_mass_gev, _ = PRODUCTION_REFERENCES[production]
    x = mass_gev / (1000.0 * sqrt_s_tev)
    if x >= 1.0:
        return 0.0
    x_ref = mass_gev / (1000.0 * REFERENCE_SQRT_S_TEV)
    x0 = reference_mass_gev / (1000.0 * sqrt_s_tev)
    x0_ref = reference_mass_gev / (1000.0 * REFERENCE_SQRT_S_TEV)
    fall_off = math.pow((1.0 - x) * (1.0 - x0_ref) / ((1.0 - x_ref) * (1.0 - x0)), HIGH_X_EXPONENT)
    return _reference_ratio(production, sqrt_s_tev) * float(fall_off)


@dataclass(frozen=True)
class BeamEnergy:
    """One LHC running mode: how fast luminosity comes and what it costs."""

    sqrt_s_tev: float
    days_per_fb: float
    """Calendar days to deliver 1 fb^-1 at nominal pileup (published peak-year deliveries:
    ~5 fb^-1 in 2011, ~23 in 2012, ~65 in 2018, ~120 in 2024, over ~150 physics days)."""
    cost_musd_per_fb: float
    """Operating cost per fb^-1 (modelling choice: ~1 M$ per day of running, more at higher energy)."""


BEAM_ENERGIES: Dict[float, BeamEnergy] = {
    7.0: BeamEnergy(7.0, days_per_fb=30.0, cost_musd_per_fb=24.0),
    8.0: BeamEnergy(8.0, days_per_fb=6.5, cost_musd_per_fb=6.0),
    13.0: BeamEnergy(13.0, days_per_fb=2.3, cost_musd_per_fb=2.6),
    13.6: BeamEnergy(13.6, days_per_fb=1.25, cost_musd_per_fb=1.6),
}


@dataclass(frozen=True)
class PileupSetting:
    """Instantaneous-luminosity regime: more collisions per crossing, faster data, dirtier events."""

    name: str
    luminosity_rate_factor: float
    """Multiplies the delivered fb^-1 per day."""
    resolution_penalty_frac: float
    """Added in quadrature to the relative mass resolution (pileup energy in the calorimeter)."""
    trigger_efficiency_factor: float
    """Multiplies trigger efficiencies (thresholds are raised to keep rates in budget)."""


PILEUP_SETTINGS: Dict[str, PileupSetting] = {
    "low": PileupSetting("low", 0.5, 0.000, 1.00),
    "nominal": PileupSetting("nominal", 1.0, 0.004, 0.97),
    "high": PileupSetting("high", 1.8, 0.010, 0.88),
}


@dataclass(frozen=True)
class Channel:
    """A decay channel as the detector sees it.

    Background: `background_per_fb_per_gev` at `reference_mass_gev` and 13 TeV, with the
    dijet-function shape parameters (p1, p2) of `cernenv.physics.shapes`.
    """

    name: str
    final_state: str
    resolution_frac: float
    """Relative mass resolution σ_m/m of a calibrated, standard reconstruction."""
    uncalibrated_resolution_factor: float
    """How much worse the resolution is before calibration."""
    energy_scale_bias_max_frac: float
    """Before calibration the mass scale is off by a random bias of up to this fraction."""
    signal_efficiency: float
    """Acceptance × reconstruction efficiency for the signal at standard reconstruction."""
    background_per_fb_per_gev: float
    reference_mass_gev: float
    background_p1: float
    background_p2: float
    background_production: str

    @property
    def final_state_mathtext(self) -> str:
        """`final_state` in matplotlib's mathtext (μ⁺μ⁻ → $\\mu^+\\mu^-$): plot fonts lack the
        Unicode superscripts, which then show as missing-glyph boxes."""
        text = self.final_state
        for symbol, tex in _MATHTEXT.items():
            text = text.replace(symbol, tex)
        return f"${text}$"


_MATHTEXT = {"μ": r"\mu", "γ": r"\gamma", "ℓ": r"\ell", "⁺": "^+", "⁻": "^-"}
"""The Unicode symbols of the final states, in mathtext."""


CHANNELS: Dict[str, Channel] = {
    # ATLAS H→γγ, Phys. Lett. B 716 (2012) 1: 35,251 candidates in 100-160 GeV in 5.9 fb^-1
    # at 8 TeV (≈85 /fb/GeV near 125 GeV, i.e. ≈190 at 13 TeV), σ_m ≈ 1.7 GeV inclusive,
    # signal efficiency × acceptance ≈ 0.31 (expected ~100 signal events in that sample).
    "diphoton": Channel("diphoton", "γγ", 0.0136, 1.35, 0.010, 0.31, 190.0, 125.0, 6.0, 4.5, "gg"),
    # CMS H→ZZ→4ℓ, Phys. Lett. B 716 (2012) 30 and JHEP 11 (2017) 047: σ_m/m ≈ 1-2%,
    # A×ε ≈ 0.3-0.6 (0.45 used), ZZ* continuum ≈ 0.1 events /fb/GeV near 125 GeV.
    "four_lepton": Channel("four_lepton", "ℓℓℓℓ", 0.014, 1.3, 0.008, 0.45, 0.10, 125.0, 1.0, 0.5, "qq"),
    # CMS Z→μμ, JHEP 10 (2011) 132: A×ε ≈ 0.4-0.5, σ_m/m ≈ 1.5% at the Z pole;
    # Drell-Yan continuum ≈ 1% of the Z yield in 60-120 GeV. TeV muons: σ_m/m ≈ 5-8%
    # (ATLAS dilepton search, Phys. Lett. B 796 (2019) 68) — resolution grows with mass.
    "dimuon": Channel("dimuon", "μ⁺μ⁻", 0.015, 1.4, 0.006, 0.45, 160.0, 91.19, 9.0, 4.2, "qq"),
    # ATLAS dielectron, Phys. Lett. B 796 (2019) 68: σ_m/m ≈ 1-2%, A×ε ≈ 0.7 at TeV masses.
    "dielectron": Channel("dielectron", "e⁺e⁻", 0.012, 1.5, 0.010, 0.55, 150.0, 91.19, 9.0, 4.2, "qq"),
    # CMS dijet search, JHEP 08 (2018) 130: σ_m/m ≈ 5-10%; the QCD continuum dominates.
    "dijet": Channel("dijet", "jj", 0.07, 1.25, 0.020, 0.55, 10.0, 2000.0, 9.0, 5.0, "gg"),
}

# Trigger efficiency for each channel it records (published Run-2 plateau values,
# rounded; a trigger not listed for a channel records none of it).
TRIGGERS: Dict[str, Mapping[str, float]] = {
    "diphoton": {"diphoton": 0.95},
    "single_lepton": {"dimuon": 0.90, "dielectron": 0.92, "four_lepton": 0.97},
    "dilepton": {"dimuon": 0.96, "dielectron": 0.97, "four_lepton": 0.99},
    "single_jet": {"dijet": 0.99, "diphoton": 0.05},
    "minimum_bias": {name: 0.002 for name in CHANNELS},
}


@dataclass(frozen=True)
class Reconstruction:
    """Offline selection quality: tighter identification trades signal for purity."""

    name: str
    signal_efficiency_factor: float
    background_efficiency_factor: float
    resolution_factor: float
    days: float
    cost_musd: float


RECONSTRUCTIONS: Dict[str, Reconstruction] = {
    "fast": Reconstruction("fast", 1.00, 1.60, 1.25, 1.0, 0.2),
    "standard": Reconstruction("standard", 1.00, 1.00, 1.00, 4.0, 0.8),
    "tight": Reconstruction("tight", 0.85, 0.55, 0.95, 6.0, 1.2),
}

MAX_CALIBRATION_LEVEL = 2
# Residual energy-scale bias and resolution factor after 0, 1, 2 calibrations.
CALIBRATION_BIAS_FACTOR = (1.0, 0.2, 0.05)


def calibration_resolution_factor(channel: Channel, level: int) -> float:
    """Resolution multiplier after `level` calibrations (uncalibrated → calibrated → refined)."""
    return (channel.uncalibrated_resolution_factor, 1.0, 0.93)[level]


def mass_resolution_gev(channel: Channel, mass_gev, calibration_level: int, reconstruction: str, pileup: str):
    """Gaussian mass resolution σ_m [GeV] of `channel` at `mass_gev` (scalar or array)."""
    rel = channel.resolution_frac * calibration_resolution_factor(channel, calibration_level)
    rel *= RECONSTRUCTIONS[reconstruction].resolution_factor
    rel = np.hypot(rel, PILEUP_SETTINGS[pileup].resolution_penalty_frac)
    if channel.name == "dimuon":  # sagitta resolution: σ(p)/p grows ∝ p for TeV muons
        rel = np.hypot(rel, 0.05 * np.asarray(mass_gev) / 3000.0)
    return rel * mass_gev


def expected_background_events(
    channel: Channel, edges_gev: np.ndarray, sqrt_s_tev: float, luminosity_fb: float
) -> np.ndarray:
    """Expected background per mass bin before trigger and reconstruction efficiencies."""
    from cernenv.physics.shapes import background_density, integrate_bins, simpson_nodes

    nodes = simpson_nodes(edges_gev)
    density = background_density(nodes, sqrt_s_tev, channel.background_p1, channel.background_p2)
    # Normalised at the reference mass at the same √s: the energy dependence of the
    # rate comes from `cross_section_scale` alone, the shape from x = m/√s.
    at_reference = background_density(
        np.array([channel.reference_mass_gev]), sqrt_s_tev, channel.background_p1, channel.background_p2
    )[0]
    per_bin = integrate_bins(density, edges_gev) / at_reference
    scale = cross_section_scale(channel.reference_mass_gev, sqrt_s_tev, channel.background_production)
    return channel.background_per_fb_per_gev * scale * luminosity_fb * per_bin
