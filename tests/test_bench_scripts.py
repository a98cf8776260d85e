"""The benchmark scripts' command lines parse (they are not run by the suite: `make bench*`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(  # the scripts with a command line (bench_physics.py takes none: it would run)
    path.name
    for path in (ROOT / "bench").glob("*.py")
    if any(call in path.read_text() for call in ("parse_args(", "parse_known_args(", "parse_train_config("))
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_parses(script):
    """`--help` builds the whole parser: a flag defined twice (bench_generate's --max-turns beside
    TrainConfig's --max_turns, which the parser also spells with a dash) fails here."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage" in result.stdout.lower()
