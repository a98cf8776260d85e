"""Several seeds read together: outcomes.csv round-trips and the pooled difference pairs tasks."""

from __future__ import annotations

from pathlib import Path

import pytest

from lib.report.seed_runs import (
    main,
    outcome_rows,
    pooled_difference,
    read_outcomes_csv,
    seed_comparisons,
    write_outcomes_csv,
)


def episode(seed, success, reward, exists=True):
    return {
        "seed": seed,
        "scenario": "procedural_easy",
        "difficulty": "easy",
        "truth": {"exists": exists},
        "correct_outcome": success,
        "cumulative_reward": reward,
    }


def runs():
    """Two seeds on four tasks: seed a gains on tasks 0 and 1, seed b on task 0 only."""
    pre = [episode(s, False, -1.0) for s in range(4)]
    rows = outcome_rows("a", "pre", pre) + outcome_rows("b", "pre", pre)
    rows += outcome_rows("a", "post", [episode(s, s < 2, 1.0 if s < 2 else -1.0) for s in range(4)])
    rows += outcome_rows("b", "post", [episode(s, s < 1, 1.0 if s < 1 else -1.0) for s in range(4)])
    rows += outcome_rows("sft", "pre", [episode(s, s == 3, -1.0) for s in range(4)])
    return rows


def test_the_pooled_difference_averages_the_seeds_task_by_task(tmp_path):
    rows = runs()
    assert pooled_difference(rows, [("a", "pre")], [("a", "post")], "success", "all").mean == pytest.approx(0.5)
    pooled = pooled_difference(rows, [("a", "pre"), ("b", "pre")], [("a", "post"), ("b", "post")], "success", "all")
    assert pooled.mean == pytest.approx((0.5 + 0.25) / 2) and pooled.low <= pooled.mean <= pooled.high
    result = seed_comparisons(rows, ["a", "b"], "sft")
    versus = result["groups"]["all"]["grpo_minus_sft_success"]
    assert versus["a"]["mean"] == pytest.approx(0.5 - 0.25) and versus["b"]["mean"] == pytest.approx(0.0)
    path = tmp_path / "outcomes.csv"
    write_outcomes_csv(path, rows)
    assert read_outcomes_csv(path) == rows
    assert main(["--from-csv", str(path), "--out", str(tmp_path / "out")]) == 0
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"seeds.json", "seeds.md", "seeds.png"}


def test_runs_over_other_tasks_or_a_damaged_row_are_refused(tmp_path):
    rows = runs()
    with pytest.raises(ValueError, match="same tasks"):
        pooled_difference(
            [r for r in rows if not (r["run"] == "b" and r["seed"] == 3)],
            [("a", "pre")],
            [("b", "post")],
            "success",
            "all",
        )
    path = tmp_path / "outcomes.csv"
    write_outcomes_csv(path, rows)
    text = path.read_text().splitlines()
    text[3] = text[3].replace(",1,-1.0", ",yes,-1.0").replace(",0,-1.0", ",yes,-1.0")
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(ValueError, match="line 4"):
        read_outcomes_csv(Path(path))
