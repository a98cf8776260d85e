"""Throughput of CERNenv in process and over OpenEnv's WebSocket API (`python -m cernenv.server`).

    make bench-server      # or: python bench/bench_server.py --sessions 1 8 32 --episodes 128

The same HeuristicAgent episodes in every row: the first `--episodes` of bench_env.py's
fixed mix of curated and procedural campaigns. In process: one environment, one core. Remote: a server subprocess on
127.0.0.1 and N concurrent sessions, one async `CERNEnvClient` each, all on one event loop
in this process. Prints episodes/s and steps/s, and remote/in-process.
Target: remote throughput at 32 sessions >= 30% of in-process.

Then the server under attack (bench/server_load.py; `--no-abuse` skips it), each case with and
without abusers on the same server:
- fairness: 4 honest clients beside 8 sessions repeating `scan_bump`, then beside 8 scanning
  one spectrum with another step each time, 8 resetting again and again, 8 resetting and
  claiming at once, 8 sending garbage frames, 8 sending `state` requests, 8 churning
  sessions, 8 HTTP connections spamming `POST /reset`, 8 spamming the other HTTP routes, 8
  spamming `GET /schema`;
  target: the honest median latency at most 2x what it is without them;
- capacity (no target): 4 honest clients beside 8 sessions that play whole episodes back to
  back. They do new work, as honest clients do, and get equal shares: the server is simply
  past its capacity (12 busy sessions), and no scheduler can tell them from honest ones;
- load: 64 honest clients beside 8 abusers (2 scan, 1 scan-varied, 2 slow, 2 flood, 1 session
  churn); target: every honest episode completes with 0 errors, honest p99 latency
  < 1 s.

`--attacks` (`make bench-server-attacks`) runs the outside attacker's attacks instead, as a gate
that exits non-zero if any regresses, on a server in its default (evaluation) mode; each case
beside 4 honest clients, with the server's memory, open files and log growth measured:
- 4 connections flooding pings without reading; 8 spamming `POST /reset`, `GET /metadata` or
  session churn with a rotated X-Forwarded-For; 8 sending frames that are not UTF-8, requests that
  are not HTTP, JSON nested 900 deep: honest median latency at most 2x, server RSS growth under
  64 MB, log under 1 MB/h, no session ended by a message, the rotated header buying no more
  requests or sessions than one address is paced to;
- lock-out: half-open requests from 8 addresses filling the connection cap, then 34 honest clients
  (all served); one address taking every session it can, then 44 honest clients (each served
  while slots are free); sessions that send only `state` with --max-sessions 2 (never more
  sessions playing than the limit);
- the documented launches: plain uvicorn refuses to start; `openenv validate --url` passes.
`--server-root PATH` starts the server from another checkout (the same cases before a change;
flags it does not know are left out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")  # single core: no BLAS threads (the server inherits these)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

from cernenv.client import CERNEnvClient  # noqa: E402
from lib.agents.baselines import HeuristicAgent  # noqa: E402

from bench_env import episode_specs, heuristic_throughput  # noqa: E402
from server_load import ABUSE_MS, LOAD_ABUSERS, LoadResult, run_load  # noqa: E402

HTTP_REQUESTS_PER_S, STEPLESS_SESSIONS_PER_S = 20.0, 5.0  # cernenv.server.pacing, per address

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


class RunningServer:
    """`python -m cernenv.server` in a subprocess (from `root`), its output in a file."""

    def __init__(self, args: List[str], root: str = ROOT, state_dir: Optional[str] = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = tempfile.TemporaryDirectory(prefix="cernenv-bench-state-")
        self.log = tempfile.NamedTemporaryFile(prefix="cernenv-bench-server-", suffix=".log")
        known = _known_flags(root)
        kept, skip = [], False
        for index, arg in enumerate(args):  # flags an older server does not know are left out, with their value
            if skip:
                skip = False
                continue
            if arg.startswith("--") and arg not in known:
                skip = index + 1 < len(args) and not args[index + 1].startswith("--")
                continue
            kept.append(arg)
        environment = {**os.environ, "CERNENV_STATE_DIR": state_dir or self.state.name, "PYTHONPATH": root}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cernenv.server", "--port", str(self.port), *kept],
            cwd=root,
            env=environment,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the server on {self.url} did not start")

    def log_bytes(self) -> int:
        return os.path.getsize(self.log.name)

    def resources(self) -> Tuple[float, int]:
        """(RSS in MB, open file descriptors) of the server process."""
        import psutil

        process = psutil.Process(self.process.pid)
        return process.memory_info().rss / 2**20, process.num_fds()

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        self.log.close()
        self.state.cleanup()


class PeakResources:
    """The server's largest RSS [MB] and number of open files while the block runs (sampled every 0.1 s)."""

    def __init__(self, server: RunningServer) -> None:
        self.server, self.rss_mb, self.fds = server, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            try:
                rss_mb, fds = self.server.resources()
            except Exception:  # the process is gone
                return
            self.rss_mb, self.fds = max(self.rss_mb, rss_mb), max(self.fds, fds)
            if self._stop.wait(0.1):
                return

    def __enter__(self) -> "PeakResources":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        self._thread.join()


def _known_flags(root: str) -> set:
    text = subprocess.run(
        [sys.executable, "-m", "cernenv.server", "--help"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return {word.strip(",[]") for word in text.split() if word.startswith("--")}


def start_server(max_sessions: int) -> Tuple[RunningServer, str]:
    """The server of the throughput and fairness cases: training mode (one client address holds all
    the sessions, as in process), `max_sessions` sessions."""
    server = RunningServer(["--mode", "training", "--max-sessions", str(max_sessions)])
    return server, server.url


# The outside attacker's attacks, as a gate -----------------------------------------------------

ATTACK_CASES: Dict[str, Tuple[int, str]] = {  # abuser kind: (how many, what they do)
    "ping": (4, "sending pings as fast as they can, never reading"),
    "xff-reset": (8, "sending POST /reset as fast as answered, another X-Forwarded-For each time"),
    "xff-metadata": (8, "sending GET /metadata as fast as answered, another X-Forwarded-For each time"),
    "xff-create": (8, "churning sessions, another X-Forwarded-For on each handshake"),
    "bad-utf8": (8, "sending text frames that are not UTF-8, a connection each"),
    "bad-http": (8, "sending requests that are not HTTP, a connection each"),
    "deep": (8, "sending step messages nested 900 deep"),
    "fragments": (4, "sending 1 MiB messages in 1-byte WebSocket fragments"),
    "chunked": (4, "sending POST /reset with 60 KB bodies in 1-byte chunks"),
}
ATTACK_RUN_LIMIT_S = 60.0  # an attacked run whose honest clients are not done by then counts as failed
ATTACK_REPEATS = 3  # pairs of runs alone / attacked per case (the machine's own noise moves one ratio by +-50%)
RSS_GROWTH_LIMIT_MB = 64.0
LOG_LIMIT_MB_PER_H = 1.0
PACED = {  # abuse counter: (the rate one address is paced to [per second], its free burst)
    "xff /reset answered 200": (HTTP_REQUESTS_PER_S, 32),
    "xff /metadata answered 200": (HTTP_REQUESTS_PER_S, 32),
    "xff sessions created": (STEPLESS_SESSIONS_PER_S, 16),
}


P99_GATED = {"fragments", "chunked"}  # parsing-cost attacks: the honest p99 too, within x2 of alone
P99_TARGET_RATIO = 2.0


def attack_gate(root: str, cases: Sequence[str] = ()) -> Tuple[List[str], bool]:
    """Each case of `ATTACK_CASES` (or of `cases` alone) against a server in its default mode,
    then (for all cases) the capacity cases and the launches: (lines to print, all gates met)."""
    lines: List[str] = []
    met_all = True

    def gate(name: str, met: bool, detail: str) -> None:
        nonlocal met_all
        met_all &= met
        lines.append(f"  {'met' if met else 'NOT met'}: {name}: {detail}")

    server = RunningServer(["--max-sessions", "64", "--max-sessions-per-client", "16"], root=root)
    try:

        def run(abusers: Tuple[str, ...]) -> LoadResult:
            try:
                return asyncio.run(
                    run_load(server.url, honest=4, episodes_per_client=4, abusers=abusers, timeout_s=ATTACK_RUN_LIMIT_S)
                )
            except (asyncio.TimeoutError, TimeoutError):  # the honest clients could not finish: a failed gate
                stuck = LoadResult()
                stuck.errors.append(f"the honest clients did not finish in {ATTACK_RUN_LIMIT_S:g} s")
                stuck.abuse[ABUSE_MS] = int(1000 * ATTACK_RUN_LIMIT_S)
                return stuck

        run(())  # warm-up
        for kind, (count, what) in ATTACK_CASES.items():
            if cases and kind not in cases:
                continue
            rss_before, fds_before = server.resources()
            log_before, start, ratios, tail_ratios = server.log_bytes(), time.perf_counter(), [], []
            with PeakResources(server) as peak:
                for _ in range(ATTACK_REPEATS):  # alone, then attacked: the median of the ratios
                    alone = run(())
                    attacked = run((kind,) * count)
                    ratios.append(attacked.percentile_s(50) / alone.percentile_s(50))
                    tail_ratios.append(attacked.percentile_s(99) / alone.percentile_s(99))
            elapsed = time.perf_counter() - start
            rss_after, fds_after = peak.rss_mb, peak.fds
            log_per_h = (server.log_bytes() - log_before) / elapsed * 3600 / 2**20
            ratio = sorted(ratios)[len(ratios) // 2]
            lines.append(f"attack: 4 honest clients x 4 episodes, {count} connections {what} ({elapsed:.1f} s)")
            lines.append(f"  alone (last of {ATTACK_REPEATS}): {alone.summary()}")
            lines.append(f"  with abusers (last of {ATTACK_REPEATS}): {attacked.summary()}")
            lines.append(
                f"  server RSS {rss_before:.0f} -> peak {rss_after:.0f} MB, open files {fds_before} -> peak "
                f"{fds_after}, log {log_per_h:.3f} MB/h"
            )
            spread = ", ".join(f"x{r:.2f}" for r in ratios)
            met = ratio <= FAIRNESS_TARGET_RATIO and not attacked.errors
            gate("honest median latency", met, f"x{ratio:.2f} ({spread})")
            if kind in P99_GATED:
                tail = sorted(tail_ratios)[len(tail_ratios) // 2]
                gate("honest p99 latency", tail <= P99_TARGET_RATIO, f"x{tail:.2f} (target <= x{P99_TARGET_RATIO:g})")
            gate("server memory", rss_after - rss_before < RSS_GROWTH_LIMIT_MB, f"{rss_after - rss_before:+.0f} MB")
            gate("log growth", log_per_h < LOG_LIMIT_MB_PER_H, f"{log_per_h:.3f} MB/h")
            ran_s = attacked.abuse[ABUSE_MS] / 1000.0
            for counter, (rate, burst) in PACED.items():
                if counter in attacked.abuse:  # the 8 spammers share 127.0.0.1: its pace, whatever the header says
                    got = attacked.abuse[counter] / ran_s
                    limit = 1.25 * (rate + burst / ran_s)
                    gate(counter, got <= limit, f"{got:.0f}/s over {ran_s:.1f} s (one address's pace: {rate:g}/s)")
            ended = sum(n for key, n in attacked.abuse.items() if key.startswith("deep sessions ended"))
            if kind == "deep":
                gate("sessions ended by nested JSON", ended == 0, str(ended))
    finally:
        server.stop()
    if cases:
        return lines, met_all
    for name, check in CAPACITY_CHECKS.items():
        detail, met = check(root)
        gate(name, met, detail)
    return lines, met_all


def _ws(url: str, source: str, stack: contextlib.ExitStack) -> Any:
    """A WebSocket from `source`, closed with `stack`."""
    from websockets.sync.client import connect

    url = url.replace("http://", "ws://") + "/ws"
    return stack.enter_context(connect(url, source_address=(source, 0), open_timeout=10))


def _reset_ok(ws: Any, seed: int = 1) -> bool:
    ws.send(json.dumps({"type": "reset", "data": {"seed": seed}}))
    return json.loads(ws.recv(timeout=30)).get("type") == "observation"


def _lockout(root: str) -> Tuple[str, bool]:
    """Half-open requests from 8 addresses, each at its share, fill the cap; then 34 honest clients."""
    server = RunningServer(["--max-connections", "64", "--max-connections-per-client", "8"], root=root)
    held = []
    try:
        for address in range(8):
            for _ in range(8):
                sock = socket.socket()
                sock.bind((f"127.0.20.{address + 1}", 0))
                sock.connect(("127.0.0.1", server.port))
                sock.sendall(b"POST /reset HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{")
                held.append(sock)
        time.sleep(0.5)
        served = 0
        for honest in range(34):
            try:
                with socket.create_connection(("127.0.0.1", server.port), 5, (f"127.0.21.{honest + 1}", 0)) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    served += sock.recv(64).startswith(b"HTTP/1.1 200")
            except OSError:
                pass
        return f"honest clients served beside a full server: {served}/34", served == 34
    finally:
        for sock in held:
            sock.close()
        server.stop()


def _hog(root: str) -> Tuple[str, bool]:
    """One address opens every session it can (and holds them); then 44 honest clients, one
    session each, opened while slots are free (64 in all)."""
    server = RunningServer(["--max-sessions", "64"], root=root)
    hogged, honest_ok = 0, 0
    try:
        with contextlib.ExitStack() as stack:
            for _ in range(64):
                try:
                    if not _reset_ok(_ws(server.url, "127.0.22.1", stack)):
                        break
                    hogged += 1
                except Exception:
                    break
            for honest in range(44):
                try:
                    honest_ok += _reset_ok(_ws(server.url, f"127.0.23.{honest + 1}", stack))
                except Exception:
                    pass
        return f"one address held {hogged} sessions; honest clients {honest_ok}/44", honest_ok == 44
    finally:
        server.stop()


def _state_only(root: str) -> Tuple[str, bool]:
    """With --max-sessions 2 and a 3 s idle timeout: 2 sessions that send only `state` for 9 s,
    then 2 more; how many play at once (resets answered on open sockets) against the limit."""
    server = RunningServer(["--max-sessions", "2", "--session-idle-timeout-s", "3", "--mode", "training"], root=root)
    try:
        with contextlib.ExitStack() as stack:
            sockets = [_ws(server.url, f"127.0.24.{i + 1}", stack) for i in range(2)]
            for ws in sockets:
                _reset_ok(ws)
            deadline = time.monotonic() + 9
            while time.monotonic() < deadline:
                for ws in sockets:
                    try:
                        ws.send(json.dumps({"type": "state"}))
                        ws.recv(timeout=5)
                    except Exception:
                        pass
                time.sleep(0.5)
            for i in range(2):
                try:
                    sockets.append(_ws(server.url, f"127.0.25.{i + 1}", stack))
                    _reset_ok(sockets[-1])
                except Exception:
                    pass
            playing = 0
            for ws in sockets:
                try:
                    playing += _reset_ok(ws, seed=9)
                except Exception:
                    pass
            with urllib.request.urlopen(server.url + "/sessions", timeout=10) as answer:
                listed = json.loads(answer.read())["open_environments"]
        return f"sessions playing with --max-sessions 2: {playing} (/sessions says {listed})", playing <= 2
    finally:
        server.stop()


def _plain_uvicorn(root: str) -> Tuple[str, bool]:
    """`uvicorn cernenv.server.app:app`: start-up refused (else: served without the guard)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "cernenv.server.app:app", "--port", str(port)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": root},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        code = process.wait(timeout=60)
        return f"exited with {code} at start-up", code != 0
    except subprocess.TimeoutExpired:
        return "served (no guard)", False
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def _validate(root: str) -> Tuple[str, bool]:
    """OpenEnv's `openenv validate --url` criteria against the server in its default mode."""
    from openenv.cli._validation import validate_running_environment

    server = RunningServer([], root=root)
    try:
        report = validate_running_environment(server.url, timeout_s=30.0)
        failed = [c["id"] for c in report["criteria"] if not c["passed"]]
        return f"failed criteria: {failed or 'none'}", bool(report["passed"])
    finally:
        server.stop()


CAPACITY_CHECKS: Dict[str, Callable[[str], Tuple[str, bool]]] = {
    "lock-out by half-open requests from 8 addresses": _lockout,
    "one address holding every session": _hog,
    "sessions sending only state (capacity bypass)": _state_only,
    "plain uvicorn launch": _plain_uvicorn,
    "openenv validate --url": _validate,
}


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--episodes", type=int, default=128, help="episodes per row")
    parser.add_argument("--no-abuse", action="store_true", help="skip the measurements under attack")
    parser.add_argument(
        "--attacks",
        action="store_true",
        help="run the outside attacker's attacks as a gate instead (exit 1 if one regresses)",
    )
    parser.add_argument("--cases", help=f"with --attacks: only these cases, comma-separated ({','.join(ATTACK_CASES)})")
    parser.add_argument("--server-root", default=ROOT, help="checkout to start the server from (default: this one)")
    args = parser.parse_args()
    if args.attacks:
        start = time.perf_counter()
        cases = [c for c in (args.cases or "").split(",") if c]
        unknown = sorted(set(cases) - set(ATTACK_CASES))
        if unknown:
            parser.error(f"--cases: no case {', '.join(unknown)}; cases: {', '.join(ATTACK_CASES)}")
        lines, met = attack_gate(os.path.abspath(args.server_root), cases)
        for line in lines:
            print(line)
        print(f"attack gate: {'all met' if met else 'NOT all met'} ({time.perf_counter() - start:.0f} s)")
        return 0 if met else 1
    specs = list(episode_specs(args.episodes))
    in_process(specs[:4])  # warm-up: imports, caches
    base_episodes, base_steps = in_process(specs)
    rows = [("in-process", 1, len(specs), base_episodes, base_steps)]
    server, url = start_server(max(max(args.sessions), 96))
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
        server.stop()
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
