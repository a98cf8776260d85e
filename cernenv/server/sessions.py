"""The server's sessions: who made each, how many an address holds, when each last did work,
and the MCP tools a session is played with over `POST /mcp`.

OpenEnv's `HTTPEnvServer` makes a session for each WebSocket on `/ws` and for each
`openenv/session/create` call on `POST /mcp`, and keeps them in one table against
`max_sessions`. `GuardedEnvServer` is that server with the rules the CERNenv server adds:

- an address holds at most `max_per_address` sessions, WebSocket and MCP together;
- each session remembers its address, and an MCP call naming a session made from another
  address is answered as if the session did not exist (`owner_of`, used by `MessageLimit`);
- a session's activity is its environment's last reset or step (`ServedEnvironment.last_work`),
  the one clock by which it is idle. A WebSocket session's lifetime is its socket's, which
  `MessageLimit` closes after `session_idle_timeout_s` without work, and OpenEnv's reaper
  leaves it alone (by its own clock it would free the slot while the socket went on playing).
  MCP sessions, which have no socket, are reaped by OpenEnv's reaper on the same clock;
- sessions that end without a single step are paced per address (`AddressPacer`): past the
  free ones, a new session waits.

The request being served (its client address, its transport, its connection's message budget,
and the session's environment once made) travels in the context variable `REQUEST`, set by
`MessageLimit` for every request and read here and by `ServedEnvironment`.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from openenv.core.env_server.exceptions import SessionCapacityError
from openenv.core.env_server.http_server import HTTPEnvServer
from openenv.core.env_server.serialization import serialize_observation

from cernenv.models import ExperimentAction
from cernenv.scenarios import DIFFICULTIES, list_scenarios
from cernenv.server.pacing import WASTED_WORK_PAUSE_S, AddressPacer, MessageBudget
from cernenv.server.wire import RequestError, reset_problem


@dataclass
class RequestContext:
    """What the layers serving one request (or one WebSocket connection) share."""

    address: str
    transport: str  # "websocket" or "http"
    budget: MessageBudget = field(default_factory=MessageBudget)
    env: Any = None  # the session's environment, once `GuardedEnvServer` has made it


REQUEST: contextvars.ContextVar[Optional[RequestContext]] = contextvars.ContextVar("cernenv_request", default=None)


class SessionLimitError(SessionCapacityError):
    """A new session refused because its address holds its share."""


class GuardedEnvServer(HTTPEnvServer):
    """OpenEnv's `HTTPEnvServer` with the session rules of the module docstring; `create_cernenv_app`
    makes the server `create_app` built one of these (`adopt`)."""

    max_per_address: int
    stepless: AddressPacer
    _owners: Dict[str, str]
    _held: Counter

    @classmethod
    def adopt(cls, server: HTTPEnvServer, max_per_address: int, stepless: AddressPacer) -> "GuardedEnvServer":
        """`server` (made by OpenEnv's `create_app`, whose routes call its methods) under these rules."""
        server.__class__ = cls
        server.max_per_address = max_per_address
        server.stepless = stepless
        server._owners = {}
        server._held = Counter()
        return server  # type: ignore[return-value]

    _pause = staticmethod(asyncio.sleep)  # how a paced session waits (tests record it)

    def owner_of(self, session_id: Any) -> Optional[str]:
        """The address that made MCP session `session_id` (None: no such session, or a WebSocket's,
        which belongs to its socket alone)."""
        if not isinstance(session_id, str) or session_id in self._session_websocket_attachments:
            return None
        return self._owners.get(session_id)

    def held_by(self, address: str) -> int:
        return self._held[address]

    async def _create_session(self) -> tuple:
        request = REQUEST.get()
        address = request.address if request is not None else "?"
        wait_s = self.stepless.wait_s(address)
        if wait_s > 0.0:  # its address dropped too many sessions without a step: a tarpit
            await self._pause(wait_s)
        if self._held[address] >= self.max_per_address:
            raise SessionLimitError(
                len(self._sessions),
                self._max_concurrent_envs,
                message=f"{address} holds its limit of {self.max_per_address} sessions "
                f"(of {self._max_concurrent_envs} on this server); close one first",
            )
        self._held[address] += 1  # counted before the first await: concurrent requests see it
        try:
            session_id, env = await super()._create_session()
        except BaseException:
            self._release(address)
            raise
        self._owners[session_id] = address
        env.adopt_session(session_id, address)
        if request is not None and request.transport == "websocket":
            self._session_websocket_attachments.add(session_id)  # its socket's lifetime, not the reaper's
            request.env = env
        return session_id, env

    async def _cleanup_session_resources(self, env: Any, executor: Any, stack: Any = None) -> None:
        """Every way a session ends (its socket closes, `openenv/session/close`, the reaper) comes here."""
        address = self._owners.pop(getattr(env, "session_id", None), None) if env is not None else None
        try:
            await super()._cleanup_session_resources(env, executor, stack)
        finally:
            if address is not None:
                self._release(address)
                if not env.steps:
                    self.stepless.charge(address)

    def _release(self, address: str) -> None:
        self._held[address] -= 1
        if self._held[address] <= 0:
            del self._held[address]

    def _update_session_activity(self, session_id: str, increment_step: bool = False) -> None:
        """A session's activity is its environment's last reset or step, whatever was asked."""
        info, env = self._session_info.get(session_id), self._sessions.get(session_id)
        if info is not None and env is not None:
            info.last_activity_at = env.last_work_wall
            if increment_step:
                info.step_count += 1


def adopt_env_server(app: Any, max_per_address: int, stepless: AddressPacer) -> GuardedEnvServer:
    """The `HTTPEnvServer` behind `app`'s routes (found in their closures), made a `GuardedEnvServer`."""
    found = {
        id(cell.cell_contents): cell.cell_contents
        for route in app.router.routes
        for cell in (getattr(getattr(route, "endpoint", None), "__closure__", None) or ())
        if _cell_is_env_server(cell)
    }
    if len(found) != 1:
        raise RuntimeError(f"expected one OpenEnv HTTPEnvServer behind the routes, found {len(found)}")
    return GuardedEnvServer.adopt(next(iter(found.values())), max_per_address, stepless)


def _cell_is_env_server(cell: Any) -> bool:
    try:
        return isinstance(cell.cell_contents, HTTPEnvServer)
    except ValueError:  # an empty cell
        return False


# MCP ---------------------------------------------------------------------------------------

_RESET_SCHEMA = {
    "type": "object",
    "properties": {
        "seed": {"type": ["integer", "null"], "minimum": 0, "description": "the task's seed (null: a random one)"},
        "scenario": {
            "type": ["string", "null"],
            "enum": [*list_scenarios(), None],
            "description": "a curated campaign",
        },
        "difficulty": {
            "type": ["string", "null"],
            "enum": [*DIFFICULTIES, None],
            "description": "a procedural campaign of this difficulty",
        },
        "episode_id": {"type": ["string", "null"], "maxLength": 255},
    },
    "additionalProperties": False,
}

TOOLS: List[Dict[str, Any]] = [
    {
        "name": "new_campaign",
        "description": "Start a discovery campaign (ends any unfinished one). Returns the first observation, "
        "with the task: search window, channels, beams and resources.",
        "inputSchema": _RESET_SCHEMA,
    },
    {
        "name": "act",
        "description": "Run one action of the campaign (an ExperimentAction: action_type, parameters, "
        "justification). Returns the observation, the step's reward and whether the campaign is over; "
        "invalid actions come back as rule violations with their penalty.",
        "inputSchema": ExperimentAction.model_json_schema(),
    },
    {
        "name": "campaign_state",
        "description": "The campaign's bookkeeping (CernState): step count, rewards so far.",
        "inputSchema": {"type": "object", "properties": {}, "additionalProperties": False},
    },
]
WORK_TOOLS = ("new_campaign", "act")


class CampaignTools:
    """A session's environment as MCP tools, in the form OpenEnv's `/mcp` handler calls an
    environment's `mcp_client` (`list_tools`, `call_tool`): `new_campaign` resets, `act` steps,
    `campaign_state` reads the state, each through the same `ServedEnvironment` calls (and the
    same fair turns, surcharges and grade rules) as the WebSocket's. Calls that do no work past
    `FREE_MESSAGES_WITHOUT_WORK` in a row are paced as on the WebSocket."""

    def __init__(self, env: Any) -> None:
        self.env = env

    _pause = staticmethod(asyncio.sleep)

    def is_connected(self) -> bool:
        return True

    async def __aenter__(self) -> "CampaignTools":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        return None

    async def list_tools(self) -> List[Dict[str, Any]]:
        await self._idle()
        return [dict(tool) for tool in TOOLS]

    async def call_tool(self, name: Any, arguments: Any = None) -> Dict[str, Any]:
        arguments = {} if arguments is None else arguments
        if name not in WORK_TOOLS:
            await self._idle()
        if not isinstance(arguments, dict):
            raise RequestError("a tool's arguments are a JSON object")
        if name == "new_campaign":
            problem = reset_problem(arguments)
            if problem is not None:
                raise RequestError(problem)
            return serialize_observation(await self.env.reset_async(**arguments))
        if self.env.session_id is None:
            raise RequestError(
                "no session: create one with the method openenv/session/create and pass its session_id "
                "in the params of every call"
            )
        if name == "act":
            return serialize_observation(await self.env.step_async(arguments))
        if name == "campaign_state":
            return self.env.state.model_dump()
        raise RequestError(f"no tool {ascii(name)[:60]}; tools: {', '.join(t['name'] for t in TOOLS)}")

    async def _idle(self) -> None:
        if self.env.mcp_budget.idle():
            await self._pause(WASTED_WORK_PAUSE_S)
