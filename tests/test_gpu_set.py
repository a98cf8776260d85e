"""Installing the GPU training set keeps the machine's own torch (lib/gpu_set.py, notebook 03 on Colab)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from lib import gpu_set

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def a_gpu(monkeypatch):
    """These tests play a GPU machine (the GPU set is refused without one): nvidia-smi lists a T4."""
    monkeypatch.setattr("lib.runtime.visible_gpus", lambda: ["Tesla T4 (15 GiB)"])


def _pins(path: Path) -> dict:
    """{name: version} of the `name==version` lines of a requirements file."""
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==([^\s#;]+)", line.strip())
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2)
    return pins


def _installed(name: str):
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@pytest.mark.slow
def test_the_gpu_set_resolves_beside_the_installed_torch_without_replacing_it(tmp_path):
    """pip's own resolver, asked by the package registry (a dry run, nothing installed): with the
    installed torch held, the GPU set resolves to requirements-gpu.txt's exact pins, moves no
    installed package of the torch stack and brings no CUDA libraries of its own; a torchvision
    it adds (unsloth asks for one; Colab has its own) is the build for the installed torch
    (a triton it adds is one a CUDA torch would have brought: this CPU torch has none).
    Without the constraint the same resolution replaced torch 2.13.0 by 2.14.1 with 18 CUDA
    wheels (lib/gpu_set.py)."""
    report = tmp_path / "report.json"
    result = gpu_set.install_gpu_set(dry_run=True, report=report, force=True)
    planned = {name.replace("_", "-"): version for name, version in result["planned"].items()}
    kept = result["kept"]
    assert "torch" in kept and "torch" not in planned
    assert not set(planned) & set(kept), f"kept packages would move: {planned}"
    assert not [name for name in planned if name.startswith(("nvidia-", "cuda-"))]
    for item in json.loads(report.read_text())["install"]:
        if item["metadata"]["name"].lower() in ("torchvision", "torchaudio"):
            needs = [r for r in item["metadata"].get("requires_dist", []) if re.match(r"torch\b", r)]
            assert needs and all(kept["torch"].split("+")[0] in r for r in needs), (item["metadata"]["name"], needs)
    for name, version in _pins(ROOT / "requirements-gpu.txt").items():
        assert planned.get(name, _installed(name)) == version, name


def test_constraints_hold_each_package_at_its_installed_build():
    pins = {"torch": "2.9.0+cu126", "triton": "3.5.0"}
    assert gpu_set.constraints_text(pins) == "torch==2.9.0+cu126\ntriton==3.5.0\n"
    assert gpu_set.moved_packages(pins, dict(pins)) == []
    assert gpu_set.moved_packages(pins, {"torch": "2.14.1"}) == [
        "torch: 2.9.0+cu126 -> 2.14.1",
        "triton: 3.5.0 -> removed",
    ]


def test_a_torch_that_moves_anyway_is_an_error(monkeypatch):
    versions = iter([{"torch": "2.9.0+cu126"}, {"torch": "2.14.1"}])
    monkeypatch.setattr(gpu_set, "installed_torch_stack", lambda names=gpu_set.TORCH_STACK: next(versions))
    monkeypatch.setattr(gpu_set.subprocess, "run", lambda command: subprocess.CompletedProcess(command, 0))
    with pytest.raises(RuntimeError, match=r"changed the machine's torch stack: torch: 2.9.0\+cu126 -> 2.14.1"):
        gpu_set.install_gpu_set()


def test_without_torch_the_error_says_to_install_the_machine_s_build_first(monkeypatch):
    monkeypatch.setattr(gpu_set, "installed_torch_stack", lambda names=gpu_set.TORCH_STACK: {})
    monkeypatch.setattr(gpu_set.subprocess, "run", lambda command: pytest.fail("pip must not run"))
    with pytest.raises(RuntimeError, match="install the torch build for this machine's CUDA first"):
        gpu_set.install_gpu_set()


def test_a_failing_pip_is_an_error_that_names_what_was_kept(monkeypatch):
    monkeypatch.setattr(gpu_set, "installed_torch_stack", lambda names=gpu_set.TORCH_STACK: {"torch": "2.9.0"})
    monkeypatch.setattr(gpu_set.subprocess, "run", lambda command: subprocess.CompletedProcess(command, 1))
    with pytest.raises(RuntimeError, match=r"beside this machine's torch==2.9.0 \(exit 1"):
        gpu_set.install_gpu_set()


def test_notebook_03_installs_the_gpu_set_holding_colab_s_torch(tmp_path):
    """Notebook 03's install cell as Colab runs it: one pip call, on requirements-gpu.txt, with a
    constraints file that pins the installed torch (read while pip would run: it is temporary)."""
    cells = [c.source for c in nbformat.read(ROOT / "notebooks" / "03_train_grpo.ipynb", as_version=4).cells]
    source = next(s for s in cells if "requirements-gpu.txt" in s and "MOUNT_DRIVE" in s)
    driver = f"""
import subprocess, sys, types
from pathlib import Path
sys.modules["google"] = types.ModuleType("google")
sys.modules["google.colab"] = types.ModuleType("google.colab")
calls = []
def run(command, *args, **kwargs):
    calls.append((command, Path(command[command.index("-c") + 1]).read_text()))
    return subprocess.CompletedProcess(command, 0)
subprocess.run = run
import lib.runtime
lib.runtime.visible_gpus = lambda: ["Tesla T4 (15 GiB)"]  # a Colab GPU runtime
runtime = types.SimpleNamespace(gpu=True)  # what the notebook's runtime check found
namespace = {{"ROOT": Path({str(ROOT)!r}), "sys": sys, "subprocess": subprocess, "runtime": runtime}}
exec({source!r}, namespace)
[(command, constraints)] = calls
print(command[command.index("-r") + 1])
print(constraints, end="")
"""
    out = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    requirements, *constraints = out.stdout.splitlines()
    assert Path(requirements) == ROOT / "requirements-gpu.txt"
    assert f"torch=={_installed('torch')}" in constraints


def test_the_gpu_set_is_refused_without_a_gpu_unless_forced(monkeypatch, capsys):
    """`python -m lib.gpu_set --dry-run` used to plan Unsloth on a machine without a GPU without a word."""
    monkeypatch.setattr("lib.runtime.visible_gpus", lambda: [])
    ran = []
    monkeypatch.setattr(gpu_set.subprocess, "run", lambda *a, **k: ran.append(a))
    with pytest.raises(gpu_set.NoGpuError, match="no GPU here .* requirements.txt is the set"):
        gpu_set.install_gpu_set(dry_run=True)
    assert gpu_set.main(["--dry-run"]) == 1 and ran == [], "pip was not asked"
    assert capsys.readouterr().err.startswith("error: no GPU here")
