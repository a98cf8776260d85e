"""Notebook 04's opening conclusion (lib/report/conclusion.py): what the run shows, in words computed
from its evaluations, harms named as plainly as gains; and whether the baselines played the
policy's episodes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lib.measure.evaluation import heldout_suite
from lib.report.conclusion import baseline_episodes_note, conclusion_markdown, run_changes
from lib.report.evidence_logs import read_records

ROOT = Path(__file__).resolve().parents[1]
EVIDENCE = ROOT / "evidence"


def _episode(seed: int, *, exists: bool, correct: bool, discovered: bool, reward: float) -> dict:
    return {
        "seed": seed,
        "scenario": f"procedural_{seed}",
        "difficulty": "easy",
        "truth": {"exists": exists},
        "correct_outcome": correct,
        "discovered": discovered,
        "cumulative_reward": reward,
    }


def _suite(n_particle: int, n_null: int, *, particle_right: float, null_right: float, reward: float) -> list:
    """Episodes 0..n-1: tasks with a particle first, then null tasks; the first fraction of each
    right (a wrong null task is a discovery claimed where there is nothing)."""
    episodes = []
    for i in range(n_particle):
        right = i < particle_right * n_particle
        episodes.append(_episode(i, exists=True, correct=right, discovered=right, reward=reward + (i % 3)))
    for j in range(n_null):
        right = j < null_right * n_null
        seed = n_particle + j
        episodes.append(_episode(seed, exists=False, correct=right, discovered=not right, reward=reward + (j % 3)))
    return episodes


def test_the_committed_evidence_names_its_one_clear_change_a_harm():
    """The committed run (the family recipe's seed 0): success 0.703 -> 0.674 and reward down, both
    with intervals that hold 0; null-task success 1.000 -> 0.943 with its interval below 0; no false
    discovery before or after. The conclusion says the one clear effect is a harm, and names it
    first, from the episodes, each change with its interval. The figures are the committed evidence's
    as its evaluation wrote them (evidence/before_after_metrics.json, which the test reads back for
    the null tasks' interval, and README.md quotes), not this module's output copied."""
    pre = read_records(EVIDENCE / "pre_eval.jsonl.gz").rows
    post = read_records(EVIDENCE / "post_eval.jsonl.gz").rows
    changes = {c.metric.label: c for c in run_changes(pre, post)}
    null = changes["null-task success"]
    assert (round(null.before.mean, 3), round(null.after.mean, 3)) == (1.0, 0.943)
    assert (round(null.delta.mean, 3), round(null.delta.low, 3), round(null.delta.high, 3)) == (-0.057, -0.115, -0.011)
    stored = json.loads((EVIDENCE / "before_after_metrics.json").read_text())["groups"]["null"]["delta_ci95"]
    assert [null.delta.low, null.delta.high] == pytest.approx(stored["success_rate"]), "the evidence's own interval"
    false = changes["false-discovery rate"]
    assert (round(false.before.mean, 3), round(false.after.mean, 3)) == (0.0, 0.0)
    assert {label: change.verdict for label, change in changes.items()} == {
        "success": "unclear",
        "mean reward": "unclear",
        "null-task success": "harm",
        "false-discovery rate": "unclear",
    }
    text = conclusion_markdown(pre, post)
    assert text.startswith("**What this run shows** (313 held-out episodes played by the policy before and after")
    assert text.split("\n")[0].endswith("Training's only clear effects are harms:")
    items = text.split("\n\n")[1].splitlines()
    assert items[0].startswith("- **Clearly worse**: null-task success 1.000 → 0.943 (Δ −0.057 [−0.115, −0.011])")
    assert items[1] == "- No clear change: success 0.703 → 0.674 (Δ −0.029 [−0.086, +0.026])."
    assert items[2] == "- No clear change: mean reward 3.477 → 3.160 (Δ −0.317 [−0.742, +0.085])."
    assert "clearly better" not in text.lower()
    assert not re.search(r"\d\.\d{4}", text), "three decimals, as the tables"


def test_a_clear_gain_is_said_as_one_and_no_change_as_none():
    before = _suite(40, 40, particle_right=0.3, null_right=0.5, reward=1.0)
    after = _suite(40, 40, particle_right=0.9, null_right=0.95, reward=3.0)
    text = conclusion_markdown(before, after)
    assert "Training's clear effects are gains:" in text and text.count("- **Clearly better**: ") == 4
    assert "false-discovery rate 0.500 → 0.050 (Δ −0.450" in text and "fewer discoveries claimed" in text
    assert "worse" not in text
    same = conclusion_markdown(before, before)
    assert "No change is clear: every interval holds zero." in same and "Clearly" not in same


def test_a_smoke_run_of_a_few_episodes_concludes_nothing():
    """A smoke run's 6 episodes, each 0.1 better: the bootstrap interval is [+0.1, +0.1], which
    would read as a clear gain; with so few episodes the conclusion says it cannot tell."""
    before = _suite(3, 3, particle_right=0.0, null_right=0.0, reward=-1.0)
    after = [dict(e, cumulative_reward=e["cumulative_reward"] + 0.1) for e in before]
    text = conclusion_markdown(before, after)
    assert "Too few episodes to conclude anything (fewer than 30)" in text
    assert "Clearly" not in text and "- Too few to tell: mean reward" in text


def test_different_episodes_are_compared_unpaired_and_said_so():
    before = _suite(20, 20, particle_right=0.5, null_right=0.5, reward=1.0)
    after = [dict(e, seed=e["seed"] + 1000) for e in before]  # 40 a side: enough to conclude
    text = conclusion_markdown(before, after)
    assert "not the same ones (unpaired)" in text and all(not c.paired for c in run_changes(before, after))
    assert conclusion_markdown([], []).startswith("**What this run shows:** nothing yet")


def test_the_baselines_are_said_to_play_other_episodes_when_they_do():
    """In the smoke profile the baselines play the suite's first 6 episodes and the policy 6 spread
    over it, while the text said "the same suite": the note says which."""
    suite = heldout_suite("v3")
    baselines = {"suite_version": "v3", "n_episodes": {"random": 6, "heuristic": 6}}

    def played(specs):
        return [{"seed": s.seed, "scenario": s.scenario or f"procedural_{s.difficulty}"} for s in specs]

    assert baseline_episodes_note(baselines, played(suite[:6])) == (
        "The reference agents and the policy played the same 6 held-out episodes."
    )
    spread = [suite[i] for i in (0, 62, 125, 187, 250, 312)]
    note = baseline_episodes_note(baselines, played(spread))
    assert note.startswith("**Not the same episodes:** the reference agents played the first 6 episodes")
    assert "the policy 6 episodes of its own evaluation (1 of them in common)" in note
    whole = {"suite_version": "v3", "n_episodes": {"random": len(suite)}}
    assert baseline_episodes_note(whole, played(suite)).endswith(f"the same {len(suite)} held-out episodes.")
    assert baseline_episodes_note(None, played(suite)) == ""
    committed = json.loads((EVIDENCE / "baselines.json").read_text())
    pre = read_records(EVIDENCE / "pre_eval.jsonl.gz").rows
    assert (
        baseline_episodes_note(committed, pre)
        == "The reference agents and the policy played the same 313 held-out episodes."
    )
