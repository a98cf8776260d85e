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


def _minutes(text: str) -> float:
    """'3 min 7 s', '41 min', '58 s' or '1.5' (minutes) as minutes."""
    minutes = re.search(r"(\d+(?:\.\d+)?) ?min", text)
    seconds = re.search(r"(\d+) ?s\b", text)
    if not minutes and not seconds:
        return float(text)
    return (float(minutes.group(1)) if minutes else 0.0) + (int(seconds.group(1)) / 60 if seconds else 0.0)


def test_each_rounded_range_holds_its_rows_bold_measurements():
    """The rounded table is read from the measured rows below it: every figure a row sets in bold
    (the idle measurements) lies within its command's rounded range: at most its upper end, and at
    least its lower end less the 15 s a figure may be rounded up by."""
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    measured = text[text.index("| command | measured |") :].split("\n\n", 1)[0].splitlines()[2:]
    checked = 0
    for command, rounded in _rounded().items():
        span = re.fullmatch(r"(\d+(?:\.\d+)?)-(\d+(?:\.\d+)?) min", rounded)
        if span is None:  # "~15 s": a single figure, not a range
            continue
        low, high = float(span.group(1)), float(span.group(2))
        rows = [row for row in measured if row.startswith(f"| `{command}`")]
        assert rows, f"{command}: a rounded time with no measured row"
        for figure in re.findall(r"\*\*([^*]+)\*\*", " ".join(rows)):
            value = _minutes(figure)
            assert low - 0.25 <= value <= high, f"{command}: **{figure}** measured, the table rounds to {rounded}"
            checked += 1
    assert checked >= 5, "the bold idle figures of setup, the smoke run, the tests and the full run"
