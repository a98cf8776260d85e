"""The runtime check of notebook 03 (lib/runtime.py): on Colab without a GPU it stops and says what to
do, instead of starting the CPU stand-in's half-hour run without a word."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import nbformat
import pytest

from lib import runtime
from lib.runtime import CPU_STAND_IN_TIMES, SWITCH_TO_GPU, CpuRuntimeError, Runtime, check_training_runtime

ROOT = Path(__file__).resolve().parents[1]


def test_a_colab_cpu_runtime_stops_and_says_how_to_switch_or_how_long_the_stand_in_takes(capsys):
    with pytest.raises(CpuRuntimeError) as stopped:
        check_training_runtime(Runtime(colab=True, gpus=[], cpu_cores=2))
    message = str(stopped.value)
    assert SWITCH_TO_GPU in message and "ALLOW_CPU = True" in message and CPU_STAND_IN_TIMES in message
    assert re.search(r"\d+ min", message) and "2026-11-26" in message, "the time, with its date and machine"
    check_training_runtime(Runtime(colab=True, gpus=[], cpu_cores=2), allow_cpu=True)
    assert "no GPU: the CPU stand-in (cernenv-tiny) trains" in capsys.readouterr().out
    check_training_runtime(Runtime(colab=False, gpus=[], cpu_cores=2))  # a laptop: told, not stopped
    gpu = check_training_runtime(Runtime(colab=True, gpus=["Tesla T4 (15 GiB)"], cpu_cores=2))
    assert gpu.gpu and "Tesla T4 (15 GiB)" in capsys.readouterr().out


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
