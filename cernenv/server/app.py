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
| `GET /evaluation` | the mode, the fingerprint, fresh worlds, withheld grades, a scored run's progress, its head |
| `POST /evaluation/nonce` | a scored run's entrant's nonce (once, before its first reset), its agent, its key |
| `POST /evaluation/end` | a scored run ended by its entrant (signed with its key) |
| `GET /` | a page: the server, its version and mode, how to play on it at its address; `GET /docs`: every route |
| `GET /web` | OpenEnv's web UI where `ENABLE_WEB_INTERFACE` is set, else a redirect to `/` |

What the server adds to the environment (`ServedEnvironment`): in evaluation mode (the
default) a fresh hidden world at every reset and no grade on the wire, each ended episode's
grade, truth and actions written to the results ledger (`cernenv.server.ledger`), and with
`--scored-run` the tasks assigned by the server and their worlds committed to before play, in a
ledger of the run's own whose lines chain (`cernenv.server.runs`); a step before any
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

import functools
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.types import ConcurrencyConfig
from pydantic import BaseModel, ConfigDict
from starlette.middleware.trustedhost import TrustedHostMiddleware

from cernenv._version import __version__
from cernenv.models import CernState, CollisionObservation
from cernenv.server.apidocs import SERVER_DESCRIPTION, serve_offline_docs
from cernenv.server.config import ServerConfig
from cernenv.server.ledger import ResultsLedger
from cernenv.server.middleware import BearerToken, MessageLimit, RequireGuard
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
)
from cernenv.server.runs import RUN_END_REASONS, ScoredRun
from cernenv.server.scheduler import FairScheduler
from cernenv.server.served import EnvironmentCount, ServedEnvironment, WireAction
from cernenv.server.sessions import adopt_env_server
from cernenv.server.wire import (
    NoEpisodeError,
    RequestError,
    printable,
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
    run, ledger, secret = None, None, config.secret_salt
    if config.scored_run:
        if not config.results_ledger or not config.evaluation:
            raise ValueError("a scored run needs evaluation mode and a results ledger")
        run = ScoredRun(config.scored_run, Path(config.results_ledger))  # its ledger, a file of its own
        ledger, secret = run.ledger, ""  # every session plays the run's worlds, drawn with the run's secret
    elif config.results_ledger:
        ledger = ResultsLedger(Path(config.results_ledger), int(config.ledger_max_mib * 2**20))
    concurrency = ConcurrencyConfig(
        max_concurrent_envs=config.max_sessions, session_timeout=config.session_idle_timeout_s
    )
    app: FastAPI = create_app(
        functools.partial(
            ServedEnvironment,
            count,
            scheduler,
            secret,
            evaluation=config.evaluation,
            ledger=ledger,
            run=run,
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
    app.title, app.description = "CERNenv", SERVER_DESCRIPTION  # OpenEnv's says to loop over POST /step
    app.version = __version__  # OpenEnv's create_app says 1.0.0, whatever the environment
    for route in app.router.routes:
        if getattr(route, "path", None) == "/step":
            route.description = (
                "Over HTTP each request gets a fresh environment, which has no episode: this answers 409. "
                "Play episodes on the WebSocket WS /ws (or in an MCP session, POST /mcp)."
            )

    def record_unfinished_episodes() -> None:
        """At shutdown, after the sockets closed (their episodes recorded as their sessions
        ended): the episodes still open in MCP sessions, then the scored run's end."""
        for env in list(sessions._sessions.values()):
            if env is not None:
                env.record_unfinished("abandoned: server shut down")
        if run is not None:
            run.end(RUN_END_REASONS[1])

    def close_ledger() -> None:
        """Last at shutdown: the ledger closed, its lock released for the next server."""
        if ledger is not None:
            ledger.close()

    app.router.on_shutdown.insert(0, record_unfinished_episodes)
    app.router.on_shutdown.append(close_ledger)
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
        """The mode, the fingerprint of the secret worlds are drawn with (never the secret: a scored
        run's own), what the mode does to worlds and grades, and the scored run: its progress and
        its commitment, published before the first reset."""
        return {
            "mode": config.mode,
            "secret_fingerprint": run.secret_fingerprint if run is not None else config.secret_fingerprint,
            "fresh_worlds": config.evaluation,
            "grades": "withheld: recorded for the operator when each episode ends"
            if config.evaluation
            else "served in observations and state (training mode: not for scoring)",
            "scored_run": run.describe() if run is not None else None,
        }

    @app.post(
        "/evaluation/nonce", tags=["Environment Info"], summary="The entrant's nonce, mixed into a scored run's worlds"
    )
    async def entrant_nonce(body: EntrantNonce) -> Dict[str, Any]:
        """Once per scored run, after reading its commitment (`GET /evaluation`) and before the first
        reset: the entrant's nonce, mixed with the operator's committed secret into the secret every
        world of the run is drawn with (neither side chooses the worlds alone). Answers what
        `/evaluation` says of the run; 409 when the run already has its nonce, 404 without a run."""
        if run is None:
            error = RequestError("this server plays no scored run: it takes no entrant's nonce")
            error.status_code = 404
            raise error
        return run.seed(body.nonce, body.model_dump(exclude={"nonce"}))

    @app.post("/evaluation/end", tags=["Environment Info"], summary="A scored run ended by its entrant")
    async def end_run(body: EndRun) -> Dict[str, Any]:
        """The entrant ends its scored run (the tasks it did not play count as failures), signed with
        the key that sent its nonce (`cernenv.server.runs.end_statement`): the run's end line is then
        served by `/evaluation`, and the entrant's receipts cover the run to its end. Answers what
        `/evaluation` says of the run; 403 for anyone else, 404 without a run."""
        if run is None:
            error = RequestError("this server plays no scored run")
            error.status_code = 404
            raise error
        return run.end_by_entrant(body.signature)

    app.add_middleware(
        MessageLimit,
        max_bytes=config.max_message_bytes,
        idle_timeout_s=config.session_idle_timeout_s,
        allowed_origins=config.origins,
        sessions=sessions,
    )
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(config.hosts), www_redirect=False)
    if config.token:
        app.add_middleware(BearerToken, token=config.token)  # nothing runs for a stranger
    if require_guard:
        app.add_middleware(RequireGuard)  # outermost
    app.state.cernenv_config = config
    app.state.cernenv_sessions = sessions
    app.state.cernenv_run = run
    app.state.cernenv_ledger = ledger
    return app


class EntrantNonce(BaseModel):
    """The body of `POST /evaluation/nonce`: the nonce, what plays (`agent`, `agent_sha256`), and the
    entrant's Ed25519 `public_key` with its `signature` of them (`cernenv.server.runs.entrant_statement`)."""

    model_config = ConfigDict(extra="forbid")
    nonce: str
    agent: Optional[str] = None
    agent_sha256: Optional[str] = None
    public_key: Optional[str] = None
    signature: Optional[str] = None


class EndRun(BaseModel):
    """The body of `POST /evaluation/end`: the entrant's signature of `end_statement(run_id)`."""

    model_config = ConfigDict(extra="forbid")
    signature: str


async def app(scope: Dict[str, Any], receive: Any, send: Any) -> None:
    """What `uvicorn cernenv.server.app:app` (or the manifest of an older release) finds: a
    refusal (`RequireGuard.refuse`: start-up fails, every request is refused). `python -m
    cernenv.server` builds and serves the real app under its guard."""
    await RequireGuard.refuse(scope, receive, send)
