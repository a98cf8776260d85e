"""The listener, connection limits and protocol settings every launch of the server runs under.

What the ASGI app cannot see: connections that never finish a request, WebSocket control
frames, what a connection sends that is not HTTP or WebSocket, the peer a connection really
comes from. (The attacks each rule answers, with their figures:
docs/studies/2026-11-26-attacks-tried-and-what-each-gets.md.)

`ConnectionGuard` bounds the open connections, in all and per client address, and gives each
request `request_read_timeout_s` to arrive whole (headers and body), from the connection's
opening or from the end of the previous response. When the server holds its limit, a new
connection from an address that holds fewer than another takes the place of one of that
other's connections that is not being served (waiting for a request, or half sent): the
address that holds the most connections loses one, so no group of addresses can lock the
others out by filling the server with unfinished requests. Otherwise a connection over a limit
gets a 503 and is closed before anything is read; a late request gets a 408 and is closed.

`GuardedWebSocketProtocol` counts its connection while it is open, counts each ping and pong
its client sends as a message that does no work (paced with the others by `MessageBudget`,
the connection closed past `MAX_CONTROL_FRAME_DEBT_S` of pauses in one read), and stops
reading while its client does not read what the server writes (the unread pongs and answers
stay in the client's kernel buffers, not in the server).

`GuardedListener` refuses a connection over a limit as it accepts it, before asyncio builds a
transport, a task and a protocol for it, and sets TCP_NODELAY on those it hands over.

`guarded_server(app, config, guard)` is the one `uvicorn.Server` that serves the app, with
these protocols, this listener, the frame limit, no per-message compression, and proxy
headers trusted only from the configured proxies; `python -m cernenv.server` (the module,
`make serve`, the container) runs it, and the app refuses to serve under anything else.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections import Counter
from typing import Any, Dict, Iterable, Optional, Tuple

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_remote_addr
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from cernenv.server.pacing import (
    MAX_CONTROL_FRAME_DEBT_S,
    OFFENCE_BURST,
    OFFENCE_DELAY_MAX_S,
    OFFENCES_PER_S,
    WASTED_WORK_PAUSE_S,
    AddressPacer,
    EventLog,
    HostileEventFilter,
    MessageBudget,
    events,
)

logger = logging.getLogger("cernenv.server")

BUDGET_EXTENSION = "cernenv.message_budget"
"""The key, in a WebSocket scope's `extensions`, of its connection's `MessageBudget`."""

_serving: Dict[str, Any] = {}


def serving_guard() -> Optional["ConnectionGuard"]:
    """The guard of the `guarded_server` this process runs (None: none, e.g. plain uvicorn)."""
    return _serving.get("guard")


class ConnectionGuard:
    """Counts of open connections (all, per client address) against their limits; the
    connections that may give their place to a newcomer; the addresses whose connections broke
    the protocol (`offence`), whose new connections are read only after their debt
    (`offence_delay_s`: `OFFENCE_BURST`, `OFFENCES_PER_S`); refusals, counted in `events`.
    Addresses in `trusted_proxies` carry many clients' connections: only the overall limit
    applies to them."""

    def __init__(
        self,
        max_connections: int,
        max_connections_per_client: int,
        request_read_timeout_s: float,
        trusted_proxies: Iterable[str] = (),
        log: Optional[EventLog] = None,
    ) -> None:
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        self.request_read_timeout_s = request_read_timeout_s
        self.trusted_proxies = frozenset(trusted_proxies)
        self.events = log if log is not None else events
        self.open = 0
        self.per_client: Counter = Counter()
        self.offences = AddressPacer(OFFENCE_BURST, OFFENCES_PER_S)
        self._waiting: Dict[str, Dict[Any, None]] = {}  # client -> its connections not being served, oldest first
        self._lock = threading.Lock()

    @property
    def refused(self) -> Counter:
        return self.events.counts

    def admit(self, client: str) -> Optional[str]:
        """Count a new connection from `client` (making room if the server is full and another
        address holds more); or, over a limit, the reason it is refused."""
        with self._lock:
            reason, victim = self._check(client)
            if reason is None:
                self.open += 1
                self.per_client[client] += 1
        if victim is not None:
            self.events.note("connections closed to make room for another address's")
            victim.evict()
        if reason is not None:
            self.events.note("connections refused over a limit")
        return reason

    def refusal(self, client: str) -> Optional[str]:
        """Why a new connection from `client` would be refused now (None: it would be admitted)."""
        with self._lock:
            return self._check(client, look_only=True)[0]

    def offence(self, client: str) -> None:
        """A connection from `client` broke the protocol (and is closed)."""
        if client not in self.trusted_proxies:
            with self._lock:
                self.offences.charge(client)

    def offence_delay_s(self, client: str) -> float:
        """How long a new connection from `client` waits before it is read: its address's debt of
        offences (`OFFENCE_BURST`, `OFFENCES_PER_S`), at most `OFFENCE_DELAY_MAX_S`. The address
        is slowed, not refused: an honest client that shares it (a NAT, a notebook beside a
        misconfigured script) is still served, a moment later, while the offender's reconnects
        cost it the wait each time."""
        if client in self.trusted_proxies:
            return 0.0
        with self._lock:
            return min(self.offences.wait_s(client), OFFENCE_DELAY_MAX_S)

    def _check(self, client: str, look_only: bool = False) -> Tuple[Optional[str], Any]:
        if client not in self.trusted_proxies and self.per_client[client] >= self.max_connections_per_client:
            return f"{client} holds its limit of {self.max_connections_per_client} connections", None
        if self.open < self.max_connections:
            return None, None
        victim = self._victim_for(client)
        if victim is None:
            return f"the server holds its limit of {self.max_connections} connections", None
        if not look_only:  # its place is taken now; `evict` closes it
            self._forget_waiting(victim.guard_client, victim)
            self.open -= 1
            self.per_client[victim.guard_client] -= 1
            victim.guard_counted = False
        return None, victim

    def _victim_for(self, client: str) -> Any:
        """The oldest connection not being served of the address that holds the most connections,
        if that address holds at least two more than `client`."""
        candidates = [(self.per_client[c], c) for c, waiting in self._waiting.items() if waiting and c != client]
        if not candidates:
            return None
        held, heaviest = max(candidates)
        if held < self.per_client[client] + 2:
            return None
        return next(iter(self._waiting[heaviest]))

    def count(self, client: str) -> None:
        """Count a connection from `client` whatever the limits (an upgrade of one already admitted)."""
        with self._lock:
            self.open += 1
            self.per_client[client] += 1

    def release(self, client: str) -> None:
        with self._lock:
            self.open -= 1
            self.per_client[client] -= 1
            if self.per_client[client] <= 0:
                del self.per_client[client]

    def waiting(self, client: str, connection: Any, is_waiting: bool) -> None:
        """Mark `connection` as one that may give its place (it is not being served) or not."""
        with self._lock:
            if is_waiting:
                self._waiting.setdefault(client, {})[connection] = None
            else:
                self._forget_waiting(client, connection)

    def _forget_waiting(self, client: str, connection: Any) -> None:
        waiting = self._waiting.get(client)
        if waiting is not None:
            waiting.pop(connection, None)
            if not waiting:
                del self._waiting[client]

    def note(self, event: str) -> None:
        self.events.note(event)


def _client_host(transport: asyncio.BaseTransport) -> str:
    address: Optional[Tuple[str, int]] = get_remote_addr(transport)
    return address[0] if address else "?"


def _response(status: int, reason: str, message: str) -> bytes:
    body = message.encode("ascii", "replace") + b"\n"
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode("ascii")
    return head + body


def _refuse(transport: asyncio.BaseTransport, status: int, reason: str, message: str) -> None:
    try:
        transport.write(_response(status, reason, message))  # type: ignore[attr-defined]
    finally:
        transport.close()


class GuardedListener(socket.socket):
    """A listening socket whose `accept` answers a connection over the guard's limits with a 503
    and closes it at once (a non-blocking send of a short response, then close), and returns the
    next one; at most `REFUSALS_PER_ACCEPT` are refused per call, then it reports nothing pending
    (BlockingIOError), so that a flood cannot hold the event loop: asyncio calls again on its next
    turn."""

    REFUSALS_PER_ACCEPT = 64
    guard: ConnectionGuard

    def accept(self):  # type: ignore[override]
        for _ in range(self.REFUSALS_PER_ACCEPT):
            conn, address = super().accept()
            host = address[0] if isinstance(address, tuple) and address else "?"
            reason = self.guard.refusal(host)
            if reason is None:
                # asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP, and this
                # one inherits the listener's 0: without it, a response written in two parts
                # (uvicorn's headers, then body) waited ~40 ms for the client's delayed ACK
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return conn, address
            self.guard.note("connections refused over a limit")
            try:
                conn.setblocking(False)
                conn.send(_response(503, "Service Unavailable", f"{reason}; try again later"))
            except OSError:  # the client is gone, or its buffer full: the close says enough
                pass
            conn.close()
        raise BlockingIOError("connections over the limits were refused; more may be pending")


def listening_socket(guard: ConnectionGuard, host: str, port: int) -> GuardedListener:
    """A `GuardedListener` bound to (host, port), for `uvicorn.Server.run(sockets=[...])` (as
    uvicorn binds one: IPv6 when the host holds a colon, SO_REUSEADDR). OSError if the port is taken."""
    sock = GuardedListener(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.guard = guard
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a `ConnectionGuard` (set as the class attribute `guard`)."""

    guard: ConnectionGuard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.guard_client = _client_host(transport)
        self._read_timer: Optional[asyncio.TimerHandle] = None
        self._request_cycle: Any = None
        self.guard_counted = False
        reason = self.guard.admit(self.guard_client)
        if reason is not None:  # refused before uvicorn sets anything up: a flood costs little
            _refuse(transport, 503, "Service Unavailable", f"{reason}; try again later")
            return
        self.guard_counted = True
        super().connection_made(transport)
        self._start_read_timer()
        delay_s = self.guard.offence_delay_s(self.guard_client)
        if delay_s > 0.0:  # its address broke the protocol too often: read it a moment later
            self.flow.pause_reading()
            self.loop.call_later(delay_s, self.flow.resume_reading)
        self._h11_next_event = self.conn.next_event
        self.conn.next_event = self._next_event  # type: ignore[method-assign]

    def _next_event(self) -> Any:
        """h11's next event, with a request whose body is chunked refused (411) from its head:
        h11 parses a chunked body chunk by chunk, so 1-byte chunks cost ~200x their bytes, and
        every client this server has sends a Content-Length."""
        event = self._h11_next_event()
        if isinstance(event, h11.Request) and any(name.lower() == b"transfer-encoding" for name, _ in event.headers):
            self.guard.note("HTTP requests refused: chunked body (411)")
            self._stop_read_timer()
            _refuse(
                self.transport,
                411,
                "Length Required",
                "send the body with a Content-Length; chunked bodies are not read",
            )
            self.guard_counted = False
            self.guard.release(self.guard_client)
            return h11.NEED_DATA  # nothing more of this connection is parsed
        return event

    def data_received(self, data: bytes) -> None:
        if not self.guard_counted:  # refused or evicted (data already on its way)
            return
        if self._read_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._start_read_timer()  # the next request on a kept-alive connection begins
        super().data_received(data)
        if self._read_timer is not None and self.cycle is not self._request_cycle and not self.cycle.more_body:
            self._stop_read_timer()  # the request arrived whole: the app has it

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.guard_counted and not self.transport.is_closing():
            self.guard.waiting(self.guard_client, self, True)  # idle between requests

    def handle_websocket_upgrade(self, event: Any) -> None:
        self._stop_read_timer()
        if self.guard_counted:  # the WebSocket protocol counts this connection from now on
            self.guard_counted = False
            self.guard.release(self.guard_client)
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self.transport is None:  # refused in connection_made: nothing was set up
            return
        self._stop_read_timer()
        self.guard.waiting(self.guard_client, self, False)
        if self.guard_counted:
            self.guard_counted = False
            self.guard.release(self.guard_client)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self.guard.offence(self.guard_client)  # not HTTP: uvicorn answers 400 and closes
        super().send_400_response(msg)

    def evict(self) -> None:
        """Give this connection's place to another address's (the guard has uncounted it)."""
        self._stop_read_timer()
        if self.transport is not None and not self.transport.is_closing():
            _refuse(self.transport, 503, "Service Unavailable", "the server is full; this connection made room")

    def _start_read_timer(self) -> None:
        self._request_cycle = self.cycle
        self._read_timer = self.loop.call_later(self.guard.request_read_timeout_s, self._read_timed_out)
        self.guard.waiting(self.guard_client, self, True)  # a request not yet whole

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
            self.guard.waiting(self.guard_client, self, False)  # being served

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        self.guard.note("requests not received whole in time (408)")
        _refuse(
            self.transport,
            408,
            "Request Timeout",
            f"a request must arrive whole within {self.guard.request_read_timeout_s:g} s",
        )


class _ReadGate:
    """A WebSocket connection's transport, reading while none of the reasons to pause holds:
    uvicorn's own ("app": a message waits for the app), the client not reading what the server
    writes ("write"), a pause its control frames earned ("pace"). Everything else is the
    transport's."""

    def __init__(self, transport: asyncio.Transport, on_resume: Any) -> None:
        self._transport = transport
        self._paused: set = set()
        self._on_resume = on_resume

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    @property
    def paused(self) -> bool:
        return bool(self._paused)

    def pause_reading(self, reason: str = "app") -> None:
        if not self._paused and not self._transport.is_closing():
            self._transport.pause_reading()
        self._paused.add(reason)

    def resume_reading(self, reason: str = "app") -> None:
        was_paused = bool(self._paused)
        self._paused.discard(reason)
        if was_paused and not self._paused and not self._transport.is_closing():
            self._transport.resume_reading()
            self._on_resume()  # what was read before the pause


class GuardedWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, counted by a `ConnectionGuard` (the class attribute `guard`)
    while it is open, its pings and pongs counted and paced as messages without work, and its
    reading paused while the client does not read. What it reads is parsed `FEED_BYTES` at a
    time, and no further while reading is paused: a flood of pings in one read is cut off after
    the few that earn its close, not parsed whole. A connection that breaks the protocol is an
    offence of its address (`ConnectionGuard.offence`). The limits were checked when its
    connection opened as HTTP."""

    FEED_BYTES = 4096
    MAX_FRAGMENTS = 16
    """Frames one message may arrive in; one more closes the connection (1009): each frame costs
    the parser the same whatever its size, so 1-byte fragments would cost ~200x their bytes."""
    guard: ConnectionGuard

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.transport = _ReadGate(transport, self._feed)  # type: ignore[assignment]
        self.guard_client = _client_host(transport)
        self.guard.count(self.guard_client)
        self.guard_counted = True
        self.budget = MessageBudget()
        self._debt_s = 0.0
        self._pacing: Optional[asyncio.TimerHandle] = None
        self._input = bytearray()
        self._fragments = 0  # frames of the message being received

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        if getattr(self, "scope", None) is not None:  # the app's pacing shares this connection's count
            self.scope["extensions"][BUDGET_EXTENSION] = self.budget

    def data_received(self, data: bytes) -> None:
        self._input += data
        self._feed()

    def _feed(self) -> None:
        """Parse what was read, `FEED_BYTES` at a time, while reading is not paused."""
        while self._input and not self.transport.paused and not self.transport.is_closing():
            chunk = bytes(self._input[: self.FEED_BYTES])
            del self._input[: self.FEED_BYTES]
            super().data_received(chunk)
            if self._debt_s > MAX_CONTROL_FRAME_DEBT_S and not self.close_sent:
                self.guard.note("WebSocket connections closed for a flood of pings or pongs (1008)")
                self.guard.offence(self.guard_client)
                self._debt_s = 0.0
                self._input.clear()
                self._close(1008, "too many pings or pongs without a reset or step")
            elif self._debt_s > 0.0 and self._pacing is None and not self.transport.is_closing():
                self.transport.pause_reading("pace")
                self._pacing = self.loop.call_later(self._debt_s, self._end_pace)

    def handle_text(self, event: Any) -> None:
        self._fragments = 1
        super().handle_text(event)

    def handle_bytes(self, event: Any) -> None:
        self._fragments = 1
        super().handle_bytes(event)

    def handle_cont(self, event: Any) -> None:
        self._fragments += 1
        if self._fragments > self.MAX_FRAGMENTS:
            if not self.close_sent:
                self.guard.note(
                    f"WebSocket connections closed for a message in over {self.MAX_FRAGMENTS} fragments (1009)"
                )
                self.guard.offence(self.guard_client)
                self._input.clear()
                self._close(1009, f"a message may come in at most {self.MAX_FRAGMENTS} frames")
            return
        super().handle_cont(event)

    def handle_parser_exception(self) -> None:
        self.guard.offence(self.guard_client)  # an invalid frame, text not UTF-8, a frame over the limit
        self._input.clear()
        super().handle_parser_exception()

    def _end_pace(self) -> None:
        self._pacing, self._debt_s = None, 0.0
        self.transport.resume_reading("pace")

    def _control_frame(self) -> None:
        if self.budget.idle():
            self._debt_s += WASTED_WORK_PAUSE_S

    def handle_ping(self) -> None:
        super().handle_ping()
        self._control_frame()

    def handle_pong(self, event: Any) -> None:
        super().handle_pong(event)
        self._control_frame()

    def pause_writing(self) -> None:
        super().pause_writing()
        self.transport.pause_reading("write")  # read no more until the client reads

    def resume_writing(self) -> None:
        super().resume_writing()
        self.transport.resume_reading("write")

    def _close(self, code: int, reason: str) -> None:
        self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.conn.send_close(code, reason)
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.transport.close()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._input.clear()
        if self._pacing is not None:
            self._pacing.cancel()
            self._pacing = None
        if getattr(self, "guard_counted", False):
            self.guard_counted = False
            self.guard.release(self.guard_client)
        super().connection_lost(exc)


def guarded_protocols(guard: ConnectionGuard) -> Tuple[type, type]:
    """(http, ws) protocol classes for uvicorn's `http=` and `ws=`, both under `guard`."""
    http = type("GuardedH11", (GuardedH11Protocol,), {"guard": guard})
    ws = type("GuardedWebSocket", (GuardedWebSocketProtocol,), {"guard": guard})
    return http, ws


def guarded_server(
    app: Any,
    guard: ConnectionGuard,
    host: str,
    port: int,
    ws_frame_limit_bytes: int,
    log_level: str = "warning",
) -> uvicorn.Server:
    """The uvicorn server for `app` under `guard`: its protocols, the frame limit (larger frames
    close the connection, 1009), no per-message compression (a 4 KB frame could inflate to
    4 MiB), keep-alive pings every 20 s, proxy headers (X-Forwarded-For) trusted from
    `guard.trusted_proxies` only, uvicorn's per-request warnings counted in `events`. Marks this
    process as serving under `guard` (see `serving_guard`)."""
    http, ws = guarded_protocols(guard)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=http,
        ws=ws,
        ws_max_size=ws_frame_limit_bytes,
        ws_per_message_deflate=False,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        proxy_headers=bool(guard.trusted_proxies),
        forwarded_allow_ips=sorted(guard.trusted_proxies) or None,
        server_header=False,
    )
    server = uvicorn.Server(config)
    install_log_filter()  # after uvicorn configured its loggers
    _serving["guard"] = guard
    return server


def install_log_filter() -> None:
    """Count uvicorn's per-request warnings in `events` instead of writing them (see
    `HostileEventFilter`); idempotent."""
    uvicorn_errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, HostileEventFilter) for f in uvicorn_errors.filters):
        uvicorn_errors.addFilter(HostileEventFilter())
