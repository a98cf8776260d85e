"""A training run keeps its state in its output folder (`lib.training.run_state`): a run stopped by
SIGTERM, one that failed and one killed outright are each named by the next run in the folder and
by `make report`, with the checkpoint they can resume from."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap

import pytest

from lib.training import run_state
from lib.training.run_state import RUN_STATE, RunState, unfinished_run

STOPPED_IN_GRPO = textwrap.dedent(
    """
    import sys, time
    from lib.training.run_state import RunState
    with RunState(sys.argv[1]) as state:
        state.phase("GRPO")
        state.step = lambda: "step 3 of 60"
        print("ready", flush=True)
        time.sleep(120)
    """
)


def _complete_checkpoint(folder):
    folder.mkdir(parents=True)
    for name in ("trainer_state.json", "optimizer.pt", "model.safetensors"):
        (folder / name).write_text("{}")


def test_a_run_stopped_by_sigterm_leaves_where_it_stopped_and_still_ends_by_the_signal(tmp_path):
    _complete_checkpoint(tmp_path / "checkpoint-2")
    run = subprocess.Popen([sys.executable, "-c", STOPPED_IN_GRPO, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout.readline().strip() == "ready"
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == -signal.SIGTERM, "the signal does what it did: the process ends by it"
    finally:
        run.kill()
    said = unfinished_run(tmp_path)
    assert said.startswith(f"the training run in {tmp_path} (started ")
    assert "was stopped by SIGTERM on " in said and "in GRPO, step 3 of 60" in said
    assert said.endswith("resume it from checkpoint-2 (--resume_from_checkpoint latest)")


def test_a_failed_a_killed_and_a_finished_run_are_told_apart(tmp_path):
    with pytest.raises(ValueError):
        with RunState(tmp_path) as state:
            state.phase("the SFT warm start")
            raise ValueError("the disk was fine, the data were not")
    said = unfinished_run(tmp_path)
    assert "failed on" in said and "in the SFT warm start: ValueError: the disk was fine" in said
    assert said.endswith("it saved no checkpoint: run it again")
    with pytest.raises(ValueError):
        with RunState(tmp_path):  # refused before its first phase: it wrote nothing, the last state stays
            raise ValueError("gradient_accumulation_steps must be a multiple of the number of processes")
    assert unfinished_run(tmp_path) == said

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    with RunState(tmp_path) as state:
        state.phase("GRPO")
    assert unfinished_run(tmp_path) is None, "finished"
    state.record.update(state="running", pid=int(gone.stdout))  # as a SIGKILL leaves it
    state._write()
    assert "ended without a word (killed, or the machine went down)" in unfinished_run(tmp_path)
    (tmp_path / RUN_STATE).write_text('{"state": ')
    assert f"{tmp_path / RUN_STATE} cannot be read" in unfinished_run(tmp_path)


def test_the_next_run_in_the_folder_and_make_report_name_a_run_that_did_not_finish(tmp_path, monkeypatch, caplog):
    from lib.notebooks import export
    from lib.training import run
    from lib.training.config import TrainConfig

    output = tmp_path / "build" / "smoke" / "outputs"
    output.mkdir(parents=True)
    with pytest.raises(KeyboardInterrupt):
        with RunState(output):
            raise KeyboardInterrupt
    assert "was stopped by Ctrl-C" in unfinished_run(output)
    assert export.unfinished_runs(tmp_path / "build" / "smoke") == [unfinished_run(output)]

    monkeypatch.setattr(run, "_train", lambda config, state, pre_eval: "trained")
    config = TrainConfig(output_dir=str(output), evidence_dir=str(tmp_path / "evidence"), report_to=["none"])
    with caplog.at_level(logging.WARNING, logger="lib.training.run"):
        assert run.train(config) == "trained"
    assert "was stopped by Ctrl-C" in caplog.text and "This run starts afresh" in caplog.text
    assert unfinished_run(output) is None and export.unfinished_runs(tmp_path / "build" / "smoke") == []
    assert run_state.read_json(output / RUN_STATE)["state"] == "finished"
