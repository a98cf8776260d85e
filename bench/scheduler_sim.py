"""Scheduling rules for the server's physics thread, simulated on real step costs.

    python bench/scheduler_sim.py                 # the rules compared, 6 seeds
    python bench/scheduler_sim.py --grid          # half-life x lead of the recent-usage rule

Why a simulation: on the 2-core machine one real load run takes a minute and its figures move
by 10-20% from run to run, too little signal to choose a rule's constants. Here one physics
thread runs jobs without pre-emption; each job costs the thread CPU time one real
`CERNCollisionEnvironment` step took (recorded first, in process, from HeuristicAgent episodes
of the load test's scenarios) plus `--overhead-ms` of server work; a client waits
`--client-ms` between an answer and its next request. Honest clients play their episodes;
scan spammers repeat a `scan_bump` of the Z spectrum (its cost measured too) until the honest
clients are done. Printed per rule, median and range over the seeds: the fairness ratio (honest median latency with
8 spammers over without, 4 honest clients; target <= 2) and the honest p99 at 64
clients alone and beside 3 spammers (target < 1 s with the load test's abusers). Rules:

- arrival order;
- least total CPU (the server's rule before: a session waking is charged at least the least
  waiting charge less 50 ms; lead capped at 10 ms);
- recent usage (`cernenv.server.scheduler.RecentUsage`);
- recent usage with the spammers' jobs surcharged (what the server runs: a repeated scan does no
  new work, and `cernenv.server.pacing.NO_NEW_WORK_SURCHARGE` multiplies its charge).

`make bench-server` measures the real server.
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import sys
import time
from typing import Dict, Hashable, List, Tuple

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from cernenv import CERNCollisionEnvironment, ExperimentAction  # noqa: E402
from cernenv.server.pacing import NO_NEW_WORK_SURCHARGE  # noqa: E402
from cernenv.server.scheduler import RecentUsage  # noqa: E402
from lib.agents.baselines import HeuristicAgent  # noqa: E402

from server_load import HONEST_SCENARIOS  # noqa: E402


def record_costs(episodes: int) -> Tuple[List[List[float]], float]:
    """(per-episode lists of step CPU seconds, reset first; median CPU seconds of a spammer's
    repeated `scan_bump` on the Z spectrum)."""
    env, agent = CERNCollisionEnvironment(), HeuristicAgent()
    recorded = []
    for i in range(episodes):
        scenario = HONEST_SCENARIOS[i % len(HONEST_SCENARIOS)]
        agent.reset()
        start = time.thread_time()
        obs = env.reset(seed=1000 + i, scenario=scenario, difficulty=None if scenario else "medium")
        costs = [time.thread_time() - start]
        while not obs.done:
            action = agent.act(obs)
            start = time.thread_time()
            obs = env.step(action)
            costs.append(time.thread_time() - start)
        recorded.append(costs)
    agent.reset()  # a spammer: the heuristic up to its first scan, then scans again and again
    obs = env.reset(seed=1, scenario="z_mumu_91")
    while True:
        action = agent.act(obs)
        obs = env.step(action)
        if action.action_type.value == "scan_bump":
            break
    scan_costs = []
    for _ in range(20):
        start = time.thread_time()
        env.step(ExperimentAction(action_type="scan_bump", parameters={}))
        scan_costs.append(time.thread_time() - start)
    return recorded, float(np.median(scan_costs))


class ArrivalOrder:
    def pick(self, waiting, now):
        return min(waiting, key=lambda pair: pair[1])[0]

    def charge(self, session, cost_s, now, others_waiting):
        pass


class LeastTotalCpu:
    """The server's rule before the recent-usage one (see the module docstring)."""

    def __init__(self, wake_credit_s: float = 0.05, max_lead_s: float = 0.01) -> None:
        self.wake_credit_s, self.max_lead_s = wake_credit_s, max_lead_s
        self.total: Dict[Hashable, float] = {}
        self.floor = 0.0

    def wake(self, session, others_waiting):
        least = min((self.total[s] for s in others_waiting if s in self.total), default=self.floor)
        self.total[session] = max(self.total.get(session, 0.0), least - self.wake_credit_s)

    def pick(self, waiting, now):
        session = min(waiting, key=lambda pair: (self.total[pair[0]], pair[1]))[0]
        self.floor = self.total[session]
        return session

    def charge(self, session, cost_s, now, others_waiting):
        charge = self.total[session] + cost_s
        waiting = [self.total[s] for s in others_waiting if s != session]
        self.total[session] = min(charge, min(waiting) + self.max_lead_s) if waiting else charge


class SurchargedSpam(RecentUsage):
    """Recent usage, every spammer job charged `NO_NEW_WORK_SURCHARGE` times its CPU time."""

    def charge(self, session, cost_s, now, others_waiting, surcharge=1.0):
        factor = NO_NEW_WORK_SURCHARGE if not isinstance(session, int) else surcharge
        super().charge(session, cost_s, now, others_waiting, surcharge=factor)


def simulate(rule, costs, scan_s, honest, spammers, episodes, seed, overhead_s, client_s) -> Tuple[float, float]:
    """(median, p99) of the honest clients' latencies [s] under `rule`."""
    rng = random.Random(seed)
    plans = {}
    events: List[Tuple[float, int, str, Hashable]] = []
    order = 0
    for i in range(honest):
        plans[i] = [c for _ in range(episodes) for c in costs[rng.randrange(len(costs))]]
    position = {i: 0 for i in range(honest)}
    for session in [*range(honest), *(("spammer", j) for j in range(spammers))]:
        heapq.heappush(events, (rng.uniform(0.0, 0.01), order, "submit", session))
        order += 1
    waiting: Dict[Hashable, Tuple[int, float, float]] = {}  # session -> (order, arrival time, cost)
    latencies, running, finished = [], False, 0
    while events:
        now, _, kind, item = heapq.heappop(events)
        if kind == "submit":
            cost = plans[item][position[item]] if isinstance(item, int) else scan_s
            if isinstance(rule, LeastTotalCpu):
                rule.wake(item, waiting)
            elif isinstance(rule, RecentUsage):
                rule.track(item, now)
            waiting[item] = (order, now, cost)
            order += 1
        else:  # a job ended
            session, arrived, cost = item
            running = False
            rule.charge(session, cost, now, waiting)
            if isinstance(session, int):
                latencies.append(now - arrived)
                position[session] += 1
                if position[session] < len(plans[session]):
                    heapq.heappush(events, (now + client_s, order, "submit", session))
                else:
                    finished += 1
            elif finished < honest:
                heapq.heappush(events, (now + 0.5 * client_s, order, "submit", session))
            order += 1
        if not running and waiting:
            session = rule.pick([(s, w[0]) for s, w in waiting.items()], now)
            _, arrived, cost = waiting.pop(session)
            running = True
            heapq.heappush(events, (now + cost + overhead_s, order, "end", (session, arrived, cost)))
            order += 1
    return float(np.percentile(latencies, 50)), float(np.percentile(latencies, 99))


def evaluate(make_rule, costs, scan_s, seeds, overhead_s, client_s) -> Tuple[List[float], List[float], List[float]]:
    fair, alone, beside = [], [], []
    for seed in range(seeds):
        args = (costs, scan_s)
        base = simulate(make_rule(), *args, 4, 0, 6, seed, overhead_s, client_s)
        attacked = simulate(make_rule(), *args, 4, 8, 6, seed, overhead_s, client_s)
        fair.append(attacked[0] / base[0])
        alone.append(simulate(make_rule(), *args, 64, 0, 2, seed, overhead_s, client_s)[1])
        beside.append(simulate(make_rule(), *args, 64, 3, 2, seed, overhead_s, client_s)[1])
    return fair, alone, beside


def span(values: List[float]) -> str:
    """Median and range of `values`."""
    return f"{np.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=60, help="episodes recorded for the step costs")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--overhead-ms", type=float, default=1.0, help="server work per request beside the physics")
    parser.add_argument("--client-ms", type=float, default=1.0, help="client time between an answer and its request")
    parser.add_argument("--grid", action="store_true", help="half-life x lead of the recent-usage rule")
    args = parser.parse_args()
    costs, scan_s = record_costs(args.episodes)
    flat = np.concatenate(costs)
    print(
        f"{flat.size} steps recorded: mean {1e3 * flat.mean():.2f} ms, p99 {1e3 * np.percentile(flat, 99):.1f} ms; "
        f"a Z-spectrum scan {1e3 * scan_s:.1f} ms; server overhead {args.overhead_ms:g} ms, "
        f"client {args.client_ms:g} ms; {args.seeds} seeds"
    )
    if args.grid:
        rules = {
            f"recent usage, half-life {h:g} ms, lead {lead:g} ms": (
                lambda h=h, lead=lead: RecentUsage(h / 1e3, lead / 1e3)
            )
            for h in (100, 150, 200)
            for lead in (3, 5, 10)
        }
    else:
        rules = {
            "arrival order": ArrivalOrder,
            "least total CPU (before)": LeastTotalCpu,
            "recent usage": RecentUsage,
            f"recent usage, spam surcharged x{NO_NEW_WORK_SURCHARGE:g} (server)": SurchargedSpam,
        }
    print(f"{'rule':<48}{'fairness ratio (<= 2)':>26}{'p99 64 alone [s]':>20}{'p99 64 + 3 scans [s]':>24}")
    for name, make_rule in rules.items():
        fair, alone, beside = evaluate(
            make_rule, costs, scan_s, args.seeds, args.overhead_ms / 1e3, args.client_ms / 1e3
        )
        print(f"{name:<48}{span(fair):>26}{span(alone):>20}{span(beside):>24}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
