"""The committed evidence still describes this checkout's environment: every recorded episode,
replayed from its seed with its recorded actions, earns the recorded rewards and grade
(`lib.report.replay.check_replay`, `make verify-evidence`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from lib.episodes.records import RENAMED_SUMMARY_KEYS, load_episodes_jsonl
from lib.report.replay import ReplayCheck, check_replay, main

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = [ROOT / "evidence" / "pre_eval.jsonl.gz", ROOT / "evidence" / "post_eval.jsonl.gz"]


@pytest.mark.slow
def test_every_committed_evidence_episode_replays_identically_on_a_processor_without_avx_or_fma():
    """Every reward, grade and prompt of the committed episodes, replayed (`make verify-evidence
    --strict`) in a process whose numpy, numba, OpenBLAS and C library compute as on an x86-64
    processor without AVX or FMA: the evidence was written on one with AVX-512, and the same seed is
    the same episode."""
    import os
    import subprocess
    import sys

    from lib.report.replay import BASELINE_PROCESSOR_ENVIRONMENT

    env = {**os.environ, **BASELINE_PROCESSOR_ENVIRONMENT}
    probe = (
        "from numpy._core._multiarray_umath import __cpu_features__ as f; import numba.core.config as c;"
        "print(f['X86_V3'], f['X86_V4'], c.CPU_NAME)"
    )
    assert subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    ).stdout.split() == ["False", "False", "generic"], "numpy's vector kernels are off and numba's target is generic"
    result = subprocess.run(
        [sys.executable, "-m", "lib.report.replay", "--strict", *map(str, EVIDENCE)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("outcomes differ at 0, prompts at 0 (0.0% of steps)") == len(EVIDENCE)
    assert len(load_episodes_jsonl(str(EVIDENCE[0]))) >= 100


def replays_identically(episode, where: str) -> None:
    """`episode` replays to every recorded reward, grade and prompt; else the failure names `where`
    (the file and the episode's place in it), the first step and the fields that differ."""
    check = check_replay(episode)
    differences = check.outcome + check.prompts
    assert not differences, f"{where} does not replay: {differences[0]} (of {len(differences)} differences)"
    assert check == ReplayCheck(len(episode["steps"]))


def first_of_each_ending(episodes):
    """(index, episode) of the first episode of each kind of ending: its outcome grade, whether it
    claimed a discovery and whether it was right (a correct discovery and a correct null both earn +3)."""
    kinds = {}
    for index, episode in enumerate(episodes):
        kind = (
            (episode.get("reward_components") or {}).get("outcome"),
            episode["discovered"],
            episode["correct_outcome"],
        )
        kinds.setdefault(kind, (index, episode))
    return kinds


@pytest.mark.parametrize("path", EVIDENCE, ids=lambda p: p.name)
def test_the_first_committed_episode_of_each_ending_replays_identically(path):
    """In the fast suite, one committed episode of each kind of ending (correct discovery, observation
    and null, missed, wrong or unsupported discovery, as the file holds them) replays to its recorded
    rewards, grade and prompts (`make verify-evidence` and the slow test above replay them all)."""
    kinds = first_of_each_ending(load_episodes_jsonl(str(path)))
    assert len(kinds) >= 4, f"{path.name} holds {len(kinds)} kinds of ending: {sorted(map(str, kinds))}"
    for index, episode in kinds.values():
        replays_identically(episode, f"{path.name} episode {index} (seed {episode['seed']})")


def test_a_changed_record_is_reported_where_it_changed(tmp_path, capsys):
    """The first episode of more than 5 steps, which replays (else the test says where it does not),
    changed at steps 3 and 4 and at its end: each change is reported at its step and field."""
    episodes = load_episodes_jsonl(str(EVIDENCE[1]))
    index, episode = next(((i, e) for i, e in enumerate(episodes) if len(e["steps"]) > 5), (None, None))
    assert episode is not None, f"{EVIDENCE[1].name} holds no episode of more than 5 steps"
    replays_identically(episode, f"{EVIDENCE[1].name} episode {index} (seed {episode['seed']})")
    changed = copy.deepcopy(episode)
    changed["steps"][3]["reward"] += 0.5
    changed["steps"][4]["prompt"] += " (edited)"
    changed["terminal_reward"] = (changed["terminal_reward"] or 0.0) - 1.0
    check = check_replay(changed)
    assert [line.rsplit(": ", 1)[1] for line in check.outcome] == ["reward", "terminal_reward"]
    assert check.outcome[0].endswith("step 3: reward")
    assert check.prompts == [f"seed {episode['seed']} ({episode['scenario']}) step 4"]
    path = tmp_path / "changed.jsonl"
    path.write_text(json.dumps(changed) + "\n")
    assert main([str(path)]) == 1
    assert "outcomes differ at 2, prompts at 1" in capsys.readouterr().out


def test_records_written_before_a_summary_key_was_renamed_read_under_the_new_name(tmp_path):
    episode = load_episodes_jsonl(str(EVIDENCE[0]))[0]
    old, new = next(iter(RENAMED_SUMMARY_KEYS.items()))
    for step in episode["steps"]:
        step["observation_summary"] = {(old if k == new else k): v for k, v in step["observation_summary"].items()}
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(episode) + "\n")
    (read,) = load_episodes_jsonl(str(path))
    assert all(new in s["observation_summary"] and old not in s["observation_summary"] for s in read["steps"])


@pytest.mark.parametrize("fields", [{}, {"compact_followups": True}, {"style": "brief"}])
def test_a_conversation_s_prompts_replay_in_the_style_it_was_played_in(tokenizer, fields):
    """The prompts of a campaign played as one conversation in any observation style (the brief one
    SmolLM2 plays, the compact one) are the environment's rendering of each observation: the strict
    replay finds no difference, and finds a changed prompt."""
    from cernenv import CERNCollisionEnvironment
    from lib.agents.baselines import HeuristicAgent
    from lib.agents.prompting import LLMAgentConfig, Sampling
    from lib.episodes.agent_rollouts import collect_agent_episode
    from lib.episodes.llm_rollouts import play_episodes

    spec = dict(seed=321, scenario=None, difficulty="easy")
    reference = collect_agent_episode(env=CERNCollisionEnvironment(), agent=HeuristicAgent(), **spec)
    replies = [
        json.dumps({"action_type": s.action["action_type"], "parameters": s.action["parameters"]})
        for s in reference.steps
    ]
    calls = {"n": 0}

    def generate(contexts, sampling):
        ids = tokenizer(replies[calls["n"]], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        calls["n"] += 1
        return [(ids, [-0.5] * len(ids))]

    [played] = play_episodes(
        generate, tokenizer, [spec], sampling=Sampling(temperature=0.0), observation_config=LLMAgentConfig(**fields)
    )
    record = played.record.to_dict()
    assert len(record["steps"]) > 5
    check = check_replay(record)
    assert not check.outcome and not check.prompts
    changed = copy.deepcopy(record)
    changed["steps"][4]["prompt"] += " "
    # the first difference is the changed prompt (a compacted later message, read against the recorded
    # ones before it, may differ after it too)
    assert check_replay(changed).prompts[0] == "seed 321 (procedural_easy) step 4"
