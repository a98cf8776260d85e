"""Connection limits and request timeouts in front of the app, at uvicorn's protocol level.

What the ASGI app cannot see: connections that never finish a request. One client opened
19,993 HTTP requests that never finished, until the server reached its file-descriptor limit,
`/health` timed out and the log grew by 235,519 "Too many open files" lines (issue 15).
`ConnectionGuard` bounds the open connections, in all and per client address, and gives each
request `request_read_timeout_s` to arrive whole (headers and body), from the connection's
opening or from the end of the previous response. A connection over a limit gets a 503 and is
closed before anything is read; a late request gets a 408 and is closed. Refusals are counted
and logged at most once per `LOG_EVERY_S`, never once each.

`guarded_protocols(guard)` returns the HTTP (h11) and WebSocket protocol classes uvicorn takes
as `http=` and `ws=`; `python -m cernenv.server` uses them. An upgraded WebSocket keeps its
connection's place in the count until it closes.

`listening_socket(guard, host, port)` is the server's listening socket, which refuses a
connection over a limit as it accepts it, before asyncio builds a transport, a task and a
protocol for it: a flood of connections from one address (two processes opening 3,800 a
second) cost the server 170 µs of CPU each when refused in the protocol, 60% of a core taken
from the physics thread (bench/server_load.py). The protocol keeps its own check, which is the
one that counts.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import Counter
from typing import Any, Optional, Tuple

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_remote_addr
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

logger = logging.getLogger("cernenv.server")

LOG_EVERY_S = 10.0


class ConnectionGuard:
    """Counts of open connections (all, per client address) against their limits, and the
    refusals made (`refused`, by reason)."""

    def __init__(self, max_connections: int, max_connections_per_client: int, request_read_timeout_s: float) -> None:
        self.max_connections = max_connections
        self.max_connections_per_client = max_connections_per_client
        self.request_read_timeout_s = request_read_timeout_s
        self.open = 0
        self.per_client: Counter = Counter()
        self.refused: Counter = Counter()
        self._lock = threading.Lock()
        self._last_log = 0.0
        self._logged: Counter = Counter()

    def admit(self, client: str) -> Optional[str]:
        """Count a new connection from `client`; or, over a limit, the reason it is refused."""
        with self._lock:
            reason = self._over_limit(client)
            if reason is None:
                self.open += 1
                self.per_client[client] += 1
                return None
        self.note("connections refused over a limit")
        return reason

    def refusal(self, client: str) -> Optional[str]:
        """Why a new connection from `client` would be refused now (None: it would be admitted)."""
        with self._lock:
            return self._over_limit(client)

    def _over_limit(self, client: str) -> Optional[str]:
        if self.open >= self.max_connections:
            return f"the server holds its limit of {self.max_connections} connections"
        if self.per_client[client] >= self.max_connections_per_client:
            return f"{client} holds its limit of {self.max_connections_per_client} connections"
        return None

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

    def note(self, event: str) -> None:
        """Count `event`; log the counts since the last line, at most once per LOG_EVERY_S."""
        with self._lock:
            self.refused[event] += 1
            self._logged[event] += 1
            now = time.monotonic()
            if now - self._last_log < LOG_EVERY_S:
                return
            self._last_log, counts = now, dict(self._logged)
            self._logged.clear()
        logger.warning(
            "connection guard: %s (open now: %d)", ", ".join(f"{n} {event}" for event, n in counts.items()), self.open
        )


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
        self._host = _client_host(transport)
        self._read_timer: Optional[asyncio.TimerHandle] = None
        self._request_cycle: Any = None
        reason = self.guard.admit(self._host)
        self._counted = reason is None
        if reason is not None:  # refused before uvicorn sets anything up: a flood costs little
            _refuse(transport, 503, "Service Unavailable", f"{reason}; try again later")
            return
        super().connection_made(transport)
        self._start_read_timer()

    def data_received(self, data: bytes) -> None:
        if not self._counted:  # refused (data already on its way)
            return
        if self._read_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._start_read_timer()  # the next request on a kept-alive connection begins
        super().data_received(data)
        if self._read_timer is not None and self.cycle is not self._request_cycle and not self.cycle.more_body:
            self._stop_read_timer()  # the request arrived whole: the app has it

    def handle_websocket_upgrade(self, event: Any) -> None:
        self._stop_read_timer()
        if self._counted:  # the WebSocket protocol counts this connection from now on
            self._counted = False
            self.guard.release(self._host)
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if self.transport is None:  # refused in connection_made: nothing was set up
            return
        self._stop_read_timer()
        if self._counted:
            self._counted = False
            self.guard.release(self._host)
        super().connection_lost(exc)

    def _start_read_timer(self) -> None:
        self._request_cycle = self.cycle
        self._read_timer = self.loop.call_later(self.guard.request_read_timeout_s, self._read_timed_out)

    def _stop_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        self.guard.note("requests not received whole in time")
        _refuse(
            self.transport,
            408,
            "Request Timeout",
            f"a request must arrive whole within {self.guard.request_read_timeout_s:g} s",
        )


class GuardedWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol, counted by a `ConnectionGuard` (the class attribute `guard`)
    while it is open. The limits were checked when its connection opened as HTTP."""

    guard: ConnectionGuard

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._host = _client_host(transport)
        self.guard.count(self._host)
        self._counted = True

    def connection_lost(self, exc: Optional[Exception]) -> None:
        if getattr(self, "_counted", False):
            self._counted = False
            self.guard.release(self._host)
        super().connection_lost(exc)


def guarded_protocols(guard: ConnectionGuard) -> Tuple[type, type]:
    """(http, ws) protocol classes for `uvicorn.run(http=..., ws=...)`, both under `guard`."""
    http = type("GuardedH11", (GuardedH11Protocol,), {"guard": guard})
    ws = type("GuardedWebSocket", (GuardedWebSocketProtocol,), {"guard": guard})
    return http, ws
