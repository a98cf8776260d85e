"""SmolLM2-135M-Instruct's imitation learning curve on a CPU: one LoRA warm start on the heuristic
family's campaigns, evaluated after each size of `--sizes`, and the model zero-shot beside it.

    python bench/bench_smollm2_curve.py --sizes 50 100 200 --eval-episodes 120 --out build/smollm2-curve

With `warm_start_lr_schedule` "constant" (`-- --warm_start_lr_schedule constant`, as `make
bench-smollm2-curve` runs it), the warm start is one run over the demonstrations in order, cut into
stages at the sizes: stage k trains the adapter that stage k-1 saved on demonstrations [N(k-1), N(k))
(each campaign once), so its adapter is what one run would hold after N(k) campaigns (less its
optimiser's moments, which each stage starts afresh). With a decaying schedule
(configs/train/smollm2-cpu.yaml's cosine) each size is a whole run of its own on the first N(k)
campaigns, its rate decayed to 0 at its end.
Each stage's adapter (`adapter-N/`) and each evaluation (`eval-N.jsonl.gz`: greedy,
the validation split's first `--eval-episodes` campaigns, the configuration's setting) is written
whole once done, so a run that is killed goes on from the last one written when started again with
the same arguments. `curve.csv` (one row per evaluation: campaigns, correct, success and mean
reward with 95% bootstrap intervals, refused actions per campaign, seconds) and `curve.png` are
written again after each evaluation. `--zero-shot` first evaluates the model as it comes
(`eval-0.jsonl.gz`).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from lib.training.imitation import curve_row, evaluate_stage, train_stage, write_curve

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "train" / "smollm2-cpu.yaml"

logger = logging.getLogger("smollm2-curve")


def load_config(path: Path, overrides: List[str]) -> Any:
    from lib.training.cli import parse_train_config

    config, _ = parse_train_config(["--config", str(path), *overrides])
    return config


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
    from lib.measure.evaluation import validation_suite
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
    suite = validation_suite(args.eval_episodes)
    if args.zero_shot:
        target = args.out / "eval-0.jsonl.gz"
        seconds = 0.0 if target.is_file() else evaluate_stage(config, None, suite, target, "zero-shot")
        rows.append(curve_row(0, target, 0.0, seconds))
        write_curve(args.out, rows)
        logger.info("zero-shot: %d of %d correct", rows[-1]["correct"], rows[-1]["evaluated"])
    tokenizer = load_tokenizer(model_source(config.model_name))
    specs = corpus_specs(args.sizes[-1], DEMONSTRATION_SEED)
    previous: Optional[Path] = None
    done = 0
    stages = config.warm_start_lr_schedule == "constant"  # a decaying schedule: one whole run per size
    for size in args.sizes:
        if not stages:
            previous, done = None, 0
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
            train_seconds = train_stage(
                config, previous, examples, adapter, args.gradient_checkpointing, config.warm_start_lr_schedule
            )
        else:
            train_seconds = json.loads((adapter / "stage.json").read_text())["seconds"]
        target = args.out / f"eval-{size}.jsonl.gz"
        eval_seconds = 0.0
        if not target.is_file():
            eval_seconds = evaluate_stage(config, adapter, suite, target, f"imitation-{size}")
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
