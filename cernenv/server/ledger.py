"""The results ledger: the operator's record of an evaluation server, one typed JSON line per
event — an episode that ended (`EpisodeEnded`), a scored run opened (`RunOpened`) or ended
(`RunEnded`).

Every line is checked against its schema when it is written and when it is read (`LedgerLine`,
strict pydantic models): booleans are JSON booleans, numbers finite JSON numbers, nothing unknown.
A line that fails is an error naming the file, the line and the field (`LedgerError`), never a
silent value; `read_ledger(..., skip_damaged=True)` reads past damaged lines and says which.

Two kinds of file (`ResultsLedger`): the server's ledger of episodes played outside scored runs,
rotated by size into a bounded number of files and refused once they are full (never deleted),
one writer at a time (a lock beside it), each client address's share bounded and its episodes
that never took a step bounded in number; and a scored run's file of its own (`run_file=True`),
made new, locked for its server's life, never rotated, whose lines chain and are signed: each
carries the SHA-256 of the run's previous line (`previous`, `line_sha256`), so a line changed,
inserted, removed or moved breaks the chain, and an Ed25519 signature (`signature`) under the
run's key, whose public half the run committed to (`cernenv.server.audit` checks both).
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
from typing import Annotated, Any, Dict, List, Literal, Mapping, Optional, Tuple, Union

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, TypeAdapter, ValidationError

from cernenv.server.evaluation import open_private_file

logger = logging.getLogger("cernenv.server")

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
"""A finite JSON number (an integer is one; a boolean, a string, NaN and infinity are not)."""


def _check_finite(value: Any, where: str) -> None:
    """A ValueError naming the first place in `value` (what `json.loads` made of a line: objects,
    arrays, strings, numbers, booleans, null) that holds a number JSON cannot write: NaN or an
    infinity, which Python's JSON reader accepts and pydantic does not look for inside the
    free-form objects (`truth`, `claim`, a run's `tasks`)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where} is {value}: a ledger holds finite numbers only")
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_finite(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, f"{where}.{key}")


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
    signature: Optional[StrictStr] = None
    """In a scored run's file, the run's Ed25519 signature of the line (`line_digest`)."""

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
    public_key: Optional[StrictStr] = None
    """The run's Ed25519 public key (32 bytes, hex), which every line's `signature` verifies under;
    committed to in the commitment document."""
    previous: Optional[StrictStr] = None
    """None: the first line of the run's chain."""
    signature: Optional[StrictStr] = None


class RunSeeded(_Line):
    """The entrant's nonce, sent after the commitment was published and before the first reset:
    the run's worlds are drawn with a secret mixed from the committed operator's secret and this
    nonce (`cernenv.server.runs.worlds_secret`), so neither side chose them alone (a development run's,
    `dev:N`, with the public `cernenv.server.runs.DEVELOPMENT_WORLDS_SECRET`).
    `secret_fingerprint` is the mixed secret's. What plays the run: `agent` (its module:Class),
    `agent_sha256` (the SHA-256 of the file that defines its module), and the entrant's own Ed25519
    key (`entrant_public_key`), whose `entrant_signature` of the run, its commitment, the nonce and
    the agent (`cernenv.server.runs.entrant_statement`) the server checked before taking the nonce."""

    record: Literal["run_seeded"] = "run_seeded"
    seeded_at: StrictStr
    run_id: StrictStr
    entrant_nonce: StrictStr
    secret_fingerprint: StrictStr
    agent: Optional[StrictStr] = None
    agent_sha256: Optional[StrictStr] = None
    entrant_public_key: Optional[StrictStr] = None
    entrant_signature: Optional[StrictStr] = None
    previous: Optional[StrictStr] = None
    signature: Optional[StrictStr] = None


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
    signature: Optional[StrictStr] = None


Record = Union[EpisodeEnded, RunOpened, RunSeeded, RunEnded]
LedgerLine = Annotated[Record, Field(discriminator="record")]
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


def parse_line(text: str) -> Record:
    """One ledger line's record (a line written before records were typed is an episode's);
    a ValueError (pydantic's or JSON's) when it is not a valid record."""
    data = json.loads(text)
    if isinstance(data, dict):
        data.setdefault("record", "episode")
    _check_finite(data, "the line")
    return _LINE.validate_python(data)


def line_sha256(text: str) -> str:
    """The SHA-256 (hex) of one ledger line as written, without its newline: what the next line of
    a scored run's file carries as `previous`."""
    return hashlib.sha256(text.encode()).hexdigest()


SIGNED_LINE_CONTEXT = b"cernenv scored-run ledger line\x00"
"""What a scored run's signature signs, before the line's digest (a signature of a line is never
one of anything else)."""


def record_text(record: Mapping[str, Any]) -> str:
    """A record as a ledger line's text: JSON with sorted keys, finite numbers only."""
    return json.dumps(record, sort_keys=True, default=_plain_scalar, allow_nan=False)


def line_digest(text: str) -> str:
    """The digest (SHA-256, hex) a scored run's line is signed by: of the line's text without its
    `signature` field (`record_text` of the rest, which is the text the server signed)."""
    data = json.loads(text)
    if isinstance(data, dict):
        data.pop("signature", None)
    return hashlib.sha256(record_text(data).encode()).hexdigest()


def sign_digest(key: Ed25519PrivateKey, digest: str) -> str:
    """The Ed25519 signature (hex) of a line's `line_digest`."""
    return key.sign(SIGNED_LINE_CONTEXT + bytes.fromhex(digest)).hex()


def public_key_hex(key: Ed25519PrivateKey) -> str:
    """The raw public half of `key` (32 bytes), as hex: what a run commits to."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()


def signature_holds(public_key: str, digest: str, signature: Optional[str]) -> bool:
    """Whether `signature` is the Ed25519 signature of `digest` under `public_key` (both hex)."""
    if not isinstance(signature, str):
        return False
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key))
        key.verify(bytes.fromhex(signature), SIGNED_LINE_CONTEXT + bytes.fromhex(digest))
        return True
    except (ValueError, InvalidSignature):
        return False


LEDGER_MAX_BYTES = 256 * 2**20
"""Size [bytes] at which the ledger file is rotated (`ResultsLedger`)."""
LEDGER_ROTATED_FILES = 8
"""Rotated files kept beside it (results.jsonl.1 the newest): the ledger holds at most
(1 + LEDGER_ROTATED_FILES) x LEDGER_MAX_BYTES on disk, and once they are all full it refuses
further lines (`LedgerFull`) rather than delete any."""
STEPLESS_LINES_PER_CLIENT = 16
"""Lines a client address may write, over a ledger's life, for episodes it abandoned without a
single step (a reset after a reset): past them such episodes are counted, not written
(`ResultsLedger.stepless_unrecorded`). A scored run records every one of its episodes."""
REPORT_EVERY_S = 10.0
LEDGER_MIN_FREE_BYTES = 4 * 2**20
"""Free space [bytes] the ledger's file system must have for the server to start a new episode: an
episode whose line could not be written would be played and lost (`ResultsLedger.room_problem`)."""


class LedgerShareSpent(OSError):
    """A client address has written its share of the ledger (`ResultsLedger.client_max_bytes`), or
    its share of lines for episodes without a step (`STEPLESS_LINES_PER_CLIENT`)."""


class LedgerFull(OSError):
    """The ledger and all its rotated files are full: nothing more is written (nothing is deleted)."""


class ResultsLedger:
    """A ledger file, appended one whole line per `append` (one `write` on a file opened
    O_APPEND, under a lock), readable by this user only.

    A record is validated before it is written (a ValueError, nothing written, if it is not
    valid). A write the disk cuts short is undone (the file is truncated back) and reported
    (OSError), so no partial line is left.

    The server's ledger (the default): one writer at a time, held by an exclusive lock on
    `<path>.lock` for the life of this object (a second server given the same file is refused
    with what to do: two writers rotating one file lose each other's lines); a scored run's
    ledger is refused outright (it is never anyone else's to write or rotate). When the file would
    pass `max_bytes` it is rotated: results.jsonl becomes results.jsonl.1, .1 becomes .2, ...,
    up to `rotated_files` of them; once those are all full the ledger is `full`: every further line
    is refused (`LedgerFull`, logged at a bounded rate, and the server refuses resets) until the
    operator moves the files away. `read_ledger` reads them all, oldest first. Each client address
    may write at most `client_max_bytes` of episode lines over the object's life (default
    `max_bytes`, one file's worth), and at most `stepless_lines` lines of episodes it abandoned
    without a step (past them those are counted per address, `stepless_unrecorded`): beyond either,
    that address's episodes are not recorded (`LedgerShareSpent`, logged at a bounded rate).

    A scored run's file (`run_file=True`): created here (an existing file is refused), held by the
    same exclusive lock on `<path>.lock` while it is open (a second server on the path is refused
    at start), never rotated (a run's size is bounded by its tasks), no share per client (every
    line of a run counts), and its lines chain: `append` sets each record's `previous` to
    `line_sha256` of the line before (None for the first) and, given `signing_key`, its
    `signature` to the key's Ed25519 signature of the line's `line_digest`; `head()` is the
    receipt of the last line written."""

    def __init__(
        self,
        path: Path,
        max_bytes: int = LEDGER_MAX_BYTES,
        rotated_files: int = LEDGER_ROTATED_FILES,
        *,
        client_max_bytes: Optional[int] = None,
        stepless_lines: int = STEPLESS_LINES_PER_CLIENT,
        run_file: bool = False,
        signing_key: Optional[Ed25519PrivateKey] = None,
    ) -> None:
        self.path = Path(path)
        self.max_bytes, self.rotated_files, self.run_file = max_bytes, rotated_files, run_file
        self.client_max_bytes = None if run_file else (client_max_bytes or max_bytes)
        self.stepless_lines = None if run_file else stepless_lines
        self._signing_key = signing_key
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_fd: Optional[int] = _exclusive_lock(lock_path(self.path), self.path)
        self._fd: Optional[int]
        try:
            if run_file:
                try:
                    self._fd = open_private_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL)
                except FileExistsError:
                    raise OSError(
                        f"{self.path} exists: a scored run's ledger is a file of its own, made when the run opens; "
                        "give a new path (or none: runs/RUN_ID.jsonl in the state directory)"
                    ) from None
            else:
                self._fd = open_private_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                if _opens_a_run(self.path):
                    os.close(self._fd)
                    raise OSError(
                        f"{self.path} is a scored run's ledger, which no other server writes or rotates: give this "
                        "server a results ledger of its own with --results-ledger PATH or CERNENV_STATE_DIR"
                    )
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.last_sha256: Optional[str] = None
        self.lines = 0
        self._head: Optional[Dict[str, Any]] = None
        self._lock = threading.Lock()
        self._client_bytes: Dict[str, int] = {}
        self._client_stepless: Dict[str, int] = {}
        self.stepless_unrecorded: Dict[str, int] = {}
        """Per client address, episodes abandoned without a step that were counted, not written."""
        self.full = False
        self.unwritable: Optional[str] = None
        """Why the last line could not be written (a full disk), until a line is written again."""
        self._failed, self._last_report = 0, -REPORT_EVERY_S
        self._room_refusals = 0
        """`room_problem`'s refusals in a row (the first is logged)."""

    def append(self, record: Dict[str, Any]) -> Record:
        """Validate `record` (in a run's file, with `previous` and `signature` set) and append it;
        the typed record written."""
        with self._lock:
            signature = None
            if self.run_file:
                record = json.loads(record_text({**record, "previous": self.last_sha256}))
                record.pop("signature", None)
                if self._signing_key is not None:
                    digest = hashlib.sha256(record_text(record).encode()).hexdigest()
                    signature = sign_digest(self._signing_key, digest)
                    record["signature"] = signature
            text = record_text(record)
            try:
                typed = parse_line(text)
            except ValueError as error:
                raise ValueError(f"not a valid results-ledger record: {_problem(error)}") from None
            data = (text + "\n").encode()
            client = typed.client if isinstance(typed, EpisodeEnded) and typed.client else "unknown"
            stepless = isinstance(typed, EpisodeEnded) and typed.abandoned and typed.steps == 0
            if self.full:
                raise LedgerFull(self._full_message())
            if self.client_max_bytes is not None and isinstance(typed, EpisodeEnded):
                if stepless and self._client_stepless.get(client, 0) >= self.stepless_lines:
                    self.stepless_unrecorded[client] = self.stepless_unrecorded.get(client, 0) + 1
                    raise LedgerShareSpent(
                        f"client {client} has written {self.stepless_lines} lines of episodes abandoned without a "
                        f"step: its further ones are counted, not written ({self.stepless_unrecorded[client]} so far)"
                    )
                spent = self._client_bytes.get(client, 0)
                if spent + len(data) > self.client_max_bytes:
                    raise LedgerShareSpent(
                        f"client {client} has written {spent} bytes of episode lines, its share of "
                        f"{self.client_max_bytes}: its further episodes are not recorded (--ledger-max-mib sets both)"
                    )
            if self._fd is None:
                raise OSError(f"the results ledger {self.path} is closed: nothing more is written to it")
            size = os.fstat(self._fd).st_size
            if not self.run_file and size and size + len(data) > self.max_bytes:
                if rotated_path(self.path, self.rotated_files).exists():
                    self.full = True
                    raise LedgerFull(self._full_message())
                self._rotate()
                size = 0
            try:
                if os.write(self._fd, data) != len(data):
                    raise OSError  # a short write: the rest did not fit
            except OSError:
                os.ftruncate(self._fd, size)  # no partial line: the next one starts clean
                self.unwritable = f"results ledger {self.path}: the line could not be written whole (is the disk full?)"
                raise OSError(self.unwritable) from None
            self.unwritable = None
            self.lines += 1
            if self.run_file:
                self.last_sha256 = line_sha256(text)
                self._head = {
                    "line": self.lines,
                    "line_sha256": self.last_sha256,
                    "digest": line_digest(text),
                    "signature": signature,
                }
            elif isinstance(typed, EpisodeEnded):
                self._client_bytes[client] = self._client_bytes.get(client, 0) + len(data)
                if stepless:
                    self._client_stepless[client] = self._client_stepless.get(client, 0) + 1
        return typed

    def room_problem(self) -> Optional[str]:
        """Why a new episode must not be played now, its line having nowhere to go (None: it may): the
        ledger is full, its last line could not be written and its file system still has under
        `LEDGER_MIN_FREE_BYTES` free, or has that little now. Said in the log once while it lasts."""
        problem = self._full_message() if self.full else None
        if problem is None:
            try:
                info = os.statvfs(self.path.parent)
                free = info.f_bavail * info.f_frsize
            except OSError:
                free = LEDGER_MIN_FREE_BYTES
            if free < LEDGER_MIN_FREE_BYTES:
                problem = (
                    f"the results ledger {self.path} cannot be written: its file system has {free} bytes free, "
                    f"under the {LEDGER_MIN_FREE_BYTES} an episode's line needs"
                    + (f" ({self.unwritable})" if self.unwritable else "")
                )
        with self._lock:
            if problem is None:
                self._room_refusals = 0
                return None
            self._room_refusals += 1
            report = self._room_refusals == 1
        if report:
            logger.error("%s: the server plays no new episode until it has room again", problem)
        return problem

    def head(self) -> Optional[Dict[str, Any]]:
        """The receipt of a run file's last line: its number, its `line_sha256`, its `line_digest`
        and the run's signature of that digest (None before the first line)."""
        with self._lock:
            return dict(self._head) if self._head is not None else None

    def _full_message(self) -> str:
        return (
            f"the results ledger {self.path} is full ({1 + self.rotated_files} files of up to {self.max_bytes} "
            "bytes): nothing more is recorded; move its files away (or raise --ledger-max-mib) and restart the server"
        )

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
        """results.jsonl → .1 → .2 ... (`append` never rotates when .`rotated_files` exists), and a new file."""
        for index in range(self.rotated_files, 0, -1):
            source = self.path if index == 1 else rotated_path(self.path, index - 1)
            if source.exists():
                os.replace(source, rotated_path(self.path, index))
        os.close(self._fd)
        self._fd = open_private_file(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL)

    def close(self) -> None:
        with self._lock:
            for fd in (self._fd, self._lock_fd):  # closing the lock's releases it
                if fd is not None:
                    os.close(fd)
            self._fd = self._lock_fd = None


FIRST_LINE_MAX_BYTES = 2**20
"""How much of a file `_opens_a_run` reads for its first line (a run's opening line is far shorter)."""


def _opens_a_run(path: Path) -> bool:
    """Whether the regular file `path` starts with a scored run's first line (`RunOpened`)."""
    fd = open_private_file(path, os.O_RDONLY)
    try:
        first = os.pread(fd, FIRST_LINE_MAX_BYTES, 0).partition(b"\n")[0]
    finally:
        os.close(fd)
    try:
        data = json.loads(first)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("record") == "run_opened"


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


def read_ledger(path: Path, *, skip_damaged: bool = False) -> Union[List[Record], Tuple[List[Any], List[str]]]:
    """The ledger's typed records, in order, its rotated files first (`ledger_files`). A line
    that is not a valid record raises `LedgerError` naming the file, line and field; with
    `skip_damaged`, (records, problems): the valid records and one line per damaged one."""
    records: List[Record] = []
    problems: List[str] = []
    files = ledger_files(path)
    if not Path(path).exists():
        raise FileNotFoundError(f"no results ledger at {path}")
    for file in files:
        with open(file, "rb") as handle:
            for number, line in enumerate(handle, start=1):
                text = line.decode(errors="replace")  # UTF-8, whatever the locale
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
