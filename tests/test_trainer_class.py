"""The GRPO trainer class (lib/training/trainer_class.py): scoring a batch without the padding its
rows share gives TRL's log-probabilities and entropies, from narrower forward passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lib.training import TrainConfig
from lib.training.trainer_class import grouped_by_length, grpo_trainer_class, padding_trimmed_trainer


def _trainer(trainer_class, model, tokenizer, tmp_path):
    from lib.training.grpo import REWARD_FUNCS, CampaignRollout, training_dataset
    from lib.training.run import grpo_args

    config = TrainConfig(
        warm_start_episodes=0,
        max_steps=1,
        num_generations=2,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        output_dir=str(tmp_path),
    )
    return trainer_class(
        model=model,
        reward_funcs=REWARD_FUNCS,
        args=grpo_args(config, save_strategy="no"),
        train_dataset=training_dataset(config),
        processing_class=tokenizer,
        rollout_func=CampaignRollout(config, tokenizer),
    )


def _padded_batch(prompt_lengths, completion_lengths, pad_id, seed=0):
    """TRL's layout: prompts left-padded to the longest, completions right-padded to the longest,
    concatenated; the attention mask 1 on tokens."""
    generator = torch.Generator().manual_seed(seed)
    width_p, width_c = max(prompt_lengths), max(completion_lengths)
    ids = torch.full((len(prompt_lengths), width_p + width_c), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        ids[row, width_p - p : width_p + c] = torch.randint(5, 2000, (p + c,), generator=generator)
        mask[row, width_p - p : width_p + c] = 1
    return ids, mask, width_c


def test_a_batch_scored_without_its_shared_padding_gets_trl_s_numbers(tiny_model_dir, tmp_path):
    """Two batches of two rows: the first's prompts and completions much shorter than the step's
    longest, the second holding the longest. Log-probabilities and entropies on every completion
    token agree with TRL's to float rounding, the padding stays 0, the first batch's forward pass
    reads only the columns its rows use, and the LM head projects only the completions' positions."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from lib.training.tokenizer import load_tokenizer

    tokenizer, model = load_tokenizer(tiny_model_dir), AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids, mask, keep = _padded_batch([12, 9, 60, 41], [3, 5, 20, 8], tokenizer.pad_token_id)
    plain = _trainer(GRPOTrainer, model, tokenizer, tmp_path / "plain")
    trimmed = _trainer(padding_trimmed_trainer(GRPOTrainer), model, tokenizer, tmp_path / "trimmed")
    widths, projected = [], []
    hooks = [
        model.register_forward_hook(
            lambda module, args, kwargs, out: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
        ),
        model.get_output_embeddings().register_forward_hook(lambda module, args, out: projected.append(out.shape[1])),
    ]
    try:
        with torch.no_grad():
            expected = plain._get_per_token_logps_and_entropies(model, ids, mask, keep, 2, compute_entropy=True)
            widths.clear()
            got = trimmed._get_per_token_logps_and_entropies(model, ids, mask, keep, 2, compute_entropy=True)
    finally:
        for hook in hooks:
            hook.remove()
    completion_mask = mask[:, -keep:].bool()
    for a, b in zip(got[:2], expected[:2]):
        assert a.shape == b.shape
        assert torch.allclose(a[completion_mask], b[completion_mask], atol=1e-4)
        assert torch.all(a[~completion_mask] == 0)
    assert widths == [12 + 5, 60 + 20], widths  # the first batch's own widths; the second holds the longest
    assert projected == [5 + 1, 20 + 1], "on a CPU the LM head projects the completions' positions alone"


@pytest.mark.parametrize("backend, credit", [("trl", "episode"), ("trl", "decision"), ("unsloth", "episode")])
def test_the_trainer_class_follows_the_backend_and_the_credit(backend, credit):
    """Padding trimmed on TRL's trainer (Unsloth's patched one is left as Unsloth made it), decision
    credit where the config asks for it, and always a GRPOTrainer."""
    from trl import GRPOTrainer

    trainer_class = grpo_trainer_class(TrainConfig(credit=credit), backend)
    assert issubclass(trainer_class, GRPOTrainer)
    assert ("PaddingTrimmed" in trainer_class.__name__) == (backend == "trl")
    assert trainer_class.__name__.startswith("DecisionCredit") == (credit == "decision")


def test_a_step_s_passes_are_dealt_its_samples_by_length_each_sample_whole():
    """Three passes of two samples: afterwards the passes hold the samples shortest first, each
    sample's tensors and list entries still together, the per-step number kept, the sizes kept."""
    prompt_lengths, completion_lengths = [5, 1, 4, 2, 6, 3], [1, 1, 1, 1, 1, 2]
    mask = torch.tensor([[0] * (6 - n) + [1] * n for n in prompt_lengths])
    completion = torch.tensor([[1] * n + [0] * (2 - n) for n in completion_lengths])
    names = list("abcdef")
    batches = [
        {
            "prompt_ids": mask[i : i + 2] * (torch.arange(i, i + 2)[:, None] + 10),
            "prompt_mask": mask[i : i + 2],
            "completion_mask": completion[i : i + 2],
            "advantages": torch.arange(i, i + 2, dtype=torch.float),
            "names": names[i : i + 2],
            "num_items_in_batch": torch.tensor(9),
            "old_per_token_logps": None,
        }
        for i in (0, 2, 4)
    ]
    out = grouped_by_length(batches)
    assert [len(batch["prompt_ids"]) for batch in out] == [2, 2, 2]
    order = [name for batch in out for name in batch["names"]]
    assert order == ["b", "d", "c", "f", "a", "e"]  # lengths 2, 3, 5, 5 (4 + 1, 3 + 2: as they came), 6, 7
    for batch in out:
        for row, name in enumerate(batch["names"]):
            i = names.index(name)
            assert batch["advantages"][row] == i and batch["prompt_ids"][row].max() == i + 10
            assert torch.equal(batch["prompt_mask"][row], mask[i])
        assert batch["num_items_in_batch"] == 9 and batch["old_per_token_logps"] is None


def test_replies_held_to_the_grammar_are_scored_as_they_were_sampled(tiny_model_dir, tmp_path):
    """With what the grammar admitted at each token of a sample (`AdmittedTokens`), its reply's
    log-probabilities are the model's renormalised over those tokens, as sampling drew them: the
    numbers computed from the model by hand, 0 on a forced token, never below the whole-vocabulary
    number; a sample the rollout did not add keeps TRL's numbers."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from lib.episodes.grammar import forced_tokens, reply_admitted
    from lib.training.tokenizer import load_tokenizer
    from lib.training.trainer_class import admitted_tokens_of

    tokenizer, model = load_tokenizer(tiny_model_dir), AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reply = tokenizer(
        '{"action_type":"configure_beam","parameters":{"beam_energy_tev":13.6,"pileup":"nominal"}}',
        add_special_tokens=False,
    )["input_ids"] + [tokenizer.eos_token_id]
    prompt = tokenizer("the beam is not configured yet", add_special_tokens=False)["input_ids"]
    other = prompt[2:]  # a shorter prompt, left-padded, whose sample the rollout did not add
    width_p, keep = len(prompt), len(reply)
    ids = torch.full((2, width_p + keep), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[0] = torch.tensor(prompt + reply)
    mask[0] = 1
    ids[1, width_p - len(other) :] = torch.tensor(other + reply)
    mask[1, width_p - len(other) :] = 1
    trainer = _trainer(padding_trimmed_trainer(GRPOTrainer), model, tokenizer, tmp_path)
    rows = reply_admitted(tokenizer, reply, [1] * len(reply))
    with torch.no_grad():
        whole = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, 2)[0]
        admitted_tokens_of(trainer).add(prompt, reply, rows)
        within, entropy, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, 2, compute_entropy=True)
        logits = model(input_ids=ids[:1]).logits[0, width_p - 1 : -1].float() / trainer.temperature
    bits = torch.from_numpy(np.unpackbits(rows.view(np.uint8), axis=1, bitorder="little")[:, : logits.size(1)])
    expected = logits.gather(1, torch.tensor(reply)[:, None])[:, 0] - torch.logsumexp(
        logits.masked_fill(bits == 0, float("-inf")), dim=1
    )
    assert torch.allclose(within[0], expected, atol=1e-4)
    forced = torch.tensor(forced_tokens(reply, rows))
    assert 0 < int(forced.sum()) < len(reply)
    assert torch.all(within[0][forced].abs() < 1e-5) and torch.all(entropy[0][forced].abs() < 1e-4)
    assert torch.all(within[0] >= whole[0] - 1e-5) and torch.any(within[0][~forced] > whole[0][~forced] + 1e-3)
    assert torch.isfinite(entropy).all()
    assert torch.allclose(within[1], whole[1], atol=1e-6), "a sample the rollout did not add is scored as TRL scores it"


def test_the_admitted_tokens_are_found_by_a_sample_s_tokens_and_checked_as_added():
    """A sample is found by its prompt and its completion or the start of it; a completion whose
    rows do not match its length is refused."""
    from lib.training.trainer_class import AdmittedTokens

    registry = AdmittedTokens()
    rows = np.arange(6, dtype=np.int32).reshape(3, 2)
    registry.add([1, 2], [7, 8, 9], rows)
    assert np.array_equal(registry.rows([1, 2], [7, 8, 9]), rows)
    assert np.array_equal(registry.rows([1, 2], [7, 8]), rows[:2])
    assert registry.rows([1, 2], [7, 9]) is None and registry.rows([2], [7, 8, 9]) is None
    with pytest.raises(ValueError, match="2 rows of admitted tokens for a completion of 3 tokens"):
        registry.add([1], [7, 8, 9], rows[:2])
    registry.clear()
    assert len(registry) == 0 and registry.rows([1, 2], [7, 8, 9]) is None


def test_replies_are_scored_within_the_grammar_only_where_they_were_held_to_it_by_trl_s_trainer():
    """The setting needs replies held to the grammar, and the TRL backend's trainer."""
    with pytest.raises(ValueError, match="needs constrained_replies: true"):
        TrainConfig(renormalise_to_grammar=True, constrained_replies=False)
    with pytest.raises(ValueError, match="set backend 'trl'"):
        TrainConfig(renormalise_to_grammar=True, backend="unsloth")
    assert "PaddingTrimmed" in grpo_trainer_class(TrainConfig(renormalise_to_grammar=True), "trl").__name__
    with pytest.raises(ValueError, match="renormalise_to_grammar"):
        grpo_trainer_class(TrainConfig(renormalise_to_grammar=True), "unsloth")
