"""Score an agent you did not write: it plays a scored run as a client of an evaluation server, in
a process of its own, and the run's ledger is scored.

    python -m lib.measure.score_agent --agent package.module:Class [--suite v3] [--out DIR]
    make evaluate AGENT=package.module:Class [SUITE=v3]

Three processes: the server (`python -m cernenv.server --scored-run SUITE --ephemeral-secret`,
on a free loopback port, its ledger in a private temporary folder), the agent
(`python -m lib.agents.remote_player`, started without the CERNENV_* variables), and this one,
which waits, then scores the ledger (`lib.measure.scorecard`). The agent's process holds what the
server sends an agent and nothing else: the secret exists only in the server's memory (never in a
file or a variable), every world is fresh, and the run's tasks come in an order the server keeps
to itself. Introspecting its own process (frames, the garbage collector, files) finds nothing.

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
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from cernenv.server.runs import reveal_path
from cernenv.suite import SELECTION_HELP, SUITE_VERSION, selected_tasks
from lib.files import atomic_write
from lib.measure.scorecard import score_run, scorecard_json, scorecard_markdown
from lib.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
AGENT_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
SERVER_START_S = 180.0
"""How long the server may take to answer /health (it compiles the physics kernels first)."""


def _get(url: str) -> Optional[Dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return json.loads(answer.read())
    except (OSError, ValueError):
        return None


def agent_environment(extra_paths: Sequence[str] = ()) -> Dict[str, str]:
    """The agent process's variables: this process's, without CERNENV_* (the server's settings),
    with the repository and the current folder importable."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("CERNENV_")}
    paths = [str(ROOT), os.getcwd(), *extra_paths, *filter(None, [environment.get("PYTHONPATH")])]
    environment["PYTHONPATH"] = os.pathsep.join(paths)
    return environment


def score_agent(
    agent: str,
    suite: str = SUITE_VERSION,
    *,
    out_dir: Optional[Path] = None,
    progress_every_s: float = 15.0,
    max_episodes: Optional[int] = None,
) -> Dict[str, Any]:
    """Play `suite` with the agent class `agent` ("module:Class") out of process and return its
    scorecard (`lib.measure.scorecard.scorecard`), also written to `out_dir` as
    scorecard-<run id>.json and .md when given. `max_episodes`: the agent stops after so many
    (the rest of the run then counts as not played)."""
    selected_tasks(suite)  # a bad selection fails here, before anything starts
    workspace = Path(tempfile.mkdtemp(prefix="cernenv-score-"))  # 0700: this user's only
    ledger, log_path, port = workspace / "results.jsonl", workspace / "server.log", free_port()
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
        print(f"scored run {run.get('run_id')}: {run.get('n_tasks')} tasks ({suite}); agent {agent}", flush=True)
        player_command = [sys.executable, "-m", "lib.agents.remote_player", "--url", url, "--agent", agent]
        if max_episodes is not None:
            player_command += ["--max-episodes", str(max_episodes)]
        player = subprocess.Popen(player_command, env=agent_environment())
        last = time.monotonic()
        while player.poll() is None:
            time.sleep(0.5)
            if time.monotonic() - last >= progress_every_s:
                last = time.monotonic()
                state = (_get(url + "/evaluation") or {}).get("scored_run") or {}
                print(f"  {state.get('ended')} of {state.get('n_tasks')} tasks ended", flush=True)
        if player.returncode != 0:
            print(f"the agent's process exited with {player.returncode}: its unplayed tasks count as failures")
    finally:
        if player is not None and player.poll() is None:
            player.kill()
        server.send_signal(signal.SIGTERM)  # records what is still open, then the run's end
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    card = score_run(ledger, reveal_path(ledger))  # the run's own ledger, checked, every episode replayed
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(out_dir / f"scorecard-{card['run_id']}.json", scorecard_json(card))
        atomic_write(out_dir / f"scorecard-{card['run_id']}.md", scorecard_markdown(card, agent))
    return card


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lib.measure.score_agent",
        description="Score an agent out of process, as a client of an evaluation server's scored run.",
        allow_abbrev=False,
    )
    parser.add_argument("--agent", required=True, help="the agent class, module:Class (importable from here)")
    parser.add_argument("--suite", default=SUITE_VERSION, help=f"what the run plays: {SELECTION_HELP}")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "scorecards", help="where the scorecard goes")
    parser.add_argument("--max-episodes", type=int, help="stop the agent after this many episodes")
    args = parser.parse_args(argv)
    try:
        selected_tasks(args.suite)
    except ValueError as error:
        parser.error(f"--suite: {error}")
    if not AGENT_SPEC.fullmatch(args.agent):  # its code is imported in its own process only
        parser.error(f"--agent {args.agent!r}: give module:Class, e.g. lib.agents.baselines:HeuristicAgent")
    card = score_agent(args.agent, args.suite, out_dir=args.out, max_episodes=args.max_episodes)
    print(scorecard_markdown(card, args.agent), end="")
    print(f"scorecard: {args.out}/scorecard-{card['run_id']}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
