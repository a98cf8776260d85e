"""The ASGI layers the server puts around OpenEnv's app: `MessageLimit` (what clients may send,
how fast, and for how long a session may idle), `RequireGuard` (every request refused unless the
app runs under `python -m cernenv.server`'s guard) and `BearerToken` (a token on every route but
`/health`)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import parse_qsl, urlsplit

from openenv.core.env_server.mcp_types import JsonRpcErrorCode, JsonRpcResponse
from starlette.websockets import WebSocketDisconnect, WebSocketDisconnected
from uvicorn.protocols.utils import ClientDisconnected

from cernenv.server.guard import BUDGET_EXTENSION, serving_guard
from cernenv.server.pacing import (
    HTTP_MAX_WAIT_S,
    HTTP_REQUEST_BURST,
    HTTP_REQUESTS_PER_S,
    WASTED_WORK_PAUSE_S,
    AddressPacer,
    MessageBudget,
    events,
)
from cernenv.server.sessions import REQUEST, GuardedEnvServer, RequestContext
from cernenv.server.wire import (
    all_encodable,
    error_frame,
    printable,
    reset_problem,
    too_deep,
)

logger = logging.getLogger("cernenv.server")


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
