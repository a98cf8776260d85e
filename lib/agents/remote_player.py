"""An agent played as a client of an evaluation server, in a process of its own.

    python -m lib.agents.remote_player --url http://127.0.0.1:8000 --agent package.module:Class [--summary PATH]

Loads the agent class (`load_agent`: any class with `reset()` and `act(observation)`, as
`lib.agents.baselines` defines them), then plays the server's scored run on one WebSocket
session: reset (no seed: the server assigns the task), act until the episode is done, again,
until the server says the run has nothing more. An exception the agent raises (or an action it
returns that cannot be sent) fails that episode only: its traceback is printed the first time
(a line each time after), the episode is left (the server records it as abandoned: a failure),
and the run goes on. The process holds only what the server sends its agent;
`lib.measure.score_agent` starts it beside the server and scores the run.

Exit status: 0 when every episode was played to its end, 1 when the agent raised in some, 3 when
the agent cannot be loaded (one line saying why). `--summary PATH` writes what happened as JSON
(`played`, `failed`, `first_error`, `load_error`); `--load-only` loads the agent and stops.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

from cernenv.client import CERNEnvClient, action_payload

RUN_OVER = "there is nothing more to play on this server"
LOAD_FAILED = 3
"""The exit status of a player whose agent cannot be loaded."""


def load_agent(spec: str) -> Any:
    """An instance of the agent class `spec` names ("package.module:Class"); a ValueError that
    says what to give when it names nothing importable."""
    module_name, _, class_name = spec.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"--agent {spec!r}: give module:Class, e.g. lib.agents.baselines:HeuristicAgent")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"--agent {spec!r}: cannot import {module_name} ({error}); an agent kept outside the repository: "
            "AGENT_PATH=its/folder (score_agent --agent-path)"
        ) from None
    agent_class = getattr(module, class_name, None)
    if agent_class is None:
        raise ValueError(f"--agent {spec!r}: {module_name} has no {class_name}")
    try:
        agent = agent_class()
    except Exception as error:
        raise ValueError(f"--agent {spec!r}: {class_name}() raised {type(error).__name__}: {error}") from None
    missing = [name for name in ("reset", "act") if not callable(getattr(agent, name, None))]
    if missing:
        raise ValueError(
            f"--agent {spec!r}: an agent needs reset() and act(observation); it lacks {', '.join(missing)}"
        )
    return agent


@dataclass
class PlayReport:
    """What a player's run came to: episodes played to their end, episodes the agent failed (it
    raised, or returned what cannot be sent), the first failure, an agent that could not be loaded."""

    played: int = 0
    failed: int = 0
    first_error: Optional[str] = None
    load_error: Optional[str] = None
    errors: List[str] = field(default_factory=list)


def _agent_failed(report: PlayReport, episode: int, error: BaseException) -> None:
    """Count the agent's failure in `episode`; its traceback printed the first time, a line after."""
    line = f"{type(error).__name__}: {error}"[:500]
    report.failed += 1
    report.errors.append(f"episode {episode}: {line}")
    if report.first_error is None:
        report.first_error = f"episode {episode}: {line}"
        print(f"the agent raised in episode {episode}; the episode counts as failed, the run goes on:", file=sys.stderr)
        traceback.print_exception(error, file=sys.stderr)
    else:
        print(f"the agent raised again in episode {episode}: {line}", file=sys.stderr)
    sys.stderr.flush()


def play_run(url: str, agent: Any, *, headers: Optional[dict] = None, max_episodes: Optional[int] = None) -> PlayReport:
    """Play the server's scored run with `agent` until the run has no task left (or
    `max_episodes` episodes were started); what happened (`PlayReport`)."""
    report = PlayReport()
    started = 0
    with CERNEnvClient(base_url=url, headers=headers or {}).sync() as env:
        while max_episodes is None or started < max_episodes:
            try:
                result = env.reset()
            except Exception as error:  # the server's error frame, raised by OpenEnv's client
                if RUN_OVER in str(error):
                    break
                raise
            started += 1
            try:
                agent.reset()
                while not result.done:
                    payload = action_payload(agent.act(result.observation))
                    result = env.step(payload)
            except Exception as error:  # the agent's (or its action's): this episode fails, the run goes on
                _agent_failed(report, started, error)
                continue
            report.played += 1
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lib.agents.remote_player", description=__doc__, allow_abbrev=False)
    parser.add_argument("--url", help="the evaluation server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--agent", required=True, help="the agent class, module:Class")
    parser.add_argument("--max-episodes", type=int, help="stop after this many episodes (default: the whole run)")
    parser.add_argument("--summary", type=Path, metavar="PATH", help="write what happened here, as JSON")
    parser.add_argument(
        "--load-only", action="store_true", help="load the agent and stop (exit 3 if it cannot be loaded): a check"
    )
    args = parser.parse_args(argv)
    if args.url is None and not args.load_only:
        parser.error("--url: give the evaluation server, e.g. http://127.0.0.1:8000")
    try:
        agent = load_agent(args.agent)
    except ValueError as error:
        report = PlayReport(load_error=str(error))
        status = LOAD_FAILED
        if args.summary is None:  # with a summary, whoever reads it says it (score_agent: one line)
            print(f"error: {error}", file=sys.stderr, flush=True)
    else:
        if args.load_only:
            return 0
        report = play_run(args.url, agent, max_episodes=args.max_episodes)
        status = 1 if report.failed else 0
        print(
            f"played {report.played} episodes to their end"
            + (f"; the agent raised in {report.failed}" if report.failed else ""),
            flush=True,
        )
    if args.summary is not None:
        args.summary.write_text(json.dumps(asdict(report)) + "\n", encoding="utf-8")
    return status


if __name__ == "__main__":
    sys.exit(main())
