"""The runtime check of notebook 03 (lib/runtime.py): on Colab without a GPU it stops and says what to
do, instead of starting the CPU stand-in's half-hour run without a word."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lib import runtime
from lib.runtime import SWITCH_TO_GPU, CpuRuntimeError, Runtime, check_training_runtime, stand_in_times

ROOT = Path(__file__).resolve().parents[1]


def test_a_colab_cpu_runtime_stops_and_says_how_to_switch_or_how_long_the_stand_in_takes(capsys):
    with pytest.raises(CpuRuntimeError) as stopped:
        check_training_runtime(Runtime(colab=True, gpus=[], cpu_cores=2))
    message = str(stopped.value)
    assert SWITCH_TO_GPU in message and "ALLOW_CPU = True" in message and stand_in_times() in message
    assert re.search(r"\d+ min", message) and re.search(r"20\d\d-\d\d-\d\d", message), "the time, with its date"
    assert "2 idle cores of an AMD EPYC" in message, "and the machine it was measured on"
    check_training_runtime(Runtime(colab=True, gpus=[], cpu_cores=2), allow_cpu=True)
    assert "no GPU: the CPU stand-in (cernenv-tiny) trains" in capsys.readouterr().out
    check_training_runtime(Runtime(colab=False, gpus=[], cpu_cores=2))  # a laptop: told, not stopped
    gpu = check_training_runtime(Runtime(colab=True, gpus=["Tesla T4 (15 GiB)"], cpu_cores=2))
    assert gpu.gpu and "Tesla T4 (15 GiB)" in capsys.readouterr().out


def test_the_stand_in_s_times_are_read_from_docs_benchmarks_md_the_one_place_they_are_written(tmp_path):
    """The notebook says no time of its own: it quotes docs/benchmarks.md's row, or points there."""
    assert stand_in_times().endswith("(docs/benchmarks.md)")
    assert stand_in_times(tmp_path / "absent.md").startswith("its times, with dates and machines: docs/benchmarks.md")


def test_the_warm_start_estimate_counts_its_steps_and_spans_the_measured_speeds(monkeypatch):
    """The smoke run's warning once gave the 600-campaign default's 21.4 min next to "64 campaigns",
    then 2.3 min where the warm start took 4.6: the estimate counts the warm start's steps (the
    smoke one's 190, the default's 1,776 as built) and gives the range the measured steps span, says
    it is an estimate, and says the load when the machine is busy."""
    assert runtime.warm_start_steps(64, 2.0) == 190 and runtime.warm_start_steps(600, 2.0) == 1778
    assert runtime.warm_start_steps(64, 2.0, batch_size=32) == 95
    fastest, slowest = runtime.WARM_START_SECONDS_PER_STEP
    low, high = runtime.warm_start_estimate_minutes(64, 2.0)
    assert (low, high) == (pytest.approx(190 * fastest / 60), pytest.approx(190 * slowest / 60))
    assert low <= 190 * 1.46 / 60 <= high, "the smoke warm start measured on 2026-12-01 falls inside"
    assert runtime.warm_start_estimate_minutes(128, 2.0)[1] == pytest.approx(2 * high, rel=0.01)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.3, 0.3))
    idle = "about 190 steps, 2.3-5.6 min on 2 cores, an estimate (its progress bar gives the time left as it goes)"
    assert runtime.warm_start_estimate(64, 2.0) == idle
    monkeypatch.setattr(os, "getloadavg", lambda: (3.46, 2.0, 1.0))
    assert runtime.warm_start_estimate(64, 2.0).endswith("as it goes); the load here is 3.5 now, so expect longer")


def test_gpus_are_read_from_nvidia_smi_without_torch(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'Tesla T4, 15360'\necho 'NVIDIA A100-SXM4-40GB, 40960'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert runtime.visible_gpus() == ["Tesla T4 (15 GiB)", "NVIDIA A100-SXM4-40GB (40 GiB)"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert runtime.visible_gpus() == []


def test_notebook_03_checks_the_runtime_before_it_installs_or_trains_anything():
    cells = [c for c in nbformat.read(ROOT / "notebooks" / "03_train_grpo.ipynb", as_version=4).cells]
    code = [c.source for c in cells if c.cell_type == "code"]
    check = next(i for i, source in enumerate(code) if "check_training_runtime(allow_cpu=ALLOW_CPU)" in source)
    install = next(i for i, source in enumerate(code) if "install_gpu_set" in source)
    assert check == 1 and install > check, "the first cell after the bootstrap"
    assert "runtime.gpu" in code[install], "the GPU set only on a GPU runtime"


def test_the_cores_are_those_of_the_affinity_set_less_a_container_s_quota(tmp_path, monkeypatch):
    everything = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(everything)})
        assert runtime.available_cores() == 1
    finally:
        os.sched_setaffinity(0, everything)
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert runtime.cgroup_cpu_quota(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert runtime.cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert runtime.cgroup_cpu_quota(tmp_path) == 0.5, "cgroup v1"
    monkeypatch.setattr(runtime, "cgroup_cpu_quota", lambda: 1.5)
    assert runtime.available_cores() == min(len(everything), 2)


def test_busy_cores_elsewhere_are_the_cores_busy_time_less_this_process_s_own(tmp_path):
    """Two snapshots of /proc/stat (user nice system idle iowait irq softirq steal ...) a second
    apart: cpu0 busy 100 ticks (of which this process 0.4 s), cpu1 busy 30 ticks of steal (a virtual
    machine's core lent elsewhere); cpu2 is not among this process's cores."""
    ticks = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"

    def snapshot(busy0, steal1, busy2, wall, own):
        stat.write_text(
            f"cpu  1 1 1 1 1 1 1 1 0 0\ncpu0 {busy0} 0 0 500 3 0 0 0 0 0\ncpu1 0 0 0 500 0 0 0 {steal1} 0 0\n"
            f"cpu2 {busy2} 0 0 500 0 0 0 0 0 0\nintr 1 2 3\n"
        )
        taken = runtime.cpu_snapshot([0, 1], stat)
        return runtime.CpuSnapshot(wall, taken.busy_s, own)

    before = snapshot(0, 0, 0, wall=10.0, own=5.0)
    after = snapshot(ticks, ticks * 30 // 100, ticks * 5, wall=11.0, own=5.4)
    assert after.busy_s - before.busy_s == pytest.approx(1.3, abs=0.02)
    assert runtime.busy_cores_elsewhere(before, after) == pytest.approx(0.9, abs=0.02)
    assert runtime.busy_cores_elsewhere(after, before) == 0.0, "a clock that did not move counts nothing"


def test_the_threads_are_the_free_cores_shared_among_the_processes(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime, "available_cores", lambda: 4)
    assert runtime.cpu_threads(busy_elsewhere=0.1) == 4, "background noise takes no core"
    assert runtime.cpu_threads(busy_elsewhere=1.0) == 3, "a busy loop takes one"
    assert runtime.cpu_threads(busy_elsewhere=0.5) == 3, "a core shared half the time stalls every step"
    assert runtime.cpu_threads(busy_elsewhere=6.5) == 1, "never fewer than one"
    assert runtime.cpu_threads(processes=2, busy_elsewhere=0.0) == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert runtime.cpu_threads(busy_elsewhere=6.5) == 3, "a count fixed outside is kept"


def test_training_sets_torch_s_threads_before_each_step_from_the_step_before(monkeypatch):
    """`CpuThreads` (the warm start's and GRPO's trainers): the cores other processes kept busy during
    the last step leave this many threads for the next; none of it where OMP_NUM_THREADS fixes them."""
    import torch

    from lib.training.callbacks import CpuThreads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime, "available_cores", lambda: 2)
    snapshots = iter(
        [
            runtime.CpuSnapshot(0.0, 0.0, 0.0),
            runtime.CpuSnapshot(1.0, 2.0, 1.0),  # a step beside a busy loop: 1 core of 2 elsewhere
            runtime.CpuSnapshot(2.0, 3.0, 2.0),  # a step alone
        ]
    )
    monkeypatch.setattr("lib.training.callbacks.cpu_snapshot", lambda: next(snapshots))
    monkeypatch.setattr(runtime, "busy_cores_elsewhere", lambda: 0.0)  # the first step's: no wait in a test
    threads = torch.get_num_threads()
    try:
        callback = CpuThreads()
        callback.on_train_begin(None, None, None)
        assert torch.get_num_threads() == 2
        callback.on_step_begin(None, None, None)
        assert torch.get_num_threads() == 1
        callback.on_step_begin(None, None, None)
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        pinned = CpuThreads()
        pinned.on_train_begin(None, None, None)
        assert pinned.last is None, "off where the count is fixed"
    finally:
        torch.set_num_threads(threads)


ALLOCATIONS = """
import ctypes, sys
import numpy as np
from lib.runtime import keep_freed_memory
class MallInfo2(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    _fields_ = [(name, ctypes.c_size_t) for name in names.split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
tuned = keep_freed_memory() if sys.argv[1] == "tuned" else None
block = np.ones(24 * 1024 * 1024 // 8)  # 24 MiB, as a decoding pass's layer cache for a batch
print(tuned, libc.mallinfo2().hblkhd)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux")
def test_megabyte_blocks_come_from_the_heap_not_fresh_mappings():
    """`keep_freed_memory`: a block of megabytes (a decoding pass's caches) comes from the heap, which
    keeps and reuses what is freed, not from a fresh mapping the kernel must zero-fill each time: under
    glibc's defaults a 24 MiB block is mapped on its own (glibc's `mallinfo2().hblkhd`), tuned it is not."""
    mapped = {}
    for mode in ("default", "tuned"):
        out = subprocess.run(
            [sys.executable, "-c", ALLOCATIONS, mode], capture_output=True, text=True, check=True
        ).stdout.split()
        mapped[mode] = int(out[1])
        if mode == "tuned":
            assert out[0] == "True", "glibc took the settings"
    block = 24 * 1024 * 1024
    assert mapped["default"] >= block, mapped
    assert mapped["tuned"] < block, mapped
