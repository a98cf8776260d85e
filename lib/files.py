"""Writing files so that a kill, a full disk or a second run at any moment loses nothing.

Every file under an evidence folder is written here:

- `atomic_write` writes through a temporary file in the target's folder and renames it over
  the target: a reader sees the old file or the new one, never half of one. A writer killed
  mid-write (SIGKILL: no cleanup runs) leaves its temporary file; the next write to the same
  target sweeps the ones whose writer is no longer alive (the writer's pid is in the name, so
  a live concurrent writer's file is left alone). The result gets the mode the umask gives a
  new file (mkstemp alone would leave it 0600). A full disk leaves the old file as it was and
  raises `DiskFullError`, which says so.
- `write_json` writes strict JSON (RFC 8259): a NaN or an infinity is written `null`, never
  the `NaN` token Python's json writes by default and other readers refuse. Readers here
  (`read_json`, `parse_json`: `json.loads`) accept both, and refuse a damaged file in one line
  that names the file, the line and column, and what is wrong (`JsonError`), a file nested too
  deep for Python's parser included.
- `refuse_empty` stops a result without data (an evaluation of 0 episodes) from replacing
  one that has it.
- `FolderLock` gives one live run a folder: a second run is refused with the owner's pid,
  host and start time; the lock of a process that died is taken over.
- `check_writable_dir` checks an output folder (not a file, writable, each of its names within
  the file system's limit: `long_name_problem`) before the work that would fill it.

`lib.report.evidence`'s CSV logs are the one exception to the rename: they are appended to, one
complete line per `write` under `fcntl.flock` (see that module).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import math
import os
import re
import socket
import stat
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

PROJECT_CACHE = Path(__file__).resolve().parents[1] / ".cache"
"""Where the project caches what it builds (git-ignored): the tokenizer, the stand-in, warm starts,
converted models; at the repository root, whatever the working directory (notebooks run in
notebooks/, `make train` at the root)."""

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """A write failed because the disk (or the user's quota) is full; the message names the folder."""


def disk_full_error(path: Union[str, Path], cause: Optional[BaseException] = None) -> DiskFullError:
    """The `DiskFullError` for a failed write to `path`, saying how much space is left there."""
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    try:
        import shutil

        free = f"{shutil.disk_usage(folder).free / 1e6:.1f} MB free"
    except OSError:
        free = "free space unknown"
    detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    return DiskFullError(
        errno.ENOSPC,
        f"the disk is full: writing {path} failed ({free} in {folder}); free some space "
        f"(or point the run at another disk) and run again{detail}",
    )


def is_disk_full(error: BaseException, folder: Union[str, Path, None] = None, min_free_bytes: int = 1 << 20) -> bool:
    """Whether `error` (or an error it was raised from) is a full disk: ENOSPC/EDQUOT anywhere in
    its chain, or, with `folder`, an error of any kind while `folder`'s disk has less than
    `min_free_bytes` left (torch's checkpoint writer reports a full disk as "enforce fail ...
    unexpected pos")."""
    seen = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return True
        current = current.__cause__ or current.__context__
    if folder is not None:
        import shutil

        try:
            probe = Path(folder)
            while not probe.exists() and probe != probe.parent:
                probe = probe.parent
            return shutil.disk_usage(probe).free < min_free_bytes
        except OSError:
            return False
    return False


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()
"""What open() would give a new file under this process's umask."""


def staging_folder(target: Union[str, Path]) -> Path:
    """A new empty folder beside `target` to fill, pass to `share_folder`, and then move onto it whole
    (`os.replace`)."""
    target = Path(target)
    return Path(tempfile.mkdtemp(prefix=target.name + "-", dir=target.parent))


def share_folder(folder: Union[str, Path]) -> None:
    """Give `folder` and everything in it the permissions `mkdir` and `open` give under this process's
    umask (0777 and 0666 less it): `mkdtemp`'s 0700 and the 0600 some writers give their files (a
    model's safetensors) would hide a model from every other user, the agent's own user of `make
    evaluate` among them."""
    folder = Path(folder)
    folder.chmod(0o777 & ~_umask())
    for path in folder.rglob("*"):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~_umask())


def process_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (another user's counts)."""
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
        if match and int(match.group(1)) != os.getpid() and not process_alive(int(match.group(1))):
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
    except BaseException as error:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(error, OSError) and not isinstance(error, DiskFullError) and is_disk_full(error):
            raise disk_full_error(path, error) from error
        raise
    return path


def strict_json(value: Any) -> Any:
    """`value` with every float that is not finite (NaN, ±inf) replaced by None, in dicts,
    lists and tuples at any depth; numpy scalars become Python numbers."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        value = value.item()  # numpy scalar or 0-d array
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def json_text(payload: Any, *, indent: Optional[int] = 2, **dumps: Any) -> str:
    """`payload` as strict JSON text (`strict_json`: no NaN or Infinity tokens)."""
    return json.dumps(strict_json(payload), indent=indent, allow_nan=False, **dumps)


def write_json(path: Union[str, Path], payload: Any, *, indent: Optional[int] = 2, **dumps: Any) -> Path:
    """`payload` as strict JSON (`json_text`), written atomically (`atomic_write`), ending in a newline."""
    return atomic_write(path, json_text(payload, indent=indent, **dumps) + "\n")


class JsonError(ValueError):
    """JSON text that cannot be read: where (line and column, from 1) and what is wrong; `too_deep`
    when it nests deeper than Python's parser can follow (not a file cut short)."""

    def __init__(self, problem: str, line: int, column: int, too_deep: bool = False) -> None:
        super().__init__(f"line {line}, column {column}: {problem}")
        self.problem, self.line, self.column, self.too_deep = problem, line, column, too_deep


def parse_json(text: str) -> Any:
    """`json.loads(text)`, or a `JsonError` saying where and what is wrong. Python's parser recurses
    once per level of nesting and fails with a RecursionError somewhere under `sys.getrecursionlimit()`
    levels; pydantic-core's parser then says where the nesting went past its own limit (200 levels)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise JsonError(f"not JSON ({error.msg})", error.lineno, error.colno) from None
    except RecursionError:
        pass
    from pydantic_core import from_json

    line = column = 1
    try:
        from_json(text)
    except ValueError as error:
        found = re.search(r"line (\d+) column (\d+)", str(error))
        line, column = (int(found.group(1)), int(found.group(2))) if found else (1, 1)
    raise JsonError(
        f"JSON nested too deep for Python's parser (it gives up under {sys.getrecursionlimit()} levels; the "
        "nesting passes 200 here, and the project's files nest a few)",
        line,
        column,
        too_deep=True,
    )


def read_json(path: Union[str, Path], fix: str = "restore it from where it was copied, or rerun what writes it") -> Any:
    """The JSON value in the file at `path` (UTF-8); a ValueError of one line naming the file, line
    and column and what is wrong, then `fix`, for a file that is not JSON or not UTF-8."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{path}:{line}: byte {error.start} is not UTF-8 text ({error.reason}); {fix}") from None
    try:
        return parse_json(text)
    except JsonError as error:
        raise ValueError(f"{path}:{error.line}:{error.column}: {error.problem}; {fix}") from None


NAME_MAX_BYTES = 255
"""The longest name of a file or folder, in UTF-8 bytes, where the file system does not say
(`os.pathconf`): ext4's, XFS's, APFS's and tmpfs's."""


def name_max_bytes(path: Union[str, Path]) -> int:
    """The longest file or folder name the file system that holds `path` (or its nearest existing
    folder) takes, in bytes (`os.pathconf`'s PC_NAME_MAX; `NAME_MAX_BYTES` where it cannot say)."""
    for folder in (Path(path), *Path(path).absolute().parents):
        try:
            if folder.is_dir():
                return int(os.pathconf(folder, "PC_NAME_MAX"))
        except (OSError, ValueError):
            continue
    return NAME_MAX_BYTES


def long_name_problem(path: Union[str, Path], what: str, reserve: int = 0, reserved_for: str = "") -> Optional[str]:
    """What is wrong with `path` when one of its names is longer than its file system takes
    (`name_max_bytes`), less `reserve` bytes that a name made from it adds (`reserved_for` says
    what), else None."""
    most = name_max_bytes(Path(path).parent)
    limit = most - reserve
    for part in Path(path).parts:
        size = len(part.encode("utf-8", "surrogateescape"))
        if size > limit:
            shown = part if len(part) <= 40 else part[:39] + "…"
            why = f" ({most}, less the {reserve} bytes {reserved_for})" if reserve else ""
            return f"{what} holds a name of {size} bytes ({shown!r}); a file or folder name holds at most {limit}{why}"
    return None


class EmptyResultError(ValueError):
    """A result without data that would have replaced an evidence file."""


def refuse_empty(path: Union[str, Path], count: int, what: str) -> None:
    """Raise `EmptyResultError` when `count` is 0: a result of no `what` is never written, so a
    run that played nothing (MAX_EPISODES 0, a crash before the first episode) cannot replace
    evidence that holds some. The message says whether `path` exists and is left alone."""
    if count > 0:
        return
    path = Path(path)
    kept = f"{path} is left as it was" if path.exists() else f"nothing was written to {path}"
    raise EmptyResultError(f"refusing to write {what} of 0 episodes: {kept}; run with at least one episode")


def check_writable_dir(path: Union[str, Path], what: str = "output folder") -> Path:
    """Make `path` (and its parents) if missing and check that a file can be created in it;
    returns it. Raises `NotADirectoryError` or `PermissionError` with a message that says what
    to do, before any work that would fill the folder."""
    path = Path(path)
    too_long = long_name_problem(path, f"the {what} {str(path)[:80]}")
    if too_long:
        raise OSError(errno.ENAMETOOLONG, f"{too_long}: choose a shorter path")
    blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise NotADirectoryError(
            f"the {what} {path} cannot be made: {blocking} is a file, not a folder; "
            "choose another path or move that file away"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        if is_disk_full(error):
            raise disk_full_error(path, error) from error
        raise PermissionError(
            errno.EACCES,
            f"the {what} {path} is not writable ({error.strerror or error}); "
            "choose a folder you can write to, or fix its permissions",
        ) from error
    return path


LOCK_NAME = ".run.lock"
"""The lock file a run keeps in each folder it writes (`FolderLock`)."""


class FolderLockedError(RuntimeError):
    """Another live run holds the folder; the message names it (pid, host, start time)."""


@dataclass(frozen=True)
class LockOwner:
    """Who holds a `FolderLock`: what the lock file says."""

    pid: int
    host: str
    started: str
    command: str = ""

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}" + (f" ({self.command})" if self.command else "")


def _read_owner(fd: int) -> Optional[LockOwner]:
    try:
        size = os.fstat(fd).st_size
        data = json.loads(os.pread(fd, max(size, 1), 0).decode("utf-8") or "null")
        return LockOwner(int(data["pid"]), str(data["host"]), str(data["started"]), str(data.get("command", "")))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _command_line() -> str:
    try:
        return Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200]
    except OSError:
        return ""


class FolderLock:
    """One live run's claim on a folder, as a context manager: `<folder>/.run.lock` holds the
    owner (pid, host, start time, command line) under an exclusive `fcntl.flock`, which the
    kernel releases when the process ends however it ends. A second run is refused with
    `FolderLockedError` naming the owner; a lock file whose process died (its flock is gone)
    is taken over, with a log line naming the dead owner. On a file system without flock, the
    owner's pid decides: alive on this host (or on another host: it cannot be checked) refuses,
    and a dead owner's file is taken over by one process only (`_acquire_without_flock`). The
    lock file is never followed through a link."""

    def __init__(self, folder: Union[str, Path], what: str = "folder") -> None:
        self.folder, self.what = Path(folder), what
        self.path = self.folder / LOCK_NAME
        self._fd: Optional[int] = None
        self._made_inode: Optional[int] = None  # the lock file this object made (O_EXCL)
        self.taken_over: Optional[LockOwner] = None
        """The owner of a stale lock this one replaced (a process that died), if any."""

    def _refuse(self, owner: Optional[LockOwner]) -> FolderLockedError:
        holder = owner.describe() if owner else "another process (its lock file is unreadable)"
        return FolderLockedError(
            f"the {self.what} {self.folder} is in use by a live run: {holder}. Wait for it to end, "
            f"or give this run another folder; if that run is over, delete {self.path}"
        )

    def acquire(self) -> "FolderLock":
        check_writable_dir(self.folder, self.what)
        for _ in range(50):  # the file can be replaced between open and lock: retry then
            fd = self._open()
            if fd is None:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise self._refuse(owner) from None
            except OSError:  # no flock here (some network file systems): the recorded owner decides
                return self._acquire_without_flock(fd)
            if not self._still_the_lock_file(fd):  # its holder removed it as we opened it
                os.close(fd)
                continue
            return self._own(fd, _read_owner(fd))
        raise self._refuse(None)

    def _open(self) -> Optional[int]:
        """The lock file, opened without following a link: made (O_EXCL) if missing; None if it
        vanished between the two attempts (try again)."""
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags | os.O_CREAT | os.O_EXCL, 0o644)
            self._made_inode = os.fstat(fd).st_ino
            return fd
        except FileExistsError:
            pass
        try:
            fd = os.open(self.path, flags)
        except FileNotFoundError:
            return None
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise FolderLockedError(
                    f"{self.path} is a symbolic link, not a lock file: remove it (a lock is never followed)"
                ) from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FolderLockedError(f"{self.path} is not a regular file: remove it")
        return fd

    def _still_the_lock_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _acquire_without_flock(self, fd: int) -> "FolderLock":
        """The lock where the file system has no flock: the file's recorded owner decides. A file
        that names a live owner (any owner on another host: it cannot be checked), or no owner yet
        (its maker is writing it), refuses; one whose owner died is taken over by one process
        only: under a takeover token made with O_EXCL, after reading the owner again."""
        owner = _read_owner(fd)
        if owner is None and os.fstat(fd).st_size == 0 and self._made_by_us(fd):
            return self._own(fd, None)  # this call made the file (O_EXCL): it is ours
        if owner is None or owner.host != socket.gethostname() or process_alive(owner.pid):
            os.close(fd)
            raise self._refuse(owner)
        token = self.path.with_name(self.path.name + ".takeover")
        try:
            token_fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            os.close(fd)
            raise self._refuse(owner) from None  # another process is taking it over now
        try:
            again = _read_owner(fd)
            if not self._still_the_lock_file(fd) or again != owner:
                os.close(fd)
                raise self._refuse(again)
            return self._own(fd, owner)
        finally:
            os.close(token_fd)
            os.unlink(token)

    def _made_by_us(self, fd: int) -> bool:
        return getattr(self, "_made_inode", None) == os.fstat(fd).st_ino

    def _own(self, fd: int, previous: Optional[LockOwner]) -> "FolderLock":
        import logging

        if previous is not None:
            self.taken_over = previous
            logging.getLogger(__name__).warning(
                "taking over the lock of %s: %s is no longer running", self.folder, previous.describe()
            )
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": _command_line(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode("utf-8"), 0)
        self._fd = fd
        return self

    def owner(self) -> Optional[LockOwner]:
        """What the lock file says now (None without one)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except (FileNotFoundError, OSError):
            return None
        try:
            return _read_owner(fd)
        finally:
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)  # before the flock goes: a waiting opener then sees a new inode
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
