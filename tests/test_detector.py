"""Cross sections reproduce the published values they cite, at every √s a campaign offers."""

from __future__ import annotations

import numpy as np
import pytest

from cernenv.detector import BEAM_ENERGIES, PRODUCTION_REFERENCES, cross_section_scale
from cernenv.scenarios import CURATED

# (production, √s [TeV], published value, its unit, what it is)
CITED = [
    ("gg", 7.0, 19.1, "pb", "σ(pp→H), YR4"),
    ("gg", 8.0, 24.3, "pb", "σ(pp→H), YR4"),
    ("gg", 13.0, 55.1, "pb", "σ(pp→H), YR4"),
    ("gg", 13.6, 59.9, "pb", "σ(pp→H) SM, ATLAS EPJC 84 (2024) 78"),
    ("gg", 14.0, 62.1, "pb", "σ(pp→H), YR4"),
    ("qq", 7.0, 0.974, "nb", "σ·B(Z→ℓℓ), CMS JHEP 10 (2011) 132"),
    ("qq", 8.0, 1.15, "nb", "σ·B(Z→ℓℓ), CMS PRL 112 (2014) 191802"),
    ("qq", 13.0, 1.981, "nb", "σ·B(Z→ℓℓ), ATLAS PLB 759 (2016) 601"),
]


@pytest.mark.parametrize("production, sqrt_s_tev, published, unit, what", CITED)
def test_cross_section_reproduces_its_citation(production, sqrt_s_tev, published, unit, what):
    """The simulated Higgs (gg) and Z (qq̄) rates at √s are the cited values, within 2%."""
    truth = CURATED["higgs_diphoton_125"].truth if production == "gg" else CURATED["z_mumu_91"].truth
    if production == "gg":  # σ·B(γγ) back to σ(pp→H) [pb]
        simulated = truth.sigma_br_fb["diphoton"] / 2.27e-3 * 1e-3
    else:  # σ·B(μμ) [nb]
        simulated = truth.sigma_br_fb["dimuon"] * 1e-6
    simulated *= cross_section_scale(truth.mass_gev, sqrt_s_tev, truth.production)
    assert simulated == pytest.approx(published, rel=0.02), f"{what} at {sqrt_s_tev:g} TeV"


def test_every_offered_beam_energy_is_covered_by_a_reference():
    """Each √s a campaign offers lies within (or at the edge of) the gg references; qq is
    extended from 13 TeV to 13.6 TeV by the 8 → 13 TeV power law."""
    offered = {e for scenario in CURATED.values() for e in scenario.beam_energies_tev} | set(BEAM_ENERGIES)
    gg = PRODUCTION_REFERENCES["gg"][1]
    assert offered <= set(gg) | {e for e in offered if min(gg) <= e <= max(gg)}
    qq_136 = cross_section_scale(91.1876, 13.6, "qq")
    slope = np.log(1.981 / 1.15) / np.log(13.0 / 8.0)
    assert qq_136 == pytest.approx((13.6 / 13.0) ** slope, rel=1e-9)


def test_heavy_states_gain_more_from_energy_than_light_ones():
    """The high-x fall-off: a 4 TeV state gains 20-40% from 13 to 13.6 TeV, a 125 GeV one ~9%;
    nothing is produced at or above √s; the scale is 1 at 13 TeV for every mass."""
    light = cross_section_scale(125.09, 13.6, "gg")
    heavy = cross_section_scale(4000.0, 13.6, "qq")
    assert light == pytest.approx(59.9 / 55.1, rel=1e-9)
    assert 1.2 < heavy < 1.4 and heavy > cross_section_scale(91.1876, 13.6, "qq")
    assert cross_section_scale(8000.0, 8.0, "gg") == 0.0
    for mass in (50.0, 125.0, 1000.0, 5000.0):
        for production in ("gg", "qq"):
            assert cross_section_scale(mass, 13.0, production) == pytest.approx(1.0, rel=1e-12)
