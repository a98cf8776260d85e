"""The grade of a discovery claim: it asks for global evidence, reads the truth only for a
supported claim, and can be withheld; an evaluation world cannot be replayed or bisected."""

from __future__ import annotations

import json
from typing import Any, Dict, Iterator, List

import numpy as np
import pytest

from cernenv.environment import CERNCollisionEnvironment
from cernenv.models import DiscoveryClaim
from cernenv.rewards import (
    CORRECT_DISCOVERY,
    CORRECT_NULL,
    CORRECT_OBSERVATION,
    EVIDENCE_Z_GLOBAL,
    FALSE_DISCOVERY,
    MAX_CLAIM_UNCERTAINTY_FRAC,
    MISSED_DISCOVERY,
    NO_CLAIM,
    UNSUPPORTED_DISCOVERY,
    UNSUPPORTED_NULL,
    WRONG_MASS_DISCOVERY,
    grade_claim,
    mass_is_correct,
)
from cernenv.scenarios import procedural_scenario

PARTICLE = {"exists": True, "mass_gev": 1000.0, "width_gev": 1.0, "spin": 1, "channels": ["dimuon"]}
NOTHING = {"exists": False, "mass_gev": None, "width_gev": None, "spin": None, "channels": []}


def claim(discovered=True, mass=1000.0, uncertainty=10.0, significance=4.0, confidence=0.8, **extra):
    if not discovered:
        return DiscoveryClaim(discovered=False, significance_sigma=significance, confidence=confidence)
    return DiscoveryClaim(
        discovered=True,
        mass_gev=mass,
        mass_uncertainty_gev=uncertainty,
        channel=extra.get("channel", "dimuon"),
        spin=extra.get("spin", 1),
        significance_sigma=significance,
        confidence=confidence,
    )


def grade(c, truth, z=4.0, analysed=1.0, budget_left=0.5):
    return grade_claim(
        c, truth, reference_z_global=z, luminosity_analysed_fraction=analysed, budget_left_fraction=budget_left
    )


class Untouchable(dict):
    """A truth that fails the test if the grader reads any of it."""

    def __getitem__(self, key):
        raise AssertionError(f"the grader read the truth ({key!r}) for an unsupported claim")

    get = __getitem__

    def __bool__(self):
        raise AssertionError("the grader looked at the truth for an unsupported claim")


# The grading rule -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "c, z, analysed, outcome",
    [
        (claim(), EVIDENCE_Z_GLOBAL - 0.01, 1.0, UNSUPPORTED_DISCOVERY),
        (claim(), 0.0, 0.0, UNSUPPORTED_DISCOVERY),
        (claim(discovered=False), 0.0, 0.2499, UNSUPPORTED_NULL),
        (None, 0.0, 1.0, NO_CLAIM),
    ],
)
def test_an_unsupported_claim_is_graded_without_reading_the_truth(c, z, analysed, outcome):
    """Below the evidence bars the grade is the same in every hidden world: the grader never
    even reads the truth (a truth that raises when touched goes unnoticed)."""
    graded = grade(c, Untouchable(), z=z, analysed=analysed)
    assert graded.components["outcome"] == outcome
    assert graded.correct_outcome is False
    assert graded.correct_mass is graded.correct_channel is graded.correct_spin is None
    for truth in (PARTICLE, NOTHING):
        assert grade(c, truth, z=z, analysed=analysed) == graded


@pytest.mark.parametrize(
    "c, truth, z, outcome, correct",
    [
        (claim(), PARTICLE, 3.0, CORRECT_DISCOVERY, True),
        (claim(), PARTICLE, 5.0, CORRECT_OBSERVATION, True),
        (claim(mass=1200.0), PARTICLE, 6.0, WRONG_MASS_DISCOVERY, False),
        (claim(), NOTHING, 3.5, FALSE_DISCOVERY, False),
        (claim(discovered=False), NOTHING, 0.0, CORRECT_NULL, True),
        (claim(discovered=False), PARTICLE, 0.0, MISSED_DISCOVERY, False),
    ],
)
def test_a_supported_claim_is_graded_against_the_truth(c, truth, z, outcome, correct):
    graded = grade(c, truth, z=z, analysed=0.25)
    assert graded.components["outcome"] == outcome and graded.correct_outcome is correct
    assert (graded.components["efficiency"] > 0) is correct


def test_misstating_the_significance_costs_both_ways():
    """Beyond 1σ of the reference global Z, each σ costs 0.5 (at most 2), over or under."""
    cost = {
        claimed: grade(claim(significance=claimed), PARTICLE, z=5.0).components["significance_calibration"]
        for claimed in (0.0, 3.0, 4.0, 5.0, 6.0, 7.0, 12.0)
    }
    assert cost == {0.0: -2.0, 3.0: -0.5, 4.0: 0.0, 5.0: 0.0, 6.0: 0.0, 7.0: -0.5, 12.0: -2.0}


def test_the_mass_window_is_symmetric_about_the_true_mass():
    """The same claimed uncertainty is right at the same distance above and below, and a vaguer
    claim than 5% of the mass is graded as 5%: no cliff between 997 ± 49.75 and 1003 ± 50.05."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        true = float(rng.uniform(50, 5000))
        sigma = float(true * rng.uniform(0.0, 0.1))
        offset = float(true * rng.uniform(0.0, 0.25))
        assert mass_is_correct(true + offset, sigma, true) == mass_is_correct(true - offset, sigma, true)
    assert mass_is_correct(997.0, 49.75, 1000.0) and mass_is_correct(1003.0, 50.05, 1000.0)
    cap = MAX_CLAIM_UNCERTAINTY_FRAC * 1000.0
    window = 2.0 * np.hypot(cap, 1.0)
    assert mass_is_correct(1000.0 + 0.999 * window, 500.0, 1000.0)
    assert not mass_is_correct(1000.0 + 1.001 * window, 500.0, 1000.0)


# Every component of the grade, from the rule as docs/environment.md states it ---------------
#
# Each case lists all nine terminal components. The values come from the documented rules, not
# from the code: outcome (the table of grades), mass (+1 inside the window, −0.5 outside), channel
# (+0.5 / −0.25), spin (+0.5 / −0.25, 0 not claimed), all three 0 unless the discovery is supported
# and the particle real; significance_calibration (−0.5 per σ beyond 1σ of the reference global Z,
# for a discovery only); confidence_calibration 0.5·(1 − 2·(confidence − correct)²) with correct = 1
# only for a correct outcome; efficiency 0.5 × the budget fraction left, for a correct outcome only.
# Confidences 0.75 and 1.0 and budget fractions 0.5 and 0.25 keep every expected value exact in
# binary floating point, so the comparison is exact.

ZERO = dict.fromkeys(
    ("outcome", "mass", "channel", "spin", "significance_calibration", "confidence_calibration", "efficiency"), 0.0
)


def expect(**components: float) -> Dict[str, float]:
    return {**ZERO, **components}


# confidence 0.75 against a correct outcome: 0.5·(1 − 2·0.25²) = 0.4375; against a wrong one:
# 0.5·(1 − 2·0.75²) = −0.0625. Budget left 0.5: efficiency 0.5·0.5 = 0.25.
RIGHT, WRONG = 0.4375, -0.0625
COMPONENT_CASES = {
    # right mass, channel and spin, claimed 4σ at a reference 4σ: +3 +1 +0.5 +0.5
    "right mass, channel and spin": (
        claim(confidence=0.75),
        PARTICLE,
        4.0,
        expect(
            outcome=CORRECT_DISCOVERY, mass=1.0, channel=0.5, spin=0.5, confidence_calibration=RIGHT, efficiency=0.25
        ),
        (True, True, True, True),
    ),
    # the same at a reference 5σ: an observation, +4; the claimed 4σ is within 1σ of 5σ: no cost
    "an observation": (
        claim(confidence=0.75),
        PARTICLE,
        5.0,
        expect(
            outcome=CORRECT_OBSERVATION, mass=1.0, channel=0.5, spin=0.5, confidence_calibration=RIGHT, efficiency=0.25
        ),
        (True, True, True, True),
    ),
    # 1100 ± 10 GeV against 1000: outside the window 2·√(10² + 1²) ≈ 20.1 GeV, so −2 and mass −0.5;
    # the channel and spin are still graded (+0.5 each), and the outcome is not correct
    "wrong mass": (
        claim(mass=1100.0, confidence=0.75),
        PARTICLE,
        4.0,
        expect(outcome=WRONG_MASS_DISCOVERY, mass=-0.5, channel=0.5, spin=0.5, confidence_calibration=WRONG),
        (False, False, True, True),
    ),
    # a wrong channel costs 0.25 and leaves a correct outcome (the outcome follows the mass)
    "wrong channel": (
        claim(channel="dielectron", confidence=0.75),
        PARTICLE,
        4.0,
        expect(
            outcome=CORRECT_DISCOVERY, mass=1.0, channel=-0.25, spin=0.5, confidence_calibration=RIGHT, efficiency=0.25
        ),
        (True, True, False, True),
    ),
    # a wrong spin costs 0.25
    "wrong spin": (
        claim(spin=2, confidence=0.75),
        PARTICLE,
        4.0,
        expect(
            outcome=CORRECT_DISCOVERY, mass=1.0, channel=0.5, spin=-0.25, confidence_calibration=RIGHT, efficiency=0.25
        ),
        (True, True, True, False),
    ),
    # a spin not claimed is worth 0 (and is not the right spin)
    "spin not claimed": (
        claim(spin=None, confidence=0.75),
        PARTICLE,
        4.0,
        expect(outcome=CORRECT_DISCOVERY, mass=1.0, channel=0.5, confidence_calibration=RIGHT, efficiency=0.25),
        (True, True, True, False),
    ),
    # a supported discovery where there is nothing: −3, nothing else graded; confidence 1.0 against
    # a wrong outcome is the worst Brier score, 0.5·(1 − 2·1²) = −0.5
    "false discovery": (
        claim(confidence=1.0),
        NOTHING,
        4.0,
        expect(outcome=FALSE_DISCOVERY, confidence_calibration=-0.5),
        (False, None, None, None),
    ),
    # a discovery below the 3σ evidence bar: −2 whatever the truth; claimed 4σ at a reference 2σ is
    # 1σ beyond the tolerance: −0.5
    "unsupported discovery": (
        claim(confidence=0.75),
        PARTICLE,
        2.0,
        expect(outcome=UNSUPPORTED_DISCOVERY, significance_calibration=-0.5, confidence_calibration=WRONG),
        (False, None, None, None),
    ),
    # "nothing there" with enough luminosity analysed and nothing there: +3, correct; a null claim
    # has no significance to calibrate, whatever it says (here 4σ against a reference 0)
    "correct null": (
        claim(discovered=False, confidence=0.75),
        NOTHING,
        0.0,
        expect(outcome=CORRECT_NULL, confidence_calibration=RIGHT, efficiency=0.25),
        (True, None, None, None),
    ),
    # "nothing there" where a particle is: −1, and mass, channel and spin all count as missed
    "missed discovery": (
        claim(discovered=False, confidence=0.75),
        PARTICLE,
        0.0,
        expect(outcome=MISSED_DISCOVERY, confidence_calibration=WRONG),
        (False, False, False, False),
    ),
}


@pytest.mark.parametrize("case", list(COMPONENT_CASES))
def test_every_component_of_the_grade(case):
    c, truth, z, components, (correct, mass, channel, spin) = COMPONENT_CASES[case]
    graded = grade(c, truth, z=z, analysed=1.0, budget_left=0.5)
    assert graded.components == components
    assert (graded.correct_outcome, graded.correct_mass, graded.correct_channel, graded.correct_spin) == (
        correct,
        mass,
        channel,
        spin,
    )
    assert graded.discovered is c.discovered


@pytest.mark.parametrize(
    "c, analysed, outcome",
    [
        (claim(discovered=False, confidence=0.75), 0.2, UNSUPPORTED_NULL),  # under 25% of the cap analysed: −1
        (None, 1.0, NO_CLAIM),  # no claim: −1, and no confidence to calibrate
    ],
)
def test_each_null_ending_without_evidence(c, analysed, outcome):
    """An unsupported null claim is not correct, so its confidence is scored against 0: 0.75 gives
    0.5·(1 − 2·0.75²) = −0.0625. No claim has nothing but its outcome."""
    for truth in (PARTICLE, NOTHING):
        graded = grade(c, truth, z=0.0, analysed=analysed, budget_left=0.5)
        confidence = 0.0 if c is None else WRONG
        assert graded.components == expect(outcome=outcome, confidence_calibration=confidence)
        assert graded.correct_outcome is False and graded.discovered is False


@pytest.mark.parametrize(
    "confidence, correct, expected",
    [
        # 0.5·(1 − 2·(c − t)²): perfect confidence pays 0.5, the opposite −0.5, and 0.5 pays 0.25 either way
        (1.0, True, 0.5),
        (0.0, True, -0.5),
        (0.0, False, 0.5),
        (1.0, False, -0.5),
        (0.5, True, 0.25),
        (0.5, False, 0.25),
    ],
)
def test_confidence_is_scored_against_whether_the_outcome_was_correct(confidence, correct, expected):
    truth = NOTHING if correct else PARTICLE
    graded = grade(claim(discovered=False, confidence=confidence), truth, z=0.0)
    assert graded.correct_outcome is correct
    assert graded.components["confidence_calibration"] == expected


@pytest.mark.parametrize(
    "budget_left, efficiency",
    [
        (0.25, 0.125),  # 0.5 × 0.25
        (1.0, 0.5),  # nothing spent: the whole 0.5
        (-0.01, 0.0),  # overspent within the tolerance: no budget left, nothing paid
        (1.5, 0.5),  # a fraction left is at most 1
    ],
)
def test_efficiency_pays_the_budget_left_for_a_correct_outcome(budget_left, efficiency):
    assert (
        grade(claim(discovered=False), NOTHING, z=0.0, budget_left=budget_left).components["efficiency"] == efficiency
    )
    assert grade(claim(discovered=False), PARTICLE, z=0.0, budget_left=budget_left).components["efficiency"] == 0.0


def test_the_mass_window_is_two_sigma_with_the_resolution_floor():
    """The window is 2·√(σ² + (0.001·m)²): with no claimed uncertainty it is 2·0.001·1000 = 2 GeV
    either side of 1000 GeV; with σ = 3 GeV it is 2·√(9 + 1) ≈ 6.32 GeV."""
    assert mass_is_correct(1001.99, 0.0, 1000.0) and mass_is_correct(998.01, 0.0, 1000.0)
    assert mass_is_correct(1002.0, 0.0, 1000.0) and mass_is_correct(998.0, 0.0, 1000.0), "the edge is inside (≤)"
    assert not mass_is_correct(1002.01, 0.0, 1000.0) and not mass_is_correct(997.99, 0.0, 1000.0)
    window = 2.0 * np.sqrt(10.0)
    assert mass_is_correct(1000.0 + window - 0.01, 3.0, 1000.0)
    assert not mass_is_correct(1000.0 + window + 0.01, 3.0, 1000.0)


# The environment's grade, withheld grades and fresh worlds --------------------------------

BLIND = {
    "action_type": "submit_discovery_claim",
    "parameters": {
        "discovered": True,
        "mass_gev": 300.0,
        "mass_uncertainty_gev": 3.0,
        "channel": "diphoton",
        "spin": 0,
        "significance_sigma": 5.0,
        "confidence": 0.9,
    },
}


def answers(env: CERNCollisionEnvironment, actions: List[Dict[str, Any]], **reset: Any) -> Iterator[str]:
    """Everything the environment tells an agent, as JSON: the reset view, each observation and
    the state after each step."""
    yield env.reset(**reset).model_dump_json()
    for action in actions:
        observation = env.step(action)
        state = env.state.model_dump()
        state.pop("episode_id")
        yield observation.model_dump_json() + json.dumps(state, sort_keys=True)


def _same_config_seeds(difficulty: str, count: int = 200):
    """Procedural seeds grouped by visible configuration, with and without a particle."""
    groups: Dict[tuple, Dict[bool, List[int]]] = {}
    for seed in range(count):
        scenario = procedural_scenario(seed, difficulty)
        key = (scenario.search_window_gev, scenario.channels)
        groups.setdefault(key, {True: [], False: []})[scenario.truth is not None].append(seed)
    return {key: seeds for key, seeds in groups.items() if seeds[True] and seeds[False]}


def test_a_blind_claim_gets_the_same_answer_in_every_hidden_world():
    """A claim made without data, in tasks with and without a particle of one visible configuration:
    the grade and everything else the environment says are the same, up to the episode id."""
    env = CERNCollisionEnvironment()
    compared = 0
    for seeds in list(_same_config_seeds("medium").values())[:4]:
        window = procedural_scenario(seeds[True][0], "medium").search_window_gev
        action = json.loads(json.dumps(BLIND))
        channel = procedural_scenario(seeds[True][0], "medium").channels[0]
        action["parameters"].update(mass_gev=float(np.mean(window)), channel=channel)
        said = {
            exists: {json.dumps(list(answers(env, [action], seed=seed, difficulty="medium"))[1:]) for seed in group[:3]}
            for exists, group in seeds.items()
        }
        assert len(said[True] | said[False]) == 1
        compared += 1
    assert compared >= 3


def _take_diphoton_data(env: CERNCollisionEnvironment, seed: int, luminosity_fb: float) -> None:
    """Reset `env` to higgs_diphoton_125 (`seed`) and collect `luminosity_fb` of diphoton data."""
    env.reset(seed=seed, scenario="higgs_diphoton_125")
    for verb, parameters in [
        ("configure_beam", {"beam_energy_tev": 13.6}),
        ("set_trigger", {"trigger": "diphoton"}),
        ("allocate_luminosity", {"luminosity_fb": luminosity_fb}),
        ("collect_collisions", {"luminosity_fb": luminosity_fb}),
    ]:
        assert not env.step({"action_type": verb, "parameters": parameters}).rule_violations


def _reference_spectrum(env: CERNCollisionEnvironment):
    """The diphoton spectrum the grader builds for its reference analysis (its own construction, read here)."""
    episode = env._episode
    lo, hi = episode.scenario.search_window_gev
    width = env._default_bin_width("diphoton", lo, hi)
    return episode.recorder.build_spectrum("diphoton", (lo, hi), width, episode.beam_energy_tev, episode.pileup)


def _claim_the_higgs_after(luminosity_fb: float):
    """Plays higgs_diphoton_125 (seed 0) to `luminosity_fb` of diphoton data, then claims the Higgs at
    its true mass (125 GeV) with 3σ. Returns the grade and the reference analysis's local and global
    significance at the claim (`analysis.GlobalSignificance`), from the spectrum the grader builds (the
    grader's own construction, read here)."""
    from cernenv import analysis

    env = CERNCollisionEnvironment()
    _take_diphoton_data(env, 0, luminosity_fb)
    spectrum = _reference_spectrum(env)
    background = analysis.background_fit(spectrum)
    local = analysis.local_significance(spectrum, 125.0, 0.0, background)
    reference = analysis.global_significance(spectrum, 125.0, local, background)
    action = json.loads(json.dumps(BLIND))
    action["parameters"].update(mass_gev=125.0, mass_uncertainty_gev=0.5, significance_sigma=3.0)
    observation = env.step(action)
    assert not observation.rule_violations
    return env.episode_grade(), reference, observation


def test_the_grade_asks_for_the_look_elsewhere_corrected_significance():
    """With 20 fb⁻¹ the true Higgs stands at local Z 3.39 but global Z 2.34 over the 110-160 GeV
    window: evidence is global Z >= 3, so a claim at the right mass is an unsupported discovery
    (−2), where a grade read from the local Z would pay a correct one (+3). With 40 fb⁻¹ the global
    Z passes 3 (3.10) and the same claim is graded against the truth. The reference's global Z is the
    physics module's look-elsewhere formula at the same local Z and upcrossings: one formula."""
    from cernenv.physics.significance import global_significance_from_upcrossings

    grade_20, reference_20, _ = _claim_the_higgs_after(20.0)
    assert reference_20.z_local >= EVIDENCE_Z_GLOBAL > reference_20.z_global
    assert reference_20.local_method == "asymptotic"
    p_global, z_global, _ = global_significance_from_upcrossings(reference_20.z_local, reference_20.upcrossings_z1)
    assert (p_global, z_global) == pytest.approx((reference_20.p_global, reference_20.z_global), rel=1e-9)
    assert grade_20["reference_z_global"] == pytest.approx(reference_20.z_global, abs=1e-3)
    assert grade_20["components"]["outcome"] == UNSUPPORTED_DISCOVERY and grade_20["correct_mass"] is None
    grade_40, reference_40, _ = _claim_the_higgs_after(40.0)
    assert reference_40.z_global >= EVIDENCE_Z_GLOBAL
    assert grade_40["components"]["outcome"] == CORRECT_DISCOVERY and grade_40["correct_mass"] is True


def test_the_claim_s_step_reports_the_grade_it_records():
    """The claim's step says it was graded, with the reference's global Z to 3 significant figures
    (the same number the evaluator's `episode_grade` holds) and each component to 3 significant
    figures: what an agent reads is short, and the same on every processor."""
    grade, reference, observation = _claim_the_higgs_after(40.0)
    result = observation.latest_result
    assert result["graded"] is True
    three_figures = float(f"{reference.z_global:.3g}")
    assert result["reference_z_global"] == grade["reference_z_global"] == three_figures
    assert float(f"{reference.z_global:.4g}") != three_figures, "a Z whose 4th figure is not 0, so rounding shows"
    assert {name: result[name] for name in grade["components"]} == {
        name: float(f"{value:.3g}") for name, value in grade["components"].items()
    }


def _ended_without_a_discovery_supported(
    env: CERNCollisionEnvironment, claim_parameters: Dict[str, Any], seed: int = 0, luminosity_fb: float = 10.0
):
    """Play higgs_diphoton_125 (`seed`) to `luminosity_fb` of diphoton data and claim `claim_parameters`:
    the step's result and the evaluator's grade."""
    _take_diphoton_data(env, seed, luminosity_fb)
    observation = env.step({"action_type": "submit_discovery_claim", "parameters": claim_parameters})
    assert not observation.rule_violations and observation.done
    return observation.latest_result, env.episode_grade()


@pytest.mark.parametrize(
    "case, change",
    [
        ("nothing there", {"discovered": False, "mass_gev": None, "mass_uncertainty_gev": None, "channel": None}),
        ("a channel never recorded", {"channel": "four_lepton"}),
        ("at the window's low edge", {"mass_gev": 110.0}),
        ("at the window's high edge", {"mass_gev": 160.0}),
        ("outside the window", {"mass_gev": 300.0}),
    ],
)
def test_the_reference_z_is_zero_where_the_grader_builds_no_spectrum(case, change):
    """The grader builds its reference spectrum only for a discovery claimed in a recorded channel
    strictly inside the search window (110-160 GeV here); any other claim is graded at a reference
    global Z of 0 (so it is not evidence), and says so. Seed 8 with 20 fb⁻¹ is a world whose
    reference analysis reads a global Z above 0 at both edges of the window (checked below), so a
    grader that took an edge for inside would show it."""
    parameters = {**BLIND["parameters"], "mass_gev": 125.0, "mass_uncertainty_gev": 0.5}
    parameters = {key: value for key, value in {**parameters, **change}.items() if value is not None}
    env = CERNCollisionEnvironment()
    result, grade = _ended_without_a_discovery_supported(env, parameters, seed=8, luminosity_fb=20.0)
    assert result["reference_z_global"] == grade["reference_z_global"] == 0.0, case
    lo, hi = env._episode.scenario.search_window_gev
    spectrum = _reference_spectrum(env)
    assert (lo, hi) == (110.0, 160.0)
    assert all(env._significance(spectrum, edge, False, None)["z_global"] > 0.5 for edge in (lo, hi))


def test_the_reference_z_is_zero_where_the_reference_fit_finds_no_excess():
    """A discovery claimed at a mass where the reference fit finds no excess (its local Z is 0 there)
    is graded at a reference global Z of exactly 0, not at some default above it."""
    from cernenv import analysis

    env = CERNCollisionEnvironment()
    parameters = {**BLIND["parameters"], "mass_gev": 125.0, "mass_uncertainty_gev": 0.5}
    _ended_without_a_discovery_supported(env, parameters)
    spectrum = _reference_spectrum(env)
    background = analysis.background_fit(spectrum)
    deficit = next(
        mass
        for mass in np.arange(112.0, 158.0, 0.5)
        if analysis.local_significance(spectrum, float(mass), 0.0, background).z_local <= 0.0
    )
    result, grade = _ended_without_a_discovery_supported(env, {**parameters, "mass_gev": float(deficit)})
    assert result["reference_z_global"] == grade["reference_z_global"] == 0.0


def test_withheld_grades_say_only_whether_a_claim_was_recorded():
    """With grades withheld, the step that ends an episode says whether a claim was recorded and that
    the grade waits for the evaluation's end, and nothing else: a claim, or an end without one."""
    env = CERNCollisionEnvironment(withhold_grades=True)
    result, grade = _ended_without_a_discovery_supported(env, {**BLIND["parameters"], "mass_gev": 125.0})
    assert result == {
        "action": "submit_discovery_claim",
        "claim_recorded": True,
        "grade": "withheld until the evaluation ends",
    }
    assert grade["components"]["outcome"] == UNSUPPORTED_DISCOVERY
    limited = CERNCollisionEnvironment(default_max_steps=1, withhold_grades=True)
    limited.reset(seed=0, scenario="higgs_diphoton_125")
    observation = limited.step({"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6}})
    assert observation.done
    assert observation.latest_result["claim_recorded"] is False
    assert observation.latest_result["grade"] == "withheld until the evaluation ends"
    assert "graded" not in observation.latest_result and limited.state.correct_outcome is None
    assert limited.episode_grade()["components"]["outcome"] == NO_CLAIM


def test_withheld_grades_are_kept_for_the_evaluator_alone():
    env = CERNCollisionEnvironment(withhold_grades=True)
    seen = list(answers(env, [BLIND], seed=3, scenario="higgs_diphoton_125"))
    observation = env.step({"action_type": "select_channel", "parameters": {"channel": "diphoton"}})
    assert observation.done and observation.rule_violations[0].startswith("EPISODE_DONE")
    text = "".join(seen)
    for hidden in ('"outcome"', "confidence_calibration", "significance_calibration", "efficiency", "graded"):
        assert hidden not in text, hidden
    state = env.state
    assert state.terminal_reward is None and state.correct_outcome is None and "outcome" not in state.reward_components
    grade = env.episode_grade()
    assert grade["components"]["outcome"] == UNSUPPORTED_DISCOVERY and grade["correct_outcome"] is False


def test_fresh_worlds_make_every_reset_of_a_seed_a_new_world(monkeypatch):
    import cernenv.environment

    # the nonces each reset draws, fixed here so that which worlds hold a particle (0.85 of easy ones)
    # does not rest on chance: a run of 12 fresh random nonces gives 5 truths or fewer about once in 14,000
    drawn = iter(f"{index:032x}" for index in range(12))
    monkeypatch.setattr(cernenv.environment.secrets, "token_hex", lambda n_bytes: next(drawn))
    fresh = CERNCollisionEnvironment(secret_salt="an evaluation secret", fresh_worlds=True)
    truths, nonces = set(), set()
    for _ in range(12):
        fresh.reset(seed=902_100, difficulty="easy")
        truths.add(json.dumps(fresh.hidden_truth(), sort_keys=True))
        nonces.add(fresh.world_nonce())
    assert len(nonces) == 12 and len(truths) >= 6 and next(drawn, None) is None, "a nonce drawn at every reset"
    same = CERNCollisionEnvironment(secret_salt="an evaluation secret")
    for _ in range(3):
        same.reset(seed=902_100, difficulty="easy")
        truths.add(json.dumps(same.hidden_truth(), sort_keys=True))
    assert same.world_nonce() == ""


def _bisect_mass(env: CERNCollisionEnvironment, seed: int, lo: float, hi: float, queries: int) -> List[str]:
    """The attack an outside evaluator ran: reset the seed, claim blind at the middle of the
    interval with an uncertainty covering half of it, read every answer, keep the half the
    answer points to. Returns every answer it read."""
    read = []
    for _ in range(queries):
        middle = 0.5 * (lo + hi)
        action = json.loads(json.dumps(BLIND))
        action["parameters"].update(
            mass_gev=middle,
            mass_uncertainty_gev=max(0.25 * (hi - lo), 1e-3),
            channel=procedural_scenario(seed, "easy").channels[0],
        )
        said = list(answers(env, [action], seed=seed, difficulty="easy"))
        read.append(json.dumps(said[1:]))
        if "-2" in said[-1] or "unsupported" in said[-1]:
            lo = middle
        else:
            hi = middle
    return read


@pytest.mark.parametrize("withhold_grades", [True, False])
def test_bisecting_blind_claims_recovers_nothing(withhold_grades):
    """With the secret, fresh worlds and (or without) withheld grades, 29 blind claims per seed
    bisecting the window all get the same answer: there is nothing to bisect on."""
    env = CERNCollisionEnvironment(
        secret_salt="an evaluation secret", fresh_worlds=True, withhold_grades=withhold_grades
    )
    for seed in range(902_000, 902_005):
        window = procedural_scenario(seed, "easy").search_window_gev
        read = _bisect_mass(env, seed, *window, queries=29)
        # the claimed mass is echoed nowhere but in what the agent sent: the answers are identical
        assert len(set(read)) == 1, f"seed {seed}: {len(set(read))} different answers"
