"""SmolLM2-135M-Instruct's imitation learning curve on a CPU: one LoRA warm start on the heuristic
family's campaigns, evaluated after each size of `--sizes`, and the model zero-shot beside it.

    python bench/bench_smollm2_curve.py --sizes 50 100 200 --eval-episodes 120 --out build/smollm2-curve

The warm start is one run at a constant learning rate over the demonstrations in order, cut into
stages at the sizes: stage k trains the adapter that stage k-1 saved on demonstrations
[N(k-1), N(k)) (each campaign once), so its adapter is what one run would hold after N(k)
campaigns. Each stage's adapter (`adapter-N/`) and each evaluation (`eval-N.jsonl.gz`: greedy,
the validation split's first `--eval-episodes` campaigns, the configuration's setting) is written
whole once done, so a run that is killed goes on from the last one written when started again with
the same arguments. `curve.csv` (one row per evaluation: campaigns, correct, success and mean
reward with 95% bootstrap intervals, refused actions per campaign, seconds) and `curve.png` are
written again after each evaluation. `--zero-shot` first evaluates the model as it comes
(`eval-0.jsonl.gz`).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "train" / "smollm2-cpu.yaml"
COLUMNS = (
    "campaigns",
    "evaluated",
    "correct",
    "success",
    "success_low",
    "success_high",
    "mean_reward",
    "reward_low",
    "reward_high",
    "refused_per_campaign",
    "particle_correct",
    "particle_tasks",
    "train_seconds",
    "eval_seconds",
)
"""`curve.csv`'s columns: per evaluation, the demonstrations seen and the play's measures."""

logger = logging.getLogger("smollm2-curve")


def load_config(path: Path, overrides: List[str]) -> Any:
    from lib.training.cli import parse_train_config

    config, _ = parse_train_config(["--config", str(path), *overrides])
    return config


def train_stage(
    config: Any, previous: Optional[Path], examples: List[Dict[str, List[int]]], target: Path, checkpointing: bool
) -> float:
    """Train the adapter saved in `previous` (a new one where None) on `examples`, each once, at the
    configuration's warm-start learning rate held constant; save it in `target`, whole or not at all.
    Returns the training seconds."""
    from peft import PeftModel

    from lib.files import share_folder, staging_folder
    from lib.training.backends import load_policy
    from lib.training.warm_start import sft_trainer

    policy = load_policy(config, "trl")
    if previous is not None:
        policy.model = PeftModel.from_pretrained(policy.model, str(previous), is_trainable=True)
        policy.peft_config = None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="curve-stage-") as work:
        trainer = sft_trainer(
            policy,
            config,
            examples,
            work,
            epochs=1.0,
            lr_scheduler_type="constant",
            gradient_checkpointing=checkpointing,
        )
        trainer.train()
    seconds = time.perf_counter() - start
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    staging = staging_folder(target)
    trainer.model.save_pretrained(staging)
    (staging / "stage.json").write_text(
        json.dumps({"examples": len(examples), "seconds": seconds, "losses": losses}, indent=1) + "\n"
    )
    share_folder(staging)
    os.replace(staging, target)
    logger.info("stage to %s: %d campaigns in %.0f s, loss %s", target.name, len(examples), seconds, _ends(losses))
    return seconds


def _ends(losses: List[float]) -> str:
    return f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "not logged"


def evaluate_stage(config: Any, adapter: Optional[Path], episodes: int, target: Path, name: str) -> float:
    """Play the validation split's first `episodes` campaigns greedily with the base model and
    `adapter` (none: zero-shot); write the episodes to `target`. Returns the seconds."""
    from peft import PeftModel

    from lib.episodes.records import save_episodes_jsonl
    from lib.measure.evaluation import validation_suite
    from lib.training.backends import load_policy
    from lib.training.policy_evaluation import evaluate_policy

    policy = load_policy(config, "trl")
    model = policy.model
    if adapter is not None:  # merged into the weights: a third of the linear layers' calls, nothing to train here
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    start = time.perf_counter()
    played = evaluate_policy(model, policy.tokenizer, validation_suite(episodes), config, agent_name=name)
    seconds = time.perf_counter() - start
    staging = target.with_name(target.name + ".partial.jsonl.gz")
    save_episodes_jsonl(played, str(staging))
    os.replace(staging, target)
    return seconds


def curve_row(campaigns: int, path: Path, train_seconds: float, eval_seconds: float) -> Dict[str, Any]:
    """One row of `curve.csv` from an evaluation's episodes."""
    from lib.episodes.records import load_episodes_jsonl
    from lib.measure.comparison import bootstrap_interval, episode_values, summarise_episodes

    episodes = load_episodes_jsonl(str(path))
    summary = summarise_episodes(episodes)
    success = bootstrap_interval([v for _, v in episode_values(episodes, "success_rate")])
    reward = bootstrap_interval([v for _, v in episode_values(episodes, "mean_reward")])
    refused = [sum(1 for step in e["steps"] if step["rule_violations"]) for e in episodes]
    particle = [e for e in episodes if (e.get("truth") or {}).get("exists")]
    return {
        "campaigns": campaigns,
        "evaluated": summary["n"],
        "correct": summary["n_correct"],
        "success": round(summary["success_rate"], 4),
        "success_low": round(success[0], 4),
        "success_high": round(success[1], 4),
        "mean_reward": round(summary["mean_reward"], 4),
        "reward_low": round(reward[0], 4),
        "reward_high": round(reward[1], 4),
        "refused_per_campaign": round(sum(refused) / max(1, len(refused)), 3),
        "particle_correct": sum(1 for e in particle if e.get("correct_outcome")),
        "particle_tasks": len(particle),
        "train_seconds": round(train_seconds),
        "eval_seconds": round(eval_seconds),
    }


def write_curve(out: Path, rows: List[Dict[str, Any]]) -> None:
    """`curve.csv` and `curve.png` from the rows so far."""
    with open(out / "curve.csv.partial", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(out / "curve.csv.partial", out / "curve.csv")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    x = [row["campaigns"] for row in rows]
    y = [row["success"] for row in rows]
    errors = [
        [row["success"] - row["success_low"] for row in rows],
        [row["success_high"] - row["success"] for row in rows],
    ]
    ax.errorbar(x, y, yerr=errors, marker="o", capsize=3, label="SmolLM2-135M-Instruct + LoRA")
    ax.set_xlabel("demonstration campaigns seen (0: zero-shot)")
    ax.set_ylabel(f"success on {rows[0]['evaluated']} validation campaigns")
    ax.set_ylim(0, 1)
    ax.set_title("Imitation learning curve (95% bootstrap intervals)", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=120)
    plt.close(fig)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the training configuration")
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 100, 200], help="campaigns at each evaluation")
    parser.add_argument("--eval-episodes", type=int, default=120, help="validation campaigns each evaluation plays")
    parser.add_argument("--zero-shot", action="store_true", help="first evaluate the model as it comes")
    parser.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="recompute activations in the backward pass (less memory, ~1/3 more compute); off: a brief campaign's "
        "activations fit in a few GB",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "smollm2-curve", help="where it all goes")
    parser.add_argument(
        "overrides", nargs="*", help="TrainConfig fields after --, e.g. -- --warm_start_learning_rate 3e-4"
    )
    args = parser.parse_args(argv)
    if sorted(set(args.sizes)) != args.sizes or args.sizes[0] <= 0:
        parser.error("--sizes must be increasing positive numbers of campaigns")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from lib.seeds import DEMONSTRATION_SEED
    from lib.training.backends import model_source
    from lib.training.tokenizer import corpus_specs, load_tokenizer
    from lib.training.warm_start import demonstration_examples, demonstration_layout

    config = load_config(args.config, args.overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "settings.json").write_text(
        json.dumps(
            {
                "config": str(args.config),
                "overrides": args.overrides,
                "sizes": args.sizes,
                "eval_episodes": args.eval_episodes,
            },
            indent=1,
        )
        + "\n"
    )
    rows: List[Dict[str, Any]] = []
    if args.zero_shot:
        target = args.out / "eval-0.jsonl.gz"
        seconds = 0.0 if target.is_file() else evaluate_stage(config, None, args.eval_episodes, target, "zero-shot")
        rows.append(curve_row(0, target, 0.0, seconds))
        write_curve(args.out, rows)
        logger.info("zero-shot: %d of %d correct", rows[-1]["correct"], rows[-1]["evaluated"])
    tokenizer = load_tokenizer(model_source(config.model_name))
    specs = corpus_specs(args.sizes[-1], DEMONSTRATION_SEED)
    previous: Optional[Path] = None
    done = 0
    for size in args.sizes:
        adapter = args.out / f"adapter-{size}"
        train_seconds = 0.0
        if not (adapter / "stage.json").is_file():
            examples = demonstration_examples(
                tokenizer, size - done, specs=specs[done:size], **demonstration_layout(config)
            )
            logger.info(
                "stage %d -> %d: %d demonstrations, %d tokens",
                done,
                size,
                len(examples),
                sum(len(e["input_ids"]) for e in examples),
            )
            train_seconds = train_stage(config, previous, examples, adapter, args.gradient_checkpointing)
        else:
            train_seconds = json.loads((adapter / "stage.json").read_text())["seconds"]
        target = args.out / f"eval-{size}.jsonl.gz"
        eval_seconds = 0.0
        if not target.is_file():
            eval_seconds = evaluate_stage(config, adapter, args.eval_episodes, target, f"imitation-{size}")
        rows.append(curve_row(size, target, train_seconds, eval_seconds))
        write_curve(args.out, rows)
        row = rows[-1]
        logger.info(
            "after %d campaigns: %d of %d correct, success %.3f [%.3f, %.3f], reward %+.2f, %.1f refused a campaign",
            size,
            row["correct"],
            row["evaluated"],
            row["success"],
            row["success_low"],
            row["success_high"],
            row["mean_reward"],
            row["refused_per_campaign"],
        )
        previous, done = adapter, size
    print(f"curve: {args.out / 'curve.csv'} and {args.out / 'curve.png'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
