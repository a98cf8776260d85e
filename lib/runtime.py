"""What machine a notebook or a run is on: Colab or not, which GPU, how many cores, and how many of
them are free. Importing it imports no torch (the GPU is asked of `nvidia-smi`), so it can run
before the GPU set is installed and before Unsloth is imported.

    runtime = detect_runtime()
    check_training_runtime(runtime, allow_cpu=False)   # notebook 03's first step on Colab
    use_cpu_threads()                                  # torch's threads: the cores free now

A Colab runtime without a GPU can only train the CPU stand-in, whose timings are stated once,
with their date and machine, in docs/benchmarks.md (`stand_in_times` reads them there).

`cpu_threads` is the one place that decides how many threads a process computes with: the cores it
may run on (`available_cores`: its affinity set, less a container's CPU quota) less those other
processes keep busy (`busy_cores_elsewhere`, from /proc/stat), at least one; `OMP_NUM_THREADS`
where it is set (`make test`'s workers, `accelerate launch --num_cpu_threads_per_process`). torch
otherwise starts a thread per core whatever else runs: its OpenMP threads wait for each other at
every operation, and a thread that waits for a core stalls them all.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

WARM_START_DECISIONS_PER_CAMPAIGN = 23.7
"""A warm start's examples per campaign in the `turn` context, one per decision: 14,200 of the default's
600 `HeuristicAgent()` campaigns (the heuristic family's 600 give 12,575: its members book less)."""
WARM_START_SECONDS_PER_STEP = (0.72, 1.76)
"""The fastest and slowest a warm-start step (16 decisions, forward and backward) has run on 2 cores
of the AMD EPYC the project measures on [s]: 0.72 idle (2026-11-29, the default's 1,776 steps in
21.4 min), 1.46 idle (2026-12-01, the smoke one's 190 steps), 1.76 at load ~2 (2026-12-02, the
heuristic family's 1,572 steps in 46 min, tests running beside it for a while). That virtual
machine's speed drifts within a day: a range holds where one figure did not."""


def warm_start_steps(campaigns: int, passes: float, batch_size: int = 16) -> int:
    """About how many optimisation steps a warm start on `campaigns` heuristic campaigns takes:
    their decisions (`WARM_START_DECISIONS_PER_CAMPAIGN` each), `passes` times, `batch_size` a step."""
    return math.ceil(campaigns * WARM_START_DECISIONS_PER_CAMPAIGN * passes / batch_size)


def warm_start_estimate_minutes(campaigns: int, passes: float, batch_size: int = 16) -> tuple:
    """(least, most) minutes the CPU stand-in's warm start takes on 2 cores: its steps
    (`warm_start_steps`) at the fastest and the slowest step measured (`WARM_START_SECONDS_PER_STEP`)."""
    steps = warm_start_steps(campaigns, passes, batch_size)
    return tuple(steps * seconds / 60 for seconds in WARM_START_SECONDS_PER_STEP)


def warm_start_estimate(campaigns: int, passes: float, batch_size: int = 16) -> str:
    """`warm_start_estimate_minutes` for a reader: "about 190 steps, 2.3-5.6 min on 2 cores, an
    estimate (its progress bar gives the time left as it goes)", with the load now when it is above 1."""
    low, high = warm_start_estimate_minutes(campaigns, passes, batch_size)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = f"; the load here is {load:.1f} now, so expect longer" if load > 1.0 else ""
    return (
        f"about {warm_start_steps(campaigns, passes, batch_size)} steps, {low:.2g}-{high:.2g} min on 2 cores, "
        f"an estimate (its progress bar gives the time left as it goes){busy}"
    )


BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
"""Every measured time of the project, with its date and machine: the one place a timing is written."""
STAND_IN_ROW = "`make train` (the CPU stand-in's default run)"
"""The first cell of the row of docs/benchmarks.md that times the CPU stand-in's default run."""


def stand_in_times(path: Path = BENCHMARKS_MD) -> str:
    """How long the CPU stand-in's default run takes, as docs/benchmarks.md's `STAND_IN_ROW` says
    (with its dates and machines), or where to read it where that file is not at hand."""
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) >= 2 and cells[0] == STAND_IN_ROW:
                return f"{cells[1]} (docs/benchmarks.md)"
    except OSError:
        pass
    return "its times, with dates and machines: docs/benchmarks.md, 'Whole runs and the quick start'"


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
    return Runtime(colab="google.colab" in sys.modules, gpus=visible_gpus(), cpu_cores=available_cores())


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
    stand_in = f"the CPU stand-in (cernenv-tiny) trains, not an LLM: {stand_in_times()}"
    if runtime.colab and not allow_cpu:
        raise CpuRuntimeError(
            f"this Colab runtime has no GPU. Switch: {SWITCH_TO_GPU}. Or set ALLOW_CPU = True in this "
            f"cell to train here anyway: {stand_in}"
        )
    print(f"no GPU: {stand_in}")
    return runtime


logger = logging.getLogger(__name__)

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""The environment variables that fix a process's compute threads (OpenMP: torch; MKL; OpenBLAS: numpy)."""
TAKEN_CORE_SHARE = 0.3
"""A core counts as taken when other processes kept it busy at least this share of the time: with
torch's threads waiting for each other, a core shared even part of the time stalls every step."""
BUSY_WINDOW_S = 0.25
"""How long `cpu_threads` watches the cores when it has no earlier snapshot to compare with."""


def available_cores() -> int:
    """The CPU cores this process may run on: its affinity set (`os.sched_getaffinity`; `taskset`,
    a batch system's allocation), less where its cgroup's CPU quota (a container's `--cpus`) allows
    fewer; `os.cpu_count()` where there is no affinity (macOS)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> Optional[float]:
    """The CPUs this process's cgroup may use at most (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`
    over `cpu.cfs_period_us`); None without a quota or a cgroup file system."""
    candidates = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hierarchy, _, path = line.partition(":")[2].partition(":")
            if hierarchy in ("", "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                candidates.append((root / path.lstrip("/"), root / "cpu" / path.lstrip("/")))
    except OSError:
        pass
    candidates.append((root, root / "cpu"))
    for v2, v1 in candidates:
        try:
            limit, period = (v2 / "cpu.max").read_text().split()[:2]
            return None if limit == "max" else int(limit) / int(period)
        except (OSError, ValueError):
            pass
        try:
            limit = int((v1 / "cpu.cfs_quota_us").read_text())
            return None if limit <= 0 else limit / int((v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            pass
    return None


@dataclass(frozen=True)
class CpuSnapshot:
    """The busy time of some cores (all processes) and this process's own CPU time, at one moment [s]."""

    wall_s: float
    busy_s: float
    own_s: float


def cpu_snapshot(cores: Optional[Sequence[int]] = None, stat: Path = Path("/proc/stat")) -> Optional[CpuSnapshot]:
    """A `CpuSnapshot` of `cores` (default: this process's affinity set) from /proc/stat (user,
    nice, system, irq, softirq and steal time: steal is a virtual machine's core lent to another);
    None where there is no /proc/stat (macOS)."""
    try:
        wanted = set(os.sched_getaffinity(0) if cores is None else cores)
        lines = stat.read_text().splitlines()
    except (AttributeError, OSError):
        return None
    ticks = 0
    for line in lines:
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in wanted:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in values[:8])
            ticks += user + nice + system + irq + softirq + steal
    own = os.times()
    return CpuSnapshot(time.monotonic(), ticks / os.sysconf("SC_CLK_TCK"), own.user + own.system)


def busy_cores_elsewhere(before: Optional[CpuSnapshot] = None, after: Optional[CpuSnapshot] = None) -> float:
    """How many of this process's cores other processes kept busy between two snapshots (by default,
    over the next `BUSY_WINDOW_S`); where /proc/stat is missing, the 1-minute load average (which
    counts this process too)."""
    if before is None:
        before = cpu_snapshot()
        if before is None:
            return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        time.sleep(BUSY_WINDOW_S)
    after = after or cpu_snapshot()
    if after is None or after.wall_s <= before.wall_s:
        return 0.0
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, others / (after.wall_s - before.wall_s))


def pinned_threads() -> Optional[int]:
    """The thread count `OMP_NUM_THREADS` fixes (a whole number of at least 1), else None."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) >= 1 else None


def cpu_threads(processes: int = 1, busy_elsewhere: Optional[float] = None) -> int:
    """How many compute threads each of `processes` processes side by side should run: the cores
    free now (`available_cores` less those other processes keep busy, a core taken from
    `TAKEN_CORE_SHARE` of its time) shared among them, at least 1; `OMP_NUM_THREADS` where it is
    set. `busy_elsewhere`: cores busy elsewhere as measured (default: `busy_cores_elsewhere()`)."""
    pinned = pinned_threads()
    if pinned is not None:
        return pinned
    busy = busy_cores_elsewhere() if busy_elsewhere is None else busy_elsewhere
    taken = math.floor(busy + 1.0 - TAKEN_CORE_SHARE)
    return max(1, (available_cores() - taken) // max(1, processes))


def use_cpu_threads(busy_elsewhere: Optional[float] = None) -> int:
    """Set torch's compute threads to `cpu_threads()` and return them (torch is imported here: a
    training process has it already); the log says so when the count changes."""
    import torch

    pinned = pinned_threads()
    busy = 0.0 if pinned else busy_cores_elsewhere() if busy_elsewhere is None else busy_elsewhere
    threads = cpu_threads(busy_elsewhere=busy)
    if threads != torch.get_num_threads():
        why = "OMP_NUM_THREADS" if pinned else f"{available_cores()} core(s), {busy:.1f} kept busy by other processes"
        logger.info("torch computes with %d thread(s) (%s)", threads, why)
        torch.set_num_threads(threads)
    return threads


SDPA_GROUPED_QUERY_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"
"""transformers' switch that hands a grouped-query model's key-value heads to PyTorch's SDPA as they
are (`enable_gqa`) wherever it runs, instead of copying each to the query heads it serves first."""


def attend_grouped_queries() -> bool:
    """Have a CPU run's attention read a grouped-query model's key-value heads in place (SmolLM2: 3
    of them for 9 query heads) and return whether it does. transformers does so by itself only where
    no mask is passed (one unpadded sequence); with a batch's padding mask it copies the keys and values of every
    prefill (`repeat_kv`), a third of a SmolLM2 evaluation's attention time on a CPU. Set once a process
    through transformers' own switch, read at every attention call; a value the caller set, either
    way, is kept. Call it on a CPU only: on a GPU, SDPA with a mask and grouped heads may leave its
    fused kernels."""
    os.environ.setdefault(SDPA_GROUPED_QUERY_SWITCH, "1")
    return os.environ[SDPA_GROUPED_QUERY_SWITCH] == "1"


MALLOC_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
"""glibc's largest mmap threshold: blocks up to this size come from the heap and are reused."""
MALLOC_TRIM_THRESHOLD_BYTES = 2**31 - 1
"""Free heap kept rather than given back to the kernel (the process's peak stays resident)."""
_allocator_tuned: Optional[bool] = None


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep and reuse the memory a CPU run frees (once a process; True where it is
    glibc's and took the settings).

    A model decoding or training on a CPU allocates and frees tensors of megabytes at every forward
    pass (a layer's KV cache for a batch of campaigns). glibc serves blocks above its mmap threshold
    (128 KiB at first) with fresh mappings and trims freed heap back to the kernel, so each pass faults
    its pages in again, zero-filled by the kernel (docs/models.md has the figures). The same as the
    MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ environment variables, set from inside the process
    (`mallopt`). Blocks above 32 MiB are still mapped afresh: keep batches below that."""
    global _allocator_tuned
    if _allocator_tuned is not None:
        return _allocator_tuned
    _allocator_tuned = False
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, say)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    _allocator_tuned = bool(
        mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD_BYTES)
        and mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD_BYTES)
    )
    return _allocator_tuned
