"""Fuzzing `CERNCollisionEnvironment.step` with thousands of random, malformed and hostile actions.

Whatever an agent sends (valid verbs with ill-typed, missing, extra or non-finite
parameters, unknown verbs, non-dict inputs, nested junk), `step` must not raise, must
return a `CollisionObservation` that survives a JSON round trip, keep resources within
[0, total], advance `step_index` by one per step until the episode ends, and answer
`EPISODE_DONE` to everything after that.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cernenv.actions import ACTION_TABLE
from cernenv.detector import CHANNELS, TRIGGERS
from cernenv.environment import CERNCollisionEnvironment
from cernenv.models import ActionType, CernState, CollisionObservation, ExperimentAction

MIN_ACTIONS = 2000
VERBS = [a.value for a in ActionType]

HOSTILE_NUMBERS = [
    0,
    0.0,
    -0.0,
    -1,
    -1e-9,
    1e-320,
    5e-324,
    1e300,
    -1e300,
    1.7976931348623157e308,
    2**63,
    -(2**63),
    math.nan,
    math.inf,
    -math.inf,
]
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**20), 10**20), st.sampled_from(HOSTILE_NUMBERS)
)
ODD_WORDS = ["", " ", "\x00", "null", "NaN", "low", "tight", "sideband"]
words = st.one_of(st.text(max_size=24), st.sampled_from(VERBS + list(CHANNELS) + list(TRIGGERS) + ODD_WORDS))
leaves = st.one_of(st.none(), st.booleans(), numbers, words)
junk = st.recursive(
    leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(words, inner, max_size=3), max_leaves=8
)

# Sensible values, so that random sequences also get deep into the analysis chain. Hypothesis
# favours the first element of `sampled_from` and the bounds of ranges, so the first
# entries are the ones that work in higgs_4l_125.
SENSIBLE: Dict[str, st.SearchStrategy] = {
    "beam_energy_tev": st.sampled_from([13.6, 13.0, 7.0, 8.0]),
    "pileup": st.sampled_from(["nominal", "low", "high"]),
    "luminosity_fb": st.sampled_from([5.0, 2.0, 10.0, 0.01, 29.0]),
    "trigger": st.sampled_from(["dilepton", "single_lepton", "diphoton", "minimum_bias"]),
    "channel": st.sampled_from(["four_lepton", "dimuon", "four_lepton", "diphoton", None]),
    "quality": st.sampled_from(["standard", "tight", "fast"]),
    "mass_min_gev": st.sampled_from([115.0, 60.0, 150.0, 200.0]),
    "mass_max_gev": st.sampled_from([150.0, 100.0, 119.0, 300.0]),
    "bin_width_gev": st.sampled_from([1.0, 2.5, 0.5, 40.0]),
    "method": st.sampled_from(["fit", "sideband"]),
    "signal_region_gev": st.sampled_from([[120.0, 130.0], [85.0, 95.0], [150.0, 140.0]]),
    "mass_hint_gev": st.sampled_from([125.0, 91.2, 140.0, 60.0]),
    "float_width": st.booleans(),
    "step_gev": st.sampled_from([1.0, 3.0, 0.5, 50.0]),
    "mass_gev": st.sampled_from([125.0, 91.2, 124.0, 150.0, 60.0]),
    "window_sigma": st.sampled_from([2.0, 0.5, 5.0]),
    "discovered": st.booleans(),
    "mass_uncertainty_gev": st.sampled_from([0.5, 0.01, 5.0]),
    "spin": st.integers(0, 2),
    "significance_sigma": st.sampled_from([3.0, 0.0, 10.0]),
    "confidence": st.floats(0.0, 1.0),
}
# The analysis verbs first (see above).
VERB_ORDER = VERBS[7:] + VERBS[:7]


@st.composite
def parameters_for(draw, verb: str) -> Dict[str, Any]:
    params: Dict[str, Any] = {}
    for name in ACTION_TABLE[ActionType(verb)].params.model_fields:
        kind = draw(st.sampled_from(["sensible"] * 12 + ["junk", "number", "omit"]))
        if kind == "sensible":
            params[name] = draw(SENSIBLE[name])
        elif kind == "junk":
            params[name] = draw(junk)
        elif kind == "number":
            params[name] = draw(numbers)
    if draw(st.integers(0, 9)) == 0:
        params[draw(words)] = draw(junk)  # an extra field
    return params


@st.composite
def actions(draw) -> Any:
    kind = draw(
        st.sampled_from(
            ["valid"] * 8
            + ["model", "unknown_verb", "non_dict", "junk_dict", "no_verb", "bad_parameters", "extra_top_level"]
        )
    )
    verb = draw(st.sampled_from(VERB_ORDER))
    if kind == "valid":
        action = {"action_type": verb, "parameters": draw(parameters_for(verb))}
        if draw(st.booleans()):
            action["justification"] = draw(st.text(max_size=40))
        return action
    if kind == "model":
        return ExperimentAction(action_type=verb, parameters=draw(parameters_for(verb)))
    if kind == "unknown_verb":
        return {"action_type": draw(junk), "parameters": draw(junk)}
    if kind == "non_dict":
        return draw(st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=30), st.lists(junk, max_size=4)))
    if kind == "junk_dict":
        return draw(st.dictionaries(words, junk, max_size=4))
    if kind == "no_verb":
        return {"parameters": draw(parameters_for(verb))}
    if kind == "bad_parameters":
        return {"action_type": verb, "parameters": draw(st.one_of(junk, st.lists(junk, max_size=3)))}
    return {"action_type": verb, "parameters": draw(parameters_for(verb)), draw(words): draw(junk)}


# A valid start, so that a good share of the sequences reaches the spectrum and the fits.
PREFIX = [
    {"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6}},
    {"action_type": "set_trigger", "parameters": {"trigger": "dilepton"}},
    {"action_type": "allocate_luminosity", "parameters": {"luminosity_fb": 10.0}},
    {"action_type": "collect_collisions", "parameters": {"luminosity_fb": 10.0}},
    {"action_type": "reconstruct_tracks", "parameters": {"channel": "four_lepton"}},
    {"action_type": "select_channel", "parameters": {"channel": "four_lepton"}},
    {"action_type": "build_invariant_mass", "parameters": {}},
]


def check_observation(obs: Any, task_totals: Dict[str, float]) -> None:
    assert isinstance(obs, CollisionObservation)
    again = CollisionObservation.model_validate_json(obs.model_dump_json())
    assert again == obs
    assert obs.reward is not None and math.isfinite(obs.reward)
    assert len(obs.rule_violations) <= 1
    # every bad input is refused by validation with a code that says what to do, never by a
    # failure inside an action ("INVALID_PARAMETERS: could not run ...: OverflowError")
    assert not any("could not run" in violation for violation in obs.rule_violations), obs.rule_violations
    usage = obs.resource_usage
    for used, left, total in [
        (usage.budget_used_musd, usage.budget_remaining_musd, task_totals["budget"]),
        (usage.time_used_days, usage.time_remaining_days, task_totals["time"]),
        (usage.luminosity_used_fb, usage.luminosity_remaining_fb, task_totals["luminosity"]),
    ]:
        assert 0.0 <= used <= total * (1 + 1e-9)
        assert 0.0 <= left <= total * (1 + 1e-9)
    assert 0.0 <= usage.luminosity_allocated_fb <= task_totals["luminosity"] * (1 + 1e-9)


def test_step_survives_random_actions():
    sent: List[int] = [0]
    episodes_ended: List[int] = [0]

    @settings(
        max_examples=200,
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    @given(
        scenario=st.sampled_from(["higgs_4l_125", "higgs_4l_125", "z_mumu_91"]),
        seed=st.integers(0, 3),
        max_steps=st.sampled_from([None, None, 12]),
        prefix=st.sampled_from([0, 4, 6, 7, 7, 7]),
        batch=st.lists(actions(), min_size=10, max_size=20),
        claim=st.sampled_from([None, True, False]),
        claim_at=st.integers(0, 20),
    )
    def run(scenario, seed, max_steps, prefix, batch, claim, claim_at):
        env = CERNCollisionEnvironment(default_max_steps=max_steps)
        obs = env.reset(seed=seed, scenario=scenario)
        if claim is not None:  # a well-formed claim somewhere in the batch: grading, then EPISODE_DONE
            mass = 125.0 if scenario == "higgs_4l_125" else 91.2
            batch = (
                batch[:claim_at]
                + [
                    {
                        "action_type": "submit_discovery_claim",
                        "parameters": {
                            "discovered": claim,
                            "mass_gev": mass,
                            "mass_uncertainty_gev": 0.5,
                            "channel": obs.task.available_channels[0],
                            "spin": 0,
                            "significance_sigma": 4.0,
                            "confidence": 0.7,
                        },
                    }
                ]
                + batch[claim_at:]
            )
        totals = {
            "budget": obs.task.budget_total_musd,
            "time": obs.task.time_total_days,
            "luminosity": obs.task.luminosity_total_fb,
        }
        check_observation(obs, totals)
        done, index = obs.done, obs.step_index
        for action in PREFIX[:prefix] + batch:
            obs = env.step(action)
            sent[0] += 1
            check_observation(obs, totals)
            if done:
                assert obs.done and obs.step_index == index
                assert obs.rule_violations and obs.rule_violations[0].startswith("EPISODE_DONE: ")
                assert obs.reward == 0.0
            else:
                index += 1
                assert obs.step_index == index
                assert not any(v.startswith("EPISODE_DONE") for v in obs.rule_violations)
                done = obs.done
            state = env.state
            assert CernState.model_validate_json(state.model_dump_json()) == state
            assert state.step_count == obs.step_index
            assert (state.terminal_reward is not None) is done
        episodes_ended[0] += done

    run()
    assert sent[0] >= MIN_ACTIONS, sent[0]
    assert episodes_ended[0] >= 20, "the fuzz should also exercise the ended-episode path"


EXTREME_FLOATS = [5e-324, 1e-320, 2.2250738585072014e-308, 1e-12, 1.7976931348623157e308, 1e300, 2**63, 10**400]


def test_every_numeric_parameter_refuses_extreme_values_cleanly():
    """Subnormal, tiny, huge and beyond-float numbers in every numeric parameter of every verb, at
    the analysis stage where each verb runs: a clean INVALID_PARAMETERS (or a rule's own code),
    never an exception inside the action."""
    env = CERNCollisionEnvironment()
    for verb, spec in ACTION_TABLE.items():
        for name, field in spec.params.model_fields.items():
            if "float" not in str(field.annotation) and "Tuple" not in str(field.annotation):
                continue
            for value in EXTREME_FLOATS:
                env.reset(seed=1, scenario="higgs_4l_125")
                for action in PREFIX:
                    env.step(action)
                env.step({"action_type": "fit_resonance", "parameters": {"mass_hint_gev": 125.0}})
                params = dict(SENSIBLE_DEFAULTS.get(verb.value, {}))
                params[name] = [value, value * 2] if "Tuple" in str(field.annotation) else value
                obs = env.step({"action_type": verb.value, "parameters": params})
                assert not any("could not run" in v for v in obs.rule_violations), (
                    verb,
                    name,
                    value,
                    obs.rule_violations,
                )


SENSIBLE_DEFAULTS = {
    "submit_discovery_claim": {
        "discovered": True,
        "mass_gev": 125.0,
        "mass_uncertainty_gev": 0.5,
        "channel": "four_lepton",
        "confidence": 0.5,
    },
    "subtract_background": {"method": "sideband", "signal_region_gev": [120.0, 130.0]},
    "measure_angular": {"mass_gev": 125.0},
    "estimate_significance": {"mass_gev": 125.0},
    "request_theory_review": {"mass_gev": 125.0},
    "allocate_luminosity": {"luminosity_fb": 1.0},
    "collect_collisions": {"luminosity_fb": 1.0},
    "configure_beam": {"beam_energy_tev": 13.6},
}
