"""One place for each timing: docs/benchmarks.md. The README's quick start quotes its rounded table,
and `make help` quotes no time of its own."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIME = re.compile(r"~?\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?(?:min|s|h)\b")


def _rounded() -> dict:
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    table = text[text.index("| command | rounded |") :].split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]
    return {command.strip("`"): rounded for command, rounded in rows}


def _quoted_in_readme() -> dict:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    quoted = {}
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.splitlines():
            command, _, comment = line.partition("#")
            found = TIME.findall(comment)
            if found:
                quoted[command.strip()] = found
    return quoted


def test_the_readme_s_times_are_docs_benchmarks_md_s_rounded_table():
    rounded, quoted = _rounded(), _quoted_in_readme()
    assert quoted, "the quick start's times"
    for command, times in quoted.items():
        assert command in rounded, f"{command}: a time in the README with no row in docs/benchmarks.md's table"
        assert times == [rounded[command]], f"{command}: the README says {times}, docs/benchmarks.md {rounded[command]}"


def test_make_help_quotes_no_time():
    shown = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True)
    assert shown.returncode == 0 and "reproduce" in shown.stdout
    assert not [line for line in shown.stdout.splitlines() if TIME.search(line)], "a time in make help"
