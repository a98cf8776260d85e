"""Where the time of a GRPO step goes: generation, environment, optimisation.

    make bench-train                       # default CPU config, 3 measured steps
    make bench-train NPROC=2               # the same in 2 processes (accelerate launch, one thread each)
    python bench/bench_train.py --steps 5 --num_generations 4 --per_device_train_batch_size 4

A step = the rollout (the policy plays every episode of the batch: `generate` calls, and
the environment's reset/step/grading in between) + TRL's scoring and optimisation (old
log-probs, loss, backward, optimiser). Generation and environment time are measured
inside `CampaignRollout`; the rest of the step's wall time is optimisation. The first
step is a warm-up and is reported but not averaged. On a GPU the peak memory torch
allocated is reported too. The environment's share must stay under 5% (checked; exit 1 if
not). The result is printed as one line of JSON (`bench/bench_train_gpu.py` reads it).

`--profile FILE` plays one more step under torch's profiler (not counted in the means) and
writes where its time went to FILE: the step's wall time, how long the GPU was busy (its kernels'
running time; the rest of the step it waited on the CPU), and the operators and kernels
that took the most device and CPU time.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lib.training.cli import parse_train_config, train_config_parser

ENVIRONMENT_SHARE_LIMIT = 0.05


def main(argv=None) -> int:
    parser = train_config_parser("bench/bench_train.py", description=__doc__, argv=argv)  # TrainConfig's flags
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    parser.add_argument("--profile", type=Path, help="profile one more step and write where its time went here")
    config, args = parse_train_config(argv, parser)  # imports unsloth first where the run may use it
    from transformers import TrainerCallback

    from lib.training.backends import load_policy, resolve_backend
    from lib.training.grpo import REWARD_FUNCS, CampaignRollout, training_dataset
    from lib.training.run import grpo_args
    from lib.training.warm_start import sft_warm_start

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.durations, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.durations.append(time.perf_counter() - self._start)
            print(f"step {len(self.durations) - 1} took {self.durations[-1]:.2f} s", flush=True)

    class StepProfiler(TrainerCallback):
        """torch's profiler over the step numbered `step` (0 = the warm-up)."""

        def __init__(self, step: int) -> None:
            self.step, self.profiler, self.wall_s = step, None, None

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == self.step:
                import torch

                activities = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available():
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()
                self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.profiler is not None and self.wall_s is None:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.profiler.__exit__(None, None, None)
                self.wall_s = time.perf_counter() - self._start

    with tempfile.TemporaryDirectory() as tmp:
        profiled_steps = 1 if args.profile else 0
        config = config.from_dict(
            {
                **config.to_dict(),
                "max_steps": args.steps + 1 + profiled_steps,
                "output_dir": tmp,
                "evidence_dir": tmp,
            }
        )
        backend = resolve_backend(config)
        from lib.training.trainer_class import grpo_trainer_class

        policy = load_policy(config, backend)
        if config.warm_start_episodes:  # the run's policy: warm-started (cached after its first build)
            sft_warm_start(policy, config)
        rollout = CampaignRollout(config, policy.tokenizer, backend=backend)
        timer = StepTimer()
        profiler = StepProfiler(args.steps + 1) if args.profile else None
        trainer = grpo_trainer_class(config, backend)(
            model=policy.model,
            reward_funcs=REWARD_FUNCS,
            args=grpo_args(config, save_strategy="no", logging_steps=1000),
            train_dataset=training_dataset(config),
            processing_class=policy.tokenizer,
            peft_config=policy.peft_config,
            rollout_func=rollout,
            callbacks=[timer] + ([profiler] if profiler else []),
        )
        trainer.train()
    from lib.training.processes import is_main_process, num_processes

    if not is_main_process():  # under `accelerate launch` the main process reports (its share's timings)
        return 0
    rows = []
    measured_timings = rollout.timings[: len(rollout.timings) - profiled_steps]
    for step, (total, timing) in enumerate(zip(timer.durations, measured_timings)):
        generation, environment = timing["generation_s"], timing["environment_s"]
        rows.append(
            {
                "step": step,
                "total_s": total,
                "generation_s": generation,
                "environment_s": environment,
                "optimisation_s": total - generation - environment,
                "generated_tokens": timing["generated_tokens"],
                "generation_tokens_per_s": timing["generated_tokens"] / generation if generation else None,
            }
        )
    measured = rows[1:] or rows
    mean = {key: statistics.fmean(r[key] for r in measured) for key in rows[0] if key != "step"}
    share = {key: mean[key] / mean["total_s"] for key in ("generation_s", "environment_s", "optimisation_s")}
    episodes_per_s = config.episodes_per_step / mean["total_s"]
    processes = num_processes()
    print(
        f"backend {backend}, model {policy.model_name}, {config.episodes_per_step} episodes per step "
        f"({config.num_generations} per group), {processes} process{'es' if processes > 1 else ''}"
        + (" (generation and environment: the main process's share)" if processes > 1 else "")
    )
    print(f"{'step':>4} {'total s':>8} {'generate':>9} {'environment':>11} {'optimise':>9} {'tok/s':>7}")
    for r in rows:
        print(
            f"{r['step']:>4} {r['total_s']:8.2f} {r['generation_s']:9.2f} {r['environment_s']:11.2f} "
            f"{r['optimisation_s']:9.2f} {r['generation_tokens_per_s'] or 0:7.1f}"
            + ("  (warm-up)" if r["step"] == 0 else "")
        )
    print(
        "mean of measured steps: "
        + ", ".join(f"{k.removesuffix('_s')} {v:.1%}" for k, v in share.items())
        + f"; {mean['generation_tokens_per_s']:.1f} generated tokens/s; "
        + f"{episodes_per_s:.2f} episodes/s"
    )
    import torch

    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    if peak_gib is not None:
        print(f"peak GPU memory allocated: {peak_gib:.2f} GiB")
    print(
        json.dumps(
            {
                "backend": backend,
                "model": policy.model_name,
                "episodes_per_step": config.episodes_per_step,
                "processes": processes,
                "episodes_per_s": episodes_per_s,
                "mean": mean,
                "share": share,
                "steps": rows,
                "peak_gpu_memory_gib": peak_gib,
            }
        )
    )
    if profiler is not None:  # after the result: reading a long step's trace can take minutes
        args.profile.write_text(profile_report(profiler, rollout.timings[-1]))
        print(f"profile of step {profiler.step} written to {args.profile}")
    if share["environment_s"] >= ENVIRONMENT_SHARE_LIMIT:
        print(
            f"FAIL: the environment takes {share['environment_s']:.1%} of a step (limit {ENVIRONMENT_SHARE_LIMIT:.0%})",
            file=sys.stderr,
        )
        return 1
    return 0


def profile_report(profiler, timing: dict) -> str:
    """Where a profiled step's time went: wall, GPU busy, generation, and the top operators."""
    events = profiler.profiler.events()
    kernels = sorted(
        (e.time_range.start, e.time_range.end) for e in events if getattr(e.device_type, "name", "") == "CUDA"
    )
    busy_us, reach = 0.0, -float("inf")  # the union of the kernels' intervals (streams may overlap)
    for start, end in kernels:
        busy_us += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    busy_s = busy_us / 1e6
    averages = profiler.profiler.key_averages()
    wall = profiler.wall_s
    lines = [
        f"profiled step {profiler.step}: wall {wall:.2f} s (the profiler slows it), "
        f"generating {timing['generation_s']:.2f} s ({timing['generated_tokens']} tokens), "
        f"environment {timing['environment_s']:.2f} s",
        (
            f"GPU busy (kernels running) {busy_s:.2f} s = {busy_s / wall:.1%} of the step, in {len(kernels)} kernels; "
            "the rest of the step the GPU waited on the CPU"
            if kernels
            else "no GPU kernel ran (a CPU run)"
        ),
        "",
        "by device time:",
        averages.table(sort_by="self_device_time_total" if busy_s else "self_cpu_time_total", row_limit=30),
        "by CPU time:",
        averages.table(sort_by="self_cpu_time_total", row_limit=30),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
