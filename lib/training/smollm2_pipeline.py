"""SmolLM2-135M-Instruct from imitation to GRPO on a CPU, one resumable command:

    python -m lib.training.smollm2_pipeline [--out build/smollm2] [--skip zero-shot held-out] [-- FIELD flags]
    make train-smollm2
    python -m lib.training.smollm2_pipeline --promote   # make promote-smollm2: its evidence into evidence/smollm2/

Its stages, each written whole or not at all under `--out`, so a killed run goes on from the
first stage not written when started again with the same arguments:

1. `imitation`: a LoRA adapter trained once over the heuristic family's first
   `warm_start_episodes` campaigns from `warm_start_learning_rate` on `warm_start_lr_schedule`
   (`lib.training.imitation.train_stage`): `imitation/adapter/`, its losses in `evidence/imitation_stage.json`.
2. `imitation-eval`: the imitation adapter played greedily on the validation campaigns
   (`imitation/validation.jsonl.gz`), made once for every GRPO run from that adapter: a second
   `--out` with a copy of `imitation/` tries another GRPO setting without playing it again.
3. `grpo`: TRL's GRPO from that adapter (`warm_start_adapter`), the configuration's run
   (`lib.training.run.train`), that evaluation as its own before training: the validation
   campaigns after it (`evidence/pre_eval.jsonl.gz`, `post_eval.jsonl.gz`, `before_after_metrics.json`
   with paired 95% intervals), the training log and figures in `evidence/`, the model in
   `grpo/final/`. A run killed during GRPO resumes from its last checkpoint.
   `checkpoint-curve`, within it: the checkpoints every `--curve-every` steps played on the same
   campaigns (`grpo/curve/step-N.jsonl.gz`), between the imitation adapter (step 0) and the final
   policy: `evidence/checkpoint_evals.csv` and `checkpoint_progression.png`, rewritten whole.
4. `zero-shot`: the model as it comes, on the same validation campaigns (`evidence/zero_shot_eval.jsonl.gz`).
5. `held-out`: the imitation adapter and the GRPO policy on the held-out suite
   (`evidence/heldout_imitation.jsonl.gz`, `heldout_grpo.jsonl.gz`, `heldout_before_after.json`), and
   with `--heldout-best` the checkpoint the curve found best on the validation campaigns when it lies
   between its ends (`best_checkpoint`: `heldout_grpo_best.jsonl.gz`): chosen on one split, measured
   on the other, a third play of the suite.
6. `summary`: `evidence/smollm2_summary.json` and `.md`: each stage's measures and seconds.

The two training stages (imitation, GRPO) run in a process of their own each (`in_own_process`), and
the evaluations in processes of their own too (`evaluate_stage`): the pipeline's own process never
holds a model, so what a stage allocated is the system's again when it ends, before the next starts.
Progress is logged as it goes (the GRPO steps, the evaluations' campaigns) on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypeVar

from lib.files import atomic_write, json_text

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "configs" / "train" / "smollm2-cpu.yaml"
STAGES = ("imitation", "imitation-eval", "grpo", "checkpoint-curve", "zero-shot", "held-out", "summary")
"""The pipeline's stages, in the order they run."""
OPTIONAL_STAGES = ("checkpoint-curve", "zero-shot", "held-out")
"""The stages `--skip` may leave out."""
EVIDENCE_DIR = ROOT / "evidence" / "smollm2"
"""Where `promote` copies a finished run's evidence (git-tracked)."""
KEPT_ON_PROMOTION = ("README.md",)
"""The files of `EVIDENCE_DIR` written by hand, which a promotion leaves alone."""

logger = logging.getLogger("smollm2")
T = TypeVar("T")


def load_config(path: Path, overrides: List[str]) -> Any:
    """The `TrainConfig` of `path` with `--FIELD value` overrides."""
    from lib.training.cli import parse_train_config

    config, _ = parse_train_config(["--config", str(path), *overrides])
    return config


def imitation_stage(config: Any, out: Path) -> Dict[str, Any]:
    """The LoRA adapter trained on the first `warm_start_episodes` demonstrations (stage.json holds
    its count, seconds and losses, copied to `evidence/imitation_stage.json`)."""
    from lib.seeds import DEMONSTRATION_SEED
    from lib.training.backends import model_source
    from lib.training.imitation import train_stage
    from lib.training.tokenizer import corpus_specs, load_tokenizer
    from lib.training.warm_start import demonstration_examples, demonstration_layout

    adapter = out / "imitation" / "adapter"
    if not (adapter / "stage.json").is_file():
        campaigns = config.warm_start_episodes
        tokenizer = load_tokenizer(model_source(config.model_name))
        examples = demonstration_examples(
            tokenizer, campaigns, specs=corpus_specs(campaigns, DEMONSTRATION_SEED), **demonstration_layout(config)
        )
        logger.info(
            "imitation: %d demonstrations, %d tokens", len(examples), sum(len(e["input_ids"]) for e in examples)
        )
        adapter.parent.mkdir(parents=True, exist_ok=True)
        train_stage(config, None, examples, adapter, checkpointing=False, lr_schedule=config.warm_start_lr_schedule)
    record = (adapter / "stage.json").read_bytes()
    atomic_write(out / "evidence" / "imitation_stage.json", record)  # its losses, beside the evidence they made
    stage = json.loads(record)
    return {"campaigns": stage["examples"], "seconds": round(stage["seconds"]), "adapter": str(adapter)}


def configure_logging() -> None:
    """The pipeline's log lines on stderr (its own, `lib`'s progress and stage lines), in each of its processes."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("lib").setLevel(logging.INFO)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def in_own_process(stage: Callable[..., T], *args: Any) -> T:
    """`stage(*args)` run in a spawned process of its own, its result handed back (pickled) and its
    exception raised here: whatever the stage allocated (a model, an optimiser, glibc's kept heap)
    is the system's again when it returns. The process ends itself if this one is killed
    (`exit_with_parent`)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_stage, os.getpid(), stage, args).result()


def _run_stage(parent: int, stage: Callable[..., T], args: tuple) -> T:
    """`in_own_process`'s side in the stage's process."""
    from lib.training.imitation import exit_with_parent

    exit_with_parent(parent)
    configure_logging()
    return stage(*args)


def grpo_config(config: Any, out: Path) -> Any:
    """The configuration GRPO runs: the imitation adapter as its warm start, the folders under `out`,
    resumed from the last checkpoint of a run that did not finish."""
    from lib.training.config import TrainConfig

    output_dir = out / "grpo"
    checkpoints = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[-1]))
    fields = {
        **config.to_dict(),
        "warm_start_adapter": str(out / "imitation" / "adapter"),
        "warm_start_episodes": 0,
        "evidence_dir": str(out / "evidence"),
        "output_dir": str(output_dir),
        "resume_from_checkpoint": str(checkpoints[-1]) if checkpoints else None,
    }
    return TrainConfig(**fields)


def grpo_stage(config: Any, out: Path, pre_eval: Path) -> Dict[str, Any]:
    """GRPO from the imitation adapter (`lib.training.run.train`), with `pre_eval` (the adapter's
    validation evaluation) as its evaluation before training; `grpo/train_result.json`."""
    result_file = out / "grpo" / "train_result.json"
    if not result_file.is_file():
        from dataclasses import asdict

        from lib.episodes.records import load_episodes_jsonl
        from lib.training import train

        run = grpo_config(config, out)
        if run.resume_from_checkpoint:
            logger.info("grpo: resuming from %s", run.resume_from_checkpoint)
        result = train(run, pre_eval=load_episodes_jsonl(str(pre_eval)))
        atomic_write(result_file, json_text(asdict(result)))
    return json.loads(result_file.read_text())


def checkpoint_curve_stage(
    config: Any, out: Path, every: int, validation: List[Any], first: Path, last: Path
) -> Optional[float]:
    """GRPO's saved checkpoints every `every` steps, each played greedily on the `validation` campaigns
    (`grpo/curve/step-N.jsonl.gz`, kept once written), and the curve they make with `first` (the
    imitation adapter's episodes: step 0) and `last` (the final policy's: the last step), in
    `evidence/checkpoint_evals.csv` and `checkpoint_progression.png`, both rewritten whole. Returns the
    seconds its evaluations took (None: all were written before their seconds were kept)."""
    from lib.episodes.records import load_episodes_jsonl
    from lib.measure.comparison import checkpoint_row
    from lib.report.evidence_figures import render_checkpoint_progression
    from lib.report.evidence_logs import CheckpointEvalWriter

    if every < 1:
        raise ValueError(f"--curve-every is a number of GRPO steps, at least 1 (got {every})")
    grpo, steps = out / "grpo", config.max_steps
    played, seconds = {0: first, steps: last}, []
    for step in range(every, steps, every):
        checkpoint = grpo / f"checkpoint-{step}"
        target = grpo / "curve" / f"step-{step}.jsonl.gz"
        if not target.is_file() and not (checkpoint / "adapter_config.json").is_file():
            raise FileNotFoundError(
                f"{checkpoint} holds no adapter: the curve reads the checkpoints GRPO saved (save_steps 1 keeps "
                "each step's); run with --skip checkpoint-curve, or --curve-every a multiple of save_steps"
            )
        target.parent.mkdir(parents=True, exist_ok=True)
        seconds.append(evaluate_once(config, checkpoint, validation, target, f"checkpoint {step}"))
        played[step] = target
    evidence = out / "evidence"
    staging = evidence / "checkpoint_evals.partial.csv"
    staging.unlink(missing_ok=True)
    writer = CheckpointEvalWriter(staging)
    for step, path in sorted(played.items()):
        writer.append(**checkpoint_row(step, load_episodes_jsonl(str(path)), fraction_done=step / steps))
    os.replace(staging, evidence / "checkpoint_evals.csv")
    render_checkpoint_progression(
        evidence / "checkpoint_evals.csv", evidence / "checkpoint_progression.png", "validation"
    )
    known = [s for s in seconds if s is not None]
    return sum(known) if known or not seconds else None


def best_checkpoint(curve: Path, last_step: int) -> Optional[int]:
    """The step of the highest validation success in a checkpoint curve's rows (`curve`, its
    checkpoint_evals.csv; the earliest of a tie) when it is a checkpoint between the curve's ends,
    else None: the imitation adapter (step 0) or the final policy (`last_step`) is played anyway."""
    from lib.report.evidence_logs import read_records

    rows = [r for r in read_records(curve).rows if r.get("success_rate") not in ("", None)] if curve.is_file() else []
    if not rows:
        return None
    step = int(max(rows, key=lambda r: (float(r["success_rate"]), -int(r["step"])))["step"])
    return step if 0 < step < last_step else None


def evaluate_once(config: Any, adapter: Optional[Path], specs: List[Any], target: Path, name: str) -> Optional[float]:
    """Play `specs` greedily with the base model and `adapter` (none: as it comes) into `target`,
    unless it is written already (`lib.training.imitation.evaluate_stage`). Returns the seconds it
    took, kept beside `target` (`seconds_file`) for a run that finds it written later (None: an
    evaluation written before its seconds were kept)."""
    from lib.training.imitation import evaluate_stage

    record = seconds_file(target)
    if not target.is_file():
        seconds = evaluate_stage(config, adapter, specs, target, name)
        atomic_write(record, json_text({"seconds": seconds}))
        return seconds
    return float(json.loads(record.read_text())["seconds"]) if record.is_file() else None


def seconds_file(target: Path) -> Path:
    """Where an evaluation's seconds are kept: `NAME.seconds.json` beside its episodes `NAME.jsonl.gz`."""
    return target.with_name(target.name.removesuffix(".jsonl.gz") + ".seconds.json")


def summary_of(path: Path) -> Dict[str, Any]:
    """An evaluation's measures (`lib.training.imitation.evaluation_measures`), unrounded: the report
    rounds each once."""
    from lib.training.imitation import evaluation_measures

    return evaluation_measures(path)


def summary_markdown(summary: Dict[str, Any]) -> str:
    """The summary as a short Markdown report: one row per policy and split."""
    lines = [
        "# SmolLM2-135M-Instruct on a CPU: zero-shot, imitation, GRPO",
        "",
        "| policy | split | campaigns | correct | success [95% CI] | mean reward [95% CI] | refused a campaign |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, entry in summary["evaluations"].items():
        lines.append(
            f"| {entry['policy']} | {entry['split']} | {entry['evaluated']} | {entry['correct']} | "
            f"{entry['success']:.3f} [{entry['success_low']:.3f}, {entry['success_high']:.3f}] | "
            f"{entry['mean_reward']:+.2f} [{entry['reward_low']:+.2f}, {entry['reward_high']:+.2f}] | "
            f"{entry['refused_per_campaign']:.2f} |"
        )
    best = summary.get("best_checkpoint_step")
    for policy, label, key in (
        ("GRPO", "validation", "validation_grpo_minus_imitation"),
        ("GRPO", "held-out", "heldout_grpo_minus_imitation"),
        (f"GRPO step {best} (the validation curve's best)", "held-out", "heldout_best_minus_imitation"),
    ):
        diff = summary.get(key)
        if diff:
            lines.append("")
            lines.append(
                f"{policy} − imitation on the {label} campaigns (paired by task, 95% bootstrap): success "
                f"{_signed(diff.get('success_rate'))}, reward {_signed(diff.get('mean_reward'))}."
            )
    seconds = ", ".join(
        f"{k} {'not recorded' if v is None else format(v, '.0f')}" for k, v in summary["seconds"].items()
    )
    lines += ["", "Seconds: " + seconds, ""]
    return "\n".join(lines)


def difference(comparison: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Post − pre of a `before_after_metrics` payload for success and reward, with its paired 95% interval."""
    return {
        key: {"delta": comparison["delta"][key], "ci95": comparison["delta_ci95"].get(key)}
        for key in ("success_rate", "mean_reward")
    }


def _signed(diff: Optional[Dict[str, Any]]) -> str:
    if not diff or diff.get("delta") is None:
        return "n/a"
    low, high = diff.get("ci95") or (None, None)
    interval = f" [{low:+.3f}, {high:+.3f}]" if low is not None else ""
    return f"{diff['delta']:+.3f}{interval}"


def promote(out: Path, target: Path = EVIDENCE_DIR) -> List[str]:
    """Copy a finished run's evidence (`out/evidence/`, its summary written) into `target`, each file
    whole; the files of `target` the run did not make are removed (git has them), but for
    `KEPT_ON_PROMOTION`; an evaluation's seconds file is not copied (the summary holds its seconds).
    Refused, with nothing copied, when the summary is missing. Returns the names copied."""
    from lib.files import atomic_write

    source = Path(out) / "evidence"
    if not (source / "smollm2_summary.json").is_file():
        raise FileNotFoundError(
            f"{source}/smollm2_summary.json is missing: the run has not finished (make train-smollm2 goes on "
            "from where it stopped); nothing was promoted"
        )
    files = sorted(
        p
        for p in source.iterdir()
        if p.is_file()
        and not p.name.startswith(".")
        and ".partial" not in p.name
        and not p.name.endswith(".seconds.json")
    )
    target.mkdir(parents=True, exist_ok=True)
    for path in files:
        atomic_write(target / path.name, path.read_bytes())
    written = [path.name for path in files]
    for stale in target.iterdir():
        if stale.is_file() and stale.name not in written and stale.name not in KEPT_ON_PROMOTION:
            stale.unlink()
    return written


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the training configuration")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "smollm2", help="where it all goes")
    parser.add_argument("--skip", nargs="*", default=[], choices=OPTIONAL_STAGES, help="stages to leave out")
    parser.add_argument(
        "--curve-every",
        type=int,
        default=2,
        help="GRPO steps between the checkpoints the curve plays on the validation campaigns (default: 2)",
    )
    parser.add_argument(
        "--heldout-episodes",
        type=int,
        default=None,
        help="held-out campaigns each policy plays (default: the whole suite; fewer for a quick look only)",
    )
    parser.add_argument(
        "--heldout-best",
        action="store_true",
        help="also play the curve's best checkpoint between its ends on the held-out suite (a third play of it)",
    )
    parser.add_argument(
        "--promote",
        action="store_true",
        help=f"copy the finished run's evidence into {EVIDENCE_DIR.relative_to(ROOT)}/",
    )
    parser.add_argument("overrides", nargs="*", help="TrainConfig fields after --, e.g. -- --max_steps 4")
    args = parser.parse_args(argv)
    if args.curve_every < 1:
        parser.error(f"--curve-every is a number of GRPO steps, at least 1 (got {args.curve_every})")
    if args.heldout_best and {"checkpoint-curve", "held-out"} & set(args.skip):
        parser.error("--heldout-best plays the checkpoint curve's best on the held-out suite: skip neither of them")
    if args.promote:
        try:
            written = promote(args.out)
        except FileNotFoundError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(f"promoted {len(written)} files to {EVIDENCE_DIR}: review with `git diff --stat evidence/smollm2`")
        return 0
    configure_logging()
    from lib.episodes.records import load_episodes_jsonl
    from lib.measure.comparison import before_after_metrics
    from lib.measure.evaluation import heldout_suite
    from lib.training.grpo import evaluation_suite

    config = load_config(args.config, args.overrides)
    if config.warm_start_adapter is not None or not config.warm_start_episodes:
        parser.error("the pipeline makes its own imitation adapter: warm_start_episodes > 0, no warm_start_adapter")
    args.out.mkdir(parents=True, exist_ok=True)
    evidence = args.out / "evidence"
    seconds: Dict[str, Optional[float]] = {}

    logger.info("stage 1 of 6: imitation on %d campaigns", config.warm_start_episodes)
    imitation = in_own_process(imitation_stage, config, args.out)
    seconds["imitation"] = imitation["seconds"]
    imitation_eval, validation = args.out / "imitation" / "validation.jsonl.gz", evaluation_suite(config)
    logger.info("stage 2 of 6: the imitation adapter on %d validation campaigns", len(validation))
    seconds["imitation_eval"] = evaluate_once(
        config, Path(imitation["adapter"]), validation, imitation_eval, "imitation"
    )
    logger.info("stage 3 of 6: GRPO, %d steps, from the imitation adapter", config.max_steps)
    grpo = in_own_process(grpo_stage, config, args.out, imitation_eval)
    seconds.update({f"grpo_{k}": v for k, v in grpo["seconds"].items() if k != "total"})
    if "checkpoint-curve" not in args.skip:
        logger.info(
            "GRPO's checkpoints every %d steps on the same %d validation campaigns", args.curve_every, len(validation)
        )
        seconds["checkpoint_curve"] = checkpoint_curve_stage(
            config, args.out, args.curve_every, validation, imitation_eval, evidence / "post_eval.jsonl.gz"
        )
    evaluations = {
        "imitation_validation": ("imitation", "validation", evidence / "pre_eval.jsonl.gz"),
        "grpo_validation": ("GRPO", "validation", evidence / "post_eval.jsonl.gz"),
    }
    if "zero-shot" not in args.skip:
        logger.info("stage 4 of 6: zero-shot on the same %d validation campaigns", len(validation))
        target = evidence / "zero_shot_eval.jsonl.gz"
        seconds["zero_shot_eval"] = evaluate_once(config, None, validation, target, "zero-shot")
        evaluations["zero_shot_validation"] = ("zero-shot", "validation", target)
    heldout_diff = best = best_diff = None
    curve = evidence / "checkpoint_evals.csv"
    if "held-out" not in args.skip:
        suite = list(heldout_suite())[: args.heldout_episodes]
        logger.info("stage 5 of 6: imitation and GRPO on the %d held-out campaigns", len(suite))
        imitation_target = evidence / "heldout_imitation.jsonl.gz"
        grpo_target = evidence / "heldout_grpo.jsonl.gz"
        heldout_config = dataclasses.replace(config, eval_split="heldout")  # its progress lines say held-out
        seconds["heldout_imitation_eval"] = evaluate_once(
            heldout_config, Path(imitation["adapter"]), suite, imitation_target, "imitation"
        )
        seconds["heldout_grpo_eval"] = evaluate_once(
            heldout_config, Path(grpo["final_model_dir"]), suite, grpo_target, "grpo"
        )
        evaluations["imitation_heldout"] = ("imitation", "held-out", imitation_target)
        evaluations["grpo_heldout"] = ("GRPO", "held-out", grpo_target)
        imitation_played = load_episodes_jsonl(str(imitation_target))
        heldout = before_after_metrics(imitation_played, load_episodes_jsonl(str(grpo_target)))
        atomic_write(evidence / "heldout_before_after.json", json_text(heldout))
        heldout_diff = difference(heldout)
        best = best_checkpoint(curve, config.max_steps) if args.heldout_best else None
        if best is not None:  # chosen on the validation campaigns, measured on the held-out ones
            best_target = evidence / "heldout_grpo_best.jsonl.gz"
            seconds["heldout_grpo_best_eval"] = evaluate_once(
                heldout_config, args.out / "grpo" / f"checkpoint-{best}", suite, best_target, f"grpo step {best}"
            )
            evaluations["grpo_best_heldout"] = (f"GRPO step {best}, the curve's best", "held-out", best_target)
            best_diff = difference(before_after_metrics(imitation_played, load_episodes_jsonl(str(best_target))))
    logger.info("stage 6 of 6: summary")
    validation = grpo["before_after"]
    summary = {
        "model": config.model_name,
        "imitation_campaigns": imitation["campaigns"],
        "grpo_steps": config.max_steps,
        "episodes_per_step": config.episodes_per_step,
        "evaluations": {
            name: {"policy": policy, "split": split, **summary_of(path)}
            for name, (policy, split, path) in evaluations.items()
        },
        "validation_grpo_minus_imitation": difference(validation),
        "heldout_grpo_minus_imitation": heldout_diff,
        "best_checkpoint_step": best,
        "heldout_best_minus_imitation": best_diff,
        "seconds": {k: None if v is None else round(v) for k, v in seconds.items()},
    }
    atomic_write(evidence / "smollm2_summary.json", json_text(summary))
    atomic_write(evidence / "smollm2_summary.md", summary_markdown(summary))
    print(summary_markdown(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
