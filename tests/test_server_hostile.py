"""Attacks on the server, as an outside attacker ran them against a local server, kept as tests.

Each test is one class of attack, run against a live server with small limits (bounded in size
and time; no assertion on wall-clock time; what each got before the rule that stops it, in
docs/studies/2026-11-26-attacks-tried-and-what-each-gets.md):
a WebSocket ping flood, X-Forwarded-For rotated to escape the per-address limits, JSON nested
hundreds deep, half-open requests from many addresses filling the connection cap, one address
holding every session, floods of invalid requests and frames in the log, foreign Origins,
ill-typed HTTP resets, MCP sessions. Then every documented way to launch the server gets the
same guard (and the undocumented ones refuse), and a property-based fuzz of actions and reset
arguments finds no input that ends a session.

The latency ratios these attacks cause beside honest clients are measured by
`make bench-server` (bench/bench_server.py `--attacks`), which fails on a regression.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shlex
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import psutil
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import (
    LOCAL,
    ROOT,
    WAIT_S,
    Server,
    call,
    error_of,
    free_port,
    raw_connection,
    read_until_closed,
    send_oversized_frame_head,
)
from uvicorn.server import ServerState
from websockets.exceptions import ConnectionClosed, InvalidStatus

from cernenv.server.guard import ConnectionGuard, guarded_protocols, guarded_server
from cernenv.server.ledger import read_ledger
from cernenv.server.pacing import FREE_MESSAGES_WITHOUT_WORK, MAX_CONTROL_FRAME_DEBT_S, WASTED_WORK_PAUSE_S
from cernenv.server.wire import MAX_JSON_DEPTH
from lib.agents.baselines import HeuristicAgent

pytestmark = pytest.mark.slow  # servers started in subprocesses and attacked (`make test-slow` runs them)

SESSIONS, SESSIONS_PER_CLIENT = 8, 2
CONNECTIONS, CONNECTIONS_PER_CLIENT = 64, 8
READ_TIMEOUT_S, IDLE_TIMEOUT_S = 2.0, 4.0
PROXY, ORIGIN = "127.0.0.50", "https://lab.example.org"
LIMITS = [
    "--max-sessions",
    str(SESSIONS),
    "--max-sessions-per-client",
    str(SESSIONS_PER_CLIENT),
    "--max-connections",
    str(CONNECTIONS),
    "--max-connections-per-client",
    str(CONNECTIONS_PER_CLIENT),
    "--request-read-timeout-s",
    str(READ_TIMEOUT_S),
    "--session-idle-timeout-s",
    str(IDLE_TIMEOUT_S),
    "--trusted-proxy",
    PROXY,
    "--allowed-origin",
    ORIGIN,
]


def make_serve_command() -> List[str]:
    """What `make serve` runs (its recipe, from `make -n`), as an argument list. Run from inside
    another make (`make test-slow`), make prints its "Entering/Leaving directory" lines too: the
    sub-make gets neither the outer make's flags nor that chatter, and the recipe line is the
    one that starts the server."""
    outer = {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"}
    dry_run = subprocess.run(
        ["make", "--no-print-directory", "-n", "serve", "SERVE_ARGS="],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={k: v for k, v in os.environ.items() if k not in outer},
    )
    lines = [line for line in dry_run.stdout.splitlines() if line.strip().endswith("-m cernenv.server")]
    assert len(lines) == 1, dry_run.stdout
    return ["env", *shlex.split(lines[0])]


@pytest.fixture(scope="module")
def hostile():
    """The server as `make serve` starts it (evaluation mode), with small limits to reach."""
    server = Server(*LIMITS, mode=None, command=make_serve_command())
    yield server
    server.stop()


def log_since(server: Server, offset: int) -> str:
    server.log.seek(offset)
    return server.log.read().decode(errors="replace")


def log_size(server: Server) -> int:
    server.log.seek(0, os.SEEK_END)
    return server.log.tell()


# WebSocket frames by hand -------------------------------------------------------------------


def client_frame(opcode: int, payload: bytes = b"") -> bytes:
    """One masked client frame (payload under 126 bytes)."""
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked


def masked_frame(opcode: int, payload: bytes, *, fin: bool = True) -> bytes:
    """One masked client frame of any opcode (continuation included) and length."""
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    length = len(payload)
    head = bytes([(0x80 if fin else 0) | opcode])
    if length < 126:
        head += bytes([0x80 | length])
    elif length < 2**16:
        head += bytes([0x80 | 126]) + struct.pack("!H", length)
    else:
        head += bytes([0x80 | 127]) + struct.pack("!Q", length)
    return head + mask + masked


PING = 0x9


def raw_websocket(server: Server, source: str, headers: str = "") -> socket.socket:
    """A WebSocket on /ws from `source`, its handshake made by hand; the socket, past the 101."""
    key = base64.b64encode(os.urandom(16)).decode()
    request = (
        f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{headers}\r\n"
    ).encode()
    sock = raw_connection(server, source, request)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        assert chunk, head
        head += chunk
    assert head.startswith(b"HTTP/1.1 101 "), head
    return sock


def close_code(data: bytes) -> Optional[int]:
    """The code of the close frame in what the server sent (server frames are not masked)."""
    index = 0
    while index + 2 <= len(data):
        opcode, length = data[index] & 0x0F, data[index + 1] & 0x7F
        start = index + 2
        if length == 126:
            length, start = struct.unpack("!H", data[start : start + 2])[0], start + 2
        elif length == 127:
            length, start = struct.unpack("!Q", data[start : start + 8])[0], start + 8
        if opcode == 0x8:
            return struct.unpack("!H", data[start : start + 2])[0] if length >= 2 else None
        index = start + length
    return None


# Pings and pongs --------------------------------------------------------------------------


class FakeTransport:
    """What the WebSocket protocol writes to, pauses and closes."""

    def __init__(self) -> None:
        self.reading, self.closing, self.written = True, False, bytearray()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("10.0.0.9", 40000) if name in ("peername", "sockname") else default

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closing = True

    def set_protocol(self, protocol: Any) -> None:
        pass


def test_pings_and_pongs_count_as_messages_without_work_and_are_paced():
    """Each ping or pong counts in the connection's `MessageBudget` like a `state` request: past
    `FREE_MESSAGES_WITHOUT_WORK` in a row, each earns `WASTED_WORK_PAUSE_S` without reading, more
    than `MAX_CONTROL_FRAME_DEBT_S` of it in one read closes the connection (1008), and while the
    client does not read what the server writes, the server reads nothing from it."""
    guard = ConnectionGuard(10, 10, 5.0)
    _, protocol_class = guarded_protocols(guard)

    async def app(scope: Dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.accept"})
        while (await receive())["type"] != "websocket.disconnect":
            pass

    async def main() -> Tuple[Any, FakeTransport, List[bool]]:
        config = uvicorn.Config(app, ws_ping_interval=None)
        config.load()
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        transport = FakeTransport()
        protocol.connection_made(transport)
        key = base64.b64encode(b"0123456789abcdef").decode()
        protocol.data_received(
            f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        await asyncio.sleep(0.01)  # the app accepts
        reading = []
        for _ in range(FREE_MESSAGES_WITHOUT_WORK + 1):
            protocol.data_received(client_frame(PING))
            reading.append(transport.reading)
        pace = protocol._pacing
        assert pace is not None and protocol._debt_s == pytest.approx(WASTED_WORK_PAUSE_S)
        pace.cancel()
        protocol._end_pace()
        assert transport.reading
        protocol.pause_writing()  # the client stopped reading: so does the server
        assert not transport.reading
        protocol.resume_writing()
        assert transport.reading
        frames = int(MAX_CONTROL_FRAME_DEBT_S / WASTED_WORK_PAUSE_S) + 2
        protocol.data_received(client_frame(PING) * frames)  # a flood in one read
        return protocol, transport, reading

    protocol, transport, reading = asyncio.run(main())
    assert reading == [True] * FREE_MESSAGES_WITHOUT_WORK + [False]  # the 11th ping in a row waits
    frames_written = bytes(transport.written).split(b"\r\n\r\n", 1)[1]  # past the handshake's answer
    assert transport.closing and close_code(frames_written) == 1008
    assert guard.refused["WebSocket connections closed for a flood of pings or pongs (1008)"] >= 1


def test_the_closing_handshake_completes_under_the_guard():
    """The guard parses what a WebSocket reads a slice at a time: the client's answer to the
    server's close frame is still read (else the connection waits out uvicorn's close timeout)."""
    guard = ConnectionGuard(10, 10, 5.0)
    _, protocol_class = guarded_protocols(guard)

    async def app(scope: Dict[str, Any], receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1000})

    async def main() -> FakeTransport:
        config = uvicorn.Config(app, ws_ping_interval=None)
        config.load()
        protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
        transport = FakeTransport()
        protocol.connection_made(transport)
        key = base64.b64encode(b"0123456789abcdef").decode()
        protocol.data_received(
            f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        await asyncio.sleep(0.01)  # the app accepts and closes
        assert protocol.close_sent and not transport.closing
        protocol.data_received(client_frame(0x8, struct.pack("!H", 1000)))  # the client's answer
        return transport

    assert asyncio.run(main()).closing


def test_a_ping_flood_costs_the_server_no_memory_and_honest_clients_play_on(hostile):
    """4 connections sending pings as fast as they can, never reading: each is closed (1008) or
    held by TCP's flow control once the server stops reading it; the server's memory stays put;
    an honest client plays a whole episode meanwhile."""
    server = hostile
    process = psutil.Process(server.process.pid)
    rss_before = process.memory_info().rss
    outcomes: List[Tuple[int, Optional[int]]] = []  # (bytes sent, close code seen)
    stop = threading.Event()

    def flood(source: str) -> None:
        sock = raw_websocket(server, source)
        sock.setblocking(False)
        burst, sent, blocked_since = client_frame(PING) * 4096, 0, None
        while not stop.is_set() and sent < 256 * 2**20:
            try:
                sent += sock.send(burst)
                blocked_since = None
            except BlockingIOError:  # the server does not read: flow control holds the sender
                blocked_since = blocked_since or time.monotonic()
                if time.monotonic() - blocked_since > 2.0:
                    break
                time.sleep(0.01)
            except OSError:  # closed by the server
                break
        sock.settimeout(5.0)
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
                if close_code(received) is not None:
                    break
        except OSError:
            pass
        sock.close()
        outcomes.append((sent, close_code(received)))

    threads = [threading.Thread(target=flood, args=(f"127.0.1.{i}",)) for i in range(1, 5)]
    for thread in threads:
        thread.start()
    try:
        with server.client() as client:
            agent, result = HeuristicAgent(), client.reset(seed=902_050, difficulty="medium")
            while not result.done:
                result = client.step(agent.act(result.observation))
        rss_peak = process.memory_info().rss
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert len(outcomes) == 4 and all(code in (1008, None) for _, code in outcomes), outcomes
    assert (rss_peak - rss_before) / 2**20 < 40, (rss_before, rss_peak)
    assert server.http("GET", "/health")[0] == 200


# Addresses --------------------------------------------------------------------------------


def test_x_forwarded_for_names_the_client_only_behind_a_trusted_proxy(hostile):
    """X-Forwarded-For names the client only when it comes from a `--trusted-proxy` address: from
    anyone else (uvicorn would trust 127.0.0.1 by default) every limit, here the per-address
    session cap, keys on the connection's peer, whatever the header says."""
    server = hostile

    def refusal(source: str, forwarded: str) -> Tuple[str, str]:
        with server.ws(source=source, additional_headers={"X-Forwarded-For": forwarded}) as over:
            return error_of(json.loads(over.recv(timeout=WAIT_S)))

    with contextlib.ExitStack() as stack:
        for i in range(SESSIONS_PER_CLIENT):
            ws = stack.enter_context(
                server.ws(source="127.0.2.1", additional_headers={"X-Forwarded-For": f"10.9.9.{i}"})
            )
            assert call(ws, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"
        code, message = refusal("127.0.2.1", "10.9.9.9")
        assert code == "CAPACITY_REACHED" and "127.0.2.1 holds its limit of 2 sessions" in message
    with contextlib.ExitStack() as stack:
        for forwarded in ("10.8.8.0", "10.8.8.0", "10.8.8.1"):  # each forwarded client within its share
            ws = stack.enter_context(server.ws(source=PROXY, additional_headers={"X-Forwarded-For": forwarded}))
            assert call(ws, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"
        code, message = refusal(PROXY, "10.8.8.0")
        assert code == "CAPACITY_REACHED" and "10.8.8.0 holds its limit" in message
    assert server.wait_open_environments(0) == 0


def test_the_launcher_trusts_proxy_headers_from_the_named_proxies_only(monkeypatch):
    import cernenv.server.guard

    monkeypatch.setattr(cernenv.server.guard, "_serving", {})  # this process serves nothing after the test
    app = object()
    plain = guarded_server(app, ConnectionGuard(10, 5, 5.0), "127.0.0.1", 0, 2**20)
    assert plain.config.proxy_headers is False
    assert (plain.config.ws_per_message_deflate, plain.config.ws_max_size) == (False, 2**20)
    proxied = guarded_server(app, ConnectionGuard(10, 5, 5.0, trusted_proxies=["10.0.0.1"]), "127.0.0.1", 0, 2**20)
    assert proxied.config.proxy_headers is True and proxied.config.forwarded_allow_ips == ["10.0.0.1"]


def test_half_open_requests_from_many_addresses_cannot_lock_honest_clients_out(hostile):
    """Half-open requests from 8 addresses, each holding its share, fill the connection cap; a
    newcomer then takes the place of a waiting connection of the address that holds the most:
    34 honest clients of 34 are served."""
    server = hostile
    unfinished = b"POST /reset HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{"
    held = [
        raw_connection(server, f"127.0.3.{a}", unfinished) for a in range(1, 9) for _ in range(CONNECTIONS_PER_CLIENT)
    ]
    try:
        time.sleep(0.3)  # the server has them all: it is full
        assert b" 503 " in read_until_closed(raw_connection(server, "127.0.3.1", unfinished))  # its own share is full
        served = 0
        for honest in range(1, 35):
            request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            served += b" 200 " in read_until_closed(raw_connection(server, f"127.0.4.{honest}", request))
        assert served == 34
    finally:
        for sock in held:
            sock.close()


def test_one_address_cannot_hold_every_session(hostile):
    """An address holds at most its share of the sessions (`--max-sessions-per-client`), WebSocket
    and MCP together; the other slots serve other addresses."""
    server = hostile
    with contextlib.ExitStack() as stack:
        for _ in range(SESSIONS_PER_CLIENT):
            ws = stack.enter_context(server.ws(source="127.0.5.1"))
            assert call(ws, {"type": "reset", "data": {"seed": 2}})["type"] == "observation"
        refused = server.mcp("openenv/session/create", source="127.0.5.1")
        assert "127.0.5.1 holds its limit of 2 sessions" in refused["error"]["message"]
        with server.ws(source="127.0.5.1") as over:
            code, message = error_of(json.loads(over.recv(timeout=WAIT_S)))
            assert code == "CAPACITY_REACHED" and "127.0.5.1 holds its limit" in message
        for i in range(SESSIONS - SESSIONS_PER_CLIENT):  # every other slot serves other addresses
            ws = stack.enter_context(server.ws(source=f"127.0.5.{2 + i}"))
            assert call(ws, {"type": "reset", "data": {"seed": 3}})["type"] == "observation"
    assert server.wait_open_environments(0) == 0


def test_mcp_sessions_are_counted_and_reaped_by_the_same_clock(hostile):
    """MCP sessions fill the same slots as WebSocket ones (`/sessions`), and one that does no
    work is reaped after --session-idle-timeout-s however often it asks for its tool list."""
    server = hostile
    session = server.mcp("openenv/session/create", source="127.0.6.1")["result"]["session_id"]
    assert server.open_environments() == 1
    deadline = time.monotonic() + WAIT_S
    while server.open_environments() and time.monotonic() < deadline:
        assert server.mcp("tools/list", {"session_id": session}, source="127.0.6.1")  # not work
        time.sleep(0.5)
    assert server.open_environments() == 0
    gone = server.mcp("tools/list", {"session_id": session}, source="127.0.6.1")
    assert gone["error"]["message"].startswith("Unknown session_id")


# What clients send ------------------------------------------------------------------------


def nested(depth: int, inner: Any = 1) -> str:
    return "[" * depth + json.dumps(inner) + "]" * depth


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH - 4, 400, 900, 20_000])
def test_json_nested_deep_anywhere_gets_an_error_and_the_session_goes_on(hostile, depth):
    """JSON nested deep in an action's parameters or justification, or in reset data: nesting is
    measured on the text, before anything parses it; past MAX_JSON_DEPTH the message gets
    INVALID_JSON (HTTP 400) and the session goes on; within it the value is judged as any other
    (a rule violation, a refused reset argument)."""
    server = hostile
    deep, too_deep = nested(depth), depth > MAX_JSON_DEPTH - 4
    with server.ws(source="127.0.7.1") as ws:
        assert call(ws, {"type": "reset", "data": {"seed": 4}})["type"] == "observation"
        for text in (
            '{"type": "step", "data": {"action_type": "scan_bump", "parameters": {"x": %s}}}' % deep,
            '{"type": "step", "data": {"action_type": "scan_bump", "justification": %s}}' % deep,
            '{"type": "reset", "data": {"seed": 1, "episode_id": %s}}' % deep,
        ):
            reply = call(ws, text)
            if too_deep:
                code, message = error_of(reply)
                assert code == "INVALID_JSON" and "nested" in message
            else:
                assert reply["type"] == "observation" or error_of(reply)[0] == "EXECUTION_ERROR", reply
            assert call(ws, {"type": "state"})["type"] == "state"
        assert call(ws, {"type": "reset", "data": {"seed": 5}})["type"] == "observation"
    status, reply = server.http(
        "POST", "/reset", data=('{"seed": 1, "episode_id": %s}' % deep).encode(), source="127.0.7.2"
    )
    assert status == 400 and ("nested" if too_deep else "episode_id") in reply["detail"]
    rpc = '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "act", "arguments": %s}}' % deep
    status, reply = server.http("POST", "/mcp", data=rpc.encode(), source="127.0.7.2")
    assert (status, "nested" in json.dumps(reply)) == ((400, True) if too_deep else (200, False)), reply
    assert server.http("GET", "/health")[0] == 200


@pytest.mark.parametrize("seed", ["7", True, -0.0, 7.0, 1e3, [7], {"a": 1}, 2**63, -1])
def test_http_reset_takes_only_what_the_websocket_takes(hostile, seed):
    """One rule (`cernenv.server.wire.reset_problem`) judges reset arguments as the JSON sent, on
    every transport: pydantic's lax coercion ("7", true, -0.0 to seeds) never sees them; the same
    refusal over HTTP (400), the WebSocket and MCP."""
    server = hostile
    status, reply = server.http("POST", "/reset", {"seed": seed, "difficulty": "easy"}, source="127.0.8.1")
    assert status == 400 and "seed must be a non-negative integer" in reply["detail"]
    with server.ws(source="127.0.8.2") as ws:
        code, message = error_of(call(ws, {"type": "reset", "data": {"seed": seed}}))
        assert code == "EXECUTION_ERROR" and message == reply["detail"]
    session = server.mcp("openenv/session/create", source="127.0.8.3")["result"]["session_id"]
    answer = server.mcp(
        "tools/call", {"session_id": session, "name": "new_campaign", "arguments": {"seed": seed}}, "127.0.8.3"
    )
    assert answer["error"]["message"] == reply["detail"]
    server.mcp("openenv/session/close", {"session_id": session}, source="127.0.8.3")


def test_browser_pages_of_other_origins_are_refused(hostile):
    """A request that carries an `Origin` (a browser page's) is served only from the server's own
    origin and the `--allowed-origin` ones; programs send none."""
    server = hostile
    with pytest.raises(InvalidStatus) as refused:
        server.ws(source="127.0.9.1", origin="https://evil.example").close()
    assert refused.value.response.status_code == 403
    status, _ = server.http("POST", "/reset", {"seed": 1}, headers={"Origin": "https://evil.example"})
    assert status == 403
    for origin in (ORIGIN, f"http://127.0.0.1:{server.port}"):
        with server.ws(source="127.0.9.1", origin=origin) as ws:
            assert call(ws, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"
    with server.ws(source="127.0.9.1") as ws:  # a program: no Origin
        assert call(ws, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"


def test_hostile_requests_and_frames_cost_a_line_of_counts_not_a_line_each(hostile):
    """Requests that are not HTTP and text frames that are not UTF-8 are counted, and the counts
    logged at most once every 10 s with the refusals': no line (or traceback) per event."""
    server = hostile
    offset = log_size(server)
    for index in range(200):
        answer = read_until_closed(raw_connection(server, f"127.0.10.{1 + index % 50}", b"GARBAGE \x00\r\n\r\n"))
        assert answer.startswith(b"HTTP/1.1 400 ")
    for index in range(60):
        # each closed connection's session is released after its close frame: on a loaded machine
        # the next ones could find the server at capacity, which this test is not about
        assert server.wait_open_environments(0) == 0
        sock = raw_websocket(server, f"127.0.11.{1 + index % 50}")
        sock.sendall(client_frame(0x1, b"\xff\xfe not UTF-8"))
        assert close_code(read_until_closed(sock)) == 1007
    logged = log_since(server, offset)
    assert "Traceback" not in logged and "Invalid HTTP request received" not in logged, logged[-2000:]
    assert len(logged.splitlines()) <= 4, logged


# Every launch gets the guard ------------------------------------------------------------------


def guard_is_there(server: Server, per_client: int, read_timeout_s: float) -> None:
    """What the guard does that plain uvicorn does not, checked from outside: no per-message
    compression, a frame over the limit closes the connection (1009), an address over its
    connection share gets 503, a request not whole in time 408, X-Forwarded-For ignored, a ping
    flood closed (1008), evaluation mode with its secret's fingerprint."""
    with server.ws(source="127.0.13.1", compression="deflate") as ws:
        assert "Sec-WebSocket-Extensions" not in ws.response.headers
        with pytest.raises(ConnectionClosed) as closed:
            send_oversized_frame_head(ws)
            ws.recv(timeout=WAIT_S)
        assert closed.value.rcvd.code == 1009
    held = [raw_connection(server, "127.0.13.2", b"GET /health HTTP/1.1\r\n") for _ in range(per_client)]
    try:
        time.sleep(0.2)
        assert b" 503 " in read_until_closed(raw_connection(server, "127.0.13.2"))
        assert all(b" 408 " in read_until_closed(sock) for sock in held)  # after read_timeout_s
    finally:
        for sock in held:
            sock.close()
    sock = raw_websocket(server, "127.0.13.3", headers="X-Forwarded-For: 10.7.7.7\r\n")
    sock.sendall(client_frame(PING) * 200)
    assert close_code(read_until_closed(sock)) == 1008
    status, described = server.http("GET", "/evaluation")
    assert status == 200 and described["mode"] == "evaluation" and len(described["secret_fingerprint"]) == 16


def test_make_serve_and_the_module_launch_run_under_the_guard(hostile):
    guard_is_there(hostile, CONNECTIONS_PER_CLIENT, READ_TIMEOUT_S)


def test_the_container_command_runs_under_the_guard():
    """The image's command (cernenv/Dockerfile's CMD, as OpenEnv's providers read it), run here
    on a loopback port (a Docker engine builds and runs the image itself in test_server.py)."""
    from openenv.core.containers.runtime._server_config import parse_dockerfile_cmd

    command = shlex.split(parse_dockerfile_cmd((ROOT / "cernenv" / "Dockerfile").read_text()))
    assert command[:3] == ["python", "-m", "cernenv.server"]
    server = Server(
        "--host",
        "127.0.0.1",
        "--max-connections-per-client",
        "4",
        "--request-read-timeout-s",
        "1",
        mode=None,
        command=[sys.executable, *command[1:]],
    )
    try:
        guard_is_there(server, 4, 1.0)
    finally:
        server.stop()


@pytest.mark.parametrize(
    "launch",
    [
        ["-m", "uvicorn", "cernenv.server.app:app"],
        ["-m", "uvicorn", "--factory", "cernenv.server.app:create_cernenv_app"],
    ],
    ids=["app", "factory"],
)
def test_plain_uvicorn_refuses_to_serve_the_app(launch, tmp_path):
    """`uvicorn cernenv.server.app:app` (and `--factory create_cernenv_app`) would serve the app
    without the guard: the app refuses to start anywhere but under `python -m cernenv.server`
    (`RequireGuard`), and says how to start it."""
    command = [sys.executable, *launch, "--port", str(free_port())]
    environment = {**os.environ, "CERNENV_STATE_DIR": str(tmp_path)}
    started = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120)
    assert started.returncode != 0 and "python -m cernenv.server" in started.stderr, started.stderr[-2000:]
    assert "Application startup failed" in started.stderr


def test_with_its_start_up_skipped_the_app_refuses_every_request():
    """`uvicorn --lifespan off` skips the start-up that fails: every request is refused then
    (HTTP 503 saying how to start the server, the WebSocket handshake 403)."""
    from starlette.testclient import TestClient

    from cernenv.server.app import app, create_cernenv_app
    from cernenv.server.guard import serving_guard

    assert serving_guard() is None
    for unguarded in (app, create_cernenv_app()):
        http = TestClient(unguarded, base_url=LOCAL)  # no `with`: no start-up
        for method, path in (("GET", "/health"), ("POST", "/reset"), ("GET", "/evaluation")):
            answer = http.request(method, path)
            assert answer.status_code == 503 and "python -m cernenv.server" in answer.json()["detail"]
        with pytest.raises(Exception):
            with http.websocket_connect("/ws") as ws:
                ws.receive_json()


# Fuzz ---------------------------------------------------------------------------------------

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)  # lone surrogates included
)
JSON_VALUES = st.recursive(
    JSON_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
)
ACTION_KEYS = st.sampled_from(["action_type", "parameters", "justification", "metadata", "x"]) | st.text(max_size=8)
VERBS = st.sampled_from(["configure_beam", "collect_collisions", "scan_bump", "submit_discovery_claim", "warp"])
ACTIONS = (
    st.fixed_dictionaries(
        {"action_type": VERBS | JSON_VALUES},
        optional={"parameters": st.dictionaries(st.text(max_size=20), JSON_VALUES, max_size=5) | JSON_VALUES},
    )
    | st.dictionaries(ACTION_KEYS, JSON_VALUES, max_size=4)
    | JSON_VALUES
)
RESET_KEYS = st.sampled_from(["seed", "scenario", "difficulty", "episode_id", "secret_salt"]) | st.text(max_size=8)
RESETS = st.dictionaries(RESET_KEYS, JSON_VALUES | st.integers(0, 2**64) | st.sampled_from(["easy", "z_mumu_91"]))


class RawJSON(str):
    """JSON text sent as it is (not encoded again)."""


DEEP = st.integers(min_value=0, max_value=1500).map(lambda depth: RawJSON(nested(depth)))


def _text(value: Any) -> str:
    return value if isinstance(value, RawJSON) else json.dumps(value)


@pytest.fixture(scope="module")
def fuzzed_session(hostile):
    with hostile.ws(source="127.0.14.1") as ws:
        yield ws


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["step", "reset"]), action=ACTIONS | DEEP, arguments=RESETS | DEEP)
def test_no_action_or_reset_argument_ends_a_session(fuzzed_session, kind, action, arguments):
    """Any JSON (or nesting of any depth) as an action or as reset arguments gets an observation
    or an error frame, and the session goes on: `state` answers, and a valid reset plays."""
    ws = fuzzed_session
    data = _text(action if kind == "step" else arguments)
    reply = call(ws, '{"type": "%s", "data": %s}' % (kind, data))
    assert reply["type"] in ("observation", "error"), reply
    if reply["type"] == "error":
        assert reply["data"]["code"] in ("INVALID_JSON", "VALIDATION_ERROR", "EXECUTION_ERROR"), reply
    assert call(ws, {"type": "state"})["type"] == "state"
    assert call(ws, {"type": "reset", "data": {"seed": 6, "difficulty": "easy"}})["type"] == "observation"


SOURCES = iter(range(10**9))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arguments=RESETS | DEEP, action=ACTIONS | DEEP)
def test_no_http_or_mcp_body_gets_a_500(hostile, arguments, action):
    """The same inputs as HTTP `POST /reset` bodies and MCP tool arguments: a 2xx or 4xx answer in
    valid JSON, never a 500 (each from its own address: HTTP is paced per address)."""
    source = f"127.0.15.{1 + next(SOURCES) % 200}"
    status, reply = hostile.http("POST", "/reset", data=_text(arguments).encode(), source=source)
    assert status in (200, 400, 422) and isinstance(reply, dict), (status, reply)
    rpc = '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "act", "arguments": %s}}'
    status, reply = hostile.http("POST", "/mcp", data=(rpc % _text(action)).encode(), source=source)
    assert status in (200, 400) and isinstance(reply, dict), (status, reply)


def test_the_attacked_server_is_whole(hostile):
    """After every attack of this module: healthy, no traceback in its log, no environment left open."""
    assert hostile.http("GET", "/health")[0] == 200
    assert "Traceback" not in log_since(hostile, 0)
    assert hostile.wait_open_environments(0) == 0
    assert all(record.mode == "evaluation" for record in read_ledger(hostile.ledger))


def test_a_request_naming_a_foreign_host_is_refused_as_dns_rebinding_would_send_it(hostile):
    """A page that rebinds its own name to 127.0.0.1 sends `Host` and `Origin` of that name: over
    HTTP (a reset, the session list, MCP) and the WebSocket handshake it gets nothing; the same
    requests naming the loopback host are served."""
    server = hostile
    foreign = {"Host": f"evil.example:{server.port}", "Origin": f"http://evil.example:{server.port}"}
    for method, path, body in (("POST", "/reset", {}), ("GET", "/sessions", None), ("POST", "/mcp", {})):
        status, answer = server.http(method, path, body, headers=foreign, source="127.0.14.1")
        assert status == 400 and "Invalid host header" in str(answer), (path, status, answer)
    with pytest.raises(InvalidStatus) as refused:
        with server.ws(source="127.0.14.2", additional_headers={"Host": foreign["Host"]}, origin=foreign["Origin"]):
            pass
    assert refused.value.response.status_code == 400
    assert server.http("GET", "/sessions", headers={"Host": f"localhost:{server.port}"})[0] == 200
    with server.ws(source="127.0.14.3") as ws:
        assert call(ws, {"type": "reset", "data": {"seed": 1}})["type"] == "observation"


def test_the_host_names_a_server_answers(monkeypatch):
    from cernenv.server import ServerConfig

    assert set(ServerConfig().hosts) == {"127.0.0.1", "localhost", "::1", "[::1]"}
    assert "lab.example.org" in ServerConfig(allowed_hosts="lab.example.org").hosts
    assert ServerConfig(allowed_hosts="a.example, *").hosts == ("*",)
    assert socket.gethostname().lower() in ServerConfig(host="0.0.0.0").hosts
    monkeypatch.setenv("SPACE_HOST", "someone-cernenv.hf.space")  # what a Hugging Face Space sets
    assert "someone-cernenv.hf.space" in ServerConfig(host="0.0.0.0").hosts


def test_fragmented_messages_and_chunked_bodies_are_refused_before_they_cost_more_than_their_bytes(hostile):
    """A WebSocket message in more than `MAX_FRAGMENTS` frames closes the connection (1009) after
    at most that many; one in 16 is read as a whole message. A request with a chunked body is
    refused (411) from its head, before any chunk is parsed; the same body with its
    Content-Length is served."""
    from cernenv.server.guard import GuardedWebSocketProtocol

    server = hostile
    message = json.dumps({"type": "reset", "data": {"seed": 3}}).encode()
    limit = GuardedWebSocketProtocol.MAX_FRAGMENTS

    def fragmented(count: int) -> bytes:
        bounds = [len(message) * i // count for i in range(count + 1)]
        parts = [message[a:b] for a, b in zip(bounds, bounds[1:])]
        assert len(parts) == count and all(parts)
        return b"".join(
            masked_frame((0x1 if i == 0 else 0x0), part, fin=i == len(parts) - 1) for i, part in enumerate(parts)
        )

    sock = raw_websocket(server, "127.0.15.1")
    sock.sendall(fragmented(limit))
    sock.settimeout(WAIT_S)
    assert b"observation" in sock.recv(65536)
    sock.sendall(fragmented(limit + 4))
    assert close_code(read_until_closed(sock)) == 1009
    body = b'{"seed": 3}'
    chunked = b"".join(b"1\r\n" + bytes([byte]) + b"\r\n" for byte in body) + b"0\r\n\r\n"
    head = f"POST /reset HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
    answer = read_until_closed(
        raw_connection(server, "127.0.15.2", (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + chunked)
    )
    assert answer.startswith(b"HTTP/1.1 411 ") and b"Content-Length" in answer
    plain = (head + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    assert read_until_closed(raw_connection(server, "127.0.15.3", plain)).startswith(b"HTTP/1.1 200 ")


def test_a_client_sending_garbage_slows_its_address_without_locking_out_its_neighbour(hostile):
    """Two clients on one address (127.0.16.1): one sends a TLS ClientHello to the plain port
    twice a second on fresh connections, the other asks /health ten times a second. The
    neighbour keeps at least 90% of its requests (it kept 50% when the address was refused)."""
    server = hostile
    client_hello = bytes.fromhex("16030100a5010000a10303") + os.urandom(32) + b"\x00" * 40
    stop = threading.Event()

    def garbage() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError):
                read_until_closed(raw_connection(server, "127.0.16.1", client_hello))
            stop.wait(0.5)

    sender = threading.Thread(target=garbage)
    sender.start()
    served = asked = 0
    try:
        time.sleep(5.0)  # past the address's free offences
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:
            asked += 1
            request = f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nConnection: close\r\n\r\n"
            with contextlib.suppress(OSError):
                served += read_until_closed(raw_connection(server, "127.0.16.1", request.encode())).startswith(
                    b"HTTP/1.1 200 "
                )
            time.sleep(0.1)
    finally:
        stop.set()
        sender.join()
    assert served >= 0.9 * asked, f"{served} of {asked}"
