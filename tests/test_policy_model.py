"""The CPU stand-in policy: a deterministic tiny Qwen2 model and its SFT warm start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lib.policy_model import (
    SFTSettings,
    TinyModelConfig,
    build_tiny_model,
    cached_model_dir,
    round_significant,
    sft_examples,
    warm_start,
)
from lib.prompting import parse_reply
from lib.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_tiny_model_is_deterministic_and_sized_for_a_cpu(tokenizer):
    a, b = build_tiny_model(tokenizer), build_tiny_model(tokenizer)
    assert a.config.model_type == "qwen2" and a.config.vocab_size == len(tokenizer)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    other = build_tiny_model(tokenizer, TinyModelConfig(seed=1))
    assert not torch.equal(a.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert 0.3e6 < sum(p.numel() for p in a.parameters()) < 5e6


def test_sft_examples_are_whole_heuristic_episodes_as_conversations(tokenizer):
    rows = sft_examples(2)
    assert len(rows) == 2
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"
        assert roles[1:] == ["user", "assistant"] * (len(roles) // 2), "observation, action, observation, ..."
        replies = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert all(parse_reply(reply).ok for reply in replies)
        assert parse_reply(replies[-1]).action.action_type.value == "submit_discovery_claim"
        # the template marks the replies and their <|end|>, nothing the environment wrote
        # (the loss mask when SFTSettings.assistant_only_loss is set)
        encoded = tokenizer.apply_chat_template(
            row["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        trained = tokenizer.decode([t for t, m in zip(encoded["input_ids"], encoded["assistant_masks"]) if m])
        assert trained == "".join(reply + "<|end|>" for reply in replies)


def test_demonstrations_write_numbers_to_four_significant_digits():
    assert round_significant(0.21110827456039238, 4) == 0.2111
    assert round_significant({"m": [125.019, 3], "z": -0.0012345, "ok": True, "c": "x"}, 4) == {
        "m": [125.0, 3],
        "z": -0.001234,
        "ok": True,
        "c": "x",
    }
    assert round_significant(0.0, 4) == 0.0 and round_significant(12345.6, 4) == 12350.0
    replies = [json.loads(m["content"]) for row in sft_examples(3) for m in row["messages"] if m["role"] == "assistant"]
    numbers = [v for reply in replies for v in reply["parameters"].values() if isinstance(v, float)]
    assert numbers and all(v == float(f"{v:.4g}") for v in numbers), numbers
    assert any(v != round(v) for v in numbers), "rounded to significant digits, not to integers"


def test_warm_start_learns_and_is_cached(tokenizer, tmp_path):
    report = {}
    settings = SFTSettings(n_episodes=1, epochs=12.0, batch_size=1, learning_rate=5e-3, logging_steps=4)
    model = warm_start(tokenizer, cache_dir=str(tmp_path), sft=settings, report=report)
    losses = report["losses"]
    assert len(losses) >= 3 and losses[-1] < 0.7 * losses[0], losses
    assert Path(model.name_or_path) == cached_model_dir(tokenizer, sft=settings, cache_dir=str(tmp_path)), (
        "a freshly built warm start names its folder, as an adapter's base must"
    )
    reloaded = warm_start(tokenizer, cache_dir=str(tmp_path), sft=settings, report=(again := {}))
    assert again == {}, "a cached model is loaded, not retrained"
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), reloaded.state_dict().values()))
