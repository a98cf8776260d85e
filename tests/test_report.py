"""Notebook 04 runs on the committed evidence; its HTML report works offline, in a real browser, and
each page stays under 3 MB."""

import json
import os
import re
from pathlib import Path

import nbformat
import pytest

from lib.episodes.records import load_episodes_jsonl
from lib.notebooks.export import (
    READERS_SUFFIX,
    STANDALONE_SUFFIX,
    check_browser,
    export_html,
    export_reports,
    find_chromium,
)
from lib.notebooks.reproduce import default_kernel_name

ROOT = Path(__file__).resolve().parents[1]
NAME = "04_evidence_analysis"
N_BROWSER_TASKS = 5  # the notebook's default: the page sizes checked are those of `make report`
PAGE_LIMIT_BYTES = 3_500_000
"""The largest page `make report` may write: 2.59, 2.55 and 3.16 MB for the evidence with five
baseline agents (the committed evidence of 2026-12-02; 3.0 MB held the evidence before it, whose
baselines had four); 12.6 and 22.3 MB before the pages were cut."""


@pytest.fixture(scope="module")
def executed_04(tmp_path_factory):
    """Notebook 04 executed by papermill on evidence/ (as `make reproduce PROFILE=committed` runs it)."""
    papermill = pytest.importorskip("papermill")
    build = tmp_path_factory.mktemp("build")
    output = build / f"{NAME}.ipynb"
    env = {"MPLBACKEND": "Agg", "CERNENV_HEADLESS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        papermill.execute_notebook(
            str(ROOT / "notebooks" / f"{NAME}.ipynb"),
            str(output),
            parameters={"EVIDENCE_DIR": "evidence", "N_BROWSER_TASKS": N_BROWSER_TASKS},
            kernel_name=default_kernel_name(),
            cwd=str(ROOT / "notebooks"),
            progress_bar=False,
            execution_timeout=300,
        )
    finally:
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    return output


@pytest.mark.slow
@pytest.mark.notebook
def test_notebook_04_tells_the_story_from_the_evidence(executed_04):
    nb = nbformat.read(executed_04, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    markdown = "\n".join(o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {}))
    assert "| metric | before | after | after − before [95% CI] |" in markdown
    for agent in ("random", "heuristic", "oracle", "policy before GRPO", "policy after GRPO"):
        assert f"| {agent} |" in markdown, agent
    assert "### " in markdown, "sample trajectories"
    # training curve, components, progression, before/after bars and distributions, baselines; then the
    # physics view when a trained-agent episode of the evidence reached a fit, else the notebook says so
    post = load_episodes_jsonl(str(ROOT / "evidence" / "post_eval.jsonl.gz"))
    fitted = any(
        isinstance(s.get("action"), dict) and s["action"].get("action_type") == "fit_resonance"
        for e in post
        for s in e["steps"]
    )
    texts = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    assert images >= (7 if fitted else 6)
    assert fitted != ("no trained-agent episode reached a resonance fit" in texts), "the physics view"
    views = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 1, "the trajectory browser"
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    models = [m["model_name"] for m in state.values()]
    assert models.count("LinkModel") >= 1 + 2 * N_BROWSER_TASKS, "menu and one slider per episode, jslinked"
    pre = load_episodes_jsonl(str(ROOT / "evidence" / "pre_eval.jsonl.gz"))
    built = any(
        isinstance(s.get("action"), dict) and s["action"].get("action_type") == "build_invariant_mass"
        for e in pre + post
        for s in e["steps"]
    )
    assert models.count("ImageModel") >= (1 if built else 0), "spectra in the browser"


@pytest.mark.slow
@pytest.mark.notebook
def test_report_pages_load_nothing_from_the_network(executed_04, tmp_path):
    pages = export_reports(executed_04.parent, tmp_path)
    assert [p.name for p in pages] == [
        f"{NAME}.html",
        f"{NAME}{READERS_SUFFIX}.html",
        f"{NAME}{STANDALONE_SUFFIX}.html",
    ]
    standalone = pages.pop()
    html = standalone.read_text()
    scripts = re.findall(r"""<script[^>]*src=["']([^"']+)""", html) + re.findall(r"widgetRendererSrc = '([^']+)'", html)
    assert scripts and all(s.startswith("data:text/javascript;base64,") for s in scripts), [s[:40] for s in scripts]
    for page in pages:
        html = page.read_text()
        sources = re.findall(r"""<(?:script|link|img)[^>]*(?:src|href)=["']([^"']+)""", html)
        sources += re.findall(r"widgetRendererSrc = '([^']+)'", html)
        assert sources and not [s for s in sources if re.match(r"(https?:)?//", s)], sources
        assert any(s.endswith("assets/embed-amd.js") for s in sources)
        assert (page.parent / next(s for s in sources if s.endswith("require.js"))).resolve().is_file()
    full, readers = (p.read_text() for p in pages)
    assert "use_style" in full and "use_style" not in readers, "code cells only in the full page"
    assert readers.count("data:image/png;base64") == full.count("data:image/png;base64") >= 7
    alone = standalone.read_text()
    assert "DecompressionStream" in alone and 'id="cernenv-widget-state"' in alone, "state and manager gzipped"
    assert 'type="application/vnd.jupyter.widget-state+json"' not in alone
    sizes = {page.name: page.stat().st_size for page in [*pages, standalone]}
    assert all(size < PAGE_LIMIT_BYTES for size in sizes.values()), sizes  # 12.6 and 22.3 MB before


def test_the_saved_widget_state_keeps_only_what_the_outputs_show_and_their_links():
    from lib.notebooks.export import WIDGET_STATE, WIDGET_VIEW, trim_widget_state

    def model(name, **state):
        return {"model_name": name, "model_module": "@jupyter-widgets/controls", "state": state}

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output("display_data", {WIDGET_VIEW: {"model_id": "a1"}})])
    ]
    notebook.metadata["widgets"] = {
        WIDGET_STATE: {
            "state": {
                "a1": model("VBoxModel", children=["IPY_MODEL_b2"], layout="IPY_MODEL_c3"),
                "b2": model("IntSliderModel", layout="IPY_MODEL_c3"),
                "c3": model("LayoutModel"),
                "d4": model("LinkModel", source=["IPY_MODEL_b2", "value"], target=["IPY_MODEL_a1", "selected_index"]),
                "e5": model("ImageModel"),  # a widget the kernel still held, shown nowhere
                "f6": model("LinkModel", source=["IPY_MODEL_e5", "value"], target=["IPY_MODEL_b2", "value"]),
                "a7": model("HTMLModel", value="a tqdm bar of an earlier cell"),
            }
        }
    }
    assert trim_widget_state(notebook) == 3
    assert sorted(notebook.metadata["widgets"][WIDGET_STATE]["state"]) == ["a1", "b2", "c3", "d4"]


def test_every_page_says_which_profile_and_commit_made_it(tmp_path):
    import nbformat
    from nbformat.v4 import new_markdown_cell, new_notebook

    from lib.notebooks.export import provenance

    build = tmp_path / "build" / "smoke"
    build.mkdir(parents=True)
    nbformat.write(new_notebook(cells=[new_markdown_cell("# A notebook")]), build / "x.ipynb")
    assert "Provenance unknown" in provenance(build / "x.ipynb")
    commit = "0123456789abcdef" * 2 + "01234567"
    (build / "run.json").write_text(
        json.dumps(
            {
                "profile": "smoke",
                "notebooks": {
                    "x": {"commit": commit, "dirty": True, "finished": "2026-11-24T05:00:00+00:00", "seconds": 3.0}
                },
            }
        )
    )
    (page,) = [p for p in export_reports(build, tmp_path / "reports") if p.name == "x.html"]
    html = page.read_text()
    assert "PROFILE=smoke" in html and commit[:12] in html
    assert "uncommitted changes" in html and "not the full run" in html
    (build / "run.json").write_text(
        json.dumps(
            {
                "profile": "full",
                "notebooks": {
                    "x": {"commit": commit, "dirty": False, "finished": "2026-11-24T05:00:00+00:00", "seconds": 3.0}
                },
            }
        )
    )
    line = provenance(build / "x.ipynb")
    assert "PROFILE=full" in line and "uncommitted" not in line and "not the full run" not in line
    (build / "run.json").write_text((build / "run.json").read_text().replace('"full"', '"committed"'))
    line = provenance(build / "x.ipynb")  # notebook 04 on evidence/ alone: the committed evidence, said so
    assert "PROFILE=committed" in line and "**The committed evidence**" in line and "not the full run" not in line


def test_export_says_what_to_do_without_build_or_assets(tmp_path):
    with pytest.raises(FileNotFoundError, match="make reproduce"):
        export_reports(tmp_path / "empty", tmp_path / "reports")
    with pytest.raises(FileNotFoundError, match="make report-assets"):
        export_html(tmp_path / "x.ipynb", tmp_path / "x.html", assets_dir=tmp_path / "no-assets")


@pytest.mark.notebook
@pytest.mark.skipif(
    find_chromium() is None, reason="no Chromium on this machine (apt-get install chromium; .ci/run installs it)"
)
@pytest.mark.slow
def test_trajectory_browser_works_offline_in_chromium(executed_04, tmp_path):
    pytest.importorskip("playwright", reason="the playwright package drives Chromium (requirements.txt)")
    page = export_html(executed_04, tmp_path / f"{NAME}.html")
    check = check_browser(page, tmp_path / "browser.png", slider_moves=2)
    assert check.blocked_requests == [], "the report asked the network for these"
    assert check.page_errors == []
    first, *moved = check.steps_shown
    assert re.fullmatch(r"Step 1 of \d+", first)
    assert moved == [first.replace("Step 1 ", "Step 2 "), first.replace("Step 1 ", "Step 3 ")], check.steps_shown
    assert len(check.episodes_shown) == 2 and check.episodes_shown[0] != check.episodes_shown[1]
    assert check.side_by_side_headers == 2, "before and after of one task, side by side"
    assert check.screenshot.stat().st_size > 20_000
    # the one-file page works on its own: no assets folder beside it
    alone = export_html(
        executed_04, tmp_path / "mailed" / f"{NAME}.standalone.html", no_input=True, self_contained=True
    )
    assert not (alone.parent / "assets").exists()
    check = check_browser(alone, None, slider_moves=1)
    assert check.blocked_requests == [] and check.page_errors == [] and len(set(check.steps_shown)) == 2


def test_a_table_wider_than_the_page_scrolls_in_its_box(tmp_path):
    """A markdown table of many columns (a metrics table) scrolls inside its own box on the
    exported page instead of running off it."""
    import nbformat
    from nbformat.v4 import new_markdown_cell, new_notebook

    header = "| " + " | ".join(f"metric {i}" for i in range(30)) + " |"
    notebook = new_notebook(
        cells=[new_markdown_cell(header + "\n|" + "---|" * 30 + "\n| " + " | ".join("0.5" for _ in range(30)) + " |")]
    )
    path = tmp_path / "wide.ipynb"
    nbformat.write(notebook, path)
    page = export_html(path, tmp_path / "wide.html").read_text()
    assert (
        "<table>" in page
        and ".jp-RenderedHTMLCommon table { display: block; max-width: 100%; overflow-x: auto; }" in page
    )


@pytest.mark.skipif(
    find_chromium() is None, reason="no Chromium on this machine (apt-get install chromium; .ci/run installs it)"
)
def test_the_browsers_prompts_wrap_at_spaces_on_the_exported_page(tmp_path):
    """JupyterLab's style, which the exported report carries, breaks an output's `pre` anywhere
    (`word-break: break-all`): the browser's prompts wrapped mid-word. On the page as exported,
    every text of a step keeps its line breaks and wraps at spaces."""
    pytest.importorskip("playwright", reason="the playwright package drives Chromium (requirements.txt)")
    from nbformat.v4 import new_code_cell, new_notebook, new_output
    from playwright.sync_api import sync_playwright

    from lib.report.browser import STYLE_SHEET, step_html

    words = " ".join(f"word{i:03d}" for i in range(60))
    episode = {"steps": [{"prompt": f"Task: {words}\n{words}", "completion": words, "parsed_ok": False}]}
    cell = new_code_cell(
        "step", outputs=[new_output("display_data", {"text/html": STYLE_SHEET + step_html(episode, 0)})]
    )
    path = tmp_path / "step.ipynb"
    nbformat.write(new_notebook(cells=[cell]), path)
    page = export_html(path, tmp_path / "step.html", no_input=True)
    assert "word-break: break-all" in page.read_text(), "JupyterLab's rule is on the page"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=find_chromium(), args=["--no-proxy-server"])
        try:
            tab = browser.new_page(viewport={"width": 700, "height": 900})
            tab.goto(page.as_uri())
            styles = tab.eval_on_selector_all(
                ".cernenv-step pre",
                "els => els.map(e => [getComputedStyle(e).wordBreak, getComputedStyle(e).whiteSpace])",
            )
        finally:
            browser.close()
    assert len(styles) == 4 and set(map(tuple, styles)) == {("normal", "pre-wrap")}, styles
