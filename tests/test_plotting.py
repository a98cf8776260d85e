"""lib.report.plotting draws a spectrum, its fit and a bump scan with the expected artists."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402

from cernenv import CERNCollisionEnvironment, ExperimentAction, analysis  # noqa: E402
from cernenv.physics.angular import spin_likelihoods  # noqa: E402
from cernenv.physics.fitting import fit_background_only, fit_signal_plus_background  # noqa: E402
from cernenv.physics.scan import scan_local_significance  # noqa: E402
from lib.report import plotting  # noqa: E402

SETUP = [
    ("configure_beam", {"beam_energy_tev": 13.6}),
    ("set_trigger", {"trigger": "diphoton"}),
    ("allocate_luminosity", {"luminosity_fb": 40.0}),
    ("collect_collisions", {"luminosity_fb": 40.0}),
    ("reconstruct_tracks", {"channel": "diphoton", "quality": "tight"}),
    ("select_channel", {"channel": "diphoton"}),
    ("build_invariant_mass", {}),
]


@pytest.fixture(scope="module")
def env():
    env = CERNCollisionEnvironment()
    env.reset(seed=3, scenario="higgs_diphoton_125")
    for action_type, parameters in SETUP:
        obs = env.step(ExperimentAction(action_type=action_type, parameters=parameters))
        assert not obs.rule_violations, obs.rule_violations
    return env


@pytest.fixture(scope="module")
def spectrum(env):
    return plotting.analysis_snapshot(env)["spectrum"]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _save(ax, path):
    plotting.savefig(ax.figure, path, dpi=50)
    assert path.stat().st_size > 5_000
    return path


def test_importing_plotting_leaves_the_global_style_alone():
    assert plt.rcParams["font.size"] != plotting.STYLE["font.size"]


def test_analysis_snapshot_reads_the_current_analysis(env, spectrum):
    snapshot = plotting.analysis_snapshot(env)
    assert set(snapshot) == {"spectrum", "resonance_fit", "background_fit", "scan", "angular"}
    assert spectrum.counts.sum() > 0
    with pytest.raises(RuntimeError, match="reset"):
        plotting.analysis_snapshot(CERNCollisionEnvironment())


def test_plot_spectrum_with_resonance_fit(spectrum, tmp_path):
    fit = fit_signal_plus_background(
        spectrum.edges_gev, spectrum.counts, spectrum.sqrt_s_tev, float(spectrum.resolution_gev(125.0)), 125.0
    )
    ax = plotting.plot_spectrum(spectrum, fit, z_local=4.2)
    assert any(isinstance(c, ErrorbarContainer) for c in ax.containers), "data drawn as error bars"
    assert len(ax.get_lines()) >= 2, "s+b model and background component"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("4.2σ" in label for label in labels), labels
    assert "GeV" in ax.get_xlabel() and ax.get_ylabel().startswith("Events /")
    _save(ax, tmp_path / "spectrum.png")


def test_model_curves_integrate_to_the_fitted_yields(spectrum):
    fit = fit_signal_plus_background(
        spectrum.edges_gev, spectrum.counts, spectrum.sqrt_s_tev, float(spectrum.resolution_gev(125.0)), 125.0
    )
    curves = plotting.model_curves(spectrum, fit)
    # curves are events per data bin on CURVE_SUBBINS sub-bins: their mean times the bins is the yield
    n_bins = spectrum.counts.size
    assert np.mean(curves["background"]) * n_bins == pytest.approx(fit.background_yield, rel=1e-6)
    assert np.sum(curves["total"]) / plotting.CURVE_SUBBINS == pytest.approx(spectrum.counts.sum(), rel=0.02)


def test_plot_spectrum_with_background_fit_only(spectrum, tmp_path):
    fit = fit_background_only(spectrum.edges_gev, spectrum.counts, spectrum.sqrt_s_tev)
    ax = plotting.plot_spectrum(spectrum, fit)
    assert len(ax.get_lines()) >= 1
    _save(ax, tmp_path / "background.png")


def test_plot_scan_marks_candidates_and_thresholds(spectrum, tmp_path):
    grid = np.linspace(112.0, 158.0, 47)
    scan = scan_local_significance(
        spectrum.edges_gev, spectrum.counts, spectrum.sqrt_s_tev, spectrum.resolution_gev, grid
    )
    ax = plotting.plot_scan(scan)
    horizontal = [line for line in ax.get_lines() if np.ptp(line.get_ydata()) == 0]
    assert sorted(float(line.get_ydata()[0]) for line in horizontal) == [3.0, 5.0]
    curve = ax.get_lines()[0]
    np.testing.assert_allclose(curve.get_xdata(), grid)
    if scan.candidates_gev:
        assert any(line.get_marker() == "v" for line in ax.get_lines())
    _save(ax, tmp_path / "scan.png")


def test_plot_spin(spectrum, tmp_path):
    cos_counts = spectrum.cos_counts(122.0, 128.0)
    result = spin_likelihoods(cos_counts, spectrum.channel)
    fig, ax = plotting.subplots()
    assert plotting.plot_spin(result, cos_counts, spectrum.channel, ax=ax) is ax
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert sum("$J$ =" in label for label in labels) == len(result.relative_likelihood)
    _save(ax, tmp_path / "spin.png")


def _dijet_spectrum():
    env = CERNCollisionEnvironment()
    env.reset(seed=3, scenario="dijet_2500")
    for action_type, parameters in [
        ("configure_beam", {"beam_energy_tev": 13.6}),
        ("set_trigger", {"trigger": "single_jet"}),
        ("allocate_luminosity", {"luminosity_fb": 20.0}),
        ("collect_collisions", {"luminosity_fb": 20.0}),
        ("reconstruct_tracks", {"channel": "dijet", "quality": "standard"}),
        ("select_channel", {"channel": "dijet"}),
        ("build_invariant_mass", {}),
    ]:
        obs = env.step(ExperimentAction(action_type=action_type, parameters=parameters))
        assert not obs.rule_violations, obs.rule_violations
    return plotting.analysis_snapshot(env)["spectrum"]


def test_a_steeply_falling_spectrum_is_drawn_on_a_log_scale_and_a_flat_one_on_a_linear_scale(spectrum, tmp_path):
    """A dijet spectrum falls by orders of magnitude: on a linear axis its tail (and a bump there)
    lay flat on zero. The diphoton window falls by a few times: linear, as ATLAS and CMS draw it."""
    dijet = _dijet_spectrum()
    assert plotting.steeply_falling(dijet.counts) and not plotting.steeply_falling(spectrum.counts)
    ax = plotting.plot_spectrum(dijet, fit_background_only(dijet.edges_gev, dijet.counts, dijet.sqrt_s_tev))
    assert ax.get_yscale() == "log"
    low, high = ax.get_ylim()
    filled = dijet.counts[dijet.counts > 0]
    assert 0 < low < filled.min() and high > 10 * filled.max(), "every point shown, room for the legend"
    _save(ax, tmp_path / "dijet.png")
    assert plotting.plot_spectrum(spectrum).get_yscale() == "linear"
    assert plotting.plot_spectrum(dijet, log_y=False).get_yscale() == "linear", "asked for: linear"
    plain = plotting.plot_spectrum(dijet, experiment_label=False)
    assert plain.get_title(loc="left") == "CERNenv" and "fb" in plain.get_title(loc="right")
    assert plotting.steeply_falling(np.array([0, 0, 5, 0])) is False


def _covered(ax, draw: bool = True) -> int:
    """How many drawn data points lie under `ax`'s legend: markers, and points every few pixels
    along each drawn line, bar outline and error bar (collections), so that a line crossing the
    legend between two vertices counts; lines drawn across the whole axes for reference (3σ, 5σ)
    do not (`draw`: lay the figure out first; False where it was just drawn)."""
    fig = ax.figure
    if draw:
        fig.canvas.draw()
    box = ax.get_legend().get_window_extent(fig.canvas.get_renderer())
    count = 0
    for artist in [*ax.get_lines(), *ax.patches, *ax.collections]:
        if not artist.get_visible() or artist.get_gid() == plotting.REFERENCE:
            continue
        if hasattr(artist, "get_xydata"):
            pieces = [artist.get_transform().transform(artist.get_xydata())]
            drawn_line = artist.get_linestyle() not in ("None", "none", "", " ")
        elif hasattr(artist, "get_paths"):
            pieces = [artist.get_transform().transform(path.vertices) for path in artist.get_paths()]
            drawn_line = True
        else:
            pieces = [artist.get_transform().transform(artist.get_path().vertices)]
            drawn_line = True
        for xy in pieces:
            xy = xy[np.isfinite(xy).all(axis=1)]
            if drawn_line and len(xy) > 1:  # every ~2 pixels along each segment
                steps = [np.linspace(a, b, max(2, int(np.hypot(*(b - a)) // 2) + 2)) for a, b in zip(xy[:-1], xy[1:])]
                xy = np.concatenate(steps)
            count += int(np.sum((xy[:, 0] > box.x0) & (xy[:, 0] < box.x1) & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1)))
    return count


def _clipped(fig) -> list:
    """The texts and legends of `fig` (labels, tick labels, annotations, legends) that reach past its
    edges, and the annotations that cross their axes' frame."""
    from matplotlib.text import Annotation, Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    edge = fig.bbox.padded(1)
    undrawn = set()  # the labels of ticks outside the view, which matplotlib keeps but does not draw
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
                if not low - 1e-9 * (high - low) <= tick.get_loc() <= high + 1e-9 * (high - low):
                    undrawn |= {id(tick.label1), id(tick.label2)}
    out = []
    for artist in [*fig.findobj(Text), *(ax.get_legend() for ax in fig.axes if ax.get_legend())]:
        if not artist.get_visible() or (isinstance(artist, Text) and not artist.get_text()) or id(artist) in undrawn:
            continue
        extent = artist.get_window_extent(renderer)
        if not (edge.x0 <= extent.x0 and extent.x1 <= edge.x1 and edge.y0 <= extent.y0 and extent.y1 <= edge.y1):
            out.append(artist.get_text() if isinstance(artist, Text) else "legend")
        elif isinstance(artist, Annotation) and artist.axes is not None:
            frame = artist.axes.get_window_extent(renderer)
            if not (frame.x0 <= extent.x0 and extent.x1 <= frame.x1):
                out.append(artist.get_text())
    return out


def test_the_spin_figure_shows_what_measure_angular_measured_and_changes_with_the_events(env):
    """The episode's `measure_angular` step and the figure agree (the same relative likelihoods, from
    the same events); other events give other curves; no curve hides under the legend."""
    observation = env.step(ExperimentAction(action_type="measure_angular", parameters={"mass_gev": 125.0}))
    assert not observation.rule_violations, observation.rule_violations
    angular = plotting.analysis_snapshot(env)["angular"]
    said = observation.latest_result["relative_likelihood"]
    shown = {f"spin_{j}": p for j, p in angular.result.relative_likelihood.items()}
    assert shown.keys() == said.keys() and all(abs(shown[k] - said[k]) < 1e-3 for k in said)
    fig, ax = plotting.subplots()
    plotting.plot_spin(angular.result, angular.cos_counts, angular.channel, ax=ax)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert all(f"{p:.2f}" in " ".join(labels) for p in angular.result.relative_likelihood.values())
    curves = [line.get_path().vertices[:, 1].round(6).tobytes() for line in ax.patches]
    other = spin_likelihoods(angular.cos_counts[::-1].copy(), angular.channel, angular.result.signal_fraction)
    fig2, ax2 = plotting.subplots()
    plotting.plot_spin(other, angular.cos_counts[::-1].copy(), angular.channel, ax=ax2)
    assert [line.get_path().vertices[:, 1].round(6).tobytes() for line in ax2.patches] != curves
    plt.close(fig)
    plt.close(fig2)


def test_reward_histograms_keep_their_legend_off_the_bars_and_count_whole_episodes():
    rng = np.random.default_rng(1)
    rewards = {name: rng.normal(mean, 1.0, 300) for name, mean in (("a", 0.0), ("b", 0.5), ("c", 1.0), ("d", 4.0))}
    fig, ax = plotting.subplots()
    plotting.plot_reward_distributions(rewards, ax=ax)
    assert _covered(ax) == 0
    assert all(float(tick).is_integer() for tick in ax.get_yticks())
    plt.close(fig)


def test_the_checkpoint_figure_shows_equal_series_apart_on_whole_steps_with_its_legend_beside(tmp_path):
    """Mass and channel accuracy equal at every checkpoint (as in the committed run): both visible
    (different markers and sizes), whole-number step ticks, the legend outside the data."""
    from lib.report.evidence_figures import render_checkpoint_progression

    csv = tmp_path / "checkpoint_evals.csv"
    rows = ["step,fraction_done,episodes,mean_reward,success_rate,mass_acc,channel_acc"]
    rows += [f"{step},{step / 60},21,{1.8 + step / 100},0.48,0.4,0.4" for step in (0, 20, 40, 60)]
    csv.write_text("\n".join(rows) + "\n")
    captured = {}
    import lib.report.evidence_figures as figures

    real_save = figures._save_figure
    figures._save_figure = lambda fig, path: captured.setdefault("fig", fig) and real_save(fig, path)
    try:
        render_checkpoint_progression(csv, tmp_path / "cp.png")
    finally:
        figures._save_figure = real_save
    rates = captured["fig"].axes[1]
    lines = {line.get_label(): line for line in rates.get_lines() if not line.get_label().startswith("_")}
    mass, channel = lines["mass accuracy"], lines["channel accuracy"]
    assert (mass.get_marker(), mass.get_markersize()) != (channel.get_marker(), channel.get_markersize())
    assert all(float(tick).is_integer() for tick in rates.get_xticks())
    assert _covered(rates) == 0


def _evidence_figures_drawn(monkeypatch, tmp_path, render) -> list:
    """The figures `render(figures_module, evidence_folder)` draws from the committed evidence."""
    from pathlib import Path

    import lib.report.evidence_figures as figures

    drawn: list = []
    real_save = figures._save_figure
    monkeypatch.setattr(figures, "_save_figure", lambda fig, path: (drawn.append(fig), real_save(fig, path))[1])
    render(figures, Path(__file__).resolve().parents[1] / "evidence")
    for fig in drawn:
        fig.canvas.draw()  # once per figure: the legends' places
    return drawn


def test_the_evidence_figures_keep_their_legends_off_the_data(monkeypatch, tmp_path):
    """The committed evidence's figures drawn from its logs and summary, again: no legend lies over a
    data point, a bar or a curve of its panel, and no text runs off its figure."""
    import json

    def render(figures, evidence):
        summary = json.loads((evidence / "before_after_metrics.json").read_text())
        figures.render_summary(summary, tmp_path / "summary.png")
        figures.render_training_curve(evidence / "training_log.csv", tmp_path / "curve.png")
        figures.render_reward_components(evidence / "reward_components.csv", tmp_path / "components.png")
        figures.render_checkpoint_progression(evidence / "checkpoint_evals.csv", tmp_path / "checkpoints.png")

    drawn = _evidence_figures_drawn(monkeypatch, tmp_path, render)
    covered = {ax.get_title()[:40]: _covered(ax, draw=False) for fig in drawn for ax in fig.axes if ax.get_legend()}
    assert len(drawn) == 4 and len(covered) >= 8
    assert {title: points for title, points in covered.items() if points} == {}
    assert {str(i): _clipped(fig) for i, fig in enumerate(drawn) if _clipped(fig)} == {}


@pytest.mark.slow
def test_the_evidence_reward_distribution_keeps_its_legend_off_the_data(monkeypatch, tmp_path):
    """The before/after reward distribution notebook 04 shows, from the committed episodes (both files
    read and checked: the slow part)."""
    from lib.report.evidence_logs import read_records

    def render(figures, evidence):
        pre, post = (read_records(evidence / f"{phase}_eval.jsonl.gz").rows for phase in ("pre", "post"))
        figures.render_distribution(pre, post, tmp_path / "distribution.png")

    (fig,) = _evidence_figures_drawn(monkeypatch, tmp_path, render)
    assert _covered(fig.axes[0], draw=False) == 0 and _clipped(fig) == []


def _notebook_01_episode():
    """Notebook 01's step-by-step episode (its default SEED and SCENARIO), played by the heuristic:
    its analysis then is a four-lepton spectrum and spin measurement."""
    from lib.agents.baselines import HeuristicAgent

    env, agent = CERNCollisionEnvironment(), HeuristicAgent()
    agent.reset()
    observation, results = env.reset(seed=7, scenario="higgs_diphoton_125"), []
    while not observation.done:
        observation = env.step(agent.act(observation))
        results.append(observation.latest_result)
    return plotting.analysis_snapshot(env), results


def test_every_figure_the_notebooks_draw_keeps_its_legend_off_the_data_and_all_of_its_text_in_the_figure():
    """Notebook 01's spectrum and scan and its spin figure, notebook 02's reward histograms (four agents,
    as many episodes as the smoke run plays) and notebook 04's comparison: the spin legend covered the
    tallest bin (|cos θ*| 0.8-0.9, the one that decides spin 1), the histogram's legend ran off its
    figure, the comparison's numbers ran into the frame."""
    from lib.measure.metrics import Estimate

    snapshot, results = _notebook_01_episode()
    angular = snapshot["angular"]
    z_local = next(r["z_local"] for r in reversed(results) if r.get("action") == "estimate_significance")
    figures = {}
    figures["01 spectrum"], (left, right) = plotting.subplots(1, 2)
    plotting.plot_spectrum(snapshot["spectrum"], snapshot["resonance_fit"], ax=left, z_local=z_local)
    plotting.plot_scan(snapshot["scan"] or analysis.default_bump_scan(snapshot["spectrum"]), ax=right)  # as 01 does
    figures["01 spin"], ax = plotting.subplots()
    plotting.plot_spin(angular.result, angular.cos_counts, angular.channel, ax=ax)
    rng = np.random.default_rng(2)
    rewards = {
        name: rng.normal(mean, 0.8, 6) for name, mean in (("random", -1.9), ("always-null", 0.6), ("heuristic", 5.31))
    }
    figures["02 rewards"], ax = plotting.subplots()
    plotting.plot_reward_distributions({**rewards, "oracle": rng.normal(5.5, 0.5, 6)}, ax=ax)
    figures["04 comparison"], (left, right) = plotting.subplots(1, 2, figsize=(20, 6))
    estimates = {
        agent: {"mean_reward": Estimate(-0.05, -0.117, 0.0167, 6), "success_rate": Estimate(0.0, 0.0, 0.0, 6)}
        for agent in ("random", "always-null", "heuristic", "oracle", "policy before GRPO", "policy after GRPO")
    }
    plotting.plot_agent_comparison(estimates, "mean_reward", ax=left, label="mean episode reward (95% CI)")
    plotting.plot_agent_comparison(estimates, "success_rate", ax=right, label="success rate (95% CI)")
    covered = {
        f"{name}: {ax.get_xlabel()}": _covered(ax)
        for name, fig in figures.items()
        for ax in fig.axes
        if ax.get_legend()
    }
    assert len(covered) == 4 and {axes: points for axes, points in covered.items() if points} == {}
    assert {name: _clipped(fig) for name, fig in figures.items() if _clipped(fig)} == {}
    rewards_axes = figures["02 rewards"].axes[0]
    assert rewards_axes.get_window_extent().width > 0.7 * figures["02 rewards"].bbox.width, "the axes keep their width"


def test_data_points_carry_their_poisson_error_bars_and_every_point_of_the_spin_figure_shows(spectrum):
    """The legend's symbol and notebook 01's text promised Poisson error bars that were not drawn."""
    from scipy import stats

    ax = plotting.plot_spectrum(spectrum)
    (data,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    bars = data.lines[2][0].get_segments()
    counts = spectrum.counts
    assert len(bars) == counts.size
    for n, bar in zip(counts[:12], bars[:12]):
        low = stats.chi2.ppf(stats.norm.cdf(-1), 2 * n) / 2 if n else 0.0  # Garwood's 68% interval
        high = stats.chi2.ppf(stats.norm.cdf(1), 2 * (n + 1)) / 2
        assert bar[:, 1].min() == pytest.approx(low, rel=1e-6) and bar[:, 1].max() == pytest.approx(high, rel=1e-6)

    snapshot, _ = _notebook_01_episode()
    angular = snapshot["angular"]
    fig, ax = plotting.subplots()
    plotting.plot_spin(angular.result, angular.cos_counts, angular.channel, ax=ax)
    (points,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    shown = points.lines[0].get_ydata()
    assert list(shown) == list(angular.cos_counts) and sum(shown) == angular.cos_counts.sum() == 39
    assert angular.channel == "four_lepton" and _covered(ax) == 0, "the tallest bin decides spin 1: it shows"
    assert ax.get_ylim()[1] > max(points.lines[2][0].get_segments()[i][:, 1].max() for i in range(10))


def test_a_comparison_of_zeros_is_drawn_on_the_rate_s_range_with_no_offset_and_its_numbers_in_the_frame():
    from lib.measure.metrics import Estimate

    zeros = {agent: {"success_rate": Estimate(0.0, 0.0, 0.0, 6)} for agent in ("random", "heuristic")}
    fig, ax = plotting.subplots()
    plotting.plot_agent_comparison(zeros, "success_rate", ax=ax)
    fig.canvas.draw()
    low, high = ax.get_xlim()
    assert low < 0 < 1 <= high < 1.5, "a rate: 0 to 1, the points at 0"
    assert ax.xaxis.get_offset_text().get_text() == "", "no 1e-10 offset"
    assert _clipped(fig) == []
    same = {agent: {"mean_reward": Estimate(-2.0, -2.0, -2.0, 6)} for agent in ("random", "heuristic")}
    fig, ax = plotting.subplots()
    plotting.plot_agent_comparison(same, "mean_reward", ax=ax)
    low, high = ax.get_xlim()
    assert low < -2.0 < high and high - low >= plotting.MIN_SPAN_SHARE * 2.0
    assert ax.xaxis.get_offset_text().get_text() == "" and _clipped(fig) == []


def test_the_spin_figure_s_caption_speaks_of_the_channel_it_shows():
    """Notebook 01's text spoke of diphoton and Landau-Yang beside a four-lepton figure."""
    four_lepton = plotting.spin_caption("four_lepton", 39, "±2.6 GeV of 125.1 GeV")
    assert four_lepton.startswith("**four_lepton**: the 39 events within ±2.6 GeV of 125.1 GeV, against spin 0, 1, 2")
    assert "Landau" not in four_lepton and "diphoton" not in four_lepton and "1 + 1.5 cos²θ*" in four_lepton
    diphoton = plotting.spin_caption("diphoton", 120, "±3 GeV of 125 GeV")
    assert "against spin 0, 2." in diphoton and "Landau–Yang" in diphoton and "pass for spin 1" not in diphoton


def test_the_checkpoint_figure_names_the_split_its_evaluations_played(tmp_path):
    """A run evaluated on the validation split draws "validation" in the figure's title and panels,
    never "held-out"; the split is read from the episodes' seeds (`split_of`)."""
    import lib.report.evidence_figures as figures
    from lib.measure.evaluation import heldout_suite, split_of, validation_suite

    assert split_of([{"seed": spec.seed} for spec in heldout_suite()[:5]]) == "held-out"
    assert split_of([{"seed": spec.seed} for spec in validation_suite(5)]) == "validation"
    mixed = [{"seed": heldout_suite()[0].seed}, {"seed": validation_suite(1)[0].seed}]
    assert split_of(mixed) == "evaluation" and split_of([]) == "evaluation"
    assert split_of([{"seed": 40_000}]) == "evaluation", "a training seed is neither split"
    from cernenv.suite import drawn_tasks

    assert split_of([{"seed": task.seed} for task in drawn_tasks(3)]) == "evaluation", "a fresh draw is neither"
    csv = tmp_path / "checkpoint_evals.csv"
    rows = ["step,fraction_done,episodes,mean_reward,success_rate,mass_acc,channel_acc"]
    rows += [f"{step},{step / 8},60,3.5,0.7,0.6,0.6" for step in (0, 4, 8)]
    csv.write_text("\n".join(rows) + "\n")
    captured = []
    real_save = figures._save_figure
    figures._save_figure = lambda fig, path: (captured.append(fig), real_save(fig, path))[1]
    try:
        figures.render_checkpoint_progression(csv, tmp_path / "cp.png", "validation")
    finally:
        figures._save_figure = real_save
    (fig,) = captured
    texts = [fig._suptitle.get_text()] + [ax.get_title() for ax in fig.axes]
    assert texts[0].startswith("CERNenv validation evaluation during training")
    assert any(t.startswith("Validation rates") for t in texts) and any("validation checkpoint" in t for t in texts)
    assert not any("held-out" in t.lower() for t in texts)
