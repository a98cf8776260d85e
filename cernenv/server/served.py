"""One server session's environment: `ServedEnvironment` (`CERNCollisionEnvironment` as a
session runs it: fresh hidden worlds and withheld grades in evaluation mode, the results ledger,
strict reset parameters, fair turns on the physics thread), the `WireAction` a step message
carries, and the `EnvironmentCount` of an app. `cernenv.server.app` serves them."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from openenv.core.env_server.types import Action
from pydantic import BaseModel, ConfigDict

from cernenv.client import RAW_ACTION_KEY
from cernenv.environment import CERNCollisionEnvironment
from cernenv.models import CollisionObservation, ExperimentAction
from cernenv.server.evaluation import fingerprint
from cernenv.server.ledger import ResultsLedger, utc_now
from cernenv.server.pacing import (
    FREE_STEPS_ON_UNCHANGED_DATA,
    NO_NEW_WORK_SURCHARGE,
    WASTED_WORK_PAUSE_S,
    MessageBudget,
)
from cernenv.server.runs import ScoredRun, unscored_reset_problem
from cernenv.server.scheduler import FairScheduler
from cernenv.server.sessions import REQUEST, CampaignTools
from cernenv.server.wire import RESET_PARAMETERS, NoEpisodeError, RequestError, reset_problem

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


MAX_RECORDED_ACTION_BYTES = 16 * 1024
"""The largest action [bytes of its JSON, UTF-8] a server that records actions (a results ledger)
takes: every action goes into the ledger, which replays the episode. The longest valid action (a
justification of 2,000 characters of 4 bytes each) takes under 9 KiB."""


def recordable_action(action: Any) -> Any:
    """`action` as the ledger records it: the JSON value the client sent (a model as its JSON)."""
    return action.model_dump(mode="json") if isinstance(action, BaseModel) else action


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
        run: Optional[ScoredRun] = None,
    ) -> None:
        if run is not None:  # a scored run's worlds are drawn with its own secret, given at each reset
            secret_salt = ""
        super().__init__(secret_salt=secret_salt or None, fresh_worlds=evaluation, withhold_grades=evaluation)
        self._count = count
        self._scheduler = scheduler
        self._closed = False
        self._evaluation = evaluation
        self._ledger = ledger
        self._scored_run = run
        self._task_index: Optional[int] = None  # the scored run's task the episode plays
        self._assignment: Optional[int] = None  # its place in the order the run hands tasks out
        self._actions: List[Any] = []  # every action of the episode, as sent (the ledger replays them)
        self._record_lock = threading.Lock()  # one ledger line per episode, whichever end comes first
        self._recorded: Optional[object] = None  # the episode last recorded
        self._last_observation: Optional[CollisionObservation] = None
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
        if problem is None and self._scored_run is not None:
            problem = unscored_reset_problem(arguments, self._scored_run)
        if problem is not None:
            raise RequestError(problem)
        if self._ledger is not None and self._ledger.full and self._scored_run is None:
            raise RequestError(
                "this server's results ledger is full: nothing more it grades can be recorded, so it plays no "
                "more episodes; its operator must move the ledger's files away and restart it"
            )
        room = self._ledger.room_problem() if self._ledger is not None else None
        if room is not None:  # an episode whose line has nowhere to go is not played
            raise RequestError(f"{room}: no new episode is played until it can be recorded; tell the operator")
        previous = self._episode
        wasted = previous is not None and (not previous.done or previous.data_version == 0)
        if previous is not None and not previous.done:
            self._record("abandoned: reset")
        if self._scored_run is not None:
            if self.session_id is None:  # HTTP's one-off environment: a task it took would be lost
                raise RequestError(
                    f"this server is playing scored run {self._scored_run.run_id}, whose tasks are played in "
                    "sessions: open the WebSocket /ws (cernenv.client.CERNEnvClient) or an MCP session"
                )
            self._task_index, self._assignment, task = self._scored_run.next_task()
            seed, scenario, difficulty = task.seed, task.scenario, task.difficulty
            nonce: Optional[str] = self._scored_run.world_nonce(self._task_index)
            secret_salt = self._scored_run.world_secret
        else:
            nonce = None  # a fresh one in evaluation mode, none in training mode
        try:
            observation = super().reset(
                seed=seed,
                episode_id=episode_id,
                scenario=scenario,
                difficulty=difficulty,
                secret_salt=secret_salt,
                world_nonce=nonce,
            )
        except ValueError as error:
            raise RequestError(str(error)) from None
        self._actions = []
        self._steps_on_unchanged_data, self._reset_wasted_episode = 0, wasted
        self._last_observation = observation
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
        if self._ledger is not None and not self._episode.done:
            recorded = recordable_action(action)
            size = len(json.dumps(recorded, ensure_ascii=False, default=str).encode("utf-8"))
            if size > MAX_RECORDED_ACTION_BYTES:
                raise RequestError(
                    f"an action of {size} bytes: this server records every action and takes at most "
                    f"{MAX_RECORDED_ACTION_BYTES} (a justification of 2,000 characters fits): send a shorter one"
                )
            self._actions.append(recorded)
        data_before, was_done = self._episode.data_version, self._episode.done
        observation = super().step(action, timeout_s=timeout_s, **kwargs)
        self._last_observation = observation
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
        the reason the campaign stopped, or how it was abandoned), at most one per episode
        whichever end comes first (a claim racing the session's close): where it was played
        (`session_id`, `client`), what it was (`episode_id`, `seed`, `scenario`, `difficulty`,
        `world_nonce`, the `secret_fingerprint`, the scored run's `run_id`, `task_index` and
        `assignment`), `steps`, the `grade` (None if abandoned), the `episode_reward`, the final
        `resources`, the `claim`, the `truth`, every action as sent (`actions`, what replays the
        episode) and how many were refused (`cernenv.server.ledger.EpisodeEnded`); a scored run's
        episode goes to the run's own ledger (`ScoredRun.record_episode`). Only a session's
        episodes are recorded (not HTTP's one-off resets)."""
        if self._ledger is None or self.session_id is None or self._episode is None:
            return
        with self._record_lock:
            episode = self._episode
            if self._recorded is episode:
                return
            self._recorded = episode
        state, grade = self.state, self.episode_grade()
        withheld_reward = grade["terminal_reward"] if grade else 0.0  # not in the state's sum when withheld
        usage = self._last_observation.resource_usage.model_dump() if self._last_observation else {}
        record = {
            "record": "episode",
            "ended_at": utc_now(),
            "mode": "evaluation" if self._evaluation else "training",
            "secret_fingerprint": self._scored_run.worlds_fingerprint if self._scored_run else self._secret_fingerprint,
            "session_id": self.session_id,
            "client": self.client,
            "episode_id": state.episode_id,
            "seed": episode.seed,
            "scenario": state.scenario_name,
            "difficulty": state.difficulty,
            "world_nonce": self.world_nonce(),
            "steps": state.step_count,
            "ended": ended,
            "grade": grade,
            "episode_reward": state.cumulative_reward + (withheld_reward if self._evaluation else 0.0),
            "resources": {k: v for k, v in usage.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
            "claim": self.episode_claim(),
            "truth": CERNCollisionEnvironment.hidden_truth(self),
            "run_id": self._scored_run.run_id if self._scored_run else None,
            "task_index": self._task_index if self._scored_run else None,
            "assignment": self._assignment if self._scored_run else None,
            "actions": list(self._actions),
            "refused_actions": self.refused_actions(),
        }
        if self._scored_run is not None and self._task_index is not None:
            self._scored_run.record_episode(record)
        else:
            self._ledger.append_or_report(record)

    def record_unfinished(self, ended: str) -> None:
        """Record the session's episode as `ended` if it is still being played."""
        if self._episode is not None and not self._episode.done:
            self._record(ended)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.record_unfinished("abandoned: session ended")
            self._count.change(-1)
            self._scheduler.forget(self)
        super().close()
