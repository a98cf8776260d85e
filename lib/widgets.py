"""A trajectory browser: step through what an agent saw, wrote and earned, with its spectrum.

Two forms over the same step panels:

- `TrajectoryBrowser` (live) calls back into a running kernel: filter by phase
  (pre/post training), scenario and outcome, pick an episode, slide through its steps.
  Each episode is replayed in the environment when first shown (`lib.replay`).
- `static_trajectory_browser` pre-renders a few episodes and ties the controls to the
  panels with `jslink`, which runs in the browser: it keeps working in an HTML export
  of the notebook, with no kernel.

Works with ipywidgets 7 (Colab) and 8: panels are switched by `widgets.Stack` where it
exists (8) and by a `widgets.Tab` otherwise (7), through their common `selected_index`.
"""

from __future__ import annotations

import html
import io
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import ipywidgets as widgets
import matplotlib.pyplot as plt

from lib.plotting import plot_spectrum, savefig, subplots
from lib.records import as_episode_dict, pair_key
from lib.replay import replay

ALL = "all"
OUTCOMES = (ALL, "success", "failure")
SPECTRUM_FIGSIZE = (10.0, 7.5)
SPECTRUM_DPI = 84
"""Spectrum images: the house figure size (its fonts are sized for it), 840 px wide, shown 420 px
wide: sharp on a high-density screen. A step shares its image with the steps before it until the
spectrum changes, so a report holds a few distinct images per episode."""
IMAGE_LAYOUT = dict(width="420px", height="auto", object_fit="contain")
ROW_LAYOUT = dict(align_items="flex-start")
"""Step text and spectrum side by side, top-aligned (a stretched row would stretch the image)."""
NO_TEXT = "(none recorded: a scripted agent reads the observation object and writes no text)"
TEXT_STYLE = "white-space:pre-wrap;font-family:monospace;font-size:12px;line-height:1.3;margin:2px 0 8px 0"
BLOCK_STYLE = "line-height:1.4"
"""The widget HTML's own line height (28 px, for one-line labels) spreads out paragraphs: reset it."""


def outcome_of(episode: Mapping[str, Any]) -> str:
    """'success' when the claim was graded correct, else 'failure'."""
    return "success" if episode.get("correct_outcome") else "failure"


def task_label(episode: Mapping[str, Any]) -> str:
    """The task an episode played: seed, scenario and difficulty."""
    return f"seed {episode.get('seed')} · {episode.get('scenario')} ({episode.get('difficulty')})"


def episode_label(phase: str, episode: Mapping[str, Any]) -> str:
    """One line naming an episode: phase, task, outcome and reward."""
    reward = episode.get("cumulative_reward", episode.get("total_reward"))
    reward_text = "?" if reward is None else f"{float(reward):+.2f}"
    return (
        f"{phase} · {task_label(episode)} · {outcome_of(episode)} · reward {reward_text} · "
        f"{len(episode.get('steps') or [])} steps"
    )


def _pre(text: Any) -> str:
    return f'<pre style="{TEXT_STYLE}">{html.escape(str(text))}</pre>'


def _table(mapping: Mapping[str, Any]) -> str:
    rows = "".join(
        f"<tr><td style='padding-right:12px'>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
        for k, v in mapping.items()
    )
    return f"<table style='font-size:12px'>{rows}</table>"


def _completion_text(text: Optional[str], max_blank_lines: int = 2) -> str:
    """What a completion shows: whitespace alone is named, not drawn (a completion of newlines once
    took ~700 px of blank page); a run of blank lines longer than `max_blank_lines` is shortened
    to a marker saying how many there were."""
    if text is None or text == "":
        return NO_TEXT
    if not text.strip():
        return f"(nothing but whitespace: {len(text)} characters, {text.count(chr(10))} line breaks)"
    lines, out, blank = text.rstrip().split("\n"), [], 0
    for line in lines + [None]:
        if line is not None and not line.strip():
            blank += 1
            continue
        if blank:
            out += [""] * blank if blank <= max_blank_lines else [f"[{blank} blank lines]"]
            blank = 0
        if line is not None:
            out.append(line)
    return "\n".join(out)


def step_html(episode: Mapping[str, Any], index: int) -> str:
    """HTML of step `index`: the prompt (observation), the completion, the parsed action,
    the reward and its breakdown, rule violations and the observation summary."""
    steps = episode.get("steps") or []
    step = steps[index]
    parsed = step.get("parsed_ok")
    action = step.get("action")
    action_text = (
        json.dumps(action, default=str)
        if parsed
        else (f"not an action: {step.get('parse_error') or 'unparsed'}\nsent as is: {json.dumps(action, default=str)}")
    )
    kind = action.get("action_type", "?") if isinstance(action, Mapping) else "(unparsed)"
    breakdown = step.get("reward_breakdown") or {}
    violations = step.get("rule_violations") or []
    parts = [
        f"<b>Step {index + 1} of {len(steps)}</b>: <code>{html.escape(str(kind))}</code>, "
        f"reward {float(step.get('reward', 0.0)):+.3f}"
        + ("" if not breakdown else " (" + ", ".join(f"{k} {float(v):+.3f}" for k, v in breakdown.items()) + ")")
        + (" · episode over" if step.get("done") else ""),
        "<b>Prompt</b> (what the agent was shown)" + _pre(step.get("prompt") or NO_TEXT),
        "<b>Completion</b> (what it wrote)" + _pre(_completion_text(step.get("completion"))),
        "<b>Parsed action</b> " + ("✓" if parsed else "✗") + _pre(action_text),
        "<b>Rule violations</b>" + _pre("\n".join(map(str, violations)) or "none"),
        "<b>Observation summary</b> (before the step)" + _table(step.get("observation_summary") or {}),
    ]
    return f'<div style="{BLOCK_STYLE}">' + "".join(f"<div>{part}</div>" for part in parts) + "</div>"


def episode_header_html(phase: str, episode: Mapping[str, Any]) -> str:
    """The episode's label, its hidden truth and its grade."""
    truth = episode.get("truth") or {}
    verdicts = ", ".join(
        f"{name} {'✓' if episode.get(key) else '✗'}"
        for name, key in (
            ("discovery", "discovered"),
            ("mass", "correct_mass"),
            ("channel", "correct_channel"),
            ("spin", "correct_spin"),
        )
    )
    return (
        f'<div style="{BLOCK_STYLE}"><b>{html.escape(episode_label(phase, episode))}</b><br>'
        f"hidden truth: <code>{html.escape(json.dumps(truth, default=str))}</code><br>"
        f"graded: {verdicts}; outcome <b>{outcome_of(episode)}</b></div>"
    )


def spectrum_png(snapshot: Mapping[str, Any]) -> Optional[bytes]:
    """PNG of the spectrum in `snapshot`, with its fit (signal+background, else background-only); None before
    any spectrum was built."""
    spectrum = snapshot.get("spectrum")
    if spectrum is None:
        return None
    fit = snapshot.get("resonance_fit") or snapshot.get("background_fit")
    fig, ax = subplots(figsize=SPECTRUM_FIGSIZE)
    try:
        plot_spectrum(spectrum, fit, ax=ax)
        buffer = io.BytesIO()
        savefig(fig, buffer, format="png", dpi=SPECTRUM_DPI)
        return buffer.getvalue()
    finally:
        plt.close(fig)


NO_SPECTRUM_HTML = "<i>No spectrum yet at this step (build_invariant_mass makes one).</i>"


@dataclass
class EpisodeView:
    """One episode prepared for the browser: its step panels' HTML and a spectrum image per step."""

    phase: str
    episode: Dict[str, Any]
    step_html: List[str]
    spectrum_png: List[Optional[bytes]]

    @property
    def label(self) -> str:
        return episode_label(self.phase, self.episode)


def prepare_episode(phase: str, episode: Any) -> EpisodeView:
    """Replay `episode` and render each step; a spectrum is drawn once and reused until it changes."""
    record = as_episode_dict(episode)
    snapshots = replay(record)
    images: List[Optional[bytes]] = []
    previous_key: Tuple = ()
    previous_png: Optional[bytes] = None
    for snapshot in snapshots:
        key = tuple(id(value) for value in snapshot.values())
        if key != previous_key:
            previous_key, previous_png = key, spectrum_png(snapshot)
        images.append(previous_png)
    return EpisodeView(
        phase=phase,
        episode=record,
        step_html=[step_html(record, i) for i in range(len(snapshots))],
        spectrum_png=images,
    )


def _switcher(children: Sequence[widgets.Widget], titles: Sequence[str]) -> widgets.Widget:
    """A container that shows one child at a time, chosen by `selected_index` (Stack, or Tab on ipywidgets 7)."""
    if hasattr(widgets, "Stack"):
        return widgets.Stack(children=list(children), selected_index=0)
    tab = widgets.Tab(children=list(children))
    for index, title in enumerate(titles):
        tab.set_title(index, title)
    tab.selected_index = 0
    return tab


def _image(png: Optional[bytes], cache: Dict[int, widgets.Widget]) -> widgets.Widget:
    """One widget per distinct image (shared by every step that shows it, so the saved state stays small)."""
    key = id(png)
    if key not in cache:
        cache[key] = (
            widgets.HTML(NO_SPECTRUM_HTML)
            if png is None
            else widgets.Image(value=png, format="png", layout=IMAGE_LAYOUT)
        )
    return cache[key]


def _step_panel(view: EpisodeView, index: int, images: Dict[int, widgets.Widget], compact: bool) -> widgets.Widget:
    if compact:  # text above the spectrum: two episodes fit side by side
        text = widgets.HTML(view.step_html[index], layout=widgets.Layout(width="440px"))
        return widgets.VBox([text, _image(view.spectrum_png[index], images)])
    text = widgets.HTML(view.step_html[index], layout=widgets.Layout(width="560px"))
    return widgets.HBox([text, _image(view.spectrum_png[index], images)], layout=ROW_LAYOUT)


def _episode_panel(view: EpisodeView, compact: bool = False) -> widgets.Widget:
    """Header, a step slider and the step panels, linked in the browser (`jslink`)."""
    n_steps = len(view.step_html)
    header = widgets.HTML(episode_header_html(view.phase, view.episode))
    if n_steps == 0:
        return widgets.VBox([header, widgets.HTML("<i>This episode has no steps.</i>")])
    images: Dict[int, widgets.Widget] = {}
    # panel k is step k (1-based, as the headings count): panel 0 is never shown (the slider starts at 1)
    panels = _switcher(
        [widgets.HTML("")] + [_step_panel(view, i, images, compact) for i in range(n_steps)],
        ["-"] + [str(i + 1) for i in range(n_steps)],
    )
    panels.selected_index = 1
    slider = widgets.IntSlider(
        value=1,
        min=1,
        max=n_steps,
        description="step",
        continuous_update=True,
        layout=widgets.Layout(width="440px" if compact else "560px"),
        style={"description_width": "initial"},
    )
    widgets.jslink((slider, "value"), (panels, "selected_index"))
    return widgets.VBox([header, slider, panels])


def _menu_and_panels(labels: Sequence[str], panels: Sequence[widgets.Widget]) -> widgets.Widget:
    """A menu of `labels` linked (`jslink`) to a switcher of `panels`."""
    menu = widgets.Dropdown(
        options=[(label, index) for index, label in enumerate(labels)],
        value=0,
        description="episode",
        layout=widgets.Layout(width="900px"),
    )
    shown = _switcher(list(panels), [str(i) for i in range(len(panels))])
    widgets.jslink((menu, "index"), (shown, "selected_index"))
    return widgets.VBox([menu, shown])


def _task_of(view: EpisodeView) -> Tuple:
    return pair_key(view.episode)


def browser_groups(views: Sequence[EpisodeView]) -> List[Tuple[str, List[int]]]:
    """The static browser's selections, (name, indices into `views`): every episode, each phase,
    each outcome; empty selections and repeats of an earlier one are left out."""
    phases = list(dict.fromkeys(view.phase for view in views))
    candidates = [("every episode", list(range(len(views))))]
    candidates += [(f"{phase} only", [i for i, v in enumerate(views) if v.phase == phase]) for phase in phases]
    candidates += [
        (
            f"{outcome}es only" if outcome == "success" else f"{outcome}s only",
            [i for i, v in enumerate(views) if outcome_of(v.episode) == outcome],
        )
        for outcome in ("success", "failure")
    ]
    groups: List[Tuple[str, List[int]]] = []
    for name, indices in candidates:
        if indices and indices not in [seen for _, seen in groups]:
            groups.append((name, indices))
    return groups


def static_trajectory_browser(
    views: Sequence[EpisodeView], before_after: Tuple[str, str] = ("pre", "post")
) -> widgets.Widget:
    """Every step of `views` pre-rendered; the menus, the step sliders and what they show are
    linked by `jslink`, which runs in the page: the browser works in an exported HTML page with
    no kernel. A first menu picks what to browse (`browser_groups`: every episode, one phase,
    one outcome) and, where a task was played in both `before_after` phases, both side by side,
    each with its own slider."""
    if not views:
        return widgets.HTML("<i>No episodes to browse.</i>")
    panels = [_episode_panel(view) for view in views]  # shared by the selections that hold them
    selections = [
        (name, _menu_and_panels([views[i].label for i in indices], [panels[i] for i in indices]))
        for name, indices in browser_groups(views)
    ]
    first, second = before_after
    by_task = {(_task_of(v), v.phase): v for v in views}
    paired = [
        (by_task[(task, first)], view)
        for view in views
        if view.phase == second
        for task in [_task_of(view)]
        if (task, first) in by_task
    ]
    if paired:
        labels = [
            f"{task_label(a.episode)}: {first} {outcome_of(a.episode)} → {second} {outcome_of(b.episode)}"
            for a, b in paired
        ]
        sides = [
            widgets.HBox(
                [_episode_panel(a, compact=True), _episode_panel(b, compact=True)],
                layout=dict(align_items="flex-start", grid_gap="16px"),
            )
            for a, b in paired
        ]
        selections.append((f"{first} | {second}, side by side", _menu_and_panels(labels, sides)))
    show = widgets.Dropdown(
        options=[(name, index) for index, (name, _) in enumerate(selections)],
        value=0,
        description="browse",
        layout=widgets.Layout(width="420px"),
    )
    shown = _switcher([box for _, box in selections], [name for name, _ in selections])
    widgets.jslink((show, "index"), (shown, "selected_index"))
    return widgets.VBox([show, shown])


class TrajectoryBrowser:
    """The live browser: filters, an episode menu and a step slider that call back into the kernel.

    `episodes_by_phase` maps a phase ('pre' and 'post' for the policy before and after
    training, from `pre_eval.jsonl` and `post_eval.jsonl`; any names work) to its episodes
    (`EpisodeRecord`s or JSONL rows). An episode is replayed when first shown. Display
    it with `display(browser.widget)` (or just `browser` as a cell's last line).
    """

    def __init__(self, episodes_by_phase: Mapping[str, Sequence[Any]]) -> None:
        self.entries: List[Tuple[str, Dict[str, Any]]] = [
            (phase, as_episode_dict(episode)) for phase, episodes in episodes_by_phase.items() for episode in episodes
        ]
        if not self.entries:
            raise ValueError("no episodes to browse: pass e.g. {'pre': pre_episodes, 'post': post_episodes}")
        self._views: Dict[int, EpisodeView] = {}
        scenarios = sorted({str(episode.get("scenario")) for _, episode in self.entries})
        self.phase = widgets.Dropdown(options=[ALL, *episodes_by_phase], value=ALL, description="phase")
        self.scenario = widgets.Dropdown(options=[ALL, *scenarios], value=ALL, description="scenario")
        self.outcome = widgets.Dropdown(options=list(OUTCOMES), value=ALL, description="outcome")
        self.episode = widgets.Dropdown(description="episode", layout=widgets.Layout(width="900px"))
        self.step = widgets.IntSlider(
            value=1,
            min=1,
            max=1,
            description="step",
            layout=widgets.Layout(width="560px"),
            style={"description_width": "initial"},
        )
        self.header = widgets.HTML()
        self.text = widgets.HTML(layout=widgets.Layout(width="560px"))
        self.image = widgets.Image(format="png", layout=IMAGE_LAYOUT)
        self.no_image = widgets.HTML(NO_SPECTRUM_HTML)
        self.figure = widgets.Box([self.no_image])
        for control in (self.phase, self.scenario, self.outcome):
            control.observe(self._refilter, names="value")
        self.episode.observe(self._show_episode, names="value")
        self.step.observe(self._show_step, names="value")
        self.widget = widgets.VBox(
            [
                widgets.HBox([self.phase, self.scenario, self.outcome]),
                self.episode,
                self.header,
                self.step,
                widgets.HBox([self.text, self.figure], layout=ROW_LAYOUT),
            ]
        )
        self._refilter()

    def _ipython_display_(self) -> None:  # shown as its widget in a notebook
        from IPython.display import display

        display(self.widget)

    def matching(self) -> List[int]:
        """Indices (into `entries`) of the episodes that pass the filters."""
        return [
            i
            for i, (phase, episode) in enumerate(self.entries)
            if self.phase.value in (ALL, phase)
            and self.scenario.value in (ALL, str(episode.get("scenario")))
            and self.outcome.value in (ALL, outcome_of(episode))
        ]

    def view(self, index: int) -> EpisodeView:
        """The prepared (replayed and rendered) episode `entries[index]`."""
        if index not in self._views:
            self._views[index] = prepare_episode(*self.entries[index])
        return self._views[index]

    def _refilter(self, _change: Any = None) -> None:
        matching = self.matching()
        self.episode.options = [(episode_label(*self.entries[i]), i) for i in matching]
        if not matching:
            self.header.value = "<i>No episode matches these filters.</i>"
            self.text.value = ""
            self.figure.children = [self.no_image]
            return
        if self.episode.value not in matching:  # new options may leave nothing selected (ipywidgets 8)
            self.episode.value = matching[0]
        self._show_episode()

    def _show_episode(self, _change: Any = None) -> None:
        if self.episode.value is None:
            return
        view = self.view(self.episode.value)
        self.header.value = episode_header_html(view.phase, view.episode)
        self.step.max = max(len(view.step_html), 1)
        self.step.value = 1
        self._show_step()

    def _show_step(self, _change: Any = None) -> None:
        if self.episode.value is None:
            return
        view = self.view(self.episode.value)
        if not view.step_html:
            self.text.value, self.figure.children = "<i>This episode has no steps.</i>", [self.no_image]
            return
        index = min(self.step.value, len(view.step_html)) - 1  # the slider counts steps from 1
        self.text.value = view.step_html[index]
        png = view.spectrum_png[index]
        if png is None:
            self.figure.children = [self.no_image]
        else:
            self.image.value = png
            self.figure.children = [self.image]
