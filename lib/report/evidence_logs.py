"""The files of one run's evidence (`EvidencePaths`), its CSV logs written while it trains
(`TrainingLogWriter`, `RewardComponentLogWriter`, `CheckpointEvalWriter`) and read back
(`read_records`), and the whole folder read once into one `Evidence` (`read_evidence`).

Logs are append-only and may be written by several processes and threads at once, and
a run may be killed at any moment. Each row is therefore one `write` of one complete line
under an exclusive `fcntl.flock`, and a row exists only once its newline is on disk:
readers skip an unterminated last line, and the next writer cuts it off before
appending. Readers skip malformed CSV lines, count them and log a warning; episode files
are read by `lib.episodes.records.read_episodes_jsonl`.
"""

from __future__ import annotations

import csv
import fcntl
import io
import logging
import math
import os
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from lib.episodes.records import COMPRESSED_SUFFIX, read_episodes_jsonl
from lib.files import read_json
from lib.measure.metrics import as_number

logger = logging.getLogger("lib.report.evidence")


EPISODE_FILES = ("pre_eval_jsonl", "post_eval_jsonl")
"""`EvidencePaths`' episode files: `pre_eval.jsonl.gz` and `post_eval.jsonl.gz`, gzip-compressed JSONL
(`lib.episodes.records.COMPRESSED_SUFFIX`); in a folder written before they were compressed, the plain
`.jsonl` files that are there."""


BASELINES = "baselines"
"""`EvidencePaths` field metadata `written_by`: a file notebook 02 writes (the reference agents), which a
training run reads and never moves or rewrites."""


@dataclass
class EvidencePaths:
    """Every evidence artifact of one folder, under `root` (the episode files: `EPISODE_FILES`): a training
    run's files, and notebook 02's baselines beside them (fields whose `written_by` is `BASELINES`)."""

    root: Path
    training_log_csv: Path = field(init=False)
    reward_components_csv: Path = field(init=False)
    checkpoint_evals_csv: Path = field(init=False)
    training_curve_png: Path = field(init=False)
    reward_components_png: Path = field(init=False)
    checkpoint_progression_png: Path = field(init=False)
    before_after_summary_png: Path = field(init=False)
    reward_distribution_png: Path = field(init=False)
    before_after_metrics_json: Path = field(init=False)
    sample_trajectories_md: Path = field(init=False)
    pre_eval_jsonl: Path = field(init=False)
    post_eval_jsonl: Path = field(init=False)
    baselines_json: Path = field(init=False, metadata={"written_by": BASELINES})
    """The reference agents on the same suite (notebook 02's `lib.measure.evaluation.BaselinesFile`)."""

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        for name in self.__dataclass_fields__:
            if name != "root":
                stem, _, suffix = name.rpartition("_")
                setattr(self, name, self.root / f"{stem}.{suffix}")
        for name in EPISODE_FILES:  # gzip-compressed JSONL; a folder written before keeps its plain files
            plain = getattr(self, name)
            compressed = plain.with_name(plain.name + COMPRESSED_SUFFIX)
            setattr(self, name, plain if plain.exists() and not compressed.exists() else compressed)

    def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    @classmethod
    def training_run_fields(cls) -> Tuple[str, ...]:
        """The fields naming a file a training run writes (a new run moves these aside, and only these)."""
        return tuple(
            f.name for f in fields(cls) if f.name != "root" and f.metadata.get("written_by", "training") == "training"
        )


# ----------------------------------------------------------------------------- writing

_path_locks: Dict[str, threading.Lock] = {}
_path_locks_guard = threading.Lock()


def _reset_locks_after_fork() -> None:
    # A lock held by another thread at fork time would never be released in the child.
    global _path_locks, _path_locks_guard
    _path_locks, _path_locks_guard = {}, threading.Lock()


os.register_at_fork(after_in_child=_reset_locks_after_fork)


def _thread_lock(path: Path) -> threading.Lock:
    """One lock per file per process, shared by every writer instance of that file."""
    key = os.path.realpath(path)
    with _path_locks_guard:
        return _path_locks.setdefault(key, threading.Lock())


def _cut_partial_last_line(fd: int, path: Path) -> int:
    """Truncate bytes after the last newline (a row whose writer was killed); return the size."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    end = size
    while end > 0:
        start = max(0, end - 65536)
        cut = os.pread(fd, end - start, start).rfind(b"\n")
        if cut >= 0:
            end = start + cut + 1
            break
        end = start
    logger.warning(
        "%s: dropped an unfinished last line %r (its writer was interrupted)",
        path,
        os.pread(fd, min(size - end, 200), end),
    )
    os.ftruncate(fd, end)
    return end


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if hasattr(value, "item") and callable(value.item):  # numpy scalar, 0-d array, torch tensor
        value = value.item()
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ""
    raise TypeError(f"a log cell is a number or nothing, not {type(value).__name__} {str(value)[:40]!r}")


def _csv_line(cells: Sequence[str]) -> bytes:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(cells)
    return buffer.getvalue().encode("utf-8")


class _CsvLog:
    """Append-only CSV with a fixed header, safe across processes, threads and kills.

    Missing keys are written empty, as are None, NaN and ±inf (plots skip them); an
    unknown key raises, so a typo cannot silently drop a metric.
    """

    COLUMNS: Tuple[str, ...] = ()
    OLDER_COLUMNS: Tuple[Tuple[str, ...], ...] = ()
    """Headers an earlier version of the writer wrote: a file that starts with one is appended to
    in its own columns (a run resumed across the change), the newer columns left out."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._header = _csv_line(self.COLUMNS)
        self._append_line(None)  # create the file with its header now, as the seed did

    def _append_row(self, row: Mapping[str, Any]) -> None:
        unknown = [key for key in row if key not in self.COLUMNS]
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: unknown column(s) {unknown} for {self.path.name}; "
                f"the columns are {list(self.COLUMNS)}"
            )
        self._append_line(row)

    def _append_line(self, row: Optional[Mapping[str, Any]]) -> None:
        with _thread_lock(self.path):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # released by close
                if _cut_partial_last_line(fd, self.path) == 0:
                    columns, line = self.COLUMNS, self._header
                else:
                    columns, line = self._columns_in_file(fd), b""
                if row is not None:
                    line += _csv_line([_csv_cell(row.get(column)) for column in columns])
                if line:
                    _write_all(fd, line)
            finally:
                os.close(fd)

    def _columns_in_file(self, fd: int) -> Tuple[str, ...]:
        longest = max(len(self._header), *(len(_csv_line(c)) for c in self.OLDER_COLUMNS)) if self.OLDER_COLUMNS else 0
        found = os.pread(fd, max(longest, len(self._header)) + 1, 0).split(b"\n")[0].rstrip(b"\r")  # csv's \r\n
        for columns in (self.COLUMNS, *self.OLDER_COLUMNS):
            if found == _csv_line(columns).rstrip(b"\n"):
                return columns
        raise ValueError(
            f"{self.path} starts with {found!r}, not the columns {list(self.COLUMNS)}; "
            "move the old file aside or log to a new evidence folder"
        )


class TrainingLogWriter(_CsvLog):
    """One row per trainer logging step: GRPO loss, reward, KL, gradient norm, learning rate, and
    the share of the step's groups whose samples all earned the same reward (no advantage, no
    gradient), after the seed logger's columns."""

    COLUMNS = (
        "step",
        "epoch",
        "loss",
        "reward",
        "reward_std",
        "kl",
        "grad_norm",
        "learning_rate",
        "wall_time_s",
        "frac_reward_zero_std",
    )

    def append(self, row: Mapping[str, Any]) -> None:
        self._append_row(row)


class RewardComponentLogWriter(_CsvLog):
    """One row per rollout batch: each reward component and outcome rate on its own, so a
    rising total can be traced to the grade rather than to shaping."""

    COLUMNS = (
        "step",
        "n",
        "mean_cumulative",
        "mean_terminal",
        "mean_step_shaping",
        "discovered_rate",
        "mass_correct_rate",
        "channel_correct_rate",
        "spin_correct_rate",
        "parsed_rate",
        "mean_n_steps",
        "mean_cumulative_low",
        "mean_cumulative_high",
        "mean_terminal_low",
        "mean_terminal_high",
        "mean_step_shaping_low",
        "mean_step_shaping_high",
        "discovered_rate_n",
        "mass_correct_rate_n",
        "channel_correct_rate_n",
        "spin_correct_rate_n",
        "parsed_rate_n",
    )
    OLDER_COLUMNS = (COLUMNS[:11],)  # before each rate's count and each mean's interval

    def append(self, row: Mapping[str, Any]) -> None:
        self._append_row(row)


class CheckpointEvalWriter(_CsvLog):
    """One row per held-out evaluation during training (see `checkpoint_row`)."""

    COLUMNS = (
        "step",
        "fraction_done",
        "episodes",
        "mean_reward",
        "success_rate",
        "mass_acc",
        "channel_acc",
        "episodes_with_particle",
        "mean_reward_low",
        "mean_reward_high",
    )
    """The last three: the count the accuracies are rates of, and the mean reward's 95% bootstrap
    interval (files written before them end at channel_acc)."""
    OLDER_COLUMNS = (COLUMNS[:-3],)

    def append(self, **row: Any) -> None:
        self._append_row(row)


# ----------------------------------------------------------------------------- reading


@dataclass
class Records:
    """What `read_records` could read: complete rows, and how many lines it skipped."""

    rows: List[Dict[str, Any]]
    n_skipped: int = 0
    columns: Tuple[str, ...] = ()
    """The CSV header (empty for JSONL)."""
    source: str = ""
    """The name of the file read ("" for rows that were not read from one)."""
    lines: List[int] = field(default_factory=list)
    """The line of the file each CSV row was read from (from 1; empty for JSONL)."""


def read_records(path: Path) -> Records:
    """Rows of a CSV log (the numeric logs' cells as numbers, `LogCell`; other CSV files' as
    strings) or episodes of a JSONL file (dicts; `.jsonl.gz`: gzip-compressed). A missing file is
    empty.

    A JSONL file is read by `lib.episodes.records.read_episodes_jsonl`: an unfinished last line
    is skipped and counted, damage anywhere else is an error (an evaluation file that lost an
    episode must not be summarised as if whole). A CSV log skips, counts and warns about lines
    that are not rows: undecodable bytes (a crash can leave NULs), wrong field counts, and an
    unterminated last line (a prefix of a row can look like a row). A run's own logs (`LOG_HEADERS`)
    are refused, in one line that names the file and line, where what is wrong is the whole file:
    no header or another one, a byte-order mark or semicolons (a spreadsheet program saved it), a
    step logged twice (a file appended to itself: every step would count twice in a trend).
    """
    path = Path(path)
    if not path.exists():
        return Records([], source=path.name)
    if path.name.lower().removesuffix(COMPRESSED_SUFFIX).endswith((".jsonl", ".ndjson")):
        episodes, skipped = read_episodes_jsonl(str(path))
        records = Records(episodes, skipped)
    else:
        data = path.read_bytes()
        _check_log_header(path, data)
        records = _read_csv(data)
        _typed_numbers(path, records)
        _check_steps_once(path, records)
    if records.n_skipped:
        logger.warning("%s: skipped %d malformed or unfinished line(s)", path, records.n_skipped)
    records.source = path.name
    return records


LOG_HEADERS = {
    "training_log.csv": (TrainingLogWriter.COLUMNS, TrainingLogWriter.COLUMNS[:-1]),  # before the zero-spread column
    "reward_components.csv": (RewardComponentLogWriter.COLUMNS, *RewardComponentLogWriter.OLDER_COLUMNS),
    "checkpoint_evals.csv": (CheckpointEvalWriter.COLUMNS, *CheckpointEvalWriter.OLDER_COLUMNS),
}
"""A run's logs by file name, each with the headers its writer wrote (today's first)."""
NUMERIC_LOGS = {header for headers in LOG_HEADERS.values() for header in headers}
"""The headers of the logs whose every cell is a number or empty (`_CsvLog` writes nothing else)."""
DAMAGED_LOG_FIX = "move it aside and rerun what writes it, or restore the file the run wrote"


def _check_log_header(path: Path, data: bytes) -> None:
    """A ValueError of one line where a run's log (`LOG_HEADERS`, by its name) does not start with
    its writer's header: a byte-order mark, fields split by semicolons, a first line of numbers (no
    header), or another header."""
    headers = LOG_HEADERS.get(path.name)
    if headers is None or not data.strip():
        return
    columns = ",".join(headers[0])
    first = data.split(b"\n", 1)[0]
    if data.startswith(b"\xef\xbb\xbf"):
        endings = " and ends its lines CRLF" if first.endswith(b"\r") else ""
        raise ValueError(
            f"{path}:1: starts with a byte-order mark{endings}: a spreadsheet program (Excel) saved it; a run "
            f"writes plain UTF-8 CSV, comma-separated: {DAMAGED_LOG_FIX}"
        )
    text = first.decode("utf-8", "replace").rstrip("\r")
    fields = tuple(_csv_fields(text) or ())
    if fields in headers:
        return
    if tuple(text.split(";")) in headers or (";" in text and "," not in text):
        problem = "separates its fields with ';', not ',' (a spreadsheet program with a decimal comma saved it)"
    elif fields and all(_is_number(cell) or not cell for cell in fields):
        problem = f"has no header: its first line is a row of numbers ({text[:40]!r})"
    else:
        problem = f"starts with {text[:60]!r}, not a {path.name}'s header"
    raise ValueError(f"{path}:1: {problem}; a {path.name} starts with the line {columns!r}: {DAMAGED_LOG_FIX}")


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _check_steps_once(path: Path, records: Records) -> None:
    """A ValueError naming the two lines where a run's log (`LOG_HEADERS`) holds a step twice: each
    step is logged once (a resumed run first cuts the rows after its checkpoint), so a repeat is a
    file appended to itself or two runs' logs joined, which would count each step twice."""
    if path.name not in LOG_HEADERS:
        return
    seen: Dict[Any, int] = {}
    for row, line in zip(records.rows, records.lines):
        step = row.get("step")
        if step is not None and step in seen:
            raise ValueError(
                f"{path}:{line}: step {step} again (first on line {seen[step]}): a run logs each step once, so "
                f"this file was appended to itself or joined with another run's: {DAMAGED_LOG_FIX}"
            )
        seen.setdefault(step, line)


LogCell = Union[int, float, None]
"""A cell of a numeric log as read: an int where the file holds an integer, else a float; None where empty."""


def _typed_numbers(path: Path, records: Records) -> None:
    """Turn every cell of a numeric log (`NUMERIC_LOGS`) into its number (`LogCell`), in place; a
    ValueError naming the file, row and column of a cell that is neither a finite number nor empty:
    such a file was not written by its writer."""
    if records.columns not in NUMERIC_LOGS:
        return
    for number, row in zip(records.lines, records.rows):
        for column, cell in row.items():
            try:
                value: LogCell = None if cell == "" else int(cell) if cell.lstrip("-").isdigit() else float(cell)
                ok = value is None or math.isfinite(value)
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(
                    f"{path}:{number}: column {column}: {cell[:40]!r} is not a finite number; "
                    "every cell of this log is a number or empty (move the file aside and rerun what writes it)"
                )
            row[column] = value


def _read_csv(data: bytes) -> Records:
    raw_lines = data.split(b"\n")
    complete, tail = raw_lines[:-1], raw_lines[-1]
    skipped = 1 if tail.strip() else 0
    lines: List[Tuple[int, str]] = []
    for number, raw in enumerate(complete, start=1):
        try:
            text = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            skipped += 1
            continue
        if "\x00" in text:
            skipped += 1
        elif text.strip():
            lines.append((number, text))
    records = _parse_csv(lines)
    records.n_skipped += skipped
    return records


def _parse_csv(lines: List[Tuple[int, str]]) -> Records:
    if not lines:
        return Records([])
    header = tuple(_csv_fields(lines[0][1]) or ())
    rows, numbers, skipped = [], [], 0
    for number, text in lines[1:]:
        fields = _csv_fields(text)  # line by line: a stray quote must not swallow the next row
        if fields is None or len(fields) != len(header) or tuple(fields) == header:
            skipped += 1
        else:
            rows.append(dict(zip(header, fields)))
            numbers.append(number)
    return Records(rows, skipped, header, lines=numbers)


def _csv_fields(text: str) -> Optional[List[str]]:
    try:
        return next(csv.reader([text], strict=True))
    except csv.Error:
        return None


def _column(rows: Sequence[Mapping[str, Any]], name: str) -> np.ndarray:
    """Values of one column as floats; missing, empty and non-finite values are NaN."""
    return np.array([as_number(row.get(name)) for row in rows], dtype=float)


# ----------------------------------------------------------------------------- one run's evidence, read once


@dataclass(frozen=True)
class Evidence:
    """One run's evidence as data, read from its folder once (`read_evidence`) and handed to every
    renderer and to notebook 04, so no figure or table opens a file of its own.

    Every part is checked as it is read: the episodes against the episode record
    (`lib.episodes.records.EpisodeLine`), the logs' cells as numbers (`LogCell`), baselines.json
    against `lib.measure.evaluation.BaselinesFile`. A file that does not exist is an empty part
    (no rows, no episodes, None)."""

    paths: EvidencePaths
    pre: List[Dict[str, Any]]
    """Episodes of the held-out evaluation before training (pre_eval.jsonl.gz)."""
    post: List[Dict[str, Any]]
    """The same tasks after training (post_eval.jsonl.gz)."""
    training_log: Records
    reward_components: Records
    checkpoint_evals: Records
    before_after: Optional[Dict[str, Any]]
    """before_after_metrics.json as the run wrote it (`lib.measure.comparison.before_after_metrics`)."""
    baselines: Optional[Dict[str, Any]]
    """baselines.json (notebook 02's reference agents on the same suite)."""


def read_evidence(paths: "EvidencePaths | Path | str") -> Evidence:
    """Every data file of a run's evidence folder (`EvidencePaths`, or its root), each read once."""
    from lib.measure.evaluation import read_baselines

    paths = paths if isinstance(paths, EvidencePaths) else EvidencePaths(Path(paths))
    metrics = paths.before_after_metrics_json
    return Evidence(
        paths=paths,
        pre=read_records(paths.pre_eval_jsonl).rows,
        post=read_records(paths.post_eval_jsonl).rows,
        training_log=read_records(paths.training_log_csv),
        reward_components=read_records(paths.reward_components_csv),
        checkpoint_evals=read_records(paths.checkpoint_evals_csv),
        before_after=read_json(metrics, "rerun what writes it (the run's end: make train)")
        if metrics.exists()
        else None,
        baselines=read_baselines(paths.baselines_json) if paths.baselines_json.exists() else None,
    )
