"""`EvidenceCallback`: writes the evidence of a GRPO run while it trains (`lib.report.evidence`).

- on each log: a training_log.csv row (step, epoch, loss, reward, reward_std, kl,
  grad_norm, learning_rate, wall_time_s, frac_reward_zero_std: the share of groups alike),
  then the training-curve and reward-component plots are redrawn from the logs so far;
- every `eval_every_steps`: the policy plays the fixed checkpoint subset of the held-out
  suite greedily; a checkpoint_evals.csv row, and the progression plot redrawn.

`TrainingProgress`: a Trainer's progress (`lib.progress`: a bar with the time left, or a log line
when headless) and one compact line of the metrics that matter at each log, in place of
transformers' `PrinterCallback`, which `disable_tqdm=True` adds and which prints each log as a
dict of ~47 entries. `trainer_progress(label)` puts it into every Trainer made inside it (the
warm start's SFT trainer, the GRPO trainer).

A GRPO step that could not move the policy (a gradient norm of about zero, or every group's
episodes scored alike: `lib.report.conclusion.still_step`) gets a warning of its own, at once and
in capitals, beside its metrics line: a run whose steps all read `groups alike 1.00, grad norm
1e-07` learned nothing from GRPO, and its metrics line alone did not say so.

`CpuThreads`: before each optimisation step, torch's compute threads set to the cores other
processes left free during the step before (`lib.runtime.cpu_threads`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from transformers import TrainerCallback

from lib.measure.comparison import checkpoint_row
from lib.measure.evaluation import split_of
from lib.progress import Progress
from lib.report.conclusion import STILL_STEP_ADVICE, still_step
from lib.report.evidence import (
    CheckpointEvalWriter,
    EvidencePaths,
    TrainingLogWriter,
    render_checkpoint_progression,
    render_reward_components,
    render_training_curve,
)
from lib.runtime import (
    attend_grouped_queries,
    busy_cores_elsewhere,
    cpu_snapshot,
    keep_freed_memory,
    pinned_threads,
    use_cpu_threads,
)

logger = logging.getLogger(__name__)

_LOG_KEYS = {
    "loss": "loss",
    "reward": "reward",
    "reward_std": "reward_std",
    "kl": "kl",
    "grad_norm": "grad_norm",
    "learning_rate": "learning_rate",
    "frac_reward_zero_std": "frac_reward_zero_std",
}


class EvidenceCallback(TrainerCallback):
    """Evidence rows and plots during `GRPOTrainer.train()`.

    `evaluate(model)` plays the checkpoint episodes and returns their records (as dicts);
    it is called every `eval_every_steps` optimisation steps (0: never). `elapsed_s`: the seconds
    a resumed run had logged before (its training log's `wall_time_s` goes on from them).
    """

    def __init__(
        self,
        paths: EvidencePaths,
        *,
        eval_every_steps: int,
        elapsed_s: float = 0.0,
        evaluate: Optional[Callable[[Any], Sequence[Dict[str, Any]]]] = None,
        max_steps: Optional[int] = None,
        render: bool = True,
        final_from_post_eval: bool = False,
        write: bool = True,
    ) -> None:
        self.paths = paths
        self.write = write
        """False (every process of a multi-process run but the main one): evaluate, write nothing."""
        if write:
            paths.ensure()
            self.training_log = TrainingLogWriter(paths.training_log_csv)
            self.checkpoint_log = CheckpointEvalWriter(paths.checkpoint_evals_csv)
        self.eval_every_steps = eval_every_steps
        self.evaluate = evaluate
        self.max_steps = max_steps
        self.render = render
        self.final_from_post_eval = final_from_post_eval
        """True: the caller records the last step's row itself (from its post-training evaluation)."""
        self.started = time.perf_counter() - elapsed_s
        self.eval_seconds = 0.0
        self.checkpoint_results: List[Dict[str, Any]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if not self.write or not any(key in logs for key in ("loss", "reward")):
            return  # e.g. the final train_runtime summary
        row = {
            "step": state.global_step,
            "epoch": logs.get("epoch", state.epoch),
            "wall_time_s": round(time.perf_counter() - self.started, 3),
        }
        row.update({column: logs.get(key) for column, key in _LOG_KEYS.items()})
        self.training_log.append(row)
        if self.render:
            render_training_curve(self.paths.training_log_csv, self.paths.training_curve_png)
            render_reward_components(self.paths.reward_components_csv, self.paths.reward_components_png)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self.eval_every_steps or self.evaluate is None or state.global_step % self.eval_every_steps:
            return
        if state.global_step == state.max_steps and self.final_from_post_eval:
            return  # the run records the last step from its post-training evaluation
        self.record_checkpoint(state.global_step, model, max_steps=state.max_steps)

    def record_checkpoint(
        self,
        step: int,
        model: Any,
        *,
        max_steps: Optional[int] = None,
        episodes: Optional[Sequence[Dict[str, Any]]] = None,
    ) -> Dict[str, Any]:
        """Evaluate `model` (or take the given `episodes`) and append a checkpoint row."""
        start = time.perf_counter()
        if episodes is None:
            episodes = self.evaluate(model)
        total = max_steps or self.max_steps
        row = checkpoint_row(step, episodes, fraction_done=step / total if total else None)
        self.checkpoint_results.append(row)
        self.eval_seconds += time.perf_counter() - start
        if not self.write:
            return row
        self.checkpoint_log.append(**row)
        logger.info(
            "checkpoint eval at step %d: mean reward %.3f, success %.3f",
            step,
            row["mean_reward"] or 0.0,
            row["success_rate"] or 0.0,
        )
        if self.render:
            render_checkpoint_progression(
                self.paths.checkpoint_evals_csv, self.paths.checkpoint_progression_png, split_of(episodes)
            )
        return row


METRICS_LINE = (
    ("reward", "reward", "{:+.3f}"),
    ("reward_std", "±", "{:.3f}"),
    ("frac_reward_zero_std", "groups alike", "{:.2f}"),
    ("loss", "loss", "{:.4g}"),
    ("kl", "kl", "{:.3g}"),
    ("grad_norm", "grad norm", "{:.3g}"),
    ("learning_rate", "lr", "{:.2g}"),
    ("mean_token_accuracy", "token accuracy", "{:.3f}"),
    ("completions/mean_length", "tokens/completion", "{:.0f}"),
)
"""The metrics of a Trainer's log shown on its one line, in order (key, label, format); the
rest stay in the evidence CSVs and TensorBoard."""


class CpuThreads(TrainerCallback):
    """torch's compute threads, set before each optimisation step to the cores free while the step
    before ran (`lib.runtime.use_cpu_threads`; measured over that step, so it costs no wait): a
    machine that other work fills as a run goes on costs the run its share, not every step's
    threads waiting on each other. Off on a GPU and where `OMP_NUM_THREADS` fixes the count."""

    def __init__(self) -> None:
        self.last = None

    def on_train_begin(self, args, state, control, **kwargs):
        import torch

        if torch.cuda.is_available():
            return
        keep_freed_memory()  # a step's activations: megabytes allocated and freed at every pass
        attend_grouped_queries()  # a campaign's forward and backward passes without copied keys
        if pinned_threads() is not None:
            return
        use_cpu_threads()
        self.last = cpu_snapshot()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.last is None:
            return
        now = cpu_snapshot()
        use_cpu_threads(busy_cores_elsewhere(self.last, now))
        self.last = now


def metrics_line(logs: Dict[str, Any]) -> str:
    """`reward +0.412 ± 0.310, loss 0.0123, ...`: the `METRICS_LINE` entries a log has."""
    parts = []
    for key, label, form in METRICS_LINE:
        value = logs.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            text = form.format(value)
            parts.append(f"± {text}" if label == "±" else f"{label} {text}")
    return ", ".join(parts).replace(", ± ", " ± ")


class TrainingProgress(TrainerCallback):
    """A bar over a Trainer's optimisation steps, with the time left (`lib.progress.Progress`), and
    at each log one line: `<label> step 3/14: reward +0.412 ± 0.310, loss 0.0123, grad norm 0.81,
    lr 3e-04`. Main process only (a Trainer calls it on every process: the others stay silent)."""

    label = "training"

    def __init__(self, label: Optional[str] = None) -> None:
        self.label = label or type(self).label
        self.progress = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.progress = Progress(self.label, state.max_steps, unit="step", initial=state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        line = metrics_line(logs or {})
        if self.progress is None or not line:
            return
        self.progress.set_postfix(line.split(",")[0])
        self.progress.note(f"{self.label} step {state.global_step}/{state.max_steps}: {line}")
        reason = still_step(logs) if "frac_reward_zero_std" in (logs or {}) else None
        if reason:
            logger.warning(
                "%s step %d/%d: THE REWARD DID NOT MOVE THE POLICY: %s; %s",
                self.label,
                state.global_step,
                state.max_steps,
                reason,
                STILL_STEP_ADVICE,
            )

    def on_train_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.close()
            self.progress = None


@contextlib.contextmanager
def trainer_progress(label: str) -> Iterator[None]:
    """Every transformers Trainer made inside shows `TrainingProgress(label)` where it would add
    its `PrinterCallback` (what `disable_tqdm=True` gives: each log printed as a dict). Trainers
    made elsewhere (the warm start's, in `lib.training.warm_start`) get it without a change there."""
    import transformers.trainer as trainer_module

    original = trainer_module.PrinterCallback
    trainer_module.PrinterCallback = type("TrainingProgress", (TrainingProgress,), {"label": label})
    try:
        yield
    finally:
        trainer_module.PrinterCallback = original
