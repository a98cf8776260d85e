"""SmolLM2-135M-Instruct's training and decoding speed on this CPU, setting against setting.

    python bench/bench_smollm2_speed.py [--campaigns 8] [--out build/smollm2-speed]
    make bench-smollm2-speed

Each setting trains a fresh LoRA adapter (r and alpha from configs/train/smollm2-cpu.yaml) with
TRL's SFTTrainer, as the warm start does (`lib.training.warm_start.sft_trainer`: the loss on the
actions, one brief campaign a step, a constant learning rate), on the same `--campaigns`
demonstrations of the heuristic family, and reports the trained tokens a second (the trainer's
own runtime, so loading is left out) and the mean loss of its steps: settings that compute the
same thing agree on the loss, so a faster one that changes it shows. A GRPO step's optimisation
pass is the same forward and backward over a campaign's tokens, so these figures are its speed
too; its other part, sampling the campaigns, is measured as decoding: one turn of 12 campaigns
(`--decode-batch`) mid-way (`--decode-turn`) by the engine that plays on a CPU
(`lib.episodes.generation.CachedGenerator`), in fp32 with glibc's malloc as it starts, in fp32 with
`lib.runtime.keep_freed_memory` (what every run does), and in bf16 autocast; each in a process of
its own, with the CPU seconds spent in user space and in the kernel.

The settings:
- precision: fp32 and bf16 autocast (the table names the CPU's bf16 instructions: AMX or AVX-512-BF16,
  or none, where bf16 is converted to and from fp32 and is no faster);
- LoRA on every linear layer of all 30 blocks, against the last 10 blocks only;
- gradient checkpointing on and off.

`results.json` and a table on stdout. Run it on an idle machine: every setting shares the cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "train" / "smollm2-cpu.yaml"
LAST_BLOCKS = 10
"""The "fewer layers" setting: LoRA on the last this many transformer blocks only."""


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def native_bf16() -> List[str]:
    """The CPU's bf16 instructions named in /proc/cpuinfo (AMX, AVX-512-BF16); none: torch's bf16 runs
    on wider fp32 arithmetic and conversions."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return sorted(flag for flag in flags if flag in ("amx_bf16", "avx512_bf16"))


def lora_config(config: Any, layers: Optional[List[int]]) -> Any:
    from peft import LoraConfig

    from lib.training.backends import _lora_targets

    return LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=0.0,
        target_modules=_lora_targets(),
        layers_to_transform=layers,
        task_type="CAUSAL_LM",
    )


def train_setting(
    config: Any, examples: List[Dict[str, List[int]]], *, bf16: bool, layers: Optional[List[int]], checkpointing: bool
) -> Dict[str, Any]:
    """One setting's trained tokens a second and mean step loss."""
    import torch

    from lib.training.backends import load_policy
    from lib.training.warm_start import sft_trainer

    torch.manual_seed(config.seed)
    policy = load_policy(config, "trl")
    policy.peft_config = lora_config(config, layers)
    with tempfile.TemporaryDirectory(prefix="smollm2-speed-") as work:
        trainer = sft_trainer(
            policy,
            config,
            examples,
            work,
            epochs=1.0,
            lr_scheduler_type="constant",
            gradient_checkpointing=checkpointing,
            bf16=bf16,
        )
        trainer.args.logging_steps = 1
        output = trainer.train()
    tokens = sum(len(e["input_ids"]) for e in examples)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    seconds = output.metrics["train_runtime"]
    return {
        "seconds": round(seconds, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "mean_loss": round(sum(losses) / len(losses), 4) if losses else None,
    }


def decode_setting(
    config: Any, examples: List[Dict[str, List[int]]], *, bf16: bool, turn: int, allocator: str
) -> Dict[str, Any]:
    """One turn of decoding by the engine that plays on a CPU (`CachedGenerator`), for a batch of
    campaigns: each context is a demonstration's campaign up to its `turn`-th decision; the engine
    decodes a reply (untimed: it prefills the context), then, timed, the next reply after its own and
    the campaign's next observation, as a turn of play does. `allocator` "default" leaves glibc's
    malloc as it starts (`lib.runtime.keep_freed_memory` not called). Generated tokens a second, and
    the CPU seconds in user space and in the kernel."""
    import contextlib
    import resource

    import torch

    import lib.runtime
    from lib.agents.prompting import Sampling
    from lib.episodes.generation import CachedGenerator
    from lib.training.backends import load_policy

    if allocator == "default":
        lib.runtime._allocator_tuned = False  # as if glibc had refused the settings
    policy = load_policy(config, "trl")
    generate = CachedGenerator(policy.model.eval(), policy.tokenizer)
    contexts, observations = [], []
    for example in examples:
        mask = example["completion_mask"]
        starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
        ends = [i for i in range(1, len(mask)) if not mask[i] and mask[i - 1]]
        k = min(turn, len(starts) - 2)
        contexts.append(example["input_ids"][: starts[k]])
        observations.append(example["input_ids"][ends[k] : starts[k + 1]])
    sampling = Sampling(temperature=0.0, max_new_tokens=config.max_new_tokens, constrained=False)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with autocast:
        first = generate(contexts, sampling)
        following = [c + reply + o for c, (reply, _), o in zip(contexts, first, observations)]
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        replies = generate(following, sampling)
        seconds = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_SELF)
    tokens = sum(len(reply) for reply, _ in replies)
    return {
        "seconds": round(seconds, 2),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "user_cpu_s": round(after.ru_utime - before.ru_utime, 1),
        "kernel_cpu_s": round(after.ru_stime - before.ru_stime, 1),
    }


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the training configuration")
    parser.add_argument("--campaigns", type=int, default=8, help="demonstration campaigns each setting trains on")
    parser.add_argument("--decode-batch", type=int, default=12, help="campaigns decoded together (the evaluations')")
    parser.add_argument("--decode-turn", type=int, default=8, help="the decision of each campaign decoding starts at")
    parser.add_argument(
        "--decode-only", nargs=2, metavar=("PRECISION", "ALLOCATOR"), help=argparse.SUPPRESS
    )  # one decoding row, in a process of its own (the allocator's settings are the process's)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "smollm2-speed", help="results.json goes here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch

    from lib.seeds import DEMONSTRATION_SEED
    from lib.training.backends import model_source
    from lib.training.cli import parse_train_config
    from lib.training.tokenizer import corpus_specs, load_tokenizer
    from lib.training.warm_start import demonstration_examples, demonstration_layout

    config, _ = parse_train_config(["--config", str(args.config)])
    tokenizer = load_tokenizer(model_source(config.model_name))
    campaigns = max(args.campaigns, args.decode_batch) if args.decode_only else args.campaigns
    examples = demonstration_examples(
        tokenizer, campaigns, specs=corpus_specs(campaigns, DEMONSTRATION_SEED), **demonstration_layout(config)
    )
    if args.decode_only:
        precision, allocator = args.decode_only
        row = decode_setting(
            config, examples[: args.decode_batch], bf16=precision == "bf16", turn=args.decode_turn, allocator=allocator
        )
        print(json.dumps(row), flush=True)
        return 0
    precisions = [False, True]
    blocks = 30
    fewer = list(range(blocks - LAST_BLOCKS, blocks))
    rows: List[Dict[str, Any]] = []
    bf16_instructions = native_bf16()
    print(
        f"{cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, "
        f"bf16 instructions: {', '.join(bf16_instructions) or 'none'}"
    )
    print(f"{'what':<9}{'precision':<10}{'LoRA on':<15}{'checkpointing':<15}{'tokens/s':>10}{'mean loss':>11}")
    for bf16 in precisions:
        for layers in (None, fewer):
            for checkpointing in (False, True):
                row = {
                    "what": "train",
                    "precision": "bf16" if bf16 else "fp32",
                    "lora": "all 30 blocks" if layers is None else f"last {LAST_BLOCKS}",
                    "checkpointing": checkpointing,
                    **train_setting(config, examples, bf16=bf16, layers=layers, checkpointing=checkpointing),
                }
                rows.append(row)
                print(
                    f"{'train':<9}{row['precision']:<10}{row['lora']:<15}{str(checkpointing):<15}"
                    f"{row['tokens_per_s']:>10.1f}{row['mean_loss']:>11.4f}",
                    flush=True,
                )
    for precision, allocator in (("fp32", "default"), ("fp32", "tuned"), ("bf16", "tuned")):
        command = [sys.executable, __file__, "--config", str(args.config), "--campaigns", str(args.campaigns)]
        command += ["--decode-only", precision, allocator, "--decode-batch", str(args.decode_batch)]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        row = {"what": "decode", "precision": precision, "allocator": allocator, "batch": args.decode_batch}
        row.update(json.loads(result.stdout.strip().splitlines()[-1]))
        rows.append(row)
        print(
            f"{'decode':<9}{precision:<10}{'batch ' + str(args.decode_batch):<15}{allocator + ' malloc':<15}"
            f"{row['tokens_per_s']:>10.1f}   user {row['user_cpu_s']} s, kernel {row['kernel_cpu_s']} s",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "bf16_instructions": bf16_instructions,
        "load_average": os.getloadavg()[0],
        "campaigns": args.campaigns,
        "rows": rows,
    }
    (args.out / "results.json").write_text(json.dumps(payload, indent=1) + "\n")
    print(f"results: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
