"""The LLM agent's input and output: the prompt (`build_chat`, `SYSTEM_PROMPT`), its size,
the action parser, the JSON schema, and `LLMAgent` in an episode."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cernenv import ACTION_TABLE, ActionType, CERNCollisionEnvironment, ExperimentAction
from cernenv.rewards import NO_CLAIM, VIOLATION_PENALTY
from cernenv.rules import MAX_CONSECUTIVE_REFUSALS
from lib.agents.baselines import HeuristicAgent
from lib.agents.prompting import (
    SYSTEM_PROMPT,
    LLMAgent,
    LLMAgentConfig,
    action_json_schema,
    action_to_json,
    build_chat,
    chat_text,
    parse_reply,
)
from lib.episodes.agent_rollouts import transitions

SCAN = {"action_type": "scan_bump", "parameters": {}, "justification": "look for a bump"}


def heuristic_steps(seed=3, scenario="higgs_4l_125", difficulty=None):
    """(observation, action) pairs of one HeuristicAgent episode."""
    env = CERNCollisionEnvironment()
    return [
        (obs, action)
        for obs, action, _ in transitions(env, HeuristicAgent(), seed=seed, scenario=scenario, difficulty=difficulty)
    ]


# parse_reply -----------------------------------------------------------------------------


def test_parse_plain_json():
    result = parse_reply(json.dumps(SCAN))
    assert result.ok and result.error is None
    assert result.action == ExperimentAction(**SCAN)
    assert result.payload is result.action


def test_parse_json_fence():
    result = parse_reply(f"```json\n{json.dumps(SCAN, indent=2)}\n```")
    assert result.ok and result.action.action_type is ActionType.SCAN_BUMP


def test_parse_prose_around_the_object():
    text = f"The spectrum is built, so next I scan it.\n{json.dumps(SCAN)}\nThat should show any excess."
    result = parse_reply(text)
    assert result.ok and result.action == ExperimentAction(**SCAN), "the object between the prose, as written"


def test_parse_braces_inside_strings_and_prose():
    action = {
        "action_type": "fit_resonance",
        "parameters": {"mass_hint_gev": 125.0},
        "justification": "fit {the peak} near 125 GeV; an unbalanced { and } in text",
    }
    result = parse_reply("My plan {roughly}: " + json.dumps(action) + " done {")
    assert result.ok, result.error
    assert result.action.justification == action["justification"]
    assert result.action.parameters == {"mass_hint_gev": 125.0}


def test_parse_two_objects_is_an_error():
    text = json.dumps(SCAN) + "\nor maybe\n" + json.dumps({**SCAN, "action_type": "fit_resonance"})
    result = parse_reply(text)
    assert not result.ok and result.action is None
    assert "2 JSON objects" in result.error
    assert result.payload == text  # no guess at which one was meant


def test_parse_no_object_is_an_error():
    result = parse_reply("I would scan the spectrum next.")
    assert not result.ok and "no JSON object" in result.error
    assert result.payload == "I would scan the spectrum next."
    assert not parse_reply("").ok
    assert not parse_reply('{"action_type": "scan_bump", "parameters": {}').ok  # truncated


def test_parse_invalid_parameters_are_refused_as_the_environment_would():
    raw = {"action_type": "fit_resonance", "parameters": {"mass_hint_gev": -5}}
    result = parse_reply(json.dumps(raw))
    assert not result.ok and result.error.startswith("INVALID_PARAMETERS") and "mass_hint_gev" in result.error
    assert result.payload == raw  # the decoded object goes to the environment, which refuses it
    missing = parse_reply('{"action_type": "measure_angular", "parameters": {}}')
    assert missing.error.startswith("INVALID_PARAMETERS") and "mass_gev" in missing.error


def test_parse_unknown_verb_and_malformed_action():
    unknown = parse_reply('{"action_type": "discover_higgs", "parameters": {}}')
    assert not unknown.ok and unknown.error.startswith("INVALID_ACTION") and "discover_higgs" in unknown.error
    extra_key = parse_reply('{"action_type": "scan_bump", "parameters": {}, "confidence": 1}')
    assert not extra_key.ok and extra_key.error.startswith("INVALID_ACTION")
    not_text = parse_reply(None)
    assert not not_text.ok and "text" in not_text.error


def test_heuristic_actions_round_trip_through_json():
    steps = list(heuristic_steps()) + list(heuristic_steps(seed=8, scenario=None, difficulty="hard"))
    actions = [a for _, a in steps]
    verbs = {a.action_type for a in actions}
    assert {ActionType.CONFIGURE_BEAM, ActionType.FIT_RESONANCE, ActionType.SUBMIT_DISCOVERY_CLAIM} <= verbs
    for obs, action in steps:
        assert parse_reply(json.dumps(action.model_dump(mode="json")), obs.references).action == action
        assert parse_reply(action_to_json(action), obs.references).action == action


def test_action_json_schema_has_one_branch_per_verb_and_accepts_valid_actions():
    jsonschema = pytest.importorskip("jsonschema")
    schema = action_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert [b["properties"]["action_type"]["const"] for b in schema["oneOf"]] == [a.value for a in ACTION_TABLE]
    validator = jsonschema.Draft202012Validator(schema)
    for _, action in heuristic_steps():
        validator.validate(json.loads(action_to_json(action)))
    for bad in (
        {"action_type": "fit_resonance", "parameters": {"mass_hint_gev": -5}},
        {"action_type": "discover_higgs"},
        {"action_type": "measure_angular", "parameters": {}},
    ):
        assert not validator.is_valid(bad)
        assert not parse_reply(json.dumps(bad)).ok  # the schema and the environment agree


# The prompt -------------------------------------------------------------------------------


def test_system_prompt_lists_every_verb_and_parameter():
    for action_type, spec in ACTION_TABLE.items():
        assert f"{action_type.value}(" in SYSTEM_PROMPT
        for name in spec.params.model_fields:
            assert name in SYSTEM_PROMPT, name
    assert '"action_type"' in SYSTEM_PROMPT and "JSON" in SYSTEM_PROMPT


def test_build_chat_is_deterministic_and_holds_no_truth():
    first, second = heuristic_steps(seed=5), heuristic_steps(seed=5)
    config = LLMAgentConfig(max_history_steps=3)
    for (obs_a, _), (obs_b, _) in zip(first, second):
        chat = build_chat(obs_a, config)
        assert [m["role"] for m in chat] == ["system", "user"]
        assert chat == build_chat(obs_b, config) == build_chat(obs_a.model_copy(deep=True), config)
    env = CERNCollisionEnvironment()
    for scenario in ("higgs_diphoton_125", "zprime_dilepton_4000", "null_diphoton_750"):
        text = chat_text(build_chat(env.reset(seed=1, scenario=scenario)))
        truth = env.hidden_truth()
        assert scenario not in text and "truth" not in text and "cross_section" not in text
        if truth["exists"]:
            assert f"{truth['mass_gev']:g}" not in text


def test_user_message_shows_the_observation():
    steps = heuristic_steps()
    obs = next(o for o, a in steps if a.action_type is ActionType.ESTIMATE_SIGNIFICANCE)  # after fit and scan
    text = build_chat(obs, LLMAgentConfig(max_history_steps=2))[1]["content"]
    lo, hi = obs.task.search_window_gev
    assert f"Window=[{lo!r},{hi!r}] GeV" in text and f"/{obs.task.max_steps}" in text
    for option in obs.task.available_channels + obs.task.available_triggers:
        assert option in text
    assert f"History: {','.join(e.removesuffix(': ok') for e in obs.pipeline_history[-2:])}" in text
    assert obs.pipeline_history[-3].removesuffix(": ok") + "," not in text.split("History: ")[1].split("\n")[0]
    assert f"Last ({obs.latest_result['action']})" in text and "candidates" in text
    refused = CERNCollisionEnvironment()
    refused.reset(seed=0, scenario="higgs_4l_125")
    obs = refused.step({"action_type": "scan_bump"})
    text = build_chat(obs)[1]["content"]
    assert "Violations: MISSING_PREREQUISITE" in text and text.count("build_invariant_mass first") == 1


def test_a_campaign_fits_the_context_budget(tokenizer):
    """A whole heuristic campaign, laid out as GRPO plays it (system prompt, first observation,
    then each action and the next message): the context the policy reads and the trainer
    scores. With every message restating the task it took ~6,400 tokens."""
    from bench.bench_prompt import CAMPAIGN_TOKENS_MEDIAN_TARGET
    from lib.training.warm_start import demonstration_examples

    lengths = sorted(len(example["input_ids"]) for example in demonstration_examples(tokenizer, 30))
    assert lengths[len(lengths) // 2] < CAMPAIGN_TOKENS_MEDIAN_TARGET, lengths
    assert lengths[-1] < 1.3 * CAMPAIGN_TOKENS_MEDIAN_TARGET, lengths


# LLMAgent ---------------------------------------------------------------------------------


def test_llm_agent_with_a_scripted_model_reaches_a_graded_end():
    replies = [f"Next step.\n```json\n{action_to_json(a)}\n```" for _, a in heuristic_steps()]
    prompts = []
    agent = LLMAgent(generate_fn=lambda prompt: prompts.append(prompt) or replies.pop(0), prompt_fn=chat_text)
    env = CERNCollisionEnvironment()
    obs = env.reset(seed=3, scenario="higgs_4l_125")
    agent.reset()
    while not obs.done:
        payload = agent.act(obs)
        assert agent.last_parse.ok and payload is agent.last_parse.action
        assert agent.last_prompt == prompts[-1] and agent.last_completion.startswith("Next step.")
        obs = env.step(payload)
        assert not obs.rule_violations
    assert not replies
    state = env.state
    assert state.terminal_reward is not None and state.correct_outcome is not None


@pytest.mark.parametrize(
    "garbage",
    [
        "I am not sure what to do.",
        '{"action_type": "win"}',
        '{"action_type": "configure_beam", "parameters": {"beam_energy_tev": "max"}}',
        json.dumps(SCAN) + json.dumps(SCAN),
    ],
)
def test_garbage_output_is_refused_and_never_becomes_a_move(garbage):
    agent = LLMAgent(generate_fn=lambda prompt: garbage, prompt_fn=chat_text)
    env = CERNCollisionEnvironment()
    obs = env.reset(seed=2, scenario="z_mumu_91")
    agent.reset()
    start = obs.resource_usage
    steps = 0
    while not obs.done:
        obs = env.step(agent.act(obs))
        steps += 1
        assert not agent.last_parse.ok and agent.last_parse.error
        assert obs.reward_breakdown["violations"] == VIOLATION_PENALTY
        assert obs.rule_violations[0].split(":")[0] in ("INVALID_ACTION", "INVALID_PARAMETERS")
    state = env.state
    assert steps == MAX_CONSECUTIVE_REFUSALS < env.max_steps  # the run is stopped, graded as no claim
    assert obs.selected_beam_energy_tev is None and obs.resource_usage == start  # nothing ever ran
    assert state.reward_components["violations"] == pytest.approx(VIOLATION_PENALTY * steps)
    assert state.cumulative_reward == pytest.approx(VIOLATION_PENALTY * steps + NO_CLAIM)
    assert np.isclose(state.reward_components["milestones"], 0.0)
