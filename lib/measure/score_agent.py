"""Score an agent you did not write: it plays a scored run as a client of an evaluation server, in
a process of its own that cannot reach the scorer, and the run's ledger is scored and verified.

    python -m lib.measure.score_agent --agent package.module:Class [--agent-path DIR] [--suite v3] [--out DIR]
    make evaluate AGENT=package.module:Class [AGENT_PATH=DIR] [SUITE=v3]

Three processes: the server (`python -m cernenv.server --scored-run SUITE`, on a free loopback
port, the run's ledger in a private temporary folder), the agent (`python -m
lib.agents.remote_player`, started without the CERNENV_* variables, importing from the
repository, the current folder and each `--agent-path`), and this one, the entrant: it reads the
run's commitment and prints it, sends the entrant's nonce (`POST /evaluation/nonce`: a fresh random
one, or `--entrant-nonce`) signed with a key of its own together with the agent's name and the
SHA-256 of its module's file, starts the agent, keeps a receipt of each signed head of the ledger
it sees (`GET /evaluation` every 0.2 s), then ends the run (`POST /evaluation/end`, signed: a no-op
when every task was played) and keeps the end line's receipt, signs its receipts, stops the server,
and scores the ledger against the commitment it printed before play, its receipts and the run's
reveal, replaying every episode (`lib.measure.scorecard`). What the run came to (`agent_run`) is read
from the run's ledger, never from the agent's process, whose own report is kept as `player_said`.

The agent cannot reach the scorer (`Sandbox`, when this runs as root, as CI does): its process runs
as a user id of its own, drawn for the run (no account, no file anywhere is its), with no
supplementary groups, capabilities or new privileges (util-linux's `setpriv`), in PID, mount, IPC
and UTS namespaces of its own (util-linux's `unshare`: it sees no other process, and every process
it leaves behind is killed when it ends); so it can neither write the scorer's files (the work
folder is root's, mode 0700) nor read the server's or the scorer's memory (another user's, and
outside its PID namespace). The whole evaluation runs in a network namespace of its own (`unshare
--net`), whose only interface is its loopback: the agent's network is the evaluation server. What
it prints comes through the scorer, each line marked `agent |` (it never holds the terminal). Why
another user rather than a user namespace (bubblewrap): a namespace's root maps to the caller, root,
whose files it could then write; util-linux is in every Debian system, so nothing is installed.
Without root, it refuses (exit 2) unless `--unisolated`, which plays the agent as your own user
and says so in the scorecard (`agent_run.isolation`) and the output: for your own agent.

It fails (`AgentRunError`: one line, a non-zero exit) when the agent cannot be loaded (checked in
a process of its own before any server starts), plays no episode to its end, left some
unfinished (it raised, or walked away: those count as failures; the run went on and is scored),
or its process ended before the run did. The run's ledger, reveal, receipts and scorecard are
kept in `--out`. `--commitment-file PATH` writes the run's commitment there before any nonce is
sent and, with `--nonce-file PATH`, waits for the nonce to appear in that file: how
`make scored-run-example` commits the commitment to git before the run is played.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence

from cernenv.server.audit import AuditError
from cernenv.server.runs import reveal_path
from cernenv.suite import SELECTION_HELP, SUITE_VERSION, is_development, selected_tasks
from lib.agents.remote_player import (
    LOAD_FAILED,
    REFUSED,
    Entrant,
    Receipts,
    RunRefused,
    agent_code_sha256,
    check_own_nonce,
    get_json,
)
from lib.files import atomic_write
from lib.measure.comparison import before_after_metrics, group_table, same_tasks
from lib.measure.evaluation import GROUPS, PARTS
from lib.measure.metrics import CONFIDENCE, has_particle
from lib.measure.scorecard import score_run, scorecard_json, scorecard_markdown, verified_line
from lib.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
AGENT_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
COMPARISON_SUITE = "dev:60"
"""What `--baseline` plays both agents on unless `--suite` says otherwise: the first 60 development tasks."""
SERVER_START_S = 180.0
"""How long the server may take to answer /health (it compiles the physics kernels first)."""


_get = get_json


class AgentRunError(RuntimeError):
    """The agent could not be scored as asked: it cannot be loaded, played no episode to its end,
    or raised in some. One line, saying which and what to do."""


SANDBOX_UIDS = range(61184, 65520)
"""The user ids a sandboxed agent is given one of, at random: Debian leaves them to no account
(systemd's dynamic users, which it avoids by checking that no account and no process has the id)."""
NETWORK_NAMESPACE_FLAG = "--in-network-namespace"
"""Given by `main` to itself, restarted under `unshare --net`: the evaluation's own network."""


class Sandbox:
    """Where the agent's process runs: user id `uid` (group id the same), with `home` its only
    folder, in PID, mount, IPC and UTS namespaces of its own (see the module docstring)."""

    def __init__(self, uid: int, home: Path) -> None:
        self.uid, self.home = uid, home

    @classmethod
    def make(cls) -> "Sandbox":
        """A sandbox with a fresh user id and home; an AgentRunError when this process is not root."""
        if os.geteuid() != 0:
            raise AgentRunError(
                "the agent is run as a user of its own, which needs root (sudo make evaluate ...; CI runs as root): "
                "or --unisolated (make evaluate UNISOLATED=1) to play it as your own user, for an agent you trust"
            )
        taken = {int(entry.pw_uid) for entry in pwd.getpwall()}
        for entry in Path("/proc").iterdir():
            try:
                taken.add(entry.stat().st_uid)
            except OSError:
                pass
        free = [uid for uid in SANDBOX_UIDS if uid not in taken]
        uid = secrets.choice(free)
        home = Path(tempfile.mkdtemp(prefix="cernenv-agent-"))
        os.chown(home, uid, uid)
        return cls(uid, home)

    def command(self, argv: Sequence[str]) -> List[str]:
        return [
            "unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts", "--",
            "setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups", "--no-new-privs",
            "--inh-caps=-all", "--bounding-set=-all", "--", *argv,
        ]  # fmt: skip

    def environment(self, environment: Dict[str, str]) -> Dict[str, str]:
        return {**environment, "HOME": str(self.home), "TMPDIR": str(self.home), "USER": f"agent{self.uid}"}

    def unreadable(self, paths: Sequence[Path]) -> Optional[str]:
        """The first of `paths` (the repository, the interpreter, the agent's folders) the sandbox's
        user cannot read, with why; None when it can read them all."""
        for path in paths:
            path = Path(path).resolve()
            for folder in [*reversed(path.parents), path]:
                mode = folder.stat().st_mode
                need = stat.S_IXOTH | (stat.S_IROTH if folder == path else 0)
                if stat.S_ISDIR(mode) and mode & need != need:
                    return f"{folder} (mode {stat.S_IMODE(mode):o}) is closed to other users, so to the agent's"
        return None

    def remove(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


def loopback_up() -> None:
    """Bring up the loopback interface of this process's new network namespace (SIOCSIFFLAGS)."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as handle:
        flags = struct.unpack("16sH14x", fcntl.ioctl(handle, siocgifflags, struct.pack("16sH14x", b"lo", 0)))[1]
        fcntl.ioctl(handle, siocsifflags, struct.pack("16sH14x", b"lo", flags | iff_up))


def _relay(stream: Any, prefix: str) -> threading.Thread:
    """Print each line `stream` (the agent's output) gives on this process's stderr, after `prefix`."""

    def copy() -> None:
        for raw in iter(stream.readline, b""):
            sys.stderr.write(prefix + raw.decode("utf-8", "replace").rstrip("\n")[:2000] + "\n")
            sys.stderr.flush()
        stream.close()

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


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
    isolated: bool = True,
) -> Dict[str, Any]:
    """Play `suite` with the agent class `agent` ("module:Class", importable from the repository,
    the current folder or `agent_paths`) out of process and return its scorecard
    (`lib.measure.scorecard.scorecard`), checked against the commitment printed before play and the
    receipts kept while it played and verified against the run's reveal (unless `verify` is False),
    with `agent_run`: what the run's ledger says the agent did (`played` to the end, `failed`:
    abandoned, `unplayed`), the player process's `exit_status`, `first_error` and `player_said` (its
    own report, not believed), `isolation` (how the agent was confined), and `error` (why the run
    fails, or None). The run's ledger (RUN_ID.jsonl), reveal (RUN_ID.reveal.json), receipts
    (RUN_ID.receipts.json) and scorecard (scorecard-RUN_ID.json and .md) go to `out_dir` when given.
    `max_episodes`: the agent stops after so many (the rest of the run then counts as not played).
    `entrant_nonce`: the nonce to send (default: 32 random hex digits); `commitment_file`: where to
    write the commitment before sending it; `nonce_file`: wait for the nonce to appear there instead.
    `isolated`: run the agent in a `Sandbox` (root only; False: as this user). An `AgentRunError`
    when the agent cannot be loaded or sandboxed."""
    selected_tasks(suite)  # a bad selection fails here, before anything starts
    sandbox = Sandbox.make() if isolated else None
    workspace = Path(tempfile.mkdtemp(prefix="cernenv-score-"))  # 0700: this user's only
    try:
        return _score_agent(
            agent, suite, workspace, sandbox, out_dir=out_dir, agent_paths=agent_paths,
            progress_every_s=progress_every_s, max_episodes=max_episodes, verify=verify,
            entrant_nonce=entrant_nonce, commitment_file=commitment_file, nonce_file=nonce_file,
        )  # fmt: skip
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
        if sandbox is not None:
            sandbox.remove()


def _score_agent(
    agent: str,
    suite: str,
    workspace: Path,
    sandbox: Optional[Sandbox],
    *,
    out_dir: Optional[Path],
    agent_paths: Sequence[Path],
    progress_every_s: float,
    max_episodes: Optional[int],
    verify: bool,
    entrant_nonce: Optional[str],
    commitment_file: Optional[Path],
    nonce_file: Optional[Path],
) -> Dict[str, Any]:
    ledger, log_path, port = workspace / "run.jsonl", workspace / "server.log", free_port()
    receipts_path = workspace / "run.receipts.json"
    summary_path = (sandbox.home if sandbox is not None else workspace) / "player.json"
    environment = agent_environment(agent_paths)
    if sandbox is not None:
        environment = sandbox.environment(environment)
        closed = sandbox.unreadable([ROOT, Path(sys.executable).parent, *agent_paths])
        if closed:
            raise AgentRunError(f"{closed} (uid {sandbox.uid}): open it to others (chmod o+rX), or --unisolated")
    wrap = sandbox.command if sandbox is not None else list
    player_base = [sys.executable, "-m", "lib.agents.remote_player", "--agent", agent, "--summary", str(summary_path)]
    # the agent loaded once in a process of its own first: one that cannot be fails before any server starts
    check = subprocess.run(wrap([*player_base, "--load-only"]), env=environment, cwd=os.getcwd())
    if check.returncode != 0:
        report = _player_report(check, summary_path)
        raise AgentRunError(f"the agent could not be loaded: {report.get('load_error') or check.returncode}")
    search = [str(ROOT), os.getcwd(), *map(str, agent_paths)]
    try:
        code_sha256 = agent_code_sha256(agent, search)
    except RunRefused as error:
        raise AgentRunError(str(error)) from None
    url = f"http://127.0.0.1:{port}"
    # the server of this run alone: none of the operator's CERNENV_* settings (a token, a ledger, a run)
    server_env = {k: v for k, v in os.environ.items() if not k.startswith("CERNENV_")}
    server_env["CERNENV_STATE_DIR"] = str(workspace)
    command = [sys.executable, "-m", "cernenv.server", "--port", str(port), "--ephemeral-secret"]
    command += ["--scored-run", suite, "--results-ledger", str(ledger)]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, cwd=ROOT, env=server_env, stdout=log, stderr=subprocess.STDOUT)
    player, relay, run = None, None, {}
    try:
        deadline = time.monotonic() + SERVER_START_S
        while _get(url + "/health") is None:
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the evaluation server did not start; its log:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        run = (_get(url + "/evaluation") or {}).get("scored_run") or {}
        printed = run.get("commitment")
        print(
            f"scored run {run.get('run_id')}: {run.get('n_tasks')} tasks ({suite}); agent {agent} (its module's "
            f"SHA-256 {code_sha256[:16]}); commitment {printed}",
            flush=True,
        )
        if commitment_file is not None:
            published = {k: run.get(k) for k in ("run_id", "selection", "n_tasks", "commitment", "public_key")}
            atomic_write(commitment_file, json.dumps(published, indent=1) + "\n")
        nonce = entrant_nonce or (_wait_for_nonce(nonce_file) if nonce_file is not None else None)
        entrant = Entrant(agent, code_sha256, nonce)
        seeded = entrant.send_nonce(url, run)
        check_own_nonce(seeded, entrant.nonce)
        receipts = Receipts(run, entrant)
        receipts.keep(seeded)
        player_command = [*player_base, "--url", url, "--entrant-nonce", entrant.nonce]
        if max_episodes is not None:
            player_command += ["--max-episodes", str(max_episodes)]
        player = subprocess.Popen(
            wrap(player_command), env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        relay = _relay(player.stdout, "agent | ")
        last = time.monotonic()
        while player.poll() is None:
            time.sleep(0.2)
            state = (_get(url + "/evaluation") or {}).get("scored_run") or {}
            receipts.keep(state)
            if time.monotonic() - last >= progress_every_s:
                last = time.monotonic()
                print(f"  {state.get('ended')} of {state.get('n_tasks')} tasks ended", flush=True)
        relay.join(timeout=10)
        settle = time.monotonic() + 10  # the server records what the agent's closed session left open
        while (state := (_get(url + "/evaluation") or {}).get("scored_run") or {}).get("ended") != state.get(
            "assigned"
        ) and time.monotonic() < settle:
            time.sleep(0.1)
        receipts.keep(state)
        receipts.keep(entrant.end(url, str(run.get("run_id"))))  # the end line, served to the entrant
        receipts.write(receipts_path)
    except RunRefused as error:
        raise AgentRunError(str(error)) from None
    finally:
        if player is not None and player.poll() is None:
            player.kill()
            player.wait()
        server.send_signal(signal.SIGTERM)  # records what is still open, then the run's end and its reveal
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    report = _player_report(player, summary_path)
    if report.get("load_error"):
        raise AgentRunError(f"the agent could not be loaded: {report['load_error']}")
    reveal = reveal_path(ledger)
    with progress_lines():
        card = score_run(
            ledger, reveal if verify else None, receipts=receipts_path, commitment=printed, agent=agent
        )  # against the commitment printed before play, never one read from a file
    card["agent_run"] = _ledger_report(agent, card, report, player, max_episodes)
    card["agent_run"]["isolation"] = (
        f"user {sandbox.uid}, own PID, mount, IPC and UTS namespaces (unshare, setpriv); "
        + ("network: the evaluation's own loopback" if _in_network_namespace() else "network: this machine's")
        if sandbox is not None
        else "none: the agent ran as this user (--unisolated)"
    )
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ledger, out_dir / f"{card['run_id']}.jsonl")
        shutil.copyfile(reveal, out_dir / f"{card['run_id']}.reveal.json")
        shutil.copyfile(receipts_path, out_dir / f"{card['run_id']}.receipts.json")
        atomic_write(out_dir / f"scorecard-{card['run_id']}.json", scorecard_json(card))
        atomic_write(out_dir / f"scorecard-{card['run_id']}.md", scorecard_markdown(card, agent))
    return card


def _in_network_namespace() -> bool:
    return os.environ.get("CERNENV_SCORER_NETWORK") == "own"


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
    """What the run's ledger says the agent did (`played`, `failed`, `unplayed`, `actions` sent and
    how many were `refused`), beside what its process said (`player_said`, `first_error`: the last
    line of the first traceback, `first_refusal`: the first refused action and why; read, not
    believed) and its `exit_status`; `error`: why the run fails (one line), or None. A run fails when
    the environment refused every action, the agent crashed in some episode, played none to its end,
    left some unfinished, or its process ended before the run did."""
    played, failed, unplayed = card["graded"], card["abandoned"], card["unplayed"]
    status = None if player is None else player.returncode
    first = _said_text(said, "first_error")
    refused = card["counts"]["all"]["refused_actions"]
    actions = sum(int(episode.get("n_steps") or 0) for episode in card.get("_episodes", ()))
    first_refusal = _said_text(said, "first_refusal")
    error = None
    if actions and refused == actions:
        why = first_refusal or "the run's ledger holds each action as it was sent"
        error = f"the environment refused every one of the agent {agent}'s {actions} actions (first: {why})"
    elif failed and first:
        error = (
            f"the agent {agent} crashed in {failed} of {played + failed} episodes (it raised; first: {first}; its "
            "traceback is above): those count as failures, and are left out of the false-discovery rate"
        )
    elif played == 0:
        why = f"{unplayed} of {card['n_tasks']} tasks never played, {failed} abandoned"
        error = f"the agent {agent} played no episode to its end ({why})"
    elif failed:
        error = (
            f"the agent {agent} left {failed} of {played + failed} episodes unfinished (its process ended with "
            f"status {status}): those count as failures"
        )
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
        "actions": actions,
        "refused": refused,
        "first_refusal": first_refusal,
        "player_said": dict(said),
        "error": error,
    }


def _said_text(said: Mapping[str, Any], key: str) -> Optional[str]:
    """The player's `key` when it is text (cut to 600 characters), else None: its word, not believed."""
    value = said.get(key)
    return value[:600] if isinstance(value, str) else None


class _StderrHandler(logging.StreamHandler):
    """A log handler writing to whatever `sys.stderr` is when a line is written (a caller, a test's
    capture, may replace it between lines)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


@contextlib.contextmanager
def progress_lines() -> Iterator[None]:
    """Long work's progress (`lib.progress`: the run's replay, 20 s for v3's 313 episodes) on stderr, as
    plain lines, while the block runs."""
    log, handler = logging.getLogger("lib.progress"), _StderrHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    level, propagate = log.level, log.propagate
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


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
    parser.add_argument(
        "--suite",
        help=f"what the run plays: {SELECTION_HELP} (default: {SUITE_VERSION}; with --baseline, {COMPARISON_SUITE})",
    )
    parser.add_argument(
        "--baseline",
        metavar="MODULE:CLASS",
        help="also play this agent on the same development worlds (--suite dev:N) and print both and the paired "
        "difference, agent − baseline, with its 95%% bootstrap interval (make evaluate BASELINE=...)",
    )
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
    parser.add_argument(
        "--unisolated",
        action="store_true",
        help="play the agent as your own user, with this machine's network (make evaluate UNISOLATED=1): for an "
        "agent you trust; without root, the only way",
    )
    parser.add_argument(NETWORK_NAMESPACE_FLAG, action="store_true", help=argparse.SUPPRESS)
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(arguments)
    args.suite = args.suite or (COMPARISON_SUITE if args.baseline else SUITE_VERSION)
    try:
        selected_tasks(args.suite)
    except ValueError as error:
        parser.error(f"--suite: {error}")
    for option, spec in (("--agent", args.agent), ("--baseline", args.baseline)):
        if spec is not None and not AGENT_SPEC.fullmatch(spec):  # its code is imported in its own process only
            parser.error(f"{option} {spec!r}: give module:Class, e.g. lib.agents.baselines:HeuristicAgent")
    if args.baseline and not is_development(args.suite):
        parser.error(
            f"--baseline with --suite {args.suite}: two agents are compared on the same worlds, which only "
            f"development tasks give (--suite dev:N, e.g. {COMPARISON_SUITE}; make evaluate ... "
            f"SUITE={COMPARISON_SUITE}): a scored run's worlds are secret and fresh each run"
        )
    args.agent_path = [folder.expanduser() for folder in args.agent_path]  # AGENT_PATH=~/agents, quoted by make
    for folder in args.agent_path:
        if not folder.is_dir():
            parser.error(f"--agent-path {folder}: not a folder; give the folder that holds the agent's module")
    if args.unisolated:
        print(
            "WARNING: --unisolated: the agent runs as your own user, with your network: it can write this scorer's "
            "files and read its memory; the scorecard says so (agent_run.isolation)",
            file=sys.stderr,
            flush=True,
        )
    elif args.in_network_namespace:
        loopback_up()
        os.environ["CERNENV_SCORER_NETWORK"] = "own"
    elif os.geteuid() == 0:  # the whole evaluation again, in a network namespace whose only interface is loopback
        sys.stdout.flush()
        inner = [sys.executable, "-m", "lib.measure.score_agent", *arguments, NETWORK_NAMESPACE_FLAG]
        try:
            probe = subprocess.run(["unshare", "--net", "--", "true"], capture_output=True, text=True)
        except OSError as error:
            probe = subprocess.CompletedProcess([], 1, "", str(error))
        if probe.returncode != 0:
            why = (probe.stderr.strip().splitlines() or ["no reason given"])[-1]
            print(f"error: cannot give the evaluation a network of its own (unshare --net: {why})", file=sys.stderr)
            return REFUSED
        return subprocess.run(["unshare", "--net", "--", *inner]).returncode
    if args.baseline:
        return compare(args)
    try:
        card = score_agent(
            args.agent, args.suite, out_dir=args.out, agent_paths=[p.resolve() for p in args.agent_path],
            max_episodes=args.max_episodes, entrant_nonce=args.entrant_nonce, commitment_file=args.commitment_file,
            nonce_file=args.nonce_file, isolated=not args.unisolated,
        )  # fmt: skip
    except (AgentRunError, AuditError) as error:
        print(f"error: {error}", file=sys.stderr)
        return REFUSED
    print(scorecard_markdown(card, args.agent), end="")
    print(verified_line(card))
    print(
        f"scorecard: {args.out}/scorecard-{card['run_id']}.json and .md; the run's ledger and reveal: "
        f"{args.out}/{card['run_id']}.jsonl, .reveal.json and .receipts.json"
    )
    note = refusal_note(card)
    if note and not card["agent_run"]["error"]:
        print(note)
    if card["agent_run"]["error"]:
        print(f"error: {card['agent_run']['error']}", file=sys.stderr)
        return 1
    return 0


def refusal_note(card: Mapping[str, Any]) -> Optional[str]:
    """A line saying how many of the agent's actions were refused and the first refusal's reason
    (as its process said it), or None when none was."""
    run = card["agent_run"]
    if not run.get("refused"):
        return None
    return (
        f"note: the environment refused {run['refused']} of the agent's {run['actions']} actions; the first: "
        f"{run.get('first_refusal') or 'its process did not say (the ledger holds each action as sent)'}"
    )


def compare(args: argparse.Namespace) -> int:
    """`main` with --baseline: the baseline's development run, then the agent's, on the same worlds,
    each scored and verified as on its own; then both and the paired difference (`comparison_markdown`).
    Exit 2 when either cannot be scored, 1 when either run fails (`agent_run.error`), else 0."""
    cards: Dict[str, Dict[str, Any]] = {}
    for role, spec in (("baseline", args.baseline), ("agent", args.agent)):
        print(f"{role} {spec} on {args.suite}:", flush=True)
        try:
            cards[role] = score_agent(
                spec, args.suite, out_dir=args.out, agent_paths=[p.resolve() for p in args.agent_path],
                max_episodes=args.max_episodes, isolated=not args.unisolated,
            )  # fmt: skip
        except (AgentRunError, AuditError) as error:
            print(f"error: the {role}: {error}", file=sys.stderr)
            return REFUSED
        card = cards[role]
        print(f"  {verified_line(card)}")
        print(f"  scorecard: {args.out}/scorecard-{card['run_id']}.json and .md")
        note = refusal_note(card)
        if note and not card["agent_run"]["error"]:
            print(f"  {note}")
    print()
    print(comparison_markdown(cards["baseline"], cards["agent"], args.baseline, args.agent), end="")
    errors = [f"the {role}: {card['agent_run']['error']}" for role, card in cards.items() if card["agent_run"]["error"]]
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    return 1 if errors else 0


def paired_episodes(card: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """The run's episode records (`lib.measure.scorecard.scorecard`'s `_episodes`), each under the task
    the run committed to, so that two runs of the same tasks pair task by task
    (`lib.episodes.records.pair_key`) whether a task was played or not."""
    return [{**episode, **episode["task"]} for episode in card["_episodes"]]


def comparison_markdown(
    baseline_card: Mapping[str, Any], agent_card: Mapping[str, Any], baseline: str, agent: str
) -> str:
    """Two development runs of the same tasks side by side: each agent's success (tasks correct, the
    rate and its 95% bootstrap interval) and mean reward (with its interval), and agent − baseline
    with its 95% bootstrap interval paired by task (`lib.measure.comparison.before_after_metrics`,
    the baseline before, the agent after); then per group, and the false discoveries on null tasks.
    A ValueError when the runs did not play the same tasks."""
    pre, post = paired_episodes(baseline_card), paired_episodes(agent_card)
    if not same_tasks(pre, post):
        raise ValueError("the two runs did not play the same tasks: compare development runs of one dev:N")
    payload = before_after_metrics(pre, post)
    if payload["n"]["pairs"] != len(pre):
        raise ValueError(f"{payload['n']['pairs']} of {len(pre)} tasks paired: the comparison is not paired")

    def side(stats: Mapping[str, Any], intervals: Mapping[str, Any], key: str) -> str:
        low, high = intervals[key]
        value = f"{stats[key]:.3f} [{low:.3f}, {high:.3f}]"
        return f"{stats['n_correct']} of {stats['n']}: {value}" if key == "success_rate" else value

    lines = [
        f"# {agent} against {baseline} on {baseline_card['selection']}",
        "",
        f"The same {len(pre)} tasks and worlds for both (development worlds: public, the same in every run), paired "
        f"by task; each cell mean [{CONFIDENCE:.0%} bootstrap interval], the difference's resampled per task.",
        "",
        f"| | baseline {baseline} | agent {agent} | agent − baseline |",
        "|---|---|---|---|",
    ]
    for key, label in (("success_rate", "success"), ("mean_reward", "mean reward")):
        low, high = payload["delta_ci95"][key]
        difference = f"{payload['delta'][key]:+.3f} [{low:+.3f}, {high:+.3f}]"
        lines.append(
            f"| {label} | {side(payload['pre'], payload['pre_ci95'], key)} | "
            f"{side(payload['post'], payload['post_ci95'], key)} | {difference} |"
        )
    parts = [part for part in PARTS if payload["groups"][part]["n"]["pre"]]
    shown = {  # the groups that hold a task, a part's only when the run holds another part too
        name: group
        for name, group in payload["groups"].items()
        if group["n"]["pre"] and (len(parts) > 1 or GROUPS[name][0] is None)
    }
    nulls = [episode for episode in pre if has_particle(episode) is False]
    false = {
        role: sum(bool(e.get("discovered")) for e in episodes if has_particle(e) is False and not e.get("unfinished"))
        for role, episodes in (("baseline", pre), ("agent", post))
    }
    lines += [
        "",
        "By part and by task, with a particle or null (baseline → agent):",
        "",
        group_table({**payload, "groups": shown}),
        "",
        f"False discoveries on the {len(nulls)} null tasks: baseline {false['baseline']}, agent {false['agent']}. "
        f"Crashed or abandoned: baseline {baseline_card['abandoned']}, agent {agent_card['abandoned']}; refused "
        f"actions: baseline {baseline_card['agent_run']['refused']}, agent {agent_card['agent_run']['refused']}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
