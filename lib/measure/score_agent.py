"""Score an agent you did not write: it plays a scored run as a client of an evaluation server, in
a process of its own, and the run's ledger is scored and verified.

    python -m lib.measure.score_agent --agent package.module:Class [--agent-path DIR] [--suite v3] [--out DIR]
    make evaluate AGENT=package.module:Class [AGENT_PATH=DIR] [SUITE=v3]

Three processes: the server (`python -m cernenv.server --scored-run SUITE`, on a free loopback
port, the run's ledger in a private temporary folder), the agent (`python -m
lib.agents.remote_player`, started without the CERNENV_* variables, importing from the
repository, the current folder and each `--agent-path`), and this one, the entrant's client: it
reads the run's commitment, sends the entrant's nonce (`POST /evaluation/nonce`: a fresh random
one, or `--entrant-nonce`), starts the agent, keeps a receipt of each signed head of the ledger
it sees (`GET /evaluation` every 0.2 s and once the agent is done, RUN_ID.receipts.json), then
scores the ledger, checks it holds every receipt and replays every episode against the run's
reveal (`lib.measure.scorecard`). What the run came to (`agent_run`: episodes played to their
end, abandoned, never played) is read from the run's ledger, never from the agent's process,
whose own report is kept as `player_said`. The agent's process holds what the server sends an
agent and nothing else: the secret of the run's worlds exists only in the server's memory until
the run ends, every world is fresh, and the run's tasks come in an order the server keeps to
itself. Introspecting its own process (frames, the garbage collector, files) finds nothing.

It fails (`AgentRunError`: one line, a non-zero exit) when the agent cannot be loaded (checked in
a process of its own before any server starts), plays no episode to its end, left some
unfinished (it raised, or walked away: those count as failures; the run went on and is scored),
or its process ended before the run did. The run's ledger, reveal, receipts and scorecard are
kept in `--out`. `--commitment-file PATH` writes the run's commitment there before any nonce is
sent and, with `--nonce-file PATH`, waits for the nonce to appear in that file: how
`make scored-run-example` commits the commitment to git before the run is played.

What this does not isolate: the agent runs as your user, so it could read files you can and, where
the kernel lets one process of a user read another's memory (`kernel.yama.ptrace_scope` 0), the
server's. For an agent you do not trust at all, run it under another user or in a container
(`cernenv/Dockerfile` serves the same server), and point `lib.agents.remote_player` at it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence

from cernenv.server.audit import AuditError
from cernenv.server.runs import reveal_path
from cernenv.suite import SELECTION_HELP, SUITE_VERSION, selected_tasks
from lib.agents.remote_player import LOAD_FAILED, Receipts, get_json, send_nonce
from lib.files import atomic_write
from lib.measure.scorecard import score_run, scorecard_json, scorecard_markdown, verified_line
from lib.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
AGENT_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
SERVER_START_S = 180.0
"""How long the server may take to answer /health (it compiles the physics kernels first)."""


_get = get_json


class AgentRunError(RuntimeError):
    """The agent could not be scored as asked: it cannot be loaded, played no episode to its end,
    or raised in some. One line, saying which and what to do."""


def agent_environment(extra_paths: Sequence[str] = ()) -> Dict[str, str]:
    """The agent process's variables: this process's, without CERNENV_* (the server's settings),
    with the repository, the current folder and `extra_paths` importable."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CERNENV_")}
    paths = [str(ROOT), os.getcwd(), *map(str, extra_paths), *filter(None, [environment.get("PYTHONPATH")])]
    environment["PYTHONPATH"] = os.pathsep.join(paths)
    return environment


def score_agent(
    agent: str,
    suite: str = SUITE_VERSION,
    *,
    out_dir: Optional[Path] = None,
    agent_paths: Sequence[Path] = (),
    progress_every_s: float = 15.0,
    max_episodes: Optional[int] = None,
    verify: bool = True,
    entrant_nonce: Optional[str] = None,
    commitment_file: Optional[Path] = None,
    nonce_file: Optional[Path] = None,
) -> Dict[str, Any]:
    """Play `suite` with the agent class `agent` ("module:Class", importable from the repository,
    the current folder or `agent_paths`) out of process and return its scorecard
    (`lib.measure.scorecard.scorecard`, verified against the run's reveal unless `verify` is
    False) and checked against the receipts kept while it played, with `agent_run`: what the run's
    ledger says the agent did (`played` to the end, `failed`: abandoned, `unplayed`), the player
    process's `exit_status`, `first_error` and `player_said` (its own report, not believed), and
    `error` (why the run fails, or None). The run's ledger (RUN_ID.jsonl), reveal
    (RUN_ID.reveal.json), receipts (RUN_ID.receipts.json) and scorecard (scorecard-RUN_ID.json and
    .md) go to `out_dir` when given. `max_episodes`: the agent stops after so many (the rest of the
    run then counts as not played). `entrant_nonce`: the nonce to send (default: 32 random hex
    digits); `commitment_file`: where to write the commitment before sending it; `nonce_file`: wait
    for the nonce to appear there instead. An `AgentRunError` when the agent cannot be loaded."""
    selected_tasks(suite)  # a bad selection fails here, before anything starts
    workspace = Path(tempfile.mkdtemp(prefix="cernenv-score-"))  # 0700: this user's only
    ledger, log_path, port = workspace / "run.jsonl", workspace / "server.log", free_port()
    receipts_path = workspace / "run.receipts.json"
    summary_path = workspace / "player.json"
    player_base = [sys.executable, "-m", "lib.agents.remote_player", "--agent", agent, "--summary", str(summary_path)]
    # the agent loaded once in a process of its own first: one that cannot be fails before any server starts
    check = subprocess.run([*player_base, "--load-only"], env=agent_environment(agent_paths))
    if check.returncode != 0:
        report = _player_report(check, summary_path)
        shutil.rmtree(workspace, ignore_errors=True)
        raise AgentRunError(f"the agent could not be loaded: {report.get('load_error') or check.returncode}")
    url = f"http://127.0.0.1:{port}"
    # the server of this run alone: none of the operator's CERNENV_* settings (a token, a ledger, a run)
    server_env = {k: v for k, v in os.environ.items() if not k.startswith("CERNENV_")}
    server_env["CERNENV_STATE_DIR"] = str(workspace)
    command = [sys.executable, "-m", "cernenv.server", "--port", str(port), "--ephemeral-secret"]
    command += ["--scored-run", suite, "--results-ledger", str(ledger)]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, cwd=ROOT, env=server_env, stdout=log, stderr=subprocess.STDOUT)
    player = None
    try:
        deadline = time.monotonic() + SERVER_START_S
        while _get(url + "/health") is None:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the evaluation server did not start; its log:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        run = (_get(url + "/evaluation") or {}).get("scored_run") or {}
        print(
            f"scored run {run.get('run_id')}: {run.get('n_tasks')} tasks ({suite}); agent {agent}; "
            f"commitment {run.get('commitment')}",
            flush=True,
        )
        if commitment_file is not None:
            published = {k: run.get(k) for k in ("run_id", "selection", "n_tasks", "commitment", "public_key")}
            atomic_write(commitment_file, json.dumps(published, indent=1) + "\n")
        nonce = entrant_nonce or (_wait_for_nonce(nonce_file) if nonce_file is not None else secrets.token_hex(16))
        receipts = Receipts(run, nonce)
        receipts.keep(send_nonce(url, nonce))
        player_command = [*player_base, "--url", url]
        if max_episodes is not None:
            player_command += ["--max-episodes", str(max_episodes)]
        player = subprocess.Popen(player_command, env=agent_environment(agent_paths))
        last = time.monotonic()
        while player.poll() is None:
            time.sleep(0.2)
            state = (_get(url + "/evaluation") or {}).get("scored_run") or {}
            receipts.keep(state)
            if time.monotonic() - last >= progress_every_s:
                last = time.monotonic()
                print(f"  {state.get('ended')} of {state.get('n_tasks')} tasks ended", flush=True)
        receipts.keep((_get(url + "/evaluation") or {}).get("scored_run"))
        receipts.write(receipts_path)
    finally:
        if player is not None and player.poll() is None:
            player.kill()
        server.send_signal(signal.SIGTERM)  # records what is still open, then the run's end and its reveal
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    report = _player_report(player, summary_path)
    if report.get("load_error"):
        shutil.rmtree(workspace, ignore_errors=True)
        raise AgentRunError(f"the agent could not be loaded: {report['load_error']}")
    reveal = reveal_path(ledger)
    card = score_run(ledger, reveal if verify else None, receipts=receipts_path)
    card["agent_run"] = _ledger_report(agent, card, report, player, max_episodes)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ledger, out_dir / f"{card['run_id']}.jsonl")
        shutil.copyfile(reveal, out_dir / f"{card['run_id']}.reveal.json")
        shutil.copyfile(receipts_path, out_dir / f"{card['run_id']}.receipts.json")
        atomic_write(out_dir / f"scorecard-{card['run_id']}.json", scorecard_json(card))
        atomic_write(out_dir / f"scorecard-{card['run_id']}.md", scorecard_markdown(card, agent))
    shutil.rmtree(workspace, ignore_errors=True)
    return card


def _player_report(player: Any, summary_path: Path) -> Dict[str, Any]:
    """What the player process reported (its --summary), or what its exit says when it wrote none."""
    try:
        said = json.loads(summary_path.read_text(encoding="utf-8"))
        return said if isinstance(said, dict) else {"summary": str(said)[:200]}
    except (OSError, ValueError):
        status = None if player is None else player.returncode
        if status == LOAD_FAILED:
            return {"load_error": "the player could not load it (its line above says why)"}
        return {"summary": f"none written: the agent's process ended with status {status}"}


def _wait_for_nonce(path: Path, timeout_s: float = 3600.0) -> str:
    """The entrant's nonce once a line of it appears in `path` (`make scored-run-example` writes the
    commit that holds the commitment there)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = path.read_text(encoding="utf-8").strip()
        except OSError:
            text = ""
        if text:
            return text
        time.sleep(0.5)
    raise RuntimeError(f"no entrant's nonce appeared in {path} within {timeout_s:.0f} s")


def _ledger_report(
    agent: str, card: Mapping[str, Any], said: Mapping[str, Any], player: Any, max_episodes: Optional[int]
) -> Dict[str, Any]:
    """What the run's ledger says the agent did (`played`, `failed`, `unplayed`), beside what its
    process said (`player_said`, `first_error`: read, not believed) and its `exit_status`; `error`:
    why the run fails (one line), or None."""
    played, failed, unplayed = card["graded"], card["abandoned"], card["unplayed"]
    status = None if player is None else player.returncode
    first = said.get("first_error") if isinstance(said.get("first_error"), str) else None
    error = None
    if played == 0:
        why = first or f"{unplayed} of {card['n_tasks']} tasks never played, {failed} abandoned"
        error = f"the agent {agent} played no episode to its end ({why})"
    elif failed:
        how = (
            f"raised in {failed} of {played + failed} episodes (first: {first}; its traceback is above)"
            if first
            else (f"left {failed} of {played + failed} episodes unfinished (its process ended with status {status})")
        )
        error = f"the agent {agent} {how}: those count as failures"
    elif unplayed and max_episodes is None:
        error = (
            f"the agent {agent}'s process ended (status {status}) after {played} of {card['n_tasks']} tasks: "
            f"the {unplayed} it never played count as failures"
        )
    return {
        "played": played,
        "failed": failed,
        "unplayed": unplayed,
        "exit_status": status,
        "first_error": first,
        "player_said": dict(said),
        "error": error,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lib.measure.score_agent",
        description="Score an agent out of process, as a client of an evaluation server's scored run.",
        allow_abbrev=False,
    )
    parser.add_argument("--agent", required=True, help="the agent class, module:Class")
    parser.add_argument(
        "--agent-path",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="a folder the agent's module is imported from, for an agent kept outside the repository (repeatable; "
        "make evaluate: AGENT_PATH=DIR)",
    )
    parser.add_argument("--suite", default=SUITE_VERSION, help=f"what the run plays: {SELECTION_HELP}")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "build" / "scorecards", help="where the ledger, reveal and scorecard go"
    )
    parser.add_argument("--max-episodes", type=int, help="stop the agent after this many episodes")
    parser.add_argument(
        "--entrant-nonce", metavar="TEXT", help="the entrant's nonce to send (default: a fresh random one)"
    )
    parser.add_argument(
        "--commitment-file", type=Path, metavar="PATH", help="write the run's commitment here before sending the nonce"
    )
    parser.add_argument(
        "--nonce-file", type=Path, metavar="PATH", help="wait for the entrant's nonce to appear in this file"
    )
    args = parser.parse_args(argv)
    try:
        selected_tasks(args.suite)
    except ValueError as error:
        parser.error(f"--suite: {error}")
    if not AGENT_SPEC.fullmatch(args.agent):  # its code is imported in its own process only
        parser.error(f"--agent {args.agent!r}: give module:Class, e.g. lib.agents.baselines:HeuristicAgent")
    args.agent_path = [folder.expanduser() for folder in args.agent_path]  # AGENT_PATH=~/agents, quoted by make
    for folder in args.agent_path:
        if not folder.is_dir():
            parser.error(f"--agent-path {folder}: not a folder; give the folder that holds the agent's module")
    try:
        card = score_agent(
            args.agent, args.suite, out_dir=args.out, agent_paths=[p.resolve() for p in args.agent_path],
            max_episodes=args.max_episodes, entrant_nonce=args.entrant_nonce, commitment_file=args.commitment_file,
            nonce_file=args.nonce_file,
        )  # fmt: skip
    except (AgentRunError, AuditError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(scorecard_markdown(card, args.agent), end="")
    print(verified_line(card))
    print(
        f"scorecard: {args.out}/scorecard-{card['run_id']}.json and .md; the run's ledger and reveal: "
        f"{args.out}/{card['run_id']}.jsonl, .reveal.json and .receipts.json"
    )
    if card["agent_run"]["error"]:
        print(f"error: {card['agent_run']['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
