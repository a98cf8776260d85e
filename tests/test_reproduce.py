"""`make reproduce`: profiles name real notebooks and parameters; a failing notebook stops the run clearly."""

import gzip
import json
import os
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from lib import runtime
from lib.notebooks import reproduce
from lib.notebooks.reproduce import ReproduceError, load_profile
from lib.training.seeds import EVIDENCE_CONFIG

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_NAMES = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("profile", ["full", "smoke", "untrained"])
def test_profiles_run_every_notebook_in_order(profile):
    assert list(load_profile(profile)) == NOTEBOOK_NAMES


def test_every_profile_writes_under_build_only_and_the_full_run_is_promoted_explicitly():
    """`make reproduce` used to rewrite the git-tracked evidence/ (full) without a word: every profile
    now writes under build/PROFILE/, and only `make promote-evidence` writes evidence/."""
    folders = ("EVIDENCE_DIR", "evidence_dir", "output_dir")
    for profile in ("full", "smoke", "untrained"):
        plan = load_profile(profile)
        written = {str(parameters[key]) for name, parameters in plan.items() for key in folders if key in parameters}
        assert written and all(path.startswith(f"build/{profile}/") for path in written), (profile, written)
    assert load_profile("full")["03_train_grpo"]["TRAIN_CONFIG"] == EVIDENCE_CONFIG, "the seeds' seed 0"
    smoke = load_profile("smoke")["03_train_grpo"]
    assert smoke["TRAIN_CONFIG"] == "configs/train/smoke.yaml"
    assert load_profile("committed") == {"04_evidence_analysis": {"EVIDENCE_DIR": "evidence"}}, "it only reads"


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


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "notebooks:\n  02_baseline_rollouts:\n    MAX_EPISODES: 0\n",
            "MAX_EPISODES must be a whole number of at least 1",
        ),
        ("notebooks:\n  02_baseline_rollouts:\n    N_TRAJECTORIES: two\n", "N_TRAJECTORIES must be a whole number"),
        ("notebooks:\n  02_baseline_rollouts:\n    SUITE_VERSION: 3\n", "SUITE_VERSION must be str like its default"),
        ("notebooks:\n  02_baseline_rollouts: [1, 2]\n", "02_baseline_rollouts's parameters must be a mapping"),
        (
            "notebooks:\n  03_train_grpo:\n    temperature: .nan\n",
            "03_train_grpo: invalid TrainConfig: temperature must be",
        ),
        ("notebooks:\n  03_train_grpo:\n    eval_episodes: 0\n", "eval_episodes must be at least 1"),
        ("notebooks:\n  03_train_grpo:\n    TRAIN_CONFIG: configs/nope.yaml\n", "configs/nope.yaml does not exist"),
        ("notebooks:\n  03_train_grpo:\n    TRAIN_CONFIG: configs/smoke.yaml\n", "is a `make reproduce` profile"),
        ("notebooks:\n  01_explore_environment: {}\nextra: 1\n", "unknown top-level key(s) ['extra']"),
        ("notebooks:\n  01_explore_environment: {\n", "is not valid YAML at line"),
    ],
)
def test_a_bad_profile_is_refused_whole_before_anything_runs_with_one_line(tmp_path, text, message, capsys):
    profile = _write_profile(tmp_path, text)
    with pytest.raises(ReproduceError) as refused:
        load_profile(profile)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert reproduce.main(["--profile", profile]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_folders_a_run_writes_are_checked_before_any_notebook_runs(tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("not a folder")
    profile = _write_profile(
        tmp_path, f"notebooks:\n  02_baseline_rollouts:\n    EVIDENCE_DIR: {tmp_path}/a_file/evidence\n"
    )
    ran = []
    monkeypatch.setattr(reproduce, "run_notebook", lambda *a, **k: ran.append(a))
    with pytest.raises(ReproduceError, match="02_baseline_rollouts's EVIDENCE_DIR .* is a file, not a folder"):
        reproduce.reproduce(profile, build_dir=tmp_path / "build")
    assert ran == []


def test_promotion_copies_a_complete_full_run_and_refuses_anything_less(tmp_path):
    build, target = tmp_path / "build" / "full", tmp_path / "evidence"
    (build / "evidence").mkdir(parents=True)
    target.mkdir()
    (target / "stale.png").write_text("an earlier run's figure")
    (target / "baselines.json").write_text('{"old": 1}\n')
    with pytest.raises(ReproduceError, match="run.json is missing"):
        reproduce.promote_evidence(build, target)
    (build / "run.json").write_text(json.dumps({"profile": "smoke", "notebooks": {"02_baseline_rollouts": {}}}))
    with pytest.raises(ReproduceError, match="holds no complete full run"):
        reproduce.promote_evidence(build, target)
    record = {"profile": "full", "notebooks": {"02_baseline_rollouts": {}, "03_train_grpo": {}}}
    (build / "run.json").write_text(json.dumps(record))
    for name in reproduce.PROMOTED_REQUIRED[:-1]:
        (build / "evidence" / name).write_text(f"new {name}\n")
    with pytest.raises(ReproduceError, match=r"lacks \['training_log.csv'\]: the run did not finish"):
        reproduce.promote_evidence(build, target)
    assert (target / "baselines.json").read_text() == '{"old": 1}\n', "nothing promoted"
    (build / "evidence" / "training_log.csv").write_text("step\n1\n")
    from lib.measure.evaluation import heldout_suite, validation_suite

    def episodes(specs):
        return gzip.compress("".join(json.dumps({"seed": spec.seed}) + "\n" for spec in specs).encode())

    (build / "evidence" / "pre_eval.jsonl.gz").write_bytes(episodes(heldout_suite()[:3]))
    (build / "evidence" / "post_eval.jsonl.gz").write_bytes(episodes(validation_suite(3)))
    with pytest.raises(ReproduceError, match="outside the held-out suite .* never promoted"):
        reproduce.promote_evidence(build, target)
    assert (target / "baselines.json").read_text() == '{"old": 1}\n', "nothing promoted"
    (build / "evidence" / "post_eval.jsonl.gz").write_bytes(episodes(heldout_suite()[3:6]))
    (build / "evidence" / ".run.lock").write_text("{}")
    written = reproduce.promote_evidence(build, target)
    assert sorted(written) == sorted(reproduce.PROMOTED_REQUIRED)
    assert (target / "baselines.json").read_text() == "new baselines.json\n"
    assert not (target / "stale.png").exists() and not (target / ".run.lock").exists()


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


def test_a_run_prints_a_line_per_notebook_and_only_the_warnings_that_matter(tmp_path, monkeypatch, capfd):
    """papermill's echo printed ~1,000 lines for the smoke profile (every cell's start and end and
    output), the kernel's TCP notice, libraries' FutureWarnings and TRL's experimental notice."""
    notebooks = tmp_path / "notebooks"
    code = (
        "import os, sys, warnings\n"
        "for i in range(200):\n"
        "    print('line', i)\n"
        "warnings.warn('an API will change', FutureWarning)\n"
        "warnings.warn('the fit did not converge', UserWarning)\n"
        "print('headless' if os.environ.get('CERNENV_HEADLESS') == '1' else 'watched')\n"
    )
    _write_notebook(notebooks, "a_first", code)
    monkeypatch.setattr(reproduce, "NOTEBOOKS_DIR", notebooks)
    profile = _write_profile(tmp_path, "notebooks:\n  a_first: {}\n")
    import io

    out = io.StringIO()
    (executed,) = reproduce.reproduce(profile, build_dir=tmp_path / "build", out=out)
    lines = [line for line in out.getvalue().splitlines() if ": still running, " not in line]  # a slow kernel start
    assert len(lines) == 6, lines
    assert lines[0] == "[1/1] a_first (profile) …" and lines[1].startswith("[1/1] a_first (profile): done in ")
    assert "UserWarning: the fit did not converge" in lines[2]
    assert lines[3].startswith("done: 1 notebook(s) of the profile profile in ") and "(a_ " in lines[3]
    assert lines[4] == f"  executed notebooks: {tmp_path / 'build'}/ (run.json: each one's commit and time)"
    assert lines[5] == "next: make report PROFILE=profile, then open reports/profile/a_first.readers.html in a browser"
    captured = capfd.readouterr()
    assert "without encryption" not in captured.err + captured.out and "line 199" not in captured.err + captured.out
    outputs = "".join(
        o.get("text", "") for c in nbformat.read(executed, as_version=4).cells for o in c.get("outputs", [])
    )
    assert "headless" in outputs and "FutureWarning" not in outputs, "the kernel ran headless, libraries' notices off"


def test_the_notebooks_progress_lines_are_echoed_and_nothing_else():
    """`make reproduce` shows the progress meters a notebook prints (headless `lib.progress`
    lines, even split across writes), not the rest of its output."""
    import io

    from lib.notebooks.reproduce import ProgressEcho
    from lib.progress import Progress

    out = io.StringIO()
    echo = ProgressEcho(out)
    progress = Progress("SFT warm start", total=285, unit="step")
    line = progress.meter()  # "SFT warm start: 0/285 steps (0%) [00:00<?, ?step/s]"
    progress.close()
    echo.write("loading the tokenizer\n2026-11-28 06:37:04,684 lib.progress: " + line[:10])
    echo.write(line[10:] + "\nsome other output\nGRPO: 1/2 steps (50%) [00:03<00:03, 0.3 steps/s]\n")
    assert out.getvalue().splitlines() == [
        f"    {line.strip()}",
        "    GRPO: 1/2 steps (50%) [00:03<00:03, 0.3 steps/s]",
    ]


def test_a_mistyped_profile_gets_a_did_you_mean_and_a_bare_report_names_the_run_there_is(tmp_path):
    from lib.notebooks import export
    from lib.notebooks.reproduce import ReproduceError, profile_path

    with pytest.raises(ReproduceError, match="did you mean PROFILE=smoke"):
        profile_path("smok")
    (tmp_path / "smoke").mkdir()
    (tmp_path / "smoke" / "01_explore_environment.ipynb").write_text("{}")
    with pytest.raises(
        FileNotFoundError, match=r"run `make reproduce PROFILE=full` first; .*`make report PROFILE=smoke`"
    ):
        export.export_reports(tmp_path / "full", tmp_path / "reports")


def test_a_run_ends_with_its_time_what_it_wrote_where_and_the_next_command(tmp_path, monkeypatch):
    """`make reproduce` ended at "[4/4] ... done": no total, no word of where the evidence went or of
    `make report`; the full run's summary names the promotion step too."""
    from lib.notebooks.reproduce import duration, run_summary

    seconds = {"02_baseline_rollouts": 25.2, "03_train_grpo": 118.0, "04_evidence_analysis": 9.0}
    for profile in ("smoke", "full"):
        plan = {name: parameters for name, parameters in load_profile(profile).items() if name in seconds}
        lines = run_summary(profile, plan, ROOT / "build" / profile, seconds)
        each = "02 25 s, 03 1 min 58 s, 04 9 s"
        assert lines[0] == f"done: 3 notebook(s) of the {profile} profile in 2 min 32 s ({each})"
        assert lines[1] == f"  executed notebooks: build/{profile}/ (run.json: each one's commit and time)"
        assert lines[2] == (
            f"  written: build/{profile}/evidence/ (02_baseline_rollouts's EVIDENCE_DIR, 03_train_grpo's evidence_dir)"
        )
        assert lines[3] == f"  written: build/{profile}/outputs/ (03_train_grpo's output_dir)"
        pages = "reports/" if profile == "full" else f"reports/{profile}/"
        command = "make report" if profile == "full" else f"make report PROFILE={profile}"
        assert lines[4] == f"next: {command}, then open {pages}04_evidence_analysis.readers.html in a browser"
    assert "make promote-evidence" in lines[5]
    assert duration(3725) == "1 h 2 min" and duration(59.6) == "1 min 0 s"


def test_the_summary_names_the_folder_make_report_writes(tmp_path):
    """The Makefile maps a profile to its reports folder; the summary says the same folder."""
    import subprocess

    for profile in ("smoke", "full"):
        dry = subprocess.run(
            ["make", "-s", "-n", "report", f"PROFILE={profile}", "VENV=.venv"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin", "MAKEFLAGS": ""},
        )
        command = dry.stdout.strip().splitlines()[-1]
        assert command.endswith(f" build/{profile} {reproduce.shown_path(reproduce.reports_dir(profile))}"), command


def test_the_first_run_says_it_builds_the_warm_start_and_how_long_that_took(tmp_path, monkeypatch):
    """Nothing warned that the first smoke run builds the stand-in's warm start (190 steps, minutes on a
    busy machine); once a warm start of the same campaigns is cached, nothing is said. The time it
    gives is its own campaigns' estimate, not the 600-campaign default's."""
    import lib.training.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "WARM_START_CACHE", tmp_path / "warm_start")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    smoke = load_profile("smoke")
    config = reproduce.training_config(smoke[reproduce.TRAIN_NOTEBOOK])
    campaigns = config.warm_start_episodes
    note = reproduce.warm_start_note(smoke)
    assert note.startswith(f"first run: notebook 03 builds the CPU stand-in's warm start ({campaigns} campaigns, ")
    steps = runtime.warm_start_steps(campaigns, config.warm_start_epochs, config.warm_start_batch_size)
    assert f"about {steps} steps, " in note and "an estimate (its progress bar gives the time left as it goes)" in note
    assert "1778" not in note and "21.4" not in note, "not the 600-campaign default's"
    cached = tmp_path / "warm_start" / "cernenv-tiny-0123456789abcdef"
    cached.mkdir(parents=True)
    (cached / "warm_start.json").write_text(json.dumps({"episodes": 200, "action_tokens": None}))
    assert reproduce.warm_start_note(smoke) is not None, "the full profile's is not the smoke one's"
    (cached / "warm_start.json").write_text(json.dumps({"episodes": campaigns, "action_tokens": 5000}))
    assert reproduce.warm_start_note(smoke) is None
    assert reproduce.warm_start_note(load_profile("committed")) is None, "no training"


def test_a_misspelt_make_variable_is_named_with_the_one_meant_before_anything_runs():
    """`make reproduce PROFIL=smoke` silently started the 30-minute full profile."""
    import subprocess

    def make(*arguments):
        return subprocess.run(
            ["make", "-s", *arguments], cwd=ROOT, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
        )

    for given, meant in (("PROFIL=smoke", "PROFILE"), ("AGNET=my:Agent", "AGENT"), ("profile=smoke", "PROFILE")):
        refused = make("-n", "reproduce", given)
        name = given.split("=")[0]
        assert refused.returncode == 2 and refused.stdout == "", refused.stdout
        assert f"{name} is not a variable of this Makefile: did you mean {meant}?" in refused.stderr
    assert make("help", "CUDA_VISIBLE_DEVICES=0", "PROFILE=smoke").returncode == 0, "names unlike any pass"


def test_a_silent_notebook_gets_a_line_every_heartbeat_and_a_talking_one_none():
    """No README command stays silent over 15 s: a notebook that echoes nothing for `every_s` gets a
    line saying it still runs."""
    import io

    out = io.StringIO()
    with reproduce.Heartbeat(out, "04_evidence_analysis", every_s=0.05) as heartbeat:
        time.sleep(1.3)
    said = out.getvalue().splitlines()
    assert said and all(line.startswith("    04_evidence_analysis: still running, ") for line in said)
    quiet = io.StringIO()
    with reproduce.Heartbeat(quiet, "03_train_grpo", every_s=60.0) as heartbeat:
        heartbeat.said()
    assert quiet.getvalue() == ""
    assert reproduce.HEARTBEAT_S <= 15


def test_make_report_ends_with_the_pages_it_wrote_and_the_one_to_open(tmp_path):
    """`make report` wrote three pages per notebook without saying which to open."""
    from lib.notebooks import export

    pages = []
    for name in ("01_explore_environment", "04_evidence_analysis"):
        for suffix in ("", export.READERS_SUFFIX, export.STANDALONE_SUFFIX):
            pages.append(tmp_path / "reports" / f"{name}{suffix}.html")
            pages[-1].parent.mkdir(exist_ok=True)
            pages[-1].write_bytes(b"x" * 1_200_000)
    lines = export.summary(tmp_path / "build", tmp_path / "reports", pages, 8.6)
    assert lines[0].startswith(f"exported 2 notebook(s) from {tmp_path / 'build'}/ to {tmp_path / 'reports'}/ in 9 s")
    assert lines[1:3] == ["  01_explore_environment: 1.2, 1.2, 1.2 MB", "  04_evidence_analysis: 1.2, 1.2, 1.2 MB"]
    opened = tmp_path / "reports" / "04_evidence_analysis.readers.html"
    assert lines[3].startswith(f"open {opened} in a browser: the results, code hidden"), "results first"
    assert lines[3].endswith(opened.as_uri())
    assert export.page_to_open(pages[:3]) == pages[1], "without notebook 04: the last notebook's readers' page"
    assert export.page_to_open([pages[0], pages[3]]) == pages[3], "without readers' pages: notebook 04's with code"
