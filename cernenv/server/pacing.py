"""Pacing rules shared by the server's layers, and its rate-limited log of hostile events.

The ASGI app (`MessageLimit`, `ServedEnvironment`), the session registry (`GuardedEnvServer`)
and uvicorn's protocols under the guard (`GuardedWebSocketProtocol`) count the same things:
what a connection sends that does no work, what an address does with its sessions. The rules
and their constants live here, with the measurements that set them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Callable, Dict, Optional, Tuple

logger = logging.getLogger("cernenv.server")

# The scheduler's charge for a step that does no new work for its agent, in times its CPU time:
# one that broke a rule of the environment (refused, after the episode's end, or repeating an
# action on unchanged data: its `rule_violations` are not empty), and one more than
# `FREE_STEPS_ON_UNCHANGED_DATA` in a row without new data (HeuristicAgent takes at most 5 in
# a row in 120 curated and procedural episodes); the step that ends an episode that took no
# data (a claim made blind); a reset that abandons an unfinished episode or follows one
# without data. Sessions that spam `scan_bump` on one spectrum (repeated, or each time with
# another step), `reset`, or reset-and-claim then get far fewer turns than an honest session
# instead of as many (the fairness cases of `make bench-server`; figures in
# docs/openenv.md). No step is refused.
NO_NEW_WORK_SURCHARGE = 8.0
FREE_STEPS_ON_UNCHANGED_DATA = 6
# ... and while another session is open, the answer to such a step waits this long (a tarpit):
# a session that only wastes work sends at most 10 requests a second, and the server's event
# loop, which the scheduler does not order, is spared their traffic. An agent's occasional
# refused action costs it 0.1 s, little beside the time a language model takes to answer
# (why 0.1 s and not 50 ms: docs/studies/2026-11-25-how-the-scheduler-s-rules-came-about.md).
WASTED_WORK_PAUSE_S = 0.1
# The same pause for what a connection sends that runs no physics (refused frames, `state`
# requests, WebSocket pings and pongs, MCP calls that neither reset nor step) beyond this many
# in a row without a reset or step (`MessageBudget`): 8 clients sending them as fast as they
# were answered raised 4 honest clients' median latency x1.6-2.1 (bench/server_load.py
# `garbage`, `state`; pings: `ping`, docs/studies/2026-11-26-attacks-tried-and-what-each-gets.md).
FREE_MESSAGES_WITHOUT_WORK = 10
# A connection that sends more control frames in one read than this many seconds of pauses
# would cover (50 past the free ones) is closed (1008): no client needs that many pings.
MAX_CONTROL_FRAME_DEBT_S = 5.0
# Connections closed for breaking the protocol (a request that is not HTTP, a WebSocket frame
# that is not valid or not UTF-8, a flood of pings), per address: this many free, then this many
# a second; beyond, the address's new connections are read only after its debt, at most
# OFFENCE_DELAY_MAX_S. Each such connection costs the server its handshake and a read before it
# is closed, and reconnecting is free for the client (bench/server_load.py `bad-http`,
# `bad-utf8`, `ping`; docs/studies/2026-11-26-attacks-tried-and-what-each-gets.md). Refusing the
# address instead (503) cost an honest client on the same address half its requests beside one
# sending TLS to the plain port twice a second.
OFFENCE_BURST = 8
OFFENCES_PER_S = 1.0
OFFENCE_DELAY_MAX_S = 1.0
# Sessions that end without a single step, from one client address: this many free, then this
# many a second; beyond, a new session waits (`AddressPacer`). 8 addresses opening a session,
# resetting and dropping it as fast as they could raised 4 honest clients' median latency
# x2.8-4.0. Sessions that step are never counted, however many a client opens.
STEPLESS_SESSION_BURST = 16
STEPLESS_SESSIONS_PER_S = 5.0
# HTTP requests from one client address: this many free, then this many a second; beyond, a
# request waits its turn before it is read (`AddressPacer`). Every route costs the event loop
# (parsing, a fresh environment, JSON): 8 addresses sending `POST /reset` as fast as they were
# answered raised 4 honest WebSocket clients' median latency x5.8-6.1, the other routes x2.8-4.0.
# The WebSocket carries the work; HTTP is for health checks, schemas, one-off resets and MCP.
HTTP_REQUEST_BURST = 32
HTTP_REQUESTS_PER_S = 20.0
# A request whose turn is further away than this gets 429 (Retry-After) after waiting this long,
# and its turn is given back: an address's queue, and a server's shutdown, wait at most this.
HTTP_MAX_WAIT_S = 1.0


class AddressPacer:
    """A token bucket per client address: `burst` charges free, then `rate_per_s`; what is charged
    is the caller's (a session that ended without a single step, an HTTP request). An address in
    debt waits `wait_s(address)`."""

    def __init__(self, burst: int, rate_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.burst, self.rate_per_s, self._clock = float(burst), float(rate_per_s), clock
        self._buckets: Dict[str, Tuple[float, float]] = {}  # address -> (tokens, when)

    def _tokens(self, address: str, now: float) -> float:
        tokens, when = self._buckets.get(address, (self.burst, now))
        return min(self.burst, tokens + (now - when) * self.rate_per_s)

    def charge(self, address: str, tokens: float = 1.0) -> None:
        """`tokens` more charges from `address` (negative: given back)."""
        now = self._clock()
        self._buckets[address] = (self._tokens(address, now) - tokens, now)
        if len(self._buckets) > 10_000:  # forget the addresses whose buckets are full again
            for stale in [a for a in self._buckets if self._tokens(a, now) >= self.burst]:
                del self._buckets[stale]

    def wait_s(self, address: str) -> float:
        """How long `address` waits now: until its bucket is out of debt."""
        return max(0.0, -self._tokens(address, self._clock()) / self.rate_per_s)


class MessageBudget:
    """What one connection (or MCP session) has sent without work since its last reset or step:
    past `FREE_MESSAGES_WITHOUT_WORK` in a row, each such message is paced."""

    def __init__(self) -> None:
        self.in_a_row = 0

    def work(self) -> None:
        """A reset or step: the count starts again."""
        self.in_a_row = 0

    def idle(self) -> bool:
        """One more message without work; True if it is to be paced."""
        self.in_a_row += 1
        return self.in_a_row > FREE_MESSAGES_WITHOUT_WORK


class EventLog:
    """Counts of hostile or abnormal events (refused connections, invalid requests, aborted
    sockets, ...), logged as one line of counts at most once per `every_s`, never a line (or a
    traceback) per event: a client that sends bad requests as fast as it can grows the log by a
    line every `every_s`."""

    def __init__(self, every_s: float = 10.0, status: Optional[Callable[[], str]] = None) -> None:
        self.every_s = every_s
        self.status = status
        self.counts: Counter = Counter()  # since the start
        self._pending: Counter = Counter()  # since the last line
        self._last_line = 0.0
        self._lock = threading.Lock()

    def note(self, event: str) -> None:
        with self._lock:
            self.counts[event] += 1
            self._pending[event] += 1
            now = time.monotonic()
            if now - self._last_line < self.every_s:
                return
            self._last_line, pending = now, dict(self._pending)
            self._pending.clear()
        status = f" ({self.status()})" if self.status is not None else ""
        logger.warning("refused or cut short: %s%s", ", ".join(f"{n} {event}" for event, n in pending.items()), status)


events = EventLog()
"""The server process's event log (one server per process)."""


class HostileEventFilter(logging.Filter):
    """A filter for uvicorn's error logger: the lines it writes once per hostile request (and the
    traceback it writes for every text frame that is not UTF-8) become counts in `events`."""

    MESSAGES = {
        "Invalid HTTP request received.": "invalid HTTP requests (400)",
        "Invalid UTF-8 sequence received from client.": "WebSocket text frames not UTF-8 (closed, 1007)",
        "Unsupported upgrade request.": "unsupported upgrade requests",
    }

    def __init__(self, log: EventLog = events) -> None:
        super().__init__()
        self.log = log

    def filter(self, record: logging.LogRecord) -> bool:
        event = self.MESSAGES.get(record.msg) if isinstance(record.msg, str) else None
        if event is None:
            return True
        self.log.note(event)
        return False
