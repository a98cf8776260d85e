"""The evidence's figures: the training logs' curves (`plot_training_curve`,
`plot_reward_components`, `plot_checkpoint_progression`, drawn from rows already read; the
`render_*` forms read one file first) and the before/after panels `lib.report.evidence` draws.

Renderers draw what exists and never raise on missing, empty or partial data: with
nothing to show they return None and write nothing (an artifact on disk always holds
evidence; no placeholder images). Outputs are written to a temporary file and renamed,
so a server publishing the folder never serves half a PNG. Figures are built with
`matplotlib.figure.Figure` on an Agg canvas: no pyplot, no global backend or style change.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Tuple

import numpy as np

from lib.episodes.records import ENDINGS
from lib.files import atomic_write
from lib.measure.comparison import (
    SUMMARY_METRICS,
    episode_values,
)
from lib.report.evidence_logs import Records, _column, read_records

logger = logging.getLogger("lib.report.evidence")

DPI = 140
_MARKER_MAX_POINTS = 60  # below this many points, mark each one (a lone point is invisible as a line)


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
    """A rate over the row's `count` column: drawn with its exact (Clopper–Pearson) 95% interval."""
    style: str = "-"
    count: str = "episodes"
    """With `binomial`: the column of how many episodes (or actions) the rate is over."""
    interval: Optional[Tuple[str, str]] = None
    """Columns of a mean's 95% interval (low, high), drawn as error bars where the row has them."""


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


_MARKERS = ("o", "s", "^", "D", "v")


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
    without_interval = []
    order = np.argsort(x, kind="stable")  # rows from several processes or a resumed run arrive out of order
    for index, s in enumerate(panel.series):
        y = _column(rows, s.column)[order]
        xs = x[order]
        ok = np.isfinite(xs) & np.isfinite(y)
        if not ok.any():
            continue
        # each series its own marker, each smaller than the last: equal series stay visible, not hidden
        marker = _MARKERS[index % len(_MARKERS)] if ok.sum() <= _MARKER_MAX_POINTS else None
        size = max(2.5, 5.5 - 1.5 * index)
        ax.plot(xs[ok], y[ok], s.style, color=s.color, label=s.label, marker=marker, markersize=size, lw=1.5)
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
        if s.binomial or s.interval:
            if s.interval:
                low, high = (_column(rows, column)[order] for column in s.interval)
            else:
                low, high = _binomial_interval(y, _column(rows, s.count)[order])
            good = ok & np.isfinite(low) & np.isfinite(high)
            if not good.any():
                without_interval.append(s.label)
            if good.any():
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
    missing = "\n(an older file: no interval for " + (
        f"{without_interval[0]})" if len(without_interval) == 1 else f"{len(without_interval)} of the series)"
    )
    ax.set_title(panel.title + (missing if without_interval else ""), fontsize=10)
    ax.set_ylabel(panel.ylabel)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.25)
    if panel.rate:
        ax.set_ylim(-0.02, 1.02)
    finite_x = x[np.isfinite(x)]
    if finite_x.size and np.all(finite_x == np.round(finite_x)):  # steps: no fractional ticks
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if drawn:  # beside the axes, never over the data
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    else:
        ax.text(0.5, 0.5, "not logged yet", transform=ax.transAxes, ha="center", va="center", color="0.5")


def _plot_log_panels(
    log: Records, png_path: Path, title: str, panels: Sequence[_Panel], ncols: int = 1
) -> Optional[Path]:
    """Draw `panels` (one per axes, sharing the step axis) from a CSV log's rows; None if nothing to draw."""
    rows = log.rows
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
    subtitle = f"{len(rows)} rows of {log.source or 'the log'}" + "".join(f"; {note}" for note in notes)
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
        "Reward per rollout, by component (95% bootstrap intervals)",
        "mean reward per episode",
        tuple(
            _Series(column, label, color, style=style, interval=(f"{column}_low", f"{column}_high"))
            for column, label, color, style in (
                ("mean_cumulative", "total (cumulative)", "#0f172a", "-"),
                ("mean_terminal", "terminal grade", "#1d4ed8", "-"),
                ("mean_step_shaping", "step shaping", "#9333ea", "--"),
            )
        ),
    ),
    _Panel(
        "Outcome rates of each step's rollouts (95% exact intervals)",
        "fraction of episodes",
        tuple(
            _Series(column, label, color, style=style, binomial=True, count=f"{column}_n")
            for column, label, color, style in (
                ("discovered_rate", "discovery claimed", "#16a34a", "-"),
                ("mass_correct_rate", "mass correct (of the particle episodes graded)", "#9333ea", "--"),
                ("channel_correct_rate", "channel correct", "#ea580c", "--"),
                ("spin_correct_rate", "spin correct", "#0891b2", "--"),
                ("parsed_rate", "action parsed (of the actions)", "#64748b", ":"),
            )
        ),
        rate=True,
    ),
    _Panel("Episode length", "mean steps per episode", (_Series("mean_n_steps", "steps", "#0f766e"),)),
)


def _checkpoint_panels(split: str) -> Tuple[_Panel, ...]:
    """The checkpoint figure's panels, naming the split its evaluations played."""
    return (
        _Panel(
            f"Mean episode reward on the {split} checkpoint episodes (95% bootstrap intervals)",
            "mean episode reward",
            (_Series("mean_reward", "mean reward", "#1d4ed8", interval=("mean_reward_low", "mean_reward_high")),),
        ),
        _Panel(
            f"{split.capitalize()} rates (success = correct discovery or correct null; 95% exact intervals)",
            "fraction of episodes",
            (
                _Series("success_rate", "success (correct outcome)", "#16a34a", binomial=True),
                _Series(
                    "mass_acc", "mass accuracy", "#9333ea", style="--", binomial=True, count="episodes_with_particle"
                ),
                _Series(
                    "channel_acc",
                    "channel accuracy",
                    "#ea580c",
                    style="--",
                    binomial=True,
                    count="episodes_with_particle",
                ),
            ),
            rate=True,
        ),
    )


def plot_training_curve(log: Records, png_path: Path) -> Optional[Path]:
    """Every training_log.csv column against step; None (nothing written) without data."""
    return _plot_log_panels(log, png_path, "CERNenv GRPO training", _TRAINING_PANELS, ncols=2)


def plot_reward_components(log: Records, png_path: Path) -> Optional[Path]:
    """Terminal grade vs step shaping, and outcome rates, per logging step (reward_components.csv);
    None without data."""
    return _plot_log_panels(log, png_path, "CERNenv reward components during training", _COMPONENT_PANELS)


def plot_checkpoint_progression(log: Records, png_path: Path, split: str = "held-out") -> Optional[Path]:
    """Reward and success/mass/channel rates at each checkpoint (checkpoint_evals.csv) of the evaluations
    on `split` ("held-out", "validation": `lib.measure.evaluation.split_of`); None without data."""
    title = f"CERNenv {split} evaluation during training"
    return _plot_log_panels(log, png_path, title, _checkpoint_panels(split))


def render_training_curve(csv_path: Path, png_path: Path) -> Optional[Path]:
    """`plot_training_curve` of a training_log.csv file."""
    return plot_training_curve(read_records(csv_path), png_path)


def render_reward_components(csv_path: Path, png_path: Path) -> Optional[Path]:
    """`plot_reward_components` of a reward_components.csv file."""
    return plot_reward_components(read_records(csv_path), png_path)


def render_checkpoint_progression(csv_path: Path, png_path: Path, split: str = "held-out") -> Optional[Path]:
    """`plot_checkpoint_progression` of a checkpoint_evals.csv file."""
    return plot_checkpoint_progression(read_records(csv_path), png_path, split)


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
        _annotate_top(ax, x[i], text)
    ax.set_xticks(x, [_RATE_LABELS.get(k, k.replace("_", " ")) for k in keys])
    ax.axhline(0, color="0.3", lw=0.8)
    ax.grid(axis="y", alpha=0.25)


def _draw_endings(ax, payload: Mapping[str, Any]) -> None:
    """How the episodes ended (`lib.episodes.records.ENDINGS`), before and after: a claim of either
    kind, or no claim and why; every ending either side had, counts on the bars."""
    pre, post = payload["pre"].get("endings") or {}, payload["post"].get("endings") or {}
    shown = [ending for ending in ENDINGS if ending in pre or ending in post]
    y = np.arange(len(shown))
    height = 0.38
    for offset, counts, color in ((-height / 2, pre, "#94a3b8"), (height / 2, post, "#1d4ed8")):
        values = [counts.get(ending, 0) for ending in shown]
        bars = ax.barh(y + offset, values, height, color=color)
        ax.bar_label(bars, fontsize=7, padding=2)
    ax.set_yticks(y, [ending.replace(": ", ":\n") for ending in shown], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.2 * max([1, *pre.values(), *post.values()]))
    ax.set_xlabel("episodes")
    ax.set_title("How the episodes ended")
    ax.grid(axis="x", alpha=0.25)


def _draw_null_tasks(ax, changes: Sequence[Any]) -> None:
    """The null tasks before and after (`lib.report.conclusion.Change`s of the null group): the
    right "nothing there" and the discoveries claimed where there was nothing, each side's mean with
    its 95% bootstrap interval, and the difference with its interval above the pair."""
    width = 0.38
    x = np.arange(len(changes))
    for offset, side, color, label in (
        (-width / 2, "before", "#94a3b8", "before training"),
        (width / 2, "after", "#1d4ed8", "after training"),
    ):
        for i, change in enumerate(changes):
            estimate = getattr(change, side)
            ax.bar(
                x[i] + offset,
                estimate.mean,
                width,
                color=color,
                yerr=[[estimate.mean - estimate.low], [estimate.high - estimate.mean]],
                capsize=4,
                ecolor="#0f172a",
                label=f"{label} (n={estimate.n})" if i == 0 else None,
            )
    for i, change in enumerate(changes):
        delta = change.delta
        verdict = {"harm": "\nclearly worse", "gain": "\nclearly better"}.get(change.verdict, "")
        _annotate_top(
            ax,
            x[i],
            f"Δ {delta.mean:+.2f}\n95% CI [{delta.low:+.2f}, {delta.high:+.2f}]{verdict}",
            color="#b91c1c" if change.verdict == "harm" else "black",
        )
    labels = {
        "success_rate": 'right "nothing there"\n(null-task success)',
        "false_discovery_rate": "discovery claimed,\nnothing there",
    }
    ax.set_xticks(x, [labels.get(c.metric.metric, c.metric.label) for c in changes])
    ax.set_ylim(0, 1.4)
    ax.set_ylabel("fraction of null tasks")
    ax.set_title("Null tasks (no particle)")
    ax.axhline(0, color="0.3", lw=0.8)
    ax.grid(axis="y", alpha=0.25)
    ax.legend(loc="center right", fontsize=8)


def render_summary(payload: Mapping[str, Any], png_path: Path, null_changes: Sequence[Any] = ()) -> Optional[Path]:
    """The before/after summary figure of `payload` (`lib.measure.comparison.before_after_metrics`):
    mean reward, the outcome rates, how the episodes ended (when the payload counts endings), and,
    given `null_changes` (`lib.report.conclusion.run_changes`' changes on the null tasks), a panel
    of the null tasks: success there and the false discoveries."""
    with_endings = "endings" in payload["pre"] and "endings" in payload["post"]
    ratios = [1, 3, *([2] if with_endings else []), *([1.6] if null_changes else [])]
    fig, axes = _new_figure(1, len(ratios), (2.5 * sum(ratios) + (0 if with_endings else 1), 4.8), width_ratios=ratios)
    if fig is None:
        return None
    reward_ax, rate_ax = axes[0][:2]
    if with_endings:
        _draw_endings(axes[0][2], payload)
    if null_changes:
        _draw_null_tasks(axes[0][-1], null_changes)
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


def render_distribution(
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
    from lib.report.legends import keep_legend_off_data

    keep_legend_off_data(ax)
    return _save_figure(fig, png_path)


def _annotate_top(ax: Any, x: float, text: str, color: str = "black") -> None:
    """`text` at the top of `ax`, centred over the group of bars at `x` (a difference and its interval)."""
    ax.annotate(
        text,
        xy=(x, 1.0),
        xycoords=("data", "axes fraction"),
        xytext=(0, -4),
        textcoords="offset points",
        ha="center",
        va="top",
        fontsize=8,
        color=color,
    )
