"""Recording episodes: the records, their JSONL files, and LLM / agent collection."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from cernenv import CERNCollisionEnvironment
from lib.agents.baselines import HeuristicAgent, OracleAgent, RandomAgent
from lib.agents.prompting import LLMAgentConfig, Sampling, action_to_json, chat_text
from lib.episodes.agent_rollouts import collect_agent_episode, collect_episode, collect_episodes, transitions
from lib.episodes.records import (
    EpisodeRecord,
    EpisodeSpec,
    StepRecord,
    load_episodes_jsonl,
    pair_key,
    save_episodes_jsonl,
)

# The fields of the original rollout collector, which downstream code reads.
SEED_STEP_FIELDS = {
    "step",
    "prompt",
    "completion",
    "action",
    "parsed_ok",
    "reward",
    "done",
    "rule_violations",
    "observation_summary",
}
SEED_EPISODE_FIELDS = {
    "seed",
    "scenario",
    "difficulty",
    "truth",
    "total_reward",
    "cumulative_reward",
    "terminal_reward",
    "discovered",
    "correct_mass",
    "correct_channel",
    "correct_spin",
    "steps",
}


def scripted_heuristic(seed, scenario=None, difficulty=None):
    """A generate_fn(prompt, config) that replies with HeuristicAgent's actions of that episode, as JSON."""
    env = CERNCollisionEnvironment()
    replies = [
        action_to_json(action)
        for _, action, _ in transitions(env, HeuristicAgent(), seed=seed, scenario=scenario, difficulty=difficulty)
    ]
    configs = []

    def generate_fn(prompt, config):
        configs.append(config)
        return replies.pop(0)

    generate_fn.configs = configs
    return generate_fn


def test_records_have_the_original_fields_and_more():
    step_fields = {f.name for f in dataclasses.fields(StepRecord)}
    episode_fields = {f.name for f in dataclasses.fields(EpisodeRecord)}
    assert SEED_STEP_FIELDS | {"parse_error", "reward_breakdown"} <= step_fields
    assert (
        SEED_EPISODE_FIELDS | {"agent", "correct_outcome", "reward_components", "resources", "n_steps"}
        <= episode_fields
    )


@pytest.mark.parametrize(
    "seed,scenario,difficulty", [(3, "higgs_4l_125", None), (41, None, "medium"), (7, "null_diphoton_750", None)]
)
def test_scripted_llm_reproduces_the_heuristic_episode_exactly(seed, scenario, difficulty):
    env = CERNCollisionEnvironment()
    reference = collect_agent_episode(
        env=env, agent=HeuristicAgent(), seed=seed, scenario=scenario, difficulty=difficulty
    )
    config = LLMAgentConfig(sampling=Sampling(temperature=0.0))
    generate_fn = scripted_heuristic(seed, scenario, difficulty)
    llm = collect_episode(
        env=env,
        seed=seed,
        scenario=scenario,
        difficulty=difficulty,
        prompt_fn=chat_text,
        generate_fn=generate_fn,
        config=config,
    )
    assert llm.total_reward == reference.total_reward and llm.n_steps == reference.n_steps
    assert [s.reward for s in llm.steps] == [s.reward for s in reference.steps]
    assert [s.action for s in llm.steps] == [s.action for s in reference.steps]
    assert llm.reward_components == reference.reward_components and llm.correct_outcome == reference.correct_outcome
    assert all(s.parsed_ok and s.parse_error is None for s in llm.steps)
    assert all(c is config for c in generate_fn.configs)
    assert llm.agent == "LLMAgent" and reference.agent == "HeuristicAgent"
    assert llm.steps[0].prompt.startswith("You are") and llm.steps[0].completion.startswith('{"action_type"')
    assert reference.steps[0].prompt == reference.steps[0].completion == ""
    assert llm.terminal_reward is not None and llm.steps[-1].done
    assert sum(s.reward_breakdown.get("outcome", 0.0) for s in llm.steps) == llm.reward_components["outcome"]
    assert llm.resources["budget_used_musd"] > 0 and llm.truth == env.hidden_truth()


def test_parse_failures_are_recorded_and_sent_as_they_are():
    replies = iter(["no idea", '{"action_type": "fit_resonance", "parameters": {"mass_hint_gev": -1}}'])
    record = collect_episode(
        env=CERNCollisionEnvironment(),
        seed=1,
        scenario="z_mumu_91",
        difficulty=None,
        prompt_fn=chat_text,
        generate_fn=lambda p, c: next(replies, "still no idea"),
        max_steps=3,
    )
    first, second, third = record.steps
    assert record.n_steps == 3 and not any(s.parsed_ok for s in record.steps)
    assert first.action == "no idea" and "no JSON object" in first.parse_error
    assert first.rule_violations[0].startswith("INVALID_ACTION")
    assert second.action == {"action_type": "fit_resonance", "parameters": {"mass_hint_gev": -1}}
    assert second.parse_error.startswith("INVALID_PARAMETERS")
    assert second.rule_violations[0].startswith("INVALID_PARAMETERS")
    assert all(s.reward_breakdown["violations"] < 0 for s in record.steps)
    assert record.terminal_reward is None and record.resources["budget_used_musd"] == 0.0


def test_the_oracle_is_handed_the_truth_only_where_the_evaluator_says_so():
    record = collect_agent_episode(
        env=CERNCollisionEnvironment(), agent=OracleAgent(), seed=4, scenario="higgs_4l_125", reveal_truth=True
    )
    claim = record.steps[-1].action
    assert claim["action_type"] == "submit_discovery_claim"
    assert claim["parameters"]["mass_gev"] == record.truth["mass_gev"]
    with pytest.raises(ValueError, match="needs the hidden truth"):
        collect_agent_episode(env=CERNCollisionEnvironment(), agent=OracleAgent(), seed=4, scenario="higgs_4l_125")


class TruthSeeker(HeuristicAgent):
    """An ordinary-looking agent that asks for the truth by every name it can think of."""

    def __init__(self):
        self.given = []
        super().__init__()

    def reset(self, truth=None, hidden_truth=None, **kwargs):
        super().reset()
        self.given += [value for value in (truth, hidden_truth, *kwargs.values()) if value is not None]

    def observe_truth(self, truth):
        self.given.append(truth)


def test_an_agent_that_asks_for_the_truth_gets_nothing():
    """Only the evaluator hands the truth (`reveal_truth`, `reveal_truth_to`): an agent whose
    `reset` takes `truth`, or that has the oracle's `observe_truth`, is given nothing."""
    from lib.measure.evaluation import PUBLISHED_KEY, evaluate_agents, heldout_suite

    seeker = TruthSeeker()
    collect_agent_episode(env=CERNCollisionEnvironment(), agent=seeker, seed=4, scenario="higgs_4l_125")
    evaluate_agents({"seeker": seeker}, heldout_suite()[:3], key=PUBLISHED_KEY, progress=False)
    assert seeker.given == []
    with pytest.raises(ValueError, match="not evaluated"):
        evaluate_agents({"seeker": seeker}, heldout_suite()[:1], key=PUBLISHED_KEY, reveal_truth_to=["oracle"])


def test_max_steps_caps_an_episode():
    record = collect_agent_episode(
        env=CERNCollisionEnvironment(), agent=HeuristicAgent(), seed=3, scenario="higgs_4l_125", max_steps=4
    )
    assert record.n_steps == 4 and record.terminal_reward is None and not record.steps[-1].done
    with pytest.raises(ValueError, match="max_steps"):
        collect_agent_episode(env=CERNCollisionEnvironment(), agent=HeuristicAgent(), seed=3, max_steps=0)


def test_batch_collection_with_agents_and_llms():
    specs = [EpisodeSpec(11, scenario="z_mumu_91"), {"seed": 12, "difficulty": "easy"}, (13, None, "hard")]
    records = collect_episodes(specs, agent=RandomAgent(seed=1), progress=False)
    assert [r.seed for r in records] == [11, 12, 13]
    assert [r.difficulty for r in records][1:] == ["easy", "hard"]
    assert all(r.agent == "RandomAgent" and r.n_steps == len(r.steps) > 0 for r in records)
    llm = collect_episodes(
        [(3, "higgs_4l_125", None)],
        make_env=CERNCollisionEnvironment,
        prompt_fn=chat_text,
        generate_fn=scripted_heuristic(3, "higgs_4l_125"),
        progress=False,
    )
    assert llm[0].correct_outcome is not None and llm[0].agent == "LLMAgent"
    with pytest.raises(ValueError, match="either agent"):
        collect_episodes(specs, agent=RandomAgent(), generate_fn=lambda p, c: "", prompt_fn=chat_text)
    with pytest.raises(ValueError, match="prompt_fn"):
        collect_episodes(specs, generate_fn=lambda p, c: "")


@pytest.fixture(scope="module")
def records():
    return collect_episodes(
        [(21, "higgs_diphoton_125", None), (22, None, "medium")], agent=HeuristicAgent(), progress=False
    )


def test_jsonl_round_trip(records, tmp_path):
    path = tmp_path / "runs" / "episodes.jsonl"
    save_episodes_jsonl(records, str(path))
    loaded = load_episodes_jsonl(str(path))
    assert loaded == [json.loads(json.dumps(dataclasses.asdict(r))) for r in records]
    assert loaded[0]["steps"][0]["action"]["action_type"] == "configure_beam"
    # a line read back is the record again, steps included
    assert [EpisodeRecord.from_dict(line) for line in loaded] == [EpisodeRecord.from_dict(r.to_dict()) for r in records]
    assert EpisodeRecord.from_dict(loaded[1]).steps[-1].done
    assert pair_key(loaded[1]) == (22, records[1].scenario, "medium")
    save_episodes_jsonl(loaded[:1], str(path))  # dicts too; replaces the file atomically
    assert len(load_episodes_jsonl(str(path))) == 1
    assert os.listdir(path.parent) == ["episodes.jsonl"]  # no temporary file left behind


def test_truncated_last_line_is_skipped_with_a_warning(records, tmp_path):
    path = tmp_path / "episodes.jsonl"
    save_episodes_jsonl(records, str(path))
    text = path.read_text()
    path.write_text(text[: len(text) - 40])  # a writer died in the middle of the last episode
    with pytest.warns(UserWarning, match="truncated"):
        loaded = load_episodes_jsonl(str(path))
    assert [e["seed"] for e in loaded] == [21]
    first, second = text.splitlines()
    path.write_text(first[:-10] + "\n" + second + "\n")  # damage anywhere else is an error
    with pytest.raises(ValueError, match="is not an episode"):
        load_episodes_jsonl(str(path))
