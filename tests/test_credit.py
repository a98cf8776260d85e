"""Credit for each decision (`lib.training.credit`): the arithmetic, on decisions written by hand."""

from __future__ import annotations

import numpy as np
import pytest

from lib.training.config import TrainConfig
from lib.training.credit import (
    ADVANTAGE_FIELD,
    Credit,
    Decision,
    decision_credit,
    decision_credit_trainer,
    episode_decisions,
    returns_to_go,
    state_digest,
)


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


# Every scale_rewards: "batch" (the step's standard deviation of episode returns), "group" (each
# group's own), "none" (1); every spread is taken with ddof=1 and SCALE_EPSILON = 1e-4 added.
# Group a: a0 earns 1 then 2 (return 3), a1 earns -1 (return -1); both first read "s", an anchor
# state. Group b: b0 and b1 both return 2 (no spread). Group c: c0 alone, return 5.
# Episode term: R - mean(group): a0 +2, a1 -2, b0 0, b1 0, c0 0; then divided by the scale.
# Step term at "s" (discount 0.5): a0's return to go 1 + 0.5·2 = 2, a1's -1; mean 0.5: +1.5, -1.5;
# divided by the scale, where "group" is the step group's own spread |2 - (-1)|/√2 = 3/√2.
SCALED_DECISIONS = (
    episode("a", "a0", ["s", "a0-next"], [1.0, 2.0])
    + episode("a", "a1", ["s"], [-1.0])
    + episode("b", "b0", ["t"], [2.0])
    + episode("b", "b1", ["u"], [2.0])
    + episode("c", "c0", ["v"], [5.0])
)
# the five returns' spread: mean 2.2, squared deviations 0.64 + 10.24 + 0.04 + 0.04 + 7.84 = 18.8, over 4
BATCH_STD = float(np.sqrt(18.8 / 4))
EPISODE_SCALE = {"none": 1.0, "batch": BATCH_STD + 1e-4, "group": 4.0 / np.sqrt(2.0) + 1e-4}  # group a: |3-(-1)|/√2
STEP_SCALE = {"none": 1.0, "batch": BATCH_STD + 1e-4, "group": 3.0 / np.sqrt(2.0) + 1e-4}


@pytest.mark.parametrize("scale_rewards", ["batch", "group", "none"])
def test_each_scale_divides_both_terms_by_its_own_spread(scale_rewards):
    credit = decision_credit(SCALED_DECISIONS, scale_rewards=scale_rewards, discount=0.5, penalty_weight=0.0)
    scale = EPISODE_SCALE[scale_rewards]
    expected_episode = {"a0": 2.0 / scale, "a1": -2.0 / scale, "b0": 0.0, "b1": 0.0, "c0": 0.0}
    assert credit.episode_term == pytest.approx(expected_episode, abs=1e-12)
    step = STEP_SCALE[scale_rewards]
    assert credit.step_term == pytest.approx({("a0", 0): 1.5 / step, ("a1", 0): -1.5 / step}, abs=1e-12)
    assert credit.advantage[("a0", 0)] == pytest.approx(2.0 / scale + 1.5 / step)
    assert credit.advantage[("a0", 1)] == pytest.approx(2.0 / scale)  # "a0-next": no other episode read it


def test_a_group_of_one_or_of_equal_returns_has_no_advantage_under_any_scale():
    """Under "group" a lone episode has no spread to divide by: its advantage is 0, not 0/ε; equal
    returns have none either, whatever the scale (0/(0 + ε) = 0)."""
    for scale_rewards in ("batch", "group", "none"):
        credit = decision_credit(SCALED_DECISIONS, scale_rewards=scale_rewards, penalty_weight=0.0)
        assert credit.episode_term["c0"] == 0.0 and credit.episode_term["b0"] == credit.episode_term["b1"] == 0.0


def test_the_penalty_term_is_never_scaled():
    """A refused action's penalty reaches its decision as penalty_weight × penalty whatever the scale."""
    decisions = episode("t", "e0", ["s0", "s1"], [0.0, -0.1], [0.0, -0.1]) + episode("t", "e1", ["s0"], [3.0])
    for scale_rewards in ("batch", "group", "none"):
        credit = decision_credit(decisions, scale_rewards=scale_rewards, penalty_weight=10.0)
        assert credit.penalty_term == {("e0", 0): 0.0, ("e0", 1): pytest.approx(-1.0), ("e1", 0): 0.0}


def test_one_grpo_step_trains_with_each_decision_s_own_advantage(tiny_model_dir, tmp_path):
    """The fast suite's one gradient step through TRL's `GRPOTrainer` (the others are marked slow):
    two episodes whose replies are both refused score alike, so GRPO's own advantage is 0 for both;
    with credit for each decision each refused reply carries its penalty (−0.1 × 10 = −1), and the
    step has a gradient and moves every parameter of the stand-in policy."""
    import torch
    from test_training import _scripted_group_step

    before, after, logged = _scripted_group_step(
        tiny_model_dir, tmp_path, ["not json", "not json"], "turn", credit="decision"
    )
    assert logged["frac_reward_zero_std"] == 1.0, "the episodes scored alike: GRPO's own advantage is 0"
    assert logged["grad_norm"] > 0
    moved = [name for name, p in after.items() if not torch.equal(p.detach(), before[name])]
    assert len(moved) == len(after), f"{len(after) - len(moved)} parameter tensors did not move"


def test_a_lone_episode_has_no_advantage_and_two_are_scaled_by_their_spread():
    """With one episode in the step there is no spread to scale by: every term is 0 (not 0/0). With
    two, "batch" divides by their standard deviation: returns 3 and -1 spread |3-(-1)|/√2."""
    alone = decision_credit(episode("t", "e0", ["s0", "s1"], [1.0, 2.0]), penalty_weight=0.0)
    assert alone.advantage == {("e0", 0): 0.0, ("e0", 1): 0.0}
    pair = episode("t", "e0", ["a"], [3.0]) + episode("t", "e1", ["b"], [-1.0])
    credit = decision_credit(pair, scale_rewards="batch", penalty_weight=0.0)
    scale = 4.0 / np.sqrt(2.0) + 1e-4
    assert credit.episode_term == pytest.approx({"e0": 2.0 / scale, "e1": -2.0 / scale})


def test_a_refused_action_costs_one_unit_of_advantage_by_default():
    """The documented default penalty_weight, 10: a refused action's −0.1 costs its decision 1.0."""
    decisions = episode("t", "e0", ["s0", "s1"], [0.0, -0.1], [0.0, -0.1]) + episode("t", "e1", ["x"], [0.0])
    assert decision_credit(decisions).penalty_term[("e0", 1)] == pytest.approx(-1.0)


def test_a_state_only_one_episode_reached_does_not_hide_later_anchor_states():
    """e0's first observation is its own, its second is shared with e1's first: the shared one is a
    step group even though an unshared state was met before it."""
    decisions = episode("t", "e0", ["own", "shared"], [0.0, 2.0]) + episode("t", "e1", ["shared"], [-1.0])
    credit = decision_credit(decisions, discount=1.0, penalty_weight=0.0)
    assert set(credit.step_term) == {("e0", 1), ("e1", 0)}
    assert credit.step_term[("e0", 1)] > 0 > credit.step_term[("e1", 0)]


def test_a_misordered_episode_is_named_with_its_first_ten_turns():
    decisions = [Decision("t", "long", turn, "s", 0.0, 0.0) for turn in range(11, -1, -1)]
    with pytest.raises(ValueError, match=r"episode long: .* got \[11, 10, 9, 8, 7, 6, 5, 4, 3, 2\]$"):
        decision_credit(decisions)


def test_episode_decisions_keeps_the_group_and_takes_only_negative_penalties():
    """A decision belongs to the group it was played in, and only a penalty component below 0 says
    it was wrong (a positive value there, were one ever recorded, would not be a reward for it)."""

    class Turn:
        prompt_ids = [7]

    class Step:
        reward, reward_breakdown = 0.2, {"violations": 0.2, "redundancy": -0.05, "milestones": -1.0}

    (decision,) = episode_decisions("task-7", "e", [Turn()], [Step()])
    assert decision.group == "task-7" and decision.penalty == pytest.approx(-0.05)


def test_a_state_digest_is_sixteen_hex_digits_of_the_token_ids_whatever_their_integer_type():
    digest = state_digest([1, 2, 3])
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert state_digest(np.array([1, 2, 3], dtype=np.int32)) == digest != state_digest([1, 2, 4])


def test_the_summary_gives_each_term_s_share_and_mean_size():
    """Three decisions: one anchored (with another episode's), one penalised; the means are over the
    terms each decision has. An empty step's summary is all zeros, and one decision is a whole."""
    credit = Credit(
        advantage={("e0", 0): 1.0, ("e0", 1): -2.0, ("e1", 0): 0.5},
        episode_term={"e0": -0.5, "e1": 1.5},
        step_term={("e0", 0): 0.75, ("e1", 0): -0.25},
        penalty_term={("e0", 0): 0.0, ("e0", 1): -1.0, ("e1", 0): 0.0},
    )
    assert credit.summary() == pytest.approx(
        {
            "decisions": 3.0,
            "anchored": 2 / 3,
            "penalised": 1 / 3,
            "mean_abs_episode_term": (0.5 + 0.5 + 1.5) / 3,
            "mean_abs_step_term": (0.75 + 0.25) / 2,
            "mean_abs_penalty_term": 1.0 / 3,
        }
    )
    assert set(Credit({}, {}, {}, {}).summary().values()) == {0.0}
    one = Credit({("e", 0): -1.0}, {"e": 0.0}, {}, {("e", 0): -1.0}).summary()
    assert one["penalised"] == 1.0 and one["mean_abs_penalty_term"] == 1.0


class _GroupTrainer:
    """A stand-in for TRL's trainer: its own advantage is the group's, 0 for every sample here."""

    def _generate_and_score_completions(self, inputs):
        import torch

        return {"advantages": torch.zeros(len(inputs))}


def test_the_trainer_trains_with_each_sample_s_own_advantage_and_refuses_a_rollout_without_one():
    trainer = decision_credit_trainer(_GroupTrainer)()
    assert type(trainer).__name__ == "DecisionCredit_GroupTrainer"
    output = trainer._generate_and_score_completions([{ADVANTAGE_FIELD: 1.5}, {ADVANTAGE_FIELD: -0.25}])
    assert output["advantages"].tolist() == [1.5, -0.25]
    with pytest.raises(RuntimeError, match=r"1 of 2 samples have none \(is policy_context 'turn'\?\)"):
        trainer._generate_and_score_completions([{ADVANTAGE_FIELD: 1.0}, {"prompt": "no advantage"}])
