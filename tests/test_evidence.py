"""Evidence writers and renderers: the seed's artifact names and columns, concurrency, kills,
empty and partial data, and honest before/after statistics."""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path

import numpy as np
import pytest

from lib.evidence import (
    CheckpointEvalWriter,
    EvidencePaths,
    RewardComponentLogWriter,
    TrainingLogWriter,
    before_after_metrics,
    format_episode_markdown,
    read_records,
    render_all,
    render_before_after,
    render_checkpoint_progression,
    render_reward_components,
    render_sample_trajectories,
    render_training_curve,
)

SEED_ARTIFACTS = {
    "training_log_csv": "training_log.csv", "reward_components_csv": "reward_components.csv",
    "checkpoint_evals_csv": "checkpoint_evals.csv", "training_curve_png": "training_curve.png",
    "reward_components_png": "reward_components.png", "checkpoint_progression_png": "checkpoint_progression.png",
    "before_after_summary_png": "before_after_summary.png", "reward_distribution_png": "reward_distribution.png",
    "before_after_metrics_json": "before_after_metrics.json", "sample_trajectories_md": "sample_trajectories.md",
    "pre_eval_jsonl": "pre_eval.jsonl", "post_eval_jsonl": "post_eval.jsonl",
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def assert_real_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000
    pixels = matplotlib.image.imread(str(path))
    assert pixels.reshape(-1, pixels.shape[-1]).std(axis=0).max() > 0.01, "not a single colour"


def test_artifact_names_and_columns_are_the_seeds(tmp_path):
    paths = EvidencePaths(tmp_path / "ev")
    for attribute, name in SEED_ARTIFACTS.items():
        assert getattr(paths, attribute) == tmp_path / "ev" / name
    paths.ensure()
    assert paths.root.is_dir()
    assert TrainingLogWriter.COLUMNS == ("step", "epoch", "loss", "reward", "reward_std", "kl", "grad_norm",
                                         "learning_rate", "wall_time_s")
    assert RewardComponentLogWriter.COLUMNS == (
        "step", "n", "mean_cumulative", "mean_terminal", "mean_step_shaping", "discovered_rate",
        "mass_correct_rate", "channel_correct_rate", "spin_correct_rate", "parsed_rate", "mean_n_steps")
    assert CheckpointEvalWriter.COLUMNS == ("step", "fraction_done", "episodes", "mean_reward", "success_rate",
                                            "mass_acc", "channel_acc")
    writer = TrainingLogWriter(paths.training_log_csv)
    assert paths.training_log_csv.read_text().splitlines() == [",".join(TrainingLogWriter.COLUMNS)]
    with pytest.raises(ValueError, match="unknown column"):
        writer.append({"step": 1, "lsos": 0.3})


def _append_rows(path: str, worker: int, n: int) -> None:
    writer = TrainingLogWriter(Path(path))
    for i in range(n):
        writer.append({"step": worker * 10_000 + i, "loss": 0.5, "reward": float(i), "wall_time_s": 1.25})


def test_concurrent_appends_from_processes_and_threads_keep_every_row_whole(tmp_path):
    path = tmp_path / "training_log.csv"
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_append_rows, args=(str(path), w, 200)) for w in range(4)]
    threads = [threading.Thread(target=_append_rows, args=(str(path), 10 + w, 200)) for w in range(4)]
    for worker in processes + threads:
        worker.start()
    for worker in processes + threads:
        worker.join(timeout=60)
    records = read_records(path)
    assert records.n_skipped == 0 and len(records.rows) == 8 * 200
    steps = sorted(int(row["step"]) for row in records.rows)
    assert steps == sorted(w * 10_000 + i for w in [0, 1, 2, 3, 10, 11, 12, 13] for i in range(200))
    assert all(row["loss"] == "0.5" and row["wall_time_s"] == "1.25" for row in records.rows)


def test_a_truncated_last_line_breaks_neither_rendering_nor_the_next_append(tmp_path):
    paths = EvidencePaths(tmp_path)
    writer = TrainingLogWriter(paths.training_log_csv)
    for step in range(5):
        writer.append({"step": step, "loss": 1.0 / (step + 1), "reward": step, "kl": 0.01 * step})
    with open(paths.training_log_csv, "a") as f:  # a kill in the middle of a row
        f.write("5,0.1,0.2")
    assert render_training_curve(paths.training_log_csv, paths.training_curve_png) is not None
    writer.append({"step": 6, "loss": 0.1, "reward": 6})
    rows = read_records(paths.training_log_csv).rows
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3, 4, 6]
    assert_real_png(paths.training_curve_png)


def test_renderers_survive_missing_empty_and_partial_files(tmp_path):
    paths = EvidencePaths(tmp_path)
    for render, csv, png in [(render_training_curve, paths.training_log_csv, paths.training_curve_png),
                             (render_reward_components, paths.reward_components_csv, paths.reward_components_png),
                             (render_checkpoint_progression, paths.checkpoint_evals_csv,
                              paths.checkpoint_progression_png)]:
        assert render(csv, png) is None  # missing
        csv.write_text("")
        assert render(csv, png) is None  # empty
    CheckpointEvalWriter(paths.checkpoint_evals_csv).append(step=10, mean_reward=-1.5)  # partial row
    assert render_checkpoint_progression(paths.checkpoint_evals_csv, paths.checkpoint_progression_png)
    payload = render_before_after(pre_jsonl=paths.pre_eval_jsonl, post_jsonl=paths.post_eval_jsonl,
                                  summary_png=paths.before_after_summary_png,
                                  distribution_png=paths.reward_distribution_png,
                                  metrics_json=paths.before_after_metrics_json)
    assert payload is None and not paths.before_after_metrics_json.exists()  # nothing to compare yet
    assert render_sample_trajectories(pre_jsonl=paths.pre_eval_jsonl, post_jsonl=paths.post_eval_jsonl,
                                      md_path=paths.sample_trajectories_md) is None
    rendered = render_all(paths)  # regenerates what the data allow, skips the rest
    assert rendered["checkpoint_progression_png"] == paths.checkpoint_progression_png
    assert rendered["training_curve_png"] is None and rendered["before_after_metrics_json"] is None


def _episode(seed, reward, correct, exists=True, steps=None):
    return {"seed": seed, "scenario": None, "difficulty": "easy", "cumulative_reward": reward,
            "correct_outcome": correct, "discovered": exists and correct, "correct_mass": correct if exists else None,
            "correct_channel": correct if exists else None, "correct_spin": None, "truth": {"exists": exists},
            "steps": steps if steps is not None else [
                {"action": {"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6}},
                 "reward": 0.0, "parsed_ok": True, "rule_violations": []},
                {"action": "not json", "reward": -0.1, "parsed_ok": False,
                 "rule_violations": ["INVALID_ACTION: ..."]}]}


def _write_jsonl(path, episodes, truncated_tail=False):
    text = "".join(json.dumps(e) + "\n" for e in episodes)
    path.write_text(text + ('{"seed": 99, "cumul' if truncated_tail else ""))


def test_before_after_metrics_and_plots_on_a_clear_improvement(tmp_path):
    paths = EvidencePaths(tmp_path)
    rng = np.random.default_rng(3)
    base = rng.normal(0.0, 2.0, size=100)
    pre = [_episode(i, float(r), bool(i % 4 == 0), exists=i % 5 != 0) for i, r in enumerate(base)]
    post = [_episode(i, float(r) + 1.5 + rng.normal(0, 0.2), bool(i % 4 != 3), exists=i % 5 != 0)
            for i, r in enumerate(base)]
    _write_jsonl(paths.pre_eval_jsonl, pre, truncated_tail=True)
    _write_jsonl(paths.post_eval_jsonl, post)
    payload = render_before_after(pre_jsonl=paths.pre_eval_jsonl, post_jsonl=paths.post_eval_jsonl,
                                  summary_png=paths.before_after_summary_png,
                                  distribution_png=paths.reward_distribution_png,
                                  metrics_json=paths.before_after_metrics_json)
    assert payload["n"] == {"pre": 100, "post": 100, "pairs": 100}
    assert payload["bootstrap"]["pairing"] == "paired"
    assert payload["pre"]["mean_reward"] == pytest.approx(float(np.mean(base)))
    assert payload["pre"]["success_rate"] == pytest.approx(0.25) and payload["post"]["success_rate"] == 0.75
    low, high = payload["delta_ci95"]["mean_reward"]
    assert 1.3 < low < payload["delta"]["mean_reward"] < high < 1.7
    assert payload["delta_ci95"]["success_rate"][0] > 0
    assert json.loads(paths.before_after_metrics_json.read_text())["delta"] == pytest.approx(payload["delta"],
                                                                                              nan_ok=True)
    assert_real_png(paths.before_after_summary_png)
    assert_real_png(paths.reward_distribution_png)


def test_no_difference_gives_an_interval_around_zero_and_unpaired_when_episodes_differ():
    rng = np.random.default_rng(4)
    pre = [_episode(i, float(r), bool(r > 0)) for i, r in enumerate(rng.normal(0, 1, 150))]
    post = [_episode(1000 + i, float(r), bool(r > 0)) for i, r in enumerate(rng.normal(0, 1, 150))]
    payload = before_after_metrics(pre, post)
    assert payload["bootstrap"]["pairing"] == "unpaired"
    low, high = payload["delta_ci95"]["mean_reward"]
    assert low < 0 < high


def test_sample_trajectories_are_readable_markdown(tmp_path):
    paths = EvidencePaths(tmp_path)
    _write_jsonl(paths.pre_eval_jsonl, [_episode(1, -1.0, False), _episode(2, 0.5, False, steps=[])])
    _write_jsonl(paths.post_eval_jsonl, [_episode(1, 4.0, True)])
    render_sample_trajectories(pre_jsonl=paths.pre_eval_jsonl, post_jsonl=paths.post_eval_jsonl,
                               md_path=paths.sample_trajectories_md, n_samples=2)
    text = paths.sample_trajectories_md.read_text()
    assert "configure_beam" in text and "beam_energy_tev=13.6" in text and "INVALID_ACTION" in text
    assert "No steps recorded" in text
    single = format_episode_markdown(_episode(7, 2.0, True), "one episode")
    assert single.startswith("### one episode") and "| 1 | `configure_beam`" in single
