"""The CERNenv server: OpenEnv's `create_app` around `CERNCollisionEnvironment`.

    python -m cernenv.server                  # 127.0.0.1:8000, evaluation mode; --help for the options
    python -m cernenv.server --mode training  # rewards served, worlds replayable: for training only

The app is served by `python -m cernenv.server` alone (`cernenv.server.guard.guarded_server`:
its listener, connection limits and protocol settings); under anything else (`uvicorn
cernenv.server.app:app`, `--factory`, another ASGI server) it refuses every request and its
start-up fails, rather than run without them.

Routes (from `openenv.core.env_server.create_app`, less its WebSocket `/mcp`, plus `/sessions`
and `/evaluation`):

| route | what it does |
|---|---|
| `WS /ws` | one session = one environment: messages `reset`, `step`, `state`, `close` |
| `POST /mcp` | MCP JSON-RPC: sessions (`openenv/session/create`, `.../close`), `tools/list`, `tools/call` |
| `GET /health`, `/metadata`, `/schema` | liveness; name and version; JSON schemas of action, observation, state |
| `POST /reset` | the first observation of a fresh environment (seed, scenario, difficulty), then forgotten |
| `POST /step`, `GET /state` | a fresh environment per request (OpenEnv 0.10): 409; the empty state |
| `GET /sessions` | environments open now and the session limits |
| `GET /evaluation` | the mode, the fingerprint of the evaluation secret, whether worlds are fresh and grades withheld |

What the server adds to the environment (`ServedEnvironment`): in evaluation mode (the
default) a fresh hidden world at every reset and no grade on the wire, each ended episode's
grade and truth written to the results ledger (`cernenv.server.evaluation`); a step before any
reset is an error rather than an implicit seed-0 episode; unknown or ill-typed reset
parameters are errors, with one rule for every transport (`cernenv.server.wire.reset_problem`);
`hidden_truth()` is refused; any JSON value sent as an action is judged by the environment's
rules, so malformed actions cost the same penalty as in process; all sessions' resets and steps
run on one thread, in fair turns in which work that gives an agent nothing new counts 8 times
and, while another session is open, is answered 0.1 s later (`NO_NEW_WORK_SURCHARGE`,
`WASTED_WORK_PAUSE_S`). Sessions follow the rules of `cernenv.server.sessions` (a share per
address, one idle clock, stepless sessions paced). `MessageLimit` bounds and checks what
clients send (`cernenv.server.wire`: size, nesting before parsing, encoding, reset types),
refuses WebSocket handshakes that would attach to an existing session or come from a foreign
`Origin`, paces messages that do no work, closes sessions idle for `session_idle_timeout_s`,
and paces HTTP requests per address. With `ServerConfig.token`, `BearerToken` refuses every
route but `/health` without `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import parse_qsl, urlsplit

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_types import JsonRpcErrorCode, JsonRpcResponse
from openenv.core.env_server.types import Action, ConcurrencyConfig
from pydantic import ConfigDict
from starlette.websockets import WebSocketDisconnect, WebSocketDisconnected
from uvicorn.protocols.utils import ClientDisconnected

from cernenv.client import RAW_ACTION_KEY
from cernenv.environment import CERNCollisionEnvironment
from cernenv.models import CernState, CollisionObservation, ExperimentAction
from cernenv.server.apidocs import serve_offline_docs
from cernenv.server.config import ServerConfig
from cernenv.server.evaluation import ResultsLedger, fingerprint
from cernenv.server.guard import BUDGET_EXTENSION, serving_guard
from cernenv.server.pacing import (
    FREE_MESSAGES_WITHOUT_WORK,
    FREE_STEPS_ON_UNCHANGED_DATA,
    HTTP_MAX_WAIT_S,
    HTTP_REQUEST_BURST,
    HTTP_REQUESTS_PER_S,
    NO_NEW_WORK_SURCHARGE,
    STEPLESS_SESSION_BURST,
    STEPLESS_SESSIONS_PER_S,
    WASTED_WORK_PAUSE_S,
    AddressPacer,
    MessageBudget,
    events,
)
from cernenv.server.scheduler import FairScheduler
from cernenv.server.sessions import REQUEST, CampaignTools, GuardedEnvServer, RequestContext, adopt_env_server
from cernenv.server.wire import (
    RESET_PARAMETERS,
    NoEpisodeError,
    RequestError,
    all_encodable,
    error_frame,
    printable,
    reset_problem,
    too_deep,
)

__all__ = [
    "FREE_MESSAGES_WITHOUT_WORK",
    "FREE_STEPS_ON_UNCHANGED_DATA",
    "HTTP_MAX_WAIT_S",
    "HTTP_REQUEST_BURST",
    "HTTP_REQUESTS_PER_S",
    "NO_NEW_WORK_SURCHARGE",
    "STEPLESS_SESSION_BURST",
    "STEPLESS_SESSIONS_PER_S",
    "WASTED_WORK_PAUSE_S",
    "AddressPacer",
    "EnvironmentCount",
    "MessageLimit",
    "NoEpisodeError",
    "RequestError",
    "ServedEnvironment",
    "ServerConfig",
    "create_cernenv_app",
]

logger = logging.getLogger("cernenv.server")


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
    """`CERNCollisionEnvironment` as one server session runs it (see the module docstring).

    `evaluation`: fresh hidden worlds and grades withheld (the environment's `fresh_worlds` and
    `withhold_grades`), each ended episode recorded in `ledger`. `session_id` and `client` are
    set when the environment becomes a session's (`adopt_session`); `steps` counts the steps it
    ran and `last_work` (monotonic) / `last_work_wall` (epoch) the time of its last reset or step:
    the session's activity."""

    RESET_PARAMETERS = RESET_PARAMETERS
    # Every session's reset and step run on one shared thread (`FairScheduler`: least recent CPU time
    # used first). The physics holds the GIL, so a thread per session only adds contention: at 32
    # sessions it doubled the server's CPU time per episode (170 vs 87 ms) and cut throughput by a
    # third (bench/bench_server.py). OpenEnv awaits `reset_async`/`step_async` (overridden below)
    # and creates and closes environments on its own single thread.
    REQUIRES_SINGLE_THREAD_EXECUTOR = True

    def __init__(
        self,
        count: EnvironmentCount,
        scheduler: FairScheduler,
        secret_salt: str = "",
        *,
        evaluation: bool = False,
        ledger: Optional[ResultsLedger] = None,
    ) -> None:
        super().__init__(secret_salt=secret_salt or None, fresh_worlds=evaluation, withhold_grades=evaluation)
        self._count = count
        self._scheduler = scheduler
        self._closed = False
        self._evaluation = evaluation
        self._ledger = ledger
        self._secret_fingerprint = fingerprint(secret_salt) if secret_salt else None
        self._steps_on_unchanged_data = 0  # steps in a row since the episode's data last changed
        self._reset_wasted_episode = False  # the last reset cut short an episode, or one without data
        self.session_id: Optional[str] = None
        self.client: Optional[str] = None
        self.steps = 0
        self.last_work, self.last_work_wall = time.monotonic(), time.time()
        self.mcp_budget = MessageBudget()
        count.change(+1)

    def adopt_session(self, session_id: str, client: str) -> None:
        """This environment is session `session_id`'s, made from address `client`."""
        self.session_id, self.client = session_id, client

    @property
    def mcp_client(self) -> CampaignTools:
        """The session's MCP tools, as OpenEnv's `/mcp` handler calls them."""
        return CampaignTools(self)

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
        observation = await self._run(
            functools.partial(self.step, action, timeout_s=timeout_s, **kwargs), self.step_surcharge
        )
        self.steps += 1
        return observation

    async def _run(
        self, job: Callable[[], CollisionObservation], surcharge: Callable[[CollisionObservation], float]
    ) -> CollisionObservation:
        """`job` on the physics thread in this session's turn, charged by `surcharge`; while
        another session is open, the answer to a surcharged job waits `WASTED_WORK_PAUSE_S`. A job
        that ran is the session's activity (and starts its connection's count of messages without
        work again)."""
        factors: List[float] = []

        def charge_factor(observation: CollisionObservation) -> float:
            factors.append(surcharge(observation))  # on the physics thread, before `run` returns
            return factors[-1]

        observation = await self._scheduler.run(self, job, surcharge=charge_factor)
        self.last_work, self.last_work_wall = time.monotonic(), time.time()
        self.mcp_budget.work()
        request = REQUEST.get()
        if request is not None:
            request.budget.work()
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
        arguments = dict(seed=seed, episode_id=episode_id, scenario=scenario, difficulty=difficulty)
        arguments.update(secret_salt=secret_salt, **unknown)
        problem = reset_problem(arguments)
        if problem is not None:
            raise RequestError(problem)
        previous = self._episode
        wasted = previous is not None and (not previous.done or previous.data_version == 0)
        if previous is not None and not previous.done:
            self._record("abandoned: reset")
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
                "WebSocket /ws (cernenv.client.CERNEnvClient) or in an MCP session"
            )
        if isinstance(action, WireAction):
            action = action.unwrap()
        data_before, was_done = self._episode.data_version, self._episode.done
        observation = super().step(action, timeout_s=timeout_s, **kwargs)
        changed = self._episode is None or self._episode.data_version != data_before
        self._steps_on_unchanged_data = 0 if changed else self._steps_on_unchanged_data + 1
        if self._episode.done and not was_done:
            self._record(observation.latest_result.get("episode_end") or "claim")
        return observation

    def hidden_truth(self) -> Dict[str, Any]:
        raise PermissionError(
            "the hidden truth is not served; the operator's results ledger holds it once the episode has ended"
        )

    def _record(self, ended: str) -> None:
        """One line in the results ledger for the episode that just ended (`ended`: the claim,
        the reason the campaign stopped, or how it was abandoned): where it was played (`session_id`,
        `client`), what it was (`episode_id`, `seed`, `scenario`, `difficulty`, `world_nonce`, the
        `secret_fingerprint`), `steps`, the `grade` (`episode_grade()`: None if abandoned) and the
        `truth`. Only a session's episodes are recorded (not HTTP's one-off resets)."""
        if self._ledger is None or self.session_id is None or self._episode is None:
            return
        episode, state = self._episode, self.state
        record = {
            "mode": "evaluation" if self._evaluation else "training",
            "secret_fingerprint": self._secret_fingerprint,
            "session_id": self.session_id,
            "client": self.client,
            "episode_id": state.episode_id,
            "seed": episode.seed,
            "scenario": state.scenario_name,
            "difficulty": state.difficulty,
            "world_nonce": self.world_nonce(),
            "steps": state.step_count,
            "ended": ended,
            "grade": self.episode_grade(),
            "truth": CERNCollisionEnvironment.hidden_truth(self),
        }
        try:
            self._ledger.append(record)
        except OSError as error:  # the operator must hear of it; the agent's session goes on
            logger.error("could not record an ended episode in the results ledger: %s", error)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._episode is not None and not self._episode.done:
                self._record("abandoned: session ended")
            self._count.change(-1)
            self._scheduler.forget(self)
        super().close()


class MessageLimit:
    """ASGI middleware: bounds and checks what a client may send, and answers what OpenEnv would not.

    Every request runs with a `RequestContext` (`REQUEST`) that names its client address, the
    transport's peer (or, behind a trusted proxy, the client it names).

    WebSocket: a handshake that names a `session_id` (attaching to another connection's session)
    or comes from a foreign `Origin` is refused (HTTP 403); a message over `max_bytes`, a binary
    frame, text that is not JSON (nested deeper than `MAX_JSON_DEPTH`, an integer over Python's
    4,300 digits), JSON that is not an object, an unknown message type or a string that is not
    UTF-8 gets an OpenEnv-style error frame and is dropped; the session goes on. Messages that do
    no work (refused frames, errors the app answers, `state` requests, and the pings and pongs the
    protocol counts in the same `MessageBudget`) beyond `FREE_MESSAGES_WITHOUT_WORK` in a row
    each wait `WASTED_WORK_PAUSE_S`. A session whose environment has not reset or stepped for
    `idle_timeout_s` is closed (1001).

    HTTP: an address's requests beyond `HTTP_REQUEST_BURST` wait their turn at
    `HTTP_REQUESTS_PER_S`, or, if it is more than `HTTP_MAX_WAIT_S` away, get 429 after that long;
    a body over `max_bytes` gets 413; a body that is not UTF-8 or nests too deep 400; `POST
    /reset` arguments follow `reset_problem` (400) and must be a JSON object (422); an MCP call
    naming a session made from another address is answered as for an unknown session."""

    def __init__(
        self,
        app: Any,
        max_bytes: int,
        idle_timeout_s: Optional[float] = None,
        allowed_origins: Tuple[str, ...] = (),
        sessions: Optional[GuardedEnvServer] = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout_s = idle_timeout_s
        self.allowed_origins = frozenset(allowed_origins)
        self.sessions = sessions
        self.http_requests = AddressPacer(HTTP_REQUEST_BURST, HTTP_REQUESTS_PER_S)

    _pause = staticmethod(asyncio.sleep)  # how a paced message waits (tests record it)

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] == "http":
            return await self._http(scope, receive, send)
        return await self.app(scope, receive, send)

    # WebSocket -----------------------------------------------------------------------------

    async def _websocket(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        client = scope.get("client") or ("?", 0)
        refusal = self._handshake_refusal(scope)
        if refusal is not None:
            event, reason = refusal
            events.note(event)
            return await send({"type": "websocket.close", "code": 1008, "reason": reason})
        budget = (scope.get("extensions") or {}).get(BUDGET_EXTENSION) or MessageBudget()
        context = RequestContext(client[0], "websocket", budget)
        token = REQUEST.set(context)
        try:
            receive, send = self._guarded_receive(receive, send, context), self._guarded_send(send, context)
            return await self.app(scope, receive, send)
        except Exception as error:
            if not _is_disconnect(error):
                raise
            events.note("WebSocket connections dropped mid-exchange")  # counted, not a traceback
        finally:
            REQUEST.reset(token)
        return None

    def _handshake_refusal(self, scope: Dict[str, Any]) -> Optional[Tuple[str, str]]:
        """(event, reason) for a WebSocket handshake that is refused, or None."""
        if any(name == "session_id" for name, _ in parse_qsl(scope.get("query_string", b"").decode("latin-1"))):
            return (
                "WebSocket handshakes refused: attaching to a session by id",
                "a session belongs to the connection that made it: open a WebSocket without session_id",
            )
        if not self._origin_allowed(scope):
            return "WebSocket handshakes refused: foreign Origin", "this Origin may not use the server"
        return None

    def _origin_allowed(self, scope: Dict[str, Any]) -> bool:
        """No `Origin` (a program, not a browser page), the server's own, or one of `allowed_origins`."""
        headers = dict(scope.get("headers") or [])
        origin = headers.get(b"origin")
        if origin is None:
            return True
        text = origin.decode("latin-1").rstrip("/")
        if text in self.allowed_origins:
            return True
        host = headers.get(b"host")
        return host is not None and urlsplit(text).netloc.lower() == host.decode("latin-1").lower()

    def _guarded_receive(self, receive: Any, send: Any, context: RequestContext) -> Any:
        """`receive` for the app, with the checks above."""
        connected = time.monotonic()

        async def guarded() -> Dict[str, Any]:
            while True:  # one client message per turn: the client, not the server, drives this loop
                timeout_s = None
                if self.idle_timeout_s is not None:  # idle: no reset or step for idle_timeout_s
                    last_work = context.env.last_work if context.env is not None else connected
                    timeout_s = max(0.0, last_work + self.idle_timeout_s - time.monotonic())
                try:
                    message = await asyncio.wait_for(receive(), timeout_s)
                except asyncio.TimeoutError:  # close, and let the app free the session
                    await send(
                        {
                            "type": "websocket.close",
                            "code": 1001,
                            "reason": f"idle: no reset or step for {self.idle_timeout_s:g} s",
                        }
                    )
                    return {"type": "websocket.disconnect", "code": 1001}
                if message["type"] != "websocket.receive":
                    return message
                problem, message_type = self._problem(message)
                if (problem is not None or message_type == "state") and context.budget.idle():
                    await self._pause(WASTED_WORK_PAUSE_S)  # a tarpit, as for wasted physics work
                if problem is None:
                    return message
                await send({"type": "websocket.send", "text": json.dumps(error_frame(**problem))})

        return guarded

    def _guarded_send(self, send: Any, context: RequestContext) -> Any:
        """`send` for the app: its error frames count as messages without work, and are paced."""

        async def guarded(message: Dict[str, Any]) -> None:
            if message.get("type") == "websocket.send" and (message.get("text") or "").startswith('{"type":"error"'):
                if context.budget.idle():
                    await self._pause(WASTED_WORK_PAUSE_S)
            await send(message)

        return guarded

    def _problem(self, message: Dict[str, Any]) -> Tuple[Optional[Dict[str, str]], Optional[str]]:
        """(the error frame's code and message, or None for a message the app may have; the
        message's type, or None where it has none)."""
        text = message.get("text")
        if text is None:
            return {"code": "VALIDATION_ERROR", "message": "send JSON text frames, not binary ones"}, None
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            return {
                "code": "MESSAGE_TOO_LARGE",
                "message": f"message of {size} bytes is over the server's limit of {self.max_bytes} bytes",
            }, None
        deep = too_deep(text)
        if deep is not None:
            return {"code": "INVALID_JSON", "message": f"Invalid JSON: {deep}"}, None
        try:  # parsed here too: OpenEnv's handler lets huge integers end the session
            value = json.loads(text)
        except (ValueError, RecursionError) as error:
            return {
                "code": "INVALID_JSON",
                "message": f"Invalid JSON ({type(error).__name__}): {printable(str(error), 200)}",
            }, None
        if not isinstance(value, dict):
            return {
                "code": "VALIDATION_ERROR",
                "message": f'a message is a JSON object {{"type": ..., "data": ...}}, got {type(value).__name__}',
            }, None
        if value.get("type") not in WS_MESSAGE_TYPES:
            return {
                "code": "UNKNOWN_TYPE",
                "message": f"Unknown message type {printable(value.get('type'))}; "
                f"send one of {', '.join(WS_MESSAGE_TYPES)}",
            }, None
        if not all_encodable(value):
            return {"code": "VALIDATION_ERROR", "message": "strings must be valid UTF-8 (no lone surrogates)"}, None
        return None, value["type"]

    # HTTP ------------------------------------------------------------------------------------

    async def _http(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        address = (scope.get("client") or ("?", 0))[0]
        if not self._origin_allowed(scope):
            events.note("HTTP requests refused: foreign Origin (403)")
            return await _answer(send, 403, {"detail": "this Origin may not use the server"})
        self.http_requests.charge(address)  # first: concurrent requests of an address queue up
        wait_s = self.http_requests.wait_s(address)
        if wait_s > HTTP_MAX_WAIT_S:
            self.http_requests.charge(address, -1.0)
            await self._pause(HTTP_MAX_WAIT_S)
            return await self._too_many(send, address)
        if wait_s > 0.0:
            await self._pause(wait_s)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(send, int(length))
        chunks, size = [], 0  # the whole body (at most max_bytes), checked, then replayed to the app
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(send, size)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        answer = self._body_problem(scope, body, address)
        if answer is not None:
            return await _answer(send, *answer)
        token = REQUEST.set(RequestContext(address, "http"))
        try:
            return await self.app(scope, _replay([{"type": "http.request", "body": body}], receive), send)
        finally:
            REQUEST.reset(token)

    def _body_problem(self, scope: Dict[str, Any], body: bytes, address: str) -> Optional[Tuple[int, Any]]:
        """(status, JSON answer) for a request body refused here, or None."""
        if not body:
            return None
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            return 400, {"detail": "a request body is UTF-8 JSON"}
        deep = too_deep(text)
        if deep is not None:
            return 400, {"detail": deep}
        path, method = scope.get("path"), scope.get("method")
        if method != "POST" or path not in ("/reset", "/step", "/mcp"):
            return None
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            if path == "/mcp":
                return None  # OpenEnv answers with a JSON-RPC parse error
            return 422, {"detail": "the request body is not JSON"}
        if not all_encodable(value):
            return 400, {"detail": "strings must be valid UTF-8 (no lone surrogates)"}
        if path == "/reset":
            if not isinstance(value, dict):
                return 422, {"detail": "reset arguments are a JSON object"}
            problem = reset_problem(value)
            return None if problem is None else (400, {"detail": problem})
        if path == "/mcp" and isinstance(value, dict) and isinstance(value.get("params"), dict):
            session_id = value["params"].get("session_id")
            if session_id is not None and (self.sessions is None or self.sessions.owner_of(session_id) != address):
                events.note("MCP calls refused: a session made from another address")
                request_id = value.get("id") if isinstance(value.get("id"), (str, int)) else None
                message = f"Unknown session_id: {printable(session_id)}"
                error = JsonRpcResponse.error_response(JsonRpcErrorCode.INVALID_PARAMS, message, request_id=request_id)
                return 200, error.model_dump()
        return None

    async def _too_many(self, send: Any, address: str) -> None:
        detail = (
            f"too many HTTP requests from {address}: {HTTP_REQUEST_BURST} at once, then "
            f"{HTTP_REQUESTS_PER_S:g} a second; try again in a second, or play over the WebSocket (/ws)"
        )
        await _answer(send, 429, {"detail": detail}, [(b"retry-after", b"1")])

    async def _too_large(self, send: Any, size: int) -> None:
        detail = f"request body of {size} bytes is over the server's limit of {self.max_bytes} bytes"
        await _answer(send, 413, {"detail": detail})


async def _answer(send: Any, status: int, content: Any, headers: Optional[List[Tuple[bytes, bytes]]] = None) -> None:
    """A whole JSON response."""
    body = json.dumps(content).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + list(headers or [])})
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
"""What a client may send on /ws. OpenEnv's "mcp" messages are refused: they reveal the session
id; MCP is served on `POST /mcp`, in sessions of its own."""


class RequireGuard:
    """ASGI middleware, outermost: the app serves only in a process running `guarded_server`
    (`python -m cernenv.server`). Under plain uvicorn (or any other server) its start-up fails
    with a message that says how to start it, and every request is refused (HTTP 503, WebSocket
    handshake 403), so that it never runs without its listener, limits and protocol settings."""

    MESSAGE = (
        "the CERNenv server runs under its guard only: start it with `python -m cernenv.server` "
        "(or `make serve`, or the container), not with plain uvicorn or another ASGI server"
    )

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if serving_guard() is not None:
            return await self.app(scope, receive, send)
        return await self.refuse(scope, receive, send)

    @classmethod
    async def refuse(cls, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            message = await receive()
            if message["type"] == "lifespan.startup":
                logger.error("%s", cls.MESSAGE)
                await send({"type": "lifespan.startup.failed", "message": cls.MESSAGE})
            return None
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1011, "reason": "not served under its guard"})
        if scope["type"] == "http":
            return await _answer(send, 503, {"detail": cls.MESSAGE})
        return None


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


def create_cernenv_app(config: Optional[ServerConfig] = None, *, require_guard: bool = True) -> Any:
    """The ASGI app: OpenEnv's routes for `ServedEnvironment` under `GuardedEnvServer`'s session
    rules, `POST /mcp`, `/sessions`, `/evaluation`, and `MessageLimit` (and `BearerToken`) in front.
    `require_guard=False` serves it without `guarded_server`: for in-process tests only."""
    config = config or ServerConfig.from_env()
    count = EnvironmentCount()
    scheduler = FairScheduler()
    ledger = ResultsLedger(Path(config.results_ledger)) if config.results_ledger else None
    concurrency = ConcurrencyConfig(
        max_concurrent_envs=config.max_sessions, session_timeout=config.session_idle_timeout_s
    )
    app: FastAPI = create_app(
        functools.partial(
            ServedEnvironment, count, scheduler, config.secret_salt, evaluation=config.evaluation, ledger=ledger
        ),
        WireAction,
        CollisionObservation,
        env_name="cernenv",
        concurrency_config=concurrency,
        state_cls=CernState,
    )
    sessions = adopt_env_server(
        app, config.sessions_per_client, AddressPacer(STEPLESS_SESSION_BURST, STEPLESS_SESSIONS_PER_S)
    )
    # MCP is served over HTTP (`POST /mcp`), in sessions `GuardedEnvServer` counts; OpenEnv's
    # WebSocket /mcp would be a second kind of socket session for no client that needs it.
    app.router.routes[:] = [
        route
        for route in app.router.routes
        if not (getattr(route, "path", None) == "/mcp" and not getattr(route, "methods", None))
    ]
    _serve_schema_once(app)
    serve_offline_docs(app)  # /docs and /redoc without a CDN (cernenv/server/apidocs.py)

    async def request_error(request: Request, error: RequestError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=error.status_code)

    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        """FastAPI's own handler echoes the input, which fails on text JSON cannot encode (500)."""
        details = [
            {
                "loc": [part if isinstance(part, int) else printable(part) for part in e.get("loc", ())],
                "msg": printable(e.get("msg", ""), 300),
                "type": e.get("type", ""),
            }
            for e in error.errors()
        ]
        return JSONResponse({"detail": details}, status_code=422)

    app.add_exception_handler(RequestError, request_error)
    app.add_exception_handler(RequestValidationError, validation_error)

    @app.get("/sessions", tags=["Health"], summary="Open environments and the session limits")
    async def open_sessions() -> Dict[str, int]:
        return {
            "open_environments": count.open,
            "max_sessions": config.max_sessions,
            "max_sessions_per_client": config.sessions_per_client,
        }

    @app.get("/evaluation", tags=["Environment Info"], summary="How this server grades")
    async def evaluation() -> Dict[str, Any]:
        """The mode, the fingerprint of the evaluation secret (never the secret), and what the
        mode does to worlds and grades."""
        return {
            "mode": config.mode,
            "secret_fingerprint": config.secret_fingerprint,
            "fresh_worlds": config.evaluation,
            "grades": "withheld: recorded for the operator when each episode ends"
            if config.evaluation
            else "served in observations and state (training mode: not for scoring)",
        }

    app.add_middleware(
        MessageLimit,
        max_bytes=config.max_message_bytes,
        idle_timeout_s=config.session_idle_timeout_s,
        allowed_origins=config.origins,
        sessions=sessions,
    )
    if config.token:
        app.add_middleware(BearerToken, token=config.token)  # nothing runs for a stranger
    if require_guard:
        app.add_middleware(RequireGuard)  # outermost
    app.state.cernenv_config = config
    app.state.cernenv_sessions = sessions
    return app


async def app(scope: Dict[str, Any], receive: Any, send: Any) -> None:
    """What `uvicorn cernenv.server.app:app` (or the manifest of an older release) finds: a
    refusal (`RequireGuard.refuse`: start-up fails, every request is refused). `python -m
    cernenv.server` builds and serves the real app under its guard."""
    await RequireGuard.refuse(scope, receive, send)
