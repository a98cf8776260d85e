"""How the server grades: its mode, its evaluation secret, and the results ledger.

Two modes (`ServerConfig.mode`):

- `evaluation` (the default): every episode is drawn with an evaluation secret the server
  holds, every reset draws a fresh hidden world (`CERNCollisionEnvironment(fresh_worlds=True)`),
  and grades never cross the wire (`withhold_grades=True`): each ended episode's grade and
  truth go to the operator's results ledger instead (`ResultsLedger`, one JSON line each).
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

import datetime
import hashlib
import json
import os
import secrets
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

MODES = ("evaluation", "training")
SECRET_FILE = "evaluation.secret"
LEDGER_FILE = "results.jsonl"


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


def generated_secret(path: Path) -> str:
    """The secret in `path`, made there first if the file does not exist: 32 random bytes
    (URL-safe base64), readable by this user only. Two servers starting at once get the same
    one (the file appears whole, by a hard link, or not at all)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
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
    secret = path.read_text(encoding="utf-8").strip()
    if not secret:
        raise ValueError(f"{path} is empty: delete it to have a new secret generated, or write one in it")
    return secret


class ResultsLedger:
    """The operator's record of an evaluation: one JSON object per line, per ended episode
    (graded, or abandoned unfinished), appended with one `write` on a file opened O_APPEND, so a
    line is whole or absent, never interleaved with another. The file is readable by this user
    only. See `ServedEnvironment._record` for the fields."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lock = threading.Lock()

    def append(self, record: Dict[str, Any]) -> None:
        text = json.dumps({"ended_at": _utc_now(), **record}, sort_keys=True, default=_plain, allow_nan=False)
        line = (text + "\n").encode("utf-8")
        with self._lock:
            written = os.write(self._fd, line)
        if written != len(line):  # a full disk: say so (the line is cut, and the next starts on its own line)
            raise OSError(f"results ledger {self.path}: wrote {written} of {len(line)} bytes")

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def read_ledger(path: Path) -> list:
    """The ledger's records, in order (for operators and tests)."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _plain(value: Any) -> Any:
    """A numpy scalar as the plain JSON value it holds (`numpy.bool_` → true/false, never "True");
    anything else a ledger record should not hold is a TypeError, not its `str`."""
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        return item()
    raise TypeError(f"a results-ledger record holds plain JSON values, not {type(value).__name__}")


def _utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
