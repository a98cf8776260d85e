"""Loading the policy for a backend: Unsloth on a CUDA GPU, else transformers + PEFT.

Unsloth patches transformers and TRL when it is imported, so it must be imported before
`trl`; `resolve_backend` does that first. Without a GPU `import unsloth` raises
`NotImplementedError` (not `ImportError`), which `auto` treats as "not available".
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lib.training.config import GPU_DEFAULT_MODEL, TINY_MODEL, TINY_UNTRAINED_MODEL, TrainConfig

logger = logging.getLogger(__name__)


@dataclass
class Policy:
    """A loaded policy: the model, its tokenizer, the PEFT config for GRPOTrainer (None when
    the model is already wrapped or trained in full), and how it was made."""

    model: Any
    tokenizer: Any
    peft_config: Any
    backend: str
    model_name: str


def unsloth_available() -> tuple[bool, str]:
    """(True, "") when a CUDA device exists and `unsloth` imports, else (False, why)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if "trl" in sys.modules and "unsloth" not in sys.modules:
        logger.warning("trl was imported before unsloth; Unsloth's patches may not apply to it")
    try:
        import unsloth  # noqa: F401  (import before trl: it patches trl and transformers)
    except (ImportError, NotImplementedError) as error:
        return False, f"unsloth does not import ({type(error).__name__}: {error})"
    return True, ""


def resolve_backend(config: TrainConfig) -> str:
    """The backend `config` asks for, checked: `auto` becomes `unsloth` or `trl`."""
    if config.backend == "trl":
        return "trl"
    ok, why = unsloth_available()
    if config.backend == "unsloth" and not ok:
        raise RuntimeError(f"backend='unsloth' needs a CUDA GPU and the unsloth package: {why}. "
                           "Use backend='trl' (or 'auto') to train with transformers + PEFT.")
    if config.use_vllm and not torch.cuda.is_available():
        raise RuntimeError("use_vllm=True needs a CUDA GPU (and the vllm package); set use_vllm=False on CPU.")
    return "unsloth" if ok else "trl"


def resolve_model_name(config: TrainConfig) -> str:
    if config.model_name:
        return config.model_name
    return GPU_DEFAULT_MODEL if torch.cuda.is_available() else TINY_MODEL


def load_policy(config: TrainConfig, backend: Optional[str] = None) -> Policy:
    """Load `config`'s model for `backend` (default: `resolve_backend(config)`)."""
    backend = backend or resolve_backend(config)
    name = resolve_model_name(config)
    if backend == "unsloth":
        return _load_unsloth(config, name)
    return _load_transformers(config, name)


def _lora_targets() -> list[str]:
    return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _load_transformers(config: TrainConfig, name: str) -> Policy:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name in (TINY_MODEL, TINY_UNTRAINED_MODEL):
        from lib.policy_model import build_tiny_model, warm_start
        from lib.tokenizer import build_tokenizer

        tokenizer = build_tokenizer()
        model = warm_start(tokenizer) if name == TINY_MODEL else build_tiny_model(tokenizer)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    peft_config = None
    if config.lora_r > 0:
        peft_config = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                                 target_modules=_lora_targets(), task_type="CAUSAL_LM")
    return Policy(model, tokenizer, peft_config, "trl", name)


def _load_unsloth(config: TrainConfig, name: str) -> Policy:
    from unsloth import FastLanguageModel

    if name in (TINY_MODEL, TINY_UNTRAINED_MODEL):
        raise ValueError(f"the {name} stand-in is a CPU model; on a GPU give a real model_name "
                         f"(e.g. {GPU_DEFAULT_MODEL})")
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=name, max_seq_length=config.max_seq_length, load_in_4bit=False,
        fast_inference=config.use_vllm, max_lora_rank=max(config.lora_r, 1))
    if config.lora_r > 0:
        model = FastLanguageModel.get_peft_model(
            model, r=config.lora_r, lora_alpha=config.lora_alpha, target_modules=_lora_targets(),
            use_gradient_checkpointing="unsloth", random_state=config.seed)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Policy(model, tokenizer, None, "unsloth", name)
