"""The README's training section stays short and in step with the committed evidence: every number
it quotes is read here from the evidence files, and its figure is a committed PNG."""

import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "evidence" / "seeds-family-5e-5"
"""The study the README's sentence and figure quote."""


def _section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("## What the training showed")
    return text[start : text.index("\n## ", start + 1)]


def _signed(value: float) -> str:
    """A signed figure as the README writes it: +0.077, or −0.013 with the minus sign."""
    return f"{value:+.3f}".replace("-", "−")


def _flag(command, name):
    return command[command.index(name) + 1]


def _expected_numbers() -> dict:
    """Each number the section quotes, as it must read, from the evidence files."""
    seeds = json.loads((STUDY / "seeds.json").read_text())
    whole = seeds["groups"]["all"]
    pooled = whole["grpo_minus_warm_start_success"]["pooled"]
    runs = seeds["runs"]
    study_run = json.loads((STUDY / "seeds_run.json").read_text())
    (learning_rate,) = {_flag(c["command"], "--learning_rate") for c in study_run["commands"]}
    (steps,) = {_flag(c["command"], "--max_steps") for c in study_run["commands"]}
    baselines = json.loads((ROOT / "evidence" / "baselines.json").read_text())
    committed = json.loads((ROOT / "evidence" / "before_after_metrics.json").read_text())
    return {
        "pooled success": f"{_signed(pooled['mean'])} [{_signed(pooled['low'])}, {_signed(pooled['high'])}]",
        "seeds": len(runs),
        "heuristic success": f"({baselines['metrics']['heuristic']['success_rate']['mean']:.3f})",
        "steps": f"{steps} GRPO steps at {learning_rate}",
        "per seed": ", ".join(f"{whole[f'success_{run}_pre']} → {whole[f'success_{run}_post']}" for run in runs[:-1])
        + f" and {whole[f'success_{runs[-1]}_pre']} → {whole[f'success_{runs[-1]}_post']} of {whole['n_tasks']}",
        "committed": f"({committed['pre']['n_correct']} → {committed['post']['n_correct']})",
        "SmolLM2": smollm2_sentence(),
    }


def smollm2_sentence() -> str:
    """What SmolLM2's committed episodes played before and after GRPO, on the validation campaigns
    and the held-out suite, and the paired interval of the held-out difference, as the README says it."""
    from lib.episodes.records import load_episodes_jsonl

    folder = ROOT / "evidence" / "smollm2"

    def correct(name: str) -> int:
        return sum(1 for e in load_episodes_jsonl(str(folder / name)) if e.get("correct_outcome"))

    validation = json.loads((folder / "before_after_metrics.json").read_text())["pre"]["n"]
    heldout = json.loads((folder / "heldout_before_after.json").read_text())
    low, high = heldout["delta_ci95"]["success_rate"]
    return (
        f"plays {correct('pre_eval.jsonl.gz')} → {correct('post_eval.jsonl.gz')} of {validation} validation campaigns "
        f"and {correct('heldout_imitation.jsonl.gz')} → {correct('heldout_grpo.jsonl.gz')} of the "
        f"{heldout['pre']['n']} held-out ones "
        f"({_signed(heldout['delta']['success_rate'])} [{_signed(low)}, {_signed(high)}]"
    )


def test_the_readme_s_training_numbers_are_the_committed_evidence_s():
    section = " ".join(_section().split())
    expected = _expected_numbers()
    assert expected["seeds"] == 3 and "three seeds pooled" in section
    for name, text in expected.items():
        if isinstance(text, str):
            assert text in section, f"{name}: the README should quote {text!r} from the evidence"


def test_the_readme_s_training_section_is_one_sentence_one_figure_and_the_link():
    section = _section()
    bold = re.findall(r"\*\*(.+?)\*\*", section, re.DOTALL)
    assert len(bold) == 1 and bold[0].count(". ") == 0, "one bold sentence a newcomer can repeat"
    figures = re.findall(r"!\[[^\]]+\]\(([^)]+)\)", section)
    assert figures == ["evidence/seeds-family-5e-5/seeds.png"]
    tracked = subprocess.run(
        ["git", "ls-files", "--error-unmatch", figures[0]], cwd=ROOT, capture_output=True, text=True
    )
    assert tracked.returncode == 0, f"{figures[0]} is committed, so the repository's page shows it"
    assert "(docs/training.md#what-the-training-showed)" in section
    assert "## What the training showed" in (ROOT / "docs" / "training.md").read_text()
    words = len(re.sub(r"!\[[^\]]*\]\([^)]*\)", "", section).split())
    assert words <= 140, f"{words} words: the detail belongs in docs/training.md"
