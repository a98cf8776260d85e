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
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.types import Action, ConcurrencyConfig
from pydantic import ConfigDict

from cernenv.client import RAW_ACTION_KEY
from cernenv.environment import CERNCollisionEnvironment
from cernenv.models import CernState, CollisionObservation, ExperimentAction
from cernenv.server.apidocs import serve_offline_docs
from cernenv.server.config import ServerConfig
from cernenv.server.evaluation import ResultsLedger, fingerprint
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
    MessageBudget,
)
from cernenv.server.scheduler import FairScheduler
from cernenv.server.sessions import REQUEST, CampaignTools, adopt_env_server
from cernenv.server.wire import (
    RESET_PARAMETERS,
    NoEpisodeError,
    RequestError,
    printable,
    reset_problem,
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
