"""How the server grades: its mode, its evaluation secret, and the results ledger.

Two modes (`ServerConfig.mode`):

- `evaluation` (the default): every episode is drawn with an evaluation secret the server
  holds, every reset draws a fresh hidden world (`CERNCollisionEnvironment(fresh_worlds=True)`),
  and grades never cross the wire (`withhold_grades=True`): each ended episode's grade and
  truth go to the operator's results ledger instead (`cernenv.server.ledger`, one typed JSON line
  each); an operator may open a scored run there (`cernenv.server.runs`).
- `training`: public, replayable worlds (the seed's, or the secret's when one is given) and
  rewards served as in process, for reinforcement learning against the server. Not for scoring
  anyone: whoever plays it can read every grade and replay any seed.

The secret comes from `--secret-salt-file` (or CERNENV_SECRET_SALT); without one, evaluation
mode generates one on first use into `secret_path(state_dir())` and reuses it afterwards.
The state directory is the user's (`$CERNENV_STATE_DIR`, else `$XDG_STATE_HOME/cernenv`, else
`~/.local/state/cernenv`), not the repository: the server also runs from an installed package
(the container, pip), and a file outside every working tree cannot be committed by accident.
Only the secret's fingerprint (`fingerprint`) is ever printed or served.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Mapping, Optional

MODES = ("evaluation", "training")
SECRET_FILE = "evaluation.secret"
LEDGER_FILE = "results.jsonl"
RUNS_DIR = "runs"
"""The state directory's folder of scored runs' ledgers (RUN_ID.jsonl) and reveals (RUN_ID.reveal.json)."""


def state_dir(environ: Optional[Mapping[str, str]] = None) -> Path:
    """Where the server keeps what it generates (the secret, the ledger): CERNENV_STATE_DIR,
    else $XDG_STATE_HOME/cernenv, else ~/.local/state/cernenv."""
    environ = os.environ if environ is None else environ
    if environ.get("CERNENV_STATE_DIR"):
        return Path(environ["CERNENV_STATE_DIR"]).expanduser()
    base = environ.get("XDG_STATE_HOME") or os.path.join(environ.get("HOME") or Path.home(), ".local", "state")
    return Path(base).expanduser() / "cernenv"


def secret_path(directory: Path) -> Path:
    return directory / SECRET_FILE


def ledger_path(directory: Path) -> Path:
    return directory / LEDGER_FILE


def fingerprint(secret: str) -> str:
    """A public name for `secret`: the first 16 hex digits of its SHA-256 (as
    `lib.measure.evaluation.EvaluationKey.fingerprint` names its keys). It tells which secret a server
    holds (announce it before an evaluation, reveal the secret after) and nothing about it."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()[:16]


def private_path_problem(path: Path, info: os.stat_result, *, directory: bool) -> Optional[str]:
    """Why `path` (as `info` describes it, not following links) cannot hold this server's secret
    or ledger, or None: it must be a real directory or regular file (not a link, a FIFO, a
    device), owned by this user, and writable by nobody else."""
    kind = "directory" if directory else "regular file"
    if not (stat.S_ISDIR(info.st_mode) if directory else stat.S_ISREG(info.st_mode)):
        return f"{path} is not a {kind} (a link, a FIFO or a device planted there?)"
    if info.st_uid != os.getuid():
        return f"{path} belongs to user {info.st_uid}, not to this server's user {os.getuid()}"
    if info.st_mode & 0o022:
        return f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def private_dir(directory: Path) -> Path:
    """`directory`, made (0700) if missing; an OSError that says what to do when another user
    could have planted it or what is in it (`private_path_problem`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    problem = private_path_problem(directory, os.lstat(directory), directory=True)
    if problem:
        raise OSError(
            f"{problem}: the server keeps its secret and ledger only in a folder of its own; "
            "remove it or choose another with CERNENV_STATE_DIR"
        )
    return directory


def open_private_file(path: Path, flags: int) -> int:
    """`os.open(path, flags)` that never follows a link nor blocks on a FIFO, made 0600 if new; an
    OSError that says what is wrong when the file is not this user's own regular file, and a
    file other users could read made private."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO nobody reads
            kind = "a symbolic link" if error.errno == errno.ELOOP else "a FIFO"
            raise OSError(f"{path} is {kind}, not a regular file: remove it, or give another path") from None
        raise
    try:
        info = os.fstat(fd)
        problem = private_path_problem(path, info, directory=False)
        if problem:
            raise OSError(f"{problem}: remove it, or give another path")
        if info.st_mode & 0o044:
            os.fchmod(fd, 0o600)  # it holds grades and truths (or the secret): this user's only
    except BaseException:
        os.close(fd)
        raise
    return fd


def generated_secret(path: Path) -> str:
    """The secret in `path`, made there first if the file does not exist: 32 random bytes
    (URL-safe base64), readable by this user only. Two servers starting at once get the same
    one (the file appears whole, by a hard link, or not at all)."""
    private_dir(path.parent)
    if not os.path.lexists(path):
        handle, temporary = tempfile.mkstemp(prefix=".secret-", dir=path.parent)
        try:
            os.fchmod(handle, 0o600)
            os.write(handle, (secrets.token_urlsafe(32) + "\n").encode("ascii"))
            os.close(handle)
            try:
                os.link(temporary, path)
            except FileExistsError:  # another server made it first: use that one
                pass
        finally:
            os.unlink(temporary)
    fd = open_private_file(path, os.O_RDONLY)
    with os.fdopen(fd, encoding="utf-8") as handle:
        secret = handle.read(4096).strip()
    if not secret:
        raise ValueError(f"{path} is empty: delete it to have a new secret generated, or write one in it")
    return secret
