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
import threading
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


def evaluate_stage(
    config: Any,
    adapter: Optional[Path],
    specs: Sequence[Any],
    target: Path,
    name: str,
    processes: Optional[int] = None,
) -> float:
    """Play `specs` (the validation split's first campaigns, say) greedily with the base model and
    `adapter` merged into it (none: zero-shot); write the episodes to `target`, whole or not at all.
    The campaigns are played in processes of their own, so the caller never holds the model: on a
    CPU split into contiguous shards played side by side, one process of `threads` compute threads
    each (`evaluation_processes`; `processes` fixes how many), and put back in order (two processes
    of one thread play SmolLM2's campaigns faster than one of two: docs/models.md); one process with
    a GPU or pinned threads. Returns the seconds, loading the model included."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from lib.episodes.records import save_episodes_jsonl
    from lib.training.processes import shard_bounds

    specs = list(specs)
    processes, threads = evaluation_processes(len(specs), config.eval_batch_size, processes)
    start = time.perf_counter()
    parent = os.getpid()
    bounds = [shard_bounds(len(specs), processes, index) for index in range(processes)]
    logger.info("%s: %d campaigns in %d process(es) of %d thread(s)", name, len(specs), processes, threads)
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        shards = [
            pool.submit(
                _play_shard, config, adapter, specs[lo:hi], name, threads, index == 0, (lo, hi, len(specs)), parent
            )
            for index, (lo, hi) in enumerate(bounds)
        ]
        played = [record for future in shards for record in future.result()]
    seconds = time.perf_counter() - start
    staging = target.with_name(target.name + ".partial.jsonl.gz")
    save_episodes_jsonl(played, str(staging))
    os.replace(staging, target)
    logger.info("%s: %d campaigns in %.0f s", name, len(played), seconds)
    return seconds


def evaluation_processes(campaigns: int, batch_size: int, processes: Optional[int] = None) -> tuple[int, int]:
    """(processes, threads each) an evaluation of `campaigns` is played with: on a CPU one process
    of one thread per free core (`lib.runtime.cpu_threads`), as many as hold a whole batch of
    `batch_size` campaigns each (a smaller share would decode a smaller batch), the free cores shared
    among them; one process where `OMP_NUM_THREADS` pins the threads, and with a GPU. `processes`
    given: that many, the free cores shared among them."""
    import torch

    from lib.runtime import cpu_threads, pinned_threads

    if processes is None and (torch.cuda.is_available() or pinned_threads() is not None):
        return 1, pinned_threads() or 1
    cores = cpu_threads()
    processes = processes or max(1, min(cores, campaigns // max(1, batch_size)))
    return processes, max(1, cores // processes)


def play_greedily(
    config: Any,
    adapter: Optional[Path],
    specs: Sequence[Any],
    name: str,
    progress_note: str = "",
    show_progress: bool = True,
) -> List[Dict[str, Any]]:
    """The episode records of `specs` played greedily, in this process, by the base model with
    `adapter` merged into its weights (none: the model as it comes)."""
    from peft import PeftModel

    from lib.training.backends import load_policy
    from lib.training.policy_evaluation import evaluate_policy

    policy = load_policy(config, "trl")
    model = policy.model
    if adapter is not None:  # merged into the weights: a third of the linear layers' calls, nothing to train here
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return evaluate_policy(
        model,
        policy.tokenizer,
        list(specs),
        config,
        agent_name=name,
        progress_note=progress_note,
        show_progress=show_progress,
    )


def _play_shard(
    config: Any,
    adapter: Optional[Path],
    specs: Sequence[Any],
    name: str,
    threads: int,
    shows_progress: bool,
    place: tuple[int, int, int],
    parent: int,
) -> List[Dict[str, Any]]:
    """One shard of `evaluate_stage`, in a process of its own with `threads` compute threads; the
    first shard alone draws progress, for campaigns `place` = (start, stop, of how many). It ends
    itself when `parent`, the process that started it, is gone (`exit_with_parent`)."""
    exit_with_parent(parent)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # read by lib.runtime.pinned_threads, not only by OpenMP
    import torch

    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    whole = place[1] - place[0] == place[2]
    note = "" if whole else f", campaigns {place[0] + 1}-{place[1]} of {place[2]} beside the other shards"
    return play_greedily(config, adapter, specs, name, progress_note=note, show_progress=shows_progress)


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


def exit_with_parent(parent: int, every_s: float = 1.0) -> threading.Thread:
    """Start a daemon thread that ends this process (`os._exit`) once its parent process is no longer
    `parent` (the pid the parent gave it: a parent gone before the thread started counts too),
    checked every `every_s` seconds: a worker process whose parent was killed stops rather than play
    on for nobody, beside a run started again."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="exit-with-parent", daemon=True)
    thread.start()
    return thread
