"""`CERNEnvClient`: play CERNenv on a server (`python -m cernenv.server`) over OpenEnv's WebSocket API.

>>> from cernenv import ExperimentAction
>>> from cernenv.client import CERNEnvClient
>>> with CERNEnvClient(base_url="http://127.0.0.1:8000").sync() as env:  # doctest: +SKIP
...     result = env.reset(seed=7, scenario="higgs_diphoton_125")  # or difficulty="easy"|"medium"|"hard"
...     result = env.step(ExperimentAction(action_type="configure_beam", parameters={"beam_energy_tev": 13.6}))
...     result.observation.selected_beam_energy_tev, env.state().step_count
(13.6, 1)

Each client is one session, i.e. one environment on the server, for as long as it is
connected; `reset` keyword arguments (`seed`, `scenario`, `difficulty`, `episode_id`)
reach `CERNCollisionEnvironment.reset` unchanged. For the same seed and actions the
observations are exactly those of the in-process environment, malformed actions
included: they come back as rule violations in the observation, not as exceptions.
Protocol errors (no reset yet, an unknown reset parameter, an oversized message, a full
server) raise `RuntimeError` with the server's message.
"""

from __future__ import annotations

import json
from typing import Any, Dict

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from pydantic import BaseModel

from cernenv.models import CernState, CollisionObservation, ExperimentAction

RAW_ACTION_KEY = "__cernenv_raw_action__"
"""A step message's data must be a JSON object; an action that is not one (say, an LLM's
unparsable reply as a string) travels as `{RAW_ACTION_KEY: action}` and is unwrapped by the
server, so that the environment judges it exactly as it would in process."""


def action_payload(action: Any) -> Dict[str, Any]:
    """The JSON object a step message carries for `action` (see `RAW_ACTION_KEY`)."""
    if isinstance(action, BaseModel):
        return action.model_dump(mode="json")
    if isinstance(action, dict):
        return action
    try:
        json.dumps(action)
    except (TypeError, ValueError):
        raise TypeError(
            f"cannot send a {type(action).__name__} to the server: an action is an ExperimentAction, "
            "a JSON object or a JSON value"
        ) from None
    return {RAW_ACTION_KEY: action}


def parse_observation(payload: Dict[str, Any]) -> CollisionObservation:
    """The observation in a reset or step reply (OpenEnv sends `reward` and `done` beside it)."""
    return CollisionObservation.model_validate(
        {**payload.get("observation", {}), "reward": payload.get("reward"), "done": payload.get("done", False)}
    )


class CERNEnvClient(EnvClient[ExperimentAction, CollisionObservation, CernState]):
    """A typed OpenEnv client for CERNenv: `reset`/`step` give `StepResult[CollisionObservation]`,
    `state()` gives `CernState`. Async by default; `.sync()` for blocking use."""

    def _step_payload(self, action: Any) -> Dict[str, Any]:
        return action_payload(action)

    def _parse_result(self, payload: Dict[str, Any]) -> StepResult[CollisionObservation]:
        observation = parse_observation(payload)
        return StepResult(
            observation=observation, reward=observation.reward, done=observation.done, metadata=payload.get("metadata")
        )

    def _parse_state(self, payload: Dict[str, Any]) -> CernState:
        return CernState.model_validate(payload)
