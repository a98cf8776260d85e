"""The CPU stand-in policy: a tiny Qwen2-architecture causal LM built here.

No weights can be downloaded on the project's machines, so the CPU path builds its own model:
the project tokenizer (`lib.training.tokenizer`) and a small randomly initialised Qwen2 network
(deterministic from its seed), which the run's SFT warm start then teaches the environment
from scratch (`lib.training.warm_start`, with the CPU defaults of `TrainConfig`). It is a
stand-in for a real instruct model; on a GPU the defaults are a real model (e.g.
Qwen2.5-1.5B-Instruct).

    tokenizer = build_tokenizer()
    model = untrained_stand_in(tokenizer)   # saved once to .cache/policy/..., then loaded
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from lib.files import share_folder, staging_folder
from lib.training.tokenizer import PROJECT_CACHE


@dataclass(frozen=True)
class TinyModelConfig:
    """Size of the stand-in model (Qwen2 architecture, tied embeddings)."""

    hidden_size: int = 128
    """Width of the residual stream."""
    num_hidden_layers: int = 4
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Query heads (head size hidden_size / heads)."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention, as in Qwen2)."""
    intermediate_size: int = 384
    """Width of the MLP."""
    max_position_embeddings: int = 8192
    """Longest sequence [tokens]: a whole episode as one conversation, ~5,000 tokens for 20 turns."""
    seed: int = 0
    """Seed of the random initialisation."""


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, config: TinyModelConfig = TinyModelConfig()
) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 causal LM over `tokenizer`'s vocabulary (same seed, same weights)."""
    torch.manual_seed(config.seed)
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    return Qwen2ForCausalLM(model_config)


def untrained_stand_in(
    tokenizer: PreTrainedTokenizerFast, config: TinyModelConfig = TinyModelConfig(), *, cache_dir: Optional[str] = None
) -> Qwen2ForCausalLM:
    """`build_tiny_model`, saved once to `PROJECT_CACHE/policy/tiny-qwen2-untrained-<fingerprint>` and
    loaded from there: a model trained from it then names a base folder that loads
    (`lib.training.publish.load_trained_policy`); a model built in memory has no name."""
    key = json.dumps({"vocab": tokenizer.get_vocab(), "model": asdict(config)}, sort_keys=True)
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:12]
    target = Path(cache_dir or PROJECT_CACHE / "policy") / f"tiny-qwen2-untrained-{fingerprint}"
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = staging_folder(target)
        build_tiny_model(tokenizer, config).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            share_folder(staging)
            os.replace(staging, target)  # atomic: a concurrent build of the same model wins or loses whole
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return Qwen2ForCausalLM.from_pretrained(target)
