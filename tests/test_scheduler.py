"""The server's fair scheduler (cernenv/server/scheduler.py), on fake CPU and wall clocks: which
job runs next is decided by the CPU time each session was charged recently, whatever the arrival
order."""

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
    """A scheduler whose charges do not decay unless a test moves its wall clock (`scheduler.wall`)."""
    clock, wall = FakeClock(), FakeClock()
    scheduler = FairScheduler(half_life_s=1.0, max_lead_s=10.0, cpu_clock=clock, wall_clock=wall)
    scheduler.wall = wall
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
    futures = [
        scheduler.submit(session, job(clock, log, f"{session}{i}", 0.125))  # exact in binary
        for i in range(3)
        for session in ("a", "b")
    ]
    release.set()
    for future in futures:
        future.result(30)
    assert log == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_a_session_back_from_idle_finds_its_charge_decayed_but_saves_no_credit(setup):
    """Charges halve every `half_life_s` of wall time: a session that kept the thread busy is
    soon even with the others again, and one that stayed away for long is at 0, never below,
    so it cannot spend the time it was away: it takes turns with a brand-new session."""
    scheduler, clock = setup
    log: list = []
    scheduler.submit("busy", job(clock, log, "busy", 8.0)).result(30)
    scheduler.submit("sleeper", job(clock, log, "sleeper", 1.0)).result(30)
    scheduler.wall.now += 3.0  # three half-lives
    assert scheduler.charge_s("busy") == pytest.approx(1.0)
    assert scheduler.charge_s("sleeper") == pytest.approx(0.125)
    release = hold_worker(scheduler)
    busy = scheduler.submit("busy", job(clock, log, "busy again", 1.0))
    sleeper = [scheduler.submit("sleeper", job(clock, log, f"sleeper{i}", 0.5)) for i in range(3)]
    release.set()
    for future in [busy, *sleeper]:
        future.result(30)
    # the sleeper (0.125) runs until its charge passes the busy session's 1.0: after two jobs
    assert log[2:] == ["sleeper0", "sleeper1", "busy again", "sleeper2"]
    scheduler.wall.now += 10_000.0  # the charge underflows to 0
    assert scheduler.charge_s("sleeper") == 0.0
    release = hold_worker(scheduler)
    futures = [scheduler.submit(s, job(clock, log, f"{s}{i}", 0.25)) for i in range(2) for s in ("sleeper", "new")]
    release.set()
    for future in futures:
        future.result(30)
    assert log[-4:] == ["sleeper0", "new0", "sleeper1", "new1"]


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
    scheduler = FairScheduler(max_lead_s=0.01, cpu_clock=clock, wall_clock=FakeClock())
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


def test_a_surcharged_job_charges_its_session_that_many_times_its_cpu_time(setup):
    """A job that did no new work (the server: a step that broke a rule, such as a repeated
    scan) is charged `surcharge(result)` times its CPU time: its session gets that many times
    fewer turns than one whose jobs are charged plainly."""
    scheduler, clock = setup
    log: list = []
    release = hold_worker(scheduler)
    futures = [
        scheduler.submit("spammer", job(clock, log, f"repeat{i}", 0.125), surcharge=lambda result: 4.0)
        for i in range(2)
    ]
    futures += [scheduler.submit("honest", job(clock, log, f"step{i}", 0.125)) for i in range(5)]
    release.set()
    for future in futures:
        future.result(30)
    assert scheduler.charge_s("spammer") == pytest.approx(2 * 4 * 0.125)
    assert scheduler.charge_s("honest") == pytest.approx(5 * 0.125)
    # "spammer" arrived first; after its first job (0.5 charged) "honest" runs four times
    assert log == ["repeat0", "step0", "step1", "step2", "step3", "repeat1", "step4"]


def test_the_surcharge_sees_the_result_and_a_faulty_rule_charges_plainly(setup):
    scheduler, clock = setup
    log: list = []
    seen: list = []

    def by_result(result: str) -> float:
        seen.append(result)
        return 3.0 if result == "repeat" else 1.0

    scheduler.submit("a", job(clock, log, "repeat", 0.25), surcharge=by_result).result(30)
    scheduler.submit("a", job(clock, log, "new", 0.25), surcharge=by_result).result(30)
    assert seen == ["repeat", "new"]
    assert scheduler.charge_s("a") == pytest.approx(3 * 0.25 + 0.25)
    for faulty in (lambda result: 1 / 0, lambda result: 0.5, lambda result: float("nan"), lambda result: "x"):
        before = scheduler.charge_s("b")
        assert scheduler.submit("b", job(clock, log, "b", 0.25), surcharge=faulty).result(30) == "b"
        assert scheduler.charge_s("b") == pytest.approx(before + 0.25)


def test_a_session_forgotten_while_its_jobs_wait_is_dropped_once_they_have_run(setup):
    """A session closed while a job of its is queued (an act racing the session's close): the job
    still runs, and then nothing of the session is kept (the charge table held it forever)."""
    scheduler, clock = setup
    log: list = []
    scheduler.submit("closing", job(clock, log, "first", 0.5)).result(30)  # charged: tracked
    release = hold_worker(scheduler)
    queued = scheduler.submit("closing", job(clock, log, "queued", 0.5))
    scheduler.forget("closing")
    release.set()
    assert queued.result(30) == "queued"
    scheduler.submit("other", job(clock, log, "after", 0.1)).result(30)  # the worker is past the job
    assert not scheduler.rule.tracked("closing") and scheduler.charge_s("closing") == 0.0
