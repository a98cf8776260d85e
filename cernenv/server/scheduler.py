"""Fair scheduling of the sessions' resets and steps on the server's one physics thread.

Every session's environment runs on one thread: the physics holds the GIL, so a thread per
session only adds contention (`ServedEnvironment`). In arrival order, that thread let one
client starve the others: 8 sessions repeating `scan_bump` (~10 ms each) raised honest
clients' median step latency from 7.5 ms to 170 ms (issue 15).

`FairScheduler` runs the jobs in order of the CPU time their session has used, as Linux's
completely fair scheduler does with virtual runtime: the next job is the pending one whose
session has the least CPU time charged (ties: arrival order); a job's thread CPU time is
charged to its session when it ends. A session that comes back after waiting on its client
(an agent thinking, a network round trip) re-enters at the least charge among the sessions
waiting, less `wake_credit_s`, so it is not stuck behind sessions that kept the thread busy,
and cannot save up credit by staying away. A session is never charged more than `max_lead_s`
above the least-charged session waiting when its job ends: one expensive step (an honest scan
of a large spectrum) then costs its session a short wait, not a wait until every other session
has used as much CPU. Jobs are not pre-empted: a waiting job can still wait for the one that is
running.

Simulated with the CPU time of HeuristicAgent steps (mean 2.5 ms) and of `scan_bump` on the
Z spectrum (9.3 ms), 4 honest clients and 8 that repeat scans: arrival order multiplied the
honest median latency by 11; least CPU first by 2.05, and by 1.75 with the 10 ms lead cap,
which also lowered the honest p99 at 64 clients from 0.90 to 0.82 s (`make bench-server`
measures the real server).
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
    """One worker thread that runs submitted callables, least-charged session first (see the
    module docstring for `wake_credit_s` and `max_lead_s`).

    `run(session, fn, *args)` awaits `fn(*args)` on the worker; `submit` is the same for
    threads (a `concurrent.futures.Future`). `forget(session)` drops a closed session's charge.
    `cpu_clock` measures a job's cost (default: the worker thread's CPU time)."""

    def __init__(self, wake_credit_s: float = 0.05, max_lead_s: float = 0.01,
                 cpu_clock: Callable[[], float] = time.thread_time, name: str = "cernenv-physics") -> None:
        self.wake_credit_s = wake_credit_s
        self.max_lead_s = max_lead_s
        self._clock = cpu_clock
        self._name = name
        self._condition = threading.Condition()
        self._pending: Dict[Hashable, List[Tuple[int, concurrent.futures.Future, Callable, tuple]]] = {}
        self._charge_s: Dict[Hashable, float] = {}
        self._order = itertools.count()
        self._floor_s = 0.0  # the charge of the session whose job ran last (the least, when it was picked)
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
            queue = self._pending.setdefault(session, [])
            if not queue:  # the session wakes up: no credit saved while away, a little given
                charge = self._charge_s.get(session, 0.0)
                self._charge_s[session] = max(charge, self._least_waiting_charge() - self.wake_credit_s)
            queue.append((next(self._order), future, fn, args))
            self._ensure_worker()
            self._condition.notify()
        return future

    def forget(self, session: Hashable) -> None:
        """Drop `session`'s charge (it closed); jobs it still has pending run as submitted."""
        with self._condition:
            if session not in self._pending:
                self._charge_s.pop(session, None)

    def charge_s(self, session: Hashable) -> float:
        """CPU seconds charged to `session` (0 for one never seen)."""
        with self._condition:
            return self._charge_s.get(session, 0.0)

    def shutdown(self) -> None:
        """Stop the worker once the jobs already submitted have run."""
        with self._condition:
            self._stopped = True
            self._condition.notify_all()
        if self._thread is not None:
            self._thread.join()

    # the worker ------------------------------------------------------------------------

    def _least_waiting_charge(self) -> float:
        waiting = [self._charge_s[s] for s, queue in self._pending.items() if queue]
        return min(waiting) if waiting else self._floor_s

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
            session = min((s for s, queue in self._pending.items() if queue),
                          key=lambda s: (self._charge_s[s], self._pending[s][0][0]))
            _, future, fn, args = self._pending[session].pop(0)
            if not self._pending[session]:
                del self._pending[session]
            self._floor_s = self._charge_s[session]
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
                    if session in self._charge_s:  # not if it was forgotten meanwhile
                        charge = self._charge_s[session] + self._clock() - start
                        waiting = [self._charge_s[s] for s, queue in self._pending.items() if queue and s != session]
                        if waiting:
                            charge = min(charge, min(waiting) + self.max_lead_s)
                        self._charge_s[session] = charge
