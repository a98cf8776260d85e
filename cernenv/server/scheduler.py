"""Fair scheduling of the sessions' resets and steps on the server's one physics thread.

Every session's environment runs on one thread: the physics holds the GIL, so a thread per
session only adds contention (`ServedEnvironment`). In arrival order, that thread let one
client starve the others: 8 sessions repeating `scan_bump` (~10 ms each) raised honest
clients' median step latency from 7.5 ms to 170 ms (issue 15).

`FairScheduler` runs the jobs in order of the CPU time their session used recently, as the
decay-usage schedulers of Unix do: each session's charge is the thread CPU time of its jobs,
halved every `half_life_s` of wall time, and the next job is the pending one whose session has
the least charge (ties: arrival order). A session that comes back after waiting on its client
(an agent thinking, a network round trip) has a charge decayed towards 0, so it goes ahead of
sessions that kept the thread busy, but cannot save up credit (a charge is never below 0). A
session is never charged more than `max_lead_s` above the least-charged session waiting when
its job ends: one expensive step (an honest scan of a large spectrum) then costs its session a
short wait, not a wait until every other session has used as much CPU. Jobs are not
pre-empted: a waiting job can still wait for the one that is running.

Why decay: with a charge that only grows (the previous scheduler: least total CPU first, a
50 ms credit on waking, the same 10 ms lead cap), a session that had just run an expensive step
waited until each of the 63 others had used as much more CPU: honest p99 0.87 s at 64 clients
without any abuser (bench_server.py). Simulated with the CPU time of 1,303 HeuristicAgent
steps (mean 2.3 ms) and of `scan_bump` on the Z spectrum (9.3 ms), 1.2 ms of server work per
request, four seeds: 4 honest clients beside 8 that repeat scans had their median latency
multiplied by 1.74-1.91 (previous) and 1.86-2.08 (this, half-life 100 ms, lead 5 ms); arrival
order: 9. At 64 honest clients the p99 fell from 1.14-1.34 s to 0.57-0.76 s. Many clients in
the same phase of their episodes (all scanning at once) still wait for one another: a round of
64 scans is 0.6 s of CPU whatever the order. `make bench-server` measures the real server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

logger = logging.getLogger("cernenv.server")


class FairScheduler:
    """One worker thread that runs submitted callables, least recently charged session first
    (see the module docstring for `half_life_s` and `max_lead_s`).

    `run(session, fn, *args)` awaits `fn(*args)` on the worker; `submit` is the same for
    threads (a `concurrent.futures.Future`). `forget(session)` drops a closed session's charge.
    `cpu_clock` measures a job's cost (default: the worker thread's CPU time); `wall_clock`
    decays the charges (default: `time.monotonic`)."""

    def __init__(self, half_life_s: float = 0.1, max_lead_s: float = 0.005,
                 cpu_clock: Callable[[], float] = time.thread_time,
                 wall_clock: Callable[[], float] = time.monotonic, name: str = "cernenv-physics") -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self.max_lead_s = max_lead_s
        self._clock = cpu_clock
        self._wall = wall_clock
        self._name = name
        self._condition = threading.Condition()
        self._pending: Dict[Hashable, List[Tuple[int, concurrent.futures.Future, Callable, tuple]]] = {}
        self._charge: Dict[Hashable, Tuple[float, float]] = {}  # session -> (CPU seconds, wall time of that value)
        self._order = itertools.count()
        self._thread: Optional[threading.Thread] = None
        self._stopped = False

    # what sessions call ----------------------------------------------------------------

    async def run(self, session: Hashable, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` run on the worker in `session`'s turn; its result (or its exception)."""
        return await asyncio.wrap_future(self.submit(session, fn, *args))

    def submit(self, session: Hashable, fn: Callable, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._condition:
            if self._stopped:
                raise RuntimeError("the scheduler is shut down")
            self._pending.setdefault(session, []).append((next(self._order), future, fn, args))
            self._charge.setdefault(session, (0.0, self._wall()))  # kept until `forget`
            self._ensure_worker()
            self._condition.notify()
        return future

    def forget(self, session: Hashable) -> None:
        """Drop `session`'s charge (it closed); jobs it still has pending run as submitted."""
        with self._condition:
            if session not in self._pending:
                self._charge.pop(session, None)

    def charge_s(self, session: Hashable) -> float:
        """CPU seconds charged to `session` now, decayed (0 for one never seen)."""
        with self._condition:
            return self._decayed(session, self._wall())

    def shutdown(self) -> None:
        """Stop the worker once the jobs already submitted have run."""
        with self._condition:
            self._stopped = True
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join()

    # the worker ------------------------------------------------------------------------

    def _decayed(self, session: Hashable, now: float) -> float:
        charge, stamp = self._charge.get(session, (0.0, now))
        return charge * 0.5 ** (max(now - stamp, 0.0) / self.half_life_s)

    def _ensure_worker(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
            self._thread.start()

    def _next_job(self) -> Optional[Tuple[Hashable, concurrent.futures.Future, Callable, tuple]]:
        with self._condition:
            while not any(self._pending.values()):
                if self._stopped:
                    return None
                self._condition.wait()
            now = self._wall()
            session = min((s for s, queue in self._pending.items() if queue),
                          key=lambda s: (self._decayed(s, now), self._pending[s][0][0]))
            _, future, fn, args = self._pending[session].pop(0)
            if not self._pending[session]:
                del self._pending[session]
            return session, future, fn, args

    def _work(self) -> None:
        while True:
            job = self._next_job()
            if job is None:
                return
            session, future, fn, args = job
            if not future.set_running_or_notify_cancel():  # its client stopped waiting
                continue
            start = self._clock()
            try:
                result = fn(*args)
            except BaseException as error:  # handed to the session that asked, never lost
                future.set_exception(error)
            else:
                future.set_result(result)
            finally:
                with self._condition:
                    if session in self._charge:  # not if it was forgotten meanwhile
                        self._charge_job(session, self._clock() - start)

    def _charge_job(self, session: Hashable, cost_s: float) -> None:
        """Add a finished job's CPU time to its session's decayed charge, at most `max_lead_s`
        above the least charge among the other sessions waiting."""
        now = self._wall()
        charge = self._decayed(session, now) + cost_s
        waiting = [self._decayed(s, now) for s, queue in self._pending.items() if queue and s != session]
        if waiting:
            charge = min(charge, min(waiting) + self.max_lead_s)
        self._charge[session] = (charge, now)
