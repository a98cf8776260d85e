"""Which code is running: the git commit of the checkout and whether its source has uncommitted
changes. The scored runs of the server record it (`cernenv.server.runs`), and so do the
notebooks' headless runs (`lib.notebooks.reproduce`)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
"""The checkout this package runs from (an editable install), or the folder holding the installed package."""


def source_revision(root: Path = ROOT, ignore: Sequence[str] = ()) -> Dict[str, Any]:
    """{"commit", "dirty"} of the git checkout at `root`: its commit, and whether tracked files
    outside the folders in `ignore` changed since; None for both where `root` is not a checkout
    (an installed package, a container) or git cannot tell."""
    root = Path(root)
    if not (root / ".git").exists():  # not the folder of an enclosing repository (a venv inside one)
        return {"commit": None, "dirty": None}

    def git(*arguments: str) -> Optional[str]:
        try:
            return subprocess.run(
                ["git", "-C", str(root), *arguments], capture_output=True, text=True, check=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    excluded = [f":!{folder}" for folder in ignore]
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", *excluded)
    return {"commit": commit, "dirty": None if status is None else bool(status)}
