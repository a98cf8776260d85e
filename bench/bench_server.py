"""Throughput of CERNenv in process and over OpenEnv's WebSocket API (`python -m cernenv.server`).

    make bench-server      # or: python bench/bench_server.py --sessions 1 8 32 --episodes 128

The same HeuristicAgent episodes in every row: the first `--episodes` of bench_env.py's
fixed mix of curated and procedural campaigns. In process: one environment, one core. Remote: a server subprocess on
127.0.0.1 and N concurrent sessions, one async `CERNEnvClient` each, all on one event loop
in this process. Prints episodes/s and steps/s, and remote/in-process.
Target (issue 7): remote throughput at 32 sessions >= 30% of in-process.

Then the server under attack (bench/server_load.py; `--no-abuse` skips it), each case with and
without abusers on the same server:
- fairness: 4 honest clients beside 8 sessions repeating `scan_bump`, then beside 8 scanning
  one spectrum with another step each time, 8 resetting again and again, 8 resetting and
  claiming at once, 8 sending garbage frames, 8 sending `state` requests, 8 churning
  sessions, 8 HTTP connections spamming `POST /reset`, 8 spamming the other HTTP routes, 8
  spamming `GET /schema`;
  target (issue 15): the honest median latency at most 2x what it is without them;
- capacity (no target): 4 honest clients beside 8 sessions that play whole episodes back to
  back. They do new work, as honest clients do, and get equal shares: the server is simply
  past its capacity (12 busy sessions), and no scheduler can tell them from honest ones;
- load: 64 honest clients beside 8 abusers (2 scan, 1 scan-varied, 2 slow, 2 flood, 1 session
  churn); target (issue 15): every honest episode completes with 0 errors, honest p99 latency
  < 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, List, Optional, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")  # single core: no BLAS threads (the server inherits these)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

from cernenv.client import CERNEnvClient  # noqa: E402
from lib.baselines import HeuristicAgent  # noqa: E402

from bench_env import episode_specs, heuristic_throughput  # noqa: E402
from server_load import LOAD_ABUSERS, run_load  # noqa: E402

TARGET_RATIO_AT_32 = 0.30
FAIRNESS_TARGET_RATIO = 2.0  # honest median latency with 8 scan spammers / without
FAIRNESS_CASES = {  # abuser kind (bench/server_load.py): what its 8 sessions do
    "scan": "repeating scan_bump",
    "scan-varied": "scanning one spectrum again and again with another step_gev each time",
    "reset": "resetting again and again, never stepping",
    "reset-claim": "resetting and claiming 'nothing there' at once, again and again",
    "garbage": "sending frames that are not JSON, as fast as they are answered",
    "state": "sending state requests, as fast as they are answered",
    "create": "opening a session, resetting and dropping it, again and again",
    "http-reset": "(HTTP connections) sending POST /reset, as fast as it is answered",
    "http-misc": "(HTTP connections) sending GET /schema, /metadata, /state, /sessions, POST /step",
    "http-schema": "(HTTP connections) sending GET /schema, as fast as it is answered",
}
CAPACITY_CASE = ("busy", "playing whole episodes back to back (new work: equal shares, no target)")
LOAD_TARGET_P99_S = 1.0
Spec = Tuple[int, Optional[str], Optional[str]]


def in_process(specs: List[Spec]) -> Tuple[float, float]:
    """(episodes/s, steps/s) of one environment played sequentially."""
    return heuristic_throughput(specs)


async def _session(url: str, specs: List[Spec]) -> int:
    agent, steps = HeuristicAgent(), 0
    async with CERNEnvClient(base_url=url) as env:
        for seed, scenario, difficulty in specs:
            agent.reset()
            result = await env.reset(seed=seed, scenario=scenario, difficulty=difficulty)
            while not result.done:
                result = await env.step(agent.act(result.observation))
                steps += 1
    return steps


def remote(url: str, specs: List[Spec], sessions: int) -> Tuple[float, float]:
    """(episodes/s, steps/s) of `sessions` concurrent sessions sharing `specs` round-robin."""

    async def run() -> List[int]:
        return await asyncio.gather(*(_session(url, specs[i::sessions]) for i in range(sessions)))

    start = time.perf_counter()
    steps = sum(asyncio.run(run()))
    elapsed = time.perf_counter() - start
    return len(specs) / elapsed, steps / elapsed


def under_attack(url: str, honest: int, episodes: int, abusers: Tuple[str, ...]) -> Tuple[List[str], Any, Any, float]:
    """The honest clients' latencies without and with `abusers`: (lines to print, result alone,
    result with abusers, ratio of the medians)."""
    alone = asyncio.run(run_load(url, honest=honest, episodes_per_client=episodes))
    attacked = asyncio.run(run_load(url, honest=honest, episodes_per_client=episodes, abusers=abusers))
    lines = [f"  {label:<14}{r.summary()}" for label, r in (("alone:", alone), ("with abusers:", attacked))]
    ratio = attacked.percentile_s(50) / alone.percentile_s(50)
    lines.append(f"  median ratio {ratio:.2f}, p99 ratio {attacked.percentile_s(99) / alone.percentile_s(99):.2f}")
    return lines, alone, attacked, ratio


def start_server(max_sessions: int) -> Tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "cernenv.server", "--port", str(port), "--max-sessions", str(max_sessions)], cwd=ROOT
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the server on {url} did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--episodes", type=int, default=128, help="episodes per row")
    parser.add_argument("--no-abuse", action="store_true", help="skip the measurements under attack")
    args = parser.parse_args()
    specs = list(episode_specs(args.episodes))
    in_process(specs[:4])  # warm-up: imports, caches
    base_episodes, base_steps = in_process(specs)
    rows = [("in-process", 1, len(specs), base_episodes, base_steps)]
    process, url = start_server(max(max(args.sessions), 96))
    attack_lines: List[str] = []
    try:
        remote(url, specs[:4], 1)  # warm-up of the server
        for sessions in args.sessions:
            rows.append(("websocket", sessions, len(specs), *remote(url, specs, sessions)))
        if not args.no_abuse:
            for kind, spam in FAIRNESS_CASES.items():
                lines, _, _, ratio = under_attack(url, 4, 6, (kind,) * 8)
                attack_lines += [f"fairness: 4 honest clients x 6 episodes, 8 sessions {spam}"] + lines
                attack_lines.append(
                    f"target: median ratio <= {FAIRNESS_TARGET_RATIO:g}: "
                    f"{'met' if ratio <= FAIRNESS_TARGET_RATIO else 'NOT met'}"
                )
            kind, busy = CAPACITY_CASE
            lines, _, _, _ = under_attack(url, 4, 6, (kind,) * 8)
            attack_lines += [f"capacity: 4 honest clients x 6 episodes, 8 sessions {busy}"] + lines
            lines, _, attacked, _ = under_attack(url, 64, 2, LOAD_ABUSERS)
            attack_lines += [f"load: 64 honest clients x 2 episodes, abusers {','.join(LOAD_ABUSERS)}"] + lines
            met = not attacked.errors and attacked.percentile_s(99) < LOAD_TARGET_P99_S
            attack_lines.append(
                f"target: 0 errors and honest p99 < {LOAD_TARGET_P99_S:g} s with abusers: {'met' if met else 'NOT met'}"
            )
    finally:
        process.terminate()
        process.wait(timeout=10)
    print(f"{'mode':<12}{'sessions':>9}{'episodes':>10}{'episodes/s':>12}{'steps/s':>10}{'remote/in-process':>19}")
    for mode, sessions, n, episodes_per_s, steps_per_s in rows:
        print(
            f"{mode:<12}{sessions:>9}{n:>10}{episodes_per_s:>12.1f}{steps_per_s:>10.0f}"
            f"{episodes_per_s / base_episodes:>19.2f}"
        )
    at_32 = [r[3] / base_episodes for r in rows if r[0] == "websocket" and r[1] == 32]
    if at_32:
        print(
            f"target: remote/in-process at 32 sessions >= {TARGET_RATIO_AT_32:.2f}: "
            f"{'met' if at_32[0] >= TARGET_RATIO_AT_32 else 'NOT met'} ({at_32[0]:.2f})"
        )
    for line in attack_lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
