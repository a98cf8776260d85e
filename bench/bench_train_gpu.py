"""Unsloth vs TRL + PEFT on one GPU: the same GRPO steps on a model of Qwen2.5-1.5B's shape.

    python bench/bench_train_gpu.py                       # both backends, 3 measured steps each
    python bench/bench_train_gpu.py --backends trl --steps 5 --out results.json
    python bench/bench_train_gpu.py --shape tiny --allow-cpu --backends trl   # the plumbing, on a CPU
    python bench/bench_train_gpu.py --parts generation four-bit colab-step backends --budget 480 --out r.json

No pretrained weights reach the GPU machine this project is measured on, so the model is
Qwen2.5-1.5B-Instruct's architecture (28 layers, hidden size 1536, 12 query and 2 key/value
heads, MLP 8960, tied embeddings) with random weights and the project's tokenizer (so a
smaller vocabulary than Qwen's 151,936), saved once with `save_pretrained` and loaded by
both backends from that folder. A random model never writes its eos: every turn generates
`max_new_tokens` tokens, so each step generates exactly episodes × turns × max_new_tokens
tokens (16 × 5 × 64 = 5,120 by default). The policy reads what it reads on Colab
(configs/train/colab.yaml): the system prompt and the whole campaign as one conversation.

Each backend runs `bench/bench_train.py` in its own process (once `unsloth` is imported,
TRL's trainer is Unsloth's for the whole process), on the same training tasks and seeds:
seconds per step, generated tokens/s, the share of the step spent generating, and the
peak GPU memory torch allocated, and (`--profile-dir`) one more step per backend under torch's
profiler. A backend that fails or outlasts `--backend-timeout` is reported as such and the next
one still runs. Targets (one H100): a 16-episode step <= 15 s, generation >= 5,000 tokens/s,
Unsloth's peak memory <= 0.6 x TRL's. Exit 1 if one is missed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from lib.gpu_set import installed_torch_stack

ROOT = Path(__file__).resolve().parents[1]

QWEN25_15B_SHAPE = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
"""Qwen2.5-1.5B-Instruct's config.json, less its vocabulary (the project tokenizer's is used)."""
TINY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
"""A shape that runs on a CPU in seconds, to check the script itself."""
SHAPES = {"qwen2.5-1.5b": QWEN25_15B_SHAPE, "tiny": TINY_SHAPE}

STEP_SECONDS_TARGET = 15.0
GENERATION_TOKENS_PER_S_TARGET = 5000.0
UNSLOTH_MEMORY_RATIO_TARGET = 0.6
EPISODE_FLAGS = ["--max_turns", "5", "--max_new_tokens", "64", "--temperature", "1.0", "--lora_r", "16"]
EPISODE_FLAGS += ["--warm_start_episodes", "0"]
"""The bench's episodes, for its GRPO steps and its generation table alike: 5 turns of 64 tokens at
temperature 1, LoRA r 16, no SFT warm start (the model is random-weight)."""
DEFAULT_FLAGS = [
    "--num_generations",
    "8",
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "4",
    *EPISODE_FLAGS,
    "--policy_context",
    "conversation",
    "--system_prompt",
    "true",
    "--beta",
    "0.0",
]
"""16 episodes per step in groups of 8, 5 turns of 64 tokens, read as Colab's run reads them (one
conversation with the system prompt, no KL reference); GRPO steps alone, no SFT warm start (the
model is random-weight: what is measured is a step's time and memory, not what it learns)."""
VERSIONED = ("torch", "transformers", "trl", "peft", "accelerate", "unsloth", "unsloth_zoo", "bitsandbytes")
"""The packages whose versions a result records (read from their metadata, those installed: importing
unsloth would make every later TRL trainer in the process Unsloth's)."""


def model_config(tokenizer, shape: dict):
    """A Qwen2 config of `shape` over `tokenizer`'s vocabulary."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        **shape,
    )


def build_model(folder: Path, shape: dict) -> int:
    """Save a random-weight model of `shape` with the project tokenizer to `folder` (bfloat16 where
    the GPU has it, as a checkpoint from the Hub is); its parameter count."""
    import torch
    from transformers import Qwen2ForCausalLM

    from lib.training.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(model_config(tokenizer, shape))
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def run_backend(
    backend: str,
    model_dir: Path,
    steps: int,
    flags: list,
    timeout_s: float = None,
    profile: Path = None,
    base_flags: Sequence[str] = tuple(DEFAULT_FLAGS),
) -> dict:
    """`bench/bench_train.py` for one backend in its own process (`base_flags`, then `flags`); its JSON
    result, or the error."""
    command = [
        sys.executable,
        str(ROOT / "bench" / "bench_train.py"),
        "--model_name",
        str(model_dir),
        "--backend",
        backend,
        "--steps",
        str(steps),
        *base_flags,
        *flags,
        *(["--profile", str(profile)] if profile else []),
    ]
    print("$", " ".join(command), flush=True)
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as stopped:
        output = stopped.stdout.decode(errors="replace") if isinstance(stopped.stdout, bytes) else stopped.stdout or ""
        print(output[-4000:], flush=True)
        result = result_line(output)
        if result is not None:  # stopped while it wrote its profile: the measured steps stand
            return {**result, "note": f"stopped after {timeout_s:g} s, after printing its result"}
        return {"backend": backend, "error": f"stopped after {timeout_s:g} s"}
    print(done.stdout[-4000:], flush=True)
    result = result_line(done.stdout)
    if done.returncode not in (0, 1) or result is None:  # 1: the environment-share check failed; figures stand
        print(done.stderr[-6000:], file=sys.stderr)
        return {"backend": backend, "error": f"exit {done.returncode}", "stderr_tail": done.stderr[-2000:]}
    return result


def result_line(output: str):
    """The result `bench/bench_train.py` printed (its last line that is a JSON object with a
    `backend`), or None if it printed none."""
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(found, dict) and "backend" in found:
                return found
    return None


def summary(results: dict) -> dict:
    """Per backend: s/step, tokens/s, generation share, peak GiB; and each target met or not."""
    rows = {}
    for backend, result in results.items():
        if "error" in result:
            rows[backend] = {"error": result["error"]}
            continue
        rows[backend] = {
            "seconds_per_step": result["mean"]["total_s"],
            "generated_tokens_per_step": result["mean"]["generated_tokens"],
            "generation_tokens_per_s": result["mean"]["generation_tokens_per_s"],
            "generation_share": result["share"]["generation_s"],
            "environment_share": result["share"]["environment_s"],
            "peak_gpu_memory_gib": result.get("peak_gpu_memory_gib"),
        }
    targets = {}
    for backend, row in rows.items():
        if "error" not in row:
            targets[f"{backend}: step <= {STEP_SECONDS_TARGET:g} s"] = row["seconds_per_step"] <= STEP_SECONDS_TARGET
            targets[f"{backend}: generation >= {GENERATION_TOKENS_PER_S_TARGET:g} tokens/s"] = (
                row["generation_tokens_per_s"] >= GENERATION_TOKENS_PER_S_TARGET
            )
    memory = {b: rows[b].get("peak_gpu_memory_gib") for b in ("unsloth", "trl") if b in rows}
    if len(memory) == 2 and None not in memory.values():
        targets[f"unsloth peak memory <= {UNSLOTH_MEMORY_RATIO_TARGET} x trl's"] = (
            memory["unsloth"] <= UNSLOTH_MEMORY_RATIO_TARGET * memory["trl"]
        )
    return {"backends": rows, "targets": targets}


PARTS = ("generation", "backends", "four-bit", "colab-step", "pretrained")
"""What one session can measure, each in its own processes, in the order given to `--parts`:
`generation` (bench/bench_generate.py: each engine's tokens/s at each batch size, whole campaigns'
growing contexts, LoRA on, TRL's loading), `backends` (the GRPO steps of Unsloth and TRL + PEFT
above), `four-bit` (4-bit base weights: the generation rows, and a TRL GRPO step's peak memory
against a 16-bit one's), `colab-step` (one GRPO step of configs/train/colab.yaml's own shape,
profiled), `pretrained` (SmolLM2-135M-Instruct, a real pretrained model: `python -m lib.training`
with `--pretrained-config`, its warm start and GRPO on the validation split, before and after)."""
GENERATION_FLAGS = [*EPISODE_FLAGS, "--campaign-contexts"]
"""The generation table's episodes: 5 turns of 64 tokens of whole campaigns' contexts, as the GRPO bench's."""
GENERATION_BATCH = 16
"""The batch of the GRPO bench's step, at which the tokens/s target is read."""
FOUR_BIT_MEMORY_RATIO_TARGET = 0.6
COLAB_FLAGS = ["--config", "configs/train/colab.yaml", "--warm_start_episodes", "0"]
"""configs/train/colab.yaml's shape for the random-weight model (which has nothing to warm-start from)."""
PRETRAINED_CONFIG = "configs/train/smollm2-gpu.yaml"
"""The `pretrained` part's run: SmolLM2-135M-Instruct's warm start and GRPO, sized for one call."""
PRETRAINED_KEPT = ("before_after_metrics.json", "pre_eval.jsonl.gz", "post_eval.jsonl.gz", "training_log.csv")
"""The files of the pretrained run's evidence a session keeps (the GPU machine sends back 8 files a
call: these, results.json, the log and machine.txt); the intervals recompute from the episodes."""
PART_MIN_SECONDS = 30.0
"""A part is skipped, and said so, when less than this is left of `--budget`."""


def run_printing(command: Sequence[str], timeout_s: Optional[float]) -> Optional[str]:
    """Run `command` in the repository, its output printed as it comes; the error (a non-zero exit,
    or stopped at `timeout_s`), or None."""
    print("$", " ".join(command), flush=True)
    try:
        done = subprocess.run(command, cwd=ROOT, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"stopped after {timeout_s:g} s"
    return f"exit {done.returncode}" if done.returncode else None


def run_generation(
    model_dir: Path, flags: Sequence[str], rows_path: Path, timeout_s: Optional[float], backend: str = "trl"
) -> dict:
    """`bench/bench_generate.py` in its own process, printing its rows as it measures them; the rows
    it appended to `rows_path` (kept when it is stopped), and the error if it failed or was stopped."""
    command = [
        sys.executable,
        str(ROOT / "bench" / "bench_generate.py"),
        "--model_name",
        str(model_dir),
        "--backend",
        backend,
        *GENERATION_FLAGS,
        *flags,
        "--json-lines",
        str(rows_path),
    ]
    error = run_printing(command, timeout_s)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line] if rows_path.exists() else []
    return {"rows": rows, **({"error": error} if error else {})}


def run_pretrained(config: str, out_dir: Path, work_dir: Path, timeout_s: Optional[float]) -> dict:
    """`python -m lib.training --config config` in its own process, printing as it goes, its
    evidence and checkpoints under `work_dir`; then `PRETRAINED_KEPT` copied to `out_dir` (also from a
    run that was stopped: the warm start's evaluation is written before GRPO starts); what its
    before_after_metrics.json and train_result.json say, or the error."""
    evidence, outputs = work_dir / "evidence", work_dir / "outputs"
    command = [sys.executable, "-m", "lib.training", "--config", config]
    command += ["--evidence_dir", str(evidence), "--output_dir", str(outputs)]
    error = run_printing(command, timeout_s)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in PRETRAINED_KEPT:
        if (evidence / name).is_file():
            shutil.copyfile(evidence / name, out_dir / name)
    return {"config": config, **pretrained_summary(evidence, outputs), **({"error": error} if error else {})}


def pretrained_summary(evidence: Path, outputs: Path) -> dict:
    """Success and mean reward of the warm start (before) and after GRPO, with their 95% intervals
    and the paired difference's, and each phase's seconds: what the run's files hold of them."""
    found: dict = {}
    metrics = evidence / "before_after_metrics.json"
    if metrics.is_file():
        payload = json.loads(metrics.read_text())
        found["tasks"] = payload["pre"]["n"]
        for measure in ("success_rate", "mean_reward"):
            found[measure] = {
                "before": payload["pre"][measure],
                "before_ci95": payload["pre_ci95"][measure],
                "after": payload["post"][measure],
                "after_ci95": payload["post_ci95"][measure],
                "delta": payload["delta"][measure],
                "delta_ci95": payload["delta_ci95"][measure],
            }
    result = outputs / "train_result.json"
    if result.is_file():
        found["seconds"] = {k: round(v, 1) for k, v in json.loads(result.read_text())["seconds"].items()}
    return found


def generation_targets(rows: Sequence[dict]) -> dict:
    """Per engine: its tokens/s at `GENERATION_BATCH` episodes reaches the target or not."""
    return {
        f"{row['engine']}{' 4-bit' if row.get('load_in_4bit') else ''}: generation at batch {GENERATION_BATCH} "
        f">= {GENERATION_TOKENS_PER_S_TARGET:g} tokens/s": row["tokens_per_s"] >= GENERATION_TOKENS_PER_S_TARGET
        for row in rows
        if row["batch"] == GENERATION_BATCH
    }


def four_bit_targets(four_bit: dict, sixteen_bit: dict) -> dict:
    """4-bit GRPO step's peak memory against the 16-bit TRL step's, when both were measured."""
    peaks = [r.get("peak_gpu_memory_gib") for r in (four_bit, sixteen_bit)]
    if None in peaks or "error" in four_bit or "error" in sixteen_bit:
        return {}
    return {
        f"4-bit peak memory <= {FOUR_BIT_MEMORY_RATIO_TARGET} x 16-bit TRL's": peaks[0]
        <= FOUR_BIT_MEMORY_RATIO_TARGET * peaks[1]
    }


def main(argv=None) -> int:
    import time

    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=["backends"], help="what to measure, in order")
    parser.add_argument("--backends", nargs="+", default=["unsloth", "trl"], choices=["unsloth", "trl"])
    parser.add_argument("--steps", type=int, default=3, help="measured steps per backend (after one warm-up step)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--model-dir", type=Path, help="the model's folder: reused if it holds one, else built there")
    parser.add_argument("--backend-timeout", type=float, help="seconds a backend may take before it is stopped")
    parser.add_argument("--budget", type=float, help="seconds for all parts: each is stopped at what is left")
    parser.add_argument("--engines", nargs="+", default=["generate", "compiled"], help="the generation table's engines")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[GENERATION_BATCH, 64, 128])
    parser.add_argument("--colab-backend", choices=["unsloth", "trl"], default="unsloth")
    parser.add_argument("--pretrained-config", default=PRETRAINED_CONFIG, help="the `pretrained` part's run")
    parser.add_argument(
        "--profile-dir", type=Path, help="profile one more step per backend: profile_<backend>.txt here"
    )
    parser.add_argument("--out", type=Path, help="write the results here as JSON (again after each part)")
    parser.add_argument("--allow-cpu", action="store_true", help="run without a GPU (to check the script)")
    args, flags = parser.parse_known_args(argv)  # the rest: TrainConfig flags for bench_train.py
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            "bench_train_gpu.py measures a GPU and none is visible; on a CPU run `make bench-train`, "
            "or pass --allow-cpu --shape tiny to check this script",
            file=sys.stderr,
        )
        return 2
    deadline = time.monotonic() + args.budget if args.budget else None

    def time_left(part_timeout: Optional[float]) -> Optional[float]:
        if deadline is None:
            return part_timeout
        left = deadline - time.monotonic()
        return left if part_timeout is None else min(left, part_timeout)

    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report = {
        "device": device,
        "cuda": torch.version.cuda,
        "versions": installed_torch_stack(VERSIONED),
        "shape": args.shape,
        "steps": args.steps,
        "parts": args.parts,
        "flags": flags,
        "targets": {},
    }

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")

    engine_flags = ["--engines", *args.engines, "--batch-sizes", *map(str, args.batch_sizes)]
    with tempfile.TemporaryDirectory(prefix="bench-train-gpu-") as tmp:
        model_dir = args.model_dir or Path(tmp) / "model"
        if set(args.parts) - {"pretrained"} and not (model_dir / "config.json").exists():
            n_params = build_model(model_dir, SHAPES[args.shape])
            print(f"built a random-weight {args.shape} model: {n_params / 1e6:.0f}M parameters", flush=True)
        rows_dir = args.out.parent if args.out else Path(tmp)
        for part in args.parts:
            timeout_s = time_left(args.backend_timeout)
            if timeout_s is not None and timeout_s < PART_MIN_SECONDS:
                report[part.replace("-", "_")] = {"skipped": f"{timeout_s:.0f} s of the budget left"}
                print(f"== {part}: skipped, {timeout_s:.0f} s of the budget left", flush=True)
                continue
            print(f"== {part}", flush=True)
            if part == "generation":
                report["generation"] = run_generation(
                    model_dir, engine_flags + flags, rows_dir / "generation.jsonl", timeout_s
                )
                report["targets"].update(generation_targets(report["generation"]["rows"]))
            elif part == "backends":
                results = {}
                for backend in args.backends:
                    results[backend] = run_backend(
                        backend,
                        model_dir,
                        args.steps,
                        flags,
                        timeout_s=time_left(args.backend_timeout),
                        profile=args.profile_dir / f"profile_{backend}.txt" if args.profile_dir else None,
                    )
                    report["raw"] = results
                    save()
                summarised = summary(results)
                report["backends"] = summarised["backends"]
                report["targets"].update(summarised["targets"])
            elif part == "four-bit":
                four_bit = ["--load_in_4bit", "true"]
                generation = run_generation(
                    model_dir, engine_flags + four_bit + flags, rows_dir / "generation_4bit.jsonl", timeout_s
                )
                steps = {
                    label: run_backend("trl", model_dir, 1, flags + extra, timeout_s=time_left(args.backend_timeout))
                    for label, extra in (("4-bit", ["--lora_r", "16"] + four_bit), ("16-bit", ["--lora_r", "16"]))
                }
                report["four_bit"] = {"generation": generation, "grpo_steps": steps}
                report["targets"].update(generation_targets(generation["rows"]))
                report["targets"].update(four_bit_targets(steps["4-bit"], steps["16-bit"]))
            elif part == "colab-step":
                report["colab_step"] = run_backend(
                    args.colab_backend,
                    model_dir,
                    1,
                    flags,
                    timeout_s=timeout_s,
                    profile=args.profile_dir / "profile_colab.txt" if args.profile_dir else None,
                    base_flags=COLAB_FLAGS,
                )
            elif part == "pretrained":
                report["pretrained"] = run_pretrained(
                    args.pretrained_config, rows_dir / "pretrained", Path(tmp) / "pretrained", timeout_s
                )
            save()
    print(json.dumps({k: v for k, v in report.items() if k != "raw"}, indent=2))
    save()
    return 0 if report["targets"] and all(report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
