"""Replays rebuild the physics of a recorded episode; the trajectory browser shows each step."""

import io
import json
from dataclasses import asdict

import ipywidgets as widgets
import pytest

from cernenv import CERNCollisionEnvironment
from lib.agents.baselines import HeuristicAgent
from lib.episodes.agent_rollouts import collect_agent_episode
from lib.report.browser import TrajectoryBrowser, browser_pairs, prepare_episode, static_trajectory_browser
from lib.report.replay import ReplayMismatch, replay

pytestmark = pytest.mark.slow  # a real Chromium per test (`make test-slow` runs them)


def _episode(seed, **reset):
    record = collect_agent_episode(env=CERNCollisionEnvironment(), agent=HeuristicAgent(), seed=seed, **reset)
    return json.loads(json.dumps(asdict(record), default=str))  # as read back from a JSONL file


def _won_discovery():
    """The first procedural medium campaign of the evaluation seeds that the heuristic wins by a
    discovery (build, fit, claim): found, not hard-coded, so a change to the environment's
    tasks cannot quietly turn it into a null task or a loss."""
    for seed in range(900_000, 900_200):
        episode = _episode(seed, difficulty="medium")
        if episode["correct_outcome"] and episode["truth"]["exists"] and "fit_resonance" in _action_types(episode):
            return episode
    raise AssertionError("the heuristic won no medium campaign in 200 seeds")


@pytest.fixture(scope="module")
def episodes():
    return {"won": _won_discovery(), "curated": _episode(3, scenario="z_mumu_91")}


@pytest.fixture(scope="module")
def prepared(episodes):
    """The views of the two episodes that the static-browser tests show, shared by them: a view draws
    a spectrum when a browser first shows it (~2.5 s an episode), and a browser built again from it
    shows what it drew. The tests of how a view is prepared and drawn make their own."""
    return {"won": prepare_episode("post", episodes["won"]), "curated": prepare_episode("pre", episodes["curated"])}


def _action_types(episode):
    return [step["action"].get("action_type") for step in episode["steps"]]


def test_replay_rebuilds_the_spectra_and_fits(episodes):
    episode = episodes["won"]
    snapshots = replay(episode)
    assert len(snapshots) == len(episode["steps"])
    build = _action_types(episode).index("build_invariant_mass")
    assert snapshots[build - 1]["spectrum"] is None and snapshots[build]["spectrum"] is not None
    fit = _action_types(episode).index("fit_resonance")
    assert snapshots[fit - 1]["resonance_fit"] is None
    assert snapshots[fit]["resonance_fit"].mass_gev == pytest.approx(episode["truth"]["mass_gev"], rel=0.02)


def test_replay_of_a_curated_scenario_uses_that_scenario(episodes):
    episode = episodes["curated"]
    assert episode["scenario"] == "z_mumu_91"
    assert len(replay(episode)) == len(episode["steps"])


def test_replay_refuses_a_record_the_environment_does_not_reproduce(episodes):
    tampered = json.loads(json.dumps(episodes["won"]))
    tampered["steps"][2]["reward"] += 0.5
    with pytest.raises(ReplayMismatch, match="step 2"):
        replay(tampered)
    other_world = dict(episodes["won"], seed=episodes["won"]["seed"] + 1)
    with pytest.raises(ReplayMismatch):
        replay(other_world)


def test_prepared_steps_show_prompt_completion_action_and_the_spectrum_once_built(episodes):
    episode = json.loads(json.dumps(episodes["won"]))
    episode["steps"][0].update(prompt="Window 110-160 GeV <medium>", completion='{"action_type": "configure_beam"}')
    view = prepare_episode("post", episode)
    assert len(view.step_html) == len(view.spectrum_png) == len(episode["steps"])
    first = view.step_html[0]
    assert "Step 1 of" in first and "configure_beam" in first
    assert "Window 110-160 GeV &lt;medium&gt;" in first and "{&quot;action_type&quot;" in first, "escaped text"
    assert "none recorded" in view.step_html[1], "a scripted agent's step has no prompt text"
    build = _action_types(episode).index("build_invariant_mass")
    assert all(png is None for png in view.spectrum_png[:build])
    assert view.spectrum_png[build].startswith(b"\x89PNG")
    fit = _action_types(episode).index("fit_resonance")
    assert view.spectrum_png[fit] is not view.spectrum_png[build], "the fit is drawn on a new image"
    drawn = [png for png in view.spectrum_png if png is not None]
    assert len({id(png) for png in drawn}) < len(drawn), "steps that leave the spectrum alone reuse its image"
    assert "post · seed" in view.label and "success" in view.label


def _links():
    """Every jslink made so far in this process (from ipywidgets' registry of live widgets)."""
    from ipywidgets.widgets import widget
    from ipywidgets.widgets.widget_link import Link

    registry = getattr(widget, "_instances", None) or widgets.Widget.widgets
    return [w for w in registry.values() if isinstance(w, Link)]


def _walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _walk(child)


def test_static_browser_links_menu_and_slider_to_the_panels_in_the_page(prepared):
    views = [prepared["won"], prepared["curated"]]
    browser = static_trajectory_browser(views)
    show, selections, style = browser.children
    assert ".cernenv-step pre{" in style.value, "the step panels' styles, once"
    pairs = {(link.source[0].model_id, link.source[1], link.target[0].model_id, link.target[1]) for link in _links()}
    assert (show.model_id, "index", selections.model_id, "selected_index") in pairs
    assert [name for name, _ in show.options] == [
        "every episode",
        "post only",
        "pre only",
        "successes only",
        "failures only",
    ][: len(selections.children)]
    menu, stack = selections.children[0].children  # every episode
    assert [label for label, _ in menu.options] == [v.label for v in views]
    assert len(stack.children) == 2
    assert (menu.model_id, "index", stack.model_id, "selected_index") in pairs
    sliders = [w for w in _walk(stack) if isinstance(w, widgets.IntSlider)]
    # the slider counts steps from 1, as the headings do ("Step 1 of n"): panel k is step k
    assert [(s.min, s.max, s.value, s.description) for s in sliders] == [
        (1, len(v.step_html), 1, "step") for v in views
    ]
    first_steps = stack.children[0].children[2]
    assert (sliders[0].model_id, "value", first_steps.model_id, "selected_index") in pairs
    assert len(first_steps.children) == len(views[0].step_html) + 1 and first_steps.selected_index == 1
    assert "Step 1 of" in _walk_text(first_steps.children[1]) and "Step 2 of" in _walk_text(first_steps.children[2])
    spectra = stack.children[0].children[3]  # the step's spectrum below its text, on the same slider
    assert (sliders[0].model_id, "value", spectra.model_id, "selected_index") in pairs
    shown = {id(w) for w in _walk(spectra) if isinstance(w, widgets.Image)}
    distinct = {bytes(png) for png in views[0].spectrum_png if png is not None}
    assert len(shown) == len(distinct), "one Image widget per distinct image, shared by the steps that show it"
    # a selection shows the same episode panels (shared, not copied): the post-only menu holds the first one
    post_menu, post_stack = selections.children[1].children
    assert [label for label, _ in post_menu.options] == [views[0].label] and post_stack.children[0] is stack.children[0]


def test_static_browser_puts_before_and_after_of_a_task_side_by_side(episodes, prepared):
    before = dict(json.loads(json.dumps(episodes["won"])), correct_outcome=False)
    views = [prepared["won"], prepare_episode("pre", before), prepared["curated"]]
    show, selections, _ = static_trajectory_browser(views).children
    names = [name for name, _ in show.options]
    assert names[-1] == "pre | post, side by side"
    menu, stack = selections.children[-1].children
    (label,) = [label for label, _ in menu.options]  # only the task played in both phases
    assert label.startswith(f"seed {episodes['won']['seed']}") and label.endswith("pre failure → post success")
    pre_panel, post_panel = stack.children[0].children
    assert "pre · seed" in _walk_text(pre_panel) and "post · seed" in _walk_text(post_panel)
    assert {s.max for s in _walk(stack) if isinstance(s, widgets.IntSlider)} == {len(views[0].step_html)}
    every = selections.children[0].children[1].children
    assert pre_panel is every[1] and post_panel is every[0], "side by side shows the single views' own panels"
    images = [w for w in _walk(static_trajectory_browser(views)) if isinstance(w, widgets.Image)]
    assert len({id(w) for w in images}) == len({bytes(w.value) for w in images}), "one widget per distinct image"


def test_static_browser_falls_back_to_tabs_without_stack(prepared, monkeypatch):
    """ipywidgets 7 (Colab) has no Stack: the panels are a Tab, switched by the same selected_index."""
    monkeypatch.delattr(widgets, "Stack")
    browser = static_trajectory_browser([prepared["curated"]])
    assert isinstance(browser.children[1], widgets.Tab)
    menu, stack = browser.children[1].children[0].children
    assert isinstance(stack, widgets.Tab) and isinstance(stack.children[0].children[2], widgets.Tab)


def test_a_record_the_environment_does_not_reproduce_is_shown_without_spectra_and_says_why(episodes):
    tampered = json.loads(json.dumps(episodes["won"]))
    tampered["steps"][2]["reward"] += 1.0
    view = prepare_episode("post", tampered)
    assert len(view.step_html) == len(tampered["steps"]) and all(png is None for png in view.spectrum_png)
    assert "another version of the environment" in view.note and "step 2" in view.note
    browser = static_trajectory_browser([view])
    assert "another version of the environment" in _walk_text(browser)


def test_spectra_are_drawn_when_first_shown_once_and_as_small_palette_pngs(episodes):
    view = prepare_episode("post", episodes["won"])
    build = _action_types(episodes["won"]).index("build_invariant_mass")
    assert not view.spectrum_png._drawn, "preparing an episode draws nothing"
    png = view.spectrum_png[build]
    assert len(view.spectrum_png._drawn) == 1 and view.spectrum_png[build] is png
    from PIL import Image

    with Image.open(io.BytesIO(png)) as image:
        assert image.mode == "P" and image.size == (840, 630), (image.mode, image.size)
    assert len(png) < 40_000, len(png)


def test_the_live_browser_draws_only_the_step_it_shows_and_says_what_it_is_doing(episodes, monkeypatch):
    """Choosing an episode used to replay it and draw every spectrum (5.1 s): now it replays it
    (~0.1 s) and draws the spectrum of the step shown, if it has one; a status line shows the work."""
    browser = TrajectoryBrowser({"post": [episodes["won"]], "pre": [episodes["curated"]]})
    seen = []
    drawn = []
    import lib.report.browser as module

    real = module.spectrum_png
    monkeypatch.setattr(module, "spectrum_png", lambda snapshot: drawn.append(1) or real(snapshot))
    browser.status.observe(lambda change: seen.append(change["new"]), names="value")
    browser.episode.value = browser.episode.options[1][1]
    assert drawn == [], "step 1 of a campaign has no spectrum: nothing is drawn"
    assert any("replaying" in text for text in seen) and browser.status.value == ""
    build = _action_types(episodes["curated"]).index("build_invariant_mass") + 1
    browser.step.value = build
    assert drawn == [1] and any("drawing the spectrum" in text for text in seen) and browser.status.value == ""
    browser.step.value = build + 1 if build < browser.step.max else build - 1
    browser.step.value = build
    assert len(drawn) <= 2, "a spectrum once drawn is not drawn again"


def test_browser_pairs_is_a_fair_sample_with_and_without_a_particle_success_and_failure():
    def episode(seed, exists, correct, reward, scenario="procedural_medium"):
        return {
            "seed": seed,
            "scenario": scenario,
            "difficulty": "medium",
            "truth": {"exists": exists},
            "correct_outcome": correct,
            "cumulative_reward": reward,
        }

    pre = [episode(s, s % 2 == 0, False, float(s)) for s in range(40)]
    post = [episode(s, s % 2 == 0, s % 3 == 0, float(s)) for s in range(40)]  # successes on every third task
    pre.append(episode(99, True, True, 9.0, scenario="higgs_diphoton_125"))
    post.append(episode(99, True, True, 9.0, scenario="higgs_diphoton_125"))
    pairs = browser_pairs(pre, post, 8)
    assert len(pairs) == 8 and len({b["seed"] for b, _ in pairs}) == 8
    kinds = {(b["truth"]["exists"], a["correct_outcome"]) for b, a in pairs}
    assert kinds == {(True, True), (True, False), (False, True), (False, False)}
    assert any(b["scenario"] == "higgs_diphoton_125" for b, _ in pairs), "known physics too"
    assert all(b["seed"] == a["seed"] for b, a in pairs)
    assert len(browser_pairs(pre[:3], post[:3], 8)) == 3


def test_live_browser_filters_and_steps(episodes):
    lost = dict(json.loads(json.dumps(episodes["curated"])), correct_outcome=False)
    browser = TrajectoryBrowser({"pre": [lost], "post": [episodes["won"]]})
    assert len(browser.episode.options) == 2
    browser.outcome.value = "success"
    assert [browser.entries[i][0] for _, i in browser.episode.options] == ["post"]
    assert "success" in browser.header.value
    shown = browser.text.value
    assert "Step 1 of" in shown and browser.figure.children == (browser.no_image,)
    build = _action_types(episodes["won"]).index("build_invariant_mass") + 1  # the slider counts from 1
    assert browser.step.min == 1 and browser.step.value == 1
    browser.step.value = build
    assert browser.text.value != shown and f"Step {build} of" in browser.text.value
    assert browser.figure.children == (browser.image,) and bytes(browser.image.value).startswith(b"\x89PNG")
    browser.phase.value = "pre"
    assert browser.episode.options == () and "No episode matches" in browser.header.value
    with pytest.raises(ValueError, match="no episodes"):
        TrajectoryBrowser({"pre": []})


def _walk_text(widget) -> str:
    return " ".join(w.value for w in _walk(widget) if isinstance(w, widgets.HTML))


@pytest.mark.parametrize(
    "completion, shown",
    [
        ("\n" * 300, "(nothing but whitespace: 300 characters, 300 line breaks)"),
        ("  \t ", "(nothing but whitespace: 4 characters, 0 line breaks)"),
        ('{"action_type": "scan_bump"}' + "\n" * 40, '{"action_type": "scan_bump"}'),
        ("a\n\nb\n\n\n\n\nc", "a\n\nb\n[4 blank lines]\nc"),
        (None, "(none recorded"),
    ],
)
def test_a_completion_of_blank_lines_is_named_not_drawn(completion, shown):
    from lib.report.browser import _completion_text

    text = _completion_text(completion)
    assert text.startswith(shown) and text.count("\n") <= 4
