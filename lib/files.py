"""Writing files so that a kill at any moment loses nothing and leaves nothing behind.

`atomic_write` writes through a temporary file in the target's folder and renames it over
the target: a reader sees the old file or the new one, never half of one. A writer killed
mid-write (SIGKILL: no cleanup runs) leaves its temporary file; the next write to the same
target sweeps the ones whose writer is no longer alive (the writer's pid is in the name, so
a live concurrent writer's file is left alone). The result gets the mode the umask gives a
new file (mkstemp alone would leave it 0600).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Callable, Union


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()
"""What open() would give a new file under this process's umask."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep_stale_temporaries(path: Path) -> int:
    """Remove temporary files of `atomic_write(path, ...)` left by writers that died; returns how many."""
    path = Path(path)
    if not path.parent.is_dir():
        return 0
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(\d+)\.[^.]+\.tmp$")
    removed = 0
    for candidate in path.parent.iterdir():
        match = pattern.match(candidate.name)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            candidate.unlink(missing_ok=True)
            removed += 1
    return removed


def atomic_write(path: Union[str, Path], write: Union[str, bytes, Callable[[str], None]]) -> Path:
    """Replace `path` with new content: text, bytes, or `write(tmp_path)` that writes the file
    (e.g. a figure's savefig). Durable (fsync) before the rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        if callable(write):
            os.close(fd)
            write(tmp)
        else:
            with os.fdopen(fd, "wb") as handle:
                handle.write(write.encode("utf-8") if isinstance(write, str) else write)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
