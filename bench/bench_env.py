"""In-process, single-core throughput of CERNenv.

    make bench            # or: python bench/bench_env.py --random-steps 20000 --heuristic-episodes 300

Prints steps/s for uniformly random actions (RandomAgent, episodes reset as they end)
and episodes/s for HeuristicAgent over a fixed mix of curated and procedural scenarios: the
best of three passes, and their median (the machines here are virtual and their speed drifts
by +-10% within minutes).
Targets: >= 2,000 random steps/s and >= 50 heuristic episodes/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # single core: no BLAS threads
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from cernenv import CERNCollisionEnvironment  # noqa: E402
from cernenv.scenarios import DIFFICULTIES, list_scenarios  # noqa: E402
from lib.agents.baselines import HeuristicAgent, RandomAgent  # noqa: E402

RANDOM_STEPS_TARGET = 2000.0
HEURISTIC_EPISODES_TARGET = 50.0


def episode_specs(n: int):
    """A fixed mix: every curated scenario, then procedural ones of every difficulty."""
    curated = list_scenarios()
    for i in range(n):
        if i % 2 == 0:
            yield i, curated[(i // 2) % len(curated)], None
        else:
            yield i, None, DIFFICULTIES[(i // 2) % len(DIFFICULTIES)]


def bench_random(n_steps: int) -> float:
    env, agent = CERNCollisionEnvironment(), RandomAgent(seed=0)
    specs = episode_specs(10**9)
    steps = 0
    start = time.perf_counter()
    while steps < n_steps:
        seed, scenario, difficulty = next(specs)
        agent.reset()
        obs = env.reset(seed=seed, scenario=scenario, difficulty=difficulty)
        while not obs.done and steps < n_steps:
            obs = env.step(agent.act(obs))
            steps += 1
    return steps / (time.perf_counter() - start)


def heuristic_throughput(specs) -> tuple[float, float]:
    """(episodes/s, steps/s) of HeuristicAgent playing `specs` (seed, scenario, difficulty) in one process."""
    specs = list(specs)
    env, agent = CERNCollisionEnvironment(), HeuristicAgent()
    steps = 0
    start = time.perf_counter()
    for seed, scenario, difficulty in specs:
        agent.reset()
        obs = env.reset(seed=seed, scenario=scenario, difficulty=difficulty)
        while not obs.done:
            obs = env.step(agent.act(obs))
            steps += 1
    elapsed = time.perf_counter() - start
    return len(specs) / elapsed, steps / elapsed


def bench_heuristic(n_episodes: int) -> tuple[float, float]:
    return heuristic_throughput(episode_specs(n_episodes))


def bench_reset_by_truth(n_resets: int) -> dict:
    """Median reset time [ms] of procedural tasks with and without a particle, interleaved so
    that machine load hits both alike: a reset must not tell whether a particle exists."""
    from cernenv.scenarios import procedural_scenario

    env = CERNCollisionEnvironment()
    times: dict = {True: [], False: []}
    seed = 0
    while min(len(v) for v in times.values()) < n_resets:
        difficulty = DIFFICULTIES[seed % 3]
        exists = procedural_scenario(seed, difficulty).truth is not None
        if len(times[exists]) < n_resets:
            start = time.perf_counter()
            env.reset(seed=seed, difficulty=difficulty)
            times[exists].append(time.perf_counter() - start)
        seed += 1
    return {exists: 1e3 * sorted(values)[len(values) // 2] for exists, values in times.items()}


def bench_first_collection_by_truth(n_tasks: int) -> dict:
    """Median time [ms] of HeuristicAgent's first `collect_collisions` on procedural tasks with and
    without a particle, in turn: taking data must not tell whether a particle exists."""
    from cernenv.scenarios import procedural_scenario

    env, agent = CERNCollisionEnvironment(), HeuristicAgent()
    times: dict = {True: [], False: []}
    for seed in range(n_tasks):
        difficulty = DIFFICULTIES[seed % 3]
        exists = procedural_scenario(seed, difficulty).truth is not None
        agent.reset()
        obs = env.reset(seed=seed, difficulty=difficulty)
        while not obs.done:
            action = agent.act(obs)
            start = time.perf_counter()
            obs = env.step(action)
            if action.action_type.value == "collect_collisions":
                times[exists].append(time.perf_counter() - start)
                break
    return {exists: 1e3 * sorted(values)[len(values) // 2] for exists, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--random-steps", type=int, default=20000)
    parser.add_argument("--heuristic-episodes", type=int, default=300)
    parser.add_argument(
        "--heuristic-passes",
        type=int,
        default=3,
        help="times the heuristic episodes are played: the best and the median pass are printed "
        "(a shared or virtual machine's other work only slows a pass, timeit's reasoning)",
    )
    parser.add_argument(
        "--resets",
        type=int,
        default=2000,
        help="procedural resets timed of each kind (and a quarter as many first collections)",
    )
    args = parser.parse_args()
    bench_heuristic(4)  # warm-up: imports, caches
    random_rate = bench_random(args.random_steps)
    passes = sorted(bench_heuristic(args.heuristic_episodes) for _ in range(max(args.heuristic_passes, 1)))
    (episode_rate, step_rate), median_rate = passes[-1], passes[len(passes) // 2][0]
    reset_ms = bench_reset_by_truth(args.resets)
    collect_ms = bench_first_collection_by_truth(args.resets // 4)
    print(f"{'benchmark':<34}{'measured':>12}{'target':>10}")
    print(f"{'random actions [steps/s]':<34}{random_rate:>12.0f}{RANDOM_STEPS_TARGET:>10.0f}")
    print(f"{'HeuristicAgent [episodes/s]':<34}{episode_rate:>12.1f}{HEURISTIC_EPISODES_TARGET:>10.0f}")
    print(f"{'  median of ' + str(len(passes)) + ' passes':<34}{median_rate:>12.1f}{'':>10}")
    print(f"{'HeuristicAgent [steps/s]':<34}{step_rate:>12.0f}{'':>10}")
    print(f"{'reset, particle [ms, median]':<34}{reset_ms[True]:>12.3f}{'':>10}")
    print(f"{'reset, nothing there [ms, median]':<34}{reset_ms[False]:>12.3f}{'':>10}")
    print(f"{'1st collection, particle [ms]':<34}{collect_ms[True]:>12.3f}{'':>10}")
    print(f"{'1st collection, nothing [ms]':<34}{collect_ms[False]:>12.3f}{'':>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
