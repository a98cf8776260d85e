"""The `brief` observation style (`LLMAgentConfig.style`, `TrainConfig.observation_style`): a campaign a
small model can afford, that still carries what a decision turns on (a scan's excess, the global
significance, a refusal's reason, what new data made outdated)."""

from __future__ import annotations

import re

import pytest

from cernenv import CERNCollisionEnvironment, ExperimentAction
from cernenv.models import ActionType
from lib.agents.baselines import HeuristicAgent
from lib.agents.prompting import BRIEF_RESULT_KEYS, LLMAgentConfig, action_to_json, render_brief
from lib.episodes.agent_rollouts import transitions
from lib.episodes.chat import ChatLayout
from lib.training import TrainConfig

BRIEF = LLMAgentConfig(style="brief")


def _campaign_text(config: LLMAgentConfig, tokenizer, seed: int, difficulty: str):
    """A heuristic campaign as one conversation: (its messages, the observations each reply answered)."""
    layout, env = ChatLayout(tokenizer, config), CERNCollisionEnvironment()
    messages, seen = [], []
    for obs, action, next_obs in transitions(env, HeuristicAgent(), seed=seed, difficulty=difficulty):
        messages = messages or layout.first_messages(obs)
        seen.append(obs)
        messages.append({"role": "assistant", "content": action_to_json(action, justification=False)})
        if next_obs.done:
            break
        messages.append(layout.followup_message(next_obs, messages))
    return messages, seen


def test_every_verb_has_its_brief_fields_and_each_names_a_field_its_result_has():
    """A verb missing from `BRIEF_RESULT_KEYS` would write its whole result (never mute); each listed
    field is one that the verb's successful result holds in heuristic campaigns (a renamed result
    field would otherwise vanish from the brief observation unnoticed)."""
    assert set(BRIEF_RESULT_KEYS) == {verb.value for verb in ActionType}
    env, agent, seen = CERNCollisionEnvironment(), HeuristicAgent(), {}
    for seed in range(300, 306):
        for _, action, next_obs in transitions(env, agent, seed=seed, difficulty=("easy", "hard")[seed % 2]):
            result = next_obs.latest_result
            if "error" not in result and not next_obs.done:
                seen.setdefault(action.action_type.value, set()).update(result)
    assert len(seen) >= 10
    for verb, fields in seen.items():
        missing = set(BRIEF_RESULT_KEYS[verb]) - fields
        assert not missing, (verb, missing)


def test_a_brief_campaign_carries_the_deciding_numbers(tokenizer):
    """The scan's local significance per channel, the fit's mass, the global significance and the
    logbook's state are in the conversation, rounded to 3 significant digits; no references line."""
    messages, seen = _campaign_text(BRIEF, tokenizer, seed=1, difficulty="easy")
    text = "\n".join(m["content"] for m in messages if m["role"] == "user")
    assert "References:" not in text
    scans = [o.logbook for o in seen if any(k.startswith("scan_bump/") for k in o.logbook)]
    assert scans, "the heuristic scanned"
    written = [float(z) for z in re.findall(r"z_local=(-?[0-9.]+)", text)]
    for entry in (v for k, v in scans[-1].items() if k.startswith("scan_bump/")):
        z = float(entry["best_z_local"])  # 3 significant digits: within half a unit of the third
        assert any(abs(w - z) <= 0.005 * abs(z) + 1e-9 for w in written), (z, written)
    assert re.search(r"z_global=[0-9.]+", text) and "State: fit[" in text


def test_a_refusal_and_outdated_results_are_said():
    """A refused action's reason is the brief message; data collected after a fit marks it outdated."""
    env = CERNCollisionEnvironment()
    env.reset(seed=3, difficulty="easy")
    refused = env.step(ExperimentAction(action_type="scan_bump", parameters={}))
    assert render_brief(refused, include_task=False).startswith("Refused: ")
    agent, outdated = HeuristicAgent(), False
    for _, _, next_obs in transitions(env, agent, seed=1, difficulty="medium"):
        if "fit_resonance" in next_obs.outdated_logbook_entries:
            assert "fit[" in render_brief(next_obs, include_task=False)
            assert "(outdated)" in render_brief(next_obs, include_task=False)
            outdated = True
    assert outdated, "the heuristic collected a second block after its fit"


def test_a_brief_campaign_is_a_fraction_of_the_full_one(tokenizer):
    """Same campaign, same tokenizer: the brief conversation is under half the full one's tokens
    (SmolLM2's tokenizer: ~1,330 against ~5,100 with compact followups, `bench/bench_prompt_tokens.py`)."""
    full, _ = _campaign_text(LLMAgentConfig(system_prompt=True), tokenizer, seed=5, difficulty="medium")
    brief, _ = _campaign_text(LLMAgentConfig(style="brief", system_prompt=True), tokenizer, seed=5, difficulty="medium")
    layout = ChatLayout(tokenizer)
    assert len(layout.prompt_ids(brief)) < 0.5 * len(layout.prompt_ids(full))


def test_the_style_is_checked_where_it_is_set():
    with pytest.raises(ValueError, match="style must be one of"):
        LLMAgentConfig(style="short")
    with pytest.raises(ValueError, match="observation_style"):
        TrainConfig(observation_style="brief", policy_context="turn", credit="decision")
    config = TrainConfig(observation_style="brief", policy_context="conversation", credit="episode")
    assert config.observation_config.style == "brief"
