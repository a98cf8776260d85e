"""`make reproduce`: profiles name real notebooks and parameters; a failing notebook stops the run clearly."""

import json
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from lib import reproduce
from lib.reproduce import ReproduceError, load_profile

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_NAMES = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("profile", ["full", "smoke"])
def test_profiles_run_every_notebook_in_order(profile):
    assert list(load_profile(profile)) == NOTEBOOK_NAMES


def test_full_profile_writes_the_committed_evidence_and_smoke_stays_out_of_it():
    full, smoke = load_profile("full"), load_profile("smoke")
    directories = ("EVIDENCE_DIR", "evidence_dir", "OUTPUT_DIR", "output_dir")  # notebook 03's are TrainConfig's
    assert {p[key] for p in full.values() for key in directories[:2] if key in p} == {"evidence"}
    assert all(
        not str(p[key]).startswith("evidence") and str(p[key]).startswith("build/")
        for p in smoke.values()
        for key in directories
        if key in p
    )
    assert smoke["03_train_grpo"]["model_name"] == "cernenv-tiny" and smoke["03_train_grpo"]["warm_start_episodes"] == 0


def _write_profile(tmp_path, text):
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    return str(path)


def test_a_misspelt_parameter_or_notebook_is_refused_with_what_exists(tmp_path):
    with pytest.raises(ReproduceError, match=r"no parameter\(s\) \['MAX_EPISODE'\].*MAX_EPISODES"):
        load_profile(_write_profile(tmp_path, "notebooks:\n  02_baseline_rollouts:\n    MAX_EPISODE: 3\n"))
    with pytest.raises(ReproduceError, match="notebook '02_baselines' not found"):
        load_profile(_write_profile(tmp_path, "notebooks:\n  02_baselines: {}\n"))
    with pytest.raises(ReproduceError, match="expected a mapping `notebooks:`"):
        load_profile(_write_profile(tmp_path, "- 01_explore_environment\n"))
    with pytest.raises(ReproduceError, match=r"no profile 'ful'.*'full'"):
        load_profile("ful")


def _write_notebook(folder, name, code, parameters=None):
    """A python3 notebook `folder/NAME.ipynb` of one code cell, after a parameters cell if given."""
    folder.mkdir(exist_ok=True)
    cells = [new_code_cell(parameters, metadata={"tags": ["parameters"]})] if parameters else []
    python = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    nbformat.write(new_notebook(cells=cells + [new_code_cell(code)], metadata=python), folder / f"{name}.ipynb")


def test_a_failing_notebook_stops_the_run_and_names_the_cell(tmp_path, monkeypatch):
    notebooks = tmp_path / "notebooks"
    _write_notebook(notebooks, "a_first", "print(1 / DIVISOR)", parameters="DIVISOR = 1")
    _write_notebook(notebooks, "b_second", "print('never')")
    monkeypatch.setattr(reproduce, "NOTEBOOKS_DIR", notebooks)
    monkeypatch.setattr(reproduce, "BUILD_DIR", tmp_path / "default-build")
    profile = _write_profile(tmp_path, "notebooks:\n  a_first:\n    DIVISOR: 0\n  b_second: {}\n")
    build = tmp_path / "build"
    with pytest.raises(ReproduceError, match=r"a_first failed in cell \d+: ZeroDivisionError") as failure:
        reproduce.reproduce(profile, build_dir=build)
    assert str(build / "a_first.ipynb") in str(failure.value)
    assert "make reproduce PROFILE=profile ONLY=a_first" in str(failure.value), "the rerun keeps the profile"
    executed = nbformat.read(build / "a_first.ipynb", as_version=4)
    assert any(o.get("ename") == "ZeroDivisionError" for c in executed.cells for o in c.get("outputs", []))
    assert not (build / "b_second.ipynb").exists(), "the run stops at the first failure"
    assert reproduce.main(["--profile", profile]) == 1


def test_each_profile_writes_its_own_folder_with_the_commit_that_ran_it(tmp_path, monkeypatch):
    notebooks = tmp_path / "notebooks"
    _write_notebook(notebooks, "a_first", "print(N)", parameters="N = 1")
    monkeypatch.setattr(reproduce, "NOTEBOOKS_DIR", notebooks)
    monkeypatch.setattr(reproduce, "BUILD_DIR", tmp_path / "build")
    for name, n in (("smoke", 2), ("full", 3)):
        (tmp_path / "configs").mkdir(exist_ok=True)
        profile = tmp_path / "configs" / f"{name}.yaml"
        profile.write_text(f"notebooks:\n  a_first:\n    N: {n}\n")
        (output,) = reproduce.reproduce(str(profile))
        assert output == tmp_path / "build" / name / "a_first.ipynb"
    smoke, full = (
        nbformat.read(tmp_path / "build" / name / "a_first.ipynb", as_version=4) for name in ("smoke", "full")
    )
    assert smoke.cells[-1].outputs[0]["text"] == "2\n" and full.cells[-1].outputs[0]["text"] == "3\n"
    record = json.loads((tmp_path / "build" / "smoke" / "run.json").read_text())
    run = record["notebooks"]["a_first"]
    assert record["profile"] == "smoke" and run["commit"] == reproduce.source_revision()["commit"]
    assert len(run["commit"]) == 40 and isinstance(run["dirty"], bool) and run["seconds"] >= 0


def test_the_run_record_calls_a_tree_dirty_for_source_changes_not_for_what_notebooks_write(tmp_path, monkeypatch):
    import subprocess

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    for name in ("evidence/metrics.json", "reports/page.png", "lib/code.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("one\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start")
    monkeypatch.setattr(reproduce, "ROOT", tmp_path)
    assert reproduce.source_revision()["dirty"] is False
    (tmp_path / "evidence" / "metrics.json").write_text("two\n")
    (tmp_path / "reports" / "page.png").write_text("two\n")
    assert reproduce.source_revision()["dirty"] is False, "the notebooks' own outputs"
    (tmp_path / "lib" / "code.py").write_text("two\n")
    assert reproduce.source_revision()["dirty"] is True
