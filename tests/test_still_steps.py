"""A GRPO step that cannot move the policy is said loudly: in the training log's lines, in
notebook 03 and in the report (`lib.report.conclusion.still_step`)."""

import logging
from types import SimpleNamespace

import pytest

from lib.report.conclusion import still_step, still_steps_markdown

# what the smoke run's first GRPO step logged on an AMD EPYC, every reply refused alike
ALIKE_AND_STILL = {"reward": -1.5, "reward_std": 0.0, "frac_reward_zero_std": 1.0, "grad_norm": 1.11e-07, "loss": 0.0}
MOVED = {"reward": -1.25, "reward_std": 0.44, "frac_reward_zero_std": 0.0, "grad_norm": 3.82, "loss": 0.01}
ALIKE_MOVED_BY_CREDIT = {"reward": -0.5, "reward_std": 0.0, "frac_reward_zero_std": 1.0, "grad_norm": 0.12}


def test_a_step_with_no_gradient_is_still_and_says_why():
    reason = still_step(ALIKE_AND_STILL)
    assert reason is not None
    assert "gradient norm 1.1e-07" in reason and "scored alike (reward -1.500 ± 0.000)" in reason


def test_a_step_whose_groups_differ_and_that_moved_is_not_still():
    assert still_step(MOVED) is None


def test_groups_all_alike_are_said_even_when_other_terms_moved_the_policy():
    reason = still_step(ALIKE_MOVED_BY_CREDIT)
    assert reason is not None and "ranked nothing" in reason and "0.12" in reason


@pytest.mark.parametrize("row", [{}, {"grad_norm": "", "frac_reward_zero_std": None}, {"grad_norm": float("nan")}])
def test_a_row_without_the_figures_is_not_called_still(row):
    assert still_step(row) is None


def test_the_report_warns_of_each_still_step_and_of_none_when_all_moved():
    text = still_steps_markdown([{"step": 1, **ALIKE_AND_STILL}, {"step": 2, **MOVED}])
    assert text.startswith("**Warning: 1 of 2 GRPO steps could not move the policy")
    assert "- step 1: gradient norm" in text and "step 2" not in text
    assert still_steps_markdown([{"step": 1, **MOVED}]) == ""


def test_the_training_log_warns_at_once_in_capitals(caplog, monkeypatch):
    """The line printed at the step itself, not throttled like the metrics lines."""
    from lib.training.callbacks import TrainingProgress

    monkeypatch.setenv("CERNENV_HEADLESS", "1")
    callback = TrainingProgress("GRPO")
    state = SimpleNamespace(is_world_process_zero=True, max_steps=2, global_step=0)
    with caplog.at_level(logging.INFO):
        callback.on_train_begin(None, state, None)
        state.global_step = 1
        callback.on_log(None, state, None, logs=dict(ALIKE_AND_STILL))
        state.global_step = 2
        callback.on_log(None, state, None, logs=dict(MOVED))
        callback.on_train_end(None, state, None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("GRPO step 1/2: THE REWARD DID NOT MOVE THE POLICY: gradient norm 1.1e-07")


def test_the_warm_start_s_logs_get_no_such_warning(caplog, monkeypatch):
    """An SFT log has no groups: a small gradient there is not GRPO's."""
    from lib.training.callbacks import TrainingProgress

    monkeypatch.setenv("CERNENV_HEADLESS", "1")
    callback = TrainingProgress("SFT warm start")
    state = SimpleNamespace(is_world_process_zero=True, max_steps=2, global_step=1)
    with caplog.at_level(logging.INFO):
        callback.on_train_begin(None, state, None)
        callback.on_log(None, state, None, logs={"loss": 0.1, "grad_norm": 0.0})
        callback.on_train_end(None, state, None)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
