"""Plots of a CERNenv analysis in the style physicists read (mplhep).

Data are points with Poisson error bars (mplhep's, `yerr=True`: Garwood intervals, so an
empty bin has its upper bar), fitted models are lines, significances sit in the legend, and
the legend sits over no point, bar or curve (`keep_legend_off_data` makes room above the
data until it does). Each function builds its artists inside `plt.style.context(STYLE)`
(mplhep's CMS style), so importing this module leaves matplotlib's global style alone.
Every plot function takes an optional `ax` and returns the axes it drew on.

matplotlib resolves part of the text (mathtext fonts, the experiment label's offsets)
when a figure is *drawn*, not when it is built: save with `savefig` here, which draws
inside the style, and in a notebook call `use_style()` once so inline figures match.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Union

import numpy as np

try:
    import matplotlib.pyplot as plt
    import mplhep
    from matplotlib.ticker import MaxNLocator
except ModuleNotFoundError as missing:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError(
        f"lib.report.plotting needs {missing.name}, which the plot extra installs: pip install -e '.[plot]' "
        "(or `make setup`, which installs requirements.txt)",
        name=missing.name,
    ) from None

from cernenv.physics.angular import (
    BACKGROUND_B2,
    SpinResult,
    allowed_spins,
    angular_bin_probabilities,
    background_angular_probabilities,
)
from cernenv.physics.fitting import BackgroundFit, ResonanceFit
from cernenv.physics.scan import BumpScan
from cernenv.physics.shapes import background_bin_fractions, signal_bin_fractions
from cernenv.simulation import Spectrum

STYLE = mplhep.style.CMS
EXPERIMENT = "CERNenv"
# Model curves are drawn on this many sub-bins per data bin, scaled to events per data bin.
CURVE_SUBBINS = 8
LOG_Y_ABOVE = 30.0
"""A spectrum whose highest bin holds more than this many times its lowest non-empty bin is drawn
on a logarithmic count axis, as physicists draw steeply falling spectra (a dijet spectrum falls by
orders of magnitude: on a linear axis its tail, and a bump there, are flat on zero)."""
DISCOVERY_LINES_SIGMA = (3.0, 5.0)
from lib.report.legends import (  # noqa: E402,F401  (re-exported: plotting's figures use them)
    LEGEND_MARGIN,
    REFERENCE,
    data_under_legend,
    keep_legend_off_data,
)


def analysis_snapshot(env: Any) -> Dict[str, Any]:
    """The environment's current analysis objects (`CERNCollisionEnvironment.analysis_objects`:
    spectrum, resonance_fit, background_fit, scan; None until made), for plotting only."""
    return env.analysis_objects()


def use_style() -> None:
    """Make the house style global (for notebooks, whose inline figures are drawn after the cell)."""
    plt.style.use(STYLE)


def savefig(fig: plt.Figure, path: Any, **kwargs: Any) -> None:
    """`fig.savefig` drawn inside the house style (see the module docstring)."""
    with plt.style.context(STYLE):
        fig.savefig(path, **kwargs)


def show(fig: plt.Figure, *, dpi: float = 72.0) -> None:
    """Display `fig` in a notebook as a palette PNG drawn in the house style (`savefig`), and close it:
    a third of the bytes of the inline backend's RGBA PNG, which a report page carries."""
    import io

    from IPython.display import Image, display

    from lib.report.evidence_figures import palette_png

    buffer = io.BytesIO()
    savefig(fig, buffer, format="png", dpi=dpi)
    plt.close(fig)
    display(Image(data=palette_png(buffer.getvalue())))


def subplots(nrows: int = 1, ncols: int = 1, **kwargs: Any):
    """`plt.subplots` in the house style (axes made outside the style keep matplotlib's fonts)."""
    with plt.style.context(STYLE):
        kwargs.setdefault("figsize", (10 * ncols, 8 * nrows))
        kwargs.setdefault("layout", "constrained")
        return plt.subplots(nrows, ncols, **kwargs)


def _new_axes(ax: Optional[plt.Axes]) -> plt.Axes:
    return subplots()[1] if ax is None else ax


def _label(
    ax: plt.Axes, luminosity_fb: Optional[float] = None, sqrt_s_tev: Optional[float] = None, *, plain: bool = False
) -> None:
    """The experiment label (mplhep's; `plain`: the same words as one text, which is ~3× faster to
    draw: mplhep's label draws the figure three times to place its parts)."""
    if plain:
        parts = [f"{luminosity_fb:.3g} fb$^{{-1}}$" if luminosity_fb is not None else ""]
        parts += [f"({sqrt_s_tev:g} TeV)" if sqrt_s_tev is not None else ""]
        ax.set_title(f"{EXPERIMENT}", loc="left", fontweight="bold")
        ax.set_title(" ".join(p for p in parts if p), loc="right")
        return
    mplhep.label.exp_label(
        exp=EXPERIMENT,
        data=False,
        ax=ax,
        loc=0,
        lumi=None if luminosity_fb is None else f"{luminosity_fb:.3g}",
        com=None if sqrt_s_tev is None else f"{sqrt_s_tev:g}",
    )


def model_curves(spectrum: Spectrum, fit: Union[ResonanceFit, BackgroundFit]) -> Dict[str, np.ndarray]:
    """Fitted model as smooth curves in events per data bin: {"mass_gev", "background", "total"}.

    Built from `cernenv.physics.shapes` on sub-bins of the data binning, with the fit's own
    background yield and shape (p1, p2); the resolution is the spectrum's at the fitted mass.
    """
    edges = spectrum.edges_gev
    fine = np.linspace(edges[0], edges[-1], CURVE_SUBBINS * (edges.size - 1) + 1)
    per_data_bin = (edges[-1] - edges[0]) / (edges.size - 1) / np.diff(fine)
    centres = 0.5 * (fine[:-1] + fine[1:])
    b = fit.background_yield * background_bin_fractions(fine, spectrum.sqrt_s_tev, fit.p1, fit.p2)
    total = b
    if isinstance(fit, ResonanceFit):
        resolution = float(spectrum.resolution_gev(fit.mass_gev))
        total = b + fit.signal_yield * signal_bin_fractions(fine, fit.mass_gev, fit.width_gev, resolution)
    return {"mass_gev": centres, "background": b * per_data_bin, "total": total * per_data_bin}


def plot_spectrum(
    spectrum: Spectrum,
    fit: Union[ResonanceFit, BackgroundFit, None] = None,
    ax: Optional[plt.Axes] = None,
    *,
    z_local: Optional[float] = None,
    log_y: Optional[bool] = None,
    experiment_label: bool = True,
) -> plt.Axes:
    """Invariant-mass spectrum as data points; with `fit`, the fitted model as lines.

    A `ResonanceFit` draws the signal+background model (solid) and its background
    component (dashed); a `BackgroundFit` draws the background model alone. `z_local`
    (e.g. from `estimate_significance`) is written into the fit's legend entry. `log_y`: the
    count axis logarithmic (default: `steeply_falling`). `experiment_label`: mplhep's label
    (False: a plain one, faster to draw: the trajectory browser's).
    """
    with plt.style.context(STYLE):
        ax = _new_axes(ax)
        edges, counts = spectrum.edges_gev, spectrum.counts
        title = spectrum.channel
        mplhep.histplot(counts, edges, yerr=True, histtype="errorbar", color="black", label="Data", ax=ax, markersize=5)
        if fit is not None:
            curves = model_curves(spectrum, fit)
            if isinstance(fit, ResonanceFit):
                label = "S+B fit" + ("" if z_local is None else f", $Z_{{local}}$ = {z_local:.1f}σ")
                ax.plot(curves["mass_gev"], curves["total"], color="tab:red", lw=2, label=label)
                title += (
                    f"\n$m$ = {fit.mass_gev:.5g} ± {fit.mass_err_gev:.2g} GeV"
                    f"\n$N_s$ = {fit.signal_yield:.0f} ± {fit.signal_yield_err:.0f}"
                )
            background_label = "Background component" if isinstance(fit, ResonanceFit) else "Background-only fit"
            ax.plot(curves["mass_gev"], curves["background"], color="tab:blue", lw=2, ls="--", label=background_label)
        width = float(edges[1] - edges[0])
        ax.set_xlabel(spectrum.histogram.axes[0].label)
        ax.set_ylabel(f"Events / {width:.3g} GeV")
        ax.set_xlim(edges[0], edges[-1])
        # head room for the legend (the fit's numbers in its title), placed where it covers the fewest
        # points: fixed in the upper right, it sat on the data of a spectrum that falls to the right
        highest = max(float(counts.max()), 1.0)
        if steeply_falling(counts) if log_y is None else log_y:
            ax.set_yscale("log")
            lowest = 0.5 * float(counts[counts > 0].min())  # steeply_falling: some bins are filled
            ax.set_ylim(bottom=lowest, top=highest * (highest / lowest) ** 0.6)  # the same room, in decades
        else:
            ax.set_ylim(bottom=0, top=1.6 * highest)
        ax.legend(loc="best", fontsize="small", title=title, title_fontsize="small", alignment="left")
        _label(ax, spectrum.luminosity_fb, spectrum.sqrt_s_tev, plain=not experiment_label)
        keep_legend_off_data(ax)
    return ax


def steeply_falling(counts: Sequence[float], ratio: float = LOG_Y_ABOVE) -> bool:
    """Whether a spectrum's highest bin holds more than `ratio` times its lowest non-empty bin
    (`LOG_Y_ABOVE`): drawn on a logarithmic count axis."""
    counts = np.asarray(counts, dtype=float)
    filled = counts[counts > 0]
    return filled.size > 1 and float(filled.max()) > ratio * float(filled.min())


def plot_scan(scan: BumpScan, ax: Optional[plt.Axes] = None) -> plt.Axes:
    """Local significance Z(m) of the bump scan, candidates marked, 3σ and 5σ lines."""
    with plt.style.context(STYLE):
        ax = _new_axes(ax)
        mass, z = np.asarray(scan.mass_grid_gev), np.asarray(scan.z_local)
        ax.plot(
            mass,
            z,
            color="black",
            lw=2,
            label=f"Local $Z$ (best {scan.best_z_local:.1f}σ at {scan.best_mass_gev:.4g} GeV)",
        )
        if scan.candidates_gev:
            candidates = np.asarray(scan.candidates_gev)
            ax.plot(
                candidates, np.interp(candidates, mass, z), "v", color="tab:red", ms=12, ls="none", label="Candidates"
            )
        for level, colour in zip(DISCOVERY_LINES_SIGMA, ("tab:orange", "tab:red")):
            ax.axhline(level, color=colour, ls=":", lw=1.5, label=f"{level:g}σ", gid=REFERENCE)
        ax.set_xlabel("Mass hypothesis [GeV]")
        ax.set_ylabel("Local significance $Z_{local}$ [σ]")
        ax.set_xlim(mass[0], mass[-1])
        z_max = float(np.nanmax(z)) if np.isfinite(z).any() else 0.0
        ax.set_ylim(0, 1.6 * max(z_max, DISCOVERY_LINES_SIGMA[-1] + 0.5))
        ax.legend(loc="upper right", fontsize="small")
        _label(ax)
        keep_legend_off_data(ax)
    return ax


SPIN_PREFERENCE_2DLNL = 1.0
"""Below this 2ΔlnL between the two likeliest spins, a spin plot says that no spin is preferred."""


def plot_spin(result: SpinResult, cos_counts: Sequence[float], channel: str, ax: Optional[plt.Axes] = None) -> plt.Axes:
    """|cos θ*| of signal-region events against each spin hypothesis of a `SpinResult` (an
    `AngularMeasurement`'s, to show what a `measure_angular` step measured).

    Each hypothesis is drawn as f·A_J + (1 − f)·A_bkg with its own profiled (or given)
    signal fraction f, scaled to the observed events; the legend gives L_J / ΣL.
    """
    counts = np.asarray(cos_counts, dtype=float)
    edges = np.linspace(0.0, 1.0, counts.size + 1)
    fractions: Mapping[int, float] = result.signal_fraction_by_spin or {result.best_spin: result.signal_fraction}
    with plt.style.context(STYLE):
        ax = _new_axes(ax)
        mplhep.histplot(
            counts,
            edges,
            yerr=True,
            histtype="errorbar",
            color="black",
            label="Data (signal region)",
            ax=ax,
            markersize=5,
        )
        background = background_angular_probabilities(channel, counts.size)
        for spin, relative in result.relative_likelihood.items():
            f = fractions.get(spin, result.signal_fraction)
            expected = counts.sum() * (
                f * angular_bin_probabilities(spin, channel, counts.size) + (1.0 - f) * background
            )
            mplhep.histplot(
                expected, edges, histtype="step", lw=2, ax=ax, label=f"$J$ = {spin}: $L_J/\\Sigma L$ = {relative:.2f}"
            )
        ax.set_xlabel(r"$|\cos\theta^*|$")
        ax.set_ylabel(f"Events / {1.0 / counts.size:.2g}")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.5 * max(float(counts.max()), 1.0))
        title = (
            f"best spin {result.best_spin} ($2\\Delta\\ln L$ = {result.separation:.1f})"
            if result.separation >= SPIN_PREFERENCE_2DLNL
            else f"no spin preferred ($2\\Delta\\ln L$ = {result.separation:.2f})"
        )
        ax.legend(loc="best", fontsize="small", title=title, title_fontsize="small")
        _label(ax)
        keep_legend_off_data(ax)
    return ax


def spin_caption(channel: str, n_events: int, window: str) -> str:
    """What a reader of `plot_spin`'s figure for `channel` needs (Markdown): the events it shows,
    the spins tested there and why (Landau–Yang in γγ), their shapes and the background's in that
    channel, and whether spin 0 on that background can pass for spin 1 (`cernenv.physics.angular`)."""
    spins = allowed_spins(channel)
    b2 = BACKGROUND_B2[channel]
    parts = [f"**{channel}**: the {n_events} events within {window}, against spin {', '.join(map(str, spins))}."]
    if 1 not in spins:
        parts.append(
            "Spin 1 is not tested: a spin-1 particle cannot decay to two photons (Landau–Yang). Spin 2 goes "
            "as 1 + 6 cos²θ* + cos⁴θ* in two photons."
        )
    else:
        simplified = (
            " (a decay to two fermions' shapes, taken here for this channel too)"
            if channel
            in (
                "four_lepton",
                "dijet",
            )
            else ""
        )
        parts.append(f"Spin 1 goes as 1 + cos²θ*, spin 2 as 1 − cos⁴θ*{simplified}.")
    parts.append(f"The background here goes as 1 + {b2:g} cos²θ*, rising towards |cos θ*| = 1.")
    if 1 in spins and b2 > 1:
        parts.append(
            "Steeper than spin 1's 1 + cos²θ*: spin 0 on this background can pass for spin 1 unless the signal "
            "fraction comes from the mass fit, so read a preference for spin 1 with care."
        )
    return " ".join(parts)


def plot_reward_distributions(
    rewards_by_agent: Mapping[str, Sequence[float]], ax: Optional[plt.Axes] = None, bins: int = 24
) -> plt.Axes:
    """Episode-reward histograms of several agents on shared bins, with each mean in the legend."""
    with plt.style.context(STYLE):
        ax = _new_axes(ax)
        values = [np.asarray(v, dtype=float) for v in rewards_by_agent.values() if len(v)]
        if not values:
            ax.text(0.5, 0.5, "no episodes yet", transform=ax.transAxes, ha="center")
            return ax
        edges = np.histogram_bin_edges(np.concatenate(values), bins=bins)
        tallest = 0
        for name, rewards in rewards_by_agent.items():
            rewards = np.asarray(rewards, dtype=float)
            if rewards.size:
                counts, _, _ = ax.hist(
                    rewards,
                    bins=edges,
                    histtype="step",
                    lw=2,
                    label=f"{name}: mean {rewards.mean():+.2f}, n = {rewards.size}",
                )
                tallest = max(tallest, int(np.max(counts)))
        ax.set_xlabel("episode reward")
        ax.set_ylabel("episodes")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, tallest * 1.1 + 1)
        ax.legend(fontsize="x-small", loc="best")  # one column: two ran off the figure
        keep_legend_off_data(ax)  # the legend's lines sit in headroom above the tallest bar
    return ax


def plot_agent_comparison(
    results: Mapping[str, Mapping[str, Any]], metric: str, ax: Optional[plt.Axes] = None, label: Optional[str] = None
) -> plt.Axes:
    """One row per agent: the mean of `metric` with its 95% interval as an error bar, and its value
    written beside it, inside the frame.

    `results` maps agent → metric name → an estimate with `mean`, `low`, `high` and `n`
    (`lib.measure.evaluation.Estimate`); agents without that metric, or with n = 0, are skipped.
    A proportion (`lib.measure.metrics.PROPORTIONS`) is drawn on its whole range, 0 to 1, so that
    rates of 0 everywhere are a column of points at 0; another metric on its values' range, at
    least `MIN_SPAN_SHARE` of their size wide (equal values had an axis 1e-9 wide, offset by 1e-10).
    """
    from lib.measure.metrics import PROPORTIONS

    rows = [
        (agent, metrics[metric]) for agent, metrics in results.items() if metric in metrics and metrics[metric].n > 0
    ]
    with plt.style.context(STYLE):
        ax = _new_axes(ax)
        positions = np.arange(len(rows))[::-1]
        texts = []
        for y, (agent, est) in zip(positions, rows):
            ax.errorbar(
                [est.mean], [y], xerr=[[est.mean - est.low], [est.high - est.mean]], fmt="o", ms=9, capsize=6, lw=2
            )
            texts.append(
                ax.annotate(
                    f"{est.mean:.3g} [{est.low:.3g}, {est.high:.3g}]",
                    (est.high, y),
                    xytext=(8, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize="x-small",
                )
            )
        ax.set_yticks(positions, [agent for agent, _ in rows])
        ax.set_ylim(-0.7, len(rows) - 0.3)
        ax.set_xlabel(label or f"{metric} (95% bootstrap interval)")
        ax.ticklabel_format(axis="x", useOffset=False)
        low = min((est.low for _, est in rows), default=0.0)
        high = max((est.high for _, est in rows), default=1.0)
        if metric in PROPORTIONS:
            low, high = min(low, 0.0), max(high, 1.0)
        span = max(high - low, MIN_SPAN_SHARE * max(abs(low), abs(high)), MIN_SPAN)
        middle = 0.5 * (low + high)
        ax.set_xlim(middle - 0.55 * span, middle + 0.55 * span)
        _fit_texts_in_frame(ax, texts)
    return ax


MIN_SPAN_SHARE = 0.2
"""`plot_agent_comparison`'s narrowest axis, as a share of its values' size."""
MIN_SPAN = 0.1
"""`plot_agent_comparison`'s narrowest axis where every value is 0."""


def _fit_texts_in_frame(ax: plt.Axes, texts: Sequence[Any], tries: int = 4) -> None:
    """Widen `ax`'s x axis to the right until every one of `texts` (written right of a point) ends
    inside the frame."""
    fig = ax.figure
    for _ in range(tries):
        fig.draw_without_rendering()
        renderer = fig.canvas.get_renderer()
        frame = ax.get_window_extent(renderer)
        right = max((text.get_window_extent(renderer).x1 for text in texts), default=frame.x0)
        over = right + 0.02 * frame.width - frame.x1
        if over <= 0:
            return
        low, high = ax.get_xlim()
        # the texts stay the same size on screen: the axis grows so that the frame's last `over` pixels hold them
        ax.set_xlim(low, high + (high - low) * over / max(frame.width - over, 0.3 * frame.width))
