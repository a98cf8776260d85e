"""The CPU stand-in policy: a deterministic tiny Qwen2 model (its warm start: tests/test_warm_start.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lib.training.policy_model import TinyModelConfig, build_tiny_model, untrained_stand_in
from lib.training.tokenizer import build_tokenizer


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


def test_the_untrained_stand_in_is_saved_once_and_loaded_by_its_folder(tokenizer, tmp_path):
    model = untrained_stand_in(tokenizer, cache_dir=str(tmp_path))
    assert Path(model.name_or_path).parent == tmp_path, "a model trained from it names a base that loads"
    again = untrained_stand_in(tokenizer, cache_dir=str(tmp_path))
    fresh = build_tiny_model(tokenizer)
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), again.state_dict().values()))
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), fresh.state_dict().values()))
