"""GRPO over several processes (`make train NPROC=2`, `lib.training.processes`): the same run,
the same evidence, each process playing its share."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ports import free_port

from cernenv import CERNCollisionEnvironment
from lib.agents.baselines import HeuristicAgent
from lib.agents.prompting import action_to_json, build_chat
from lib.episodes.chat import ChatLayout
from lib.seeds import DEMONSTRATION_SEED
from lib.training import TrainConfig
from lib.training.policy_model import build_tiny_model
from lib.training.processes import gather, shard, shard_bounds
from lib.training.run import accumulation_per_process
from lib.training.tokenizer import build_tokenizer, corpus_specs

ROOT = Path(__file__).resolve().parents[1]


def test_shards_are_contiguous_cover_everything_and_differ_by_at_most_one():
    for n_items in range(0, 12):
        for n_shards in range(1, 5):
            bounds = [shard_bounds(n_items, n_shards, i) for i in range(n_shards)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n_items
            assert all(stop == start for (_, stop), (start, _) in zip(bounds, bounds[1:]))  # contiguous, in order
            sizes = [stop - start for start, stop in bounds]
            assert max(sizes) - min(sizes) <= 1
    assert shard_bounds(5, 2, 0) == (0, 3) and shard_bounds(5, 2, 1) == (3, 5)
    with pytest.raises(ValueError):
        shard_bounds(5, 2, 2)


def test_one_process_plays_everything():
    items = list(range(7))
    assert shard(items) == items and gather(shard(items)) == items


def test_accumulation_is_shared_among_the_processes_or_refused():
    config = TrainConfig(gradient_accumulation_steps=16)
    assert accumulation_per_process(config, 1) == 16 and accumulation_per_process(config, 2) == 8
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        accumulation_per_process(config, 3)


@pytest.fixture(scope="module")
def first_action_model_dir(tmp_path_factory):
    """The tiny model taught (for ~10 s) two first actions for the same observations, laid out as
    the default configuration plays them: the heuristic's (valid) and a data collection before
    any beam is configured (refused, a penalty). Sampled at temperature 1.5 it writes either, so
    the returns of a group differ and GRPO steps move the weights, whatever the exact tokens of
    the prompts (a model taught one action writes it every time once it has learnt it, and then
    no step moves anything; at temperature 1, trained with one thread on an Intel Xeon, its groups
    returned alike and the run moved the weights by 0.004)."""
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)
    config = TrainConfig()
    layout = ChatLayout(tokenizer, config.observation_config)
    refused = json.dumps({"action_type": "collect_collisions", "parameters": {"luminosity_fb": 1.0}})
    examples = []
    env = CERNCollisionEnvironment()
    for spec in corpus_specs(4, DEMONSTRATION_SEED):
        obs = env.reset(**spec)
        prompt_ids = layout.prompt_ids(build_chat(obs, config.observation_config))
        valid = action_to_json(HeuristicAgent().act(obs), justification=False)
        for reply in (valid, refused):
            examples.append((prompt_ids, tokenizer(reply + tokenizer.eos_token, add_special_tokens=False)["input_ids"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    torch.manual_seed(0)
    for step in range(160):
        prompt_ids, reply_ids = examples[step % len(examples)]
        input_ids = torch.tensor([prompt_ids + reply_ids])
        labels = input_ids.clone()
        labels[0, : len(prompt_ids)] = -100
        model(input_ids=input_ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    path = tmp_path_factory.mktemp("first-action")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _rows(path: Path) -> list:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_two_processes_write_what_one_process_writes(tmp_path, first_action_model_dir):
    """The same 2-step GRPO run, 4 episodes per step, once in one process (lockstep batches of 2)
    and once in 2 processes through `accelerate launch` (gloo; 2 episodes each): the sampled
    episodes, every evaluation and the rewards are identical; loss and gradient norm agree to
    float rounding (the 2 processes' gradients are summed by an all-reduce, in another order)."""
    flags = [
        "--model_name",
        first_action_model_dir,
        "--backend",
        "trl",
        "--lora_r",
        "0",
        "--warm_start_episodes",
        "0",
        "--max_steps",
        "2",
        "--num_generations",
        "2",
        "--per_device_train_batch_size",
        "1",
        "--gradient_accumulation_steps",
        "4",
        "--max_turns",
        "2",
        "--max_new_tokens",
        "48",
        "--eval_episodes",
        "3",
        "--checkpoint_eval_episodes",
        "4",
        "--eval_every_steps",
        "1",
        "--save_steps",
        "1",
        "--temperature",
        "1.5",
        "--learning_rate",
        "1e-3",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", "TRL_EXPERIMENTAL_SILENCE": "1"}
    one, two = tmp_path / "one", tmp_path / "two"

    def start(launcher, folder, *extra) -> subprocess.Popen:
        """The run in processes of its own (a session: its group is stopped if the test fails), its
        output in files in `folder` (a pipe left unread while the other run is waited for stalls it)."""
        folder.mkdir()
        with open(folder / "stdout.txt", "w") as stdout, open(folder / "stderr.txt", "w") as stderr:
            return subprocess.Popen(
                [
                    *launcher,
                    "-m",
                    "lib.training",
                    *flags,
                    *extra,
                    "--evidence_dir",
                    str(folder / "evidence"),
                    "--output_dir",
                    str(folder / "out"),
                ],
                cwd=ROOT,
                env=env,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )

    def finish(run: subprocess.Popen, folder) -> str:
        assert run.wait(timeout=600) == 0, (folder / "stderr.txt").read_text()[-3000:]
        return (folder / "stdout.txt").read_text()

    accelerate = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_cpu_threads_per_process",
        "1",
        "--main_process_port",
        str(free_port()),
    ]
    # The two runs are independent, so they run side by side: the two processes' run keeps ~1.5 of 2
    # cores busy (its processes wait on each other), and the test took 41-45 s alone with the runs in
    # turn, 26 s side by side.
    runs = [start([sys.executable], one, "--rollout_batch_size", "2"), start(accelerate, two)]
    try:
        finish(runs[0], one)
        launched = finish(runs[1], two)
    finally:
        for run in runs:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
    assert launched.count("everything measured: ") == 1, "one process reports the result"

    for name in ("pre_eval.jsonl.gz", "post_eval.jsonl.gz", "reward_components.csv", "checkpoint_evals.csv"):
        assert (two / "evidence" / name).read_bytes() == (one / "evidence" / name).read_bytes(), name
    rollouts = _rows(two / "evidence" / "reward_components.csv")
    assert [row["n"] for row in rollouts] == ["4", "4"], "each step's row covers both processes' episodes"
    log_one, log_two = _rows(one / "evidence" / "training_log.csv"), _rows(two / "evidence" / "training_log.csv")
    assert [row["step"] for row in log_two] == ["1", "2"], "one process writes the training log"
    for a, b in zip(log_one, log_two):
        for column in ("epoch", "reward", "reward_std", "learning_rate"):
            assert a[column] == b[column], column
        # TRL shuffles each process's share of the step before cutting it into passes, and in the
        # turn context a pass holds 8 decisions padded to its longest: the two runs' passes are cut
        # and padded differently, so their sums are rounded in another order (measured: grad norm
        # 1.78003 against 1.78038, 2e-4 apart; the loss within 1e-4)
        for column, rel in (("loss", 1e-4), ("grad_norm", 1e-3)):
            assert float(b[column]) == pytest.approx(float(a[column]), rel=rel, abs=1e-7), column
    assert any(float(row["grad_norm"]) > 0 for row in log_one), "the run must move the weights to test anything"

    from safetensors.torch import load_file

    weights_one = load_file(one / "out" / "final" / "model.safetensors")
    weights_two = load_file(two / "out" / "final" / "model.safetensors")
    initial = load_file(Path(first_action_model_dir) / "model.safetensors")
    update = torch.cat([(weights_one[k] - initial[k]).flatten() for k in initial])
    apart = torch.cat([(weights_two[k] - weights_one[k]).flatten() for k in initial])
    assert update.norm() > 0.1, "training moved nothing"
    # Adam's first steps move each weight by about lr x sign(gradient): where a gradient is ~0, its
    # rounding decides the sign, so a few weights differ by up to 2 lr; the rest agree to rounding
    # (measured: 0.02% of the weights, difference 0.26% of the update's norm)
    assert apart.norm() < 0.01 * update.norm()
    assert (apart.abs() > 1e-5).float().mean() < 1e-3
    result = json.loads((two / "out" / "train_result.json").read_text())
    assert result["config"]["gradient_accumulation_steps"] == 4, "the config keeps the run's episodes per step"


def test_several_processes_refuse_to_build_a_warm_start_of_every_weight(tmp_path, monkeypatch):
    """Built by the main process alone, its Trainer would wait forever on the others: a run in
    several processes asks for it to be built first, before it writes anything."""
    from lib.training import run

    monkeypatch.setattr(run, "num_processes", lambda: 2)
    monkeypatch.setattr(run, "cached_warm_start_dir", lambda policy, config: tmp_path / "not-built")
    config = TrainConfig(
        model_name="cernenv-tiny", evidence_dir=str(tmp_path / "evidence"), output_dir=str(tmp_path / "out")
    )
    with pytest.raises(RuntimeError, match="python -m lib.training.warm_start"):
        run.train(config)
    for folder in (tmp_path / "out", tmp_path / "evidence"):  # the run's lock, taken first, and nothing else
        assert [p.name for p in folder.rglob("*")] in ([], [".run.lock"]), list(folder.rglob("*"))
