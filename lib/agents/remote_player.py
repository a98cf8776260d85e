"""An agent played as a client of an evaluation server, in a process of its own.

    python -m lib.agents.remote_player --url http://127.0.0.1:8000 --agent package.module:Class [--summary PATH]

Loads the agent class (`load_agent`: any class with `reset()` and `act(observation)`, as
`lib.agents.baselines` defines them), then plays the server's scored run on one WebSocket
session: sends the entrant's nonce if the run still waits for one (a fresh random one: see
`cernenv.server.runs`), then reset (no seed: the server assigns the task), act until the episode
is done, again, until the server says the run has nothing more; with `--receipts PATH` it keeps
the run's signed ledger head after each episode there (`Receipts`), for
`python -m lib.measure.scorecard --receipts` to check the published ledger against. An exception
the agent raises (or an action it returns that cannot be sent) fails that episode only: its
traceback is printed the first time (a line each time after), the episode is left (the server
records it as abandoned: a failure), and the run goes on. The process holds only what the server sends its agent;
`lib.measure.score_agent` starts it beside the server and scores the run.

Exit status: 0 when every episode was played to its end, 1 when the agent raised in some, 3 when
the agent cannot be loaded (one line saying why). `--summary PATH` writes what happened as JSON
(`played`, `failed`, `first_error`, `load_error`); `--load-only` loads the agent and stops.
"""

from __future__ import annotations

import argparse
import importlib
import json
import secrets
import sys
import traceback
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from cernenv.client import CERNEnvClient, action_payload
from cernenv.server.audit import RECEIPTS_FORMAT
from lib.files import atomic_write

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


def get_json(url: str, headers: Optional[Mapping[str, str]] = None) -> Optional[Dict[str, Any]]:
    """The JSON a GET of `url` answers, or None when it cannot be had."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=dict(headers or {})), timeout=5) as answer:
            return json.loads(answer.read())
    except (OSError, ValueError):
        return None


def send_nonce(url: str, nonce: str, headers: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """POST the entrant's `nonce` to the scored run of the server at `url`; what `/evaluation` then
    says of the run. A RuntimeError with the server's reason when it refuses."""
    request = urllib.request.Request(
        url + "/evaluation/nonce",
        data=json.dumps({"nonce": nonce}).encode(),
        headers={"Content-Type": "application/json", **dict(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"the server refused the entrant's nonce: {error.read().decode()[:300]}") from None


class Receipts:
    """An entrant's receipts of one scored run: the signed heads of its ledger as `GET /evaluation`
    served them (`cernenv.server.runs.ScoredRun.describe`), one per new head; `write` saves them in
    the form `python -m lib.measure.scorecard --receipts` checks (`cernenv.server.audit.check_receipts`)."""

    def __init__(self, run: Mapping[str, Any], nonce: Optional[str]) -> None:
        self.header = {
            "format": RECEIPTS_FORMAT,
            "run_id": run.get("run_id"),
            "commitment": run.get("commitment"),
            "public_key": run.get("public_key"),
            "entrant_nonce": nonce,
        }
        self.receipts: List[Dict[str, Any]] = []

    def keep(self, state: Optional[Mapping[str, Any]]) -> None:
        """Keep the head `state` (a scored run as `/evaluation` describes it) names, when it is new."""
        head = (state or {}).get("head")
        if (
            isinstance(head, dict)
            and head.get("signature")
            and (not self.receipts or self.receipts[-1]["line"] != head.get("line"))
        ):
            self.receipts.append({k: head.get(k) for k in ("line", "line_sha256", "digest", "signature")})

    def write(self, path: Path) -> None:
        atomic_write(path, json.dumps({**self.header, "receipts": self.receipts}, indent=1) + "\n")


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


def play_run(
    url: str,
    agent: Any,
    *,
    headers: Optional[dict] = None,
    max_episodes: Optional[int] = None,
    receipts_path: Optional[Path] = None,
) -> PlayReport:
    """Play the server's scored run with `agent` until the run has no task left (or
    `max_episodes` episodes were started), sending the entrant's nonce first if the run waits
    for one, and keeping the receipts in `receipts_path`; what happened (`PlayReport`)."""
    report = PlayReport()
    started = 0
    run = (get_json(url + "/evaluation", headers) or {}).get("scored_run") or {}
    nonce = None
    if run.get("awaits_nonce"):
        nonce = secrets.token_hex(16)
        run = send_nonce(url, nonce, headers)
    receipts = Receipts(run, nonce or run.get("entrant_nonce"))
    receipts.keep(run)

    def keep_receipt() -> None:
        if receipts_path is not None:
            receipts.keep((get_json(url + "/evaluation", headers) or {}).get("scored_run"))
            receipts.write(receipts_path)

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
            keep_receipt()
    keep_receipt()
    return report


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lib.agents.remote_player", description=__doc__, allow_abbrev=False)
    parser.add_argument("--url", help="the evaluation server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--agent", required=True, help="the agent class, module:Class")
    parser.add_argument("--max-episodes", type=int, help="stop after this many episodes (default: the whole run)")
    parser.add_argument("--summary", type=Path, metavar="PATH", help="write what happened here, as JSON")
    parser.add_argument(
        "--receipts", type=Path, metavar="PATH", help="keep the run's signed ledger head after each episode here"
    )
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
        report = play_run(args.url, agent, max_episodes=args.max_episodes, receipts_path=args.receipts)
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
