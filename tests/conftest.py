"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """The project's tokenizer (trained on the environment's text, cached in .cache/)."""
    from lib.training.tokenizer import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer):
    """The stand-in's architecture with random weights (no warm start: fast)."""
    from lib.training.policy_model import build_tiny_model

    return build_tiny_model(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tokenizer, tmp_path_factory):
    """The same random model (a fresh copy: no test's changes to `model`) and the tokenizer, saved as
    any Hugging Face model is and loaded by its folder's name."""
    from lib.training.policy_model import build_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
