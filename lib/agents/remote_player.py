"""An agent played as a client of an evaluation server, in a process of its own.

    python -m lib.agents.remote_player --url http://127.0.0.1:8000 --agent package.module:Class [--summary PATH]

Loads the agent class (`load_agent`: any class with `reset()` and `act(observation)`, as
`lib.agents.baselines` defines them), then plays the server's scored run on one WebSocket
session. On its own it is the run's entrant (`Entrant`): it makes a key of its own, sends the
entrant's nonce (a fresh random one) signed with the agent's name and its module's SHA-256 (see
`cernenv.server.runs`), and refuses a run that already has a nonce it did not send (exit 2);
`lib.measure.score_agent`, which is the entrant itself, starts it with `--entrant-nonce` (the
nonce it sent: a run with another is refused). Then reset (no seed: the server assigns the task),
act until the episode is done, again, until the server says the run has nothing more; with
`--receipts PATH` it keeps the run's signed ledger head after each episode there (`Receipts`),
ends the run (`POST /evaluation/end`, signed) and keeps the end line's receipt too, signed with its
key, for `python -m lib.measure.scorecard --receipts` to check the published ledger against. An exception
the agent raises (or an action it returns that cannot be sent) fails that episode only: its
traceback is printed the first time (later ones are counted), the episode is left (the server
records it as abandoned: a failure), and the run goes on. The first action the environment refuses
is printed with why (`refusal_reason`: "act() returned a str; return an ExperimentAction or a
dict ..."). The process holds only what the server sends its agent;
`lib.measure.score_agent` starts it beside the server and scores the run.

Exit status: 0 when every episode was played to its end, 1 when the agent raised in some, 2 when
the run is refused (a nonce this player did not send), 3 when the agent cannot be loaded (one line
saying why). `--summary PATH` writes what happened as JSON
(`played`, `failed`, `first_error`, `load_error`, `actions`, `refused`, `first_refusal`);
`--load-only` loads the agent and stops.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.machinery
import json
import os
import secrets
import sys
import traceback
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import BaseModel

from cernenv.client import CERNEnvClient, action_payload
from cernenv.server.audit import RECEIPTS_FORMAT
from cernenv.server.ledger import public_key_hex
from cernenv.server.runs import end_statement, entrant_statement, receipts_statement
from lib.files import atomic_write

RUN_OVER = "there is nothing more to play on this server"
LOAD_FAILED = 3
"""The exit status of a player whose agent cannot be loaded."""
REFUSED = 2
"""The exit status of a player that refuses the run (a nonce it did not send)."""


class RunRefused(RuntimeError):
    """A scored run the entrant's side will not play or score: one line saying why."""


def agent_module_file(spec: str, search: Sequence[str] = ()) -> Optional[Path]:
    """The file that defines the module of the agent `spec` ("package.module:Class"), found along
    `search` and then `sys.path` without importing anything (no code of the agent runs), or None."""
    names = spec.partition(":")[0].split(".")
    locations: Optional[List[str]] = [str(p) for p in search] + list(sys.path)
    found = None
    for depth in range(1, len(names) + 1):
        found = importlib.machinery.PathFinder.find_spec(".".join(names[:depth]), locations)
        if found is None:
            return None
        locations = list(found.submodule_search_locations or [])
    origin = getattr(found, "origin", None)
    return Path(origin) if origin and os.path.isfile(origin) else None


def agent_code_sha256(spec: str, search: Sequence[str] = ()) -> str:
    """The SHA-256 (hex) of the file that defines the agent's module (`agent_module_file`): what a
    scored run records of the agent's code beside its name. A RunRefused when there is no such file."""
    path = agent_module_file(spec, search)
    if path is None:
        raise RunRefused(f"the agent {spec}'s module is no file found on the import path: its code cannot be hashed")
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Entrant:
    """The entrant of a scored run: its own Ed25519 key (made here, never written), its `nonce` (32
    random hex digits unless given) and what plays (`agent`, `agent_sha256`). It sends the nonce
    signed with them (`send_nonce`), ends the run (`end`), and signs its receipts (`Receipts.write`)."""

    def __init__(self, agent: str, agent_sha256: str, nonce: Optional[str] = None) -> None:
        self._key = Ed25519PrivateKey.generate()
        self.public_key = public_key_hex(self._key)
        self.nonce = nonce or secrets.token_hex(16)
        self.agent, self.agent_sha256 = agent, agent_sha256

    def sign(self, statement: bytes) -> str:
        return self._key.sign(statement).hex()

    def send_nonce(
        self, url: str, run: Mapping[str, Any], headers: Optional[Mapping[str, str]] = None
    ) -> Dict[str, Any]:
        """POST the nonce, signed with the agent, to the run `run` (as `/evaluation` described it)."""
        body = self.nonce_body(str(run.get("run_id")), str(run.get("commitment")))
        return _post(url + "/evaluation/nonce", body, headers, "the server refused the entrant's nonce")

    def nonce_body(self, run_id: str, commitment: str) -> Dict[str, Any]:
        """What `POST /evaluation/nonce` takes (`cernenv.server.runs.ScoredRun.seed`): the nonce, the
        agent, its code's SHA-256, this entrant's public key and its signature of them with the run."""
        statement = entrant_statement(run_id, commitment, self.nonce, self.agent, self.agent_sha256)
        return {
            "nonce": self.nonce,
            "agent": self.agent,
            "agent_sha256": self.agent_sha256,
            "public_key": self.public_key,
            "signature": self.sign(statement),
        }

    def end(self, url: str, run_id: str, headers: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
        """End the run (a no-op when every task was played): the end line is then served, to keep."""
        body = {"signature": self.sign(end_statement(run_id))}
        return _post(url + "/evaluation/end", body, headers, "the server refused to end the run")


def _post(url: str, body: Mapping[str, Any], headers: Optional[Mapping[str, str]], refused: str) -> Dict[str, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **dict(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return json.loads(answer.read())
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"{refused}: {error.read().decode()[:300]}") from None


def check_own_nonce(run: Mapping[str, Any], nonce: Optional[str]) -> None:
    """A RunRefused unless the run `run` (as `/evaluation` describes it) took `nonce`, the one this
    side sent (None: it sent none, so any nonce the run holds is someone else's)."""
    held = run.get("entrant_nonce")
    if held is not None and held != nonce:
        raise RunRefused(
            f"scored run {run.get('run_id')} already has an entrant's nonce ({held}) that this side did not send: "
            "whoever sent it chose the run's worlds with the operator; play a run whose nonce is yours"
        )


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


class Receipts:
    """An entrant's receipts of one scored run: the signed heads of its ledger as `GET /evaluation`
    served them (`cernenv.server.runs.ScoredRun.describe`), one per new head, in order; `write`
    saves them, signed with the entrant's key, in the form `python -m lib.measure.scorecard
    --receipts` checks (`cernenv.server.audit.check_receipts`)."""

    def __init__(self, run: Mapping[str, Any], entrant: Entrant) -> None:
        self.entrant = entrant
        self.header = {
            "format": RECEIPTS_FORMAT,
            "run_id": run.get("run_id"),
            "commitment": run.get("commitment"),
            "public_key": run.get("public_key"),
            "entrant_nonce": entrant.nonce,
            "agent": entrant.agent,
            "agent_sha256": entrant.agent_sha256,
            "entrant_public_key": entrant.public_key,
        }
        self.receipts: List[Dict[str, Any]] = []

    def keep(self, state: Optional[Mapping[str, Any]]) -> None:
        """Keep the head `state` (a scored run as `/evaluation` describes it) names, when it is new."""
        head = (state or {}).get("head")
        if (
            isinstance(head, dict)
            and head.get("signature")
            and isinstance(head.get("line"), int)
            and (not self.receipts or self.receipts[-1]["line"] < head["line"])
        ):
            self.receipts.append({k: head.get(k) for k in ("line", "line_sha256", "digest", "signature")})

    def signed(self) -> Dict[str, Any]:
        """The receipts file's content, with the entrant's signature of the rest."""
        content = {**self.header, "receipts": self.receipts}
        return {**content, "entrant_signature": self.entrant.sign(receipts_statement(content))}

    def write(self, path: Path) -> None:
        atomic_write(path, json.dumps(self.signed(), indent=1) + "\n")


@dataclass
class PlayReport:
    """What a player's run came to: episodes played to their end, episodes the agent failed (it
    raised, or returned what cannot be sent), the first failure (the last line of its traceback),
    the actions sent and how many the environment refused, the first refusal and why
    (`refusal_reason`), an agent that could not be loaded."""

    played: int = 0
    failed: int = 0
    first_error: Optional[str] = None
    load_error: Optional[str] = None
    errors: List[str] = field(default_factory=list)
    actions: int = 0
    refused: int = 0
    first_refusal: Optional[str] = None


def _agent_failed(report: PlayReport, episode: int, error: BaseException) -> None:
    """Count the agent's failure in `episode`; its traceback is printed the first time only (the
    end's line counts them all)."""
    line = f"{type(error).__name__}: {error}"[:500]
    report.failed += 1
    report.errors.append(f"episode {episode}: {line}")
    if report.first_error is None:
        report.first_error = f"episode {episode}: {line}"
        print(
            f"the agent raised in episode {episode}; the episode counts as failed, the run goes on (a later "
            "exception is counted, not printed):",
            file=sys.stderr,
        )
        traceback.print_exception(error, file=sys.stderr)
        sys.stderr.flush()


def refusal_reason(returned: Any, observation: Any) -> Optional[str]:
    """Why the environment refused the action `act()` returned (`returned`), as the observation that
    answered it says (its `latest_result`'s error), with what `act()` returned when that was no
    action at all ("act() returned a str; return an ExperimentAction or a dict: ..."); None when
    the action was not refused."""
    latest = getattr(observation, "latest_result", None)
    error = latest.get("error") if isinstance(latest, dict) else None
    if not error:
        return None
    kind = type(returned).__name__
    kind = ("an " if kind[:1].lower() in "aeiou" else "a ") + kind
    if isinstance(returned, (BaseModel, dict)):
        return f"act() returned {kind} the environment refused: {str(error)[:400]}"
    return (
        f"act() returned {kind}; return an ExperimentAction or a dict (docs/agents.md, 'What act returns'); "
        f"the environment said: {str(error)[:400]}"
    )


def _count_action(report: PlayReport, episode: int, step: int, returned: Any, observation: Any) -> None:
    """Count an action sent, and a refused one; the first refusal is kept and printed with why."""
    report.actions += 1
    reason = refusal_reason(returned, observation)
    if reason is None:
        return
    report.refused += 1
    if report.first_refusal is None:
        report.first_refusal = f"episode {episode}, step {step}: {reason}"
        print(f"the environment refused the agent's action in {report.first_refusal}", file=sys.stderr, flush=True)


def play_run(
    url: str,
    agent: Any,
    *,
    headers: Optional[dict] = None,
    max_episodes: Optional[int] = None,
    receipts_path: Optional[Path] = None,
    entrant: Optional[Entrant] = None,
    sent_nonce: Optional[str] = None,
) -> PlayReport:
    """Play the server's scored run with `agent` until the run has no task left (or
    `max_episodes` episodes were started). As the run's `entrant` it sends the nonce when the run
    waits for one, keeps the receipts in `receipts_path`, and at the end ends the run and keeps the
    end line's receipt; playing for an entrant who sent `sent_nonce`, it only checks the run has
    that one. A run holding a nonce this side did not send is refused (`RunRefused`)."""
    report = PlayReport()
    started = 0
    run = (get_json(url + "/evaluation", headers) or {}).get("scored_run") or {}
    if entrant is not None and run.get("awaits_nonce"):
        run = entrant.send_nonce(url, run, headers)
    check_own_nonce(run, entrant.nonce if entrant is not None else sent_nonce)
    receipts = Receipts(run, entrant) if entrant is not None else None
    if receipts is not None:
        receipts.keep(run)

    def keep_receipt() -> None:
        if receipts is not None and receipts_path is not None:
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
                step = 0
                while not result.done:
                    returned = agent.act(result.observation)
                    result = env.step(action_payload(returned))
                    step += 1
                    _count_action(report, started, step, returned, result.observation)
            except Exception as error:  # the agent's (or its action's): this episode fails, the run goes on
                _agent_failed(report, started, error)
                continue
            report.played += 1
            keep_receipt()
    if entrant is not None and receipts_path is not None:
        receipts.keep(entrant.end(url, str(run.get("run_id")), headers))
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
        "--entrant-nonce",
        metavar="TEXT",
        help="play for the entrant who sent this nonce (lib.measure.score_agent): a run holding another is refused",
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
        try:
            entrant = None
            if args.entrant_nonce is None:  # on its own, this player is the run's entrant
                search = [os.getcwd(), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
                entrant = Entrant(args.agent, agent_code_sha256(args.agent, search))
            report = play_run(
                args.url,
                agent,
                max_episodes=args.max_episodes,
                receipts_path=args.receipts,
                entrant=entrant,
                sent_nonce=args.entrant_nonce,
            )
        except RunRefused as error:
            print(f"error: {error}", file=sys.stderr, flush=True)
            return REFUSED
        status = 1 if report.failed else 0
        print(
            f"played {report.played} episodes to their end; {report.refused} of {report.actions} actions refused"
            + (f"; the agent raised in {report.failed} (first: {report.first_error})" if report.failed else ""),
            flush=True,
        )
    if args.summary is not None:
        args.summary.write_text(json.dumps(asdict(report)) + "\n", encoding="utf-8")
    return status


if __name__ == "__main__":
    sys.exit(main())
