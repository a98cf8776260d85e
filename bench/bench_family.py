"""The heuristic family played directly: how well each scripted physicist of `HEURISTIC_FAMILY` does.

    make bench-family                                        # validation split and training mix, 240 each
    python bench/bench_family.py --episodes 120 --members axes --json build/family.json

Each member (`lib.agents.baselines.HEURISTIC_FAMILY`: the heuristic's plan parameters) plays every
task greedily with the published evaluation key: the validation split
(`lib.measure.evaluation.validation_suite`) and GRPO's training mix (`lib.training.grpo.training_tasks`
of the default configuration). `--members`: `axes` (the default heuristic, each parameter varied
alone, and the threshold × first-block grid), `grid` (every member: slow), or `draw` (the
members a warm start's campaigns are demonstrated by, `family_member`, one per task). Printed per
member and split: the tasks won (the grade's `correct_outcome`), the success rate and the mean
reward with their 95% bootstrap intervals; then "contrast", the share of tasks some members win
and others lose: the tasks on which a policy whose samples spanned those members would set a win
against a loss in a GRPO group. The oracle (handed the truth) is the upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, Dict, List, Sequence


def axes_members() -> List[Dict[str, Any]]:
    """The default heuristic, each parameter of the family varied alone, and the threshold ×
    first-block grid (no member twice)."""
    from lib.agents.baselines import HEURISTIC_FAMILY, HeuristicAgent

    default = HeuristicAgent().plan_parameters()
    members = [dict(default)]
    for name, values in HEURISTIC_FAMILY.items():
        members += [{**default, name: value} for value in values if value != default[name]]
    for z in HEURISTIC_FAMILY["discovery_z_global"]:
        for fraction in HEURISTIC_FAMILY["first_block_fraction"]:
            members.append({**default, "discovery_z_global": z, "first_block_fraction": fraction})
    unique = {json.dumps(m, sort_keys=True): m for m in members}
    return list(unique.values())


def split_tasks(split: str, n_episodes: int) -> List[Any]:
    """The tasks of `split`: "validation" or "training" (the default configuration's mix)."""
    from lib.episodes.records import EpisodeSpec
    from lib.measure.evaluation import validation_suite

    if split == "validation":
        return list(validation_suite(n_episodes))
    from lib.training.config import TrainConfig
    from lib.training.grpo import training_tasks

    return [
        EpisodeSpec(t["seed"], scenario=t["scenario"], difficulty=t["difficulty"])
        for t in training_tasks(TrainConfig(), n_episodes)
    ]


def play(job: Dict[str, Any]) -> Dict[str, Any]:
    """One member (or the oracle, or the per-task draw) on one split: its outcome per task."""
    from lib.agents.baselines import HeuristicAgent, OracleAgent, family_member
    from lib.episodes.agent_rollouts import collect_agent_episode
    from lib.measure.evaluation import PUBLISHED_KEY

    env = PUBLISHED_KEY.make_env()
    outcomes, rewards = [], []
    for spec in split_tasks(job["split"], job["episodes"]):
        if job["member"] == "oracle":
            agent, reveal = OracleAgent(), True
        elif job["member"] == "draw":
            agent, reveal = HeuristicAgent(**family_member(spec.seed, draw=job.get("draw", 0))), False
        else:
            agent, reveal = HeuristicAgent(**job["member"]), False
        record = collect_agent_episode(
            env=env,
            agent=agent,
            seed=spec.seed,
            scenario=spec.scenario,
            difficulty=spec.difficulty,
            reveal_truth=reveal,
            evaluation_key=PUBLISHED_KEY.record_fields(),
        )
        outcomes.append(bool(record.correct_outcome))
        rewards.append(float(record.total_reward))
    return {**job, "outcomes": outcomes, "rewards": rewards}


def member_label(result: Dict[str, Any]) -> str:
    """A result's member as a table shows it: its name, "oracle", or "draw k" (the k-th draw per task)."""
    from lib.agents.baselines import member_name

    if result["member"] == "draw":
        return f"draw {result.get('draw', 0)}"
    return result["member"] if isinstance(result["member"], str) else member_name(result["member"])


def contrast(outcomes_by_member: Sequence[Sequence[bool]]) -> float:
    """The share of tasks that some members win and others lose."""
    per_task = list(zip(*outcomes_by_member))
    return sum(any(t) and not all(t) for t in per_task) / len(per_task)


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/bench_family.py", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--episodes", type=int, default=240, help="tasks per split")
    parser.add_argument("--splits", nargs="+", choices=("validation", "training"), default=["validation", "training"])
    parser.add_argument("--members", choices=("axes", "grid", "draw"), default="axes")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument(
        "--draws",
        type=int,
        default=0,
        help="with --members draw: this many members drawn per task (pass@1, pass@k and the share of tasks "
        "whose draws both win and lose: a prior that imitated the family exactly)",
    )
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be at least 1")

    from lib.agents.baselines import family_grid
    from lib.measure.comparison import bootstrap_interval

    members: List[Any] = {"axes": axes_members, "grid": family_grid, "draw": lambda: ["draw"]}[args.members]()
    jobs = [
        {"split": split, "episodes": args.episodes, "member": member}
        for split in args.splits
        for member in [*members, "oracle"]
    ]
    if args.draws:
        if args.members != "draw":
            parser.error("--draws needs --members draw")
        jobs = [
            {"split": s, "episodes": args.episodes, "member": "draw", "draw": k}
            for s in args.splits
            for k in range(args.draws)
        ] + [{"split": s, "episodes": args.episodes, "member": "oracle"} for s in args.splits]
    results = []
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:  # each member's line as it ends
        for future in as_completed([pool.submit(play, job) for job in jobs]):
            result = future.result()
            results.append(result)
            name = member_label(result)
            print(f"{result['split']}: {name} won {sum(result['outcomes'])} of {args.episodes}", flush=True)

    report: Dict[str, Any] = {"episodes": args.episodes, "splits": {}}
    for split in args.splits:
        rows = [r for r in results if r["split"] == split]
        played = [r for r in rows if r["member"] != "oracle"]
        print(f"\n{split}: {args.episodes} tasks, greedy, the published key")
        print("| member | won | success [95%] | mean reward [95%] |\n|---|---|---|---|")
        entries = []
        for r in sorted(rows, key=lambda r: -sum(r["outcomes"])):
            name = member_label(r)
            success = [float(o) for o in r["outcomes"]]
            s_lo, s_hi = bootstrap_interval(success)
            w_lo, w_hi = bootstrap_interval(r["rewards"])
            mean_s, mean_r = sum(success) / len(success), sum(r["rewards"]) / len(r["rewards"])
            print(
                f"| {name} | {sum(r['outcomes'])} | {mean_s:.3f} [{s_lo:.3f}, {s_hi:.3f}] | "
                f"{mean_r:+.2f} [{w_lo:+.2f}, {w_hi:+.2f}] |"
            )
            entries.append(
                {
                    "outcomes": r["outcomes"],
                    "member": r["member"],
                    "name": name,
                    "won": sum(r["outcomes"]),
                    "success": [mean_s, s_lo, s_hi],
                    "mean_reward": [mean_r, w_lo, w_hi],
                }
            )
        share = contrast([r["outcomes"] for r in played]) if len(played) > 1 else None
        if share is not None:
            print(
                f"contrast: {share:.3f} of tasks are won by some members and lost by others "
                f"({round(share * args.episodes)} of {args.episodes})"
            )
        report["splits"][split] = {"members": entries, "contrast": share}
        if args.draws:
            from bench_pass_at_k import pass_at_k  # beside this script (bench/ is the script's folder)

            spread = pass_at_k(list(zip(*[r["outcomes"] for r in played])))
            print(
                f"{args.draws} family members drawn per task: pass@1 {spread['pass@1']:.3f}, "
                f"pass@{args.draws} {spread['pass@k']:.3f}, both won and lost {spread['mixed']:.3f}"
            )
            report["splits"][split]["draws"] = {"k": args.draws, **spread}
    if args.json:
        from lib.files import write_json

        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
