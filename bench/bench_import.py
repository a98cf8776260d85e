"""How long `import cernenv` takes, in fresh processes, and what it loads.

    make bench-import     # or: python bench/bench_import.py --runs 7

Each run is a new interpreter that times `import cernenv` alone (the interpreter's own start-up
is not counted); the median of the runs is the figure, printed with every run and the machine's
load (the 1-minute load average) before and after, since a busy machine imports slower. It also
names the heavy modules the import pulled in (none is expected: the physics' compiled kernels and
scipy's optimiser load on the first step that needs them). Target: under 1 s on 2 cores at load 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

TARGET_S = 1.0
HEAVY = ("numba", "scipy.optimize", "iminuit", "torch", "transformers", "fastapi", "gradio", "lib")
PROBE = f"""
import json, sys, time
start = time.perf_counter()
import cernenv
seconds = time.perf_counter() - start
print(json.dumps({{"seconds": seconds, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def load() -> str:
    return f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "?"


def one_run() -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--runs", type=int, default=5, help="fresh interpreters to time (default 5)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    before = load()
    one_run()  # a first import writes the bytecode caches: not counted
    runs = [one_run() for _ in range(args.runs)]
    seconds = [run["seconds"] for run in runs]
    median = statistics.median(seconds)
    heavy = sorted({module for run in runs for module in run["heavy"]})
    print(f"import cernenv: median {median:.3f} s of {args.runs} runs ({', '.join(f'{s:.3f}' for s in seconds)})")
    print(f"load average (1 min): {before} before, {load()} after; {os.cpu_count()} CPUs")
    print(f"heavy modules loaded by the import: {', '.join(heavy) if heavy else 'none'}")
    verdict = "within" if median < TARGET_S else "over"
    print(f"{verdict} the {TARGET_S:g} s target (on 2 cores at load <= 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
