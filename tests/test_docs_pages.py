"""The README and docs/ as a newcomer meets them: every relative link and anchor resolves, no file
names a machine's folders, the README stays short, and the figures it quotes are the committed
evidence's (evidence/baselines.json, evidence/seeds*/seeds.json, SmolLM2's held-out episodes), not copies
that drift."""

from __future__ import annotations

import functools
import gzip
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MACHINE_PATH = re.compile(r"(/home/|/tmp/|/work/|/root/|/Users/|\b[A-Za-z]:\\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: links kept as their text, lower case, punctuation dropped."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose(path: Path) -> list:
    """The page's (line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def anchors(path: Path) -> set:
    """The anchors of a page's headings; a repeated heading's later ones get -1, -2, ... as on GitHub."""
    found, seen = set(), {}
    for _, line in prose(path):
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            name = slug(match.group(1))
            found.add(name if name not in seen else f"{name}-{seen[name]}")
            seen[name] = seen.get(name, 0) + 1
    return found


def test_the_slug_is_github_s():
    assert slug("Three seeds from the plateau (2026-11-29)") == "three-seeds-from-the-plateau-2026-11-29"
    assert slug("The GPU configuration (`configs/train/colab.yaml`)") == "the-gpu-configuration-configstraincolabyaml"
    assert slug("Credit for each decision, and a warm start") == "credit-for-each-decision-and-a-warm-start"


def test_every_relative_link_and_anchor_of_the_pages_resolves():
    broken = []
    for page in PAGES:
        for number, line in prose(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):
                    continue  # https:, mailto:
                path, _, anchor = target.partition("#")
                destination = (page.parent / path).resolve() if path else page
                if not destination.exists():
                    broken.append(f"{page.relative_to(ROOT)}:{number}: {target} (no such file)")
                elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                    broken.append(f"{page.relative_to(ROOT)}:{number}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def committed_text_files():
    """Every text file of evidence/ and docs/, the README, CHANGELOG and CITATION.cff, gzip ones
    decompressed: (path, its lines)."""
    paths = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "CITATION.cff"]
    paths += sorted(p for folder in ("evidence", "docs") for p in (ROOT / folder).rglob("*") if p.is_file())
    for path in paths:
        if path.suffix == ".png":
            continue
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        yield path, raw.decode("utf-8", errors="replace").splitlines()


def test_no_page_or_evidence_file_names_a_machine_s_folders():
    """A path like /home/..., /tmp/... or C:\\... is where one machine kept something: it means
    nothing to a reader and tells what it should not. Write it relative, or as a placeholder."""
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:160]}"
        for path, lines in committed_text_files()
        for number, line in enumerate(lines, 1)
        if MACHINE_PATH.search(line)
    ]
    assert not found, "machine paths in committed files:\n" + "\n".join(found[:40])


def test_the_machine_path_scan_can_fail():
    assert MACHINE_PATH.search('"command": ["/home/me/.venv/bin/python", "-m"]')
    assert MACHINE_PATH.search(r"C:\Users\me\cernenv")
    assert not MACHINE_PATH.search("build/seeds/seed0/evidence and docs/studies/")


def test_the_readme_is_short_and_its_code_fits_a_terminal():
    readme = ROOT / "README.md"
    assert len(readme.read_bytes()) <= 12 * 1024, "the README is read in five minutes: move detail to docs/"
    long_lines, fenced = [], False
    for number, line in enumerate(readme.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced and len(line) > 100:
            long_lines.append(f"README.md:{number}: {len(line)} characters")
    assert not long_lines, "\n".join(long_lines)


OTHER_GUIDES = ("openenv.md", "physics.md")
"""The guides besides docs/training.md that a study of the server or the physics is linked from."""


def test_the_training_page_is_a_guide_and_its_studies_are_pages_of_their_own():
    guide = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    assert len(guide.splitlines()) <= 500, "docs/training.md is a guide: a dated study goes to docs/studies/"
    studies = sorted((ROOT / "docs" / "studies").glob("*.md"))
    assert studies and all(re.match(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md$", p.name) for p in studies), "dated names"
    unlisted = [
        p.name
        for p in studies
        if f"studies/{p.name}" not in guide + "".join((ROOT / "docs" / f).read_text() for f in OTHER_GUIDES)
    ]
    assert not unlisted, f"studies no guide links to: {unlisted}"


def numbers(cell: str) -> list:
    return [float(x) for x in re.findall(r"[-+]?\d+(?:\.\d+)?", cell.replace("−", "-"))]


AGENTS = {
    "random": "random",
    'always "nothing there"': "always-null",
    "heuristic physicist": "heuristic",
    "oracle": "oracle",
}


SMOLLM2_ROWS = {
    "SmolLM2-135M-Instruct, imitation": "heldout_imitation.jsonl.gz",
    "SmolLM2-135M-Instruct, then GRPO": "heldout_grpo.jsonl.gz",
}
"""SmolLM2's rows of the table (their first cell's start) and their held-out episodes in evidence/smollm2/."""


def table_rows(page: Path, labels) -> dict:
    """The baseline table's rows whose first cell starts with one of `labels` ({label: name})."""
    rows = {}
    for _, line in prose(page):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        for label, agent in labels.items():
            if cells and cells[0].startswith(label) and len(cells) == 7:
                rows[agent] = cells
    return rows


def assert_row_shows(page, agent, cells, metrics, groups):
    """A row's cells are `metrics`' mean reward, success and false-discovery rate ({name: {"mean",
    "low", "high"}}) and the correct outcomes of `groups` ({group: (success mean, episodes)})."""

    def interval(metric):
        return [metrics[metric]["mean"], metrics[metric]["low"], metrics[metric]["high"]]

    def correct(group):
        rate, n = groups[group]
        return [round(rate * n), n]

    expected = [
        (interval("mean_reward"), 0.006),
        (interval("success_rate"), 0.0006),
        (interval("false_discovery_rate"), 0.006),
        (correct("unseen_with_particle"), 0),
        (correct("unseen_null"), 0),
        (correct("known_physics"), 0),
    ]
    for cell, (values, tolerance) in zip(cells[1:], expected):
        shown = numbers(cell)
        if shown == [0.0]:  # written "0" when the whole interval is 0
            assert max(abs(v) for v in values) <= tolerance, (page, agent, cell, values)
            continue
        assert len(shown) == len(values), (page, agent, cell)
        assert all(abs(s - v) <= tolerance + 1e-9 for s, v in zip(shown, values)), (page, agent, cell, values)


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_baseline_table_is_the_committed_baselines(page):
    baselines = json.loads((ROOT / "evidence" / "baselines.json").read_text())
    rows = table_rows(ROOT / page, AGENTS)
    assert set(rows) == set(AGENTS.values()), f"{page}: the four baselines' rows"
    for agent, cells in rows.items():
        groups = {
            name: (group["metrics"][agent]["success_rate"]["mean"], group["n_episodes"][agent])
            for name, group in baselines["groups"].items()
        }
        assert_row_shows(page, agent, cells, baselines["metrics"][agent], groups)


@functools.cache
def smollm2_heldout(name: str) -> tuple:
    """The metrics ({name: {"mean", "low", "high"}}) and each group's (success, episodes) of one of
    SmolLM2's held-out evaluations, measured from its committed episodes as the baselines are."""
    from lib.episodes.records import load_episodes_jsonl
    from lib.measure.evaluation import group_metrics
    from lib.measure.metrics import agent_metrics

    episodes = load_episodes_jsonl(str(ROOT / "evidence" / "smollm2" / name))
    assert len(episodes) == 313, f"{name}: the whole held-out suite"
    metrics = {metric: vars(estimate) for metric, estimate in agent_metrics(episodes).items()}
    groups = {group: (m["success_rate"].mean, m["success_rate"].n) for group, m in group_metrics(episodes).items()}
    return metrics, groups


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_smollm2_s_rows_are_its_committed_held_out_episodes(page):
    """SmolLM2's rows are measured afresh from its held-out episodes, on the same suite and worlds
    (the published key) as the baselines, with the same bootstrap."""
    rows = table_rows(ROOT / page, {label: label for label in SMOLLM2_ROWS})
    assert set(rows) == set(SMOLLM2_ROWS), f"{page}: SmolLM2's rows"
    for label, cells in rows.items():
        assert_row_shows(page, label, cells, *smollm2_heldout(SMOLLM2_ROWS[label]))


@pytest.mark.parametrize("folder", ["seeds", "seeds-family"])
def test_the_training_guide_s_figures_are_the_committed_seeds(folder):
    """docs/training.md's "What the training showed" (the README's summary at full length: its own
    figures are tests/test_readme_training.py's)."""
    seeds = json.loads((ROOT / "evidence" / folder / "seeds.json").read_text())["groups"]
    text = (ROOT / "docs" / "training.md").read_text(encoding="utf-8").replace("−", "-")
    for group, comparison in [
        ("all", "grpo_minus_warm_start_success"),
        ("all", "grpo_minus_sft_success"),
        ("unseen_null", "grpo_minus_warm_start_success"),
    ]:
        pooled = seeds[group][comparison]["pooled"]
        shown = f"{pooled['mean']:+.3f} [{pooled['low']:+.3f}, {pooled['high']:+.3f}]"
        assert shown in text, f"docs/training.md should quote {group} {comparison} pooled as {shown}"


def test_the_pages_quote_the_published_scored_run_as_its_scorecard_says():
    card = json.loads((ROOT / "evidence" / "scored_run" / "scorecard.json").read_text())
    whole = card["groups"]["all"]
    correct = f"{round(whole['success_rate']['mean'] * card['n_tasks'])} of {card['n_tasks']}"
    success = "{mean:.3f} [{low:.3f}, {high:.3f}]".format(**whole["success_rate"])
    for page in ("docs/getting-started.md", "docs/agents.md", "docs/reports.md"):
        text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
        assert correct in text, f"{page} should quote the published scored run as {correct}"
    for page in ("docs/getting-started.md", "docs/reports.md"):
        text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
        assert success in text, f"{page} should quote its success as {success}"
