"""Print requirements.txt with the GPU set's pins (requirements-gpu.txt) in place of its own,
less the packages that cannot install or import without a GPU: what `make test-gpu-set`
installs on a CPU machine to run the GPU set's CPU-checkable tests."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_ONLY = {"unsloth", "unsloth-zoo"}  # import unsloth raises NotImplementedError without a GPU


def _name(line: str) -> str:
    return re.split(r"[=<>!~\[; ]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")


def requirements(path: Path) -> list[str]:
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines() if line.split("#", 1)[0].strip()]


def main() -> int:
    gpu = {_name(line): line for line in requirements(ROOT / "requirements-gpu.txt")}
    lines = [gpu.pop(_name(line), line) for line in requirements(ROOT / "requirements.txt")]
    lines += list(gpu.values())  # GPU-set packages the CPU set does not list
    print("\n".join(line for line in lines if _name(line) not in GPU_ONLY))
    return 0


if __name__ == "__main__":
    sys.exit(main())
