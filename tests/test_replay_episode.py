"""An auditor's replay of one ledger episode (`cernenv.server.audit.replay_episode`), on records made
here as the server makes them: a task of a named scenario replays in that scenario's world, an
episode that ended without a claim replays to the same ending, and what does not come back as
recorded is named field by field, whole."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

import pytest

from cernenv.environment import CERNCollisionEnvironment
from cernenv.server.audit import replay_episode
from cernenv.server.ledger import EpisodeEnded, Grade
from lib.agents.baselines import HeuristicAgent

SECRET = "an auditor's world secret"
NONCE = "0123456789abcdef0123456789abcdef"
REFUSED = {"action_type": "build_invariant_mass", "parameters": {}}  # before a channel: refused every time


def record_of(task: Dict[str, Any], actions: Optional[List[Dict[str, Any]]] = None, **changes: Any) -> EpisodeEnded:
    """The ledger record of `task` played in the world of `SECRET` and `NONCE`: `actions` sent in
    order (None: the heuristic plays it to its claim), as the server writes an ended episode; then
    `changes` to its fields (a tampered record)."""
    env = CERNCollisionEnvironment(secret_salt=SECRET)
    obs = env.reset(
        seed=task["seed"], scenario=task.get("scenario"), difficulty=task.get("difficulty"), world_nonce=NONCE
    )
    sent: List[Dict[str, Any]] = []
    agent = HeuristicAgent()
    while not obs.done:
        action = agent.act(obs) if actions is None else actions[len(sent)]
        action = action if isinstance(action, dict) else json.loads(action.model_dump_json())
        sent.append(action)
        obs = env.step(action)
    state, grade = env.state, env.episode_grade()
    fields = {
        "ended_at": "2026-12-07T00:00:00Z",
        "mode": "evaluation",
        "secret_fingerprint": None,
        "session_id": "s",
        "client": None,
        "episode_id": None,
        "seed": task["seed"],
        "scenario": state.scenario_name,
        "difficulty": state.difficulty,
        "world_nonce": NONCE,
        "steps": state.step_count,
        "ended": obs.latest_result.get("episode_end") or "claim",
        "grade": Grade(**grade),
        "truth": json.loads(json.dumps(env.hidden_truth())),
        "episode_reward": state.cumulative_reward,
        "resources": {
            k: v
            for k, v in obs.resource_usage.model_dump().items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        },
        "claim": env.episode_claim(),
        "actions": sent,
        "refused_actions": env.refused_actions(),
    }
    return EpisodeEnded(**{**fields, **changes})


NAMED = {"seed": 7, "scenario": "higgs_diphoton_125", "difficulty": "medium"}


def test_a_task_of_a_named_scenario_replays_in_that_scenario_s_world():
    """The task names its scenario (and the difficulty that scenario has): the replay plays that
    scenario, not a procedural world drawn at the task's difficulty."""
    record = record_of(NAMED)
    assert record.scenario == "higgs_diphoton_125" and record.ended == "claim"
    assert replay_episode(record, NAMED, SECRET) is None
    drawn = {"seed": 7, "difficulty": "medium"}
    assert replay_episode(record_of(drawn), drawn, SECRET) is None
    assert replay_episode(record, drawn, SECRET) is not None, "another world: the replay does not follow the record"


def test_an_episode_ended_by_refusals_replays_to_that_ending_and_a_record_of_another_is_caught():
    record = record_of(NAMED, [REFUSED] * 5)
    assert record.ended != "claim" and record.grade is not None and record.claim is None
    assert replay_episode(record, NAMED, SECRET) is None
    forged = record_of(NAMED, [REFUSED] * 5, ended="claim")
    assert replay_episode(forged, NAMED, SECRET) == (
        f'does not replay as recorded: ended recorded "claim", replayed {json.dumps(record.ended)}'
    )


@pytest.mark.parametrize("actions, ending", [(None, "claim"), ([REFUSED] * 5, "refusals")])
def test_a_record_that_says_abandoned_of_an_episode_the_replay_ends_is_caught(actions, ending):
    """The record says the episode was abandoned (no grade), yet its actions end it in the replay:
    the message says how the replay ended (its claim, or the end without one)."""
    played = record_of(NAMED, actions)
    abandoned = record_of(NAMED, actions, grade=None, ended="abandoned: reset")
    said = replay_episode(abandoned, NAMED, SECRET)
    how = "claim" if ending == "claim" else played.ended
    assert said == f"ends ({how}) in the replay; the record says 'abandoned: reset'"


def test_every_field_that_differs_is_named_with_both_values_whole():
    record = record_of(NAMED)
    forged = record_of(NAMED, steps=record.steps + 1, episode_reward=record.episode_reward + 1.0)
    assert replay_episode(forged, NAMED, SECRET) == (
        f"does not replay as recorded: episode_reward recorded {json.dumps(record.episode_reward + 1.0)}, "
        f"replayed {json.dumps(record.episode_reward)}; steps recorded {record.steps + 1}, replayed {record.steps}"
    )
