"""Replay a recorded episode in the environment to see its physics step by step.

An evidence file (`pre_eval.jsonl`, `post_eval.jsonl`) keeps what the agent saw and sent,
not the spectra and fits its actions made. The environment is deterministic per seed,
so sending the recorded actions again rebuilds them exactly; `replay` checks that it
does, step by step, by comparing the rewards (a changed environment or a record from
another code version fails loudly instead of showing someone else's physics).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Mapping, Optional

from cernenv import CERNCollisionEnvironment
from cernenv.scenarios import list_scenarios
from lib.plotting import analysis_snapshot
from lib.records import as_episode_dict

REWARD_TOLERANCE = 1e-6
"""Largest difference between a recorded and a replayed step reward that counts as equal."""


class ReplayMismatch(RuntimeError):
    """The replayed episode earned other rewards than the recorded one."""


def reset_for(env: CERNCollisionEnvironment, episode: Mapping[str, Any]) -> Any:
    """Reset `env` to the world `episode` was played in (its seed and scenario or difficulty)."""
    seed, scenario = episode.get("seed"), episode.get("scenario")
    if seed is None:
        raise ValueError("the episode has no seed: it cannot be replayed")
    if scenario in list_scenarios():
        return env.reset(seed=int(seed), scenario=scenario)
    return env.reset(seed=int(seed), difficulty=episode.get("difficulty"))


def replay(episode: Any, *, upto_step: Optional[int] = None) -> List[Dict[str, Any]]:
    """The analysis objects (`lib.plotting.analysis_snapshot`) after each recorded step.

    Returns one snapshot per step played (all of them, or the first `upto_step`); each
    holds `spectrum`, `resonance_fit`, `background_fit` and `scan` as they stood after
    that step (None until made). Raises `ReplayMismatch` where a reward differs from the
    record's.
    """
    record = as_episode_dict(episode)
    steps = list(record.get("steps") or [])[:upto_step]
    env = CERNCollisionEnvironment()
    reset_for(env, record)
    snapshots = []
    for index, step in enumerate(steps):
        obs = env.step(step.get("action"))
        recorded = float(step.get("reward", math.nan))
        if not math.isclose(float(obs.reward or 0.0), recorded, abs_tol=REWARD_TOLERANCE):
            raise ReplayMismatch(
                f"seed {record.get('seed')} step {index}: replayed reward {obs.reward!r} ≠ recorded {recorded!r}; "
                "the record comes from another version of the environment: regenerate the evidence "
                "(make train or make reproduce)"
            )
        snapshots.append(analysis_snapshot(env))
    return snapshots
