"""Honest clients and abusive ones against a running `python -m cernenv.server`, on loopback.

Used by `tests/test_server.py` (the load test) and `bench/bench_server.py --abuse` (the same
figures, larger). Honest clients play HeuristicAgent episodes from 127.0.0.1 and time every
reset and step; each abuser comes from its own loopback address (127.0.0.2, ...), as another
host would (the `xff-` ones from 127.0.0.1, the address uvicorn trusts X-Forwarded-For from by
default), and keeps at it until the honest clients are done:

| abuser | what it does |
|---|---|
| `scan` | takes data, builds a spectrum, then repeats the same `scan_bump` as fast as the server answers |
| `scan-varied` | the same, with a different `step_gev` each time, so that the environment does not see a repeat |
| `reset` | resets its session again and again, a new campaign each time, never stepping |
| `reset-claim` | the same, each episode ended at once by a claim that nothing is there |
| `garbage` | sends frames that are not JSON, as fast as the server answers them |
| `state` | sends `state` requests, as fast as the server answers them |
| `slow` | sends HTTP requests one byte every 0.5 s (slowloris) |
| `flood` | opens HTTP connections that never finish their request, as fast as it can |
| `create` | opens WebSocket sessions, resets and drops them, as fast as it can |
| `http-reset` | `POST /reset` on a kept-alive HTTP connection, as fast as answered (a new environment each) |
| `http-misc` | `GET /schema`, `/metadata`, `/state`, `/sessions`, `POST /step` in turn, as fast as answered |
| `http-schema` | `GET /schema` on a kept-alive HTTP connection, as fast as answered |
| `busy` | plays whole HeuristicAgent episodes back to back: new work, as an honest client that never pauses |
| `ping` | opens a WebSocket and sends pings as fast as it can, never reading the pongs (reconnects when closed) |
| `xff-reset` | `http-reset` with another `X-Forwarded-For` on every request, to escape the per-address pacing |
| `xff-metadata` | `GET /metadata` as fast as answered, with another `X-Forwarded-For` on every request |
| `xff-create` | `create` with another `X-Forwarded-For` on every handshake |
| `bad-utf8` | WebSocket text frames that are not UTF-8, a new connection for each (the server closes it) |
| `bad-http` | requests that are not HTTP, a new connection for each, as fast as answered |
| `deep` | step messages whose parameters nest 900 deep, as fast as answered |
| `state-only` | a session that resets once and then sends only `state` (a slot held without work) |

    result = asyncio.run(run_load(url, honest=64, episodes_per_client=2, abusers=("scan",) * 8))
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from websockets.asyncio.client import connect

from cernenv.client import CERNEnvClient, parse_observation
from cernenv.models import ActionType
from lib.agents.baselines import HeuristicAgent

HONEST_SCENARIOS = ("z_mumu_91", "higgs_4l_125", None)  # None: a procedural campaign (medium)
ABUSER_KINDS = (
    "scan",
    "scan-varied",
    "reset",
    "reset-claim",
    "garbage",
    "state",
    "slow",
    "flood",
    "create",
    "http-reset",
    "http-misc",
    "http-schema",
    "busy",
    "ping",
    "xff-reset",
    "xff-metadata",
    "xff-create",
    "bad-utf8",
    "bad-http",
    "deep",
    "state-only",
    "fragments",
    "chunked",
)
ABUSE_MS = "abusers ran [ms]"
# the load test's abusers (tests/test_server.py and `make bench-server`): scan spam of both
# kinds, slowloris, unfinished-request floods, session churn
LOAD_ABUSERS = ("scan",) * 2 + ("scan-varied",) + ("slow",) * 2 + ("flood",) * 2 + ("create",)


@dataclass
class LoadResult:
    """What the honest clients saw, and what the abusers did."""

    latencies_s: List[float] = field(default_factory=list)
    episodes: int = 0
    errors: List[str] = field(default_factory=list)
    abuse: Counter = field(default_factory=Counter)
    wall_s: float = 0.0

    def percentile_s(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q / 100.0 * len(ordered)))] if ordered else float("nan")

    def summary(self) -> str:
        return (
            f"{self.episodes} honest episodes, {len(self.latencies_s)} requests in {self.wall_s:.1f} s: "
            f"latency p50 {1e3 * self.percentile_s(50):.0f} ms, p99 {1e3 * self.percentile_s(99):.0f} ms, "
            f"max {1e3 * max(self.latencies_s, default=float('nan')):.0f} ms; {len(self.errors)} errors; "
            f"abusers: {dict(sorted(self.abuse.items()))}"
        )


async def _honest(url: str, index: int, episodes: int, result: LoadResult) -> None:
    agent = HeuristicAgent()
    try:
        async with CERNEnvClient(base_url=url) as env:
            for k in range(episodes):
                seed = 1000 * index + k
                scenario = HONEST_SCENARIOS[(index + k) % len(HONEST_SCENARIOS)]
                agent.reset()
                start = time.perf_counter()
                step = await env.reset(seed=seed, scenario=scenario, difficulty=None if scenario else "medium")
                result.latencies_s.append(time.perf_counter() - start)
                while not step.done:
                    action = agent.act(step.observation)
                    start = time.perf_counter()
                    step = await env.step(action)
                    result.latencies_s.append(time.perf_counter() - start)
                result.episodes += 1
    except Exception as error:  # counted and reported by the caller
        result.errors.append(f"honest client {index}: {type(error).__name__}: {error}")


async def _ws_call(ws: Any, message: Dict[str, Any]) -> Dict[str, Any]:
    await ws.send(json.dumps(message))
    return json.loads(await ws.recv())


async def _scan_spam(ws_url: str, source: str, stop: asyncio.Event, abuse: Counter, varied: bool = False) -> None:
    """Play the heuristic up to its first scan, then repeat scan_bump until the episode ends; again.
    `varied`: each scan with another step (0.30, 0.31, ... 0.79 GeV), a new action each time."""
    async with connect(ws_url, local_addr=(source, 0), compression=None, max_size=None) as ws:
        seed = 0
        while not stop.is_set():
            agent, seed = HeuristicAgent(), seed + 1
            reply = await _ws_call(ws, {"type": "reset", "data": {"seed": seed, "scenario": "z_mumu_91"}})
            observation = parse_observation(reply["data"])
            scanning = False
            while not observation.done and not stop.is_set():
                if not scanning:
                    action = agent.act(observation)
                    scanning = action.action_type == ActionType.SCAN_BUMP
                    data = action.model_dump(exclude_none=True)
                elif varied:
                    step_gev = 0.3 + 0.01 * (abuse["scans"] % 50)
                    data = {"action_type": "scan_bump", "parameters": {"step_gev": step_gev}}
                else:
                    data = {"action_type": "scan_bump", "parameters": {}}
                reply = await _ws_call(ws, {"type": "step", "data": data})
                if reply.get("type") != "observation":
                    abuse["scan errors"] += 1
                    break
                abuse["scans" if scanning else "scan setup steps"] += 1
                observation = parse_observation(reply["data"])
                if scanning and observation.rule_violations:
                    abuse["scans refused or repeats"] += 1


async def _slowloris(host: str, port: int, source: str, stop: asyncio.Event, abuse: Counter) -> None:
    """Send a request one byte every 0.5 s, until the server answers or closes; again."""
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            abuse["slow connections failed"] += 1
            await asyncio.sleep(0.5)
            continue
        answer = b""
        try:
            for byte in request:
                writer.write(bytes([byte]))
                await writer.drain()
                try:
                    answer = await asyncio.wait_for(reader.read(200), 0.5)
                    break  # an answer, or the connection closed (b"")
                except asyncio.TimeoutError:
                    if stop.is_set():
                        break
        except OSError:
            pass
        writer.close()
        status = answer.split(b" ")[1].decode() if answer.count(b" ") else "none (closed)"
        abuse[f"slow requests answered {status}"] += 1


async def _flood(host: str, port: int, source: str, stop: asyncio.Event, abuse: Counter) -> None:
    held: List[asyncio.StreamWriter] = []
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
            writer.write(
                b"POST /reset HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n{"
            )  # never finished
            held.append(writer)
            abuse["unfinished requests opened"] += 1
        except OSError:
            abuse["flood connections failed"] += 1
            await asyncio.sleep(0.01)
        if len(held) > 2000:  # keep the client's own descriptors bounded
            for writer in held[:1000]:
                writer.close()
            del held[:1000]
        await asyncio.sleep(0)
    for writer in held:
        writer.close()


async def _reset_spam(ws_url: str, source: str, stop: asyncio.Event, abuse: Counter, claim: bool = False) -> None:
    """Reset one session again and again, a new procedural campaign each time; `claim`: each
    episode ended at once by a claim of nothing there, else abandoned unfinished."""
    async with connect(ws_url, local_addr=(source, 0), compression=None, max_size=None) as ws:
        while not stop.is_set():
            data = {"seed": abuse["resets"], "difficulty": "hard"}
            reply = await _ws_call(ws, {"type": "reset", "data": data})
            abuse["resets" if reply.get("type") == "observation" else "reset errors"] += 1
            if claim:
                parameters = {"discovered": False, "confidence": 0.5}
                action = {"action_type": "submit_discovery_claim", "parameters": parameters}
                reply = await _ws_call(ws, {"type": "step", "data": action})
                abuse["claims" if reply.get("type") == "observation" else "claim errors"] += 1


async def _garbage_spam(ws_url: str, source: str, stop: asyncio.Event, abuse: Counter, state: bool = False) -> None:
    """Send frames that are not JSON (or, with `state`, `state` requests) as fast as the server
    answers them."""
    async with connect(ws_url, local_addr=(source, 0), compression=None, max_size=None) as ws:
        await _ws_call(ws, {"type": "reset", "data": {"seed": 1, "difficulty": "hard"}})
        while not stop.is_set():
            if state:
                reply = await _ws_call(ws, {"type": "state"})
            else:
                await ws.send("{not json")
                reply = json.loads(await ws.recv())
            abuse["state requests" if state else "garbage frames"] += reply.get("type") in ("state", "error")


async def _session_spam(ws_url: str, source: str, stop: asyncio.Event, abuse: Counter) -> None:
    while not stop.is_set():
        try:
            async with connect(ws_url, local_addr=(source, 0), compression=None, open_timeout=30) as ws:
                reply = await _ws_call(ws, {"type": "reset", "data": {"seed": abuse["sessions created"]}})
                abuse["sessions created" if reply.get("type") == "observation" else "sessions refused"] += 1
        except Exception:  # refused handshakes and closed connections are what this abuser gets
            abuse["session attempts failed"] += 1
            await asyncio.sleep(0.01)


async def _http_request(
    reader: Any, writer: Any, method: str, path: str, body: bytes = b"", headers: Optional[Dict[str, str]] = None
) -> int:
    """One HTTP/1.1 request on a kept-alive connection; its status (the body is read and dropped)."""
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    status_line = await reader.readline()
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    await reader.readexactly(length)
    return int(status_line.split(b" ")[1]) if status_line.count(b" ") else 0


HTTP_MISC_REQUESTS = (
    ("GET", "/schema", b""),
    ("GET", "/metadata", b""),
    ("GET", "/state", b""),
    ("GET", "/sessions", b""),
    ("POST", "/step", b'{"action": {"action_type": "scan_bump", "parameters": {}}}'),
)


async def _http_spam(host: str, port: int, source: str, stop: asyncio.Event, abuse: Counter, kind: str) -> None:
    """`POST /reset` (`http-reset`), the `HTTP_MISC_REQUESTS` in turn (`http-misc`) or `GET
    /schema` (`http-schema`) on one kept-alive connection, as fast as the server answers; a new
    connection when the server closes one."""
    sent = 0
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            abuse["http connections failed"] += 1
            await asyncio.sleep(0.01)
            continue
        try:
            while not stop.is_set():
                if kind == "http-misc":
                    method, path, body = HTTP_MISC_REQUESTS[sent % len(HTTP_MISC_REQUESTS)]
                elif kind == "http-schema":
                    method, path, body = "GET", "/schema", b""
                else:
                    method, path, body = "POST", "/reset", json.dumps({"seed": sent, "difficulty": "hard"}).encode()
                status = await _http_request(reader, writer, method, path, body)
                sent += 1
                abuse[f"http {path} answered {status}"] += 1
        except (OSError, asyncio.IncompleteReadError, ValueError):
            abuse["http connections closed by the server"] += 1
        finally:
            writer.close()


async def _busy(ws_url: str, source: str, stop: asyncio.Event, abuse: Counter) -> None:
    """Play whole HeuristicAgent episodes back to back, as fast as the server answers."""
    async with connect(ws_url, local_addr=(source, 0), compression=None, max_size=None) as ws:
        seed = 0
        while not stop.is_set():
            agent, seed = HeuristicAgent(), seed + 1
            scenario = HONEST_SCENARIOS[seed % len(HONEST_SCENARIOS)]
            data = {"seed": 10**6 + seed, "scenario": scenario, "difficulty": None if scenario else "medium"}
            observation = parse_observation((await _ws_call(ws, {"type": "reset", "data": data}))["data"])
            while not observation.done and not stop.is_set():
                action = agent.act(observation).model_dump(exclude_none=True)
                reply = await _ws_call(ws, {"type": "step", "data": action})
                if reply.get("type") != "observation":
                    abuse["busy errors"] += 1
                    break
                observation = parse_observation(reply["data"])
                abuse["busy steps"] += 1
            abuse["busy episodes"] += observation.done


def _client_frame(opcode: int, payload: bytes = b"", fin: bool = True) -> bytes:
    """One masked client WebSocket frame (payload under 126 bytes; `fin` False: more fragments follow)."""
    mask = os.urandom(4)
    head = bytes([(0x80 if fin else 0) | opcode, 0x80 | len(payload)])
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def _raw_websocket(host: str, port: int, source: str) -> Any:
    """(reader, writer) of a WebSocket on /ws whose handshake is made by hand, past the 101."""
    reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        f"GET /ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 101 "):
        writer.close()
        raise ConnectionError(head.split(b"\r\n")[0].decode(errors="replace"))
    return reader, writer


async def _ping_flood(host: str, port: int, source: str, stop: asyncio.Event, abuse: Counter) -> None:
    """Pings as fast as the socket takes them, never reading; a new connection when one closes."""
    burst = _client_frame(0x9) * 4096
    while not stop.is_set():
        try:
            _, writer = await _raw_websocket(host, port, source)
        except (OSError, ConnectionError, asyncio.IncompleteReadError):
            abuse["ping connections refused"] += 1
            await asyncio.sleep(0.1)
            continue
        abuse["ping connections opened"] += 1
        try:
            while not stop.is_set():
                writer.write(burst)
                await asyncio.wait_for(writer.drain(), 5.0)  # blocks while the server does not read
                abuse["pings sent"] += 4096
        except (OSError, asyncio.TimeoutError):
            abuse["ping connections closed or held"] += 1
        writer.close()


async def _xff_http_spam(host: str, port: int, source: str, stop: asyncio.Event, abuse: Counter, kind: str) -> None:
    """`POST /reset` (`xff-reset`) or `GET /metadata` (`xff-metadata`) on a kept-alive connection, as
    fast as answered, with another X-Forwarded-For on every request."""
    sent = 0
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            abuse["http connections failed"] += 1
            await asyncio.sleep(0.01)
            continue
        try:
            while not stop.is_set():
                sent += 1
                forwarded = f"10.{sent >> 16 & 255}.{sent >> 8 & 255}.{sent & 255}"
                if kind == "xff-metadata":
                    method, path, body = "GET", "/metadata", b""
                else:
                    method, path, body = "POST", "/reset", json.dumps({"seed": sent, "difficulty": "hard"}).encode()
                status = await _http_request(reader, writer, method, path, body, {"X-Forwarded-For": forwarded})
                abuse[f"xff {path} answered {status}"] += 1
        except (OSError, asyncio.IncompleteReadError, ValueError):
            abuse["http connections closed by the server"] += 1
        finally:
            writer.close()


async def _xff_session_spam(ws_url: str, source: str, stop: asyncio.Event, abuse: Counter) -> None:
    """Session churn (`create`) with another X-Forwarded-For on every handshake."""
    while not stop.is_set():
        forwarded = f"10.{abuse['xff sessions tried'] >> 8 & 255}.{abuse['xff sessions tried'] & 255}.7"
        abuse["xff sessions tried"] += 1
        try:
            async with connect(
                ws_url,
                local_addr=(source, 0),
                compression=None,
                open_timeout=30,
                additional_headers={"X-Forwarded-For": forwarded},
            ) as ws:
                reply = await _ws_call(ws, {"type": "reset", "data": {"seed": abuse["xff sessions created"]}})
                abuse["xff sessions created" if reply.get("type") == "observation" else "xff sessions refused"] += 1
        except Exception:
            abuse["xff session attempts failed"] += 1
            await asyncio.sleep(0.01)


async def _bad_utf8(host: str, port: int, source: str, stop: asyncio.Event, abuse: Counter) -> None:
    """A text frame that is not UTF-8 on a fresh WebSocket, again and again."""
    frame = _client_frame(0x1, b"\xff\xfe not UTF-8")
    while not stop.is_set():
        try:
            reader, writer = await _raw_websocket(host, port, source)
            writer.write(frame)
            await writer.drain()
            await asyncio.wait_for(reader.read(), 10.0)  # until the server closes
            abuse["bad UTF-8 frames sent"] += 1
            writer.close()
        except (OSError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            abuse["bad UTF-8 connections failed"] += 1
            await asyncio.sleep(0.01)


async def _fragments(host: str, port: int, source: str, stop: asyncio.Event, abuse: Counter) -> None:
    """A 1 MiB text message in 1-byte fragments on a fresh WebSocket, again and again (sent in
    64 KiB writes, until the server closes the connection)."""
    first = _client_frame(0x1, b"x", fin=False)
    middle = _client_frame(0x0, b"x", fin=False)
    while not stop.is_set():
        try:
            reader, writer = await _raw_websocket(host, port, source)
            abuse["fragmented messages begun"] += 1
            writer.write(first)
            for _ in range(2**20 // 8192):
                writer.write(middle * 8192)
                await asyncio.wait_for(writer.drain(), 10.0)
            abuse["fragmented messages sent whole"] += 1
            writer.close()
        except (OSError, ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            abuse["fragmented connections closed"] += 1
            await asyncio.sleep(0.01)


async def _chunked(host: str, port: int, source: str, stop: asyncio.Event, abuse: Counter) -> None:
    """POST /reset with a 60 KB body in 1-byte chunks on a fresh connection, again and again."""
    head = f"POST /reset HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
    body = b"".join(b"1\r\n \r\n" for _ in range(60_000)) + b"0\r\n\r\n"
    request = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + body
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
            writer.write(request)
            answer = await asyncio.wait_for(reader.read(64), 10.0)
            abuse[f"chunked requests answered {answer.split(b' ')[1].decode() if answer.count(b' ') else 'none'}"] += 1
            writer.close()
        except (OSError, asyncio.TimeoutError):
            abuse["chunked connections failed"] += 1
            await asyncio.sleep(0.01)


async def _bad_http(host: str, port: int, source: str, stop: asyncio.Event, abuse: Counter) -> None:
    """A request that is not HTTP on a fresh connection, again and again."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
            writer.write(b"GARBAGE \x00\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10.0)
            abuse[f"bad requests answered {answer.split(b' ')[1].decode() if answer.count(b' ') else 'none'}"] += 1
            writer.close()
        except (OSError, asyncio.TimeoutError):
            abuse["bad request connections failed"] += 1
            await asyncio.sleep(0.01)


async def _deep_spam(ws_url: str, source: str, stop: asyncio.Event, abuse: Counter) -> None:
    """Step messages whose parameters nest 900 deep, as fast as answered; a new session if one ends."""
    deep = '{"type": "step", "data": {"action_type": "scan_bump", "parameters": {"x": %s}}}' % ("[" * 900 + "]" * 900)
    while not stop.is_set():
        try:
            async with connect(ws_url, local_addr=(source, 0), compression=None, max_size=None) as ws:
                await _ws_call(ws, {"type": "reset", "data": {"seed": 1, "difficulty": "hard"}})
                while not stop.is_set():
                    await ws.send(deep)
                    reply = json.loads(await ws.recv())
                    abuse[f"deep messages answered {reply.get('data', {}).get('code', reply.get('type'))}"] += 1
        except Exception as error:  # a session that ended: what this attack once caused
            abuse[f"deep sessions ended: {type(error).__name__}"] += 1
            await asyncio.sleep(0.01)


async def _state_only(ws_url: str, source: str, stop: asyncio.Event, abuse: Counter) -> None:
    """Reset once, then only `state`, one a second: a slot held without work; again when closed."""
    while not stop.is_set():
        try:
            async with connect(ws_url, local_addr=(source, 0), compression=None, max_size=None) as ws:
                reply = await _ws_call(ws, {"type": "reset", "data": {"seed": 2, "difficulty": "hard"}})
                abuse["state-only sessions" if reply.get("type") == "observation" else "state-only refused"] += 1
                while not stop.is_set():
                    await _ws_call(ws, {"type": "state"})
                    abuse["state-only requests"] += 1
                    await asyncio.sleep(1.0)
        except Exception:
            abuse["state-only sessions closed by the server"] += 1
            await asyncio.sleep(0.1)


async def _abuse(url: str, abusers: Sequence[str], abuse: Counter, stop: asyncio.Event) -> None:
    """Run `abusers` (one loopback address each) until `stop` is set."""
    host, port = url.split("//")[1].split(":")
    ws_url = url.replace("http://", "ws://") + "/ws"
    tasks = []
    for index, kind in enumerate(abusers):
        # each from its own address; the X-Forwarded-For abusers from 127.0.0.1, which uvicorn
        # trusts to name the client by default (they share it with the honest clients)
        source = "127.0.0.1" if kind.startswith("xff-") else f"127.0.0.{2 + index}"
        if kind in ("scan", "scan-varied"):
            coroutine = _scan_spam(ws_url, source, stop, abuse, varied=kind == "scan-varied")
        elif kind in ("reset", "reset-claim"):
            coroutine = _reset_spam(ws_url, source, stop, abuse, claim=kind == "reset-claim")
        elif kind in ("garbage", "state"):
            coroutine = _garbage_spam(ws_url, source, stop, abuse, state=kind == "state")
        elif kind == "slow":
            coroutine = _slowloris(host, int(port), source, stop, abuse)
        elif kind == "flood":
            coroutine = _flood(host, int(port), source, stop, abuse)
        elif kind in ("http-reset", "http-misc", "http-schema"):
            coroutine = _http_spam(host, int(port), source, stop, abuse, kind)
        elif kind == "busy":
            coroutine = _busy(ws_url, source, stop, abuse)
        elif kind == "ping":
            coroutine = _ping_flood(host, int(port), source, stop, abuse)
        elif kind in ("xff-reset", "xff-metadata"):
            coroutine = _xff_http_spam(host, int(port), source, stop, abuse, kind)
        elif kind == "xff-create":
            coroutine = _xff_session_spam(ws_url, source, stop, abuse)
        elif kind == "bad-utf8":
            coroutine = _bad_utf8(host, int(port), source, stop, abuse)
        elif kind == "bad-http":
            coroutine = _bad_http(host, int(port), source, stop, abuse)
        elif kind == "fragments":
            coroutine = _fragments(host, int(port), source, stop, abuse)
        elif kind == "chunked":
            coroutine = _chunked(host, int(port), source, stop, abuse)
        elif kind == "deep":
            coroutine = _deep_spam(ws_url, source, stop, abuse)
        elif kind == "state-only":
            coroutine = _state_only(ws_url, source, stop, abuse)
        else:
            coroutine = _session_spam(ws_url, source, stop, abuse)
        tasks.append(asyncio.ensure_future(coroutine))
    await stop.wait()
    for task in tasks:
        task.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    for kind, outcome in zip(abusers, outcomes):
        if isinstance(outcome, Exception) and not isinstance(outcome, asyncio.CancelledError):
            abuse[f"{kind} abuser stopped: {type(outcome).__name__}: {outcome}"] += 1


async def run_load(
    url: str, honest: int, episodes_per_client: int, abusers: Sequence[str] = (), timeout_s: float = 600.0
) -> LoadResult:
    """`honest` clients play `episodes_per_client` episodes each while `abusers` (kinds from
    ABUSER_KINDS) run in a process of their own, so that their work does not delay the honest
    clients' event loop here; what the honest clients saw, and the abusers' counts."""
    unknown = set(abusers) - set(ABUSER_KINDS)
    if unknown:
        raise ValueError(f"unknown abuser kinds {sorted(unknown)}; choose from {ABUSER_KINDS}")
    result = LoadResult()
    process, counts_path = None, None
    if abusers:
        handle, counts_path = tempfile.mkstemp(prefix="cernenv-abuse-", suffix=".json")
        os.close(handle)  # the abusers' process writes its counts here when it stops
        process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), url, ",".join(abusers), counts_path], stdout=subprocess.PIPE
        )
        # it says "ready" once it handles SIGTERM (before, a SIGTERM would lose its counts)
        ready = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), 120)
        if ready.strip() != b"ready":
            raise RuntimeError(f"the abusers' process did not start (exit code {process.wait()})")
        await asyncio.sleep(3.0)  # the abuse is under way before the honest clients start
    start = time.perf_counter()
    try:
        await asyncio.wait_for(
            asyncio.gather(*(_honest(url, i, episodes_per_client, result) for i in range(honest))), timeout_s
        )
    finally:
        result.wall_s = time.perf_counter() - start
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
            process.stdout.close()
            with open(counts_path) as handle:
                result.abuse.update(json.load(handle))
            os.unlink(counts_path)
    return result


def _abuse_until_terminated(url: str, abusers: Sequence[str], counts_path: str) -> None:
    """The abusers' process: run them until SIGTERM, then write their counts to `counts_path`."""

    async def main() -> Counter:
        abuse, stop = Counter(), asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        print("ready", flush=True)
        start = time.monotonic()
        await _abuse(url, abusers, abuse, stop)
        abuse[ABUSE_MS] = int(1000 * (time.monotonic() - start))
        return abuse

    counts = asyncio.run(main())
    with open(counts_path, "w") as handle:
        json.dump(counts, handle)


if __name__ == "__main__":
    _abuse_until_terminated(sys.argv[1], sys.argv[2].split(","), sys.argv[3])
