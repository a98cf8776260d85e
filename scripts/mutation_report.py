"""The kill rate of a mutmut run (`make mutants`), per file and per function, from mutants/*.meta.

    python scripts/mutation_report.py [--functions PATTERN ...] [--survivors]

A mutant is killed when a test failed (mutmut's exit codes 1 and 3) or timed out; it survived when
every test that calls its function passed; "no tests" when no selected test calls it; mutants not
yet run (a run stopped early, or one given mutant names) are counted apart and left out of the rate.
`--functions` keeps the mutants whose name matches one of the fnmatch patterns (the grading path of
cernenv/environment.py: '*CERNCollisionEnvironment*_grade*').
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from collections import Counter
from pathlib import Path

KILLED = {1, 3, 24, -24, 36, 152, 255}
SURVIVED = {0}
NO_TESTS = {5, 33}


def status(code) -> str:
    if code is None:
        return "not run"
    if code in KILLED:
        return "killed"
    if code in SURVIVED:
        return "survived"
    if code in NO_TESTS:
        return "no tests"
    return "other"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--mutants", default="mutants", help="mutmut's folder")
    parser.add_argument("--functions", nargs="*", default=None, help="fnmatch patterns of mutant names to keep")
    parser.add_argument("--survivors", action="store_true", help="list the surviving mutants' names")
    args = parser.parse_args(argv)
    root = Path(args.mutants)
    metas = sorted(root.rglob("*.py.meta"))
    if not metas:
        print(f"no mutmut results under {root}/: run `make mutants` first", file=sys.stderr)
        return 1
    print("| file | mutants run | killed | survived | no tests | kill rate |")
    print("|---|---|---|---|---|---|")
    survivors = []
    for meta in metas:
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        if args.functions is not None:
            codes = {k: v for k, v in codes.items() if any(fnmatch.fnmatch(k, p) for p in args.functions)}
        counts = Counter(status(code) for code in codes.values())
        run = sum(counts[s] for s in ("killed", "survived", "no tests", "other"))
        if not run:
            continue
        rate = counts["killed"] / run
        name = str(meta.relative_to(root))[: -len(".meta")]
        print(f"| {name} | {run} | {counts['killed']} | {counts['survived']} | {counts['no tests']} | {rate:.1%} |")
        survivors += sorted(k for k, v in codes.items() if status(v) in ("survived", "no tests", "other"))
    if args.survivors:
        print()
        print("\n".join(survivors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
