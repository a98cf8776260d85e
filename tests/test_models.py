"""cernenv.models and cernenv.actions: validation of actions and claims, JSON round trips, the action table."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel, ValidationError

from cernenv.actions import ACTION_TABLE, Prerequisite, parameter_schema, render_action_table_markdown
from cernenv.environment import CERNCollisionEnvironment
from cernenv.models import (
    ActionType,
    CernState,
    ChannelData,
    CollisionObservation,
    DiscoveryClaim,
    ExperimentAction,
    ResourceUsage,
    TaskInfo,
)

NON_FINITE = [math.nan, math.inf, -math.inf]

# One well-formed parameter set per verb (used to check that each params model accepts
# it and rejects it with one unknown field added).
VALID_PARAMS = {
    ActionType.CONFIGURE_BEAM: {"beam_energy_tev": 13.6, "pileup": "low"},
    ActionType.ALLOCATE_LUMINOSITY: {"luminosity_fb": 10.0},
    ActionType.SET_TRIGGER: {"trigger": "dilepton"},
    ActionType.COLLECT_COLLISIONS: {"luminosity_fb": 5.0},
    ActionType.CALIBRATE_DETECTOR: {"channel": "diphoton"},
    ActionType.RECONSTRUCT_TRACKS: {"channel": "diphoton", "quality": "tight"},
    ActionType.SELECT_CHANNEL: {"channel": "diphoton"},
    ActionType.BUILD_INVARIANT_MASS: {"mass_min_gev": 110.0, "mass_max_gev": 160.0, "bin_width_gev": 1.0},
    ActionType.SUBTRACT_BACKGROUND: {"method": "sideband", "signal_region_gev": [120.0, 130.0]},
    ActionType.FIT_RESONANCE: {"mass_hint_gev": 125.0, "float_width": False},
    ActionType.SCAN_BUMP: {"step_gev": 1.0},
    ActionType.MEASURE_ANGULAR: {"mass_gev": 125.0, "window_sigma": 2.0},
    ActionType.ESTIMATE_SIGNIFICANCE: {"mass_gev": 125.0},
    ActionType.REQUEST_SYSTEMATICS: {},
    ActionType.REQUEST_THEORY_REVIEW: {"mass_gev": 125.0},
    ActionType.SUBMIT_DISCOVERY_CLAIM: {
        "discovered": True,
        "mass_gev": 125.0,
        "mass_uncertainty_gev": 0.3,
        "channel": "diphoton",
        "spin": 0,
        "significance_sigma": 5.1,
        "confidence": 0.9,
    },
}


def claim(**overrides):
    fields = {"discovered": True, "mass_gev": 125.0, "mass_uncertainty_gev": 0.3, "confidence": 0.8}
    fields.update(overrides)
    return DiscoveryClaim(**fields)


# ExperimentAction ----------------------------------------------------------------------


def test_action_accepts_verb_strings_and_defaults():
    action = ExperimentAction(action_type="scan_bump")
    assert action.action_type is ActionType.SCAN_BUMP
    assert action.parameters == {} and action.justification == ""


@pytest.mark.parametrize("verb", ["warp_drive", "", "SCAN_BUMP", None, 3])
def test_action_rejects_unknown_verbs(verb):
    with pytest.raises(ValidationError):
        ExperimentAction(action_type=verb)


def test_action_rejects_extra_fields():
    with pytest.raises(ValidationError, match="extra"):
        ExperimentAction.model_validate({"action_type": "scan_bump", "parameters": {}, "reasoning": "x"})


@pytest.mark.parametrize("parameters", [[1, 2], "beam_energy_tev=13", 7, None])
def test_action_parameters_must_be_an_object(parameters):
    with pytest.raises(ValidationError):
        ExperimentAction.model_validate({"action_type": "configure_beam", "parameters": parameters})


def test_action_justification_is_bounded():
    ExperimentAction(action_type="scan_bump", justification="x" * 2000)
    with pytest.raises(ValidationError):
        ExperimentAction(action_type="scan_bump", justification="x" * 2001)


def test_action_json_round_trip():
    action = ExperimentAction(action_type="configure_beam", parameters={"beam_energy_tev": 13.6}, justification="why")
    again = ExperimentAction.model_validate_json(action.model_dump_json())
    assert again == action and again.action_type is ActionType.CONFIGURE_BEAM


# DiscoveryClaim ------------------------------------------------------------------------


def test_claim_discovery_with_mass_and_uncertainty_is_valid():
    c = claim(channel="diphoton", spin=0, significance_sigma=5.2)
    assert c.discovered and c.mass_gev == 125.0 and c.mass_uncertainty_gev == 0.3


@pytest.mark.parametrize("missing", ["mass_gev", "mass_uncertainty_gev"])
def test_claim_discovery_needs_mass_and_uncertainty(missing):
    fields = {"discovered": True, "mass_gev": 125.0, "mass_uncertainty_gev": 0.3, "confidence": 0.8}
    del fields[missing]
    with pytest.raises(ValidationError, match="mass"):
        DiscoveryClaim(**fields)


def test_claim_null_needs_no_mass():
    c = DiscoveryClaim(discovered=False, confidence=0.7)
    assert c.mass_gev is None and c.mass_uncertainty_gev is None and c.significance_sigma == 0.0


def test_claim_uncertainty_without_mass_is_rejected():
    with pytest.raises(ValidationError, match="without mass"):
        DiscoveryClaim(discovered=False, mass_uncertainty_gev=1.0, confidence=0.5)


def test_claim_confidence_is_required():
    with pytest.raises(ValidationError, match="confidence"):
        DiscoveryClaim(discovered=False)


@pytest.mark.parametrize("confidence", [0.0, 0.5, 1.0])
def test_claim_confidence_bounds_inclusive(confidence):
    assert claim(confidence=confidence).confidence == confidence


@pytest.mark.parametrize("confidence", [-1e-9, -0.5, 1.0000001, 2.0])
def test_claim_confidence_outside_unit_interval_rejected(confidence):
    with pytest.raises(ValidationError, match="confidence"):
        claim(confidence=confidence)


@pytest.mark.parametrize("field", ["mass_gev", "mass_uncertainty_gev", "confidence", "significance_sigma"])
@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_claim_rejects_non_finite_numbers(field, value):
    with pytest.raises(ValidationError, match=field):
        claim(**{field: value})


@pytest.mark.parametrize(
    "overrides",
    [
        {"mass_gev": 0.0},
        {"mass_gev": -125.0},
        {"mass_gev": 1.0e5},
        {"mass_uncertainty_gev": 0.0},
        {"spin": 3},
        {"spin": -1},
        {"significance_sigma": -1.0},
        {"channel": "x" * 41},
    ],
)
def test_claim_rejects_out_of_range_values(overrides):
    with pytest.raises(ValidationError):
        claim(**overrides)


def test_claim_significance_has_a_finite_upper_bound():
    caps = [getattr(m, "le", None) for m in DiscoveryClaim.model_fields["significance_sigma"].metadata]
    cap = min(c for c in caps if c is not None)
    assert 100 <= cap < math.inf
    assert claim(significance_sigma=cap).significance_sigma == cap
    with pytest.raises(ValidationError, match="significance_sigma"):
        claim(significance_sigma=cap * 1.01)


def test_claim_rejects_extra_fields():
    with pytest.raises(ValidationError, match="extra"):
        claim(width_gev=0.004)


def test_claim_json_round_trip():
    c = claim(channel="four_lepton", spin=0, significance_sigma=6.5)
    assert DiscoveryClaim.model_validate_json(c.model_dump_json()) == c


# Observation and state JSON ------------------------------------------------------------


def _rich_observation() -> CollisionObservation:
    task = TaskInfo(
        campaign_type="procedural",
        difficulty="hard",
        problem_statement="Search for ½ a bump: γγ, μ⁺μ⁻.",
        search_window_gev=(110.0, 160.0),
        available_channels=["diphoton", "four_lepton"],
        available_triggers=["diphoton"],
        available_beam_energies_tev=[13.0, 13.6],
        budget_total_musd=180.0,
        luminosity_total_fb=60.0,
        time_total_days=200.0,
        max_steps=30,
    )
    return CollisionObservation(
        task=task,
        step_index=7,
        done=False,
        reward=-0.05,
        resource_usage=ResourceUsage(
            budget_used_musd=12.5,
            budget_remaining_musd=167.5,
            luminosity_used_fb=10.0,
            luminosity_remaining_fb=50.0,
            luminosity_allocated_fb=2.5,
            time_used_days=20.25,
            time_remaining_days=179.75,
        ),
        selected_beam_energy_tev=13.6,
        selected_pileup="nominal",
        selected_trigger="diphoton",
        selected_channel="diphoton",
        data_collected={
            "diphoton": ChannelData(
                luminosity_fb=10.0, recorded_events=12345, calibration_level=2, reconstruction="tight"
            )
        },
        latest_result={
            "action": "scan_bump",
            "best_mass_gev": 125.3,
            "candidates_gev": [125.3, 141.2],
            "nested": {"z": [1.5, None]},
            "ok": True,
        },
        candidate_masses_gev=[125.3, 141.2],
        cumulative_significance=3.4,
        pipeline_history=["configure_beam: ok", "scan_bump: ok"],
        rule_violations=["REDUNDANT_ACTION: same action and parameters on unchanged data: same result"],
        reward_breakdown={"milestones": 0.0, "violations": 0.0, "redundancy": -0.05},
    )


def test_observation_json_round_trip_preserves_everything():
    obs = _rich_observation()
    text = obs.model_dump_json()
    again = CollisionObservation.model_validate_json(text)
    assert again == obs
    assert again.model_dump_json() == text
    assert again.task.search_window_gev == (110.0, 160.0)
    assert again.data_collected["diphoton"].recorded_events == 12345


def test_observation_rejects_unknown_fields():
    data = _rich_observation().model_dump()
    data["true_mass_gev"] = 125.09
    with pytest.raises(ValidationError, match="extra"):
        CollisionObservation.model_validate(data)


def test_state_json_round_trip():
    state = CernState(
        episode_id="abc",
        step_count=4,
        scenario_name="higgs_4l_125",
        difficulty="easy",
        cumulative_reward=1.25,
        terminal_reward=1.0,
        discovered=True,
        correct_mass=True,
        correct_channel=False,
        correct_spin=None,
        reward_components={"milestones": 0.25, "outcome": 3.0, "spin": -0.25},
    )
    text = state.model_dump_json()
    again = CernState.model_validate_json(text)
    assert again == state and again.model_dump_json() == text


def test_fresh_state_has_no_grade():
    state = CernState()
    assert state.terminal_reward is None
    assert state.discovered is state.correct_mass is state.correct_channel is state.correct_spin is None


def test_environment_observations_and_state_round_trip():
    env = CERNCollisionEnvironment()
    observations = [env.reset(seed=4, scenario="higgs_4l_125")]
    for action in [
        {"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6}},
        {"action_type": "set_trigger", "parameters": {"trigger": "dilepton"}},
        {"action_type": "allocate_luminosity", "parameters": {"luminosity_fb": 5.0}},
        {"action_type": "collect_collisions", "parameters": {"luminosity_fb": 5.0}},
        {"action_type": "warp_drive"},
    ]:
        observations.append(env.step(action))
    assert observations[-1].rule_violations  # the last one was refused, and still round-trips
    for obs in observations:
        again = CollisionObservation.model_validate_json(obs.model_dump_json())
        assert again == obs
    state = env.state
    assert CernState.model_validate_json(state.model_dump_json()) == state


# The action table -----------------------------------------------------------------------


def test_every_action_type_has_a_table_row():
    assert set(ACTION_TABLE) == set(ActionType)
    assert len(ActionType) == 16
    for action_type, spec in ACTION_TABLE.items():
        assert spec.action_type is action_type
        assert isinstance(spec.params, type) and issubclass(spec.params, BaseModel)
        assert spec.cost_musd >= 0 and spec.time_days >= 0
        assert all(isinstance(p, Prerequisite) for p in spec.prerequisites)
        assert spec.summary and spec.returns


def test_claim_verb_uses_the_claim_model():
    assert ACTION_TABLE[ActionType.SUBMIT_DISCOVERY_CLAIM].params is DiscoveryClaim


@pytest.mark.parametrize("action_type", list(ActionType), ids=lambda a: a.value)
def test_params_model_accepts_valid_and_rejects_extra(action_type):
    model = ACTION_TABLE[action_type].params
    model.model_validate(VALID_PARAMS[action_type])
    with pytest.raises(ValidationError):
        model.model_validate({**VALID_PARAMS[action_type], "unexpected_field": 1})
    schema = parameter_schema(action_type)
    assert schema["type"] == "object"
    assert set(schema.get("properties", {})) == set(model.model_fields)


@pytest.mark.parametrize(
    "action_type, field",
    [
        (ActionType.CONFIGURE_BEAM, "beam_energy_tev"),
        (ActionType.ALLOCATE_LUMINOSITY, "luminosity_fb"),
        (ActionType.COLLECT_COLLISIONS, "luminosity_fb"),
        (ActionType.BUILD_INVARIANT_MASS, "bin_width_gev"),
        (ActionType.FIT_RESONANCE, "mass_hint_gev"),
        (ActionType.SCAN_BUMP, "step_gev"),
        (ActionType.MEASURE_ANGULAR, "mass_gev"),
        (ActionType.MEASURE_ANGULAR, "window_sigma"),
        (ActionType.ESTIMATE_SIGNIFICANCE, "mass_gev"),
        (ActionType.REQUEST_THEORY_REVIEW, "mass_gev"),
    ],
)
@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_params_reject_non_finite_numbers(action_type, field, value):
    with pytest.raises(ValidationError):
        ACTION_TABLE[action_type].params.model_validate({**VALID_PARAMS[action_type], field: value})


@pytest.mark.parametrize(
    "action_type, params",
    [
        (ActionType.BUILD_INVARIANT_MASS, {"mass_min_gev": 150.0, "mass_max_gev": 120.0}),
        (ActionType.SUBTRACT_BACKGROUND, {"method": "sideband"}),
        (ActionType.SUBTRACT_BACKGROUND, {"method": "fit", "signal_region_gev": [130.0, 120.0]}),
        (ActionType.CONFIGURE_BEAM, {"beam_energy_tev": 13.0, "pileup": "extreme"}),
        (ActionType.RECONSTRUCT_TRACKS, {"channel": "diphoton", "quality": "perfect"}),
        (ActionType.ALLOCATE_LUMINOSITY, {"luminosity_fb": 0.0}),
        (ActionType.ALLOCATE_LUMINOSITY, {"luminosity_fb": -5.0}),
    ],
)
def test_params_reject_inconsistent_values(action_type, params):
    with pytest.raises(ValidationError):
        ACTION_TABLE[action_type].params.model_validate(params)


def test_markdown_action_table_lists_all_verbs():
    table = render_action_table_markdown()
    lines = table.splitlines()
    assert len(lines) == 2 + len(ActionType)
    rows = lines[2:]
    for action_type in ActionType:
        matching = [row for row in rows if row.startswith(f"| `{action_type.value}` |")]
        assert len(matching) == 1, action_type
        spec = ACTION_TABLE[action_type]
        for prerequisite in spec.prerequisites:
            assert prerequisite.value in matching[0]
    assert all(row.count("|") >= 6 for row in rows)


def test_environment_docstring_embeds_the_action_table():
    doc = CERNCollisionEnvironment.__doc__
    for action_type in ActionType:
        assert f"`{action_type.value}`" in doc
