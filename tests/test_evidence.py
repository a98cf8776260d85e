"""Evidence writers and renderers: the seed's artifact names and columns, concurrency, kills,
empty and partial data, and honest before/after statistics."""

from __future__ import annotations

import gzip
import json
import multiprocessing
import threading
from pathlib import Path

import matplotlib
import numpy as np
import pytest

from lib.measure import comparison
from lib.measure.comparison import before_after_metrics
from lib.report.episode_markdown import format_episode_markdown
from lib.report.evidence import (
    CheckpointEvalWriter,
    EvidencePaths,
    RewardComponentLogWriter,
    TrainingLogWriter,
    read_evidence,
    read_records,
    render_all,
    render_before_after,
    render_checkpoint_progression,
    render_reward_components,
    render_sample_trajectories,
    render_training_curve,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CSV_RENDERERS = [
    (TrainingLogWriter, render_training_curve),
    (RewardComponentLogWriter, render_reward_components),
    (CheckpointEvalWriter, render_checkpoint_progression),
]


def assert_real_png(path: Path) -> None:
    assert path.exists() and path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 10_000
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.reshape(-1, pixels.shape[-1]).std(axis=0).max() > 0.01, "a single-colour image"


def append(writer, row):
    if isinstance(writer, CheckpointEvalWriter):
        writer.append(**row)
    else:
        writer.append(row)


def full_row(writer_cls, step: int) -> dict:
    return {column: (step if column == "step" else 0.5 + 0.001 * step) for column in writer_cls.COLUMNS}


STEP = {"step": 0, "prompt": "", "completion": "", "done": False}
"""The fields of a step record the tests below do not vary."""


def episode(seed, reward, correct, *, exists=True, mass=True, spin=None, scenario=None, steps=None):
    return {
        "seed": seed,
        "scenario": scenario,
        "difficulty": "easy",
        "total_reward": reward,
        "cumulative_reward": reward,
        "discovered": correct and exists,
        "correct_outcome": correct,
        "correct_mass": mass if exists else None,
        "correct_channel": mass if exists else None,
        "correct_spin": spin,
        "truth": {"exists": exists, "mass_gev": 125.09 if exists else None},
        "steps": steps
        if steps is not None
        else [
            {
                **STEP,
                "action": {"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6}},
                "reward": 0.0,
                "parsed_ok": True,
                "rule_violations": [],
            },
            {
                **STEP,
                "step": 1,
                "action": {"action_type": "fit_resonance", "parameters": {"window_gev": [110, 140]}},
                "reward": -0.1,
                "parsed_ok": True,
                "rule_violations": ["PREREQUISITE: build the spectrum first"],
            },
        ],
    }


def write_jsonl(path: Path, episodes) -> Path:
    """`episodes` as JSON lines, written as they are (unchecked), gzip-compressed where the name ends .gz."""
    data = "".join(json.dumps(e) + "\n" for e in episodes).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


# ----------------------------------------------------------------------------- interface


def test_artifact_names_and_columns_are_the_seeds(tmp_path):
    paths = EvidencePaths(tmp_path / "ev")
    paths.ensure()
    assert paths.root.is_dir()
    names = {name: getattr(paths, name).name for name in paths.__dataclass_fields__ if name != "root"}
    assert names == {
        "training_log_csv": "training_log.csv",
        "reward_components_csv": "reward_components.csv",
        "checkpoint_evals_csv": "checkpoint_evals.csv",
        "training_curve_png": "training_curve.png",
        "reward_components_png": "reward_components.png",
        "checkpoint_progression_png": "checkpoint_progression.png",
        "before_after_summary_png": "before_after_summary.png",
        "reward_distribution_png": "reward_distribution.png",
        "before_after_metrics_json": "before_after_metrics.json",
        "sample_trajectories_md": "sample_trajectories.md",
        "pre_eval_jsonl": "pre_eval.jsonl.gz",
        "post_eval_jsonl": "post_eval.jsonl.gz",
        "baselines_json": "baselines.json",
    }
    assert all(getattr(paths, name).parent == paths.root for name in names)
    expected = {
        TrainingLogWriter: "step,epoch,loss,reward,reward_std,kl,grad_norm,learning_rate,wall_time_s,"
        "frac_reward_zero_std",
        RewardComponentLogWriter: "step,n,mean_cumulative,mean_terminal,mean_step_shaping,discovered_rate,"
        "mass_correct_rate,channel_correct_rate,spin_correct_rate,parsed_rate,mean_n_steps,mean_cumulative_low,"
        "mean_cumulative_high,mean_terminal_low,mean_terminal_high,mean_step_shaping_low,mean_step_shaping_high,"
        "discovered_rate_n,mass_correct_rate_n,channel_correct_rate_n,spin_correct_rate_n,"
        "parsed_rate_n",
        CheckpointEvalWriter: "step,fraction_done,episodes,mean_reward,success_rate,mass_acc,channel_acc,"
        "episodes_with_particle,mean_reward_low,mean_reward_high",
    }
    for cls, header in expected.items():
        path = tmp_path / f"{cls.__name__}.csv"
        cls(path)
        assert path.read_text() == header + "\n"


def test_unknown_column_raises_and_missing_or_non_finite_values_are_empty(tmp_path):
    log = TrainingLogWriter(tmp_path / "log.csv")
    with pytest.raises(ValueError, match="rewrd"):
        log.append({"step": 1, "rewrd": 0.5})
    with pytest.raises(ValueError, match="stepp"):
        CheckpointEvalWriter(tmp_path / "ck.csv").append(stepp=1)
    log.append({"step": np.int64(2), "loss": float("nan"), "reward": float("inf"), "kl": np.float32(0.25)})
    lines = (tmp_path / "log.csv").read_text().splitlines()
    assert lines[1:] == ["2,,,,,0.25,,,,"]


def test_an_existing_log_with_other_columns_is_refused(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("step,something_else\n1,2\n")
    with pytest.raises(ValueError, match="move the old file aside"):
        TrainingLogWriter(path)


def test_seed_written_crlf_logs_are_accepted(tmp_path):
    path = tmp_path / "log.csv"
    path.write_bytes(b"step,fraction_done,episodes,mean_reward,success_rate,mass_acc,channel_acc\r\n1,,,0.5,,,\r\n")
    CheckpointEvalWriter(path).append(step=2, mean_reward=0.75, mean_reward_low=0.5)
    assert [r["mean_reward"] for r in read_records(path).rows] == [0.5, 0.75]
    assert path.read_bytes().endswith(b"\n2,,,0.75,,,\n"), "a file of the older columns is appended to in them"


def test_an_older_checkpoint_log_is_drawn_and_says_it_holds_no_interval(tmp_path, monkeypatch):
    import lib.report.evidence_figures as evidence_figures

    figures = []
    monkeypatch.setattr(evidence_figures, "_save_figure", lambda fig, path: figures.append(fig) or path)
    path = tmp_path / "checkpoint_evals.csv"
    path.write_text(
        "step,fraction_done,episodes,mean_reward,success_rate,mass_acc,channel_acc\n0,0.0,21,3.19,0.67,0.53,0.53\n"
    )
    render_checkpoint_progression(path, tmp_path / "progression.png")
    reward_ax, rates_ax = [ax for ax in figures[0].axes if ax.get_visible()]
    assert len(reward_ax.collections) == 0 and "an older file: no interval for mean reward" in reward_ax.get_title()
    assert len(rates_ax.collections) == 1, "the success rate's exact interval needs only the episodes"


def _rollout(discovered, correct_mass, total_reward, parsed=(True,)):
    from lib.episodes.records import EpisodeRecord, StepRecord

    steps = [StepRecord(i, "", "", {}, ok, 0.0, False, []) for i, ok in enumerate(parsed)]
    truth = {"exists": correct_mass is not None}
    return EpisodeRecord(
        0, None, "easy", truth, total_reward, total_reward, 1.0, discovered, correct_mass, None, None, steps
    )


def test_a_rollout_row_gives_each_rate_its_count_and_the_mean_its_interval(tmp_path, monkeypatch):
    """Each rate of a GRPO step's rollouts is over its own count (the mass over the particle
    episodes graded, parsing over the actions), which the figure's exact intervals need; the mean
    return, grade and shaping carry their 95% bootstrap intervals; a log written before those columns is appended to in
    its own and drawn without them."""
    import lib.report.evidence_figures as evidence_figures
    from lib.training.grpo import rollout_row

    records = [
        _rollout(True, True, 5.0, parsed=(True, True, False)),
        _rollout(True, False, 1.0),
        _rollout(False, None, -1.0, parsed=(True, True)),
        _rollout(False, None, 3.0),
    ]
    row = rollout_row(3, records)
    assert (row["discovered_rate"], row["discovered_rate_n"]) == (0.5, 4)
    assert (row["mass_correct_rate"], row["mass_correct_rate_n"]) == (0.5, 2), "over the two particle episodes"
    assert (row["channel_correct_rate"], row["channel_correct_rate_n"]) == (None, 0), "none graded: no rate"
    assert (row["parsed_rate"], row["parsed_rate_n"]) == (pytest.approx(6 / 7), 7), "over the 7 actions"
    assert (
        row["mean_cumulative"] == 2.0 and -1.0 <= row["mean_cumulative_low"] < 2.0 < row["mean_cumulative_high"] <= 5.0
    )
    path = tmp_path / "reward_components.csv"
    RewardComponentLogWriter(path).append(row)
    figures = []
    monkeypatch.setattr(evidence_figures, "_save_figure", lambda fig, png: figures.append(fig) or png)
    render_reward_components(path, tmp_path / "components.png")
    reward_ax, rates_ax = [ax for ax in figures[0].axes if ax.get_visible()][:2]
    assert len(reward_ax.collections) == 3, "the total's, the grade's and the shaping's intervals"
    assert row["mean_terminal_low"] <= row["mean_terminal"] == 1.0 <= row["mean_terminal_high"]
    assert len(rates_ax.collections) == 3, (
        "an exact interval for the discoveries, masses and parsing (no channel or spin graded)"
    )
    older = tmp_path / "older" / "reward_components.csv"
    older.parent.mkdir()
    older.write_text(",".join(RewardComponentLogWriter.COLUMNS[:11]) + "\n")
    RewardComponentLogWriter(older).append(row)
    assert older.read_text().splitlines()[1] == "3,4,2.0,1.0,1.0,0.5,0.5,,,0.8571428571428571,0.0"
    render_reward_components(older, tmp_path / "older.png")
    assert "an older file: no interval" in [ax for ax in figures[1].axes if ax.get_visible()][1].get_title()


# ----------------------------------------------------------------------------- concurrency and kills

N_ROWS = 200


def _expected(writer_id: int, i: int) -> dict:
    return {
        "step": writer_id * 10_000 + i,
        "epoch": writer_id,
        "loss": 0.1234567890123 * i,
        "reward": -1.0 / (i + 1),
        "reward_std": 1e-7 * i,
        "kl": 3.0,
        "grad_norm": float(i) ** 0.5,
        "learning_rate": 1e-5,
        "wall_time_s": 1234.5678 + i,
        "frac_reward_zero_std": 0.125 * (i % 9),
    }


def _append_many(path: str, writer_id: int, start) -> None:
    writer = TrainingLogWriter(Path(path))  # every process creates the file: the header must be written once
    start.wait()
    for i in range(N_ROWS):
        writer.append(_expected(writer_id, i))


def test_concurrent_appends_from_processes_and_threads_give_whole_rows(tmp_path):
    path = tmp_path / "training_log.csv"
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_append_many, args=(str(path), w, start)) for w in range(4)]
    threads = [threading.Thread(target=_append_many, args=(str(path), 4 + w, start)) for w in range(4)]
    for worker in procs + threads:
        worker.start()
    start.set()
    for worker in procs + threads:
        worker.join(timeout=30)
    assert all(p.exitcode == 0 for p in procs)

    text = path.read_text()
    assert text.count("step,epoch") == 1 and text.startswith("step,epoch")
    records = read_records(path)
    assert records.n_skipped == 0
    assert len(records.rows) == 8 * N_ROWS
    by_step = {int(row["step"]): row for row in records.rows}
    assert len(by_step) == 8 * N_ROWS
    for writer_id in range(8):
        for i in range(N_ROWS):
            want = _expected(writer_id, i)
            got = by_step[want["step"]]
            assert {k: float(v) for k, v in got.items()} == pytest.approx(
                {k: float(v) for k, v in want.items()}, rel=0, abs=0
            )


@pytest.mark.parametrize("writer_cls, render", CSV_RENDERERS)
def test_a_killed_writer_breaks_neither_reading_rendering_nor_the_next_append(tmp_path, writer_cls, render):
    path = tmp_path / "log.csv"
    writer = writer_cls(path)
    for step in range(1, 4):
        append(writer, full_row(writer_cls, step))
    with open(path, "ab") as f:
        f.write(b"4,0.1,0.2")  # the process died mid-row
    records = read_records(path)
    assert len(records.rows) == 3 and records.n_skipped == 1
    assert render(path, tmp_path / "plot.png") == tmp_path / "plot.png"

    append(writer_cls(path), full_row(writer_cls, 5))  # a new run reopens the file
    records = read_records(path)
    assert records.n_skipped == 0
    assert [int(r["step"]) for r in records.rows] == [1, 2, 3, 5]
    assert path.read_bytes().endswith(b"\n") and b"4,0.1,0.2" not in path.read_bytes()


def test_an_episode_file_is_read_by_the_one_episode_reader(tmp_path):
    old = episode(1, 0.0, False)
    old["steps"][0]["observation_summary"] = {"selected_beam_energy": 13.0}
    path = write_jsonl(tmp_path / "pre_eval.jsonl", [old])
    with open(path, "a") as f:
        f.write('{"seed": 2, "cumulative_re')  # an evaluation killed mid-write
    records = read_records(path)
    assert [r["seed"] for r in records.rows] == [1] and records.n_skipped == 1
    # an old record's renamed keys are read under their current names, as load_episodes_jsonl reads them
    assert records.rows[0]["steps"][0]["observation_summary"] == {"selected_beam_energy_tev": 13.0}
    with open(path, "a") as f:
        f.write('\n{"seed": 3}\n')  # the damaged line is now in the middle: an episode would be lost
    with pytest.raises(ValueError, match=r"pre_eval.jsonl:2 is not an episode"):
        read_records(path)


def test_a_kill_during_the_header_and_garbage_lines_are_survived(tmp_path):
    path = tmp_path / "log.csv"
    path.write_bytes(b"step,ep")
    TrainingLogWriter(path).append({"step": 1, "reward": 0.5})
    assert [r["reward"] for r in read_records(path).rows] == [0.5]
    with open(path, "ab") as f:
        f.write(b'\x00\x00\x00\n1,2\n"unclosed,quote\n\xff\xfe,bad\n')
    TrainingLogWriter(path).append({"step": 2, "reward": 0.75})
    records = read_records(path)
    assert [r["reward"] for r in records.rows] == [0.5, 0.75] and records.n_skipped == 4


# ----------------------------------------------------------------------------- renderers


@pytest.mark.parametrize("writer_cls, render", CSV_RENDERERS)
def test_csv_renderers_on_missing_empty_and_partial_data(tmp_path, writer_cls, render):
    png = tmp_path / "plot.png"
    assert render(tmp_path / "missing.csv", png) is None
    (tmp_path / "empty.csv").write_text("")
    assert render(tmp_path / "empty.csv", png) is None
    writer_cls(tmp_path / "header.csv")
    assert render(tmp_path / "header.csv", png) is None
    assert not png.exists()

    partial = writer_cls(tmp_path / "partial.csv")
    second = writer_cls.COLUMNS[3]
    for step in range(1, 6):
        append(partial, {"step": step, second: float(step) if step % 2 else float("nan")})
    assert render(tmp_path / "partial.csv", png) == png
    assert_real_png(png)

    (tmp_path / "no_step.csv").write_text(f"{second}\n1\n2\n")  # an old or hand-written log: plot by row
    assert render(tmp_path / "no_step.csv", png) == png


@pytest.mark.parametrize("writer_cls, render", CSV_RENDERERS)
def test_csv_renderers_draw_full_logs_without_touching_pyplot(tmp_path, writer_cls, render):
    import matplotlib.pyplot as plt

    backend, figures = matplotlib.get_backend(), plt.get_fignums()
    writer = writer_cls(tmp_path / "log.csv")
    for step in range(1, 80):
        append(writer, full_row(writer_cls, step))
    assert render(tmp_path / "log.csv", tmp_path / "plot.png") == tmp_path / "plot.png"
    assert_real_png(tmp_path / "plot.png")
    assert matplotlib.get_backend() == backend and plt.get_fignums() == figures
    assert not list(tmp_path.glob(".*.tmp"))


def _before_after(tmp_path, pre, post):
    kwargs = dict(
        pre_jsonl=tmp_path / "pre.jsonl",
        post_jsonl=tmp_path / "post.jsonl",
        summary_png=tmp_path / "summary.png",
        distribution_png=tmp_path / "dist.png",
        metrics_json=tmp_path / "metrics.json",
    )
    if pre is not None:
        write_jsonl(kwargs["pre_jsonl"], pre)
    if post is not None:
        write_jsonl(kwargs["post_jsonl"], post)
    return render_before_after(**kwargs), kwargs


def test_before_after_on_missing_empty_and_one_sided_data(tmp_path):
    payload, kwargs = _before_after(tmp_path, None, None)
    assert payload is None and not kwargs["metrics_json"].exists() and not kwargs["summary_png"].exists()
    payload, kwargs = _before_after(tmp_path, [], [])
    assert payload is None
    payload, kwargs = _before_after(tmp_path, [episode(i, float(i), i % 2 == 0) for i in range(10)], [])
    assert payload["post"]["n"] == 0 and payload["post"]["mean_reward"] is None
    assert payload["delta"]["mean_reward"] is None and payload["delta_ci95"]["mean_reward"] is None
    assert json.loads(kwargs["metrics_json"].read_text())["pre"]["n"] == 10
    assert_real_png(kwargs["summary_png"])
    assert_real_png(kwargs["distribution_png"])


def test_before_after_metrics_on_a_hand_made_sample(tmp_path):
    pre = [
        episode(0, 4.0, True, spin=True),
        episode(1, -2.0, False, mass=False),
        episode(2, 3.0, True, exists=False),
        episode(3, -3.0, False, exists=False),
    ]
    post = [
        episode(0, 4.0, True, spin=True),
        episode(1, 3.0, True, spin=True),
        episode(2, 3.0, True, exists=False),
        episode(3, 3.0, True, exists=False),
    ]
    payload, kwargs = _before_after(tmp_path, pre, post)
    with open(kwargs["pre_jsonl"], "a") as f:
        f.write('{"seed": 9, "cumulative_re')  # an evaluation killed mid-write
    payload = render_before_after(**kwargs)
    assert payload == json.loads(kwargs["metrics_json"].read_text())
    assert payload["pre"].pop("endings") == {"no claim: stopped before the end": 4}
    assert payload["pre"] == pytest.approx(
        {
            "n": 4,
            "n_with_particle": 2,
            "n_correct": 2,
            "mean_reward": 0.5,
            "median_reward": 0.5,
            "success_rate": 0.5,
            "mass_acc": 0.5,
            "channel_acc": 0.5,
            "spin_acc": 0.5,
        }
    )
    assert payload["post"].pop("endings") == {"no claim: stopped before the end": 4}
    assert payload["post"]["mean_reward"] == pytest.approx(3.25) and payload["post"]["success_rate"] == 1.0
    assert payload["post"]["mass_acc"] == 1.0 and payload["post"]["spin_acc"] == 1.0
    assert payload["delta"]["mean_reward"] == pytest.approx(2.75)
    assert payload["delta"]["success_rate"] == pytest.approx(0.5)
    assert payload["bootstrap"]["pairing"] == "paired" and payload["n"] == {"pre": 4, "post": 4, "pairs": 4}
    assert payload["bootstrap"]["n_resamples"] == 2000
    low, high = payload["delta_ci95"]["mean_reward"]
    assert low <= 2.75 <= high
    none_spin = before_after_metrics([episode(0, 1.0, True, spin=None)], [])
    assert none_spin["pre"]["spin_acc"] == 0.0  # None counts as wrong where the particle exists


def test_before_after_metrics_and_plots_on_a_clear_improvement(tmp_path):
    rng = np.random.default_rng(3)
    base = rng.normal(0.0, 2.0, size=100)
    pre = [episode(i, float(r), i % 4 == 0, exists=i % 5 != 0, mass=i % 4 == 0) for i, r in enumerate(base)]
    post = [
        episode(i, float(r) + 1.5 + rng.normal(0, 0.2), i % 4 != 3, exists=i % 5 != 0, mass=i % 4 != 3)
        for i, r in enumerate(base)
    ]
    payload, kwargs = _before_after(tmp_path, pre, post)
    assert payload["n"] == {"pre": 100, "post": 100, "pairs": 100}
    assert payload["bootstrap"]["pairing"] == "paired"
    assert payload["pre"]["mean_reward"] == pytest.approx(float(np.mean(base)))
    assert payload["pre"]["success_rate"] == pytest.approx(0.25) and payload["post"]["success_rate"] == 0.75
    low, high = payload["delta_ci95"]["mean_reward"]
    assert 1.3 < low < payload["delta"]["mean_reward"] < high < 1.7  # pairing removes the task-to-task spread
    assert payload["delta_ci95"]["success_rate"][0] > 0
    assert_real_png(kwargs["summary_png"])
    assert_real_png(kwargs["distribution_png"])


def test_before_after_is_reported_per_part_and_per_particle_and_old_payloads_still_render():
    curated = dict(scenario="higgs_diphoton_125")
    pre = [
        episode(0, -2.0, False, scenario="procedural_easy"),
        episode(1, -2.0, False, scenario="procedural_easy"),
        episode(2, -3.0, False, exists=False, scenario="procedural_hard"),
        episode(3, 1.0, True, exists=False, scenario="procedural_hard"),
        episode(4, 5.0, True, **curated),
        episode(5, 4.0, True, **curated),
        episode(6, -1.0, False, exists=False, scenario="null_diphoton_750"),
    ]
    post = [dict(e) for e in pre]
    post[1].update(cumulative_reward=4.0, correct_outcome=True)  # unseen, with a particle: 0 → 1 of 2
    post[2].update(cumulative_reward=3.0, correct_outcome=True)  # unseen, null: 1 → 2 of 2
    post[6].update(cumulative_reward=3.0, correct_outcome=True)  # known physics, null: 0 → 1 of 1
    payload = before_after_metrics(pre, post)
    groups = payload["groups"]
    assert set(groups) == {
        "with_particle",
        "null",
        "unseen",
        "unseen_with_particle",
        "unseen_null",
        "known_physics",
        "known_physics_with_particle",
        "known_physics_null",
    }
    assert payload["pre"]["n_correct"] == 3 and payload["post"]["n_correct"] == 6
    assert groups["unseen"]["n"] == {"pre": 4, "post": 4, "pairs": 4} and groups["unseen"]["pairing"] == "paired"
    assert (
        groups["unseen_with_particle"]["pre"]["n_correct"],
        groups["unseen_with_particle"]["post"]["n_correct"],
    ) == (0, 1)
    assert groups["unseen_with_particle"]["delta"]["mean_reward"] == pytest.approx(3.0)
    assert groups["unseen_null"]["delta"]["success_rate"] == pytest.approx(0.5)
    assert groups["known_physics_with_particle"]["delta"]["mean_reward"] == 0.0
    assert groups["known_physics_with_particle"]["delta_ci95"]["mean_reward"] == [0.0, 0.0]
    assert groups["null"]["pre"]["n"] == 3 and groups["null"]["post"]["success_rate"] == 1.0
    markdown = comparison.before_after_markdown(payload)
    assert markdown.startswith("7 paired episodes.")
    for row in (
        "| whole suite | 3 → 6 of 7 |",
        "| unseen particles, with a particle | 0 → 1 of 2 | -2.000 → 1.000 | +3.000 [",
        "| unseen particles, null tasks | 1 → 2 of 2 |",
        "| known physics (recall), null tasks | 0 → 1 of 1 |",
        "| known physics (recall), with a particle | 2 → 2 of 2 | 4.500 → 4.500 | +0.000 [+0.000, +0.000] |",
    ):
        assert row in markdown, row
    json.dumps(payload, allow_nan=False)

    old = json.loads(json.dumps(payload))  # as a file written before groups and n_correct existed
    del old["groups"]
    for side in ("pre", "post"):
        del old[side]["n_correct"]
    old_markdown = comparison.before_after_markdown(old)
    assert "| success_rate |" in old_markdown and "| group |" not in old_markdown
    assert "— |" in comparison.group_table(old)


def _synthetic(rng, n, shift, seed_offset=0):
    return [
        episode(seed_offset + i, float(rng.normal(shift, 1.0)), bool(rng.random() < 0.3 + 0.4 * (shift > 0)))
        for i in range(n)
    ]


@pytest.mark.parametrize("seed_offset", [0, 10_000], ids=["paired", "unpaired"])
def test_difference_interval_finds_a_clear_effect(seed_offset):
    rng = np.random.default_rng(1)
    pre, post = _synthetic(rng, 150, 0.0), _synthetic(rng, 150, 1.0, seed_offset)
    payload = before_after_metrics(pre, post)
    assert payload["bootstrap"]["pairing"] == ("paired" if seed_offset == 0 else "unpaired")
    low, high = payload["delta_ci95"]["mean_reward"]
    assert 0 < low < 1.0 < high
    low, high = payload["delta_ci95"]["success_rate"]
    assert 0 < low < 0.4 < high
    assert payload == before_after_metrics(pre, post)  # fixed seed: reproducible


def test_difference_interval_contains_zero_without_an_effect():
    rng = np.random.default_rng(2)
    pre = _synthetic(rng, 150, 0.0)
    same = before_after_metrics(pre, pre)
    assert same["delta_ci95"]["mean_reward"] == [0.0, 0.0]
    relabelled = [dict(e, seed=e["seed"] + 10_000) for e in pre]
    for payload in (
        before_after_metrics(pre, relabelled),
        before_after_metrics(pre, _synthetic(rng, 150, 0.0, 10_000)),
    ):
        assert payload["bootstrap"]["pairing"] == "unpaired"
        for key in ("mean_reward", "success_rate"):
            low, high = payload["delta_ci95"][key]
            assert low < 0 < high


def test_sample_trajectories_are_readable_and_survive_odd_episodes(tmp_path):
    md = tmp_path / "samples.md"
    assert (
        render_sample_trajectories(pre_jsonl=tmp_path / "a.jsonl", post_jsonl=tmp_path / "b.jsonl", md_path=md) is None
        and not md.exists()
    )
    pre = [
        episode(1, -2.0, False, scenario="higgs_diphoton"),
        episode(2, 0.5, False, steps=[]),
        episode(
            3,
            -0.1,
            False,
            steps=[
                {
                    **STEP,
                    "action": "raw model text | with a pipe",
                    "parsed_ok": False,
                    "reward": -0.1,
                    "rule_violations": [],
                }
            ],
        ),
    ]
    post = [episode(10, 3.0, True, scenario="z_dimuon")]
    write_jsonl(tmp_path / "pre.jsonl", pre)
    write_jsonl(tmp_path / "post.jsonl", post)
    path = render_sample_trajectories(
        pre_jsonl=tmp_path / "pre.jsonl", post_jsonl=tmp_path / "post.jsonl", md_path=md, n_samples=4
    )
    text = path.read_text()
    for fragment in (
        "higgs_diphoton",
        "z_dimuon",
        "`configure_beam`",
        "beam_energy_tev=13.6",
        "PREREQUISITE: build the spectrum first",
        "mass 125.09 GeV",
        "_No steps recorded._",
        "(unparsed)",
        "raw model text \\| with a pipe",
        "correct ✓",
        "wrong ✗",
        "-0.100",
    ):
        assert fragment in text, fragment

    write_jsonl(tmp_path / "post.jsonl", [dict(e, cumulative_reward=3.0) for e in pre[:2]])
    write_jsonl(tmp_path / "pre.jsonl", pre[:2])
    text = render_sample_trajectories(
        pre_jsonl=tmp_path / "pre.jsonl", post_jsonl=tmp_path / "post.jsonl", md_path=md
    ).read_text()
    assert "The same 2 task(s)" in text and text.count("### Before training") == 2
    assert "- unseen particles: 0 → 0 of 2 (with a particle 0 → 0 of 2; null tasks 0 → 0 of 0)" in text
    assert "## Task 1 · unseen particles" in text and "known physics (recall):" not in text

    single = format_episode_markdown(episode(7, 2.0, True), "one episode")
    assert single.startswith("### one episode") and "| 1 | `configure_beam`" in single


def _full_folder(root: Path, steps: int = 5, episodes: int = 12) -> EvidencePaths:
    """An evidence folder with every log at `steps` rows and `episodes` episodes before and after."""
    paths = EvidencePaths(root)
    paths.ensure()
    for cls, csv_path in (
        (TrainingLogWriter, paths.training_log_csv),
        (RewardComponentLogWriter, paths.reward_components_csv),
        (CheckpointEvalWriter, paths.checkpoint_evals_csv),
    ):
        writer = cls(csv_path)
        for step in range(1, steps + 1):
            append(writer, full_row(cls, step))
    rng = np.random.default_rng(3)
    write_jsonl(paths.pre_eval_jsonl, _synthetic(rng, episodes, 0.0))
    write_jsonl(paths.post_eval_jsonl, _synthetic(rng, episodes, 1.0))
    return paths


def test_render_all_on_an_empty_a_partial_and_a_full_folder(tmp_path, caplog):
    paths = EvidencePaths(tmp_path / "ev")
    assert set(render_all(paths).values()) == {None}
    assert not paths.root.exists() or not any(paths.root.iterdir())

    CheckpointEvalWriter(paths.checkpoint_evals_csv).append(step=0, mean_reward=-1.5)  # a run that evaluated its start
    rendered = render_all(paths)  # regenerates what the data allow, skips the rest
    assert rendered["checkpoint_progression_png"] == paths.checkpoint_progression_png
    assert rendered["training_curve_png"] is None and rendered["before_after_metrics_json"] is None

    _full_folder(paths.root, steps=29, episodes=40)
    out = render_all(paths)
    assert set(out) == {
        "training_curve_png",
        "reward_components_png",
        "checkpoint_progression_png",
        "before_after_summary_png",
        "reward_distribution_png",
        "before_after_metrics_json",
        "sample_trajectories_md",
    }
    for key, path in out.items():
        assert path == getattr(paths, key)
        if path.suffix == ".png":
            assert_real_png(path)
    sources = json.loads(paths.before_after_metrics_json.read_text())["sources"]
    assert sources == {"pre": "pre_eval.jsonl.gz", "post": "post_eval.jsonl.gz"}, (
        "the files beside it, no machine's path"
    )
    assert "ERROR" not in caplog.text


def _count_reads(monkeypatch, root: Path) -> dict:
    """Count every opening for reading of a file under `root`, through open(), io.open and pathlib."""
    import builtins
    import io

    opened: dict = {}
    real_open = builtins.open

    def counting_open(file, mode="r", *args, **kwargs):
        name = str(file)
        if isinstance(file, (str, Path)) and name.startswith(str(root)) and not set(mode) & set("wax+"):
            opened[Path(name).name] = opened.get(Path(name).name, 0) + 1
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    return opened


def test_render_all_reads_each_file_of_the_folder_once(tmp_path, monkeypatch):
    paths = _full_folder(tmp_path / "ev")
    opened = _count_reads(monkeypatch, paths.root)
    out = render_all(paths)
    assert all(out.values()), out
    data_files = {"pre_eval.jsonl.gz", "post_eval.jsonl.gz", "training_log.csv", "reward_components.csv"}
    assert data_files | {"checkpoint_evals.csv"} >= set(opened) >= data_files, opened
    assert set(opened.values()) == {1}, opened  # each read once, however many renderers use it

    opened.clear()
    evidence = read_evidence(paths)  # what notebook 04 does: one read, then everything from memory
    assert set(opened.values()) == {1} and "before_after_metrics.json" in opened
    opened.clear()
    again = render_all(evidence)
    assert opened == {} and all(again.values())
    assert evidence.before_after["post"]["n"] == 12 and evidence.baselines is None
    assert [row["step"] for row in evidence.training_log.rows] == [1, 2, 3, 4, 5]
    assert evidence.training_log.source == "training_log.csv"


def test_episode_files_are_gzip_compressed_the_same_bytes_each_time_and_a_cut_one_is_refused(tmp_path):
    from lib.episodes.records import save_episodes_jsonl

    episodes = _synthetic(np.random.default_rng(1), 6, 0.5)
    first, second = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    save_episodes_jsonl(episodes, str(first))
    save_episodes_jsonl(episodes, str(second))
    assert first.read_bytes()[:2] == b"\x1f\x8b" and first.read_bytes() == second.read_bytes()
    plain = tmp_path / "a.jsonl"
    save_episodes_jsonl(episodes, str(plain))
    assert gzip.decompress(first.read_bytes()) == plain.read_bytes()
    assert read_records(first).rows == read_records(plain).rows == episodes
    first.write_bytes(first.read_bytes()[:-20])  # a copy cut short
    with pytest.raises(ValueError, match=r"a.jsonl.gz is not a whole gzip file .*git checkout"):
        read_records(first)
    plain.rename(tmp_path / "c.jsonl.gz")  # plain text under a compressed name
    with pytest.raises(ValueError, match=r"c.jsonl.gz is not a whole gzip file"):
        read_records(tmp_path / "c.jsonl.gz")


def test_a_folder_written_before_compression_keeps_its_plain_episode_files(tmp_path):
    rng = np.random.default_rng(2)
    write_jsonl(tmp_path / "pre_eval.jsonl", _synthetic(rng, 4, 0.0))
    paths = EvidencePaths(tmp_path)
    assert paths.pre_eval_jsonl.name == "pre_eval.jsonl" and paths.post_eval_jsonl.name == "post_eval.jsonl.gz"
    assert len(read_evidence(paths).pre) == 4
    write_jsonl(tmp_path / "pre_eval.jsonl.gz", _synthetic(rng, 3, 0.0))  # both: the compressed one is current
    assert EvidencePaths(tmp_path).pre_eval_jsonl.name == "pre_eval.jsonl.gz"


def test_checkpoint_row_feeds_the_checkpoint_writer(tmp_path):
    row = comparison.checkpoint_row(
        50, [episode(0, 1.0, True), episode(1, -1.0, False, mass=False)], fraction_done=0.25
    )
    CheckpointEvalWriter(tmp_path / "ck.csv").append(**row)
    (got,) = read_records(tmp_path / "ck.csv").rows
    assert got == {  # numbers, as typed as the writer wrote them
        "step": 50,
        "fraction_done": 0.25,
        "episodes": 2,
        "mean_reward": 0.0,
        "success_rate": 0.5,
        "mass_acc": 0.5,
        "channel_acc": 0.5,
        "episodes_with_particle": 2,
        "mean_reward_low": -1.0,
        "mean_reward_high": 1.0,
    }
    assert [type(got[k]) for k in ("step", "episodes", "mean_reward")] == [int, int, float]


def test_training_curve_leaves_out_flat_panels_and_says_why(tmp_path, monkeypatch):
    """beta = 0 logs no KL and a constant learning rate draws a flat line: the panels go, the title says."""
    import lib.report.evidence_figures as evidence_figures

    figures = []
    monkeypatch.setattr(evidence_figures, "_save_figure", lambda fig, path: figures.append(fig) or path)
    writer = TrainingLogWriter(tmp_path / "training_log.csv")
    for step in (1, 2, 3):
        writer.append(
            {
                "step": step,
                "epoch": 0.1 * step,
                "loss": 0.1 / step,
                "reward": -1.0 + 0.2 * step,
                "reward_std": 0.3,
                "kl": None,
                "grad_norm": 1.0 + step,
                "learning_rate": 3e-4,
                "wall_time_s": 10.0 * step,
            }
        )
    render_training_curve(tmp_path / "training_log.csv", tmp_path / "curve.png")
    (fig,) = figures
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert not [t for t in titles if "KL" in t or "Learning rate" in t], titles
    assert len(titles) == 4 and "Reward of sampled completions" in titles
    assert "KL not computed (beta = 0" in fig._suptitle.get_text()
    assert "learning rate constant at 0.0003" in fig._suptitle.get_text()
    for step, kl in ((4, 0.01), (5, 0.02)):  # beta > 0 and a schedule: both panels come back
        writer.append(
            {
                "step": step,
                "epoch": 0.1 * step,
                "loss": 0.02,
                "reward": 0.0,
                "reward_std": 0.3,
                "kl": kl,
                "grad_norm": 2.0,
                "learning_rate": 1e-4 / step,
                "wall_time_s": 10.0 * step,
            }
        )
    render_training_curve(tmp_path / "training_log.csv", tmp_path / "curve.png")
    assert len([ax for ax in figures[-1].axes if ax.get_visible()]) == 6


def test_checkpoint_progression_draws_exact_intervals_on_the_success_rate(tmp_path, monkeypatch):
    import lib.report.evidence_figures as evidence_figures

    figures = []
    monkeypatch.setattr(evidence_figures, "_save_figure", lambda fig, path: figures.append(fig) or path)
    writer = CheckpointEvalWriter(tmp_path / "checkpoint_evals.csv")
    for step, rewards in ((0, [-1.0, 0.5, 2.0, -0.5]), (7, [1.0, 2.5, 3.0, 0.0])):
        episodes = [episode(i, r, correct=r > 0.4) for i, r in enumerate(rewards)]
        writer.append(**comparison.checkpoint_row(step, episodes))
    render_checkpoint_progression(tmp_path / "checkpoint_evals.csv", tmp_path / "progression.png")
    reward_ax, rates_ax = [ax for ax in figures[0].axes if ax.get_visible()]
    assert len(rates_ax.collections) == 3, "error bars on the success rate and the mass and channel accuracies"
    assert len(reward_ax.collections) == 1, "and on the mean reward (its bootstrap interval)"
    assert "no interval" not in reward_ax.get_title()
    low, high = evidence_figures._binomial_interval(np.array([0.5, 0.0, 1.0]), np.array([4.0, 4.0, np.nan]))
    # scipy.stats.binomtest(2, 4).proportion_ci() and (0, 4): Clopper–Pearson
    assert low[0] == pytest.approx(0.0676, abs=1e-4) and high[0] == pytest.approx(0.9324, abs=1e-4)
    assert low[1] == 0.0 and high[1] == pytest.approx(0.6024, abs=1e-4) and np.isnan(low[2])


def test_a_new_training_run_moves_aside_only_what_a_training_run_writes(tmp_path):
    """Notebook 02's baselines stay in the evidence folder when notebook 03 starts a new run."""
    from lib.training.resume import archive_previous_evidence

    paths = EvidencePaths(tmp_path / "ev")
    paths.ensure()
    for path in (paths.baselines_json, paths.training_log_csv, paths.before_after_metrics_json):
        path.write_text("{}")
    moved_to = archive_previous_evidence(paths, tmp_path / "out")
    assert paths.baselines_json.read_text() == "{}"
    assert sorted(p.name for p in moved_to.iterdir()) == ["before_after_metrics.json", "training_log.csv"]
    assert "baselines_json" not in EvidencePaths.training_run_fields()
    assert "pre_eval_jsonl" in EvidencePaths.training_run_fields()
