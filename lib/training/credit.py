"""Credit for each decision: the advantage GRPO trains each decision of a campaign with.

GRPO's own credit (`credit: episode`) gives every decision of an episode the same advantage, the
episode's return against its group's. In a campaign of ~25 decisions that pushes a good opening
down with the refusal loop that ended the episode, and the one decision that doomed it is pushed
no harder than the rest. `credit: decision` gives each decision its own advantage, the sum of

* the **episode term**: GRPO's, (R - mean of the group's R) / scale;
* the **step term** of GiGPO (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent
  Training"): decisions that read the *same observation* in different episodes of a group (an
  *anchor state*: every episode's first turn, and later ones wherever the episodes have acted
  alike so far) form a step-level group, and each one's discounted return from that decision on,
  against the step group's mean and over the same scale, times `step_weight`; a decision whose
  observation no other episode of the group reached has no step term;
* the **penalty term**: the environment's own per-step signals of that decision alone (a refused
  action's `violations`, a redundant repeat's `redundancy`, `cernenv.rewards`) times
  `penalty_weight`, unscaled: with the default 10 a refused action (-0.1) costs its decision
  1.0 of advantage and a redundant repeat (-0.05) 0.5, and no other decision pays for them.

The scale is the one `scale_rewards` names for GRPO ("batch": the standard deviation of the
step's episode returns; "group": each group's; "none": 1), so `credit: decision` with
`step_weight=0` and `penalty_weight=0` is GRPO's advantage (with "batch", up to the standard
deviation being taken over the step's episodes where TRL takes it over its samples, each episode
once per decision slot). Everything here is plain
arithmetic on what the rollout recorded; `DecisionCreditTrainer` hands the result to TRL's
`GRPOTrainer` in place of its own advantage, and TRL does the rest (the clipped loss, the KL
term, the optimiser).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import numpy as np

from cernenv.rewards import STEP_COMPONENT_NAMES

CREDIT_MODES = ("episode", "decision")
"""`TrainConfig.credit`: GRPO's one advantage per episode, or one per decision (this module)."""
PENALTY_COMPONENTS = tuple(name for name in STEP_COMPONENT_NAMES if name != "milestones")
"""The step reward components that say a decision was wrong: refused (`violations`), redundant."""
SCALE_EPSILON = 1e-4
"""Added to a standard deviation before dividing by it, as TRL does."""


@dataclass(frozen=True)
class Decision:
    """One decision as credit sees it: which episode group and episode it belongs to, when, what
    it read, and what the environment answered."""

    group: str
    """The task the group's episodes played (its JSON): episodes of one group saw the same world."""
    episode: str
    """The episode, unique in the step (its task and its place in the group)."""
    turn: int
    state: str
    """A digest of the observation the decision read (its prompt tokens): equal states, equal prompts."""
    reward: float
    """The environment's reward for this step, all components (the terminal grade on the last step)."""
    penalty: float
    """The part of `reward` that says this decision was wrong (`PENALTY_COMPONENTS`), <= 0."""


def state_digest(prompt_ids: Sequence[int]) -> str:
    """The anchor-state key of a decision: a digest of the tokens it read."""
    return hashlib.sha256(np.asarray(prompt_ids, dtype=np.int64).tobytes()).hexdigest()[:16]


def episode_decisions(group: str, episode: str, turns: Sequence[Any], steps: Sequence[Any]) -> List[Decision]:
    """The `Decision`s of one played episode: `turns[t]` the decision's `PlayedTurn` (its prompt),
    `steps[t]` the environment's `StepRecord` for it (its reward and breakdown)."""
    if len(turns) != len(steps):
        raise ValueError(f"episode {episode}: {len(turns)} decisions but {len(steps)} recorded steps")
    decisions = []
    for t, (turn, step) in enumerate(zip(turns, steps)):
        breakdown = step.reward_breakdown or {}
        penalties = [float(value) for name, value in breakdown.items() if name in PENALTY_COMPONENTS]
        penalty = float(sum(min(0.0, value) for value in penalties))
        decisions.append(Decision(group, episode, t, state_digest(turn.prompt_ids), float(step.reward), penalty))
    return decisions


def returns_to_go(rewards: Sequence[float], discount: float) -> List[float]:
    """sum over k >= t of discount**(k - t) * rewards[k], for each t."""
    backwards, running = [], 0.0
    for reward in reversed(rewards):
        running = float(reward) + discount * running
        backwards.append(running)
    return backwards[::-1]


def _scaled(values: np.ndarray, groups: Sequence[str], scale_rewards: str, batch_std: float) -> np.ndarray:
    """`values` minus their group's mean, over the scale `scale_rewards` names."""
    groups = np.asarray(groups)
    out = np.zeros(len(values))
    for group in dict.fromkeys(groups.tolist()):
        members = groups == group
        centred = values[members] - values[members].mean()
        if scale_rewards == "group":
            if members.sum() > 1:  # a lone member is its own mean (0 already) and has no spread
                centred = centred / (values[members].std(ddof=1) + SCALE_EPSILON)
        elif scale_rewards == "batch":
            centred = centred / (batch_std + SCALE_EPSILON)
        out[members] = centred
    return out


@dataclass
class Credit:
    """Each decision's advantage (`advantage[(episode, turn)]`) and what it was made of."""

    advantage: Dict[Tuple[str, int], float]
    episode_term: Dict[str, float]
    step_term: Dict[Tuple[str, int], float]
    penalty_term: Dict[Tuple[str, int], float]

    def summary(self) -> Dict[str, float]:
        """How much of the step's credit each term carried: the share of decisions in an anchor
        state with another episode (`anchored`), the share with a penalty, mean |term| each."""
        n = max(1, len(self.advantage))
        return {
            "decisions": float(len(self.advantage)),
            "anchored": sum(1 for key in self.advantage if key in self.step_term) / n,
            "penalised": sum(1 for value in self.penalty_term.values() if value < 0) / n,
            "mean_abs_episode_term": float(np.mean([abs(self.episode_term[e]) for e, _ in self.advantage] or [0.0])),
            "mean_abs_step_term": float(np.mean([abs(v) for v in self.step_term.values()] or [0.0])),
            "mean_abs_penalty_term": float(np.mean([abs(v) for v in self.penalty_term.values()] or [0.0])),
        }


def decision_credit(
    decisions: Sequence[Decision],
    *,
    scale_rewards: str = "batch",
    discount: float = 0.95,
    step_weight: float = 1.0,
    penalty_weight: float = 10.0,
) -> Credit:
    """The advantage of every decision of a step's episodes (module docstring): `decisions` holds
    every decision of every episode, in turn order per episode."""
    by_episode: Dict[str, List[Decision]] = {}
    for decision in decisions:
        by_episode.setdefault(decision.episode, []).append(decision)
    episodes = list(by_episode)
    for name in episodes:
        turns = [d.turn for d in by_episode[name]]
        if turns != list(range(len(turns))):
            raise ValueError(f"episode {name}: decisions must be turns 0..n-1 in order, got {turns[:10]}")
    returns = np.array([sum(d.reward for d in by_episode[name]) for name in episodes])
    groups = [by_episode[name][0].group for name in episodes]
    batch_std = float(returns.std(ddof=1)) if len(returns) > 1 else 0.0
    episode_term = dict(zip(episodes, _scaled(returns, groups, scale_rewards, batch_std).tolist()))

    # step groups: decisions of one episode group that read the same observation, in different episodes
    to_go: Dict[Tuple[str, int], float] = {}
    anchors: Dict[Tuple[str, str], List[Tuple[str, int]]] = {}
    for name in episodes:
        ordered = by_episode[name]
        for decision, value in zip(ordered, returns_to_go([d.reward for d in ordered], discount)):
            key = (decision.episode, decision.turn)
            to_go[key] = value
            anchors.setdefault((decision.group, decision.state), []).append(key)
    step_term: Dict[Tuple[str, int], float] = {}
    for (group, _), members in anchors.items():
        if len({episode for episode, _ in members}) < 2:
            continue  # an observation only one episode reached: no step group
        values = np.array([to_go[key] for key in members])
        scaled = _scaled(values, [group] * len(members), scale_rewards, batch_std)
        for key, value in zip(members, scaled.tolist()):
            step_term[key] = step_weight * value

    penalty_term = {(d.episode, d.turn): penalty_weight * d.penalty for d in decisions}
    advantage = {key: episode_term[key[0]] + step_term.get(key, 0.0) + penalty_term[key] for key in penalty_term}
    return Credit(advantage, episode_term, step_term, penalty_term)


def credit_settings(config: Any) -> Mapping[str, Any]:
    """`decision_credit`'s settings from a `TrainConfig`."""
    return {
        "scale_rewards": config.scale_rewards,
        "discount": config.credit_discount,
        "step_weight": config.credit_step_weight,
        "penalty_weight": config.credit_penalty_weight,
    }


ADVANTAGE_FIELD = "decision_advantage"
"""The rollout output field (one number per sample) that `DecisionCreditTrainer` trains with."""


def decision_credit_trainer(base: type) -> type:
    """TRL's `GRPOTrainer` (`base`: whichever class `trl.GRPOTrainer` is, Unsloth's patched one on a
    GPU) with each sample's advantage taken from the rollout's `ADVANTAGE_FIELD` instead of its
    episode-level group baseline; generation, scoring, the clipped loss and the KL term are TRL's."""

    class DecisionCreditTrainer(base):
        def _generate_and_score_completions(self, inputs: List[Dict[str, Any]]) -> Dict[str, Any]:
            output = super()._generate_and_score_completions(inputs)
            missing = [i for i, row in enumerate(inputs) if ADVANTAGE_FIELD not in row]
            if missing:
                raise RuntimeError(
                    f"credit: decision needs the rollout to return {ADVANTAGE_FIELD!r} per sample; "
                    f"{len(missing)} of {len(inputs)} samples have none (is policy_context 'turn'?)"
                )
            advantages = output["advantages"]
            values = [float(row[ADVANTAGE_FIELD]) for row in inputs]
            output["advantages"] = advantages.new_tensor(values).reshape(advantages.shape)
            return output

    DecisionCreditTrainer.__name__ = DecisionCreditTrainer.__qualname__ = f"DecisionCredit{base.__name__}"
    return DecisionCreditTrainer
