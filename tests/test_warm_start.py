"""The SFT warm start of a policy (`lib.training.warm_start`, `TrainConfig.warm_start_*`): one
implementation for the CPU stand-in (every weight, loss on the conversation, cached) and a real
model (its LoRA adapter, loss on the actions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lib.agents.prompting import LLMAgentConfig, Sampling, parse_reply, round_significant
from lib.episodes.llm_rollouts import play_episodes
from lib.measure.evaluation import heldout_suite
from lib.training import TrainConfig
from lib.training.backends import load_policy
from lib.training.run import train
from lib.training.tokenizer import corpus_specs
from lib.training.warm_start import (
    DEMONSTRATION_SEED,
    cached_warm_start_dir,
    demonstration_examples,
    loss_mask,
    sft_trainer,
    sft_warm_start,
)


@pytest.mark.parametrize("style", ["full", "brief"])
def test_demonstrations_are_laid_out_as_grpo_plays_them(tiny_model_dir, style):
    """A demonstration replayed through `play_episodes` (a generator that writes the
    demonstrated replies) gives the same tokens, and its action mask is GRPO's env_mask, in each
    observation style."""
    from lib.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    config = LLMAgentConfig(style=style, system_prompt=style == "brief")
    (example,) = demonstration_examples(tokenizer, 1, observation_config=config)
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

    (spec,) = corpus_specs(1, DEMONSTRATION_SEED)
    (played,) = play_episodes(
        scripted, tokenizer, [spec], sampling=Sampling(max_new_tokens=512), observation_config=config
    )
    assert played.prompt_ids + played.completion_ids == ids
    assert [0] * len(played.prompt_ids) + played.env_mask == mask
    last = played.record.steps[-1]
    assert last.action["action_type"] == "submit_discovery_claim" and last.done and not replies
    assert all(step.parsed_ok and not step.rule_violations for step in played.record.steps)


@pytest.mark.parametrize("system_prompt", [False, True])
def test_turn_demonstrations_are_the_decisions_grpo_plays(tiny_model_dir, system_prompt):
    """In the turn context a demonstration is one decision: the chat of its observation and the
    reply; replayed through `play_episodes`, each is a played turn's prompt and reply."""
    from lib.agents.prompting import LLMAgentConfig
    from lib.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    config = LLMAgentConfig(system_prompt=system_prompt)
    examples = demonstration_examples(tokenizer, 1, context="turn", observation_config=config)
    replies = []
    for example in examples:
        mask = example["completion_mask"]
        start = mask.index(1)
        assert set(mask[start:]) == {1} and not any(mask[:start]), "the reply alone is in the loss"
        replies.append(example["input_ids"][start:])

    def scripted(contexts, sampling):
        return [(reply, [0.0] * len(reply)) for reply in (replies.pop(0) for _ in contexts)]

    (spec,) = corpus_specs(1, DEMONSTRATION_SEED)
    (played,) = play_episodes(
        scripted, tokenizer, [spec], sampling=Sampling(max_new_tokens=512), context="turn", observation_config=config
    )
    assert [t.prompt_ids + t.completion_ids for t in played.turns] == [e["input_ids"] for e in examples]
    assert played.record.steps[-1].action["action_type"] == "submit_discovery_claim" and not replies
    whole = demonstration_examples(tokenizer, 1, context="turn", observation_config=config, loss="conversation")
    assert all(all(e["completion_mask"]) for e in whole)
    with pytest.raises(ValueError, match="context must be one of"):
        demonstration_examples(tokenizer, 1, context="window")


def test_demonstrations_never_use_an_evaluation_seed():
    suite = {spec.seed for spec in heldout_suite()}
    assert not suite & {spec["seed"] for spec in corpus_specs(200, DEMONSTRATION_SEED)}


def test_the_trainer_s_loss_covers_the_actions_and_nothing_else(tiny_model_dir, tmp_path):
    """What TRL makes of `completion_mask` (its collated labels), read back from the trainer,
    under whichever TRL is installed (1.16 here, 1.15 in the GPU set)."""
    config = TrainConfig(model_name=tiny_model_dir, backend="trl", lora_r=8, beta=0.0, warm_start_episodes=2)
    policy = load_policy(config, "trl")
    examples = demonstration_examples(policy.tokenizer, 2)
    trainer = sft_trainer(policy, config, examples, str(tmp_path))
    masks = loss_mask(trainer)
    assert len(masks) == 2
    for mask, example in zip(masks, examples):
        assert mask == [bool(bit) for bit in example["completion_mask"]]
    whole = demonstration_examples(policy.tokenizer, 2, loss="conversation")
    assert [e["input_ids"] for e in whole] == [e["input_ids"] for e in examples]
    assert all(all(e["completion_mask"]) for e in whole), "the conversation loss covers every token"
    assert all(0 < sum(e["completion_mask"]) < len(e["input_ids"]) for e in examples), (
        "the actions loss leaves out the prompt and the environment's text"
    )
    whole_masks = loss_mask(sft_trainer(policy, config, whole, str(tmp_path / "whole")))
    assert [sum(m) for m in whole_masks] == [len(e["input_ids"]) for e in whole], "and TRL keeps it so"
    with pytest.raises(ValueError, match="loss must be one of"):
        demonstration_examples(policy.tokenizer, 1, loss="everything")


def test_demonstrations_write_numbers_as_prompts_show_them(tiny_model_dir):
    """Literal numbers to four significant digits; what a claim quotes from the observation, by the
    reference the observation's references line shows."""
    from lib.training.tokenizer import load_tokenizer

    assert round_significant(0.21110827456039238, 4) == 0.2111
    assert round_significant({"m": [125.019, 3], "z": -0.0012345, "ok": True, "c": "x"}, 4) == {
        "m": [125.0, 3],
        "z": -0.001234,
        "ok": True,
        "c": "x",
    }
    assert round_significant(0.0, 4) == 0.0 and round_significant(12345.6, 4) == 12350.0
    tokenizer = load_tokenizer(tiny_model_dir)
    replies, claims = [], []
    for example in demonstration_examples(tokenizer, 6):
        text = tokenizer.decode(example["input_ids"])
        for chunk in text.split("<|assistant|>\n")[1:]:
            reply = json.loads(chunk.split("<|end|>")[0])
            replies.append(reply)
            if reply["parameters"].get("discovered"):
                claims.append((reply, text))
    numbers = [v for reply in replies for v in reply["parameters"].values() if isinstance(v, float)]
    assert numbers and all(v == float(f"{v:.4g}") for v in numbers), numbers
    assert any(v != round(v) for v in numbers), "rounded to significant digits, not to integers"
    assert claims, "some demonstrations claim a discovery"
    for reply, text in claims:
        quoted = {
            name: reply["parameters"][name] for name in ("mass_gev", "mass_uncertainty_gev", "significance_sigma")
        }
        assert quoted == {
            "mass_gev": "@fit.mass_gev",
            "mass_uncertainty_gev": "@fit.mass_uncertainty_gev",
            "significance_sigma": "@significance.significance_sigma",
        }, "a claim quotes what it read by reference"
        context = text.split(json.dumps(reply, separators=(",", ":")))[0]
        shown = context.rsplit("References: ", 1)[1].split("\n")[0]
        assert all(f"{value}=" in shown for value in quoted.values()), "each reference is on the last references line"
    assert all(parse_reply(json.dumps(reply)).ok or "@" in json.dumps(reply) for reply in replies)


@pytest.mark.slow  # a training run (trl 1.15, the GPU set, needs triton for it)
def test_warm_start_trains_the_lora_adapter_on_the_actions(tiny_model_dir):
    config = TrainConfig(
        model_name=tiny_model_dir,
        backend="trl",
        lora_r=8,
        beta=0.0,  # a LoRA warm start: TRL's KL reference would be the model before it
        warm_start_episodes=2,
        warm_start_epochs=3,
        warm_start_learning_rate=5e-3,
        warm_start_loss="actions",
        warm_start_batch_size=1,
        policy_context="conversation",  # a real model's way (configs/train/colab.yaml)
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


@pytest.mark.slow  # a training run: 8 epochs of SFT on every weight
def test_a_warm_start_of_every_weight_learns_and_is_cached(tiny_model_dir, tmp_path):
    """The stand-in's way (every weight, one example per decision, loss on all of it): it learns, is
    saved under a name that changes with its settings, and the next run loads it instead of
    training again. 8 epochs (16 steps): the loss is below 0.7 of the first from the 6th step on and
    flat after the 8th epoch (measured: 7.66 -> 4.43 in 8 epochs, 4.38 in 12; at half the learning
    rate 5.00, still below 0.7 x 7.66, as in 12 epochs)."""
    config = TrainConfig(
        model_name=tiny_model_dir,
        backend="trl",
        lora_r=0,
        warm_start_episodes=1,
        warm_start_epochs=8.0,
        warm_start_learning_rate=5e-3,
    )
    policy = load_policy(config, "trl")
    report = sft_warm_start(policy, config, cache_dir=tmp_path)
    assert report["episodes"] == 1 and report["examples"] > 10, "one example per decision"
    assert report["steps"] == 8 * -(-report["examples"] // config.warm_start_batch_size)
    assert report["loss_tokens"] == report["tokens"]
    assert report["last_loss"] < 0.7 * report["first_loss"], report["losses"]
    assert report["train_seconds"] > 0, "its training time is kept: an imitation-only policy is sized by it"
    assert Path(policy.model.name_or_path) == Path(report["cached"]), "loaded back from its folder: it has a name"
    again = load_policy(config, "trl")
    reloaded = sft_warm_start(again, config, cache_dir=tmp_path)
    assert reloaded["loaded"] and reloaded["cached"] == report["cached"], "a cached warm start is loaded"
    assert all(torch.equal(x, y) for x, y in zip(policy.model.state_dict().values(), again.model.state_dict().values()))
    other = TrainConfig(**{**config.to_dict(), "warm_start_learning_rate": 4e-3})
    assert cached_warm_start_dir(load_policy(other, "trl"), other, tmp_path) != Path(report["cached"])


def test_a_warm_start_evaluated_on_the_validation_split_writes_its_episodes(tiny_model_dir, tmp_path):
    """`python -m lib.training.warm_start --evaluate DIR`'s second half: the configuration's evaluation
    split played greedily into DIR/pre_eval.jsonl.gz, the file `lib.report.seed_runs --sft` reads."""
    from lib.episodes.records import load_episodes_jsonl
    from lib.measure.evaluation import validation_suite
    from lib.training.warm_start import evaluate_warm_start

    config = TrainConfig(
        model_name=tiny_model_dir, backend="trl", lora_r=0, eval_split="validation", eval_episodes=3, max_turns=2
    )
    line = evaluate_warm_start(load_policy(config, "trl"), config, tmp_path / "sft")
    episodes = load_episodes_jsonl(str(tmp_path / "sft" / "pre_eval.jsonl.gz"))
    assert [episode["seed"] for episode in episodes] == [spec.seed for spec in validation_suite(3)]
    assert line.startswith("validation evaluation: ") and " of 3 correct" in line


@pytest.mark.slow
@pytest.mark.usefixtures("no_evidence_figures")  # tests/conftest.py
def test_a_run_with_a_warm_start_saves_it_and_grpo_trains_the_same_adapter(tmp_path, tiny_model_dir):
    config = TrainConfig(
        model_name=tiny_model_dir,
        backend="trl",
        lora_r=8,
        beta=0.0,  # a LoRA warm start: TRL's KL reference would be the model before it
        warm_start_episodes=1,
        warm_start_epochs=3,
        warm_start_learning_rate=5e-3,
        warm_start_batch_size=1,
        policy_context="conversation",
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


class _Stuck:
    """A learner that sends the first configuration again and again."""

    def reset(self):
        pass

    def act(self, obs):
        return {"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6, "pileup": "nominal"}}


def test_dagger_labels_the_states_the_learner_reached(tiny_model_dir):
    """The demonstrator's labels follow the learner: a learner stuck on its first action is told,
    at every state it reached, what the demonstrator would do there (the same correction each
    time), where the demonstrator's own campaign moves on to a new action at every step."""
    from cernenv import CERNCollisionEnvironment
    from lib.episodes.agent_rollouts import collect_agent_episode
    from lib.training.dagger import label_decisions
    from lib.training.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    spec = corpus_specs(2)[1]
    stuck = collect_agent_episode(env=CERNCollisionEnvironment(), agent=_Stuck(), max_steps=4, **spec)
    examples, agreed, refused = label_decisions([stuck], tokenizer, TrainConfig(warm_start_loss="actions"))
    replies = [
        tokenizer.decode([t for t, m in zip(e["input_ids"], e["completion_mask"]) if m], skip_special_tokens=True)
        for e in examples
    ]
    labels = [json.loads(reply)["action_type"] for reply in replies]
    assert len(examples) == 4 and labels[0] == "configure_beam"
    assert labels[1] != "configure_beam" and labels[1:] == [labels[1]] * 3, labels
    assert refused == 0 and agreed == 0, "redundant repeats are not refusals; scripted steps have no completion text"
    own = demonstration_examples(tokenizer, 1, loss="actions", context="turn", specs=[spec])[:4]
    own_labels = [
        json.loads(
            tokenizer.decode([t for t, m in zip(e["input_ids"], e["completion_mask"]) if m], skip_special_tokens=True)
        )["action_type"]
        for e in own
    ]
    assert len(set(own_labels)) == 4, own_labels


@pytest.mark.slow  # a DAgger round: the stand-in plays, is labelled and trains
def test_a_dagger_round_trains_on_the_learner_s_labelled_decisions(tiny_model_dir, tmp_path):
    config = TrainConfig(
        model_name=tiny_model_dir,
        lora_r=0,
        warm_start_episodes=1,
        warm_start_epochs=1.0,
        warm_start_dagger_rounds=1,
        warm_start_dagger_episodes=2,
        max_turns=3,
    )
    report = sft_warm_start(load_policy(config, "trl"), config, cache_dir=tmp_path)
    (round_report,) = report["dagger"]
    assert round_report["campaigns"] == 2 and round_report["decisions"] == 6, "3 decisions per campaign"
    assert round_report["examples"] == 12, "each labelled decision with one demonstrated decision"
    assert round_report["steps"] == 1 and round_report["losses"]
    plain = TrainConfig(**{**config.to_dict(), "warm_start_dagger_rounds": 0})
    assert cached_warm_start_dir(load_policy(plain, "trl"), plain, tmp_path) != Path(report["cached"])


def test_grpo_goes_on_training_an_adapter_saved_before(tiny_model_dir, tmp_path):
    """`warm_start_adapter`: a LoRA warm start saved once is loaded, trainable, as the policy GRPO
    trains (its weights, not a new adapter's zeros); it stands in for a warm start, never beside one."""
    from lib.training.run import adapter_policy

    config = TrainConfig(
        model_name=tiny_model_dir,
        lora_r=8,
        beta=0.0,
        warm_start_episodes=1,
        warm_start_learning_rate=5e-3,
        policy_context="conversation",
    )
    trained = load_policy(config, "trl")
    # A trained adapter stands in as random LoRA B weights: no SFT run, so the GPU set (whose trainers
    # need triton) checks this on a CPU too.
    from peft import get_peft_model

    trained.model = get_peft_model(trained.model, trained.peft_config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trained.model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    trained.model.save_pretrained(tmp_path / "adapter")
    saved = {n: p.detach().clone() for n, p in trained.model.named_parameters() if "lora_B" in n}
    assert any(p.abs().max() > 0 for p in saved.values())
    loaded = adapter_policy(load_policy(config, "trl"), str(tmp_path / "adapter"))
    assert loaded.peft_config is None, "the trainer must train this adapter, not wrap a new one"
    lora_b = {n: p for n, p in loaded.model.named_parameters() if "lora_B" in n}
    assert lora_b.keys() == saved.keys() and all(torch.equal(lora_b[n], saved[n]) for n in saved)
    assert all(p.requires_grad for p in lora_b.values())
    with pytest.raises(ValueError, match="warm_start_adapter is a warm start made before"):
        TrainConfig(warm_start_adapter=str(tmp_path / "adapter"), warm_start_episodes=1)
    with pytest.raises(FileNotFoundError, match="holds no adapter_config.json"):
        adapter_policy(load_policy(config, "trl"), str(tmp_path))


def test_recomputing_activations_is_the_configuration_s_choice_else_a_lora_adapter_s(tiny_model_dir):
    """`gradient_checkpointing`: None recomputes activations for a LoRA adapter (a real model's whole
    campaign in the full observations outgrew memory without it) and not for the stand-in; true or false
    holds for the warm start and GRPO alike, and a warm start's own argument over both."""
    from lib.training.run import grpo_args
    from lib.training.warm_start import gradient_checkpointing_for

    lora = load_policy(TrainConfig(model_name=tiny_model_dir, lora_r=8, beta=0.0), "trl")
    full = load_policy(TrainConfig(model_name=tiny_model_dir), "trl")
    assert gradient_checkpointing_for(lora, TrainConfig(lora_r=8, beta=0.0)) is True
    assert gradient_checkpointing_for(full, TrainConfig()) is False
    off = TrainConfig(lora_r=8, beta=0.0, gradient_checkpointing=False)
    assert gradient_checkpointing_for(lora, off) is False
    assert gradient_checkpointing_for(lora, off, True) is True
    assert grpo_args(TrainConfig(lora_r=8, beta=0.0)).gradient_checkpointing is True
    assert grpo_args(off).gradient_checkpointing is False
    assert grpo_args(TrainConfig(gradient_checkpointing=True)).gradient_checkpointing is True


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_the_warm_start_s_rate_follows_its_schedule(tiny_model_dir, tmp_path, schedule):
    """`warm_start_lr_schedule`: a decaying schedule warms up over 5% of the steps, peaks at
    `warm_start_learning_rate` and ends near 0; "constant" holds the peak from the first step.
    The rates are read from the scheduler the trainer builds, step by step."""
    peak = 1e-3
    config = TrainConfig(
        model_name=tiny_model_dir,
        backend="trl",
        lora_r=8,
        beta=0.0,
        warm_start_episodes=2,
        warm_start_learning_rate=peak,
        warm_start_lr_schedule=schedule,
    )
    policy = load_policy(config, "trl")
    trainer = sft_trainer(policy, config, demonstration_examples(policy.tokenizer, 2), str(tmp_path))
    steps = 40
    trainer.create_optimizer_and_scheduler(num_training_steps=steps)
    rates = []
    for _ in range(steps):
        rates.append(trainer.lr_scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    if schedule == "constant":
        assert rates == pytest.approx([peak] * steps)
    else:
        warmup = 2  # 5% of 40 steps
        assert rates[0] == 0.0 and rates[warmup] == pytest.approx(peak)
        assert all(a >= b for a, b in zip(rates[warmup:], rates[warmup + 1 :])), "it only decays after the warm-up"
        assert rates[-1] < 0.05 * peak


def test_a_warm_start_s_fingerprint_names_a_schedule_other_than_the_default(tiny_model_dir):
    """A cached warm start made on one schedule is not taken for one made on another; an unknown
    schedule is refused with the names it may take."""
    from lib.training.warm_start import fingerprint

    config = TrainConfig(model_name=tiny_model_dir, backend="trl", warm_start_episodes=2)
    policy = load_policy(config, "trl")
    default = fingerprint(policy, config)
    constant = TrainConfig(
        model_name=tiny_model_dir, backend="trl", warm_start_episodes=2, warm_start_lr_schedule="constant"
    )
    assert fingerprint(policy, constant) != default
    with pytest.raises(ValueError, match="warm_start_lr_schedule must be one of"):
        TrainConfig(model_name=tiny_model_dir, warm_start_lr_schedule="cosine_with_restarts")
