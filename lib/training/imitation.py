"""Imitation in stages, for a pretrained model with a LoRA adapter: train an adapter on demonstrations
(each once, at a constant learning rate from the adapter an earlier stage saved, or a whole run on a
decaying schedule), play it greedily on the validation split, and summarise each play as one row of
a learning curve. Used by the imitation curve (bench/bench_smollm2_curve.py) and SmolLM2's whole
pipeline (`lib.training.smollm2_pipeline`). Every adapter and every evaluation is written whole or
not at all, so a killed run goes on from the last one written.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

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

logger = logging.getLogger(__name__)


def train_stage(
    config: Any,
    previous: Optional[Path],
    examples: List[Dict[str, List[int]]],
    target: Path,
    checkpointing: bool,
    lr_schedule: str = "constant",
) -> float:
    """Train the adapter saved in `previous` (a new one where None) on `examples`, each once, from the
    configuration's warm-start learning rate on `lr_schedule` (`TrainConfig.warm_start_lr_schedule`'s
    names; "constant" for a stage that goes on from another); save it in `target`, whole or not at
    all. Returns the training seconds."""
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
            lr_scheduler_type=lr_schedule,
            gradient_checkpointing=checkpointing,
        )
        trainer.train()
    seconds = time.perf_counter() - start
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    staging = staging_folder(target)
    trainer.model.save_pretrained(staging)
    (staging / "stage.json").write_text(
        json.dumps(
            {"examples": len(examples), "seconds": seconds, "lr_schedule": lr_schedule, "losses": losses}, indent=1
        )
        + "\n"
    )
    share_folder(staging)
    os.replace(staging, target)
    logger.info("stage to %s: %d campaigns in %.0f s, loss %s", target.name, len(examples), seconds, _ends(losses))
    return seconds


def _ends(losses: List[float]) -> str:
    return f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "not logged"


def evaluate_stage(config: Any, adapter: Optional[Path], specs: Sequence[Any], target: Path, name: str) -> float:
    """Play `specs` (the validation split's first campaigns, say) greedily with the base model and
    `adapter` merged into it (none: zero-shot); write the episodes to `target`, whole or not at all.
    Returns the seconds."""
    from peft import PeftModel

    from lib.episodes.records import save_episodes_jsonl
    from lib.training.backends import load_policy
    from lib.training.policy_evaluation import evaluate_policy

    policy = load_policy(config, "trl")
    model = policy.model
    if adapter is not None:  # merged into the weights: a third of the linear layers' calls, nothing to train here
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    start = time.perf_counter()
    played = evaluate_policy(model, policy.tokenizer, list(specs), config, agent_name=name)
    seconds = time.perf_counter() - start
    staging = target.with_name(target.name + ".partial.jsonl.gz")
    save_episodes_jsonl(played, str(staging))
    os.replace(staging, target)
    logger.info("%s: %d campaigns in %.0f s", name, len(played), seconds)
    return seconds


def evaluation_measures(path: Path) -> Dict[str, Any]:
    """An evaluation's measures from its episodes, unrounded: campaigns played and correct, success and
    mean reward with their 95% bootstrap intervals, refused actions a campaign, particle tasks right."""
    from lib.episodes.records import load_episodes_jsonl
    from lib.measure.comparison import bootstrap_interval, episode_values, summarise_episodes

    episodes = load_episodes_jsonl(str(path))
    summary = summarise_episodes(episodes)
    success = bootstrap_interval([v for _, v in episode_values(episodes, "success_rate")])
    reward = bootstrap_interval([v for _, v in episode_values(episodes, "mean_reward")])
    refused = [sum(1 for step in e["steps"] if step["rule_violations"]) for e in episodes]
    particle = [e for e in episodes if (e.get("truth") or {}).get("exists")]
    return {
        "evaluated": summary["n"],
        "correct": summary["n_correct"],
        "success": summary["success_rate"],
        "success_low": success[0],
        "success_high": success[1],
        "mean_reward": summary["mean_reward"],
        "reward_low": reward[0],
        "reward_high": reward[1],
        "refused_per_campaign": sum(refused) / max(1, len(refused)),
        "particle_correct": sum(1 for e in particle if e.get("correct_outcome")),
        "particle_tasks": len(particle),
    }


def curve_row(campaigns: int, path: Path, train_seconds: float, eval_seconds: float) -> Dict[str, Any]:
    """One row of `curve.csv` from an evaluation's episodes: `evaluation_measures`, rounded for the table."""
    measures = evaluation_measures(path)
    digits = {"refused_per_campaign": 3}
    rounded = {k: round(v, digits.get(k, 4)) if isinstance(v, float) else v for k, v in measures.items()}
    return {
        "campaigns": campaigns,
        **rounded,
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
