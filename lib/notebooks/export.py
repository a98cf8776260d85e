"""Export executed notebooks to HTML reports that work offline (`make report`).

For each executed notebook in `build/PROFILE/` (written there by `make reproduce`), three
pages go into `reports/`: `NAME.html` with code and outputs, `NAME.readers.html` with the
outputs only (nbconvert's `--no-input`), and `NAME.standalone.html`, the readers' page with
its scripts inlined: one file that works on its own (to mail, say).

nbconvert's default page loads require.js, MathJax and the Jupyter widget manager from
CDNs, so its widgets stay blank without a network. These pages instead load require.js
and the widget manager (`@jupyter-widgets/html-manager`) from `reports/assets/`, shipped
with the repository (see its README for versions and how to refresh them), and leave
MathJax and Mermaid out (`lib/notebooks/report_templates/cernenv_offline`). Widgets render from
the state the execution saved in the notebook (nbclient's `store_widget_state`), so
`jslink`ed controls keep working with no kernel. That state is trimmed to the widgets the
outputs show and the links between them (`trim_widget_state`: nbclient saves every widget
the kernel still held). The standalone page carries the widget manager (3.6 MB of
JavaScript) and the widget state gzip-compressed (0.9 MB and about 40% of the state), inflated
by the browser's own `DecompressionStream`.

Every page opens with where it came from: the profile and the commit that ran the notebook
(`build/PROFILE/run.json`, written by `make reproduce`), flagged when the tree had
uncommitted changes, and named the committed evidence when the profile reads evidence/ alone
(`reads_committed_evidence`) or else flagged when it is not the full one.

    python -m lib.notebooks.export [BUILD_DIR] [REPORTS_DIR]      # make report PROFILE=full|smoke
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from lib.extras import require
from lib.files import atomic_write, read_json
from lib.notebooks.reproduce import RUN_RECORD, reads_committed_evidence

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES_DIR = Path(__file__).resolve().parent / "report_templates"
TEMPLATE_NAME = "cernenv_offline"
ASSETS_DIR = ROOT / "reports" / "assets"
REQUIRE_JS = "require.js"
WIDGET_MANAGER_JS = "embed-amd.js"
READERS_SUFFIX = ".readers"
"""`NAME.readers.html`: the page without code cells."""
STANDALONE_SUFFIX = ".standalone"
"""`NAME.standalone.html`: the readers' page with its scripts inside it, one file to mail."""
BROWSER_NOTEBOOK = "04_evidence_analysis"
"""The notebook whose report holds the trajectory browser (checked and photographed by `check_browser`)."""
SCREENSHOT_SUFFIX = ".browser.png"
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
LOCAL_SCHEMES = ("file:", "data:", "blob:", "about:")
COLAB_BADGE = re.compile(r"\[!\[Open In Colab\]\([^)]*\)\]\(([^)]*)\)")
"""The notebooks' "Open in Colab" badge, an image fetched from the web: a report shows a plain link instead."""
STEP_HEADING = re.compile(r"^Step (\d+) of (\d+)$")


def _relative_url(target: Path, start: Path) -> str:
    return Path(os.path.relpath(target, start)).as_posix()


def provenance(notebook_path: Path) -> str:
    """A Markdown line saying which profile and commit produced this executed notebook (from the
    run record beside it), with a warning when that is not a clean full run."""
    try:
        record = read_json(notebook_path.parent / RUN_RECORD)
        run = record["notebooks"][notebook_path.stem]
        profile = str(record["profile"])
    except (OSError, ValueError, KeyError, TypeError):
        return (
            f"> **Provenance unknown:** `{notebook_path}` has no entry in a `run.json` beside it; "
            "`make reproduce` writes one."
        )
    commit = str(run.get("commit") or "unknown")
    line = (
        f"> Report of `make reproduce PROFILE={profile}`: this notebook ran at commit `{commit[:12]}` "
        f"on {run.get('finished', '?')} ({run.get('seconds', '?')} s)."
    )
    if run.get("dirty"):
        line += " **The checkout had uncommitted changes**: the commit alone does not reproduce it."
    if profile != "full" and reads_committed_evidence(profile):
        line += (
            " **The committed evidence**: this report reads `evidence/`, the full run's evidence as committed "
            "(it trains and plays nothing); its numbers are the published ones."
        )
    elif profile != "full":
        line += (
            f" **Profile `{profile}`, not the full run**: its numbers check the pipeline and are not "
            "the published evidence."
        )
    return line


def _data_url(path: Path) -> str:
    return "data:text/javascript;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
_MODEL_REFERENCE = re.compile(r"IPY_MODEL_([0-9a-f]+)")


def trim_widget_state(notebook: Any) -> int:
    """Drop from `notebook`'s saved widget state every model no output shows: keep the models the
    outputs display, those they refer to (children, layouts, styles), and the links (`jslink`)
    between kept models. Returns how many models were dropped."""
    state = notebook.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state")
    if not state:
        return 0
    shown = [
        output["data"][WIDGET_VIEW]["model_id"]
        for cell in notebook.cells
        for output in cell.get("outputs", [])
        if WIDGET_VIEW in output.get("data", {})
    ]
    keep: set = set()
    pending = list(shown)
    while pending:
        model = pending.pop()
        if model in keep or model not in state:
            continue
        keep.add(model)
        pending += _MODEL_REFERENCE.findall(json.dumps(state[model].get("state", {})))
    for model, entry in state.items():  # links refer to their ends; nothing refers to a link
        if entry.get("model_name") in ("LinkModel", "DirectionalLinkModel"):
            ends = _MODEL_REFERENCE.findall(json.dumps(entry.get("state", {})))
            if ends and all(end in keep for end in ends):
                keep.add(model)
    dropped = [model for model in state if model not in keep]
    for model in dropped:
        del state[model]
    return len(dropped)


def export_html(
    notebook_path: Path,
    html_path: Path,
    *,
    no_input: bool = False,
    assets_dir: Path = ASSETS_DIR,
    self_contained: bool = False,
) -> Path:
    """Write `notebook_path` as an HTML page at `html_path` that loads its scripts from `assets_dir`
    (`self_contained`: with the scripts inside the page as data URLs, so it works on its own)."""
    import nbformat
    from nbconvert import HTMLExporter

    for name in (REQUIRE_JS, WIDGET_MANAGER_JS):
        if not (assets_dir / name).is_file():
            raise FileNotFoundError(
                f"{assets_dir / name} is missing: restore reports/assets from git "
                "(git checkout -- reports/assets) or run `make report-assets`"
            )
    html_path.parent.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name=TEMPLATE_NAME, extra_template_basedirs=[str(TEMPLATES_DIR)])
    resources: Dict[str, Any] = {"metadata": {"name": notebook_path.stem}}
    if self_contained:
        exporter.require_js_url = _data_url(assets_dir / REQUIRE_JS)
        exporter.widget_renderer_url = "inlined"  # the template inflates widget_renderer_gzip instead
        packed = gzip.compress((assets_dir / WIDGET_MANAGER_JS).read_bytes(), compresslevel=9, mtime=0)
        resources["widget_renderer_gzip"] = base64.b64encode(packed).decode("ascii")
    else:
        exporter.require_js_url = _relative_url(assets_dir / REQUIRE_JS, html_path.parent)
        exporter.widget_renderer_url = _relative_url(assets_dir / WIDGET_MANAGER_JS, html_path.parent)
    if no_input:
        exporter.exclude_input = exporter.exclude_input_prompt = exporter.exclude_output_prompt = True
    notebook = nbformat.read(notebook_path, as_version=4)
    trim_widget_state(notebook)
    state = notebook.metadata.get("widgets", {}).get(WIDGET_STATE)
    if self_contained and state:
        packed_state = gzip.compress(json.dumps(state).encode("utf-8"), compresslevel=9, mtime=0)
        resources["widget_state_gzip"] = base64.b64encode(packed_state).decode("ascii")
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            cell.source = COLAB_BADGE.sub(r"[Open in Colab](\1)", cell.source)
    notebook.cells.insert(0, nbformat.v4.new_markdown_cell(provenance(notebook_path)))
    body, _resources = exporter.from_notebook_node(notebook, resources=resources)
    atomic_write(html_path, body)
    return html_path


def export_reports(build_dir: Path, reports_dir: Path, *, assets_dir: Path = ASSETS_DIR) -> List[Path]:
    """Both pages for every executed notebook in `build_dir`; returns the pages written."""
    require("notebooks", "exporting the notebooks to HTML")
    notebooks = sorted(build_dir.glob("*.ipynb"))
    if not notebooks:
        others = sorted(
            folder.name for folder in build_dir.parent.glob("*") if folder.is_dir() and any(folder.glob("*.ipynb"))
        )
        hint = (
            f"; executed notebooks are in {', '.join(f'{build_dir.parent}/{name}/' for name in others)}: "
            + " or ".join(f"`make report PROFILE={name}`" for name in others)
            if others
            else ""
        )
        raise FileNotFoundError(
            f"no executed notebooks in {build_dir}/: run `make reproduce PROFILE={build_dir.name}` first{hint}"
        )
    written = []
    for notebook in notebooks:
        written.append(export_html(notebook, reports_dir / f"{notebook.stem}.html", assets_dir=assets_dir))
        written.append(
            export_html(
                notebook, reports_dir / f"{notebook.stem}{READERS_SUFFIX}.html", no_input=True, assets_dir=assets_dir
            )
        )
        written.append(
            export_html(
                notebook,
                reports_dir / f"{notebook.stem}{STANDALONE_SUFFIX}.html",
                no_input=True,
                assets_dir=assets_dir,
                self_contained=True,
            )
        )
    return written


def find_chromium() -> Optional[str]:
    """Path of a Chromium or Chrome executable ($CHROMIUM first, then the PATH), or None."""
    candidates = [os.environ.get("CHROMIUM", "")] + [shutil.which(name) or "" for name in CHROMIUM_NAMES]
    return next((c for c in candidates if c and Path(c).is_file()), None)


@dataclass
class BrowserCheck:
    """What `check_browser` saw in the page."""

    steps_shown: List[str] = field(default_factory=list)
    """The visible step heading ("Step k of n") before and after each slider move."""
    episodes_shown: List[str] = field(default_factory=list)
    """The visible episode header before and after choosing another episode in the menu."""
    blocked_requests: List[str] = field(default_factory=list)
    """Every request for something not in a local file (all were refused: the page is offline)."""
    page_errors: List[str] = field(default_factory=list)
    side_by_side_headers: int = 0
    """Episode headers visible once "side by side" is chosen in the browse menu (2: before and after)."""
    screenshot: Optional[Path] = None


# The step heading and episode header on show: the first of each whose element is displayed.
_VISIBLE_TEXT_JS = """(pattern) => {
  const re = new RegExp(pattern);
  for (const el of document.querySelectorAll('b')) {
    const text = el.textContent.trim();
    if (re.test(text) && el.getClientRects().length > 0 && getComputedStyle(el).visibility !== 'hidden') return text;
  }
  return null;
}"""
EPISODE_HEADER = r"^(pre|post) · seed \d+"
_VISIBLE_COUNT_JS = """(pattern) => {
  const re = new RegExp(pattern);
  return [...document.querySelectorAll('b')].filter(el => re.test(el.textContent.trim())
    && el.getClientRects().length > 0 && getComputedStyle(el).visibility !== 'hidden').length;
}"""


def _wait_for(read: Callable[[], Optional[str]], differs_from: Optional[str], timeout_s: float) -> Optional[str]:
    deadline = time.monotonic() + timeout_s
    value = read()
    while (value is None or value == differs_from) and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    return value


def check_browser(
    html_path: Path,
    screenshot_path: Optional[Path] = None,
    *,
    chromium: Optional[str] = None,
    slider_moves: int = 2,
    end_at_last_step: bool = False,
    timeout_s: float = 60.0,
) -> BrowserCheck:
    """Open the exported page in headless Chromium with every non-local request refused, wait
    for the trajectory browser's widgets to render, press → on the step slider
    `slider_moves` times (then End, with `end_at_last_step`), pick the next episode in the
    menu and back, and screenshot the browser.

    Needs the `playwright` package and a Chromium executable (`find_chromium`); Playwright's
    own browser downloads are not used.
    """
    from playwright.sync_api import sync_playwright

    chromium = chromium or find_chromium()
    if chromium is None:
        raise FileNotFoundError(
            "no Chromium found: install Debian's `chromium` package (apt-get install chromium) "
            "or set CHROMIUM=/path/to/chrome"
        )
    check = BrowserCheck()

    def route(request_route) -> None:
        url = request_route.request.url
        if url.startswith(LOCAL_SCHEMES):
            request_route.continue_()
        else:
            check.blocked_requests.append(url)
            request_route.abort()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-proxy-server"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.on("pageerror", lambda error: check.page_errors.append(str(error)))
            page.route("**/*", route)
            page.goto(Path(html_path).resolve().as_uri())
            handle = page.locator(".widget-slider .noUi-handle, .widget-slider .ui-slider-handle").first
            handle.wait_for(state="visible", timeout=timeout_s * 1000)
            step = lambda: page.evaluate(_VISIBLE_TEXT_JS, STEP_HEADING.pattern)  # noqa: E731
            episode = lambda: page.evaluate(_VISIBLE_TEXT_JS, EPISODE_HEADER)  # noqa: E731
            check.steps_shown.append(_wait_for(step, None, timeout_s))
            check.episodes_shown.append(_wait_for(episode, None, timeout_s))
            for _ in range(slider_moves):
                handle.focus()
                page.keyboard.press("ArrowRight")
                check.steps_shown.append(_wait_for(step, check.steps_shown[-1], 5.0))
            if end_at_last_step:
                handle.focus()
                page.keyboard.press("End")
                check.steps_shown.append(_wait_for(step, check.steps_shown[-1], 5.0))
            menus = page.locator(".widget-dropdown select")
            browse, menu = menus.nth(0), menus.nth(1)  # what to browse; the episode menu of "every episode"
            if menu.locator("option").count() > 1:
                menu.select_option(index=1)
                check.episodes_shown.append(_wait_for(episode, check.episodes_shown[-1], 5.0))
                menu.select_option(index=0)
                _wait_for(episode, check.episodes_shown[-1], 5.0)
            options = browse.locator("option").all_inner_texts()
            side = [i for i, text in enumerate(options) if "side by side" in text.replace("\xa0", " ")]
            if side:
                browse.select_option(index=side[0])
                deadline = time.monotonic() + 5.0
                while time.monotonic() < deadline and check.side_by_side_headers < 2:
                    check.side_by_side_headers = page.evaluate(_VISIBLE_COUNT_JS, EPISODE_HEADER)
                    time.sleep(0.1)
                browse.select_option(index=0)
            if screenshot_path is not None:
                screenshot_path.parent.mkdir(parents=True, exist_ok=True)
                container = page.locator(".widget-vbox:has(> .widget-dropdown)").first
                container.scroll_into_view_if_needed()
                container.screenshot(path=str(screenshot_path))
                check.screenshot = screenshot_path
        finally:
            browser.close()
    return check


def unfinished_runs(build_dir: Path) -> List[str]:
    """A line for each training run under `build_dir` that did not finish (stopped, failed, killed:
    `lib.training.run_state.unfinished_run`), from the state each left in its output folder."""
    from lib.training.run_state import RUN_STATE, unfinished_run

    said = (unfinished_run(state.parent) for state in sorted(Path(build_dir).rglob(RUN_STATE)))
    return [line for line in said if line]


def page_to_open(pages: Sequence[Path]) -> Optional[Path]:
    """The page a reader opens first: notebook 04's readers' page (its results from the top, the
    code hidden: the evidence, the trajectory browser), else the last notebook's; a page with code
    where no readers' page was written."""
    readers = [page for page in pages if page.name.endswith(f"{READERS_SUFFIX}.html")]
    full = [page for page in pages if not page.name.endswith((f"{READERS_SUFFIX}.html", f"{STANDALONE_SUFFIX}.html"))]
    shown = readers or full
    return next(
        (page for page in shown if page.name.split(".", 1)[0] == BROWSER_NOTEBOOK), shown[-1] if shown else None
    )


def summary(build_dir: Path, reports_dir: Path, pages: Sequence[Path], seconds: float) -> List[str]:
    """What `make report` says at its end: the pages written, where, in how long, which to open."""
    by_notebook: Dict[str, List[Path]] = {}
    for page in pages:
        by_notebook.setdefault(page.name.split(".", 1)[0], []).append(page)
    lines = [
        f"exported {len(by_notebook)} notebook(s) from {build_dir}/ to {reports_dir}/ in {seconds:.0f} s, three pages "
        f"each: NAME.html (code and outputs), NAME{READERS_SUFFIX}.html (outputs only), NAME{STANDALONE_SUFFIX}.html "
        "(outputs only, its scripts inside: one file to mail)"
    ]
    for name, written in by_notebook.items():
        sizes = ", ".join(f"{page.stat().st_size / 1e6:.1f}" for page in written)
        lines.append(f"  {name}: {sizes} MB")
    opened = page_to_open(pages)
    if opened is not None:
        lines.append(
            f"open {opened} in a browser: the results, code hidden (NAME.html has the code; keep "
            f"{ASSETS_DIR.relative_to(ROOT)}/ beside the pages, or open the {STANDALONE_SUFFIX[1:]} page anywhere): "
            f"{opened.resolve().as_uri()}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("build_dir", nargs="?", default="build", type=Path, help="executed notebooks (default build/)")
    parser.add_argument("reports_dir", nargs="?", default="reports", type=Path, help="where the pages go")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        pages = export_reports(args.build_dir, args.reports_dir)
    except (FileNotFoundError, ModuleNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for line in summary(args.build_dir, args.reports_dir, pages, time.perf_counter() - start):
        print(line)
    for line in unfinished_runs(args.build_dir):
        print(f"note: {line}")
    browser_page = args.reports_dir / f"{BROWSER_NOTEBOOK}.html"
    if browser_page.exists():
        if find_chromium() is None:
            print("no Chromium: the trajectory browser was not checked in a browser (apt-get install chromium)")
            return 0
        check = check_browser(
            browser_page, args.reports_dir / f"{BROWSER_NOTEBOOK}{SCREENSHOT_SUFFIX}", end_at_last_step=True
        )
        print(
            f"checked {browser_page} in headless Chromium: steps shown {check.steps_shown}, "
            f"{len(check.blocked_requests)} network request(s) refused, {len(check.page_errors)} page error(s); "
            f"screenshot {check.screenshot}"
        )
        if check.blocked_requests or check.page_errors or len(set(check.steps_shown)) < 2:
            print(
                "error: the report does not work offline as it should: "
                f"{check.blocked_requests[:3]} {check.page_errors[:3]}",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
