"""Progress (lib/progress.py): one mechanism, tqdm's: a bar when watched, tqdm's meter as a log line
at most once per interval when headless; and the Trainer callback's compact line of metrics."""

from __future__ import annotations

import logging

import pytest

from lib import progress as progress_module
from lib.progress import Progress, headless


def test_headless_progress_logs_tqdms_meter_at_most_once_per_interval_and_always_the_end(caplog, monkeypatch):
    monkeypatch.setenv("CERNENV_HEADLESS", "1")
    with caplog.at_level(logging.INFO, logger="lib.progress"):
        quiet = Progress("SFT", total=100, unit="step", every_s=3600.0)
        assert quiet.bar is None, "headless: no bar is drawn"
        assert [quiet.update(done) for done in range(1, 100)] == [None] * 99  # within the interval: nothing
        final = quiet.update(100)
        assert final.startswith("SFT: 100/100 steps (100%) [00:00<00:00, ") and "step" in final.split("[")[1]
        chatty = Progress("evaluation", total=4, unit="episode", every_s=0.0, initial=1)
        line = chatty.update(2)
        assert line.startswith("evaluation: 2/4 episodes (50%) [00:00<"), line
    assert [r.getMessage() for r in caplog.records] == [final, line]


def test_a_watched_run_gets_a_tqdm_bar_with_the_time_left(monkeypatch, capsys):
    monkeypatch.delenv("CERNENV_HEADLESS", raising=False)
    progress = Progress("GRPO", total=4, unit="step", draw=True, initial=1)
    progress.update(3)
    progress.set_postfix("reward +0.5")
    drawn = capsys.readouterr().err  # tqdm draws on stderr
    assert "GRPO:" in drawn and "3/4" in drawn and "reward +0.5" in drawn and "<" in drawn
    progress.update(4)
    assert progress.bar is None, "a finished bar is closed"


def test_headless_is_the_variable_or_no_terminal(monkeypatch):
    monkeypatch.setenv("CERNENV_HEADLESS", "1")
    assert headless()
    monkeypatch.setenv("CERNENV_HEADLESS", "0")
    monkeypatch.setattr(progress_module, "in_notebook", lambda: True)
    assert not headless(), "a notebook someone has open draws its bars"


@pytest.mark.parametrize(
    "logs, line",
    [
        (
            {
                "loss": 0.01234,
                "reward": 0.4123,
                "reward_std": 0.31,
                "grad_norm": 0.812,
                "learning_rate": 3e-4,
                "kl": 0.0,
            },
            "reward +0.412 ± 0.310, loss 0.01234, kl 0, grad norm 0.812, lr 0.0003",
        ),
        (
            {"loss": 1.5, "mean_token_accuracy": 0.5, "learning_rate": 2e-3, "epoch": 0.4},
            "loss 1.5, lr 0.002, token accuracy 0.500",
        ),
        ({"train_runtime": 12.0, "train_loss": 0.3}, ""),
        ({"reward": float("nan"), "loss": 2.0}, "loss 2"),
    ],
)
def test_a_trainer_log_becomes_one_short_line(logs, line):
    from lib.training.callbacks import metrics_line

    assert metrics_line(logs) == line


def test_headless_step_notes_are_one_per_interval_and_the_last_at_the_end(caplog, monkeypatch):
    """A warm start's per-step lines in a log: the first, then at most one per `every_s`, and the
    last at `close` (a notebook page carried 219 of them for one smoke warm start)."""
    monkeypatch.setenv("CERNENV_HEADLESS", "1")
    with caplog.at_level(logging.INFO, logger="lib.progress"):
        progress = Progress("SFT", total=285, unit="step", every_s=3600.0)
        for step in range(1, 286):
            progress.note(f"SFT step {step}/285: loss {1 / step:.3f}")
        progress.close()
    assert [r.getMessage() for r in caplog.records] == ["SFT step 1/285: loss 1.000", "SFT step 285/285: loss 0.004"]


def test_a_notebook_s_progress_lines_go_to_stdout_and_only_warnings_to_stderr(capsys):
    """Jupyter shows stderr on pink: the project's INFO lines read as errors there."""
    from lib.progress import notebook_logging

    saved = logging.getLogger().handlers[:], logging.getLogger("lib").handlers[:], logging.getLogger("lib").level
    try:
        notebook_logging()
        notebook_logging()  # a cell run twice prints each line once
        logging.getLogger("lib.progress").info("SFT warm start: 1/2 steps")
        logging.getLogger("lib.training").warning("GRPO step 1/2: THE REWARD DID NOT MOVE THE POLICY")
        logging.getLogger("matplotlib").info("font substituted")
        out, err = capsys.readouterr()
    finally:
        logging.getLogger().handlers[:], logging.getLogger("lib").handlers[:] = saved[0], saved[1]
        logging.getLogger("lib").setLevel(saved[2])
    assert out.count("SFT warm start: 1/2 steps") == 1 and "DID NOT MOVE" not in out
    assert "THE REWARD DID NOT MOVE THE POLICY" in err and "SFT warm start" not in err and "font" not in err + out


def test_a_unit_under_way_is_never_silent_for_long(caplog, monkeypatch):
    """Headless, nothing logged for `heartbeat_s`: the meter again, saying which unit is under way
    (a GRPO step of a real model is minutes of silence otherwise); a line just written resets it; the
    heartbeat's thread beats on its own and stops when the work is closed."""
    import time

    monkeypatch.setenv("CERNENV_HEADLESS", "1")
    with caplog.at_level(logging.INFO, logger="lib.progress"):
        manual = Progress("GRPO", total=2, unit="step", heartbeat_s=0)  # beaten by hand, no thread
        manual.beat(3600.0)
        assert caplog.records == [], "within the heartbeat: nothing"
        manual.beat(0.0)
        assert caplog.records[-1].getMessage().startswith("GRPO: 0/2 steps (0%)")
        assert caplog.records[-1].getMessage().endswith("(still working on step 1)")
        caplog.clear()
        threaded = Progress("SFT", total=3, unit="step", heartbeat_s=0.05)
        deadline = time.monotonic() + 30
        while not caplog.records and time.monotonic() < deadline:
            time.sleep(0.01)
        assert caplog.records and "still working on step 1" in caplog.records[0].getMessage()
        threaded.close()
        time.sleep(0.2)  # a beat already under way may finish
        count = len(caplog.records)
        time.sleep(0.3)
        assert len(caplog.records) == count, "closed: the heartbeat stopped"
