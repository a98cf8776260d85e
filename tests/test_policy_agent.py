"""A trained policy as an outside agent (`lib.training.policy_agent.TrainedPolicyAgent`): it plays a
campaign turn by turn exactly as `play_episodes` plays it in training and evaluation."""

from __future__ import annotations

import pytest

from cernenv import CERNCollisionEnvironment
from lib.episodes.generation import hf_generate_fn
from lib.episodes.llm_rollouts import play_episodes
from lib.training import TrainConfig
from lib.training.policy_agent import POLICY_CONFIG_ENV, TrainedPolicyAgent


@pytest.mark.parametrize("style", ["full", "brief"])
def test_the_agent_plays_as_the_evaluation_plays(tokenizer, model, style):
    """Greedy, held to the grammar of what each observation shows: the agent's actions, step by step,
    are the actions `play_episodes` sends for the same model and world."""
    config = TrainConfig(policy_context="conversation", credit="episode", observation_style=style, max_new_tokens=48)
    spec = {"seed": 31, "difficulty": "medium"}
    [played] = play_episodes(
        hf_generate_fn(model, tokenizer, "cached"),
        tokenizer,
        [spec],
        sampling=config.evaluation_sampling,
        observation_config=config.observation_config,
        max_turns=6,
    )
    agent, env = TrainedPolicyAgent.from_model(model, tokenizer, config), CERNCollisionEnvironment()
    obs, sent = env.reset(**spec), []
    for _ in range(len(played.record.steps)):
        action = agent.act(obs)
        sent.append(action.model_dump(mode="json") if hasattr(action, "model_dump") else action)
        obs = env.step(action)
    expected = [step.action for step in played.record.steps]
    assert [_comparable(a) for a in sent] == [_comparable(a) for a in expected]
    assert agent.context == played.prompt_ids + played.completion_ids[: len(agent.context) - len(played.prompt_ids)]


def _comparable(action):
    """An action's verb and parameters (a payload the environment refused is compared as it is)."""
    if isinstance(action, dict) and "action_type" in action:
        return action["action_type"], action.get("parameters")
    return action


def test_the_agent_says_which_policy_to_name(monkeypatch):
    monkeypatch.delenv(POLICY_CONFIG_ENV, raising=False)
    with pytest.raises(ValueError, match="POLICY_CONFIG=configs/train/NAME.yaml"):
        TrainedPolicyAgent()


def test_an_adapter_the_agent_s_user_cannot_read_whole_is_refused_with_the_chmod_that_fixes_it(tmp_path, monkeypatch):
    """make evaluate plays the agent as a user of its own: an adapter whose weights that user cannot
    read (safetensors writes them 0600) is refused before loading, naming the `chmod`; a folder with
    no adapter says so."""
    from lib.training import policy_agent

    adapter = tmp_path / "final"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    policy_agent.check_adapter_readable(str(adapter))
    real = policy_agent.os.access
    monkeypatch.setattr(
        policy_agent.os, "access", lambda path, mode: not str(path).endswith(".safetensors") and real(path, mode)
    )
    with pytest.raises(PermissionError) as refused:
        policy_agent.check_adapter_readable(str(adapter))
    assert str(refused.value) == (
        f"POLICY_ADAPTER={adapter} cannot be read whole by this process's user (make evaluate plays the agent "
        f"as a user of its own): chmod -R a+rX {adapter}"
    )
    monkeypatch.setattr(policy_agent.os, "access", real)
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="holds no adapter_config.json: name an adapter's folder"):
        policy_agent.check_adapter_readable(str(adapter))
