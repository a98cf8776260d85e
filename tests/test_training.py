"""GRPO training: configuration, tasks, rewards, the rollout function, and a real smoke run."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from cernenv import CERNCollisionEnvironment
from cernenv.rewards import COMPONENT_NAMES
from cernenv.scenarios import list_scenarios
from lib.agents.prompting import LLMAgentConfig, build_chat
from lib.episodes.chat import ChatLayout
from lib.episodes.records import load_episodes_jsonl
from lib.files import DiskFullError, FolderLockedError
from lib.measure.evaluation import HELDOUT_SEED_START, heldout_suite
from lib.training import TrainConfig
from lib.training.backends import resolve_backend, unsloth_available
from lib.training.grpo import (
    REWARD_FUNCS,
    CampaignRollout,
    checkpoint_suite,
    evaluation_suite,
    slot_turn,
    training_dataset,
    training_tasks,
)
from lib.training.resume import drop_rows_after
from lib.training.run import train
from lib.training.tokenizer import corpus_specs


def smoke_config(tmp_path, model_dir, **overrides):
    values = dict(
        model_name=model_dir,
        backend="trl",
        lora_r=0,
        warm_start_episodes=0,  # TrainConfig's 600-campaign warm start would take half an hour here
        max_steps=2,
        num_generations=2,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_turns=3,
        max_new_tokens=16,
        eval_episodes=3,
        checkpoint_eval_episodes=4,
        eval_every_steps=1,
        save_steps=1,
        learning_rate=1e-3,
        evidence_dir=str(tmp_path / "evidence"),
        output_dir=str(tmp_path / "out"),
    )
    values.update(overrides)
    return TrainConfig(**values)


def test_config_rejects_bad_values_with_every_reason():
    with pytest.raises(ValueError) as error:
        TrainConfig(
            backend="jax",
            num_generations=4,
            per_device_train_batch_size=6,
            gradient_accumulation_steps=1,
            temperature=0.0,
            scale_rewards="std",
            scenarios=("atlantis",),
            policy_context="window",
            turn_samples=0,
        )
    message = str(error.value)
    for fragment in (
        "policy_context must be one of",
        "turn_samples must be at least 1",
        "backend must be one of",
        "multiple of",
        "temperature must be a finite number in (0, inf)",
        "unknown scenarios",
        "scale_rewards must be one of",
    ):
        assert fragment in message
    with pytest.raises(ValueError, match="a group of one has no baseline"):
        TrainConfig(num_generations=1)
    with pytest.raises(ValueError, match="KL reference would be the base weights without the adapter"):
        TrainConfig(warm_start_episodes=200, beta=0.04, lora_r=16)
    TrainConfig(warm_start_episodes=200, beta=0.04, lora_r=0)  # the reference: the cached warm start
    TrainConfig(warm_start_episodes=200)  # without a KL penalty, and a KL penalty without a warm start
    TrainConfig(beta=0.04, warm_start_episodes=0)
    with pytest.raises(ValueError, match="unknown TrainConfig fields"):
        TrainConfig.from_dict({"max_step": 3})


def test_config_round_trips(tmp_path):
    config = TrainConfig(max_steps=7, scenarios=("higgs_diphoton_125",), lora_r=0)
    assert TrainConfig.load(config.save(tmp_path / "c.json")) == config


def test_training_tasks_avoid_the_heldout_suite_and_follow_the_curriculum():
    config = TrainConfig(curated_fraction=0.25)
    tasks = training_tasks(config, 40)
    heldout = {spec.seed for spec in heldout_suite()}
    assert not heldout & {t["seed"] for t in tasks} and len({t["seed"] for t in tasks}) == 40
    curated = [i for i, t in enumerate(tasks) if t["scenario"]]
    assert len(curated) == 10 and max(curated) - min(curated) > 25, "curated tasks spread through the run"
    order = [config.difficulties.index(t["difficulty"]) for t in tasks if t["difficulty"]]
    assert order == sorted(order) and set(order) == {0, 1, 2}, "easy → medium → hard"
    shuffled = training_tasks(TrainConfig(curated_fraction=0.25, curriculum=False), 40)
    assert Counter(t["difficulty"] for t in shuffled) == Counter(t["difficulty"] for t in tasks)
    assert [t["difficulty"] for t in shuffled] != [t["difficulty"] for t in tasks]


def test_training_and_warm_start_never_use_an_evaluation_seed():
    """Evaluation seeds draw procedural particles from mass bands training never sees: a training
    task or SFT episode there would leak them."""
    near = TrainConfig(train_seed_start=HELDOUT_SEED_START - 3)
    assert max(t["seed"] for t in training_tasks(near, 3)) == HELDOUT_SEED_START - 1
    with pytest.raises(ValueError, match=f"below {HELDOUT_SEED_START}"):
        training_tasks(near, 4)
    with pytest.raises(ValueError, match=rf"train_seed_start must be in \[0, {HELDOUT_SEED_START}\)"):
        TrainConfig(train_seed_start=HELDOUT_SEED_START + 10_000)  # in no suite: refused with the config
    with pytest.raises(ValueError, match=f"below {HELDOUT_SEED_START}"):
        corpus_specs(1, first_seed=HELDOUT_SEED_START)  # the warm start's campaigns: refused before any is played


def test_dataset_has_one_row_per_group_and_checkpoint_subset_is_spread():
    shape = dict(max_steps=5, num_generations=4, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    dataset = training_dataset(TrainConfig(policy_context="conversation", **shape))
    assert len(dataset) == 10 and json.loads(dataset[0]["prompt"])["seed"] == TrainConfig().train_seed_start
    rows = [json.loads(row["prompt"]) for row in training_dataset(TrainConfig(turn_samples=3, **shape))]
    assert len(rows) == 30, "in the turn context, a row per group and decision slot"
    assert [r["turn_slot"] for r in rows[:6]] == [0, 1, 2, 0, 1, 2]
    assert [r["seed"] for r in rows[:6]] == [rows[0]["seed"]] * 3 + [rows[3]["seed"]] * 3
    subset = checkpoint_suite(TrainConfig(checkpoint_eval_episodes=21))
    assert len(subset) == 21 and {s.difficulty for s in subset if s.difficulty} == {"easy", "medium", "hard"}
    assert {s.scenario for s in subset if s.scenario} == set(list_scenarios()), "every curated scenario once"
    assert subset == checkpoint_suite(TrainConfig(checkpoint_eval_episodes=21)), "fixed"
    assert len(checkpoint_suite(TrainConfig(checkpoint_eval_episodes=4))) == 4


def test_one_reward_function_per_component_named_after_it():
    assert [f.__name__ for f in REWARD_FUNCS] == list(COMPONENT_NAMES)
    components = [{name: float(i) for i, name in enumerate(COMPONENT_NAMES)}]
    assert [f([""], reward_components=components)[0] for f in REWARD_FUNCS] == list(range(len(COMPONENT_NAMES)))


def test_backend_auto_is_trl_without_a_gpu():
    ok, why = unsloth_available()
    if ok:
        pytest.skip("a CUDA GPU with unsloth is present")
    assert why
    assert resolve_backend(TrainConfig(backend="auto")) == "trl"
    with pytest.raises(RuntimeError, match="backend='trl'"):
        resolve_backend(TrainConfig(backend="unsloth"))


def test_rollout_func_plays_each_group_on_one_task(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from lib.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    class FakeTrainer:  # what CampaignRollout reads from GRPOTrainer
        use_vllm = False

        class accelerator:
            unwrap_model = staticmethod(lambda m: m)

    FakeTrainer.model = model
    config = TrainConfig(
        max_turns=2,
        max_new_tokens=8,
        num_generations=2,
        per_device_train_batch_size=4,
        policy_context="conversation",
        constrained_replies=False,  # free replies: every generated token is trained (mask[0] == 1)
    )
    rollout = CampaignRollout(config, tokenizer)
    prompts = [json.dumps({"seed": 7, "scenario": None, "difficulty": "easy"})] * 2 + [
        json.dumps({"seed": 8, "scenario": "higgs_4l_125", "difficulty": None})
    ] * 2
    out = rollout(prompts, FakeTrainer())
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "env_mask", "reward_components"}
    assert out["prompt_ids"][0] == out["prompt_ids"][1] != out["prompt_ids"][2] == out["prompt_ids"][3]
    for ids, mask, lps in zip(out["completion_ids"], out["env_mask"], out["logprobs"]):
        assert len(ids) == len(mask) == len(lps) and mask[0] == 1 and 0 in mask
    records = [e.record for e in rollout.last_episodes]
    assert [r.seed for r in records] == [7, 7, 8, 8] and records[2].scenario == "higgs_4l_125"
    assert records[0].truth == records[1].truth, "a group plays one hidden particle"
    for record, components in zip(records, out["reward_components"]):
        assert sum(components.values()) == pytest.approx(record.total_reward)
    timing = rollout.timings[-1]
    assert timing["generation_s"] > 0 and timing["environment_s"] > 0 and timing["generated_tokens"] > 0


def test_in_the_turn_context_each_sample_is_one_decision_of_its_group_s_episodes(tiny_model_dir):
    """Rows (task, decision slot), each repeated num_generations times: sample i of a slot's
    group is that slot's decision of episode i of the task, each episode played once for all its
    slots; every sample carries its episode's return."""
    from transformers import AutoModelForCausalLM

    from lib.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)

    class FakeTrainer:
        use_vllm = False
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

        class accelerator:
            unwrap_model = staticmethod(lambda m: m)

    # free replies: every token of a decision is trained (held to the grammar, the forced ones are not)
    config = TrainConfig(max_turns=3, max_new_tokens=8, num_generations=2, turn_samples=4, constrained_replies=False)
    task = {"seed": 7, "scenario": None, "difficulty": "easy"}
    prompts = [json.dumps({**task, "turn_slot": slot}) for slot in range(4) for _ in range(2)]
    rollout = CampaignRollout(config, tokenizer)
    out = rollout(prompts, FakeTrainer())
    episodes = rollout.last_episodes
    assert len(episodes) == 2 and [len(e.turns) for e in episodes] == [3, 3]
    for i in range(8):
        slot, episode = i // 2, episodes[i % 2]
        if slot < 3:
            turn = episode.turns[slot]
            assert out["prompt_ids"][i] == turn.prompt_ids and out["completion_ids"][i] == turn.completion_ids
            assert out["logprobs"][i] == turn.logprobs and set(out["env_mask"][i]) == {1}
        else:
            assert out["env_mask"][i] == [0], "a slot past the episode's last decision trains nothing"
        assert sum(out["reward_components"][i].values()) == pytest.approx(episode.record.total_reward)


def test_a_decision_slot_covers_its_stretch_of_a_long_episode():
    rng = np.random.default_rng(0)
    assert [slot_turn(3, slot, 5, rng) for slot in range(5)] == [0, 1, 2, None, None]
    drawn = {slot: {slot_turn(10, slot, 4, rng) for _ in range(200)} for slot in range(4)}
    assert drawn == {0: {0, 1}, 1: {2, 3, 4}, 2: {5, 6}, 3: {7, 8, 9}}, "equal stretches, every decision reachable"


@pytest.mark.slow
def test_smoke_training_run_writes_the_evidence_and_resumes(tmp_path, tiny_model_dir, caplog, capsys, monkeypatch):
    # one checkpoint episode, the suite's first: the pre/post evaluations (3 episodes) cover it;
    # the metrics also go to TensorBoard, and the progress to the log
    config = smoke_config(tmp_path, tiny_model_dir, checkpoint_eval_episodes=1, report_to=["tensorboard"])
    with caplog.at_level(logging.INFO, logger="lib.progress"):
        result = train(config)
    progress = [r.getMessage() for r in caplog.records if r.name == "lib.progress"]
    assert any(line.startswith("GRPO: 2/2 steps (100%) [") for line in progress), progress
    assert any(line.startswith("held-out evaluation (pre): 3/3 episodes (100%)") for line in progress), progress
    metrics = [line for line in progress if line.startswith("GRPO step ")]
    assert [line.split(":")[0] for line in metrics] == ["GRPO step 1/2", "GRPO step 2/2"], progress
    assert all("reward " in line and "loss " in line and "{" not in line for line in metrics), metrics
    assert "'loss':" not in capsys.readouterr().out, "no log printed as a dict (transformers' PrinterCallback)"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = {p.parent for p in (Path(config.output_dir) / "runs").rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("train/reward")] == [1, 2], events.Tags()["scalars"]
    evidence = Path(config.evidence_dir)
    for name in (
        "training_log.csv",
        "reward_components.csv",
        "checkpoint_evals.csv",
        "pre_eval.jsonl.gz",
        "post_eval.jsonl.gz",
        "before_after_metrics.json",
        "sample_trajectories.md",
        "training_curve.png",
    ):
        assert (evidence / name).exists(), name
    log = (evidence / "training_log.csv").read_text().splitlines()
    assert log[0].split(",")[:3] == ["step", "epoch", "loss"] and len(log) == 1 + config.max_steps
    checkpoints = (evidence / "checkpoint_evals.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in checkpoints[1:]] == ["0", "1", "2"]
    assert all(row.split(",")[2] == str(config.checkpoint_eval_episodes) for row in checkpoints[1:])
    pre, post = (
        load_episodes_jsonl(str(evidence / "pre_eval.jsonl.gz")),
        load_episodes_jsonl(str(evidence / "post_eval.jsonl.gz")),
    )
    assert len(pre) == len(post) == 3 and [e["seed"] for e in pre] == [e["seed"] for e in post]
    first, last = (row.split(",") for row in (checkpoints[1], checkpoints[-1]))
    assert float(first[3]) == pytest.approx(pre[0]["cumulative_reward"]), "step 0 is the policy before training"
    assert float(last[3]) == pytest.approx(post[0]["cumulative_reward"]), "the last row is the trained policy"
    assert result.before_after["n"]["pairs"] == 3
    assert (Path(config.output_dir) / "final" / "config.json").exists()
    assert TrainConfig.load(Path(config.output_dir) / "train_config.json") == config
    # The runs below are checked by their logs and the archive: their closing `render_all` (every
    # figure and summary again, ~2 s a run; it logs a failure and never raises) is left out. The
    # callback still draws each step's figures (a failure there stops the run).
    import lib.training.run

    monkeypatch.setattr(lib.training.run, "render_all", lambda paths: {})
    # resumed from the last checkpoint (a run killed after its last row): nothing is written twice
    train(smoke_config(tmp_path, tiny_model_dir, resume_from_checkpoint="latest", checkpoint_eval_episodes=1))
    rows = (evidence / "checkpoint_evals.csv").read_text().splitlines()[1:]
    assert [row.split(",")[0] for row in rows] == ["0", "1", "2"], rows
    # resume: one more step from the last checkpoint, logs continue without duplicates
    resumed = smoke_config(
        tmp_path, tiny_model_dir, max_steps=3, resume_from_checkpoint="latest", checkpoint_eval_episodes=1
    )
    log_path = evidence / "training_log.csv"
    header, *rows = log_path.read_text().splitlines()
    wall = header.split(",").index("wall_time_s")
    row = rows[1].split(",")
    row[wall] = "1000.0"  # as if the run before had spent 1,000 s to its step 2
    log_path.write_text("\n".join([header, rows[0], ",".join(row)]) + "\n")
    result = train(resumed)
    logged = [row.split(",") for row in log_path.read_text().splitlines()[1:]]
    assert [row[0] for row in logged] == ["1", "2", "3"]
    assert float(logged[2][wall]) > 1000.0, "the resumed run's clock goes on from the steps logged before"
    assert result.seconds["grpo"] > 1000.0
    # a fresh run moves the previous run's evidence aside instead of mixing or deleting it
    train(smoke_config(tmp_path, tiny_model_dir, max_steps=1, eval_every_steps=0))
    archived = list((Path(config.output_dir) / "previous_evidence").glob("*/training_log.csv"))
    assert len(archived) == 1 and len((evidence / "training_log.csv").read_text().splitlines()) == 2


def test_an_evaluation_handed_to_the_run_must_play_its_evaluation_suite(tmp_path):
    """`train(config, pre_eval=...)` takes the warm start's evaluation made before, and refuses one
    whose campaigns are not the evaluation suite's, in its order, before anything is loaded or written."""
    config = smoke_config(tmp_path, "unused", eval_episodes=2)
    seeds = [spec.seed for spec in evaluation_suite(config)]
    with pytest.raises(ValueError, match="not the 2 seeds of the evaluation suite"):
        train(config, pre_eval=[{"seed": seed} for seed in reversed(seeds)])
    with pytest.raises(ValueError, match="pre_eval plays 1 campaigns"):
        train(config, pre_eval=[{"seed": seeds[0]}])
    assert not Path(config.evidence_dir).exists() and not Path(config.output_dir).exists()


def _holder(folder: Path) -> subprocess.Popen:
    code = (
        "import time; from lib.files import FolderLock\n"
        f"FolderLock({str(folder)!r}).acquire(); print('held', flush=True); time.sleep(120)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_run_on_a_folder_a_live_run_holds_is_refused_before_any_work(tmp_path, monkeypatch):
    """Two runs on one evidence folder used to both exit 0 with their logs interleaved and the
    second's archiving moving the first's live files away: now the second stops at once."""
    import lib.training.run as run

    def never(*args, **kwargs):
        raise AssertionError("the refused run loaded a policy")

    monkeypatch.setattr(run, "load_policy", never)
    config = smoke_config(tmp_path, "unused")
    evidence = Path(config.evidence_dir)
    evidence.mkdir(parents=True)
    (evidence / "training_log.csv").write_text("step,loss\n1,0.5\n")  # the live run's log
    child = _holder(evidence)
    try:
        with pytest.raises(FolderLockedError, match=f"evidence folder .* is in use by a live run: pid {child.pid}"):
            train(config)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert (evidence / "training_log.csv").read_text() == "step,loss\n1,0.5\n", "its files stay where they are"
    assert not (Path(config.output_dir) / "previous_evidence").exists()


def test_an_output_folder_that_cannot_be_written_stops_the_run_before_any_work(tmp_path, monkeypatch):
    import lib.training.run as run

    monkeypatch.setattr(run, "load_policy", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        train(smoke_config(tmp_path, "unused", evidence_dir=str(tmp_path / "file" / "evidence")))
    with pytest.raises(ModuleNotFoundError, match="pip install tensorboard"):
        monkeypatch.setattr(run.importlib.util, "find_spec", lambda name: None)
        train(smoke_config(tmp_path, "unused", report_to=["tensorboard"]))


def test_a_full_disk_during_a_checkpoint_is_named_as_such(tmp_path, monkeypatch):
    """torch reports a checkpoint that did not fit as "enforce fail ... unexpected pos": the run
    says the disk is full, and where."""
    import lib.training.run as run

    def checkpoint_on_a_full_disk(config, state=None, pre_eval=None):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3200 vs 3096")

    monkeypatch.setattr(run, "_train", checkpoint_on_a_full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))
    with pytest.raises(DiskFullError, match=r"the disk is full: writing .* failed \(0.0 MB free"):
        train(smoke_config(tmp_path, "unused"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**6, 10**9 - 10**6))
    with pytest.raises(RuntimeError, match="unexpected pos") as other:
        train(smoke_config(tmp_path, "unused"))
    assert not isinstance(other.value, DiskFullError), "with space left, the error is what it was"


def test_a_resumed_run_takes_its_warm_start_as_the_kl_reference(tmp_path, tiny_model_dir):
    """TRL loads the KL reference by the model's name: on resume it must name the warm start the
    run saved, not the untrained model; without that folder the resume is refused, saying why."""
    from transformers import AutoModelForCausalLM

    from lib.training.backends import load_policy
    from lib.training.run import reload_warm_start_for_reference

    config = TrainConfig(model_name=tiny_model_dir, backend="trl", warm_start_episodes=2, beta=0.04)
    policy = load_policy(config, "trl")
    with pytest.raises(FileNotFoundError, match="holds no warm start"):
        reload_warm_start_for_reference(policy, config, tmp_path)
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "warm_start")
    reload_warm_start_for_reference(policy, config, tmp_path)
    assert Path(policy.model.name_or_path) == tmp_path / "warm_start"
    untouched = load_policy(TrainConfig(model_name=tiny_model_dir, warm_start_episodes=2, beta=0.0), "trl")
    reload_warm_start_for_reference(untouched, TrainConfig(model_name=tiny_model_dir, beta=0.0), tmp_path)
    assert Path(untouched.model.name_or_path) == Path(tiny_model_dir), "no KL penalty: nothing to reload"


def test_drop_rows_after(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("step,loss\n1,0.5\n2,0.4\n3,0.3\n")
    drop_rows_after(path, 2)
    assert path.read_text() == "step,loss\n1,0.5\n2,0.4\n"


def test_a_resumed_run_reads_the_seconds_its_steps_took_before(tmp_path):
    """The wall time of the last step logged at or before the checkpoint a run resumes from; none
    logged (or no log), 0; a torn last line is not read."""
    from lib.report.evidence_logs import TrainingLogWriter
    from lib.training.resume import logged_seconds

    path = tmp_path / "training_log.csv"
    writer = TrainingLogWriter(path)
    for step, wall in ((1, 40.5), (2, 81.0), (3, 122.25)):
        writer.append({"step": step, "loss": 0.5, "wall_time_s": wall})
    with path.open("a") as log:
        log.write("4,,0.2,,,,,,16")  # a killed writer's torn line
    assert [logged_seconds(path, step) for step in (0, 1, 2, 3, 4, 9)] == [0.0, 40.5, 81.0, 122.25, 122.25, 122.25]
    assert logged_seconds(tmp_path / "none.csv", 3) == 0.0


def test_grpo_args_carry_the_sampling_and_advantage_settings(tmp_path):
    from lib.training.run import grpo_args

    config = TrainConfig(temperature=0.6, scale_rewards="none", learning_rate=2e-4, beta=0.01, output_dir=str(tmp_path))
    args = grpo_args(config)
    # TRL rescales the logits by `temperature` when it scores completions: it must be the sampling one
    assert (args.temperature, args.learning_rate, args.beta) == (0.6, 2e-4, 0.01)
    assert args.scale_rewards in ("none", False)
    assert args.gradient_checkpointing is torch.cuda.is_available()  # the stand-in: none on a CPU
    assert grpo_args(TrainConfig(lora_r=16, beta=0.0, output_dir=str(tmp_path))).gradient_checkpointing  # LoRA
    assert grpo_args(TrainConfig(output_dir=str(tmp_path))).scale_rewards == "batch"


@pytest.mark.slow
@pytest.mark.usefixtures("no_evidence_figures")  # tests/conftest.py
def test_lora_run_saves_the_adapter_merges_it_and_plans_the_hub_push(tmp_path, tiny_model_dir):
    """A LoRA run leaves the adapter in final/ and, with save_merged, the merged weights; the
    dry-run push checks them and sends nothing; the merged model plays exactly as the
    adapter on its base does (what a user of the published weights gets)."""
    from lib.agents.prompting import Sampling
    from lib.episodes.generation import hf_generate_fn
    from lib.episodes.llm_rollouts import play_episodes
    from lib.training.publish import load_trained_policy, model_kind, push_to_hub

    config = smoke_config(
        tmp_path,
        tiny_model_dir,
        lora_r=4,
        max_steps=1,
        eval_every_steps=0,
        save_merged=True,
        hub_repo_id="someone/cernenv-policy",
        hub_dry_run=True,
        learning_rate=5e-2,
    )
    result = train(config)
    final, merged = Path(result.final_model_dir), Path(result.merged_model_dir)
    assert model_kind(final) == "adapter" and model_kind(merged) == "model"
    from lib.files import _umask

    readable = {p.name: oct(p.stat().st_mode & 0o777) for p in [*final.iterdir(), *merged.iterdir()] if p.is_file()}
    assert set(readable.values()) == {oct(0o666 & ~_umask())}, f"make evaluate's agent user reads them: {readable}"
    assert result.published["dry_run"] and result.published["kind"] == "model"
    assert "model.safetensors" in result.published["files"] and result.published["url"] is None
    card = (merged / "README.md").read_text()
    assert "README.md" in result.published["files"] and "[None]" not in card, "the card names the base"
    assert f"trained from {Path(tiny_model_dir).name}, which is not on the Hub" in card
    with pytest.raises(ValueError, match="local folder"):  # an adapter on a local base helps nobody else
        push_to_hub(final, "someone/cernenv-policy", dry_run=True)
    with pytest.raises(ValueError, match="user/name"):
        push_to_hub(merged, "not a repo id", dry_run=True)
    with pytest.raises(FileNotFoundError, match="no saved policy"):
        model_kind(tmp_path)
    greedy = Sampling(temperature=0.0, max_new_tokens=12)
    played = {}
    for name, folder in (("adapter", final), ("merged", merged)):
        model, tokenizer = load_trained_policy(folder)
        played[name] = play_episodes(
            hf_generate_fn(model, tokenizer), tokenizer, [(3, None, "easy")], sampling=greedy, max_turns=2
        )[0].completion_ids
    assert played["adapter"] == played["merged"]


def _rows_by_step(path: Path, drop=("wall_time_s",)) -> dict:
    import csv as _csv

    with open(path) as f:
        return {row["step"]: {k: v for k, v in row.items() if k not in drop} for row in _csv.DictReader(f)}


@pytest.mark.slow
@pytest.mark.usefixtures("no_evidence_figures")  # tests/conftest.py
def test_a_resumed_run_repeats_the_run_that_was_not_interrupted(tmp_path, tiny_model_dir, monkeypatch):
    """A run killed while saving its step-3 checkpoint, resumed with 'latest': it must skip the
    partial checkpoint, restart from step 2's, and sample and log step 3 exactly as the
    uninterrupted run did (the rollout seed follows the trainer's step, not a call counter)."""
    from lib.training import grpo

    sampled = []  # the completions of every training rollout, in order

    def recording_play_episodes(*args, **kwargs):
        episodes = play_episodes(*args, **kwargs)
        sampled.append([episode.completion_ids for episode in episodes])
        return episodes

    play_episodes = grpo.play_episodes
    monkeypatch.setattr(grpo, "play_episodes", recording_play_episodes)
    config = smoke_config(tmp_path, tiny_model_dir, max_steps=3, eval_every_steps=0, save_steps=1, temperature=1.0)
    train(config)
    assert len(sampled) == 3
    step_3 = sampled[-1]
    evidence, out = Path(config.evidence_dir), Path(config.output_dir)
    whole_log = _rows_by_step(evidence / "training_log.csv")
    whole_rollouts = _rows_by_step(evidence / "reward_components.csv")
    assert set(whole_log) == {"1", "2", "3"}
    # the kill: checkpoint-3 left without its optimizer state, the logs torn in step 3's row
    (out / "checkpoint-3" / "optimizer.pt").unlink()
    for name in ("training_log.csv", "reward_components.csv"):
        text = (evidence / name).read_text()
        (evidence / name).write_text(text[: text.rstrip("\n").rfind("\n") + 1] + "3,0.1")
    from lib.training.resume import latest_complete_checkpoint

    assert latest_complete_checkpoint(out) == out / "checkpoint-2"
    train(
        smoke_config(
            tmp_path,
            tiny_model_dir,
            max_steps=3,
            eval_every_steps=0,
            save_steps=1,
            temperature=1.0,
            resume_from_checkpoint="latest",
        )
    )
    assert len(sampled) == 4 and sampled[-1] == step_3, "the resumed step 3 sampled other episodes"
    assert _rows_by_step(evidence / "training_log.csv") == whole_log
    assert _rows_by_step(evidence / "reward_components.csv") == whole_rollouts


def test_drop_rows_after_cuts_a_torn_last_line(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("step,loss\n1,0.5\n2,0.4\n2,0.3")  # the writer died in the middle of a row
    drop_rows_after(path, 2)
    assert path.read_text() == "step,loss\n1,0.5\n2,0.4\n"
    with open(path, "a") as f:  # later writers append whole rows after it
        f.write("3,0.2\n")
    assert path.read_text().splitlines() == ["step,loss", "1,0.5", "2,0.4", "3,0.2"]


def test_a_saved_policy_folder_gives_back_the_tokenizer_it_was_trained_with(tiny_model_dir, tmp_path):
    """A stand-in saved as a Hugging Face model (config.json says qwen2) is loaded by
    `load_tokenizer` (training from a folder, the inference demo) with its own tokenizer.json
    pipeline: the same tokens for a whole first prompt as the project tokenizer. transformers'
    AutoTokenizer rebuilds it as a Qwen2 tokenizer that splits the text differently."""
    import json
    import shutil

    from cernenv import CERNCollisionEnvironment
    from lib.episodes.chat import first_messages
    from lib.training.publish import load_trained_policy
    from lib.training.tokenizer import build_tokenizer, load_tokenizer

    project = build_tokenizer()
    obs = CERNCollisionEnvironment().reset(seed=901000, scenario="higgs_diphoton_125")
    prompt = project.apply_chat_template(first_messages(obs), add_generation_prompt=True, tokenize=False)
    expected = project(prompt, add_special_tokens=False)["input_ids"]
    for loaded in (load_tokenizer(tiny_model_dir), load_trained_policy(tiny_model_dir)[1]):
        assert loaded(prompt, add_special_tokens=False)["input_ids"] == expected
        assert loaded.apply_chat_template(first_messages(obs), add_generation_prompt=True, tokenize=False) == prompt
    # a real model's own tokenizer class is left to AutoTokenizer
    real = tmp_path / "real"
    shutil.copytree(tiny_model_dir, real)
    config = json.loads((real / "tokenizer_config.json").read_text())
    (real / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "Qwen2Tokenizer"}))
    assert type(load_tokenizer(str(real))).__name__ == "Qwen2Tokenizer"


def test_the_model_card_names_a_hub_base_model(tmp_path):
    """TRL's draft card said "fine-tuned version of [None]" for a base loaded from a folder."""
    from lib.training.publish import model_card, push_to_hub

    adapter = tmp_path / "final"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "unsloth/Qwen2.5-1.5B-Instruct"}')
    plan = push_to_hub(adapter, "someone/cernenv-policy", dry_run=True)
    card = (adapter / "README.md").read_text()
    assert "README.md" in plan["files"] and "base_model: unsloth/Qwen2.5-1.5B-Instruct" in card
    assert "fine-tuned version of [unsloth/Qwen2.5-1.5B-Instruct](https://huggingface.co/unsloth" in card
    assert "library_name: peft" in card and "[None]" not in card
    assert "stand-in" in model_card(adapter, "someone/x", base_model="cernenv-tiny")


def _scripted_group_step(tiny_model_dir, tmp_path, replies, context, credit="episode", trainer_class=None):
    """One GRPO step of the stand-in on one group of `len(replies)` one-turn episodes whose
    replies are scripted (episode i writes `replies[i]`), scored by the model as if it had
    sampled them, each decision credited as `credit` says, by `trainer_class` (default: the run's,
    `grpo_trainer_class`). Returns the parameters before, after, and the step's logged metrics."""
    from transformers import AutoModelForCausalLM

    from lib.training.run import grpo_args
    from lib.training.tokenizer import load_tokenizer
    from lib.training.trainer_class import grpo_trainer_class

    tokenizer = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    config = TrainConfig(
        model_name=tiny_model_dir,
        warm_start_episodes=0,
        max_steps=1,
        num_generations=len(replies),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=len(replies),
        max_turns=1,
        policy_context=context,
        turn_samples=3,
        credit=credit,
        output_dir=str(tmp_path / "out"),
        evidence_dir=str(tmp_path / "evidence"),
    )

    def scripted(trainer):
        calls = iter(replies)

        def generate(contexts, sampling, shown=None):
            out = []
            for context in contexts:
                ids = tokenizer(next(calls), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                with torch.no_grad():
                    logits = model(torch.tensor([context + ids])).logits[0, len(context) - 1 : -1]
                logprobs = torch.log_softmax(logits / sampling.temperature, -1).gather(1, torch.tensor(ids)[:, None])
                out.append((ids, logprobs[:, 0].tolist()))
            return out

        return generate

    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = (trainer_class or grpo_trainer_class(config))(
        model=model,
        reward_funcs=REWARD_FUNCS,
        args=grpo_args(config, save_strategy="no", logging_steps=1),
        train_dataset=training_dataset(config),
        processing_class=tokenizer,
        rollout_func=CampaignRollout(config, tokenizer, generate_fn_factory=scripted),
    )
    trainer.train()
    after = dict(trainer.model.named_parameters())
    (logged,) = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    return before, after, logged


VALID_FIRST_ACTION = '{"action_type":"configure_beam","parameters":{"beam_energy_tev":13.6,"pileup":"nominal"}}'


@pytest.mark.slow  # two GRPO steps
@pytest.mark.parametrize("context", ["turn", "conversation"])
def test_grpo_moves_the_policy_when_outcomes_differ_and_only_then(tiny_model_dir, tmp_path, context):
    """The gradient path, end to end through TRL: a group whose episodes score differently (a valid
    first action against a refused one) gives a non-zero gradient and moves the parameters; a
    group whose episodes all score alike has no advantage, and nothing moves."""
    before, after, logged = _scripted_group_step(
        tiny_model_dir, tmp_path / "differ", [VALID_FIRST_ACTION, "not json"], context
    )
    assert logged["frac_reward_zero_std"] == 0.0 and logged["reward_std"] > 0
    assert logged["grad_norm"] > 0
    moved = [name for name, p in after.items() if not torch.equal(p.detach(), before[name])]
    assert len(moved) == len(after), f"{len(after) - len(moved)} parameter tensors did not move"

    before, after, logged = _scripted_group_step(tiny_model_dir, tmp_path / "alike", ["not json", "not json"], context)
    assert logged["frac_reward_zero_std"] == 1.0 and logged["grad_norm"] == 0.0
    assert all(torch.equal(p.detach(), before[name]) for name, p in after.items()), "no advantage, no update"


@pytest.mark.slow  # two GRPO steps
def test_the_run_s_trainer_takes_trl_s_step_from_regrouped_trimmed_passes(tiny_model_dir, tmp_path):
    """The run's trainer deals a step's samples into its passes by length and cuts each pass's
    shared padding; the step it takes is TRL's own: the same loss and gradient norm as TRL's
    `GRPOTrainer` from the same start on the same episodes (four replies of different lengths, three
    decision slots each: passes of three samples)."""
    from trl import GRPOTrainer

    replies = [VALID_FIRST_ACTION, "not json", '{"action_type":"configure_beam"}', VALID_FIRST_ACTION + " ok"]
    *_, ours = _scripted_group_step(tiny_model_dir, tmp_path / "ours", replies, "turn")
    *_, trl_s = _scripted_group_step(tiny_model_dir, tmp_path / "trl", replies, "turn", trainer_class=GRPOTrainer)
    assert ours["grad_norm"] > 0
    assert ours["loss"] == pytest.approx(trl_s["loss"], rel=1e-4, abs=1e-6)
    assert ours["grad_norm"] == pytest.approx(trl_s["grad_norm"], rel=1e-4)


@pytest.mark.slow  # two GRPO steps
def test_decision_credit_pushes_a_refused_reply_down_where_grpo_sees_no_difference(tiny_model_dir, tmp_path):
    """A group whose episodes all end alike (two unparsable replies, refused) gives GRPO's
    episode credit nothing to learn; credit for each decision charges each refused reply its own
    penalty, through TRL's loss: the parameters move, and the refused reply becomes less likely."""
    from transformers import AutoModelForCausalLM

    from lib.training.tokenizer import load_tokenizer

    before, after, logged = _scripted_group_step(
        tiny_model_dir, tmp_path / "episode", ["not json", "not json"], "turn", credit="episode"
    )
    assert logged["grad_norm"] == 0.0
    before, after, logged = _scripted_group_step(
        tiny_model_dir, tmp_path / "decision", ["not json", "not json"], "turn", credit="decision"
    )
    assert logged["frac_reward_zero_std"] == 1.0, "the episodes scored alike"
    assert logged["grad_norm"] > 0

    tokenizer = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    env = CERNCollisionEnvironment()
    context = ChatLayout(tokenizer, LLMAgentConfig()).prompt_ids(
        build_chat(env.reset(**training_tasks(TrainConfig(), 1)[0]), LLMAgentConfig())
    )
    reply = tokenizer("not json", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def reply_logprob(parameters):
        with torch.no_grad():
            logits = torch.func.functional_call(model, parameters, (torch.tensor([context + reply]),)).logits
        logprobs = torch.log_softmax(logits[0, len(context) - 1 : -1], -1)
        return float(logprobs.gather(1, torch.tensor(reply)[:, None]).sum())

    assert reply_logprob({k: v.detach() for k, v in after.items()}) < reply_logprob(before)
