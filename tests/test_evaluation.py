"""The held-out suite and the bootstrap metrics."""

from __future__ import annotations

import numpy as np
import pytest

from cernenv import CERNCollisionEnvironment
from cernenv.scenarios import DIFFICULTIES, list_scenarios
from lib.evaluation import (
    HELDOUT_SEED_START,
    agent_metrics,
    assert_disjoint_from_suite,
    bootstrap_mean,
    comparison_table,
    heldout_suite,
    paired_difference,
)


def test_suite_is_fixed_large_and_spans_everything():
    suite = heldout_suite()
    assert suite == heldout_suite("v1")
    assert len(suite) >= 100
    assert len({s.seed for s in suite}) == len(suite)
    assert {s.scenario for s in suite if s.scenario} == set(list_scenarios())
    assert {s.difficulty for s in suite if s.difficulty} == set(DIFFICULTIES)
    assert min(s.seed for s in suite) >= HELDOUT_SEED_START
    env = CERNCollisionEnvironment()
    nulls = 0
    for spec in suite:
        env.reset(seed=spec.seed, scenario=spec.scenario, difficulty=spec.difficulty)
        nulls += not env.hidden_truth()["exists"]
    assert nulls >= 15


def test_unknown_version_and_overlapping_training_seeds_are_refused():
    with pytest.raises(ValueError, match="v1"):
        heldout_suite("v0")
    assert_disjoint_from_suite(range(1000))
    with pytest.raises(ValueError, match="overlap"):
        assert_disjoint_from_suite([HELDOUT_SEED_START + 3])


def test_bootstrap_interval_covers_the_true_mean_at_about_95_percent():
    rng = np.random.default_rng(0)
    covered = 0
    for i in range(200):
        est = bootstrap_mean(rng.binomial(1, 0.3, size=120), seed=i)
        covered += est.low <= 0.3 <= est.high
    assert 0.89 <= covered / 200 <= 0.99


def test_bootstrap_edge_cases():
    assert bootstrap_mean([]).n == 0
    constant = bootstrap_mean([1.0, 1.0, 1.0])
    assert constant.mean == constant.low == constant.high == 1.0
    wide, narrow = bootstrap_mean(np.arange(10.0)), bootstrap_mean(np.tile(np.arange(10.0), 20))
    assert wide.high - wide.low > narrow.high - narrow.low


def _episode(seed, reward, correct, exists=True, discovered=True, mass=True):
    return {"seed": seed, "scenario": None, "difficulty": "easy", "cumulative_reward": reward,
            "correct_outcome": correct, "truth": {"exists": exists}, "discovered": discovered,
            "correct_mass": mass if exists else None, "correct_channel": mass if exists else None,
            "correct_spin": None, "steps": [{"parsed_ok": True}, {"parsed_ok": False}], "n_steps": 2,
            "resources": {"budget_used_musd": 30.0, "budget_remaining_musd": 70.0,
                          "time_used_days": 10.0, "time_remaining_days": 90.0}}


def test_metrics_on_a_hand_made_sample():
    episodes = [_episode(0, 4.0, True), _episode(1, -2.0, False, mass=False),
                _episode(2, 3.0, True, exists=False, discovered=False), _episode(3, -3.0, False, exists=False)]
    m = agent_metrics(episodes)
    assert m["mean_reward"].mean == pytest.approx(0.5)
    assert m["success_rate"].mean == pytest.approx(0.5)
    assert m["mass_accuracy"].mean == pytest.approx(0.5) and m["mass_accuracy"].n == 2
    assert m["false_discovery_rate"].mean == pytest.approx(0.5) and m["false_discovery_rate"].n == 2
    assert m["parse_rate"].mean == pytest.approx(0.5)
    assert m["budget_used_fraction"].mean == pytest.approx(0.3)
    table = comparison_table({"a": m})
    assert table.splitlines()[0].startswith("| agent | mean_reward") and "| a | 0.5 [" in table


def test_paired_difference_detects_a_clear_improvement_and_needs_the_same_episodes():
    rng = np.random.default_rng(1)
    base = rng.normal(0, 2, size=120)
    before = [_episode(i, float(r), False) for i, r in enumerate(base)]
    after = [_episode(i, float(r) + 1.0 + rng.normal(0, 0.3), True) for i, r in enumerate(base)]
    diff = paired_difference(before, after, "mean_reward")
    assert diff.low > 0.8 and diff.high < 1.2
    same = paired_difference(before, before, "mean_reward")
    assert same.mean == same.low == same.high == 0.0
    with pytest.raises(ValueError, match="same episodes"):
        paired_difference(before, after[:-1], "mean_reward")
