"""An agent played as a client of an evaluation server, in a process of its own.

    python -m lib.agents.remote_player --url http://127.0.0.1:8000 --agent package.module:Class

Loads the agent class (`load_agent`: any class with `reset()` and `act(observation)`, as
`lib.agents.baselines` defines them), then plays the server's scored run on one WebSocket
session: reset (no seed: the server assigns the task), act until the episode is done, again,
until the server says the run has nothing more. The process holds only what the server sends
its agent; `lib.measure.score_agent` starts it beside the server and scores the run.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, Optional, Sequence

from cernenv.client import CERNEnvClient

RUN_OVER = "there is nothing more to play on this server"


def load_agent(spec: str) -> Any:
    """An instance of the agent class `spec` names ("package.module:Class"); a ValueError that
    says what to give when it names nothing importable."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"--agent {spec!r}: give module:Class, e.g. lib.agents.baselines:HeuristicAgent")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--agent {spec!r}: cannot import {module_name} ({error})") from None
    agent_class = getattr(module, class_name, None)
    if agent_class is None:
        raise ValueError(f"--agent {spec!r}: {module_name} has no {class_name}")
    agent = agent_class()
    missing = [name for name in ("reset", "act") if not callable(getattr(agent, name, None))]
    if missing:
        raise ValueError(
            f"--agent {spec!r}: an agent needs reset() and act(observation); it lacks {', '.join(missing)}"
        )
    return agent


def play_run(url: str, agent: Any, *, headers: Optional[dict] = None, max_episodes: Optional[int] = None) -> int:
    """Play the server's scored run with `agent` until the run has no task left (or
    `max_episodes`); the number of episodes played to their end."""
    played = 0
    with CERNEnvClient(base_url=url, headers=headers or {}).sync() as env:
        while max_episodes is None or played < max_episodes:
            try:
                result = env.reset()
            except Exception as error:  # the server's error frame, raised by OpenEnv's client
                if RUN_OVER in str(error):
                    break
                raise
            agent.reset()
            while not result.done:
                result = env.step(agent.act(result.observation))
            played += 1
    return played


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lib.agents.remote_player", description=__doc__, allow_abbrev=False)
    parser.add_argument("--url", required=True, help="the evaluation server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--agent", required=True, help="the agent class, module:Class")
    parser.add_argument("--max-episodes", type=int, help="stop after this many episodes (default: the whole run)")
    args = parser.parse_args(argv)
    try:
        agent = load_agent(args.agent)
    except ValueError as error:
        parser.error(str(error))
    played = play_run(args.url, agent, max_episodes=args.max_episodes)
    print(f"played {played} episodes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
