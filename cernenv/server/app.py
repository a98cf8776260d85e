"""The CERNenv server: OpenEnv's `create_app` around `CERNCollisionEnvironment`.

    python -m cernenv.server                  # 127.0.0.1:8000; --help for the options
    uvicorn cernenv.server.app:app            # configured by the CERNENV_* variables (and uvicorn's flags)

Routes (from `openenv.core.env_server.create_app`, less its `/mcp` routes, plus `/sessions`):

| route | what it does |
|---|---|
| `WS /ws` | one session = one environment: messages `reset`, `step`, `state`, `close` |
| `GET /health`, `/metadata`, `/schema` | liveness; name and version; JSON schemas of action, observation, state |
| `POST /reset` | the first observation of a fresh environment (seed, scenario, difficulty), then forgotten |
| `POST /step`, `GET /state` | a fresh environment per request (OpenEnv 0.10): 409; the empty state |
| `GET /sessions` | environments open now (one per WebSocket session) and the session limit |

What the server adds to the environment (`ServedEnvironment`): a step before any reset is
an error rather than an implicit seed-0 episode; unknown or ill-typed reset parameters are
errors; `hidden_truth()` is refused; any JSON value sent as an action is judged by the
environment's rules, so malformed actions cost the same penalty as in process; all
sessions' resets and steps run on one thread, in fair turns in which work that gives an
agent nothing new counts 8 times and, while another session is open, is answered 0.1 s
later (`NO_NEW_WORK_SURCHARGE`, `WASTED_WORK_PAUSE_S`). The `MessageLimit` middleware refuses
messages over `ServerConfig.max_message_bytes` and unreadable ones with an error (the
WebSocket session goes on), frames over `ws_frame_limit_bytes` by closing the connection
(code 1009), and closes sessions idle for `session_idle_timeout_s`. Sessions are created by
the WebSocket alone (OpenEnv's `/mcp` routes are removed). With `ServerConfig.token`,
`BearerToken` refuses every route but `/health` without `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.types import Action, ConcurrencyConfig
from pydantic import ConfigDict
from starlette.websockets import WebSocketDisconnect, WebSocketDisconnected
from uvicorn.protocols.utils import ClientDisconnected

from cernenv.client import RAW_ACTION_KEY
from cernenv.environment import CERNCollisionEnvironment
from cernenv.models import CernState, CollisionObservation, ExperimentAction
from cernenv.server.scheduler import FairScheduler

ENV_PREFIX = "CERNENV_"

# The scheduler's charge for a step that does no new work for its agent, in times its CPU time:
# one that broke a rule of the environment (refused, after the episode's end, or repeating an
# action on unchanged data: its `rule_violations` are not empty), and one more than
# `FREE_STEPS_ON_UNCHANGED_DATA` in a row without new data (HeuristicAgent takes at most 5 in
# a row in 120 curated and procedural episodes); the step that ends an episode that took no
# data (a claim made blind); a reset that abandons an unfinished episode or follows one
# without data. Sessions that spam `scan_bump` on one spectrum (repeated, or each time with
# another step), `reset`, or reset-and-claim then get far fewer turns than an honest session
# instead of as many (the fairness cases of `make bench-server`; figures in
# cernenv/server/scheduler.py). No step is refused.
NO_NEW_WORK_SURCHARGE = 8.0
FREE_STEPS_ON_UNCHANGED_DATA = 6
# ... and while another session is open, the answer to such a step waits this long (a tarpit):
# a session that only wastes work sends at most 10 requests a second, and the server's event
# loop, which the scheduler does not order, is spared their traffic. An agent's occasional
# refused action costs it 0.1 s, little beside the time a language model takes to answer.
# (50 ms held 8 scan spammers to x0.97-1.44 while the server's sockets kept Nagle's algorithm,
# which also slowed their answers; with TCP_NODELAY, as plain uvicorn has it: x1.29-2.08 over
# 5 runs, and with 0.1 s x1.07-1.61.)
WASTED_WORK_PAUSE_S = 0.1
# The same pause for a WebSocket's messages that run no physics (refused frames, `state`
# requests) beyond this many in a row without a reset or step (`MessageLimit`): 8 clients
# sending them as fast as they were answered raised 4 honest clients' median latency x1.6-2.1
# (bench/server_load.py `garbage`, `state`), as they cost the event loop every session shares.
FREE_MESSAGES_WITHOUT_WORK = 10
# Sessions that end without a single step, from one client address: this many free, then this
# many a second; beyond, a new session's handshake waits (`AddressPacer`). 8 addresses opening a
# session, resetting and dropping it as fast as they could raised 4 honest clients' median
# latency x2.8-4.0. Sessions that step are never counted, however many a client opens.
STEPLESS_SESSION_BURST = 16
STEPLESS_SESSIONS_PER_S = 5.0
# HTTP requests from one client address: this many free, then this many a second; beyond, a
# request waits its turn before it is read (`AddressPacer`). Every route costs the event loop
# (parsing, a fresh environment, JSON): 8 addresses sending `POST /reset` as fast as they were
# answered raised 4 honest WebSocket clients' median latency x5.8-6.1, the other routes x2.8-4.0.
# The WebSocket carries the work; HTTP is for health checks, schemas and one-off resets.
HTTP_REQUEST_BURST = 32
HTTP_REQUESTS_PER_S = 20.0
# A request whose turn is further away than this gets 429 (Retry-After) after waiting this long,
# and its turn is given back: an address's queue, and a server's shutdown, wait at most this.
HTTP_MAX_WAIT_S = 1.0

logger = logging.getLogger("cernenv.server")


@dataclass(frozen=True)
class ServerConfig:
    """How the server runs; each field can be set by the variable CERNENV_<FIELD> (e.g. CERNENV_PORT)."""

    host: str = "127.0.0.1"
    """Interface to bind; the default serves this machine only."""
    port: int = 8000
    """TCP port."""
    max_sessions: int = 64
    """Concurrent WebSocket sessions (one environment each); one more is refused with CAPACITY_REACHED."""
    max_message_bytes: int = 64 * 1024
    """Largest request accepted [bytes]: a larger WebSocket message gets an error frame, a larger HTTP body 413.
    An action with the longest justification (2,000 characters) takes under 3 KiB."""
    session_idle_timeout_s: float = 300.0
    """A WebSocket session with no message for this long [s] is closed (code 1001) and its slot
    freed, so clients that vanish (or hoard slots) cannot keep the server at capacity."""
    max_connections: int = 1024
    """Open connections, HTTP and WebSocket together; one more gets a 503 and is closed. Keep it
    well under the process's file-descriptor limit (`ulimit -n`)."""
    max_connections_per_client: int = 128
    """Open connections from one client address (above `max_sessions`, so one host can fill the
    sessions); one more gets a 503 and is closed."""
    request_read_timeout_s: float = 10.0
    """Time [s] a connection has to deliver a whole HTTP request (headers and body); later, a 408
    and the connection is closed, so unfinished requests cannot hold connections."""
    token: str = field(default="", repr=False)
    """Bearer token: when set, every route but /health needs `Authorization: Bearer <token>`
    (the WebSocket too, in its opening handshake). "" serves anyone who can connect: keep the
    default host 127.0.0.1 then. Never printed."""
    secret_salt: str = field(default="", repr=False)
    """Evaluation secret mixed into every session's hidden streams (procedural particles and data),
    so the public code cannot look up an episode's answer from its seed; "" for none. Never
    printed; a client's own `secret_salt` at reset is mixed in on top and cannot remove it."""

    @property
    def ws_frame_limit_bytes(self) -> int:
        """Frames above this [bytes] are not even read: the connection closes with code 1009."""
        return max(1024 * 1024, 2 * self.max_message_bytes)

    @classmethod
    def from_env(cls, environ: Optional[Dict[str, str]] = None, **overrides: Any) -> "ServerConfig":
        """Defaults, then CERNENV_* variables, then `overrides` that are not None."""
        environ = os.environ if environ is None else environ
        values: Dict[str, Any] = {}
        for f in fields(cls):
            text = environ.get(ENV_PREFIX + f.name.upper())
            if text is not None:
                try:
                    values[f.name] = type(f.default)(text)
                except ValueError:
                    raise ValueError(f"{ENV_PREFIX}{f.name.upper()}={text!r} is not a valid {f.name}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        config = cls(**values)
        if (
            config.max_sessions < 1
            or config.max_message_bytes < 1024
            or not 0 <= config.port < 65536
            or not config.session_idle_timeout_s > 0
            or not config.request_read_timeout_s > 0
            or not 1 <= config.max_connections_per_client <= config.max_connections
        ):
            raise ValueError(
                f"invalid server configuration {config}: max_sessions >= 1, "
                "max_message_bytes >= 1024, 0 <= port < 65536, session_idle_timeout_s > 0, "
                "request_read_timeout_s > 0 and 1 <= max_connections_per_client <= max_connections"
            )
        return config


class RequestError(ValueError):
    """A request the environment cannot serve as asked; the message says what to send instead."""

    status_code = 400


class NoEpisodeError(RequestError):
    status_code = 409


class WireAction(Action):
    """Whatever JSON object a step message carries, handed to the environment's own rules.

    OpenEnv validates a step's data against the action class before the environment sees
    it; validating against `ExperimentAction` there would turn a malformed action into a
    protocol error, where in process it is a rule violation with a penalty. `/schema` still
    publishes `ExperimentAction`'s schema."""

    model_config = ConfigDict(extra="allow")
    metadata: Any = None

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        return ExperimentAction.model_json_schema(*args, **kwargs)

    def unwrap(self) -> Any:
        data = self.model_dump(exclude_unset=True)
        if set(data) == {RAW_ACTION_KEY}:
            return data[RAW_ACTION_KEY]
        return data


class EnvironmentCount:
    """Environments alive in one app: every session's, plus any stateless HTTP request's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.open = 0

    def change(self, delta: int) -> None:
        with self._lock:
            self.open += delta


class ServedEnvironment(CERNCollisionEnvironment):
    """`CERNCollisionEnvironment` as one server session runs it (see the module docstring)."""

    RESET_PARAMETERS = ("seed", "episode_id", "scenario", "difficulty", "secret_salt")
    # Every session's reset and step run on one shared thread (`FairScheduler`: least recent CPU time
    # used first). The physics holds the GIL, so a thread per session only adds contention: at 32
    # sessions it doubled the server's CPU time per episode (170 vs 87 ms) and cut throughput by a
    # third (bench/bench_server.py). OpenEnv awaits `reset_async`/`step_async` (overridden below)
    # and creates and closes environments on its own single thread.
    REQUIRES_SINGLE_THREAD_EXECUTOR = True

    def __init__(self, count: EnvironmentCount, scheduler: FairScheduler, secret_salt: str = "") -> None:
        super().__init__(secret_salt=secret_salt or None)
        self._count = count
        self._scheduler = scheduler
        self._closed = False
        self._steps_on_unchanged_data = 0  # steps in a row since the episode's data last changed
        self._reset_wasted_episode = False  # the last reset cut short an episode, or one without data
        count.change(+1)

    async def reset_async(self, **kwargs: Any) -> CollisionObservation:
        """`reset` (its parameters, checked there) on the physics thread, in this session's fair
        turn; one that abandons an unfinished episode, or follows one that took no data, is charged
        `NO_NEW_WORK_SURCHARGE` times its CPU time and paced (`_run`)."""
        return await self._run(functools.partial(self.reset, **kwargs), self.reset_surcharge)

    def reset_surcharge(self, observation: CollisionObservation) -> float:
        """The scheduler's charge factor for the reset that returned `observation`."""
        return NO_NEW_WORK_SURCHARGE if self._reset_wasted_episode else 1.0

    async def step_async(self, action: Any, timeout_s: Optional[float] = None, **kwargs: Any) -> CollisionObservation:
        """`step` on the physics thread, in this session's fair turn; a step that did no new work
        is charged `NO_NEW_WORK_SURCHARGE` times its CPU time and paced (`_run`)."""
        return await self._run(functools.partial(self.step, action, timeout_s=timeout_s, **kwargs), self.step_surcharge)

    async def _run(
        self, job: Callable[[], CollisionObservation], surcharge: Callable[[CollisionObservation], float]
    ) -> CollisionObservation:
        """`job` on the physics thread in this session's turn, charged by `surcharge`; while
        another session is open, the answer to a surcharged job waits `WASTED_WORK_PAUSE_S`."""
        factors: List[float] = []

        def charge_factor(observation: CollisionObservation) -> float:
            factors.append(surcharge(observation))  # on the physics thread, before `run` returns
            return factors[-1]

        observation = await self._scheduler.run(self, job, surcharge=charge_factor)
        if factors and factors[0] > 1.0 and self._count.open > 1:
            await self._pause(WASTED_WORK_PAUSE_S)
        return observation

    _pause = staticmethod(asyncio.sleep)  # how the answer to wasted work waits (tests record it)

    def step_surcharge(self, observation: CollisionObservation) -> float:
        """The scheduler's charge factor for the step that returned `observation` (see
        `NO_NEW_WORK_SURCHARGE`); read on the physics thread right after that step."""
        if observation.rule_violations or self._steps_on_unchanged_data > FREE_STEPS_ON_UNCHANGED_DATA:
            return NO_NEW_WORK_SURCHARGE
        if observation.done and self._episode.data_version == 0:  # a claim (or an end) without data
            return NO_NEW_WORK_SURCHARGE
        return 1.0

    def reset(
        self,
        seed: Optional[int] = None,
        episode_id: Optional[str] = None,
        scenario: Optional[str] = None,
        difficulty: Optional[str] = None,
        secret_salt: Optional[str] = None,
        **unknown: Any,
    ) -> CollisionObservation:
        if unknown:
            raise RequestError(
                f"unknown reset parameter(s) {sorted(unknown)}; accepted: {', '.join(self.RESET_PARAMETERS)}"
            )
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**63):
            raise RequestError(f"seed must be a non-negative integer below 2**63 (or null), got {_printable(seed)}")
        for name, value in (
            ("episode_id", episode_id),
            ("scenario", scenario),
            ("difficulty", difficulty),
            ("secret_salt", secret_salt),
        ):
            if value is not None and not (isinstance(value, str) and len(value) <= 255 and _encodable(value)):
                raise RequestError(f"{name} must be a UTF-8 string of at most 255 characters, got {_printable(value)}")
        previous = self._episode
        wasted = previous is not None and (not previous.done or previous.data_version == 0)
        try:
            observation = super().reset(
                seed=seed, episode_id=episode_id, scenario=scenario, difficulty=difficulty, secret_salt=secret_salt
            )
        except ValueError as error:
            raise RequestError(str(error)) from None
        self._steps_on_unchanged_data, self._reset_wasted_episode = 0, wasted
        return observation

    def step(self, action: Any, timeout_s: Optional[float] = None, **kwargs: Any) -> CollisionObservation:
        if self._episode is None:
            raise NoEpisodeError(
                "no episode in this session: send reset (seed, scenario or difficulty) first; "
                "over HTTP each request gets a fresh environment, so play episodes on the "
                "WebSocket /ws (cernenv.client.CERNEnvClient)"
            )
        if isinstance(action, WireAction):
            action = action.unwrap()
        data_before = self._episode.data_version
        observation = super().step(action, timeout_s=timeout_s, **kwargs)
        changed = self._episode is None or self._episode.data_version != data_before
        self._steps_on_unchanged_data = 0 if changed else self._steps_on_unchanged_data + 1
        return observation

    def hidden_truth(self) -> Dict[str, Any]:
        raise PermissionError(
            "the hidden truth is not served; grade with CernState (correct_outcome, ...) once the episode is done"
        )

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._count.change(-1)
            self._scheduler.forget(self)
        super().close()


def _encodable(text: str) -> bool:
    """False for a str that cannot be sent back as JSON text (a lone surrogate from "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(value: Any, limit: int = 60) -> str:
    """A short, always-encodable rendering of client input for an error message."""
    return ascii(value)[:limit]


class AddressPacer:
    """A token bucket per client address: `burst` charges free, then `rate_per_s`; what is charged
    is the caller's (`MessageLimit`: a WebSocket session that ended without a single step, or an
    HTTP request). An address in debt waits `wait_s(address)`."""

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


class MessageLimit:
    """ASGI middleware: bounds what a client may send, and answers what OpenEnv would not.

    WebSocket: a message over `max_bytes`, a binary frame, text that is not JSON (too deeply
    nested or an integer over Python's 4,300 digits included), JSON that is not an object, an
    unknown message type or a string that is not UTF-8 gets an OpenEnv-style error frame
    `{"type": "error", "data": {"message", "code"}}` and is dropped; the session goes on. A
    client silent for `idle_timeout_s` is disconnected. A client address that drops sessions
    without a step faster than its `AddressPacer` allows waits for its next handshake. Beyond
    `FREE_MESSAGES_WITHOUT_WORK` refused frames or `state` requests in a row (no reset or step
    between), each waits `WASTED_WORK_PAUSE_S`. HTTP: an address's requests beyond
    `HTTP_REQUEST_BURST` wait their turn at `HTTP_REQUESTS_PER_S`, or, if it is more than
    `HTTP_MAX_WAIT_S` away, get 429 after that long; a body over `max_bytes` gets 413."""

    def __init__(self, app: Any, max_bytes: int, idle_timeout_s: Optional[float] = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout_s = idle_timeout_s
        self.sessions = AddressPacer(STEPLESS_SESSION_BURST, STEPLESS_SESSIONS_PER_S)
        self.http_requests = AddressPacer(HTTP_REQUEST_BURST, HTTP_REQUESTS_PER_S)

    _pause = staticmethod(asyncio.sleep)  # how a paced message waits (tests record it)

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            client = scope.get("client") or ("?", 0)
            wait_s = self.sessions.wait_s(client[0])
            if wait_s > 0.0:  # its address dropped too many sessions without a step: a tarpit
                await self._pause(wait_s)
            steps = [0]
            try:
                return await self.app(scope, self._guarded_receive(receive, send, steps), send)
            except Exception as error:
                if not _is_disconnect(error):
                    raise
                # the client went away: one line, not a traceback
                logger.warning("WebSocket client %s:%s went away: %s", client[0], client[1], type(error).__name__)
            finally:
                if not steps[0]:
                    self.sessions.charge(client[0])
            return None
        if scope["type"] == "http":
            return await self._http(scope, receive, send)
        return await self.app(scope, receive, send)

    def _guarded_receive(self, receive: Any, send: Any, steps: Optional[List[int]] = None) -> Any:
        """`receive` for the app, with the checks above; `steps[0]` counts the step messages."""
        idle_in_a_row = 0  # refused frames and `state` requests since the last reset or step
        steps = [0] if steps is None else steps

        async def guarded() -> Dict[str, Any]:
            nonlocal idle_in_a_row
            while True:  # one client message per turn: the client, not the server, drives this loop
                try:
                    message = await asyncio.wait_for(receive(), self.idle_timeout_s)
                except asyncio.TimeoutError:  # an idle client: close, and let the app free the session
                    await send(
                        {"type": "websocket.close", "code": 1001, "reason": f"idle for {self.idle_timeout_s:g} s"}
                    )
                    return {"type": "websocket.disconnect", "code": 1001}
                if message["type"] != "websocket.receive":
                    return message
                problem, message_type = self._problem(message)
                idle_in_a_row = 0 if message_type in ("reset", "step") else idle_in_a_row + 1
                steps[0] += message_type == "step"
                if idle_in_a_row > FREE_MESSAGES_WITHOUT_WORK:  # a tarpit, as for wasted physics work
                    await self._pause(WASTED_WORK_PAUSE_S)
                if problem is None:
                    return message
                await send({"type": "websocket.send", "text": json.dumps({"type": "error", "data": problem})})

        return guarded

    def _problem(self, message: Dict[str, Any]) -> Tuple[Optional[Dict[str, str]], Optional[str]]:
        """(the error frame's data, or None for a message the app may have; the message's type,
        or None where it has none)."""
        text = message.get("text")
        if text is None:
            return {"code": "VALIDATION_ERROR", "message": "send JSON text frames, not binary ones"}, None
        size = len(text.encode("utf-8"))
        if size > self.max_bytes:
            return {
                "code": "MESSAGE_TOO_LARGE",
                "message": f"message of {size} bytes is over the server's limit of {self.max_bytes} bytes",
            }, None
        try:  # parsed here too: OpenEnv's handler lets RecursionError and huge integers end the session
            value = json.loads(text)
        except (ValueError, RecursionError) as error:
            return {
                "code": "INVALID_JSON",
                "message": f"Invalid JSON ({type(error).__name__}): {_printable(str(error), 200)}",
            }, None
        if not isinstance(value, dict):
            return {
                "code": "VALIDATION_ERROR",
                "message": f'a message is a JSON object {{"type": ..., "data": ...}}, got {type(value).__name__}',
            }, None
        if value.get("type") not in WS_MESSAGE_TYPES:
            return {
                "code": "UNKNOWN_TYPE",
                "message": f"Unknown message type {_printable(value.get('type'))}; "
                f"send one of {', '.join(WS_MESSAGE_TYPES)}",
            }, None
        if not _all_encodable(value):
            return {"code": "VALIDATION_ERROR", "message": "strings must be valid UTF-8 (no lone surrogates)"}, None
        return None, value["type"]

    async def _http(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        address = (scope.get("client") or ("?", 0))[0]
        self.http_requests.charge(address)  # first: concurrent requests of an address queue up
        wait_s = self.http_requests.wait_s(address)
        if wait_s > HTTP_MAX_WAIT_S:
            self.http_requests.charge(address, -1.0)
            await self._pause(HTTP_MAX_WAIT_S)
            return await self._too_many(send, address)
        if wait_s > 0.0:
            await self._pause(wait_s)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                return await self._too_large(send, int(length))
            return await self.app(scope, receive, send)
        chunks, size = [], 0  # no Content-Length (chunked): read at most max_bytes, then replay
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return await self.app(scope, _replay([message]), send)
            chunks.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._too_large(send, size)
            if not message.get("more_body", False):
                return await self.app(scope, _replay(chunks, receive), send)

    async def _too_many(self, send: Any, address: str) -> None:
        body = json.dumps(
            {
                "detail": f"too many HTTP requests from {address}: {HTTP_REQUEST_BURST} at once, then "
                f"{HTTP_REQUESTS_PER_S:g} a second; try again in a second, or play over the WebSocket (/ws)"
            }
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 429, "headers": headers + [(b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})

    async def _too_large(self, send: Any, size: int) -> None:
        body = json.dumps(
            {"detail": f"request body of {size} bytes is over the server's limit of {self.max_bytes} bytes"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


DISCONNECTS = (WebSocketDisconnect, WebSocketDisconnected, ClientDisconnected, ConnectionError)
"""What sending to or reading from a client that vanished raises (an aborted connection)."""

DISCONNECT_WORDS = ("websocket.disconnect", "close message has been sent", "websocket.close")


def _is_disconnect(error: BaseException) -> bool:
    """True for what a vanished client makes the WebSocket stack raise (starlette says some of
    it with RuntimeError, e.g. 'Expected ASGI message "websocket.connect", but got
    'websocket.disconnect'' when the client aborts during the handshake)."""
    if isinstance(error, DISCONNECTS):
        return True
    return isinstance(error, RuntimeError) and any(words in str(error) for words in DISCONNECT_WORDS)


WS_MESSAGE_TYPES = ("reset", "step", "state", "close")
"""What a client may send on /ws. OpenEnv's "mcp" messages are refused: they expose the session
id, which its HTTP routes would let another client use."""


def _all_encodable(value: Any) -> bool:
    if isinstance(value, str):
        return _encodable(value)
    if isinstance(value, dict):
        return all(_encodable(k) and _all_encodable(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_all_encodable(v) for v in value)
    return True


class BearerToken:
    """ASGI middleware: with a token configured, every HTTP route but /health, and the WebSocket
    handshake, need `Authorization: Bearer <token>` (compared in constant time)."""

    OPEN_PATHS = ("/health",)

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("path") in self.OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", [])).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # refuse the handshake: HTTP 403
            return await send({"type": "websocket.close", "code": 1008, "reason": "missing or wrong bearer token"})
        body = json.dumps({"detail": "missing or wrong bearer token: send Authorization: Bearer <token>"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list, then: Any = None) -> Any:
    pending = list(messages)

    async def receive() -> Dict[str, Any]:
        if pending:
            return pending.pop(0)
        if then is None:
            return {"type": "http.disconnect"}
        return await then()

    return receive


def _serve_schema_once(app: FastAPI) -> None:
    """OpenEnv's `GET /schema` builds four JSON schemas for every request, 7 ms on the event
    loop: 8 connections asking for it as fast as it was answered made honest steps 12-23 times
    slower. The schemas never change while the server runs, so its answer is made once (by
    OpenEnv's own endpoint, encoded as FastAPI encodes it) and then sent as it is."""
    (route,) = [r for r in app.router.routes if getattr(r, "path", None) == "/schema"]
    app.router.routes.remove(route)
    body: List[bytes] = []

    async def schema() -> Response:
        if not body:
            body.append(JSONResponse(jsonable_encoder(await route.endpoint())).body)
        return Response(body[0], media_type="application/json")

    app.add_api_route(
        "/schema",
        schema,
        methods=["GET"],
        response_model=route.response_model,
        tags=route.tags,
        summary=route.summary,
        description=route.description,
        responses=route.responses,
        operation_id=route.unique_id,  # OpenAPI documents the route as before
    )


def create_cernenv_app(config: Optional[ServerConfig] = None) -> Any:
    """The ASGI app: OpenEnv's routes for `ServedEnvironment`, `/sessions`, and `MessageLimit` in front."""
    config = config or ServerConfig.from_env()
    count = EnvironmentCount()
    scheduler = FairScheduler()
    concurrency = ConcurrencyConfig(
        max_concurrent_envs=config.max_sessions, session_timeout=config.session_idle_timeout_s
    )
    app: FastAPI = create_app(
        functools.partial(ServedEnvironment, count, scheduler, config.secret_salt),
        WireAction,
        CollisionObservation,
        env_name="cernenv",
        concurrency_config=concurrency,
        state_cls=CernState,
    )
    # Sessions are made by the WebSocket alone: OpenEnv's /mcp routes create sessions over plain
    # HTTP (which filled every slot) and let a client holding a session id close or drive it.
    app.router.routes[:] = [route for route in app.router.routes if getattr(route, "path", None) != "/mcp"]
    _serve_schema_once(app)

    async def request_error(request: Request, error: RequestError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=error.status_code)

    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        """FastAPI's own handler echoes the input, which fails on text JSON cannot encode (500)."""
        details = [
            {
                "loc": [part if isinstance(part, int) else _printable(part) for part in e.get("loc", ())],
                "msg": _printable(e.get("msg", ""), 300),
                "type": e.get("type", ""),
            }
            for e in error.errors()
        ]
        return JSONResponse({"detail": details}, status_code=422)

    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(RequestValidationError, validation_error)

    @app.get("/sessions", tags=["Health"], summary="Open environments and the session limit")
    async def sessions() -> Dict[str, int]:
        return {"open_environments": count.open, "max_sessions": config.max_sessions}

    app.add_middleware(MessageLimit, max_bytes=config.max_message_bytes, idle_timeout_s=config.session_idle_timeout_s)
    if config.token:
        app.add_middleware(BearerToken, token=config.token)  # outermost: nothing runs for a stranger
    app.state.cernenv_config = config
    return app


app = create_cernenv_app()
