"""Credit for each decision (`lib.training.credit`): the arithmetic, on decisions written by hand."""

from __future__ import annotations

import numpy as np
import pytest

from lib.training.config import TrainConfig
from lib.training.credit import Decision, decision_credit, episode_decisions, returns_to_go, state_digest


def episode(group, name, states, rewards, penalties=None):
    """One episode's decisions: state i read, reward i received, penalty i (part of reward i)."""
    penalties = penalties or [0.0] * len(rewards)
    return [Decision(group, name, t, s, r, p) for t, (s, r, p) in enumerate(zip(states, rewards, penalties))]


def test_returns_to_go_discount_each_later_reward():
    assert returns_to_go([1.0, 0.0, 2.0], 0.5) == [1.0 + 0.5 * 0.0 + 0.25 * 2.0, 0.0 + 0.5 * 2.0, 2.0]
    assert returns_to_go([], 0.9) == []


def test_without_step_and_penalty_terms_every_decision_gets_grpos_episode_advantage():
    decisions = (
        episode("task-a", "a0", ["s", "x"], [0.05, 3.0])
        + episode("task-a", "a1", ["s", "y", "z"], [0.05, -0.1, -1.0], [0.0, -0.1, 0.0])
        + episode("task-b", "b0", ["u"], [-1.0])
        + episode("task-b", "b1", ["u", "v"], [0.05, 4.0])
    )
    credit = decision_credit(decisions, step_weight=0.0, penalty_weight=0.0)
    returns = {"a0": 3.05, "a1": -1.05, "b0": -1.0, "b1": 4.05}
    std = np.std(list(returns.values()), ddof=1)
    mean = {"a": (3.05 - 1.05) / 2, "b": (-1.0 + 4.05) / 2}
    for (name, turn), value in credit.advantage.items():
        assert value == pytest.approx((returns[name] - mean[name[0]]) / (std + 1e-4))
    assert len(credit.advantage) == len(decisions)


def test_a_refused_action_costs_its_own_decision_and_no_other():
    decisions = episode("t", "e0", ["s0", "s1", "s2"], [0.0, -0.1, 0.0], [0.0, -0.1, 0.0]) + episode(
        "t", "e1", ["s0", "s1", "s2"], [0.0, 0.0, 0.0]
    )
    plain = decision_credit(decisions, step_weight=0.0, penalty_weight=0.0)
    credit = decision_credit(decisions, step_weight=0.0, penalty_weight=10.0)
    differs = {key for key in credit.advantage if credit.advantage[key] != pytest.approx(plain.advantage[key])}
    assert differs == {("e0", 1)}
    assert credit.advantage[("e0", 1)] - plain.advantage[("e0", 1)] == pytest.approx(-1.0)


def test_anchor_states_credit_the_decision_where_episodes_diverged():
    """Both episodes read s0 then s1 (they acted alike), then chose differently at s1: one went on
    to a correct claim, the other to a refusal loop. The step term separates them at s1, where
    they read the same thing, and gives nothing at states only one of them reached."""
    good = episode("t", "good", ["s0", "s1", "g2", "g3"], [0.05, 0.05, 0.05, 3.0])
    bad = episode("t", "bad", ["s0", "s1", "b2", "b3", "b4"], [0.05, 0.05, -0.1, -0.1, -1.1])
    credit = decision_credit(good + bad, penalty_weight=0.0)
    assert set(credit.step_term) == {("good", 0), ("bad", 0), ("good", 1), ("bad", 1)}
    assert credit.step_term[("good", 1)] > 0 > credit.step_term[("bad", 1)]
    assert credit.step_term[("good", 1)] == pytest.approx(-credit.step_term[("bad", 1)])
    # the first decision is further from the outcome: its step advantage is discounted more
    assert 0 < credit.step_term[("good", 0)] < credit.step_term[("good", 1)]
    assert ("good", 2) not in credit.step_term and ("bad", 4) not in credit.step_term
    summary = credit.summary()
    assert summary["decisions"] == 9 and summary["anchored"] == pytest.approx(4 / 9)


def test_anchor_groups_stay_within_their_episode_group():
    """The same observation in two different tasks' episodes is not an anchor state: they played
    different worlds."""
    decisions = episode("task-a", "a0", ["s"], [1.0]) + episode("task-b", "b0", ["s"], [-1.0])
    assert decision_credit(decisions).step_term == {}


def test_one_episode_revisiting_a_state_is_no_step_group():
    decisions = episode("t", "e0", ["s", "s", "x"], [0.0, -0.05, 1.0]) + episode("t", "e1", ["y"], [0.0])
    assert decision_credit(decisions).step_term == {}


def test_decisions_out_of_order_are_refused():
    decisions = [Decision("t", "e", 1, "s", 0.0, 0.0), Decision("t", "e", 0, "s", 0.0, 0.0)]
    with pytest.raises(ValueError, match="turns 0..n-1"):
        decision_credit(decisions)


def test_episode_decisions_reads_prompts_and_penalties_from_the_played_episode():
    class Turn:
        def __init__(self, prompt_ids):
            self.prompt_ids = prompt_ids

    class Step:
        def __init__(self, reward, breakdown):
            self.reward, self.reward_breakdown = reward, breakdown

    turns = [Turn([1, 2, 3]), Turn([1, 2, 3]), Turn([4])]
    steps = [
        Step(0.05, {"milestones": 0.05}),
        Step(-0.15, {"violations": -0.1, "redundancy": -0.05}),
        Step(2.0, {"outcome": 3.0, "significance_calibration": -1.0}),
    ]
    decisions = episode_decisions("t", "e", turns, steps)
    assert [d.penalty for d in decisions] == pytest.approx([0.0, -0.15, 0.0])
    assert [d.reward for d in decisions] == [0.05, -0.15, 2.0]
    assert decisions[0].state == decisions[1].state == state_digest([1, 2, 3]) != decisions[2].state
    with pytest.raises(ValueError, match="2 decisions but 3 recorded steps"):
        episode_decisions("t", "e", turns[:2], steps)


def test_decision_credit_needs_the_turn_context():
    with pytest.raises(ValueError, match="credit 'decision' needs policy_context 'turn'"):
        TrainConfig(credit="decision", policy_context="conversation")
    with pytest.raises(ValueError, match="credit must be one of"):
        TrainConfig(credit="step")
    with pytest.raises(ValueError, match="credit_discount must be a finite number"):
        TrainConfig(credit="decision", credit_discount=1.5)
