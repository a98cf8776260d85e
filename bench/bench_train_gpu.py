"""Unsloth vs TRL + PEFT on one GPU: the same GRPO steps on a model of Qwen2.5-1.5B's shape.

    python bench/bench_train_gpu.py                       # both backends, 3 measured steps each
    python bench/bench_train_gpu.py --backends trl --steps 5 --out results.json
    python bench/bench_train_gpu.py --shape tiny --allow-cpu --backends trl   # the plumbing, on a CPU

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
import subprocess
import sys
import tempfile
from pathlib import Path

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
DEFAULT_FLAGS = [
    "--num_generations",
    "8",
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "4",
    "--max_turns",
    "5",
    "--max_new_tokens",
    "64",
    "--temperature",
    "1.0",
    "--lora_r",
    "16",
    "--warm_start_episodes",
    "0",
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
    backend: str, model_dir: Path, steps: int, flags: list, timeout_s: float = None, profile: Path = None
) -> dict:
    """`bench/bench_train.py` for one backend in its own process; its JSON result, or the error."""
    command = [
        sys.executable,
        str(ROOT / "bench" / "bench_train.py"),
        "--model_name",
        str(model_dir),
        "--backend",
        backend,
        "--steps",
        str(steps),
        *DEFAULT_FLAGS,
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", nargs="+", default=["unsloth", "trl"], choices=["unsloth", "trl"])
    parser.add_argument("--steps", type=int, default=3, help="measured steps per backend (after one warm-up step)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--model-dir", type=Path, help="the model's folder: reused if it holds one, else built there")
    parser.add_argument("--backend-timeout", type=float, help="seconds a backend may take before it is stopped")
    parser.add_argument(
        "--profile-dir", type=Path, help="profile one more step per backend: profile_<backend>.txt here"
    )
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
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
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-train-gpu-") as tmp:
        model_dir = args.model_dir or Path(tmp) / "model"
        if not (model_dir / "config.json").exists():
            n_params = build_model(model_dir, SHAPES[args.shape])
            print(f"built a random-weight {args.shape} model: {n_params / 1e6:.0f}M parameters", flush=True)
        results = {
            backend: run_backend(
                backend,
                model_dir,
                args.steps,
                flags,
                timeout_s=args.backend_timeout,
                profile=args.profile_dir / f"profile_{backend}.txt" if args.profile_dir else None,
            )
            for backend in args.backends
        }
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report = {
        "device": device,
        "cuda": torch.version.cuda,
        "versions": installed_torch_stack(VERSIONED),
        "shape": args.shape,
        "steps": args.steps,
        "flags": DEFAULT_FLAGS + flags,
        **summary(results),
        "raw": results,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "raw"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["targets"] and all(report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
