"""The server's fair scheduler (cernenv/server/scheduler.py), on a fake CPU clock: which job runs
next is decided by the CPU time each session was charged, whatever the arrival order."""

from __future__ import annotations

import asyncio
import threading

import pytest

from cernenv.server.scheduler import FairScheduler


class FakeClock:
    """A CPU clock the jobs advance by their declared cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup():
    clock = FakeClock()
    scheduler = FairScheduler(wake_credit_s=0.05, max_lead_s=10.0, cpu_clock=clock)
    yield scheduler, clock
    scheduler.shutdown()


def job(clock: FakeClock, log: list, name: str, cost_s: float):
    def run() -> str:
        clock.now += cost_s
        log.append(name)
        return name
    return run


def hold_worker(scheduler: FairScheduler):
    """Occupy the worker until the returned event is set, so that later submissions queue up."""
    started, release = threading.Event(), threading.Event()
    scheduler.submit("gate", lambda: (started.set(), release.wait(30)))
    assert started.wait(30)
    return release


def test_the_session_that_used_less_cpu_runs_first_whatever_the_arrival_order(setup):
    scheduler, clock = setup
    log: list = []
    scheduler.submit("abuser", job(clock, log, "scan", 1.0)).result(30)  # 1 s of CPU charged
    release = hold_worker(scheduler)
    futures = [scheduler.submit("abuser", job(clock, log, f"scan{i}", 1.0)) for i in range(3)]
    futures.append(scheduler.submit("honest", job(clock, log, "step", 0.01)))
    release.set()
    for future in futures:
        future.result(30)
    assert log == ["scan", "step", "scan0", "scan1", "scan2"]
    assert scheduler.charge_s("abuser") == pytest.approx(4.0)


def test_equal_charges_run_in_arrival_order_and_busy_sessions_alternate(setup):
    scheduler, clock = setup
    log: list = []
    release = hold_worker(scheduler)
    futures = [scheduler.submit(session, job(clock, log, f"{session}{i}", 0.125))  # exact in binary
               for i in range(3) for session in ("a", "b")]
    release.set()
    for future in futures:
        future.result(30)
    assert log == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_session_back_from_idle_gets_a_small_credit_not_its_savings(setup):
    """A session that waited on its client re-enters at the least charge of those waiting, less
    `wake_credit_s`: ahead of the busy ones, but it cannot spend the time it was away."""
    scheduler, clock = setup
    log: list = []
    scheduler.submit("busy", job(clock, log, "busy", 10.0)).result(30)
    release = hold_worker(scheduler)
    busy = scheduler.submit("busy", job(clock, log, "busy again", 1.0))
    sleeper = [scheduler.submit("sleeper", job(clock, log, f"sleeper{i}", 0.04)) for i in range(3)]
    assert scheduler.charge_s("sleeper") == pytest.approx(10.0 - 0.05)
    release.set()
    for future in [busy, *sleeper]:
        future.result(30)
    # 0.05 s of credit: two 0.04 s jobs go first, then the busy session's turn comes back
    assert log == ["busy", "sleeper0", "sleeper1", "busy again", "sleeper2"]


def test_errors_reach_the_caller_and_the_worker_goes_on(setup):
    scheduler, clock = setup

    def broken() -> None:
        raise ValueError("bad action")

    with pytest.raises(ValueError, match="bad action"):
        scheduler.submit("a", broken).result(30)
    assert scheduler.submit("a", lambda: 42).result(30) == 42


def test_a_job_whose_caller_gave_up_is_skipped(setup):
    scheduler, clock = setup
    log: list = []
    release = hold_worker(scheduler)
    dropped = scheduler.submit("a", job(clock, log, "dropped", 1.0))
    kept = scheduler.submit("b", job(clock, log, "kept", 1.0))
    assert dropped.cancel()
    release.set()
    assert kept.result(30) == "kept" and log == ["kept"]
    assert scheduler.charge_s("a") == 0.0


def test_run_awaits_the_result_and_forget_drops_the_charge(setup):
    scheduler, clock = setup
    log: list = []

    async def main() -> list:
        return await asyncio.gather(*(scheduler.run(s, job(clock, log, s, 0.5)) for s in ("x", "y")))

    assert asyncio.run(main()) == ["x", "y"]
    assert scheduler.charge_s("x") == pytest.approx(0.5)
    scheduler.forget("x")
    assert scheduler.charge_s("x") == 0.0


def test_one_expensive_job_puts_its_session_at_most_max_lead_behind_the_others():
    """Without the cap, a session whose 1 s scan ran while another waited would wait until the
    other had used 1 s of CPU; with `max_lead_s` = 0.01 it is charged 0.01 s above the waiting one."""
    clock, log = FakeClock(), []
    scheduler = FairScheduler(wake_credit_s=0.0, max_lead_s=0.01, cpu_clock=clock)
    try:
        release = hold_worker(scheduler)
        heavy = scheduler.submit("heavy", job(clock, log, "big scan", 1.0))
        first = scheduler.submit("light", job(clock, log, "step0", 0.004))
        release.set()
        heavy.result(30), first.result(30)
        assert scheduler.charge_s("heavy") == pytest.approx(0.01)  # "light" was waiting at 0
        release = hold_worker(scheduler)
        light = [scheduler.submit("light", job(clock, log, f"step{i}", 0.004)) for i in (1, 2, 3)]
        again = scheduler.submit("heavy", job(clock, log, "next", 0.001))
        release.set()
        for future in [again, *light]:
            future.result(30)
        # "light" (0.004 s charged) runs until it is charged more than "heavy" (0.01 s)
        assert log == ["big scan", "step0", "step1", "step2", "next", "step3"]
    finally:
        scheduler.shutdown()
