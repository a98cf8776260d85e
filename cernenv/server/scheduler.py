"""Fair scheduling of the sessions' resets and steps on the server's one physics thread.

Every session's environment runs on one thread: the physics holds the GIL, so a thread per
session only adds contention (`ServedEnvironment`). In arrival order, that thread let one
client starve the others: 8 sessions repeating `scan_bump` (~10 ms each) raised honest
clients' median step latency from 7.5 ms to 170 ms.

`FairScheduler` runs the jobs in the order `RecentUsage` gives, as the decay-usage schedulers
of Unix do: each session's charge is the thread CPU time of its jobs, halved every
`half_life_s` of wall time, and the next job is the pending one whose session has the least
charge (ties: arrival order). A session that comes back after waiting on its client (an agent
thinking, a network round trip) has a charge decayed towards 0, so it goes ahead of sessions
that kept the thread busy, but cannot save up credit (a charge is never below 0). A session is
never charged more than `max_lead_s` above the least-charged session waiting when its job
ends: one expensive step (an honest scan of a large spectrum) then costs its session a short
wait, not a wait until every other session has used as much CPU. Jobs are not pre-empted: a
waiting job can still wait for the one that is running.

What tells a spammer apart is what its steps do, so the shares are unequal on purpose: a job
can carry a `surcharge`, a factor on its charge computed from its result, and its lead cap
grows by the same factor. The server (`ServedEnvironment`, cernenv/server/app.py) charges 8
times its CPU time the work that gives its agent nothing new: a refused action, a repeat of an
action on unchanged data, any step beyond the 6th in a row without new data (HeuristicAgent
takes at most 5), a claim made before any data, a reset that abandons an unfinished episode or
follows one without data.

The measurements behind these rules, and the rules tried and not kept, are in
docs/studies/2026-11-25-how-the-scheduler-s-rules-came-about.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional, Tuple

logger = logging.getLogger("cernenv.server")


class RecentUsage:
    """The scheduling rule, without threads or clocks of its own (times are passed in, in
    seconds): which waiting session goes next, and what a finished job charges its session."""

    def __init__(self, half_life_s: float = 0.1, max_lead_s: float = 0.005) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self.max_lead_s = max_lead_s
        self._charge: Dict[Hashable, Tuple[float, float]] = {}  # session -> (CPU seconds, time of that value)

    def charge_at(self, session: Hashable, now: float) -> float:
        """`session`'s charge at time `now`, decayed (0 for one never seen)."""
        charge, stamp = self._charge.get(session, (0.0, now))
        return charge * 0.5 ** (max(now - stamp, 0.0) / self.half_life_s)

    def track(self, session: Hashable, now: float) -> None:
        """Start keeping `session`'s charge (at 0), unless it is kept already."""
        self._charge.setdefault(session, (0.0, now))

    def tracked(self, session: Hashable) -> bool:
        return session in self._charge

    def forget(self, session: Hashable) -> None:
        self._charge.pop(session, None)

    def pick(self, waiting: Iterable[Tuple[Hashable, int]], now: float) -> Hashable:
        """Of the (session, arrival order of its next job) pairs, the session to run next."""
        return min(waiting, key=lambda pair: (self.charge_at(pair[0], now), pair[1]))[0]

    def charge(
        self,
        session: Hashable,
        cost_s: float,
        now: float,
        others_waiting: Iterable[Hashable],
        surcharge: float = 1.0,
    ) -> None:
        """Add a finished job's CPU time, times `surcharge` (>= 1: a job that did no new work),
        to its session's decayed charge, at most `surcharge * max_lead_s` above the least charge
        among the other sessions waiting."""
        if not surcharge >= 1.0:
            raise ValueError(f"surcharge must be >= 1, got {surcharge}")
        charge = self.charge_at(session, now) + surcharge * cost_s
        waiting = [self.charge_at(s, now) for s in others_waiting if s != session]
        if waiting:
            charge = min(charge, min(waiting) + surcharge * self.max_lead_s)
        self._charge[session] = (charge, now)


class FairScheduler:
    """One worker thread that runs submitted callables, in `RecentUsage`'s order (see the module
    docstring for `half_life_s` and `max_lead_s`).

    `run(session, fn, *args, surcharge=None)` awaits `fn(*args)` on the worker (`surcharge`,
    a function of the result: the factor on the job's charge); `submit` is the same for
    threads (a `concurrent.futures.Future`). `forget(session)` drops a closed session's charge.
    `cpu_clock` measures a job's cost (default: the worker thread's CPU time); `wall_clock`
    decays the charges (default: `time.monotonic`)."""

    def __init__(
        self,
        half_life_s: float = 0.1,
        max_lead_s: float = 0.005,
        cpu_clock: Callable[[], float] = time.thread_time,
        wall_clock: Callable[[], float] = time.monotonic,
        name: str = "cernenv-physics",
    ) -> None:
        self.rule = RecentUsage(half_life_s, max_lead_s)
        self._clock = cpu_clock
        self._wall = wall_clock
        self._name = name
        self._condition = threading.Condition()
        self._pending: Dict[Hashable, List[Tuple[int, concurrent.futures.Future, Callable, tuple, Any]]] = {}
        self._order = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self._closing: set = set()  # sessions forgotten while jobs of theirs were pending

    # what sessions call ----------------------------------------------------------------

    async def run(
        self, session: Hashable, fn: Callable, *args: Any, surcharge: Optional[Callable[[Any], float]] = None
    ) -> Any:
        """`fn(*args)` run on the worker in `session`'s turn; its result (or its exception).
        `surcharge(result)`, if given, is the factor (>= 1) on the job's charge to its session."""
        return await asyncio.wrap_future(self.submit(session, fn, *args, surcharge=surcharge))

    def submit(
        self, session: Hashable, fn: Callable, *args: Any, surcharge: Optional[Callable[[Any], float]] = None
    ) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._condition:
            if self._stopped:
                raise RuntimeError("the scheduler is shut down")
            self._pending.setdefault(session, []).append((next(self._order), future, fn, args, surcharge))
            self.rule.track(session, self._wall())  # kept until `forget`
            self._ensure_worker()
            self._condition.notify()
        return future

    def forget(self, session: Hashable) -> None:
        """Drop `session`'s charge (it closed); jobs it still has pending run as submitted."""
        with self._condition:
            if session in self._pending:
                self._closing.add(session)  # forgotten once its last pending job has run
            else:
                self.rule.forget(session)

    def charge_s(self, session: Hashable) -> float:
        """CPU seconds charged to `session` now, decayed (0 for one never seen)."""
        with self._condition:
            return self.rule.charge_at(session, self._wall())

    def shutdown(self) -> None:
        """Stop the worker once the jobs already submitted have run."""
        with self._condition:
            self._stopped = True
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join()

    # the worker ------------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._thread.start()

    def _next_job(self) -> Optional[Tuple[Hashable, concurrent.futures.Future, Callable, tuple, Any]]:
        with self._condition:
            while not any(self._pending.values()):
                if self._stopped:
                    return None
                self._condition.wait()
            session = self.rule.pick(((s, queue[0][0]) for s, queue in self._pending.items() if queue), self._wall())
            _, future, fn, args, surcharge = self._pending[session].pop(0)
            if not self._pending[session]:
                del self._pending[session]
            return session, future, fn, args, surcharge

    def _work(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            session, future, fn, args, surcharge = job
            if not future.set_running_or_notify_cancel():  # its client stopped waiting
                continue
            start, factor, result, error = self._clock(), 1.0, None, None
            try:
                result = fn(*args)
                factor = _surcharge_of(surcharge, result)
            except BaseException as raised:  # handed to the session that asked, never lost
                error = raised
            with self._condition:  # charged before the caller hears back: it sees its new charge
                if self.rule.tracked(session):  # not if it was forgotten meanwhile
                    self.rule.charge(
                        session,
                        self._clock() - start,
                        self._wall(),
                        [s for s, queue in self._pending.items() if queue],
                        surcharge=factor,
                    )
                if session in self._closing and session not in self._pending:
                    self._closing.discard(session)
                    self.rule.forget(session)  # nothing holds a closed session after its last job
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
            del job, session, future, fn, args, surcharge, result, error  # the idle worker pins no environment


def _surcharge_of(surcharge: Optional[Callable[[Any], float]], result: Any) -> float:
    """The factor `surcharge(result)` gives a job's charge: 1 without one, and 1 (logged) where it
    fails or is not a number >= 1, so that a faulty rule never stops the worker."""
    if surcharge is None:
        return 1.0
    try:
        factor = float(surcharge(result))
    except Exception:
        logger.exception("surcharge rule failed; charging the job its CPU time")
        return 1.0
    if not 1.0 <= factor < float("inf"):
        logger.error("surcharge %r is not a finite number >= 1; charging the job its CPU time", factor)
        return 1.0
    return factor
