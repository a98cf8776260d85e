"""Loading the policy for a backend: Unsloth on a CUDA GPU, else transformers + PEFT.

Unsloth patches transformers, peft and TRL when it is imported, so it must be imported
before any of them: `import_unsloth_first` does that, and `lib.training.train` calls it
before it imports anything that imports transformers. Whether Unsloth is usable is probed
without importing it (`importlib.util.find_spec`): once imported, TRL's trainer is
Unsloth's for the rest of the process, which a `backend="trl"` run must not get. Without a
GPU `import unsloth` raises `NotImplementedError` (not `ImportError`).

Precision follows the device (`policy_dtype`): bfloat16 where the GPU supports it, else
float16 (a T4), float32 on a CPU; the model and the trainer's mixed-precision flags use
the same one (`precision_flags`).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from lib.training.config import GPU_DEFAULT_MODEL, TINY_MODEL, TrainConfig
from lib.training.model_source import model_source, model_source_problem

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


LATE_FOR_UNSLOTH = ("transformers", "peft", "trl")
"""Modules that Unsloth patches on import: importing any of them first leaves them unpatched."""


def unsloth_available() -> tuple[bool, str]:
    """(True, "") when a CUDA device exists and `unsloth` is installed, else (False, why).
    Probes without importing it (see the module docstring)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if "unsloth" in sys.modules:
        return True, ""
    if importlib.util.find_spec("unsloth") is None:
        return False, "the unsloth package is not installed (pip install -r requirements-gpu.txt)"
    return True, ""


def import_unsloth_first(config: TrainConfig) -> bool:
    """Import unsloth now if `config` may train with it (backend unsloth or auto, a CUDA device,
    the package installed), before transformers, peft and trl; True if it is imported.
    Warns when one of those was imported already: its Unsloth patches are then missing, and
    the cure is a fresh process (on Colab: restart the runtime) that imports lib.training first."""
    if config.backend == "trl" or not unsloth_available()[0]:
        return "unsloth" in sys.modules
    if "unsloth" not in sys.modules:
        late = [name for name in LATE_FOR_UNSLOTH if name in sys.modules]
        if late:
            logger.warning(
                "%s imported before unsloth: Unsloth's patches may not apply to them; restart the "
                "process and import lib.training (or unsloth) first",
                ", ".join(late),
            )
    try:
        import unsloth  # noqa: F401  (patches transformers, peft and trl)
    except (ImportError, NotImplementedError) as error:
        if config.backend == "unsloth":
            raise RuntimeError(f"backend='unsloth' but unsloth does not import: {type(error).__name__}: {error}")
        logger.warning(
            "unsloth does not import (%s: %s); training with transformers + PEFT", type(error).__name__, error
        )
        return False
    return True


def policy_dtype() -> torch.dtype:
    """bfloat16 on a GPU that supports it, float16 on one that does not (a T4), float32 on a CPU."""
    if not torch.cuda.is_available():
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def precision_flags(dtype: Optional[torch.dtype] = None) -> Dict[str, bool]:
    """The trainer's mixed-precision flags for the model's `dtype` (default `policy_dtype()`):
    they must agree, or Unsloth's trainer stops ("Model is in float16 precision but you want
    to use bfloat16")."""
    dtype = dtype or policy_dtype()
    return {"bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16}


OPTIMISER_ARGS = {"optim": "adamw_torch_fused", "weight_decay": 0.0}
"""The optimiser of every trainer built here (GRPO, the SFT warm start), named rather than left
to the config classes' defaults: transformers' own default is this one (torch >= 2.8), but the
configs Unsloth patches default to 8-bit AdamW with weight decay 0.001 (unsloth/models/rl.py),
which would make `backend="unsloth"` and `backend="trl"` train differently."""


def resolve_backend(config: TrainConfig) -> str:
    """The backend `config` asks for, checked: `auto` becomes `unsloth` or `trl` (`trl` for replies
    scored within the grammar, `renormalise_to_grammar`, which only its trainer does)."""
    if config.use_vllm and not torch.cuda.is_available():
        raise RuntimeError("use_vllm=True needs a CUDA GPU (and the vllm package); set use_vllm=False on CPU.")
    if config.backend == "trl" or config.renormalise_to_grammar:
        return "trl"
    ok, why = unsloth_available()
    if config.backend == "unsloth" and not ok:
        raise RuntimeError(
            f"backend='unsloth' needs a CUDA GPU and the unsloth package: {why}. "
            "Use backend='trl' (or 'auto') to train with transformers + PEFT."
        )
    return "unsloth" if ok and import_unsloth_first(config) else "trl"


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


def four_bit_loading(config: TrainConfig) -> dict:
    """`from_pretrained`'s arguments for `config.load_in_4bit` (none without it): bitsandbytes' NF4
    with double quantisation, computed in the policy's dtype, on the GPU. Without a GPU, a
    ValueError that says so (bitsandbytes' 4-bit kernels are CUDA's)."""
    if not config.load_in_4bit:
        return {}
    if not torch.cuda.is_available():
        raise ValueError("load_in_4bit needs a CUDA GPU (bitsandbytes' 4-bit kernels); on a CPU leave it false")
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=policy_dtype(),
    )
    return {"quantization_config": quantization, "device_map": {"": torch.cuda.current_device()}}


def _load_transformers(config: TrainConfig, name: str) -> Policy:
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from lib.training.tokenizer import build_tokenizer, load_tokenizer

    if name == TINY_MODEL:
        if config.load_in_4bit:
            raise ValueError(f"load_in_4bit is for a real model on a GPU, not the {name} stand-in")
        from lib.training.policy_model import untrained_stand_in

        tokenizer = build_tokenizer()
        model = untrained_stand_in(tokenizer)
    else:
        source = model_source(name)
        problem = model_source_problem(source)
        if problem:  # said now, not after the Hub client's retries
            raise FileNotFoundError(problem)
        tokenizer = load_tokenizer(source)  # a saved stand-in's own tokenizer, not AutoTokenizer's rebuild
        model = AutoModelForCausalLM.from_pretrained(source, dtype=policy_dtype(), **four_bit_loading(config))
    if torch.cuda.is_available() and not config.load_in_4bit:
        model = model.to("cuda")  # from_pretrained loads on the CPU (4-bit weights load on the GPU)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    peft_config = None
    if config.lora_r > 0:
        peft_config = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=0.0,
            target_modules=_lora_targets(),
            task_type="CAUSAL_LM",
        )
    return Policy(model, tokenizer, peft_config, "trl", name)


def _load_unsloth(config: TrainConfig, name: str) -> Policy:
    from unsloth import FastLanguageModel

    from lib.training.tokenizer import load_tokenizer, saves_its_own_pipeline

    if name == TINY_MODEL:
        raise ValueError(
            f"the {name} stand-in is a CPU model; on a GPU give a real model_name (e.g. {GPU_DEFAULT_MODEL})"
        )
    source = model_source(name)
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=source,
        max_seq_length=config.max_seq_length,
        dtype=policy_dtype(),
        load_in_4bit=config.load_in_4bit,
        full_finetuning=config.lora_r == 0,  # lora_r=0 trains every weight, as on the trl backend
        local_files_only=Path(source).is_dir(),  # a saved folder loads without asking the Hub
        fast_inference=config.use_vllm,
        max_lora_rank=max(config.lora_r, 1),
    )
    if saves_its_own_pipeline(source):
        # Unsloth loads the tokenizer with AutoTokenizer, which rebuilds a saved project
        # tokenizer's pre-tokenizer as Qwen2's: the policy would read text split otherwise
        tokenizer = load_tokenizer(name)
    if config.lora_r > 0:
        model = FastLanguageModel.get_peft_model(
            model,
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            target_modules=_lora_targets(),
            use_gradient_checkpointing="unsloth",
            random_state=config.seed,
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Policy(model, tokenizer, None, "unsloth", name)
