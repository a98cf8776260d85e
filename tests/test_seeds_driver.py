"""The three-seed evidence driver (`python -m lib.training.seeds`, `make evidence-seeds`): which runs
it starts, in what order, and how long the imitation-only policy trains. The runs themselves are
replaced by a recorder here: each is the ordinary `python -m lib.training` run tested elsewhere."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from lib.training.cli import read_config_file
from lib.training.seeds import imitation_campaigns, run_seeds

ROOT = Path(__file__).resolve().parents[1]


def result(warm_s: float, grpo_s: float, *, loaded: bool = False, train_seconds=None) -> dict:
    warm_start = {"episodes": 200, "steps": 590, "loaded": loaded}
    if train_seconds is not None:
        warm_start["train_seconds"] = train_seconds
    return {"seconds": {"warm_start": warm_s, "grpo": grpo_s}, "warm_start": warm_start}


def test_the_imitation_only_policy_gets_the_warm_start_and_grpo_time_in_campaigns():
    assert imitation_campaigns(result(600.0, 300.0), 200) == 300
    assert imitation_campaigns(result(600.0, 1.0), 200) == 201, "rounded up: never less time than GRPO had"
    # a warm start loaded from .cache/ counts the training time it recorded when it was built
    assert imitation_campaigns(result(0.1, 300.0, loaded=True, train_seconds=300.0), 200) == 400
    with pytest.raises(ValueError, match="remove that folder"):
        imitation_campaigns(result(0.1, 300.0, loaded=True), 200)


class Recorder:
    """Stands in for the runs: writes what each leaves behind and remembers the order."""

    def __init__(self, fail: str = ""):
        self.commands, self.events, self.fail, self.lock = [], [], fail, threading.Lock()

    def __call__(self, command, log: Path) -> int:
        name = log.parent.name
        with self.lock:
            self.commands.append((name, command))
            self.events.append(("start", name))
        log.parent.mkdir(parents=True, exist_ok=True)
        if name.startswith("seed"):
            outputs = Path(command[command.index("--output_dir") + 1])
            outputs.mkdir(parents=True, exist_ok=True)
            (outputs / "train_result.json").write_text(json.dumps(result(400.0, 100.0)))
        if name == "sft":
            evidence = Path(command[command.index("--evaluate") + 1])
            evidence.mkdir(parents=True, exist_ok=True)
            (evidence / "pre_eval.jsonl.gz").write_bytes(b"")
        with self.lock:
            self.events.append(("end", name))
        return 1 if name == self.fail else 0


def test_every_seed_runs_then_the_imitation_only_policy_then_the_report(tmp_path):
    recorder = Recorder()
    record = run_seeds(
        "configs/train/smoke.yaml", [0, 1, 2], tmp_path, jobs=2, extra=["--max_steps", "2"], runner=recorder
    )
    names = [name for name, _ in recorder.commands]
    events = recorder.events
    assert events.index(("start", "sft")) > events.index(("end", "seed0")), "sized by the first seed's times"
    assert events.index(("start", "report")) > max(events.index(("end", name)) for name in names if name != "report")
    assert set(names) == {"seed0", "seed1", "seed2", "sft", "report"}
    by_name = dict(recorder.commands)
    for seed in (0, 1, 2):
        command = by_name[f"seed{seed}"]
        assert command[command.index("--seed") + 1] == str(seed)
        assert command[command.index("--evidence_dir") + 1] == str(tmp_path / f"seed{seed}" / "evidence")
        assert command[-2:] == ["--max_steps", "2"], "the extra flags go to every run"
    smoke_campaigns = read_config_file(ROOT / "configs" / "train" / "smoke.yaml")["warm_start_episodes"]
    sft = by_name["sft"]
    assert sft[sft.index("--warm_start_episodes") + 1] == str(smoke_campaigns * 500 // 400)
    assert sft[sft.index("--evaluate") + 1] == str(tmp_path / "sft" / "evidence")
    report = by_name["report"]
    assert report.count("--run") == 3 and report[report.index("--out") + 1] == str(tmp_path / "report")
    saved = json.loads((tmp_path / "seeds_run.json").read_text())
    assert saved["imitation_campaigns"] == record["imitation_campaigns"] == smoke_campaigns * 500 // 400
    assert saved["commit"] and {entry["name"] for entry in saved["commands"]} == set(names)
    assert {entry["command"][0] for entry in saved["commands"]} == {"python"}, "no machine's Python path"


def test_the_record_names_the_python_and_the_repository_s_folders_neutrally():
    import sys

    from lib.training.seeds import REPO, recorded_command

    command = [sys.executable, "-m", "lib.training", "--evidence_dir", str(REPO / "build" / "s" / "evidence")]
    assert recorded_command(command) == ["python", "-m", "lib.training", "--evidence_dir", "build/s/evidence"]
    assert recorded_command(["python3", "-m", "x"]) == ["python3", "-m", "x"], "another program is kept as given"


def test_a_failed_seed_stops_before_the_report_and_says_where_to_look(tmp_path):
    recorder = Recorder(fail="seed1")
    with pytest.raises(RuntimeError, match="seed1 failed"):
        run_seeds("configs/train/smoke.yaml", [0, 1], tmp_path, runner=recorder)
    assert "report" not in [name for name, _ in recorder.commands]
    saved = json.loads((tmp_path / "seeds_run.json").read_text())
    assert [entry["status"] for entry in saved["commands"] if entry["name"] == "seed1"] == [1]


def test_a_failed_first_seed_starts_no_other_run(tmp_path):
    """The imitation-only policy is sized by the first seed: when it fails, the seeds still waiting
    are not started (an hour each), and the record says what ran."""
    recorder = Recorder(fail="seed0")
    with pytest.raises(RuntimeError, match="seed0 failed"):
        run_seeds("configs/train/smoke.yaml", [0, 1, 2], tmp_path, jobs=1, runner=recorder)
    assert [name for name, _ in recorder.commands] == ["seed0"]
    saved = json.loads((tmp_path / "seeds_run.json").read_text())
    assert [(entry["name"], entry["status"]) for entry in saved["commands"]] == [("seed0", 1)]


class Checkout:
    """Stands in for `git_state`: the checkout moves (a commit) once `after` runs have started."""

    def __init__(self, recorder: Recorder, after: int):
        self.recorder, self.after = recorder, after

    def __call__(self) -> dict:
        moved = len(recorder_starts(self.recorder)) >= self.after
        return {"commit": "b" * 40 if moved else "a" * 40, "dirty": False, "changes_sha256": None}


def recorder_starts(recorder: Recorder) -> list:
    return [name for kind, name in recorder.events if kind == "start"]


def test_a_run_whose_checkout_moves_starts_nothing_more_and_says_to_use_a_clone(tmp_path):
    """The seeds' evidence must come from one commit: a commit made while seed 0 runs fails seed 0
    (its evidence could mix two trees) and no other run starts; the record says why."""
    recorder = Recorder()
    with pytest.raises(RuntimeError, match=r"seed0 failed: HEAD moved from a+ to b+ while it ran.*git clone \. DIR"):
        run_seeds("configs/train/smoke.yaml", [0, 1, 2], tmp_path, jobs=1, runner=recorder, state=Checkout(recorder, 1))
    assert recorder_starts(recorder) == ["seed0"]
    saved = json.loads((tmp_path / "seeds_run.json").read_text())
    assert saved["commit"] == "a" * 40 and [(e["name"], e["status"]) for e in saved["commands"]] == [("seed0", 0)]
    assert "while it ran" in saved["commands"][0]["moved"]


def test_a_later_run_is_not_started_once_the_checkout_moved(tmp_path):
    """Uncommitted changes made while seed 1 runs: seed 1 counts as failed, the imitation-only run
    still waiting is not started (status null, and why), seed 0 keeps its status, no report is written."""
    recorder = Recorder()
    states = iter([None] * 4)  # the start, before and after seed0, before seed1: unchanged; then changed

    def state() -> dict:
        changed = next(states, "changed") is not None
        return {"commit": "a" * 40, "dirty": changed, "changes_sha256": "c" * 64 if changed else None}

    with pytest.raises(RuntimeError, match="uncommitted changes to tracked files changed"):
        run_seeds("configs/train/smoke.yaml", [0, 1], tmp_path, jobs=1, runner=recorder, state=state)
    assert recorder_starts(recorder) == ["seed0", "seed1"] and "report" not in recorder_starts(recorder)
    saved = {e["name"]: e for e in json.loads((tmp_path / "seeds_run.json").read_text())["commands"]}
    assert saved["seed0"]["status"] == 0 and "moved" not in saved["seed0"]
    assert saved["seed1"]["status"] == 0 and "while it ran" in saved["seed1"]["moved"]
    assert saved["sft"]["status"] is None and saved["sft"]["moved"].startswith("not started:")


def test_a_run_started_again_keeps_what_finished_on_the_same_checkout_and_runs_the_rest(tmp_path):
    """After a failure (a kill, a session's end), the same command on the same checkout runs only the
    commands that did not finish, and the report; a finished seed whose files are gone runs again, and
    on another checkout every command runs again."""
    checkout = {"commit": "a" * 40, "dirty": False, "changes_sha256": None}
    with pytest.raises(RuntimeError, match="seed2 failed"):
        run_seeds(
            "configs/train/smoke.yaml", [0, 1, 2], tmp_path, runner=Recorder(fail="seed2"), state=lambda: checkout
        )
    again = Recorder()
    record = run_seeds("configs/train/smoke.yaml", [0, 1, 2], tmp_path, runner=again, state=lambda: checkout)
    assert sorted(recorder_starts(again)) == ["report", "seed2"]
    saved = {e["name"]: e for e in json.loads((tmp_path / "seeds_run.json").read_text())["commands"]}
    assert {name for name, e in saved.items() if e.get("kept")} == {"seed0", "seed1", "sft"}
    assert saved["seed0"]["status"] == 0 and "seconds" in saved["seed0"], "the finished run's own record"
    assert record["imitation_campaigns"] > 0

    (tmp_path / "seed1" / "outputs" / "train_result.json").unlink()
    lost = Recorder()
    run_seeds("configs/train/smoke.yaml", [0, 1, 2], tmp_path, runner=lost, state=lambda: checkout)
    assert sorted(recorder_starts(lost)) == ["report", "seed1"]

    moved = Recorder()
    other = {**checkout, "commit": "b" * 40}
    run_seeds("configs/train/smoke.yaml", [0, 1, 2], tmp_path, runner=moved, state=lambda: other)
    assert sorted(recorder_starts(moved)) == ["report", "seed0", "seed1", "seed2", "sft"]

    changed = Recorder()
    run_seeds(
        "configs/train/smoke.yaml", [0, 1, 2], tmp_path, extra=["--max_steps", "2"], runner=changed, state=lambda: other
    )
    assert sorted(recorder_starts(changed)) == ["report", "seed0", "seed1", "seed2", "sft"], "another command"
