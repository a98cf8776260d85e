"""The same episodes on two C libraries: whether what an agent is shown depends on the processor.

    make bench-libm                                     # 1,000 validation and training tasks, 313 suite tasks
    python bench/bench_libm.py --tasks 200 --offset 7   # other tasks' members and random agents

Plays every task twice, each in a process of its own: once as this processor computes, once as a
processor without AVX or FMA would (`lib.report.replay.BASELINE_PROCESSOR_ENVIRONMENT`: numpy's
baseline kernels, numba's generic target, OpenBLAS's Nehalem kernels and glibc's `exp`, `log` and
`pow` for a processor without FMA). On each task two agents play: the member of the heuristic
family that `family_member(seed + offset)` draws, and `RandomAgent(seed + offset)`, whose odd
choices reach the spectra no plan would (fits of a handful of events, windows a peak fills). The
tasks: `--tasks` of the validation split, as many of the training mix, and up to `--tasks` of the
held-out suite. Compared: every observation each episode returned, rendered as the policy reads it,
and its reward. Printed: how many episodes differ, and for the first few the first step and lines
that do; exit status 1 where any does. `--offset` draws other members and random agents on the same
tasks: a probe the environment has not been tuned on.
"""

from __future__ import annotations

import argparse
import difflib
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]


def tasks(n_tasks: int) -> List[Any]:
    """The validation split's first `n_tasks`, the training mix's (`bench_family.split_tasks`), and up
    to `n_tasks` of the suite: `EpisodeSpec`s."""
    from bench_family import split_tasks  # beside this script: Python puts its folder on the path

    from lib.measure.evaluation import heldout_suite

    return split_tasks("validation", n_tasks) + split_tasks("training", n_tasks) + list(heldout_suite())[:n_tasks]


def play(n_tasks: int, offset: int, out: Path) -> None:
    """Play every task with both agents; write {episode: [rendered observation + reward, ...]} to `out`."""
    from cernenv import CERNCollisionEnvironment
    from lib.agents.baselines import HeuristicAgent, RandomAgent, family_member
    from lib.agents.prompting import render_observation
    from lib.episodes.agent_rollouts import transitions

    env = CERNCollisionEnvironment()
    shown: Dict[str, List[str]] = {}
    for spec in tasks(n_tasks):
        seed = spec.seed
        agents = {
            "member": HeuristicAgent(**family_member(seed + offset)),
            "random": RandomAgent(seed=seed + offset),
        }
        for name, agent in agents.items():
            played = transitions(env, agent, seed=seed, scenario=spec.scenario, difficulty=spec.difficulty)
            shown[f"{name} on seed {seed}"] = [
                f"{render_observation(after)}\nreward {after.reward!r}" for _, _, after in played
            ]
    out.write_text(json.dumps(shown))


def differences(here: Dict[str, List[str]], there: Dict[str, List[str]], shown: int = 5) -> List[str]:
    """One block of lines per differing episode (the first `shown` of them): its first differing step
    and the lines that differ there; then a count of the rest."""
    lines, differing = [], [key for key in here if here[key] != there.get(key)]
    for key in differing[:shown]:
        pairs = itertools.zip_longest(here[key], there.get(key, []), fillvalue="")
        step, (ours, theirs) = next((i, pair) for i, pair in enumerate(pairs) if pair[0] != pair[1])
        diff = difflib.unified_diff(ours.splitlines(), theirs.splitlines(), lineterm="", n=0)
        lines.append(f"{key}, step {step}:")
        lines += [f"  {line}" for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    if len(differing) > shown:
        lines.append(f"... and {len(differing) - shown} more")
    return lines


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", type=int, default=1000, help="tasks of each split (the suite's at most 313)")
    parser.add_argument("--offset", type=int, default=17, help="draws other members and random agents")
    parser.add_argument("--play", type=Path, help=argparse.SUPPRESS)  # a child process: play into this file
    args = parser.parse_args(argv)
    if args.play:
        play(args.tasks, args.offset, args.play)
        return 0
    from lib.report.replay import BASELINE_PROCESSOR_ENVIRONMENT

    with tempfile.TemporaryDirectory() as folder:
        outputs, children = [], []
        for name, extra in (("this processor", {}), ("no AVX or FMA", BASELINE_PROCESSOR_ENVIRONMENT)):
            out = Path(folder) / f"{len(outputs)}.json"
            command = [sys.executable, __file__, "--tasks", str(args.tasks), "--offset", str(args.offset)]
            children.append(subprocess.Popen(command + ["--play", str(out)], cwd=ROOT, env={**os.environ, **extra}))
            outputs.append((name, out))
        if any(child.wait() != 0 for child in children):
            print("error: a playing process failed (its error is above)", file=sys.stderr)
            return 2
        here, there = (json.loads(out.read_text()) for _, out in outputs)
    lines = differences(here, there)
    differing = sum(here[key] != there.get(key) for key in here)
    steps = sum(len(texts) for texts in here.values())
    print(
        f"{differing} of {len(here)} episodes ({steps} steps) differ between {outputs[0][0]} and a processor "
        f"with {outputs[1][0]} (offset {args.offset})"
    )
    if lines:
        print("\n".join(lines))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
