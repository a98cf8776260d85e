"""`python -m lib.training [--config FILE.yaml] [--FIELD VALUE ...]`: one GRPO run.

With no arguments it runs the default CPU training (`TrainConfig()`). Every `TrainConfig`
field is a typed flag (`--max_steps 10`, `--help` lists them with their meaning); a config
file (YAML or JSON) holds field names, and flags override it (`lib.training.cli`):
configs/train/smoke.yaml is a whole run in minutes on 2 cores, default.yaml the default run,
colab.yaml a real model on one GPU. The result (timings, before/after metrics) is written to
`<output_dir>/train_result.json`; the command prints a summary of it (`run_summary`).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import asdict
from pathlib import Path

from lib.extras import require
from lib.files import DiskFullError, FolderLockedError, atomic_write, json_text
from lib.progress import headless
from lib.training.cli import parse_train_config, train_config_parser

QUIET_LIBRARIES = {
    "TRL_EXPERIMENTAL_SILENCE": "1",  # TRL's notice that rollout_func is experimental, at every run
}
"""Set for a command-line run (unless already set): libraries' notices to developers, not users."""


STOPS = (DiskFullError, FolderLockedError, NotADirectoryError, PermissionError, FileNotFoundError, ModuleNotFoundError)
"""What stops a run before or during its work with a message written to be read as it is (a full
disk, a folder another run holds, an output folder that cannot be written, a checkpoint to resume
that is not there, TensorBoard missing): one line, no traceback."""


def main(argv=None) -> int:
    for name, value in QUIET_LIBRARIES.items():
        os.environ.setdefault(name, value)
    if headless():  # transformers' and the Hub's own bars (loading weights, writing shards) in a log file
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)  # libraries' deprecations, for their developers
    parser = train_config_parser(description=__doc__, argv=argv)
    if not {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
        try:
            require("train", "training")
        except ModuleNotFoundError as error:
            parser.exit(1, f"{parser.prog}: error: {error}\n")
    config, _ = parse_train_config(argv, parser, check_model_source=True)  # a model it cannot have: refused now
    # the project's own messages (progress, evidence) at INFO; the libraries' warnings only (their INFO,
    # matplotlib's font substitutions among them, is noise here)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("lib").setLevel(logging.INFO)
    from lib.training import train

    try:
        result = train(config)
    except STOPS as error:  # said in a line of its own; CERNENV_TRACEBACK=1 shows where
        if os.environ.get("CERNENV_TRACEBACK"):
            raise
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    from lib.training.processes import is_main_process

    if is_main_process():  # under `accelerate launch`, one process reports
        payload = json_text(asdict(result))
        result_path = Path(config.output_dir) / "train_result.json"
        atomic_write(result_path, payload + "\n")
        print(run_summary(result, config, result_path))
    return 0


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min {seconds % 60:.0f} s" if seconds >= 60 else f"{seconds:.0f} s"


def run_summary(result, config, result_path: Path) -> str:
    """The end of a run in a few lines: how long its parts took, the result before and after GRPO on
    the split it was evaluated on (held-out or validation; paired difference with its 95% interval),
    and where the policy, the evidence, the TensorBoard log and the whole result went."""
    from lib.training.policy_evaluation import split_name

    seconds = result.seconds
    parts = ", ".join(
        f"{name.replace('_', ' ')} {_minutes(seconds[name])}"
        for name in ("warm_start", "pre_eval", "grpo", "checkpoint_evals", "post_eval")
        if seconds.get(name)
    )
    lines = [f"done in {_minutes(seconds.get('total', 0.0))} ({parts})"]
    split = split_name(config)
    metrics = result.before_after or {}
    pre, post, interval = metrics.get("pre") or {}, metrics.get("post") or {}, metrics.get("delta_ci95") or {}
    if pre and post:
        for name, label in (("success_rate", "success"), ("mean_reward", "mean reward")):
            low, high = (interval.get(name) or [None, None])[:2]
            ci = f", difference [{low:+.3f}, {high:+.3f}]" if low is not None and high is not None else ""
            before, after = pre.get(name, float("nan")), post.get(name, float("nan"))
            lines.append(
                f"{split} {label}: {before:.3f} before GRPO -> {after:.3f} after ({post.get('n', '?')} episodes{ci})"
            )
    lines.append(f"policy: {result.final_model_dir}")
    evidence = next((path for path in (result.evidence or {}).values() if path), None)
    lines.append(f"evidence: {Path(evidence).parent if evidence else config.evidence_dir} (notebook 04 reads it)")
    if "tensorboard" in config.report_to:
        lines.append(f"TensorBoard: tensorboard --logdir {Path(config.output_dir) / 'runs'}")
    lines.append(f"everything measured: {result_path}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
