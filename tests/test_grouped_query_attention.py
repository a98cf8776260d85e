"""A CPU run's attention reads a grouped-query model's key-value heads in place
(`lib.runtime.attend_grouped_queries`): the same log-probabilities, gradients and greedy tokens as
the copies transformers makes otherwise, on a padded batch like an evaluation's or GRPO's."""

from __future__ import annotations

import os

import pytest
import torch

from lib.runtime import SDPA_GROUPED_QUERY_SWITCH, attend_grouped_queries

LENGTHS = (21, 13, 6)
"""A left-padded batch of three sequences: the padding mask is what keeps transformers from reading
grouped heads in place by itself."""


def grouped_query_model():
    """A two-layer Llama with 6 query heads sharing 2 key-value heads (SmolLM2's layout, 9 to 3, shrunk)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def padded_batch():
    generator = torch.Generator().manual_seed(1)
    width = max(LENGTHS)
    input_ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    attention_mask = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for row, length in enumerate(LENGTHS):
        input_ids[row, width - length :] = torch.randint(1, 96, (length,), generator=generator)
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def token_log_probs(model, input_ids, attention_mask):
    """Each real token's log-probability given the ones before it (padding and first tokens zeroed)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    chosen = torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return chosen * (attention_mask[:, :-1] * attention_mask[:, 1:])


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Whether each attention call handed SDPA the grouped heads as they are (`enable_gqa`)."""
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append(bool(kwargs.get("enable_gqa", False)))
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    return calls


def test_the_switch_is_set_once_and_a_callers_choice_is_kept(monkeypatch):
    monkeypatch.delenv(SDPA_GROUPED_QUERY_SWITCH, raising=False)
    assert attend_grouped_queries() is True
    assert os.environ[SDPA_GROUPED_QUERY_SWITCH] == "1"
    monkeypatch.setenv(SDPA_GROUPED_QUERY_SWITCH, "0")
    assert attend_grouped_queries() is False, "a caller who turned it off keeps it off"
    assert os.environ[SDPA_GROUPED_QUERY_SWITCH] == "0"


def test_log_probabilities_and_gradients_are_the_copies_own(monkeypatch, sdpa_calls):
    """GRPO's forward and backward pass on a padded batch: with the switch, SDPA gets the grouped heads
    in place (not without it), and every log-probability and gradient is the same to float32 rounding."""
    model = grouped_query_model()
    input_ids, attention_mask = padded_batch()
    results = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(SDPA_GROUPED_QUERY_SWITCH, switch)
        sdpa_calls.clear()
        model.zero_grad()
        log_probs = token_log_probs(model, input_ids, attention_mask)
        log_probs.sum().backward()
        gradients = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        results[switch] = (log_probs.detach(), gradients, list(sdpa_calls))
    assert results["0"][2] == [False, False], "without the switch, the padded batch's keys are copied"
    assert results["1"][2] == [True, True], "with it, SDPA reads them in place"
    torch.testing.assert_close(results["1"][0], results["0"][0], rtol=0, atol=1e-5)
    for name, gradient in results["0"][1].items():
        torch.testing.assert_close(results["1"][1][name], gradient, rtol=1e-4, atol=1e-6, msg=name)


def test_cached_greedy_decoding_plays_the_same_tokens(monkeypatch, sdpa_calls):
    """An evaluation's decoding: prefill of a padded batch, then one token at a time from the cache."""
    model = grouped_query_model()
    input_ids, attention_mask = padded_batch()
    played = {}
    for switch in ("0", "1"):
        monkeypatch.setenv(SDPA_GROUPED_QUERY_SWITCH, switch)
        sdpa_calls.clear()
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=8,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        scores = torch.log_softmax(torch.stack(out.scores, dim=1).float(), dim=-1)
        played[switch] = (out.sequences, scores, sdpa_calls[0])
    assert (played["0"][2], played["1"][2]) == (False, True), "the prefill takes the other path"
    assert torch.equal(played["1"][0], played["0"][0])
    torch.testing.assert_close(played["1"][1], played["0"][1], rtol=0, atol=1e-5)
