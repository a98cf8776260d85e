"""SmolLM2's pipeline (`lib.training.smollm2_pipeline`): its stages, what it resumes from, its summary."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from lib.training import smollm2_pipeline as pipeline
from lib.training.config import TrainConfig


def test_grpo_trains_the_imitation_adapter_and_resumes_from_the_last_checkpoint(tmp_path):
    """The GRPO stage's run starts from the imitation adapter (not a warm start of its own) in the
    pipeline's folders, and resumes from the checkpoint of the highest step (10 after 9, not 9 after
    10 as a sort by name would)."""
    config = TrainConfig(lora_r=8, warm_start_episodes=5, beta=0.0)
    fresh = pipeline.grpo_config(config, tmp_path)
    assert fresh.warm_start_adapter == str(tmp_path / "imitation" / "adapter")
    assert fresh.warm_start_episodes == 0
    assert fresh.output_dir == str(tmp_path / "grpo") and fresh.evidence_dir == str(tmp_path / "evidence")
    assert fresh.resume_from_checkpoint is None
    for step in (2, 9, 10):
        (tmp_path / "grpo" / f"checkpoint-{step}").mkdir(parents=True)
    assert pipeline.grpo_config(config, tmp_path).resume_from_checkpoint == str(tmp_path / "grpo" / "checkpoint-10")


def test_a_stage_runs_in_a_process_of_its_own_and_hands_back_its_result_or_its_error():
    import os

    assert pipeline.in_own_process(os.getpid) != os.getpid()
    assert pipeline.in_own_process(divmod, 7, 2) == (3, 1)
    with pytest.raises(ValueError, match="invalid literal"):
        pipeline.in_own_process(int, "not a number")


def test_the_difference_is_read_from_the_paired_comparison():
    comparison = {
        "delta": {"success_rate": 0.05, "mean_reward": -0.25, "median_reward": 0.0},
        "delta_ci95": {"success_rate": [0.01, 0.09], "mean_reward": [-0.5, 0.0]},
    }
    assert pipeline.difference(comparison) == {
        "success_rate": {"delta": 0.05, "ci95": [0.01, 0.09]},
        "mean_reward": {"delta": -0.25, "ci95": [-0.5, 0.0]},
    }
    assert pipeline._signed({"delta": 0.05, "ci95": [0.01, 0.09]}) == "+0.050 [+0.010, +0.090]"
    assert pipeline._signed({"delta": None, "ci95": None}) == "n/a"


def test_the_pipeline_refuses_an_adapter_it_did_not_make(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        pipeline.main(
            ["--out", str(tmp_path), "--", "--warm_start_adapter", str(tmp_path), "--warm_start_episodes", "0"]
        )
    assert stopped.value.code == 2
    assert "makes its own imitation adapter" in capsys.readouterr().err


def test_a_finished_run_s_evidence_is_promoted_whole_and_an_unfinished_one_not_at_all(tmp_path, capsys):
    """`--promote` copies every file of the run's evidence (not its lock, a partial file or an
    evaluation's seconds, which the summary holds), removes the target's files the run did not make
    but its hand-written README, and refuses a run without its summary, leaving the target as it was."""
    out, target = tmp_path / "run", tmp_path / "evidence"
    (out / "evidence").mkdir(parents=True)
    target.mkdir()
    for name, text in (("README.md", "by hand"), ("old_episodes.jsonl.gz", "stale"), ("pre_eval.jsonl.gz", "old")):
        (target / name).write_text(text)
    for name in (
        "pre_eval.jsonl.gz",
        "post_eval.jsonl.gz",
        ".run.lock",
        "post_eval.jsonl.gz.partial.jsonl.gz",
        "post_eval.seconds.json",
    ):
        (out / "evidence" / name).write_text(name)
    with pytest.raises(FileNotFoundError, match="smollm2_summary.json is missing: .* nothing was promoted"):
        pipeline.promote(out, target)
    assert sorted(p.name for p in target.iterdir()) == ["README.md", "old_episodes.jsonl.gz", "pre_eval.jsonl.gz"]
    (out / "evidence" / "smollm2_summary.json").write_text("{}")
    assert pipeline.promote(out, target) == ["post_eval.jsonl.gz", "pre_eval.jsonl.gz", "smollm2_summary.json"]
    assert sorted(p.name for p in target.iterdir()) == [
        "README.md",
        "post_eval.jsonl.gz",
        "pre_eval.jsonl.gz",
        "smollm2_summary.json",
    ]
    assert (target / "pre_eval.jsonl.gz").read_text() == "pre_eval.jsonl.gz"
    assert (target / "README.md").read_text() == "by hand"


@pytest.mark.slow  # an imitation, a GRPO step and four evaluations of the stand-in model
def test_the_pipeline_runs_every_stage_and_a_second_run_redoes_only_what_is_missing(
    tiny_model_dir, tmp_path, no_evidence_figures, monkeypatch
):
    """Every stage writes its files, the summary counts what each evaluation played, and a run after a
    stage's file was lost makes that file again and leaves the others as they were. No stage loads a
    model in the pipeline's own process (its stages' processes do): a model loaded here would raise."""
    from lib.training import backends, run

    def loaded_here(*args, **kwargs):
        raise AssertionError("a model was loaded in the pipeline's own process")

    monkeypatch.setattr(backends, "load_policy", loaded_here)
    monkeypatch.setattr(run, "load_policy", loaded_here)
    out = tmp_path / "smollm2"
    args = [
        "--out",
        str(out),
        "--heldout-episodes",
        "2",
        "--",
        "--model_name",
        tiny_model_dir,
        "--lora_r",
        "8",
        "--warm_start_episodes",
        "2",
        "--max_steps",
        "1",
        "--num_generations",
        "2",
        "--gradient_accumulation_steps",
        "2",
        "--eval_episodes",
        "2",
        "--max_turns",
        "6",
        "--report_to",
        "none",
    ]
    assert pipeline.main(args) == 0
    evidence = out / "evidence"
    summary = json.loads((evidence / "smollm2_summary.json").read_text())
    assert summary["imitation_campaigns"] == 2
    assert (evidence / "imitation_stage.json").read_bytes() == (
        out / "imitation" / "adapter" / "stage.json"
    ).read_bytes()
    assert {name: entry["evaluated"] for name, entry in summary["evaluations"].items()} == {
        "imitation_validation": 2,
        "grpo_validation": 2,
        "zero_shot_validation": 2,
        "imitation_heldout": 2,
        "grpo_heldout": 2,
    }
    assert "GRPO − imitation on the held-out campaigns" in (evidence / "smollm2_summary.md").read_text()
    curve = list(csv.DictReader((evidence / "checkpoint_evals.csv").open()))
    assert [(int(r["step"]), int(r["episodes"])) for r in curve] == [(0, 2), (1, 2)], "the adapter, then the policy"
    from lib.episodes.records import load_episodes_jsonl

    imitation_eval = out / "imitation" / "validation.jsonl.gz"
    assert load_episodes_jsonl(str(evidence / "pre_eval.jsonl.gz")) == load_episodes_jsonl(str(imitation_eval)), (
        "GRPO's evaluation before training is the imitation stage's, not played again"
    )
    kept = {
        p: p.stat().st_mtime_ns
        for p in [out / "imitation" / "adapter" / "stage.json", imitation_eval, evidence / "pre_eval.jsonl.gz"]
    }
    lost = evidence / "heldout_grpo.jsonl.gz"
    lost.unlink()
    assert pipeline.main(args) == 0
    assert lost.is_file()
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert Path(out / "grpo" / "train_result.json").is_file()


def test_an_adapter_plays_merged_and_computes_what_it_computes(tiny_model_dir):
    """On a CPU a LoRA adapter plays merged into the weights it adapts: the same logits inside the
    block; after it the adapter is back, trainable, and the weights are what they were to within
    float rounding."""
    import torch
    from peft import get_peft_model

    from lib.training.backends import load_policy
    from lib.training.policy_evaluation import adapter_merged

    policy = load_policy(TrainConfig(model_name=tiny_model_dir, lora_r=8, beta=0.0), "trl")
    model = get_peft_model(policy.model, policy.peft_config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor([[1, 5, 9, 14, 2, 7]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        with adapter_merged(model) as playing:
            assert all(layer.merged for layer in playing.modules() if hasattr(layer, "merged"))
            merged = playing(input_ids=ids).logits
    assert not torch.allclose(expected, base, atol=1e-3), "the adapter acts"
    assert torch.allclose(expected, merged, atol=1e-5)
    assert not any(layer.merged for layer in model.modules() if hasattr(layer, "merged"))
    assert all(torch.allclose(p, before[n], atol=1e-6) for n, p in model.named_parameters())
    assert any(p.requires_grad for n, p in model.named_parameters() if "lora_B" in n)
    plain = load_policy(TrainConfig(model_name=tiny_model_dir), "trl").model
    with adapter_merged(plain) as playing:
        assert playing is plain


def test_an_evaluation_played_in_shards_is_the_evaluation_played_whole(tiny_model_dir, tmp_path, monkeypatch):
    """Campaigns split between processes side by side come back in the order given, each the record
    one process playing them all writes (one campaign a batch in both, so each computes the same
    sums)."""
    from lib.episodes.records import load_episodes_jsonl
    from lib.measure.evaluation import validation_suite
    from lib.training import imitation

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config = TrainConfig(model_name=tiny_model_dir, eval_batch_size=1, max_turns=4, report_to=["none"])
    specs = list(validation_suite(3))
    imitation.evaluate_stage(config, None, specs, tmp_path / "whole.jsonl.gz", "zero-shot", processes=1)
    imitation.evaluate_stage(config, None, specs, tmp_path / "shards.jsonl.gz", "zero-shot", processes=2)
    whole = load_episodes_jsonl(str(tmp_path / "whole.jsonl.gz"))
    shards = load_episodes_jsonl(str(tmp_path / "shards.jsonl.gz"))
    assert [e["seed"] for e in shards] == [spec.seed for spec in specs]
    assert shards == whole


@pytest.mark.parametrize(
    "pinned, free_cores, campaigns, expected",
    [
        (None, 2, 120, (2, 1)),
        (None, 4, 72, (3, 1)),
        (None, 4, 48, (2, 2)),
        (None, 2, 47, (1, 2)),
        (None, 2, 2, (1, 2)),
        (None, 1, 120, (1, 1)),
        ("2", 8, 120, (1, 2)),
    ],
)
def test_an_evaluation_plays_one_process_a_free_core_unless_its_threads_are_pinned(
    monkeypatch, pinned, free_cores, campaigns, expected
):
    """One process of one thread per free core, as many as hold a whole batch (24 campaigns here), the
    cores left shared among them; `OMP_NUM_THREADS` keeps one process of that many threads."""
    from lib import runtime
    from lib.training import imitation

    if pinned is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", pinned)
    monkeypatch.setattr(runtime, "cpu_threads", lambda: free_cores)
    assert imitation.evaluation_processes(campaigns, 24) == expected


def test_an_evaluation_s_seconds_outlive_the_run_that_measured_them(tmp_path, monkeypatch):
    """A stage's evaluation written by an earlier run reports the seconds that run measured, kept
    beside its episodes; one whose seconds were never kept says so in the summary instead of 0."""
    from lib.training import imitation

    played = []

    def evaluate_stage(config, adapter, specs, target, name):
        played.append(name)
        target.write_text("episodes")
        return 812.4

    monkeypatch.setattr(imitation, "evaluate_stage", evaluate_stage)
    target = tmp_path / "heldout_grpo.jsonl.gz"
    assert pipeline.evaluate_once(None, None, [], target, "grpo") == 812.4
    assert pipeline.evaluate_once(None, None, [], target, "grpo") == 812.4
    assert played == ["grpo"], "the second run found the episodes written and did not play them again"
    assert pipeline.seconds_file(target) == tmp_path / "heldout_grpo.seconds.json"
    pipeline.seconds_file(target).unlink()
    assert pipeline.evaluate_once(None, None, [], target, "grpo") is None and played == ["grpo"]
    summary = {"evaluations": {}, "seconds": {"heldout_grpo_eval": None, "grpo_grpo": 3245}}
    assert "Seconds: heldout_grpo_eval not recorded, grpo_grpo 3245" in pipeline.summary_markdown(summary)


def test_the_summary_rounds_each_interval_once():
    """The summary's intervals are the episodes' own, rounded once for the page: the first recipe's
    held-out imitation episodes print the interval the baselines' bootstrap gives them (0.435, where
    rounding to four digits first printed 0.434)."""
    evidence = Path(__file__).resolve().parents[1] / "evidence" / "smollm2-100"
    entry = {"policy": "imitation", "split": "held-out", **pipeline.summary_of(evidence / "heldout_imitation.jsonl.gz")}
    row = pipeline.summary_markdown({"evaluations": {"imitation_heldout": entry}, "seconds": {}}).splitlines()[4]
    assert "| 313 | 153 | 0.489 [0.435, 0.546] |" in row


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_the_imitation_stage_trains_on_the_configured_schedule(tiny_model_dir, tmp_path, monkeypatch, schedule):
    """The imitation adapter is trained from nothing on the first `warm_start_episodes` campaigns (one
    example each in the conversation context SmolLM2's recipe plays) on the configuration's
    `warm_start_lr_schedule`; a stage written before is not trained again."""
    from lib.training import imitation

    calls = []

    def fake_train_stage(config, previous, examples, target, checkpointing, lr_schedule="constant"):
        calls.append((previous, len(examples), lr_schedule))
        target.mkdir(parents=True)
        (target / "stage.json").write_text(json.dumps({"examples": len(examples), "seconds": 1.5}))
        return 1.5

    monkeypatch.setattr(imitation, "train_stage", fake_train_stage)
    config = TrainConfig(
        model_name=tiny_model_dir,
        lora_r=8,
        beta=0.0,
        policy_context="conversation",
        warm_start_episodes=3,
        warm_start_lr_schedule=schedule,
    )
    stage = pipeline.imitation_stage(config, tmp_path)
    assert calls == [(None, 3, schedule)]
    assert stage == {"campaigns": 3, "seconds": 2, "adapter": str(tmp_path / "imitation" / "adapter")}
    pipeline.imitation_stage(config, tmp_path)
    assert len(calls) == 1


def test_the_checkpoint_curve_plays_every_kth_checkpoint_between_the_adapter_and_the_final_policy(
    tmp_path, monkeypatch
):
    """The curve's rows are step 0 (the imitation adapter's episodes), every `every`-th saved checkpoint
    played on the validation campaigns, and the last step (the final policy's episodes), each row the
    success of the episodes it was computed from; a checkpoint that was not saved stops it with what to do."""
    committed = Path(__file__).resolve().parents[1] / "evidence"
    first, middle, last = (
        committed / "smollm2-100" / "pre_eval.jsonl.gz",
        committed / "smollm2-100" / "post_eval.jsonl.gz",
        committed / "smollm2-grpo-5e-5" / "post_eval.jsonl.gz",
    )
    out = tmp_path / "run"
    for step in (2, 4):
        (out / "grpo" / f"checkpoint-{step}").mkdir(parents=True)
        (out / "grpo" / f"checkpoint-{step}" / "adapter_config.json").write_text("{}")
    played = []

    def evaluate_once(config, adapter, specs, target, name):
        played.append(adapter.name)
        shutil.copyfile(middle, target)
        return 10.0

    monkeypatch.setattr(pipeline, "evaluate_once", evaluate_once)
    config = TrainConfig(max_steps=6)
    seconds = pipeline.checkpoint_curve_stage(config, out, 2, [], first, last)
    assert played == ["checkpoint-2", "checkpoint-4"] and seconds == 20.0
    rows = list(csv.DictReader((out / "evidence" / "checkpoint_evals.csv").open()))
    assert [int(r["step"]) for r in rows] == [0, 2, 4, 6]
    assert [float(r["fraction_done"]) for r in rows] == [0.0, 2 / 6, 4 / 6, 1.0]
    expected = [success_of(path) for path in (first, middle, middle, last)]
    assert [float(r["success_rate"]) for r in rows] == pytest.approx(expected)
    assert [int(r["episodes"]) for r in rows] == [120, 120, 120, 120]
    assert (out / "evidence" / "checkpoint_progression.png").stat().st_size > 0
    assert not list((out / "evidence").glob("*.partial*"))

    with pytest.raises(FileNotFoundError, match="checkpoint-3 holds no adapter.*--skip checkpoint-curve"):
        pipeline.checkpoint_curve_stage(config, out, 3, [], first, last)
    with pytest.raises(ValueError, match="at least 1"):
        pipeline.checkpoint_curve_stage(config, out, 0, [], first, last)


def success_of(path: Path) -> float:
    """The fraction of `path`'s episodes whose outcome was graded correct, read from the file itself."""
    import gzip

    with gzip.open(path, "rt") as handle:
        episodes = [json.loads(line) for line in handle if line.strip()]
    return sum(bool(e["correct_outcome"]) for e in episodes) / len(episodes)


@pytest.mark.parametrize(
    "successes, best",
    [
        ({0: 0.600, 2: 0.675, 4: 0.683, 6: 0.667, 8: 0.650}, 4),
        ({0: 0.600, 2: 0.683, 4: 0.683, 6: 0.667, 8: 0.650}, 2),  # a tie: the earlier step
        ({0: 0.600, 2: 0.610, 4: 0.620, 6: 0.630, 8: 0.700}, None),  # the final policy: played anyway
        ({0: 0.700, 2: 0.610, 4: 0.620, 6: 0.630, 8: 0.650}, None),  # the imitation adapter: played anyway
        ({0: 0.600, 8: 0.650}, None),  # no checkpoint between the ends
    ],
)
def test_the_checkpoint_played_on_the_held_out_suite_is_the_curve_s_best_between_its_ends(tmp_path, successes, best):
    from lib.report.evidence_logs import CheckpointEvalWriter

    curve = tmp_path / "checkpoint_evals.csv"
    writer = CheckpointEvalWriter(curve)
    for step, success in successes.items():
        writer.append(step=step, episodes=120, success_rate=success)
    assert pipeline.best_checkpoint(curve, 8) == best
    assert pipeline.best_checkpoint(tmp_path / "none.csv", 8) is None, "no curve, no choice"


def test_a_shard_s_process_ends_when_the_process_that_started_it_is_killed(tmp_path):
    """A worker watching its parent (`exit_with_parent`) ends once that parent is killed, instead of
    playing on beside a run started again; while the parent lives it goes on."""
    import os
    import signal
    import subprocess
    import sys
    import time

    worker = (
        "import os, sys, time; from lib.training.imitation import exit_with_parent; "
        "exit_with_parent(int(sys.argv[1]), every_s=0.05); print('watching', flush=True); time.sleep(120)"
    )
    parent = (
        "import os, subprocess, sys, time; "
        f"w = subprocess.Popen([sys.executable, '-c', {worker!r}, str(os.getpid())], "
        "stdout=subprocess.PIPE, text=True); "
        "assert w.stdout.readline().strip() == 'watching'; print(w.pid, flush=True); time.sleep(120)"
    )
    started = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True, cwd=pipeline.ROOT)
    pid = int(started.stdout.readline())

    def running() -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        return state != "Z"  # reparented, a worker that ended may wait as a zombie for its reaper

    time.sleep(0.5)
    assert running(), "the worker lives while its parent does"
    os.kill(started.pid, signal.SIGKILL)
    started.wait()
    for _ in range(600):  # a bounded wait for the worker's own exit, not a timing
        if not running():
            break
        time.sleep(0.05)
    assert not running(), "the worker outlived its killed parent"


def test_a_shard_whose_parent_is_gone_before_it_watches_ends_at_once():
    """The pid a worker is handed is its parent's as the parent saw it: a worker that starts watching
    after that parent is gone (its parent is then another process) ends rather than wait for a pid
    it will never see again."""
    import subprocess
    import sys

    worker = (
        "import time; from lib.training.imitation import exit_with_parent; "
        "exit_with_parent(-1, every_s=0.05); time.sleep(120)"
    )
    done = subprocess.run([sys.executable, "-c", worker], cwd=pipeline.ROOT, timeout=100)
    assert done.returncode == 1
