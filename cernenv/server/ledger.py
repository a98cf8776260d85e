"""The results ledger: the operator's record of an evaluation server, one typed JSON line per
event — an episode that ended (`EpisodeEnded`), a scored run opened (`RunOpened`) or ended
(`RunEnded`).

Every line is checked against its schema when it is written and when it is read (`LedgerLine`,
strict pydantic models): booleans are JSON booleans, numbers finite JSON numbers, nothing unknown.
A line that fails is an error naming the file, the line and the field (`LedgerError`), never a
silent value; `read_ledger(..., skip_damaged=True)` reads past damaged lines and says which.
"""

from __future__ import annotations

import datetime
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


class RunEnded(_Line):
    """The end of a scored run: every task played, or the server stopped (`reason`)."""

    record: Literal["run_ended"] = "run_ended"
    ended_at: StrictStr
    run_id: StrictStr
    reason: StrictStr
    assigned: StrictInt
    ended: StrictInt


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


LEDGER_MAX_BYTES = 256 * 2**20
"""Size [bytes] at which the ledger file is rotated (`ResultsLedger`)."""
LEDGER_ROTATED_FILES = 8
"""Rotated files kept beside it (results.jsonl.1 the newest): the ledger holds at most
(1 + LEDGER_ROTATED_FILES) x LEDGER_MAX_BYTES on disk."""
REPORT_EVERY_S = 10.0


class ResultsLedger:
    """The ledger file, appended one whole line per `append` (one `write` on a file opened
    O_APPEND, under a lock), readable by this user only.

    A record is validated before it is written (a ValueError, nothing written, if it is not
    valid). A write the disk cuts short is undone (the file is truncated back) and reported
    (OSError), so no partial line is left. When the file would pass `max_bytes` it is rotated:
    results.jsonl becomes results.jsonl.1, .1 becomes .2, ..., keeping `rotated_files` of them
    (the oldest is deleted, with a warning); `read_ledger` reads them all, oldest first."""

    def __init__(
        self, path: Path, max_bytes: int = LEDGER_MAX_BYTES, rotated_files: int = LEDGER_ROTATED_FILES
    ) -> None:
        self.path = Path(path)
        self.max_bytes, self.rotated_files = max_bytes, rotated_files
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._fd = open_private_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._lock = threading.Lock()
        self._failed, self._last_report = 0, -REPORT_EVERY_S

    def append(self, record: Dict[str, Any]) -> Union[EpisodeEnded, RunOpened, RunEnded]:
        """Validate `record` and append it; the typed record written."""
        text = json.dumps(record, sort_keys=True, default=_plain_scalar, allow_nan=False)
        try:
            typed = parse_line(text)
        except ValueError as error:
            raise ValueError(f"not a valid results-ledger record: {_problem(error)}") from None
        data = (text + "\n").encode("utf-8")
        with self._lock:
            size = os.fstat(self._fd).st_size
            if size > 0 and size + len(data) > self.max_bytes:
                self._rotate()
                size = 0
            try:
                written = os.write(self._fd, data)
            except OSError:
                written = -1
            if written != len(data):
                os.ftruncate(self._fd, size)  # no partial line: the next one starts clean
                raise OSError(f"results ledger {self.path}: the line could not be written whole (is the disk full?)")
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


def rotated_path(path: Path, index: int) -> Path:
    return path.with_name(f"{path.name}.{index}")


def ledger_files(path: Path) -> List[Path]:
    """The ledger's files, oldest first: its rotated files (highest number first), then `path`."""
    path = Path(path)
    rotated = []
    for candidate in path.parent.glob(path.name + ".*"):
        suffix = candidate.name[len(path.name) + 1 :]
        if suffix.isdigit():
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
                            "disk, or written by hand): read past it with skip_damaged=True (the scorer's "
                            "--skip-damaged), which reports each line it skips"
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
