"""A trajectory browser: step through what an agent saw, wrote and earned, with its spectrum.

Two forms over the same step panels:

- `TrajectoryBrowser` (live) calls back into a running kernel: filter by phase
  (pre/post training), scenario and outcome, pick an episode, slide through its steps.
  An episode is replayed in the environment when first shown (`lib.report.replay`, ~0.1 s) and a
  step's spectrum drawn when first shown (`EpisodeView.spectrum_png` is lazy); a line
  says what it is doing meanwhile.
- `static_trajectory_browser` pre-renders a few episodes and ties the controls to the
  panels with `jslink`, which runs in the browser: it keeps working in an HTML export
  of the notebook, with no kernel. Each episode's panel and each distinct spectrum image is
  one widget, shared by every selection that shows it, and the images are palette PNGs:
  the state an exported page carries stays small (`browser_pairs` picks a fair sample).

An episode recorded by another version of the environment (its replay earns other rewards)
is shown without spectra, with a note saying why.

Works with ipywidgets 7 (Colab) and 8: panels are switched by `widgets.Stack` where it
exists (8) and by a `widgets.Tab` otherwise (7), through their common `selected_index`.
"""

from __future__ import annotations

import html
import io
import json
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

try:
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
except ModuleNotFoundError as missing:  # pragma: no cover - depends on the install
    raise ModuleNotFoundError(
        f"lib.report.browser needs {missing.name}, which the notebook extra installs: pip install -e '.[notebooks]' "
        "(or `make setup`, which installs requirements.txt)",
        name=missing.name,
    ) from None

from cernenv.suite import part_of
from lib.episodes.records import as_episode_dict, pair_key
from lib.measure.metrics import has_particle
from lib.report.episode_markdown import spread_by_reward
from lib.report.evidence_figures import palette_png
from lib.report.plotting import plot_spectrum, savefig, subplots
from lib.report.replay import ReplayMismatch, replay

ALL = "all"
OUTCOMES = (ALL, "success", "failure")
SPECTRUM_FIGSIZE = (10.0, 7.5)
SPECTRUM_DPI = 84
"""Spectrum images: the house figure size (its fonts are sized for it), 840 px wide, shown 420 px
wide: sharp on a high-density screen. A step shares its image with the steps before it until the
spectrum changes, so a report holds a few distinct images per episode."""
PNG_COLOURS = 32
"""Spectra are saved as palette PNGs of this many colours (a plot has a few flat colours and
their antialiased edges): a third of the size of matplotlib's RGBA PNG, to the eye the same."""
IMAGE_LAYOUT = dict(width="420px", height="auto", object_fit="contain")
ROW_LAYOUT = dict(align_items="flex-start")
"""The live browser's step text and spectrum side by side, top-aligned (a stretched row would
stretch the image)."""
PANEL_WIDTH = "620px"
"""Step text above its spectrum, 620 px wide: a prompt line of 80 monospace characters fits
(12 px type), and the side-by-side view shows the very panels the single view does."""
NO_TEXT = "(none recorded: a scripted agent reads the observation object and writes no text)"
WRAP_AT_SPACES = "white-space:pre-wrap;word-break:normal;overflow-wrap:break-word"
"""Long lines wrap at spaces (a word longer than the line alone is broken): JupyterLab's own style,
which the exported report carries, breaks every `pre` of an output anywhere (`word-break: break-all`),
mid-word."""
TEXT_STYLE = f"{WRAP_AT_SPACES};font-family:monospace;font-size:12px;line-height:1.3;margin:2px 0 8px 0"
BLOCK_STYLE = "line-height:1.4"
STYLE_SHEET = (
    "<style>"
    f"div.cernenv-step pre{{{TEXT_STYLE}}}"  # more specific than JupyterLab's `.jp-OutputArea-output pre`
    ".cernenv-step table{font-size:12px}.cernenv-step td:first-child{padding-right:12px}"
    f".cernenv-step{{{BLOCK_STYLE}}}"
    "</style>"
)
"""The step panels' styles, once per browser (as a class, not on every element: the saved state of
a report carries each step's HTML, and the inline styles were a quarter of it)."""
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


PROMPT_STYLE = f"font-family:monospace;font-size:12px;{WRAP_AT_SPACES};min-width:80ch"
"""The prompt's own style, inline as well as in `STYLE_SHEET`: a report page that drops the style
sheet still shows the prompt as the model read it, 80 characters to a line."""


def _pre(text: Any, style: str = "") -> str:
    shown = f' style="{style}"' if style else ""
    return f"<pre{shown}>{html.escape(str(text))}</pre>"


def _table(mapping: Mapping[str, Any]) -> str:
    rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>" for k, v in mapping.items())
    return f"<table>{rows}</table>"


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
        "<b>Prompt</b> (what the agent was shown)" + _pre(step.get("prompt") or NO_TEXT, PROMPT_STYLE),
        "<b>Completion</b> (what it wrote)" + _pre(_completion_text(step.get("completion"))),
        "<b>Parsed action</b> " + ("✓" if parsed else "✗") + _pre(action_text),
        "<b>Rule violations</b>" + _pre("\n".join(map(str, violations)) or "none"),
        "<b>Observation summary</b> (before the step)" + _table(step.get("observation_summary") or {}),
    ]
    return '<div class="cernenv-step">' + "".join(f"<div>{part}</div>" for part in parts) + "</div>"


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
        f'<div class="cernenv-step"><b>{html.escape(episode_label(phase, episode))}</b><br>'
        f"hidden truth: <code>{html.escape(json.dumps(truth, default=str))}</code><br>"
        f"graded: {verdicts}; outcome <b>{outcome_of(episode)}</b></div>"
    )


def spectrum_png(snapshot: Mapping[str, Any]) -> Optional[bytes]:
    """Palette PNG of the spectrum in `snapshot`, with its fit (signal+background, else
    background-only), on the scale its counts call for (`lib.report.plotting.plot_spectrum`); None before
    any spectrum was built. Drawn with a plain label (mplhep's experiment label redraws the figure
    three times to place its text: two thirds of the time)."""
    spectrum = snapshot.get("spectrum")
    if spectrum is None:
        return None
    fit = snapshot.get("resonance_fit") or snapshot.get("background_fit")
    fig, ax = subplots(figsize=SPECTRUM_FIGSIZE)
    try:
        plot_spectrum(spectrum, fit, ax=ax, experiment_label=False)
        buffer = io.BytesIO()
        savefig(fig, buffer, format="png", dpi=SPECTRUM_DPI)
        return palette_png(buffer.getvalue(), PNG_COLOURS)
    finally:
        plt.close(fig)


NO_SPECTRUM_HTML = "<i>No spectrum yet at this step (build_invariant_mass makes one).</i>"
NOT_REPLAYED_HTML = (
    "<i>No spectrum: this record comes from another version of the environment, whose replay earns "
    "other rewards ({reason}); regenerate the evidence to see its spectra.</i>"
)


DRAWN_OBJECTS = ("spectrum", "resonance_fit", "background_fit", "scan")
"""The analysis objects of a replay snapshot a step's spectrum image is drawn from."""


class LazySpectra(SequenceABC):
    """A step's spectrum image, drawn when first asked for and shared with every step whose
    analysis objects are the same (the steps that leave the spectrum alone): a sequence of PNG
    bytes or None, one per step."""

    def __init__(self, snapshots: Sequence[Optional[Mapping[str, Any]]]) -> None:
        self._keys = [
            None if s is None or s.get("spectrum") is None else tuple(id(s.get(k)) for k in DRAWN_OBJECTS)
            for s in snapshots
        ]
        self._snapshots = snapshots
        self._drawn: Dict[Tuple, Optional[bytes]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def is_drawn(self, index: int) -> bool:
        key = self._keys[index]
        return key is None or key in self._drawn

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        key = self._keys[index]
        if key is None:
            return None
        if key not in self._drawn:
            self._drawn[key] = spectrum_png(self._snapshots[index])
        return self._drawn[key]


@dataclass
class EpisodeView:
    """One episode prepared for the browser: its step panels' HTML and a spectrum image per step
    (`LazySpectra`: drawn when first read)."""

    phase: str
    episode: Dict[str, Any]
    step_html: List[str]
    spectrum_png: Sequence[Optional[bytes]]
    note: str = field(default="")
    """Why the spectra are missing, when they are (a record the environment does not reproduce)."""

    @property
    def label(self) -> str:
        return episode_label(self.phase, self.episode)


def prepare_episode(phase: str, episode: Any) -> EpisodeView:
    """Replay `episode` and write each step's panel; its spectra are drawn when first shown
    (`LazySpectra`), each once. A record whose replay earns other rewards gets no spectra and a
    note (`EpisodeView.note`)."""
    record = as_episode_dict(episode)
    note = ""
    try:
        snapshots: List[Optional[Mapping[str, Any]]] = list(replay(record))
    except ReplayMismatch as error:
        snapshots = [None] * len(record.get("steps") or [])
        note = NOT_REPLAYED_HTML.format(reason=html.escape(str(error).split(";")[0]))
    return EpisodeView(
        phase=phase,
        episode=record,
        step_html=[step_html(record, i) for i in range(len(snapshots))],
        spectrum_png=LazySpectra(snapshots),
        note=note,
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


class _Parts:
    """The widgets a static browser shares between its episodes: one per distinct image, one
    layout and one style for every step's text (each widget would otherwise carry its own, and
    the page saves every one: they were half of the state)."""

    def __init__(self) -> None:
        self.images: Dict[Any, widgets.Widget] = {}
        self.text_layout = widgets.Layout(width=PANEL_WIDTH)
        self.image_layout = widgets.Layout(**IMAGE_LAYOUT)
        self.text_style: Any = None  # the first text's style (its class differs between ipywidgets 7 and 8)
        self.blank = widgets.HTML("")

    def text(self, value: str) -> widgets.HTML:
        if self.text_style is None:
            first = widgets.HTML(value, layout=self.text_layout)
            self.text_style = first.style
            return first
        return widgets.HTML(value, layout=self.text_layout, style=self.text_style)

    def image(self, png: Optional[bytes], note: str = "") -> widgets.Widget:
        """One widget per distinct image, shared by every step and episode that shows it."""
        key = png if png is not None else ("none", note)
        if key not in self.images:
            self.images[key] = (
                self.text(note or NO_SPECTRUM_HTML)
                if png is None
                else widgets.Image(value=png, format="png", layout=self.image_layout)
            )
        return self.images[key]


def _episode_panel(view: EpisodeView, parts: Optional[_Parts] = None) -> widgets.Widget:
    """Header, a step slider, the steps' texts and their spectra below them: the slider is linked
    in the browser (`jslink`) to both switchers, so a step shows its text and its spectrum."""
    parts = parts or _Parts()
    n_steps = len(view.step_html)
    header = widgets.HTML(episode_header_html(view.phase, view.episode))
    if n_steps == 0:
        return widgets.VBox([header, widgets.HTML("<i>This episode has no steps.</i>")])
    # child k is step k (1-based, as the headings count): child 0 is never shown (the slider starts at 1)
    titles = ["-"] + [str(i + 1) for i in range(n_steps)]
    texts = _switcher([parts.blank] + [parts.text(view.step_html[i]) for i in range(n_steps)], titles)
    spectra = _switcher([parts.blank] + [parts.image(view.spectrum_png[i], view.note) for i in range(n_steps)], titles)
    texts.selected_index = spectra.selected_index = 1
    slider = widgets.IntSlider(
        value=1,
        min=1,
        max=n_steps,
        description="step",
        continuous_update=True,
        layout=parts.text_layout,
        style={"description_width": "initial"},
    )
    widgets.jslink((slider, "value"), (texts, "selected_index"))
    widgets.jslink((slider, "value"), (spectra, "selected_index"))
    return widgets.VBox([header, slider, texts, spectra])


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


def browser_pairs(
    pre: Sequence[Mapping[str, Any]], post: Sequence[Mapping[str, Any]], n: int
) -> List[Tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """`n` tasks played before and after training, as (pre, post) pairs, for the static browser: a
    fair sample, not the best. The tasks are grouped by what a reader must see both of (a particle
    or none; the trained policy right or wrong, i.e. success and failure; then the part of the
    suite: unseen particles or known physics), and taken from the groups in turn, each group's
    spread over the pre-training reward ranking (`lib.report.episode_markdown.spread_by_reward`).
    Tasks played on one side only are left out."""
    after = {pair_key(e): e for e in post}
    paired = [(e, after[pair_key(e)]) for e in pre if pair_key(e) in after]
    groups: Dict[Tuple, List[Mapping[str, Any]]] = {}
    for before, after_episode in paired:
        particle = has_particle(before) is True
        key = (not particle, outcome_of(after_episode) != "success", part_of(before.get("scenario")))
        groups.setdefault(key, []).append(before)
    counts = {key: 0 for key in sorted(groups)}  # with a particle first, successes first
    total = min(n, len(paired))
    while sum(counts.values()) < total:
        for key in counts:  # one from each group in turn
            if counts[key] < len(groups[key]) and sum(counts.values()) < total:
                counts[key] += 1
    chosen = [before for key, k in counts.items() for before in spread_by_reward(groups[key], k)]
    return [(before, after[pair_key(before)]) for before in chosen]


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
    parts = _Parts()  # one widget per distinct image, one text layout and style, in the whole browser
    panels = [_episode_panel(view, parts) for view in views]  # shared by every selection that holds them
    selections = [
        (name, _menu_and_panels([views[i].label for i in indices], [panels[i] for i in indices]))
        for name, indices in browser_groups(views)
    ]
    first, second = before_after
    index_of = {(_task_of(v), v.phase): i for i, v in enumerate(views)}
    paired = [
        (index_of[(task, first)], i)
        for i, view in enumerate(views)
        if view.phase == second
        for task in [_task_of(view)]
        if (task, first) in index_of
    ]
    if paired:
        labels = [
            f"{task_label(views[a].episode)}: {first} {outcome_of(views[a].episode)} → "
            f"{second} {outcome_of(views[b].episode)}"
            for a, b in paired
        ]
        sides = [  # the very panels of the single views, side by side
            widgets.HBox([panels[a], panels[b]], layout=dict(align_items="flex-start", grid_gap="16px"))
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
    return widgets.VBox([show, shown, widgets.HTML(STYLE_SHEET)])


class TrajectoryBrowser:
    """The live browser: filters, an episode menu and a step slider that call back into the kernel.

    `episodes_by_phase` maps a phase ('pre' and 'post' for the policy before and after
    training, from `pre_eval.jsonl.gz` and `post_eval.jsonl.gz`; any names work) to its episodes
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
        self.status = widgets.HTML()
        """What the browser is doing while it works (replaying an episode, drawing a spectrum)."""
        self.text = widgets.HTML(layout=widgets.Layout(width=PANEL_WIDTH))
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
                self.status,
                widgets.HTML(STYLE_SHEET),
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
        """The prepared (replayed) episode `entries[index]`; its spectra are drawn when shown."""
        if index not in self._views:
            self.status.value = "<i>⏳ replaying the episode…</i>"
            try:
                self._views[index] = prepare_episode(*self.entries[index])
            finally:
                self.status.value = ""
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
        spectra = view.spectrum_png
        if isinstance(spectra, LazySpectra) and not spectra.is_drawn(index):
            self.status.value = "<i>⏳ drawing the spectrum…</i>"
        try:
            png = spectra[index]
        finally:
            self.status.value = ""
        if png is None:
            self.no_image.value = view.note or NO_SPECTRUM_HTML
            self.figure.children = [self.no_image]
        else:
            self.image.value = png
            self.figure.children = [self.image]
