"""The results ledger: the operator's record of an evaluation server, one typed JSON line per
event — an episode that ended (`EpisodeEnded`), a scored run opened (`RunOpened`) or ended
(`RunEnded`).

Every line is checked against its schema when it is written and when it is read (`LedgerLine`,
strict pydantic models): booleans are JSON booleans, numbers finite JSON numbers, nothing unknown.
A line that fails is an error naming the file, the line and the field (`LedgerError`), never a
silent value; `read_ledger(..., skip_damaged=True)` reads past damaged lines and says which.

Two kinds of file (`ResultsLedger`): the server's ledger of episodes played outside scored runs,
rotated by size, one writer at a time (a lock beside it), each client address's share bounded;
and a scored run's file of its own (`run_file=True`), made new, never rotated, whose lines chain:
each carries the SHA-256 of the run's previous line (`previous`, `line_sha256`), so a line
changed, inserted, removed or moved breaks the chain (`cernenv.server.audit` checks it).
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, TypeAdapter, ValidationError

from cernenv.server.evaluation import open_private_file

logger = logging.getLogger("cernenv.server")

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
"""A finite JSON number (an integer is one; a boolean, a string, NaN and infinity are not)."""


def _plain_json(value: Any, where: str = "value") -> Any:
    """`value` if it is plain JSON (objects with string keys, arrays, strings, finite numbers,
    booleans, null) at every depth; a ValueError naming where it is not."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} is {value}: a ledger holds finite numbers only")
        return value
    if isinstance(value, list):
        return [_plain_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise ValueError(f"{where} has the key {key!r}: keys are strings")
        return {key: _plain_json(item, f"{where}.{key}") for key, item in value.items()}
    raise ValueError(f"{where} is a {type(value).__name__}, not a JSON value")


PlainObject = Annotated[Dict[str, Any], Field(strict=True)]


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Grade(_Line):
    """How an ended episode was graded (`CERNCollisionEnvironment.episode_grade`)."""

    terminal_reward: Number
    components: Dict[str, Number]
    discovered: Optional[StrictBool]
    correct_outcome: StrictBool
    correct_mass: Optional[StrictBool]
    correct_channel: Optional[StrictBool]
    correct_spin: Optional[StrictBool]
    reference_z_global: Number


class EpisodeEnded(_Line):
    """An episode that ended on the server: graded by its claim or the campaign's end, or
    abandoned (`ended` starts with "abandoned": a reset, the session's end, the server's shutdown),
    which a scored run counts as a failure. `truth` is the hidden world; `run_id` and `task_index`
    place it in a scored run (None outside one)."""

    record: Literal["episode"] = "episode"
    ended_at: StrictStr
    mode: Literal["evaluation", "training"]
    secret_fingerprint: Optional[StrictStr]
    session_id: StrictStr
    client: Optional[StrictStr]
    episode_id: Optional[StrictStr]
    seed: StrictInt
    scenario: StrictStr
    difficulty: StrictStr
    world_nonce: StrictStr
    steps: StrictInt
    ended: StrictStr
    grade: Optional[Grade]
    truth: PlainObject
    episode_reward: Optional[Number] = None
    """Step rewards plus the terminal reward, as `cumulative_reward` counts it in process."""
    resources: Optional[Dict[str, Number]] = None
    """The final `resource_usage`'s numbers: budget [M$], luminosity [fb^-1], time [days], used and left."""
    claim: Optional[PlainObject] = None
    """The claim's parameters as the agent sent them (None: no claim)."""
    run_id: Optional[StrictStr] = None
    task_index: Optional[StrictInt] = None
    assignment: Optional[StrictInt] = None
    """In a scored run, the task's place in the order the server handed tasks out (0: the first reset's)."""
    actions: Optional[List[Any]] = None
    """Every action the client sent, in order, as sent (references unresolved): with the world's
    secret and `world_nonce`, what replays the episode (`cernenv.server.audit.replay_episode`)."""
    refused_actions: Optional[StrictInt] = None
    """The steps whose action was refused (a rule violation)."""
    previous: Optional[StrictStr] = None
    """In a scored run's file, the SHA-256 of the file's previous line (`line_sha256`)."""

    @property
    def abandoned(self) -> bool:
        return self.grade is None


class RunOpened(_Line):
    """A scored run the server opened: which tasks (`selection`, `n_tasks`, `tasks` in suite
    order), under which secret, by which code."""

    record: Literal["run_opened"] = "run_opened"
    opened_at: StrictStr
    run_id: StrictStr
    selection: StrictStr
    n_tasks: StrictInt
    tasks: List[PlainObject]
    secret_fingerprint: Optional[StrictStr]
    cernenv_version: StrictStr
    commit: Optional[StrictStr]
    commitment: Optional[StrictStr] = None
    """The SHA-256 of the run's commitment document (`cernenv.server.runs.commitment_of`): its tasks,
    the order they are handed out in, the secret every world is drawn with, the code. Published
    before the first reset (`GET /evaluation`); the document itself is revealed when the run ends."""
    previous: Optional[StrictStr] = None
    """None: the first line of the run's chain."""


class RunEnded(_Line):
    """The end of a scored run: every task played, or the server stopped (`reason`), with its
    counts: tasks handed out (`assigned`), episodes ended (`ended`), and of those the lines
    written (`recorded`: `graded` + `abandoned`); `previous` is the hash of the run's last line."""

    record: Literal["run_ended"] = "run_ended"
    ended_at: StrictStr
    run_id: StrictStr
    reason: StrictStr
    assigned: StrictInt
    ended: StrictInt
    recorded: Optional[StrictInt] = None
    graded: Optional[StrictInt] = None
    abandoned: Optional[StrictInt] = None
    previous: Optional[StrictStr] = None


LedgerLine = Annotated[Union[EpisodeEnded, RunOpened, RunEnded], Field(discriminator="record")]
_LINE = TypeAdapter(LedgerLine)


class LedgerError(ValueError):
    """A ledger line that is not a valid record; the message names the file, the line and the field."""


def _problem(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the line"
        more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
        return f"{where}: {first['msg']}{more}"
    return str(error)


def parse_line(text: str) -> Union[EpisodeEnded, RunOpened, RunEnded]:
    """One ledger line's record (a line written before records were typed is an episode's);
    a ValueError (pydantic's or JSON's) when it is not a valid record."""
    data = json.loads(text)
    if isinstance(data, dict):
        data.setdefault("record", "episode")
    _plain_json(data, "the line")
    return _LINE.validate_python(data)


def line_sha256(text: str) -> str:
    """The SHA-256 (hex) of one ledger line as written, without its newline: what the next line of
    a scored run's file carries as `previous`."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


LEDGER_MAX_BYTES = 256 * 2**20
"""Size [bytes] at which the ledger file is rotated (`ResultsLedger`)."""
LEDGER_ROTATED_FILES = 8
"""Rotated files kept beside it (results.jsonl.1 the newest): the ledger holds at most
(1 + LEDGER_ROTATED_FILES) x LEDGER_MAX_BYTES on disk."""
REPORT_EVERY_S = 10.0


class LedgerShareSpent(OSError):
    """A client address has written its share of the ledger (`ResultsLedger.client_max_bytes`)."""


class ResultsLedger:
    """A ledger file, appended one whole line per `append` (one `write` on a file opened
    O_APPEND, under a lock), readable by this user only.

    A record is validated before it is written (a ValueError, nothing written, if it is not
    valid). A write the disk cuts short is undone (the file is truncated back) and reported
    (OSError), so no partial line is left.

    The server's ledger (the default): one writer at a time, held by an exclusive lock on
    `<path>.lock` for the life of this object (a second server given the same file is refused
    with what to do: two writers rotating one file lose each other's lines). When the file would
    pass `max_bytes` it is rotated: results.jsonl becomes results.jsonl.1, .1 becomes .2, ...,
    keeping `rotated_files` of them (the oldest is deleted, with a warning); `read_ledger` reads
    them all, oldest first. Each client address may write at most `client_max_bytes` of episode
    lines over the object's life (default `max_bytes`, one file's worth: no one client can rotate
    the others' lines away); beyond it that address's episodes are not recorded (`LedgerShareSpent`,
    logged at a bounded rate).

    A scored run's file (`run_file=True`): created here (an existing file is refused), never
    rotated (a run's size is bounded by its tasks), no share per client (every line of a run
    counts), and its lines chain: `append` sets each record's `previous` to `line_sha256` of the
    line before (None for the first) and `last_sha256` to its own."""

    def __init__(
        self,
        path: Path,
        max_bytes: int = LEDGER_MAX_BYTES,
        rotated_files: int = LEDGER_ROTATED_FILES,
        *,
        client_max_bytes: Optional[int] = None,
        run_file: bool = False,
    ) -> None:
        self.path = Path(path)
        self.max_bytes, self.rotated_files, self.run_file = max_bytes, rotated_files, run_file
        self.client_max_bytes = None if run_file else (client_max_bytes or max_bytes)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_fd = -1
        if run_file:
            try:
                self._fd = open_private_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL)
            except FileExistsError:
                raise OSError(
                    f"{self.path} exists: a scored run's ledger is a file of its own, made when the run opens; "
                    "give a new path (or none: runs/RUN_ID.jsonl in the state directory)"
                ) from None
        else:
            self._lock_fd = _exclusive_lock(lock_path(self.path), self.path)
            try:
                self._fd = open_private_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            except BaseException:
                os.close(self._lock_fd)
                raise
        self.last_sha256: Optional[str] = None
        self._lock = threading.Lock()
        self._client_bytes: Dict[str, int] = {}
        self._failed, self._last_report = 0, -REPORT_EVERY_S

    def append(self, record: Dict[str, Any]) -> Union[EpisodeEnded, RunOpened, RunEnded]:
        """Validate `record` (in a run's file, with `previous` set) and append it; the typed record written."""
        with self._lock:
            if self.run_file:
                record = {**record, "previous": self.last_sha256}
            text = json.dumps(record, sort_keys=True, default=_plain_scalar, allow_nan=False)
            try:
                typed = parse_line(text)
            except ValueError as error:
                raise ValueError(f"not a valid results-ledger record: {_problem(error)}") from None
            data = (text + "\n").encode("utf-8")
            client = typed.client if isinstance(typed, EpisodeEnded) and typed.client else "unknown"
            if self.client_max_bytes is not None and isinstance(typed, EpisodeEnded):
                spent = self._client_bytes.get(client, 0)
                if spent + len(data) > self.client_max_bytes:
                    raise LedgerShareSpent(
                        f"client {client} has written {spent} bytes of episode lines, its share of "
                        f"{self.client_max_bytes}: its further episodes are not recorded (--ledger-max-mib sets both)"
                    )
            size = os.fstat(self._fd).st_size
            if not self.run_file and size > 0 and size + len(data) > self.max_bytes:
                self._rotate()
                size = 0
            try:
                written = os.write(self._fd, data)
            except OSError:
                written = -1
            if written != len(data):
                os.ftruncate(self._fd, size)  # no partial line: the next one starts clean
                raise OSError(f"results ledger {self.path}: the line could not be written whole (is the disk full?)")
            if self.run_file:
                self.last_sha256 = line_sha256(text)
            elif isinstance(typed, EpisodeEnded):
                self._client_bytes[client] = self._client_bytes.get(client, 0) + len(data)
        return typed

    def append_or_report(self, record: Dict[str, Any]) -> bool:
        """`append`, for the server: a record that cannot be written is logged, at most one line
        every `REPORT_EVERY_S` with the count since the last (a full disk must not flood the log);
        False then. The session that ended the episode goes on either way."""
        try:
            self.append(record)
            return True
        except (OSError, ValueError) as error:
            with self._lock:
                self._failed += 1
                now = time.monotonic()
                if now - self._last_report < REPORT_EVERY_S:
                    return False
                failed, self._failed, self._last_report = self._failed, 0, now
            logger.error("could not record %d ended episode(s) in the results ledger: %s", failed, error)
            return False

    def _rotate(self) -> None:
        """results.jsonl → .1 → .2 ... (the oldest past `rotated_files` deleted), and a new file."""
        oldest = rotated_path(self.path, self.rotated_files)
        if oldest.exists():
            logger.warning("results ledger: deleting %s, the oldest of %d rotated files", oldest, self.rotated_files)
        for index in range(self.rotated_files, 0, -1):
            source = self.path if index == 1 else rotated_path(self.path, index - 1)
            if source.exists():
                os.replace(source, rotated_path(self.path, index))
        os.close(self._fd)
        self._fd = open_private_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if self._lock_fd >= 0:
                os.close(self._lock_fd)  # releases the lock
                self._lock_fd = -1


def lock_path(path: Path) -> Path:
    """The file whose lock says which process writes the ledger `path` (it outlives rotations)."""
    return Path(path).with_name(Path(path).name + ".lock")


def _exclusive_lock(lock: Path, ledger: Path) -> int:
    """An open descriptor of `lock` holding its exclusive lock; an OSError that says what to do when
    another process holds it."""
    fd = open_private_file(lock, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise OSError(
            f"the results ledger {ledger} is being written by another process (another server with the same "
            "state directory or --results-ledger?): two writers would rotate each other's lines away; give "
            "this server a ledger of its own with --results-ledger PATH or CERNENV_STATE_DIR"
        ) from None
    return fd


def rotated_path(path: Path, index: int) -> Path:
    return path.with_name(f"{path.name}.{index}")


def ledger_files(path: Path) -> List[Path]:
    """The ledger's files, oldest first: its rotated files (highest number first), then `path`."""
    path = Path(path)
    rotated = []
    for candidate in path.parent.glob(path.name + ".*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isascii() and suffix.isdigit():
            rotated.append((int(suffix), candidate))
    return [candidate for _, candidate in sorted(rotated, reverse=True)] + [path]


def read_ledger(
    path: Path, *, skip_damaged: bool = False
) -> Union[List[Union[EpisodeEnded, RunOpened, RunEnded]], Tuple[List[Any], List[str]]]:
    """The ledger's typed records, in order, its rotated files first (`ledger_files`). A line
    that is not a valid record raises `LedgerError` naming the file, line and field; with
    `skip_damaged`, (records, problems): the valid records and one line per damaged one."""
    records: List[Union[EpisodeEnded, RunOpened, RunEnded]] = []
    problems: List[str] = []
    files = ledger_files(path)
    if not Path(path).exists():
        raise FileNotFoundError(f"no results ledger at {path}")
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as handle:
            for number, text in enumerate(handle, start=1):
                if not text.strip():
                    continue
                try:
                    records.append(parse_line(text))
                except ValueError as error:
                    problem = f"{file}:{number}: {_problem(error)}"
                    if not skip_damaged:
                        raise LedgerError(
                            f"{problem}; the line is not a valid results-ledger record (a line cut by a full "
                            "disk, or written by hand): read past it with skip_damaged=True, which reports each "
                            "line it skips (a scored run's ledger is never read past: cernenv.server.audit)"
                        ) from None
                    problems.append(problem)
    return (records, problems) if skip_damaged else records


def _plain_scalar(value: Any) -> Any:
    """A numpy scalar as the plain JSON value it holds (`numpy.bool_` → true/false, never "True");
    anything else a ledger record should not hold is a TypeError, not its `str`."""
    item = getattr(value, "item", None)
    if callable(item) and type(value).__module__ == "numpy":
        return item()
    raise TypeError(f"a results-ledger record holds plain JSON values, not {type(value).__name__}")


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
