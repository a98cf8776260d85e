"""Playing episodes and recording what happened."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from cernenv import CERNCollisionEnvironment, CernState


@dataclass(frozen=True)
class EpisodeOutcome:
    """The graded end of one episode played by a non-LLM agent."""

    seed: int
    scenario: Optional[str]
    difficulty: Optional[str]
    total_reward: float
    n_steps: int
    state: CernState
    truth: dict


def play_episode(env: CERNCollisionEnvironment, agent, *, seed: int, scenario: Optional[str] = None,
                 difficulty: Optional[str] = None) -> EpisodeOutcome:
    """Run `agent` (reset()/act(obs) protocol) for one episode; an agent with a
    `reset(truth=...)` (the oracle) is handed the hidden truth."""
    obs = env.reset(seed=seed, scenario=scenario, difficulty=difficulty)
    try:
        agent.reset(truth=env.hidden_truth())
    except TypeError:
        agent.reset()
    total, steps = 0.0, 0
    while not obs.done:
        obs = env.step(agent.act(obs))
        total += float(obs.reward or 0.0)
        steps += 1
    state = env.state
    return EpisodeOutcome(seed, scenario, difficulty, total, steps, state, env.hidden_truth())
