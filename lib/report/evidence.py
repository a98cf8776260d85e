"""Evidence that training improved the agent: the files of one run, written during training
(locked CSV logs), read back, and rendered into figures and documents.

Three kinds of evidence, all under one folder (`EvidencePaths`):

1. Per-step training metrics (`TrainingLogWriter` → training_log.csv) and per-rollout
   reward components (`RewardComponentLogWriter` → reward_components.csv).
2. Held-out evaluations at checkpoints (`CheckpointEvalWriter` → checkpoint_evals.csv).
3. Episodes before and after training (pre_eval.jsonl / post_eval.jsonl, one episode per
   line) → before_after_metrics.json with 95% bootstrap intervals, two plots and a
   Markdown sample of trajectories.

The statistics of the comparison are `lib.measure.comparison`'s, the metrics `lib.measure.metrics`', an
episode's Markdown `lib.report.episode_markdown`'s; this module writes, reads and draws.

Logs are append-only and may be written by several processes and threads at once, and
a run may be killed at any moment. Each row is therefore one `write` of one complete line
under an exclusive `fcntl.flock`, and a row exists only once its newline is on disk:
readers skip an unterminated last line, and the next writer cuts it off before
appending. Readers skip malformed lines, count them and log a warning.

Renderers draw what exists and never raise on missing, empty or partial data: with
nothing to show they return None and write nothing (an artifact on disk always holds
evidence; no placeholder images). Outputs are written to a temporary file and renamed,
so a server publishing the folder never serves half a PNG. Figures are built with
`matplotlib.figure.Figure` on an Agg canvas: no pyplot, no global backend or style change.
"""

from __future__ import annotations

import csv
import fcntl
import io
import logging
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from lib.episodes.records import part_of, read_episodes_jsonl
from lib.files import atomic_write, write_json
from lib.measure.comparison import (
    SUMMARY_METRICS,
    before_after_metrics,
    episode_values,
    same_tasks,
    training_reward_trend,
)
from lib.measure.evaluation import PARTS, group_label
from lib.measure.metrics import as_number
from lib.report.episode_markdown import correct_by_part, episode_markdown_lines, sample_pairs, spread_by_reward

logger = logging.getLogger(__name__)

DPI = 140
_MARKER_MAX_POINTS = 60  # below this many points, mark each one (a lone point is invisible as a line)


@dataclass
class EvidencePaths:
    """Every evidence artifact of one training run, under `root`."""

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

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        for name in self.__dataclass_fields__:
            if name != "root":
                stem, _, suffix = name.rpartition("_")
                setattr(self, name, self.root / f"{stem}.{suffix}")

    def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)


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
    return str(value).replace("\r", " ").replace("\n", " ")  # one row, one physical line


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

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._header = _csv_line(self.COLUMNS)
        self._append_line(b"")  # create the file with its header now, as the seed did

    def _append_row(self, row: Mapping[str, Any]) -> None:
        unknown = [key for key in row if key not in self.COLUMNS]
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: unknown column(s) {unknown} for {self.path.name}; "
                f"the columns are {list(self.COLUMNS)}"
            )
        self._append_line(_csv_line([_csv_cell(row.get(column)) for column in self.COLUMNS]))

    def _append_line(self, line: bytes) -> None:
        with _thread_lock(self.path):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # released by close
                if _cut_partial_last_line(fd, self.path) == 0:
                    line = self._header + line
                else:
                    self._check_header(fd)
                if line:
                    _write_all(fd, line)
            finally:
                os.close(fd)

    def _check_header(self, fd: int) -> None:
        found = os.pread(fd, len(self._header) + 1, 0).split(b"\n")[0].rstrip(b"\r")  # csv's default ends \r\n
        if found != self._header.rstrip(b"\n"):
            raise ValueError(
                f"{self.path} starts with {found!r}, not the columns {list(self.COLUMNS)}; "
                "move the old file aside or log to a new evidence folder"
            )


class TrainingLogWriter(_CsvLog):
    """One row per trainer logging step: GRPO loss, reward, KL, gradient norm, learning rate."""

    COLUMNS = ("step", "epoch", "loss", "reward", "reward_std", "kl", "grad_norm", "learning_rate", "wall_time_s")

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
    )

    def append(self, row: Mapping[str, Any]) -> None:
        self._append_row(row)


class CheckpointEvalWriter(_CsvLog):
    """One row per held-out evaluation during training (see `checkpoint_row`)."""

    COLUMNS = ("step", "fraction_done", "episodes", "mean_reward", "success_rate", "mass_acc", "channel_acc")

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


def read_records(path: Path) -> Records:
    """Rows of a CSV log (values as strings) or episodes of a JSONL file (dicts). A missing file is empty.

    A JSONL file is read by `lib.episodes.records.read_episodes_jsonl`: an unfinished last line
    is skipped and counted, damage anywhere else is an error (an evaluation file that lost an
    episode must not be summarised as if whole). A CSV log skips, counts and warns about lines
    that are not rows: undecodable bytes (a crash can leave NULs), wrong field counts, and an
    unterminated last line (a prefix of a row can look like a row).
    """
    path = Path(path)
    if not path.exists():
        return Records([])
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        episodes, skipped = read_episodes_jsonl(str(path))
        records = Records(episodes, skipped)
    else:
        records = _read_csv(path.read_bytes())
    if records.n_skipped:
        logger.warning("%s: skipped %d malformed or unfinished line(s)", path, records.n_skipped)
    return records


def _read_csv(data: bytes) -> Records:
    raw_lines = data.split(b"\n")
    complete, tail = raw_lines[:-1], raw_lines[-1]
    skipped = 1 if tail.strip() else 0
    lines: List[str] = []
    for raw in complete:
        try:
            text = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError:
            skipped += 1
            continue
        if "\x00" in text:
            skipped += 1
        elif text.strip():
            lines.append(text)
    records = _parse_csv(lines)
    records.n_skipped += skipped
    return records


def _parse_csv(lines: List[str]) -> Records:
    if not lines:
        return Records([])
    header = tuple(_csv_fields(lines[0]) or ())
    rows, skipped = [], 0
    for text in lines[1:]:
        fields = _csv_fields(text)  # line by line: a stray quote must not swallow the next row
        if fields is None or len(fields) != len(header) or tuple(fields) == header:
            skipped += 1
        else:
            rows.append(dict(zip(header, fields)))
    return Records(rows, skipped, header)


def _csv_fields(text: str) -> Optional[List[str]]:
    try:
        return next(csv.reader([text], strict=True))
    except csv.Error:
        return None


def _column(rows: Sequence[Mapping[str, Any]], name: str) -> np.ndarray:
    """Values of one column as floats; missing, empty and non-finite values are NaN."""
    return np.array([as_number(row.get(name)) for row in rows], dtype=float)


# ----------------------------------------------------------------------------- figures


def _new_figure(nrows: int, ncols: int, figsize: Tuple[float, float], **subplots_kw: Any):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        logger.warning("cannot plot evidence without matplotlib (%s); pip install matplotlib", exc)
        return None, None
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False, **subplots_kw)


PNG_COLOURS = 128
"""Evidence figures are saved as palette PNGs of this many colours: a plot is a few flat colours
and their antialiased edges, so to the eye the same as matplotlib's RGBA PNG, at a third of the
size (which every report page that shows them carries)."""


def palette_png(rgba_png: bytes, colours: int = PNG_COLOURS) -> bytes:
    """`rgba_png` as an optimised palette PNG of `colours` colours (Pillow, which matplotlib needs)."""
    from PIL import Image

    with Image.open(io.BytesIO(rgba_png)) as image:
        quantised = image.convert("RGB").quantize(colors=colours, dither=Image.Dither.NONE)
    buffer = io.BytesIO()
    quantised.save(buffer, format="png", optimize=True)
    return buffer.getvalue()


def figure_png(path: Path) -> bytes:
    """An evidence figure's PNG as a palette PNG (`palette_png`): what a page shows of a file written
    before evidence figures were palette PNGs, at a third of its size."""
    return palette_png(Path(path).read_bytes())


def _save_figure(fig, path: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=DPI, format="png")
    return atomic_write(path, palette_png(buffer.getvalue()))


@dataclass(frozen=True)
class _Series:
    column: str
    label: str
    color: str
    band: Optional[str] = None
    """Column holding a ±1 standard deviation, drawn as a shaded band."""
    binomial: bool = False
    """A rate over the row's `episodes`: drawn with its exact (Clopper–Pearson) 95% interval."""
    style: str = "-"


@dataclass(frozen=True)
class _Panel:
    title: str
    ylabel: str
    series: Tuple[_Series, ...]
    rate: bool = False
    """Values are fractions: fix the y range to [0, 1]."""
    note_if_flat: Optional[str] = None
    """Leave the panel out when its one series holds no values or a single value, and say so in the
    figure's title instead ("{value}" is replaced by that value): e.g. KL, which TRL does not
    compute with beta = 0, and a constant learning rate."""


def _x_axis(rows: Sequence[Mapping[str, Any]]) -> Tuple[np.ndarray, str]:
    steps = _column(rows, "step")
    if np.isfinite(steps).any():
        return steps, "training step [optimizer updates]"
    return np.arange(len(rows), dtype=float), "log row (no step recorded)"


def _binomial_interval(rate: np.ndarray, n: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Clopper–Pearson 95% interval (scipy's `binomtest(...).proportion_ci()`) of rates measured
    on `n` episodes each (NaN where unknown)."""
    from scipy.stats import binomtest

    low, high = np.full(np.shape(rate), np.nan), np.full(np.shape(rate), np.nan)
    for i, (r, count) in enumerate(zip(rate, n)):
        if not (np.isfinite(r) and np.isfinite(count) and round(count) >= 1 and 0.0 <= r <= 1.0):
            continue  # not a rate over a count of episodes
        episodes = int(round(count))
        interval = binomtest(int(round(r * episodes)), episodes).proportion_ci(0.95)
        low[i], high[i] = interval.low, interval.high
    return low, high


def _draw_panel(ax, x: np.ndarray, rows: Sequence[Mapping[str, Any]], panel: _Panel, xlabel: str) -> None:
    drawn = 0
    order = np.argsort(x, kind="stable")  # rows from several processes or a resumed run arrive out of order
    for s in panel.series:
        y = _column(rows, s.column)[order]
        xs = x[order]
        ok = np.isfinite(xs) & np.isfinite(y)
        if not ok.any():
            continue
        marker = "o" if ok.sum() <= _MARKER_MAX_POINTS else None
        ax.plot(xs[ok], y[ok], s.style, color=s.color, label=s.label, marker=marker, markersize=3, lw=1.5)
        if s.band:
            spread = _column(rows, s.band)[order]
            good = ok & np.isfinite(spread)
            if good.any():
                ax.fill_between(
                    xs[good],
                    (y - spread)[good],
                    (y + spread)[good],
                    color=s.color,
                    alpha=0.2,
                    lw=0,
                    label=f"± 1 std ({s.band})",
                )
        if s.binomial:
            low, high = _binomial_interval(y, _column(rows, "episodes")[order])
            good = ok & np.isfinite(low) & np.isfinite(high)
            if good.any():  # the CSV (the seed's columns) holds rates and counts, not per-episode rewards
                ax.errorbar(
                    xs[good],
                    y[good],
                    yerr=[(y - low)[good], (high - y)[good]],
                    fmt="none",
                    ecolor=s.color,
                    elinewidth=1,
                    capsize=3,
                    alpha=0.7,
                )
        drawn += 1
    ax.set_title(panel.title, fontsize=10)
    ax.set_ylabel(panel.ylabel)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.25)
    if panel.rate:
        ax.set_ylim(-0.02, 1.02)
    if drawn:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "not logged yet", transform=ax.transAxes, ha="center", va="center", color="0.5")


def _render_csv_panels(
    csv_path: Path, png_path: Path, title: str, panels: Sequence[_Panel], ncols: int = 1
) -> Optional[Path]:
    """Draw `panels` (one per axes, sharing the step axis) from a CSV log; None if nothing to draw."""
    rows = read_records(csv_path).rows
    if not rows:
        return None
    x, xlabel = _x_axis(rows)
    has_data = any(
        (np.isfinite(x) & np.isfinite(_column(rows, s.column))).any() for panel in panels for s in panel.series
    )
    if not has_data:
        return None
    notes, shown = [], []
    for panel in panels:
        values = np.unique(_column(rows, panel.series[0].column)) if panel.note_if_flat else None
        values = None if values is None else values[np.isfinite(values)]
        if values is not None and values.size <= 1:
            notes.append(panel.note_if_flat.format(value=f"{values[0]:.3g}" if values.size else "none"))
        else:
            shown.append(panel)
    nrows = math.ceil(len(shown) / ncols)
    fig, axes = _new_figure(nrows, ncols, (max(8.0, 6.0 * ncols), 2.9 * nrows + 0.8))
    if fig is None:
        return None
    for ax, panel in zip(axes.flat, shown):
        _draw_panel(ax, x, rows, panel, xlabel)
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_visible(False)
    subtitle = f"{len(rows)} rows of {Path(csv_path).name}" + "".join(f"; {note}" for note in notes)
    fig.suptitle(f"{title}\n({subtitle})", fontsize=11)
    return _save_figure(fig, png_path)


_TRAINING_PANELS = (
    _Panel(
        "Reward of sampled completions",
        "mean reward per completion",
        (_Series("reward", "mean reward", "#1d4ed8", band="reward_std"),),
    ),
    _Panel("GRPO loss", "loss", (_Series("loss", "loss", "#c026d3"),)),
    _Panel(
        "KL divergence to the reference policy",
        "KL [nats per token]",
        (_Series("kl", "KL", "#ea580c"),),
        note_if_flat="KL not computed (beta = 0: no reference model)",
    ),
    _Panel("Gradient norm (before clipping)", "‖g‖₂", (_Series("grad_norm", "gradient norm", "#0f766e"),)),
    _Panel(
        "Learning rate schedule",
        "learning rate",
        (_Series("learning_rate", "learning rate", "#64748b"),),
        note_if_flat="learning rate constant at {value}",
    ),
    _Panel("Wall-clock time", "elapsed [s]", (_Series("wall_time_s", "wall time", "#0f172a"),)),
)

_COMPONENT_PANELS = (
    _Panel(
        "Reward per rollout, by component",
        "mean reward per episode",
        (
            _Series("mean_cumulative", "total (cumulative)", "#0f172a"),
            _Series("mean_terminal", "terminal grade", "#1d4ed8"),
            _Series("mean_step_shaping", "step shaping", "#9333ea", style="--"),
        ),
    ),
    _Panel(
        "Outcome rates over the rollouts of each logging step",
        "fraction of episodes",
        (
            _Series("discovered_rate", "discovery claimed", "#16a34a"),
            _Series("mass_correct_rate", "mass correct", "#9333ea", style="--"),
            _Series("channel_correct_rate", "channel correct", "#ea580c", style="--"),
            _Series("spin_correct_rate", "spin correct", "#0891b2", style="--"),
            _Series("parsed_rate", "action parsed", "#64748b", style=":"),
        ),
        rate=True,
    ),
    _Panel("Episode length", "mean steps per episode", (_Series("mean_n_steps", "steps", "#0f766e"),)),
)

_CHECKPOINT_PANELS = (
    _Panel(
        "Mean episode reward on the held-out suite",
        "mean episode reward",
        (_Series("mean_reward", "mean reward", "#1d4ed8"),),
    ),
    _Panel(
        "Held-out rates (success = correct discovery or correct null; 95% exact intervals)",
        "fraction of episodes",
        (
            _Series("success_rate", "success (correct outcome)", "#16a34a", binomial=True),
            _Series("mass_acc", "mass accuracy", "#9333ea", style="--"),
            _Series("channel_acc", "channel accuracy", "#ea580c", style="--"),
        ),
        rate=True,
    ),
)


def render_training_curve(csv_path: Path, png_path: Path) -> Optional[Path]:
    """Every training_log.csv column against step; None (nothing written) without data."""
    return _render_csv_panels(csv_path, png_path, "CERNenv GRPO training", _TRAINING_PANELS, ncols=2)


def render_reward_components(csv_path: Path, png_path: Path) -> Optional[Path]:
    """Terminal grade vs step shaping, and outcome rates, per logging step; None without data."""
    return _render_csv_panels(csv_path, png_path, "CERNenv reward components during training", _COMPONENT_PANELS)


def render_checkpoint_progression(csv_path: Path, png_path: Path) -> Optional[Path]:
    """Held-out reward and success/mass/channel rates at each checkpoint; None without data."""
    return _render_csv_panels(csv_path, png_path, "CERNenv held-out evaluation during training", _CHECKPOINT_PANELS)


# ----------------------------------------------------------------------------- before / after

_RATE_LABELS = {
    "success_rate": "success\n(correct outcome)",
    "mass_acc": "mass\naccuracy",
    "channel_acc": "channel\naccuracy",
    "spin_acc": "spin\naccuracy",
}


def _draw_bars(ax, keys: Sequence[str], payload: Mapping[str, Any]) -> None:
    width = 0.38
    x = np.arange(len(keys))
    for offset, side, color, label in (
        (-width / 2, "pre", "#94a3b8", "before training"),
        (width / 2, "post", "#1d4ed8", "after training"),
    ):
        stats, cis = payload[side], payload[f"{side}_ci95"]
        if not stats["n"]:
            continue
        for i, key in enumerate(keys):
            if stats[key] is None:
                continue
            low, high = cis[key]
            ax.bar(
                x[i] + offset,
                stats[key],
                width,
                color=color,
                yerr=[[stats[key] - low], [high - stats[key]]],
                capsize=4,
                ecolor="#0f172a",
                label=f"{label} (n={stats['n']})" if i == 0 else None,
            )
    for i, key in enumerate(keys):
        delta = payload["delta"].get(key)
        if delta is None:
            continue
        text = f"Δ {delta:+.2f}"
        ci = payload["delta_ci95"].get(key)
        if ci is not None:
            text += f"\n95% CI [{ci[0]:+.2f}, {ci[1]:+.2f}]"
        ax.annotate(
            text,
            xy=(x[i], 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, -4),
            textcoords="offset points",
            ha="center",
            va="top",
            fontsize=8,
        )
    ax.set_xticks(x, [_RATE_LABELS.get(k, k.replace("_", " ")) for k in keys])
    ax.axhline(0, color="0.3", lw=0.8)
    ax.grid(axis="y", alpha=0.25)


def _render_summary(payload: Mapping[str, Any], png_path: Path) -> Optional[Path]:
    fig, axes = _new_figure(1, 2, (11, 4.8), width_ratios=[1, 3])
    if fig is None:
        return None
    reward_ax, rate_ax = axes[0]
    _draw_bars(reward_ax, ["mean_reward"], payload)
    reward_ax.set_ylabel("mean episode reward")
    reward_ax.set_title("Mean episode reward")
    lo, hi = reward_ax.get_ylim()
    reward_ax.set_ylim(lo, hi + 0.35 * (hi - lo))  # room for the Δ label
    _draw_bars(rate_ax, [k for k in SUMMARY_METRICS if k != "mean_reward"], payload)
    rate_ax.set_ylim(0, 1.3)
    rate_ax.set_ylabel("fraction of episodes (accuracies: particle exists)")
    rate_ax.set_title("Outcome rates")
    handles, labels = reward_ax.get_legend_handles_labels()
    if handles:
        rate_ax.legend(handles, labels, loc="upper right", bbox_to_anchor=(1.0, 0.83), fontsize=8)
    fig.suptitle(
        f"CERNenv before vs after training: error bars are 95% bootstrap intervals "
        f"(Δ intervals {payload['bootstrap']['pairing']})",
        fontsize=11,
    )
    return _save_figure(fig, png_path)


def _shared_bins(values: np.ndarray, max_bins: int = 40) -> np.ndarray:
    low, high = float(values.min()), float(values.max())
    if low == high:
        return np.array([low - 0.5, high + 0.5])
    edges = np.histogram_bin_edges(values, bins="auto")
    return edges if len(edges) - 1 <= max_bins else np.linspace(low, high, max_bins + 1)


def _render_distribution(
    pre: Sequence[Mapping[str, Any]], post: Sequence[Mapping[str, Any]], png_path: Path
) -> Optional[Path]:
    sides = [
        (label, color, np.array([v for _, v in episode_values(eps, "mean_reward")]))
        for label, color, eps in (("before training", "#94a3b8", pre), ("after training", "#1d4ed8", post))
    ]
    sides = [s for s in sides if s[2].size]
    if not sides:
        return None
    fig, axes = _new_figure(1, 1, (8, 4.6))
    if fig is None:
        return None
    ax = axes[0, 0]
    bins = _shared_bins(np.concatenate([values for _, _, values in sides]))
    for label, color, values in sides:
        weights = np.full(values.size, 1.0 / values.size)  # fractions: comparable when n differ
        ax.hist(values, bins=bins, weights=weights, histtype="stepfilled", alpha=0.35, color=color)
        ax.hist(
            values,
            bins=bins,
            weights=weights,
            histtype="step",
            lw=1.8,
            color=color,
            label=f"{label}: n={values.size}, mean={values.mean():+.2f}",
        )
        ax.axvline(values.mean(), color=color, ls="--", lw=1.2)
    ax.set_xlabel("episode cumulative reward (step rewards + terminal grade)")
    ax.set_ylabel("fraction of episodes per bin")
    ax.set_title(
        f"Episode reward distribution, before vs after training ({len(bins) - 1} shared bins; dashed: means)",
        fontsize=10,
    )
    ax.grid(alpha=0.25)
    ax.legend(fontsize=8)
    return _save_figure(fig, png_path)


def _render_before_after(
    pre_jsonl: Path,
    post_jsonl: Path,
    summary_png: Path,
    distribution_png: Path,
    metrics_json: Path,
    training_log_csv: Optional[Path] = None,
) -> Tuple[Optional[Dict[str, Any]], Dict[str, Optional[Path]]]:
    pre, post = read_records(pre_jsonl).rows, read_records(post_jsonl).rows
    written: Dict[str, Optional[Path]] = {"metrics_json": None, "summary_png": None, "distribution_png": None}
    if not pre and not post:
        return None, written
    payload = before_after_metrics(pre, post)
    if training_log_csv is not None:
        payload["training_reward_trend"] = training_reward_trend(read_records(training_log_csv).rows)
    payload["sources"] = {"pre": str(pre_jsonl), "post": str(post_jsonl)}
    written["metrics_json"] = write_json(metrics_json, payload)
    written["summary_png"] = _render_summary(payload, summary_png)
    written["distribution_png"] = _render_distribution(pre, post, distribution_png)
    return payload, written


def render_before_after(
    *, pre_jsonl: Path, post_jsonl: Path, summary_png: Path, distribution_png: Path, metrics_json: Path
) -> Optional[Dict[str, Any]]:
    """Before/after metrics JSON, bar chart with 95% intervals and shared-bin reward histogram.

    Returns the JSON payload, or None (nothing written) when neither file holds an episode;
    with one side only, that side is drawn and deltas are null. JSON keys: `pre`/`post`
    (n, n_with_particle, n_correct, mean_reward, median_reward, success_rate = correct_outcome
    rate, mass_acc/channel_acc/spin_acc over episodes whose particle exists, None counted wrong),
    `delta` (post − pre), `pre_ci95`/`post_ci95` (bootstrap interval of each mean),
    `delta_ci95` (interval of post − pre for mean_reward and success_rate), `n`,
    `bootstrap` (pairing "paired" or "unpaired", resamples, numpy seed), `training_reward_trend`
    (`lib.measure.comparison.training_reward_trend` of training_log.csv, in `render_all`), and `groups`: the
    same keys (with `pairing` in place of `bootstrap`) for each group of
    `lib.measure.evaluation.GROUPS` but "all" (the unseen-particle and rediscovery parts, tasks with
    a particle and null tasks). Files written before `groups` and `n_correct` existed still
    render with `before_after_markdown`.
    """
    return _render_before_after(
        Path(pre_jsonl), Path(post_jsonl), Path(summary_png), Path(distribution_png), Path(metrics_json)
    )[0]


# ----------------------------------------------------------------------------- trajectories


def render_sample_trajectories(
    *, pre_jsonl: Path, post_jsonl: Path, md_path: Path, n_samples: int = 3
) -> Optional[Path]:
    """Markdown of sample episodes before and after training; None without episodes.

    Opens with the correct outcomes before → after per part of the suite (`correct_by_part`).
    Samples are chosen per part (`lib.measure.evaluation.PARTS`), `n_samples` each: when both files
    hold the same tasks, the same tasks are shown before and after, chosen evenly over the
    pre-training reward ranking; otherwise each side's own episodes are chosen that way.
    Every step lists its action, key parameters, reward and rule violations.
    """
    pre, post = read_records(Path(pre_jsonl)).rows, read_records(Path(post_jsonl)).rows
    if not pre and not post:
        return None
    md = [
        "# CERNenv: sample trajectories before and after training",
        "",
        "Correct outcomes, before → after training:",
        "",
    ]
    md += [f"- {line}" for line in correct_by_part(pre, post)] + [""]
    by_part = {
        part: (
            [e for e in pre if part_of(e.get("scenario")) == part],
            [e for e in post if part_of(e.get("scenario")) == part],
        )
        for part in PARTS
    }
    if same_tasks(pre, post):
        pairs = [
            (part, pair)
            for part, (part_pre, part_post) in by_part.items()
            for pair in sample_pairs(part_pre, part_post, n_samples)
        ]
        md += [
            f"The same {len(pairs)} task(s) before and after training, up to {n_samples} per part of the "
            f"suite, spread from the lowest to the highest pre-training reward ({len(pre)} tasks evaluated).",
            "",
        ]
        for i, (part, (before, after)) in enumerate(pairs, start=1):
            md += [f"## Task {i} · {group_label(part)}", ""]
            md += episode_markdown_lines(before, "Before training")
            md += episode_markdown_lines(after, "After training")
    else:
        md += [
            "Episodes spread from the lowest to the highest reward of each side and part of the suite "
            "(the two sides are different tasks).",
            "",
        ]
        for side, label in ((0, "Before training"), (1, "After training")):
            md += [f"## {label} ({len((pre, post)[side])} episodes)", ""]
            chosen = [
                (part, episode)
                for part, episodes in by_part.items()
                for episode in spread_by_reward(episodes[side], n_samples)
            ]
            for i, (part, episode) in enumerate(chosen, start=1):
                md += episode_markdown_lines(episode, f"Episode {i} of {len(chosen)} · {group_label(part)}")
            if not chosen:
                md += ["_No episodes yet._", ""]
    text = "\n".join(md)
    return atomic_write(Path(md_path), lambda tmp: Path(tmp).write_text(text))


# ----------------------------------------------------------------------------- everything


def render_all(paths: EvidencePaths) -> Dict[str, Optional[Path]]:
    """Regenerate every PNG, JSON and Markdown artifact from the data that exist.

    Keys are `EvidencePaths` attribute names; a value is None when there was nothing to
    render or rendering failed (logged, never raised: a training callback must not die
    because a plot did).
    """
    plots = {
        "training_curve_png": lambda: render_training_curve(paths.training_log_csv, paths.training_curve_png),
        "reward_components_png": lambda: render_reward_components(
            paths.reward_components_csv, paths.reward_components_png
        ),
        "checkpoint_progression_png": lambda: render_checkpoint_progression(
            paths.checkpoint_evals_csv, paths.checkpoint_progression_png
        ),
        "sample_trajectories_md": lambda: render_sample_trajectories(
            pre_jsonl=paths.pre_eval_jsonl, post_jsonl=paths.post_eval_jsonl, md_path=paths.sample_trajectories_md
        ),
    }
    out: Dict[str, Optional[Path]] = {}
    for key, render in plots.items():
        try:
            out[key] = render()
        except Exception:
            logger.exception("rendering %s failed; the other evidence is still rendered", key)
            out[key] = None
    written: Dict[str, Optional[Path]] = {}
    try:
        written = _render_before_after(
            paths.pre_eval_jsonl,
            paths.post_eval_jsonl,
            paths.before_after_summary_png,
            paths.reward_distribution_png,
            paths.before_after_metrics_json,
            paths.training_log_csv,
        )[1]
    except Exception:
        logger.exception("rendering the before/after metrics failed; the other evidence is still rendered")
    out["before_after_metrics_json"] = written.get("metrics_json")
    out["before_after_summary_png"] = written.get("summary_png")
    out["reward_distribution_png"] = written.get("distribution_png")
    return out


__all__ = [
    "EvidencePaths",
    "TrainingLogWriter",
    "RewardComponentLogWriter",
    "CheckpointEvalWriter",
    "Records",
    "read_records",
    "render_training_curve",
    "render_reward_components",
    "render_checkpoint_progression",
    "render_before_after",
    "render_sample_trajectories",
    "render_all",
]
