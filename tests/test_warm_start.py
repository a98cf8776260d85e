"""The SFT warm start of a Hugging Face policy (`lib.training.warm_start`, `TrainConfig.warm_start_episodes`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lib.evaluation import heldout_suite
from lib.multiturn import play_episodes
from lib.policy_model import SFT_SEED
from lib.prompting import Sampling
from lib.tokenizer import corpus_specs
from lib.training import TrainConfig
from lib.training.backends import load_policy
from lib.training.run import train
from lib.training.warm_start import demonstration_examples, loss_mask, sft_trainer, sft_warm_start


def test_demonstrations_are_laid_out_as_grpo_plays_them(tiny_model_dir):
    """A demonstration replayed through `play_episodes` (a generator that writes the
    demonstrated replies) gives the same tokens, and its action mask is GRPO's env_mask."""
    from lib.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    (example,) = demonstration_examples(tokenizer, 1)
    ids, mask = example["input_ids"], example["completion_mask"]
    replies, start = [], None  # the runs of action tokens, in order
    for i, bit in enumerate(mask + [0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            replies.append(ids[start:i])
            start = None
    assert replies and all(reply[-1] == tokenizer.eos_token_id for reply in replies)

    def scripted(contexts, sampling):  # a GenerateFn that writes the demonstrated replies
        return [(reply, [0.0] * len(reply)) for reply in (replies.pop(0) for _ in contexts)]

    (spec,) = corpus_specs(1, SFT_SEED)
    (played,) = play_episodes(scripted, tokenizer, [spec], sampling=Sampling(max_new_tokens=512))
    assert played.prompt_ids + played.completion_ids == ids
    assert [0] * len(played.prompt_ids) + played.env_mask == mask
    last = played.record.steps[-1]
    assert last.action["action_type"] == "submit_discovery_claim" and last.done and not replies
    assert all(step.parsed_ok and not step.rule_violations for step in played.record.steps)


def test_demonstrations_never_use_an_evaluation_seed():
    suite = {spec.seed for spec in heldout_suite()}
    assert not suite & {spec["seed"] for spec in corpus_specs(200, SFT_SEED)}


def test_the_trainer_s_loss_covers_the_actions_and_nothing_else(tiny_model_dir, tmp_path):
    """What TRL makes of `completion_mask` (its collated labels), read back from the trainer,
    under whichever TRL is installed (1.16 here, 1.15 in the GPU set)."""
    config = TrainConfig(model_name=tiny_model_dir, backend="trl", lora_r=8, warm_start_episodes=2)
    policy = load_policy(config, "trl")
    examples = demonstration_examples(policy.tokenizer, 2)
    trainer = sft_trainer(policy, config, examples, str(tmp_path))
    masks = loss_mask(trainer)
    assert len(masks) == 2
    for mask, example in zip(masks, examples):
        assert mask == [bool(bit) for bit in example["completion_mask"]]


@pytest.mark.slow  # a training run (trl 1.15, the GPU set, needs triton for it)
def test_warm_start_trains_the_lora_adapter_on_the_actions(tiny_model_dir):
    config = TrainConfig(
        model_name=tiny_model_dir,
        backend="trl",
        lora_r=8,
        warm_start_episodes=2,
        warm_start_epochs=3,
        warm_start_learning_rate=5e-3,
    )
    policy = load_policy(config, "trl")
    report = sft_warm_start(policy, config)
    assert policy.peft_config is None, "GRPO must go on training this adapter, not wrap a new one"
    lora_b = [p for name, p in policy.model.named_parameters() if "lora_B" in name]
    assert lora_b and any(p.abs().max() > 0 for p in lora_b), "LoRA B starts at 0: the adapter was not trained"
    base = [p for name, p in policy.model.named_parameters() if "lora_" not in name]
    assert not any(p.requires_grad for p in base), "only the adapter trains"
    assert report["episodes"] == 2 and report["steps"] == 6
    assert report["loss_tokens"] == report["action_tokens"]
    assert 0 < report["action_tokens"] < 0.2 * report["tokens"], "the loss covers the actions, not the observations"
    assert report["last_loss"] < report["first_loss"]


def test_the_stand_in_refuses_a_second_warm_start(tmp_path):
    config = TrainConfig(
        model_name="cernenv-tiny-untrained",
        warm_start_episodes=4,
        evidence_dir=str(tmp_path / "evidence"),
        output_dir=str(tmp_path / "out"),
    )
    with pytest.raises(ValueError, match="warm_start_episodes is for a Hugging Face model"):
        train(config)
    assert not (tmp_path / "out").exists(), "refused before anything was written"


@pytest.mark.slow
def test_a_run_with_a_warm_start_saves_it_and_grpo_trains_the_same_adapter(tmp_path, tiny_model_dir):
    config = TrainConfig(
        model_name=tiny_model_dir,
        backend="trl",
        lora_r=8,
        warm_start_episodes=1,
        warm_start_epochs=3,
        warm_start_learning_rate=5e-3,
        max_steps=1,
        num_generations=2,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_turns=2,
        max_new_tokens=16,
        eval_episodes=2,
        checkpoint_eval_episodes=2,
        eval_every_steps=0,
        save_steps=1,
        evidence_dir=str(tmp_path / "evidence"),
        output_dir=str(tmp_path / "out"),
    )
    result = train(config)
    assert result.warm_start["episodes"] == 1 and result.warm_start["steps"] == 3
    warm = Path(config.output_dir) / "warm_start"
    final = Path(config.output_dir) / "final"
    assert (warm / "adapter_model.safetensors").is_file() and (final / "adapter_model.safetensors").is_file()
    from safetensors.torch import load_file

    warm_weights = load_file(warm / "adapter_model.safetensors")
    final_weights = load_file(final / "adapter_model.safetensors")
    assert set(warm_weights) == set(final_weights), "GRPO trained the warm-started adapter, not a new one"
    assert any(torch.any(w != 0) for name, w in warm_weights.items() if "lora_B" in name)
