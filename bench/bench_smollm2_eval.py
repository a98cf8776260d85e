"""How fast SmolLM2-135M-Instruct plays an evaluation on this CPU, setting against setting.

    python bench/bench_smollm2_eval.py --adapter build/smollm2/imitation/adapter --campaigns 48 \\
        --batch-sizes 24 --processes 1 2 [--sdpa-gqa on off] [--out build/smollm2-eval-speed]
    make bench-smollm2-eval

Each setting plays the validation split's first `--campaigns` campaigns greedily, as every
evaluation of SmolLM2's pipeline does (`lib.training.imitation.evaluate_stage`: the adapter merged
into the weights, replies held to the grammar of the references shown, the configuration's
observations and limits), in a process of its own so that none inherits another's memory. The
settings are the evaluation's batch (`eval_batch_size`: campaigns decoded together), the processes
that play the campaigns' shards side by side (`evaluate_stage`'s `processes`: one of two threads,
or one of one thread per core) and transformers' own switch for grouped-query attention in
PyTorch's SDPA (`--sdpa-gqa`; `TRANSFORMERS_SDPA_FORCE_GQA=1`: attention reads SmolLM2's 3
key-value heads for its 9 query heads as they are, instead of copying them to 9 at every pass when
the batch is padded). Every CPU run sets it on (`lib.runtime.attend_grouped_queries`), the
default here; `off` is the copies' path.

For each setting: the wall-clock seconds, the seconds a campaign, the decisions played, the
correct outcomes, and whether every campaign played the same actions as the first setting's (a
batch pads its rows differently, and float sums in another order can turn a near tie between two
tokens). `results.json` and a table on stdout. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

from lib.runtime import SDPA_GROUPED_QUERY_SWITCH

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "train" / "smollm2-cpu.yaml"


def play(
    config_path: Path, adapter: Optional[Path], campaigns: int, batch_size: int, processes: int, target: Path
) -> float:
    """Play the setting from this process; returns the seconds (`evaluate_stage`'s)."""
    from lib.measure.evaluation import validation_suite
    from lib.training.cli import parse_train_config
    from lib.training.imitation import evaluate_stage

    config, _ = parse_train_config(["--config", str(config_path)])
    config = dataclasses.replace(config, eval_batch_size=batch_size)
    return evaluate_stage(config, adapter, validation_suite(campaigns), target, "bench", processes=processes)


def actions(episodes: List[Dict[str, Any]]) -> List[List[Any]]:
    """Per campaign, the actions it played, in order."""
    return [[step["action"] for step in episode["steps"]] for episode in episodes]


def measures(episodes: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The campaigns, the decisions played and the correct outcomes of a setting's episodes."""
    return {
        "campaigns": len(episodes),
        "decisions": sum(len(e["steps"]) for e in episodes),
        "correct": sum(1 for e in episodes if e.get("correct_outcome")),
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the training configuration")
    parser.add_argument("--adapter", type=Path, default=None, help="a LoRA adapter's folder (none: zero-shot)")
    parser.add_argument("--campaigns", type=int, default=48, help="validation campaigns each setting plays")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[24], help="eval_batch_size settings")
    parser.add_argument(
        "--processes", type=int, nargs="+", default=[1, 2], help="processes playing the shards side by side"
    )
    parser.add_argument(
        "--sdpa-gqa",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="SDPA's grouped-query switch in each setting (on: every CPU run's; off: the key-value heads copied)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "smollm2-eval-speed", help="results.json here")
    parser.add_argument("--play", nargs=3, metavar=("BATCH", "PROCESSES", "TARGET"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.adapter is not None and not (args.adapter / "adapter_config.json").is_file():
        parser.error(f"{args.adapter} holds no adapter_config.json: give a LoRA adapter's folder, or none")
    if args.play:  # one setting, in the process the parent started
        batch, processes, target = int(args.play[0]), int(args.play[1]), Path(args.play[2])
        seconds = play(args.config, args.adapter, args.campaigns, batch, processes, target)
        print(json.dumps({"seconds": seconds}))
        return 0
    from lib.episodes.records import load_episodes_jsonl

    args.out.mkdir(parents=True, exist_ok=True)
    if min(args.processes) < 1:
        parser.error(f"--processes are counts of processes, at least 1 (got {args.processes})")
    settings = [(b, n, gqa == "on") for gqa in args.sdpa_gqa for b in args.batch_sizes for n in args.processes]
    rows: List[Dict[str, Any]] = []
    first: Optional[List[List[Any]]] = None
    with tempfile.TemporaryDirectory(prefix="smollm2-eval-speed-") as work:
        for batch, processes, gqa in settings:
            target = Path(work) / f"batch-{batch}-processes-{processes}-gqa-{int(gqa)}.jsonl.gz"
            command = [sys.executable, __file__, "--config", str(args.config), "--campaigns", str(args.campaigns)]
            command += ["--adapter", str(args.adapter)] if args.adapter is not None else []
            command += ["--play", str(batch), str(processes), str(target)]
            env = {**os.environ, SDPA_GROUPED_QUERY_SWITCH: "1" if gqa else "0"}
            done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                print(done.stderr[-4000:], file=sys.stderr)
                return done.returncode
            seconds = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
            episodes = load_episodes_jsonl(str(target))
            played = actions(episodes)
            first = played if first is None else first
            same = sum(1 for a, b in zip(played, first) if a == b)
            row = {"eval_batch_size": batch, "processes": processes, "sdpa_gqa": gqa, "seconds": round(seconds, 1)}
            row.update(measures(episodes))
            row["seconds_a_campaign"] = round(seconds / row["campaigns"], 2)
            row["campaigns_as_first_setting"] = same
            rows.append(row)
            print(json.dumps(row), flush=True)
    results = {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "load_before": os.getloadavg(),
        "adapter": None if args.adapter is None else str(args.adapter),
        "campaigns": args.campaigns,
        "settings": rows,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print("| batch | processes | SDPA GQA | seconds | s a campaign | decisions | correct | same actions as the first |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['eval_batch_size']} | {row['processes']} | {'on' if row['sdpa_gqa'] else 'off'} | "
            f"{row['seconds']} | "
            f"{row['seconds_a_campaign']} | {row['decisions']} | {row['correct']} | "
            f"{row['campaigns_as_first_setting']} of {row['campaigns']} |"
        )
    return 0


def _cpu_name() -> str:
    from bench_smollm2_speed import cpu_name  # beside this script: Python puts its folder on the path

    return cpu_name()


if __name__ == "__main__":
    sys.exit(main())
