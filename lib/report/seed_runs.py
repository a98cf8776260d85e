"""Several training runs of one configuration read together: each seed's paired difference and the pooled one.

    python -m lib.report.seed_runs --run 0=evidence --run 1=build/seed1/evidence --run 2=build/seed2/evidence \\
        --sft build/sft/evidence --out evidence/seeds

Each run folder holds a run's `pre_eval.jsonl.gz` (its warm start) and `post_eval.jsonl.gz` (after
GRPO) on the same held-out suite. `--sft` names a run whose `pre_eval.jsonl.gz` is an SFT-only policy
(a warm start given the wall-clock time of a warm start and GRPO together). What is written:

- `outcomes.csv`: one row per run, side and episode (its task, part, whether a particle exists,
  its success and reward), the few numbers every comparison here needs, so that the intervals
  can be recomputed from the committed file (`--from-csv`) without the runs' trajectories;
- `seeds.json` and `seeds.md`: per group (`lib.measure.evaluation.GROUPS`), GRPO's Δ success and Δ
  reward over its warm start for each seed and pooled, and the GRPO policy against the SFT-only one;
- `seeds.png`: those differences with their 95% intervals, one point per seed and the pooled one;
- `checkpoints.csv` and `checkpoints.png`: each seed's held-out success at its checkpoints during
  training (its `checkpoint_evals.csv`: the checkpoint subset of the suite).

Pooling: every run plays the same tasks, so the per-task difference is averaged over the seeds and
the mean over tasks gets a percentile-bootstrap interval resampling tasks (the seeds of one task stay
together): it measures the configuration over training seeds, with the task-to-task variance paired out.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from cernenv.suite import part_of
from lib.episodes.records import ENDINGS, PAIR_KEY, episode_ending, load_episodes_jsonl, pair_key
from lib.measure.evaluation import GROUPS, PARTICLE_SPLITS, group_label
from lib.measure.metrics import Estimate, bootstrap_mean, has_particle
from lib.report.evidence_logs import EvidencePaths, read_records
from lib.seeds import BOOTSTRAP_SEED

OUTCOME_COLUMNS = ("run", "side", *PAIR_KEY, "part", "has_particle", "success", "reward", "ending")
"""The columns of outcomes.csv: the run's label, pre or post, the task, what it scored, and how it
ended (`lib.episodes.records.ENDINGS`). A file written before endings were recorded has every
column but the last, and reads with `ending` None."""
REPORTED_GROUPS = ("all", "unseen_with_particle", "unseen_null", "known_physics")
"""The groups seeds.json and seeds.png report."""


def outcome_rows(run: str, side: str, episodes: Sequence[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """One outcomes.csv row per episode of `episodes` (records read from an evaluation JSONL)."""
    rows = []
    for episode in episodes:
        row = {"run": run, "side": side, **dict(zip(PAIR_KEY, pair_key(episode)))}
        particle = has_particle(episode)
        row.update(
            part=part_of(episode.get("scenario")),
            has_particle=particle,
            success=int(episode.get("correct_outcome") is True),
            reward=float(episode.get("cumulative_reward") or 0.0),
            ending=episode_ending(episode),
        )
        rows.append(row)
    return rows


def seed_label(run: str) -> str:
    """A run's label as a table or legend names it: `seed 0` for "0", a label that says seed already as it is."""
    return run if str(run).startswith("seed") else f"seed {run}"


def write_outcomes_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=OUTCOME_COLUMNS, lineterminator="\n")
        writer.writeheader()
        for row in rows:
            particle = row["has_particle"]
            writer.writerow({**row, "has_particle": "" if particle is None else int(particle)})


def read_outcomes_csv(path: Path) -> List[Dict[str, Any]]:
    """outcomes.csv's rows, typed; a ValueError naming the line where one is not a row of it."""
    rows = []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) not in (OUTCOME_COLUMNS, OUTCOME_COLUMNS[:-1]):
            raise ValueError(f"{path}: the header is {reader.fieldnames}, not {list(OUTCOME_COLUMNS)}")
        for line, row in enumerate(reader, start=2):
            try:
                rows.append(
                    {
                        **row,
                        "seed": int(row["seed"]),
                        "scenario": row["scenario"] or None,
                        "difficulty": row["difficulty"] or None,
                        "has_particle": None if row["has_particle"] == "" else bool(int(row["has_particle"])),
                        "success": int(row["success"]),
                        "reward": float(row["reward"]),
                        "ending": _ending(row.get("ending")),
                    }
                )
            except (TypeError, ValueError) as error:
                raise ValueError(f"{path}, line {line}: {error}") from None
            if row["side"] not in ("pre", "post") or rows[-1]["success"] not in (0, 1):
                raise ValueError(f"{path}, line {line}: side must be pre or post and success 0 or 1")
    return rows


def _ending(text: Optional[str]) -> Optional[str]:
    """An outcomes.csv `ending` cell: one of `ENDINGS`, or None in a file written without them."""
    if text is None:
        return None
    if text not in ENDINGS:
        raise ValueError(f"ending must be one of {list(ENDINGS)}, got {text!r}")
    return text


def in_group(row: Mapping[str, Any], group: str) -> bool:
    part, split = GROUPS[group]
    return (part is None or row["part"] == part) and (split is None or row["has_particle"] is PARTICLE_SPLITS[split])


def _values(rows: Sequence[Mapping[str, Any]], run: str, side: str, metric: str, group: str) -> Dict[Tuple, float]:
    values: Dict[Tuple, float] = {}
    for row in rows:
        if row["run"] == run and row["side"] == side and in_group(row, group):
            key = pair_key(row)
            if key in values:
                raise ValueError(f"run {run} ({side}) holds task {key} twice")
            values[key] = float(row[metric])
    return values


def pooled_difference(
    rows: Sequence[Mapping[str, Any]],
    before: Sequence[Tuple[str, str]],
    after: Sequence[Tuple[str, str]],
    metric: str,
    group: str,
) -> Estimate:
    """mean over tasks of (mean over `after` sides − mean over `before` sides) of `metric` in `group`,
    with a 95% bootstrap interval resampling tasks; `before`/`after` are (run, side) pairs that must
    hold the same tasks (a ValueError otherwise)."""
    sides = [_values(rows, run, side, metric, group) for run, side in (*before, *after)]
    tasks = set(sides[0])
    if any(set(values) != tasks for values in sides):
        raise ValueError(f"the runs compared do not hold the same tasks in {group}")
    order = sorted(tasks, key=repr)
    first = np.array([[values[t] for t in order] for values in sides[: len(before)]]).mean(axis=0)
    second = np.array([[values[t] for t in order] for values in sides[len(before) :]]).mean(axis=0)
    return bootstrap_mean(list(second - first), seed=BOOTSTRAP_SEED)


def seed_comparisons(rows: Sequence[Mapping[str, Any]], runs: Sequence[str], sft: Optional[str]) -> Dict[str, Any]:
    """seeds.json: per group and metric, each run's GRPO − warm start, the pooled one, and (with an
    SFT-only run) each run's and the pooled GRPO policy − SFT-only policy."""
    result: Dict[str, Any] = {"runs": list(runs), "sft_run": sft, "groups": {}}
    for group in REPORTED_GROUPS:
        entry: Dict[str, Any] = {"label": group_label(group)}
        for metric in ("success", "reward"):
            grpo = {run: pooled_difference(rows, [(run, "pre")], [(run, "post")], metric, group) for run in runs}
            grpo["pooled"] = pooled_difference(
                rows, [(run, "pre") for run in runs], [(run, "post") for run in runs], metric, group
            )
            entry[f"grpo_minus_warm_start_{metric}"] = {k: asdict(v) for k, v in grpo.items()}
            if sft:
                versus = {run: pooled_difference(rows, [(sft, "pre")], [(run, "post")], metric, group) for run in runs}
                versus["pooled"] = pooled_difference(
                    rows, [(sft, "pre")] * len(runs), [(run, "post") for run in runs], metric, group
                )
                entry[f"grpo_minus_sft_{metric}"] = {k: asdict(v) for k, v in versus.items()}
        entry["n_tasks"] = len(_values(rows, runs[0], "pre", "success", group))
        for run in runs:
            for side in ("pre", "post"):
                entry[f"success_{run}_{side}"] = int(sum(_values(rows, run, side, "success", group).values()))
        if sft:
            entry["success_sft"] = int(sum(_values(rows, sft, "pre", "success", group).values()))
        result["groups"][group] = entry
    return result


def _cell(estimate: Mapping[str, Any]) -> str:
    return f"{estimate['mean']:+.3f} [{estimate['low']:+.3f}, {estimate['high']:+.3f}]"


def seeds_markdown(result: Mapping[str, Any]) -> str:
    """seeds.md: one table per comparison, a row per group, a column per seed and the pooled one."""
    runs = result["runs"]
    lines = []
    comparisons = [("grpo_minus_warm_start", "GRPO − its warm start")]
    if result.get("sft_run"):
        comparisons.append(("grpo_minus_sft", "GRPO − the SFT-only policy given the same time"))
    for key, title in comparisons:
        for metric in ("success", "reward"):
            lines += [
                f"**{title}, Δ {metric}** (paired by task, 95% bootstrap)",
                "",
                "| group | tasks | " + " | ".join(seed_label(run) for run in runs) + " | pooled |",
                "|---|---|" + "---|" * (len(runs) + 1),
            ]
            for group, entry in result["groups"].items():
                cells = [_cell(entry[f"{key}_{metric}"][name]) for name in (*runs, "pooled")]
                lines.append(f"| {entry['label']} | {entry['n_tasks']} | " + " | ".join(cells) + " |")
            lines.append("")
    lines += ["| group | " + " | ".join(f"{seed_label(run)} before → after" for run in runs) + " | SFT-only |", ""]
    lines[-1] = "|---|" + "---|" * (len(runs) + 1)
    for group, entry in result["groups"].items():
        cells = [f"{entry[f'success_{run}_pre']} → {entry[f'success_{run}_post']}" for run in runs]
        sft = str(entry.get("success_sft", "–"))
        lines.append(f"| {entry['label']} (of {entry['n_tasks']}) | " + " | ".join(cells) + f" | {sft} |")
    return "\n".join(lines) + "\n"


def seeds_figure(result: Mapping[str, Any], path: Path) -> None:
    """seeds.png: Δ success per group, a point per seed and the pooled one with its interval; a
    second panel for GRPO against the SFT-only policy when there is one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["grpo_minus_warm_start"] + (["grpo_minus_sft"] if result.get("sft_run") else [])
    titles = {"grpo_minus_warm_start": "GRPO − its warm start", "grpo_minus_sft": "GRPO − SFT-only (same time)"}
    runs, groups = result["runs"], list(result["groups"])
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys) + 1.2, 3.8), squeeze=False, sharey=True)
    for ax, key in zip(axes[0], keys):
        for g, group in enumerate(groups):
            estimates = result["groups"][group][f"{key}_success"]
            for r, run in enumerate(runs):
                e = estimates[run]
                x = g + (r - (len(runs) - 1) / 2) * 0.12 - 0.15
                ax.errorbar(
                    x,
                    e["mean"],
                    yerr=[[e["mean"] - e["low"]], [e["high"] - e["mean"]]],
                    fmt="o",
                    color=f"C{r}",
                    ms=4,
                    lw=1,
                    label=seed_label(run) if g == 0 else None,
                )
            e = estimates["pooled"]
            ax.errorbar(
                g + 0.3,
                e["mean"],
                yerr=[[e["mean"] - e["low"]], [e["high"] - e["mean"]]],
                fmt="D",
                color="black",
                ms=6,
                lw=2,
                label="pooled" if g == 0 else None,
            )
        ax.axhline(0.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(groups)), [result["groups"][g]["label"] for g in groups], rotation=20, ha="right")
        ax.set_title(titles[key])
        ax.set_ylabel("Δ success (95% interval)")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside the data, not on it
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


CHECKPOINT_COLUMNS = ("run", "step", "episodes", "success_rate", "mean_reward")


def checkpoint_rows(run: str, folder: Path) -> List[Dict[str, Any]]:
    """`run`'s checkpoint evaluations (its checkpoint_evals.csv), as checkpoints.csv rows."""
    return [
        {"run": run, **{column: row.get(column) for column in CHECKPOINT_COLUMNS[1:]}}
        for row in read_records(EvidencePaths(folder).checkpoint_evals_csv).rows
    ]


def checkpoints_figure(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """checkpoints.png: each seed's held-out success over its GRPO steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    for index, run in enumerate(dict.fromkeys(row["run"] for row in rows)):
        points = sorted(
            (int(r["step"]), float(r["success_rate"]))
            for r in rows
            if r["run"] == run and r["success_rate"] not in ("", None)
        )
        ax.plot(*zip(*points), marker="o", color=f"C{index}", label=seed_label(run))
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("held-out success (checkpoint subset)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lib.report.seed_runs",
        description=__doc__.split("\n\n")[0],
        allow_abbrev=False,
    )
    parser.add_argument("--run", action="append", default=[], help="LABEL=FOLDER: a run's evidence folder")
    parser.add_argument("--sft", help="FOLDER: an SFT-only run's evidence folder (its pre_eval.jsonl.gz)")
    parser.add_argument("--from-csv", help="recompute from an outcomes.csv instead of run folders")
    parser.add_argument("--out", required=True, help="folder for outcomes.csv, seeds.json, seeds.md, seeds.png")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.from_csv:
        rows = read_outcomes_csv(Path(args.from_csv))
        runs = list(dict.fromkeys(row["run"] for row in rows if row["run"] != "sft"))
        sft = "sft" if any(row["run"] == "sft" for row in rows) else None
    else:
        if not args.run:
            parser.error("name the runs with --run LABEL=FOLDER (or --from-csv)")
        rows, runs = [], []
        for item in args.run:
            label, _, folder = item.partition("=")
            if not folder or label == "sft":
                parser.error(f"--run wants LABEL=FOLDER with a label other than sft, got {item!r}")
            runs.append(label)
            files = EvidencePaths(Path(folder))
            for side, path in (("pre", files.pre_eval_jsonl), ("post", files.post_eval_jsonl)):
                rows += outcome_rows(label, side, load_episodes_jsonl(str(path)))
        checkpoints = [
            row for item in args.run for row in checkpoint_rows(item.partition("=")[0], Path(item.partition("=")[2]))
        ]
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "checkpoints.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=CHECKPOINT_COLUMNS, lineterminator="\n")
            writer.writeheader()
            writer.writerows(checkpoints)
        sft = None
        if args.sft:
            sft = "sft"
            rows += outcome_rows(sft, "pre", load_episodes_jsonl(str(EvidencePaths(Path(args.sft)).pre_eval_jsonl)))
        out.mkdir(parents=True, exist_ok=True)
        write_outcomes_csv(out / "outcomes.csv", rows)
    result = seed_comparisons(rows, runs, sft)
    out.mkdir(parents=True, exist_ok=True)
    (out / "seeds.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "seeds.md").write_text(seeds_markdown(result))
    seeds_figure(result, out / "seeds.png")
    if (out / "checkpoints.csv").exists():
        with open(out / "checkpoints.csv", newline="") as handle:
            checkpoints_figure(list(csv.DictReader(handle)), out / "checkpoints.png")
    print(seeds_markdown(result))
    print(f"wrote {out}/seeds.json, seeds.md, seeds.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
