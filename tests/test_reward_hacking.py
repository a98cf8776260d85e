"""Degenerate policies must score below the heuristic physicist.

Over 210 episodes spanning every curated scenario (both null ones included) and
procedural scenarios of every difficulty (which include null cases). Policies that are
plainly degenerate must lose by half a point of reward or more; the heuristic physicist with
one honest habit dropped (claiming on weaker evidence, or under-stating its significance) must
lose too, by a paired 95% interval that excludes zero.
"""

from __future__ import annotations

import numpy as np
import pytest

from cernenv import ActionType, CERNCollisionEnvironment, ExperimentAction
from cernenv.scenarios import DIFFICULTIES, list_scenarios
from lib.agents.baselines import AlwaysNullAgent, HeuristicAgent, RandomAgent
from lib.episodes.agent_rollouts import collect_agent_episode
from lib.measure.metrics import bootstrap_mean

N_EPISODES = 210


def suite():
    curated = list_scenarios()
    for i in range(N_EPISODES):
        if i % 3 == 0:
            yield 5000 + i, curated[(i // 3) % len(curated)], None
        else:
            yield 5000 + i, None, DIFFICULTIES[(i // 3) % 3]


class _Scripted:
    """Plays a fixed function of the observation."""

    def __init__(self, policy):
        self.policy = policy

    def reset(self):
        pass

    def act(self, obs):
        return self.policy(obs)


def _claim(**parameters):
    return ExperimentAction(action_type=ActionType.SUBMIT_DISCOVERY_CLAIM, parameters=parameters)


def _claim_window_centre(obs):
    lo, hi = obs.task.search_window_gev
    return _claim(
        discovered=True,
        mass_gev=0.5 * (lo + hi),
        mass_uncertainty_gev=0.01 * (lo + hi),
        channel=obs.task.available_channels[0],
        spin=0,
        significance_sigma=5.0,
        confidence=0.9,
    )


class _MaxConfidence(HeuristicAgent):
    """The heuristic physicist, but every claim says 'discovery, 10σ, certain'."""

    def _claim(self, obs):
        fit = obs.logbook.get("fit_resonance") or {}
        mass = fit.get("mass_gev") or float(np.mean(obs.task.search_window_gev))
        return _claim(
            discovered=True,
            mass_gev=mass,
            mass_uncertainty_gev=float(fit.get("mass_err_gev") or 1.0),
            channel=fit.get("channel"),
            spin=(obs.logbook.get("measure_angular") or {}).get("best_spin"),
            significance_sigma=10.0,
            confidence=1.0,
        )


class _Understated(HeuristicAgent):
    """The heuristic physicist, but every discovery claims no significance at all."""

    def _claim(self, obs):
        action = super()._claim(obs)
        if action.parameters.get("discovered"):
            action.parameters["significance_sigma"] = 0.0
        return action


DEGENERATE = {
    "claim_at_once": lambda: _Scripted(_claim_window_centre),
    "always_125_gev": lambda: _Scripted(
        lambda obs: _claim(
            discovered=True,
            mass_gev=125.0,
            mass_uncertainty_gev=0.3,
            channel=obs.task.available_channels[0],
            spin=0,
            significance_sigma=5.0,
            confidence=0.9,
        )
    ),
    "always_no_discovery": lambda: _Scripted(lambda obs: _claim(discovered=False, confidence=0.9)),
    "repeat_cheapest_action": lambda: _Scripted(
        lambda obs: ExperimentAction(
            action_type=ActionType.SELECT_CHANNEL, parameters={"channel": obs.task.available_channels[0]}
        )
    ),
    "maximum_confidence": lambda: _MaxConfidence(),
    "random": lambda: RandomAgent(seed=11),
    "minimal_data_then_nothing_there": lambda: AlwaysNullAgent(),
}
WEAKER_HABITS = {
    "claims_at_global_1_sigma": lambda: HeuristicAgent(discovery_z_global=1.0),
    "claims_at_global_2_sigma": lambda: HeuristicAgent(discovery_z_global=2.0),
    "understates_its_significance": lambda: _Understated(),
}


def rewards_of(make_agent) -> np.ndarray:
    env, agent = CERNCollisionEnvironment(), make_agent()
    return np.array(
        [
            collect_agent_episode(env=env, agent=agent, seed=s, scenario=sc, difficulty=d).total_reward
            for s, sc, d in suite()
        ]
    )


def mean_reward(make_agent) -> float:
    return float(np.mean(rewards_of(make_agent)))


@pytest.fixture(scope="module")
def heuristic_rewards():
    return rewards_of(HeuristicAgent)


@pytest.fixture(scope="module")
def heuristic_mean(heuristic_rewards):
    return float(np.mean(heuristic_rewards))


def test_suite_spans_difficulties_and_nulls():
    env = CERNCollisionEnvironment()
    nulls, difficulties = 0, set()
    for seed, scenario, difficulty in suite():
        env.reset(seed=seed, scenario=scenario, difficulty=difficulty)
        nulls += not env.hidden_truth()["exists"]
        difficulties.add(env.state.difficulty)
    assert difficulties == set(DIFFICULTIES)
    assert nulls >= 30


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DEGENERATE))
def test_degenerate_policy_scores_below_heuristic(name, heuristic_mean):
    degenerate = mean_reward(DEGENERATE[name])
    assert degenerate < heuristic_mean - 0.5, f"{name}: {degenerate:.2f} vs heuristic {heuristic_mean:.2f}"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WEAKER_HABITS))
def test_dropping_an_honest_habit_costs(name, heuristic_rewards):
    difference = bootstrap_mean(rewards_of(WEAKER_HABITS[name]) - heuristic_rewards)
    assert difference.high < 0.0, f"{name}: {difference} against the heuristic"
