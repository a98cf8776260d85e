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
PROMPT_SHARE_LIMIT = 0.02
"""Share of replayed prompts that may differ from the record (the processor's last bits reach a
few rendered digits, lib/report/replay.py); a change of the environment moves far more, and any change
of a reward or grade fails."""


@pytest.mark.slow
@pytest.mark.parametrize("path", EVIDENCE, ids=lambda p: p.name)
def test_every_committed_evidence_episode_replays_to_its_recorded_rewards_and_grade(path):
    checks = [check_replay(episode) for episode in load_episodes_jsonl(str(path))]
    assert len(checks) >= 100
    assert [line for c in checks for line in c.outcome] == []
    steps = sum(c.steps for c in checks)
    prompts = sum(len(c.prompts) for c in checks)
    assert prompts <= PROMPT_SHARE_LIMIT * steps, f"{prompts} of {steps} prompts differ"


def test_a_changed_record_is_reported_where_it_changed(tmp_path, capsys):
    episode = next(
        e
        for e in load_episodes_jsonl(str(EVIDENCE[1]))[:20]
        if len(e["steps"]) > 5 and check_replay(e) == ReplayCheck(len(e["steps"]))
    )
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
