"""`EvidenceCallback`: writes the evidence of a GRPO run while it trains (`lib.evidence`).

- on each log: a training_log.csv row (step, epoch, loss, reward, reward_std, kl,
  grad_norm, learning_rate, wall_time_s), then the training-curve and reward-component
  plots are redrawn from the logs so far;
- every `eval_every_steps`: the policy plays the fixed checkpoint subset of the held-out
  suite greedily; a checkpoint_evals.csv row, and the progression plot redrawn.

`ProgressLog`: a log line on a Trainer's progress (steps done, s/step, time left).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from transformers import TrainerCallback

from lib.comparison import checkpoint_row
from lib.evidence import (
    CheckpointEvalWriter,
    EvidencePaths,
    TrainingLogWriter,
    render_checkpoint_progression,
    render_reward_components,
    render_training_curve,
)
from lib.progress import Progress

logger = logging.getLogger(__name__)

_LOG_KEYS = {
    "loss": "loss",
    "reward": "reward",
    "reward_std": "reward_std",
    "kl": "kl",
    "grad_norm": "grad_norm",
    "learning_rate": "learning_rate",
}


class EvidenceCallback(TrainerCallback):
    """Evidence rows and plots during `GRPOTrainer.train()`.

    `evaluate(model)` plays the checkpoint episodes and returns their records (as dicts);
    it is called every `eval_every_steps` optimisation steps (0: never).
    """

    def __init__(
        self,
        paths: EvidencePaths,
        *,
        eval_every_steps: int,
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
        self.started = time.perf_counter()
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
            render_checkpoint_progression(self.paths.checkpoint_evals_csv, self.paths.checkpoint_progression_png)
        return row


class ProgressLog(TrainerCallback):
    """A `lib.progress.Progress` line for a Trainer's optimisation steps, at most every `every_s`."""

    def __init__(self, label: str, every_s: float = 30.0) -> None:
        self.label, self.every_s = label, every_s
        self.progress: Optional[Progress] = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.progress = Progress(self.label, state.max_steps, unit="step", every_s=self.every_s)
        self.progress.done = state.global_step  # a resumed run starts where it stopped

    def on_step_end(self, args, state, control, **kwargs):
        if self.progress is not None:
            self.progress.update(state.global_step)
