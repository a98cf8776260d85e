"""Installing the GPU training set (requirements-gpu.txt) beside the machine's own CUDA torch.

A GPU machine (Colab, a CUDA workstation) comes with a torch built for its CUDA driver.
requirements-gpu.txt never names torch, but its packages pull one in: unsloth asks for
`torchvision` and `triton`, xformers for `torch>=2.10`, and pip satisfies them with the newest
releases, which replace the machine's torch (measured on 2026-11-25 with `pip install --dry-run
--report` over an installed torch 2.13.0: pip planned torch 2.14.1, torchvision 0.29.1 and 18
NVIDIA and CUDA 13 wheels). `install_gpu_set` pins whatever torch, torchvision, torchaudio and
triton are installed as constraints, so pip picks the releases of the other packages that fit
them, and checks afterwards that none of them moved.

    python -m lib.gpu_set                # install (notebook 03 does this on Colab)
    python -m lib.gpu_set --dry-run      # only resolve, and print what pip would install
    python -m lib.gpu_set --force ...    # on a machine without a GPU too

It refuses a machine without an NVIDIA GPU (`lib.runtime.visible_gpus`: none listed by
nvidia-smi) unless forced: there Unsloth cannot even be imported, and the CPU's set is
requirements.txt (`make setup`). Nothing here imports torch: the versions come from the
installed distributions' metadata.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS_GPU = ROOT / "requirements-gpu.txt"

TORCH_STACK = ("torch", "torchvision", "torchaudio", "triton")
"""Packages built together for one CUDA version: the machine's are kept as they are."""


def installed_torch_stack(names: Sequence[str] = TORCH_STACK) -> Dict[str, str]:
    """{name: version} of the `names` installed in this Python environment."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def constraints_text(pins: Dict[str, str]) -> str:
    """pip constraints that hold each package at its installed version (local labels such as
    `+cu126` included: the machine's own build)."""
    return "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def moved_packages(before: Dict[str, str], after: Dict[str, str]) -> List[str]:
    """'name: old -> new' for each package of `before` whose version is not the same `after`."""
    return [
        f"{name}: {version} -> {after.get(name, 'removed')}"
        for name, version in sorted(before.items())
        if after.get(name) != version
    ]


def pip_install_command(requirements: Path, constraints: Path, *, report: Optional[Path] = None) -> List[str]:
    """The pip command: a dry run writing pip's installation report to `report` when given."""
    command = [sys.executable, "-m", "pip", "install", "--quiet", "-r", str(requirements), "-c", str(constraints)]
    if report is not None:
        command += ["--dry-run", "--report", str(report)]
    return command


class NoGpuError(RuntimeError):
    """The GPU set was asked for on a machine without a GPU (and not forced)."""


def install_gpu_set(
    requirements: Path = REQUIREMENTS_GPU, *, dry_run: bool = False, report: Optional[Path] = None, force: bool = False
) -> Dict[str, object]:
    """Install `requirements` keeping the installed torch stack; returns what was kept and, for a
    dry run, what pip would install ({name: version}). Raises `NoGpuError` on a machine without a
    GPU unless `force`, and RuntimeError when no torch is installed (the machine's CUDA build must
    come first), when pip fails, or when a kept package moved anyway."""
    from lib.runtime import visible_gpus

    if not force and not visible_gpus():
        raise NoGpuError(
            "no GPU here (nvidia-smi lists none): the GPU set (Unsloth) is for a CUDA machine, such as a "
            "Colab GPU runtime; on a CPU, requirements.txt is the set (`make setup`). --force (force=True) "
            "installs it anyway"
        )
    kept = installed_torch_stack()
    if "torch" not in kept:
        raise RuntimeError(
            "no torch is installed here: install the torch build for this machine's CUDA first "
            "(Colab has one; see pytorch.org), then the GPU set; requirements-gpu.txt never installs torch"
        )
    with tempfile.TemporaryDirectory() as scratch:
        constraints = Path(scratch) / "keep-torch.txt"
        constraints.write_text(constraints_text(kept))
        if dry_run and report is None:
            report = Path(scratch) / "report.json"
        done = subprocess.run(pip_install_command(Path(requirements), constraints, report=report if dry_run else None))
        if done.returncode != 0:
            raise RuntimeError(
                f"pip could not install {requirements} beside this machine's {constraints_text(kept).strip()} "
                f"(exit {done.returncode}; its message is above)"
            )
        planned = _planned(report) if dry_run else None
    moved = moved_packages(kept, installed_torch_stack(list(kept)))
    if moved:
        raise RuntimeError(f"installing the GPU set changed the machine's torch stack: {'; '.join(moved)}")
    return {"kept": kept, "planned": planned}


def _planned(report: Path) -> Dict[str, str]:
    """{name: version} of what a pip installation report says it would install."""
    install = json.loads(Path(report).read_text())["install"]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in install}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m lib.gpu_set", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--requirements", type=Path, default=REQUIREMENTS_GPU)
    parser.add_argument("--dry-run", action="store_true", help="resolve only; print what pip would install")
    parser.add_argument("--force", action="store_true", help="on a machine without a GPU too")
    args = parser.parse_args(argv)
    try:
        result = install_gpu_set(args.requirements, dry_run=args.dry_run, force=args.force)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("kept:", ", ".join(f"{name} {version}" for name, version in sorted(result["kept"].items())))
    if result["planned"] is not None:
        print("would install:", ", ".join(f"{name} {version}" for name, version in sorted(result["planned"].items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
