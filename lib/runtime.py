"""What machine a notebook or a run is on: Colab or not, which GPU, how many cores. Nothing here
imports torch (the GPU is asked of `nvidia-smi`), so it can run before the GPU set is installed
and before Unsloth is imported.

    runtime = detect_runtime()
    check_training_runtime(runtime, allow_cpu=False)   # notebook 03's first step on Colab

A Colab runtime without a GPU can only train the CPU stand-in, whose timings are stated once,
with their date and machine, in `CPU_STAND_IN_TIMES`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import List, Optional

CPU_STAND_IN_TIMES = (
    "on the 2-core machine of 2026-11-26, the stand-in's warm start took 6 min and the whole default "
    "run 29 min (the warm start, 60 GRPO steps, and the 313-episode held-out suite before and after)"
)
"""The CPU stand-in's default run as measured (docs/training.md); a Colab CPU runtime has 2 cores too."""
SWITCH_TO_GPU = "Runtime > Change runtime type > T4 GPU (free) > Save, then Runtime > Run all"


@dataclass(frozen=True)
class Runtime:
    """The machine: on Colab or not, its GPUs (name and memory in GiB, from nvidia-smi), CPU cores."""

    colab: bool
    gpus: List[str]
    cpu_cores: int

    @property
    def gpu(self) -> bool:
        return bool(self.gpus)

    def describe(self) -> str:
        where = "Colab" if self.colab else "this machine"
        gpus = ", ".join(self.gpus) if self.gpus else "no GPU"
        return f"{where}: {gpus}, {self.cpu_cores} CPU cores"


def visible_gpus() -> List[str]:
    """'NAME (N GiB)' of each NVIDIA GPU `nvidia-smi` lists; empty without one (or without nvidia-smi)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return []
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run(
            [smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        name, _, memory = line.partition(",")
        try:
            gpus.append(f"{name.strip()} ({float(memory) / 1024:.0f} GiB)")
        except ValueError:
            gpus.append(name.strip())
    return [gpu for gpu in gpus if gpu]


def detect_runtime() -> Runtime:
    """The `Runtime` this process runs on."""
    return Runtime(colab="google.colab" in sys.modules, gpus=visible_gpus(), cpu_cores=os.cpu_count() or 1)


class CpuRuntimeError(RuntimeError):
    """A Colab runtime without a GPU, where the notebook was not told to train the CPU stand-in."""


def check_training_runtime(runtime: Optional[Runtime] = None, *, allow_cpu: bool = False) -> Runtime:
    """Print what the run will train on; on Colab without a GPU, raise `CpuRuntimeError` saying how to
    switch the runtime, or how to opt in to the CPU stand-in and how long it takes, unless `allow_cpu`."""
    runtime = runtime or detect_runtime()
    print(runtime.describe())
    if runtime.gpu:
        print("a GPU: a real model trains (configs/train/colab.yaml, unless TRAIN_CONFIG names another file)")
        return runtime
    stand_in = f"the CPU stand-in (cernenv-tiny) trains, not an LLM: {CPU_STAND_IN_TIMES}"
    if runtime.colab and not allow_cpu:
        raise CpuRuntimeError(
            f"this Colab runtime has no GPU. Switch: {SWITCH_TO_GPU}. Or set ALLOW_CPU = True in this "
            f"cell to train here anyway: {stand_in}"
        )
    print(f"no GPU: {stand_in}")
    return runtime
