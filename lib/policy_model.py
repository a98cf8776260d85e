"""The CPU stand-in policy: a tiny Qwen2-architecture causal LM built here, warm-started by SFT.

No weights can be downloaded on the project's machines, so the CPU path trains its own
model: the project tokenizer (`lib.tokenizer`), a small randomly initialised Qwen2
network (deterministic from its seed), then supervised fine-tuning with TRL's
`SFTTrainer` on `HeuristicAgent` episodes, each one conversation in the layout the policy
plays in (`lib.multiturn`: system prompt, observation, action as JSON, next observation,
...; loss on the whole conversation, see `SFTSettings.assistant_only_loss`). It is a
stand-in for a real instruct model: it plays some campaigns through and derails in
others, which leaves GRPO something to improve. On a GPU the defaults are a real model
(e.g. Qwen2.5-1.5B-Instruct).

    tokenizer = build_tokenizer()
    model = warm_start(tokenizer)        # trains once, then loads .cache/policy/...
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from cernenv import CERNCollisionEnvironment, ExperimentAction
from lib.baselines import HeuristicAgent
from lib.multiturn import first_messages, followup_message
from lib.prompting import action_to_json
from lib.rollouts import transitions
from lib.tokenizer import PROJECT_CACHE, corpus_specs

logger = logging.getLogger(__name__)

SFT_SEED = 40_000
"""First seed of the SFT episodes: training seeds, apart from the tokenizer's and the evaluation's."""


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


@dataclass(frozen=True)
class SFTSettings:
    """The supervised warm start."""

    n_episodes: int = 800
    """HeuristicAgent episodes, one conversation (training example) each (docs/training.md: why 800)."""
    epochs: float = 3.0
    """Passes over the examples (docs/training.md: why three)."""
    significant_digits: int = 4
    """Numbers in the demonstrated actions are rounded to this many significant digits."""
    assistant_only_loss: bool = False
    """False: the loss covers the observations as well as the actions. The environment's
    messages repeat their lines turn after turn (window, channels, data, candidates), so
    predicting them teaches the model to copy from its context, which the actions need
    (channel names, candidate masses, fitted numbers). With the loss on the actions only
    (~10% of the tokens) the model learnt the verbs but copied nothing."""
    batch_size: int = 1
    """Conversations per optimisation step (one: no padding, so attention takes PyTorch's fast causal path)."""
    learning_rate: float = 2e-3
    """AdamW learning rate (a tiny model from scratch tolerates a large one)."""
    seed: int = 0
    """Seed of the data order and dropout."""
    logging_steps: int = 10
    """Optimisation steps between logged losses."""


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
    loaded from there: a LoRA adapter trained on it then names a base folder that loads
    (`lib.training.publish.load_trained_policy`); a model built in memory has no name."""
    key = json.dumps({"vocab": tokenizer.get_vocab(), "model": asdict(config)}, sort_keys=True)
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:12]
    target = Path(cache_dir or PROJECT_CACHE / "policy") / f"tiny-qwen2-untrained-{fingerprint}"
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=target.name + "-", dir=target.parent))
        build_tiny_model(tokenizer, config).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, target)  # atomic: a concurrent build of the same model wins or loses whole
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
    return Qwen2ForCausalLM.from_pretrained(target)


def round_significant(value: Any, digits: int) -> Any:
    """`value` with every float in it (also inside lists and dicts) rounded to `digits` significant digits."""
    if isinstance(value, float) and math.isfinite(value) and value != 0.0:
        return round(value, digits - 1 - math.floor(math.log10(abs(value))))
    if isinstance(value, dict):
        return {key: round_significant(item, digits) for key, item in value.items()}
    if isinstance(value, list):
        return [round_significant(item, digits) for item in value]
    return value


class RoundedDemonstrator:
    """An agent whose actions are another agent's with their numbers rounded: the demonstrations
    write `0.2111` where the heuristic computed 0.21110827456039238, which a small model can
    copy (the digits past the fourth carry no information it could learn). The environment
    plays the rounded action, so each demonstration is a consistent episode."""

    def __init__(self, agent: Any, digits: int) -> None:
        self.agent, self.digits = agent, digits

    def reset(self) -> None:
        self.agent.reset()

    def act(self, obs: Any) -> ExperimentAction:
        action = self.agent.act(obs)
        return action.model_copy(update={"parameters": round_significant(action.parameters, self.digits)})


def sft_examples(n_episodes: int, first_seed: int = SFT_SEED, significant_digits: int = 4) -> List[Dict[str, Any]]:
    """HeuristicAgent episodes on training seeds as conversations ({"messages": [...]}):
    the system prompt and first observation, then each action as JSON followed by the
    observation it led to, ending with the claim. Actions are written without their
    justification (optional): a terse policy decodes fewer tokens per turn. Numbers are
    rounded to `significant_digits` (`RoundedDemonstrator`)."""
    env, agent, rows = CERNCollisionEnvironment(), RoundedDemonstrator(HeuristicAgent(), significant_digits), []
    for spec in corpus_specs(n_episodes, first_seed):
        messages = None
        for obs, action, _ in transitions(env, agent, **spec):
            messages = first_messages(obs) if messages is None else messages + [followup_message(obs)]
            messages.append({"role": "assistant", "content": action_to_json(action, justification=False)})
        rows.append({"messages": messages})
    return rows


def _fingerprint(tokenizer: PreTrainedTokenizerFast, model: TinyModelConfig, sft: SFTSettings) -> str:
    key = json.dumps(
        {
            "vocab": tokenizer.get_vocab(),
            "model": asdict(model),
            "sft": asdict(sft),
            "template": tokenizer.chat_template,
            "probe": sft_examples(1, significant_digits=sft.significant_digits),
        },
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def cached_model_dir(
    tokenizer: PreTrainedTokenizerFast,
    model_config: TinyModelConfig = TinyModelConfig(),
    sft: SFTSettings = SFTSettings(),
    *,
    cache_dir: Optional[str] = None,
) -> Path:
    """Where `warm_start` keeps the model for these inputs: `cache_dir` (default
    `PROJECT_CACHE/policy`, at the repository root) / `tiny-qwen2-<fingerprint>`."""
    return Path(cache_dir or PROJECT_CACHE / "policy") / f"tiny-qwen2-{_fingerprint(tokenizer, model_config, sft)}"


def warm_start(
    tokenizer: PreTrainedTokenizerFast,
    *,
    cache_dir: Optional[str] = None,
    model_config: TinyModelConfig = TinyModelConfig(),
    sft: SFTSettings = SFTSettings(),
    report: Optional[Dict[str, Any]] = None,
) -> Qwen2ForCausalLM:
    """The SFT-warm-started stand-in model, trained once and cached under a name that
    changes with any of its inputs (under `cache_dir`, default `PROJECT_CACHE/policy`).
    `report` (a dict) receives the training losses."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from lib.training.callbacks import ProgressLog

    target = cached_model_dir(tokenizer, model_config, sft, cache_dir=cache_dir)
    cache_dir = str(target.parent)
    if (target / "config.json").exists():
        return Qwen2ForCausalLM.from_pretrained(target)
    model = build_tiny_model(tokenizer, model_config)
    dataset = Dataset.from_list(sft_examples(sft.n_episodes, significant_digits=sft.significant_digits))
    work = Path(
        tempfile.mkdtemp(prefix="sft-", dir=str(Path(cache_dir).parent if Path(cache_dir).parent.exists() else None))
    )
    args = SFTConfig(
        output_dir=str(work),
        num_train_epochs=sft.epochs,
        per_device_train_batch_size=sft.batch_size,
        learning_rate=sft.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        seed=sft.seed,
        logging_steps=sft.logging_steps,
        save_strategy="no",
        report_to=[],
        assistant_only_loss=sft.assistant_only_loss,
        max_length=model_config.max_position_embeddings,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        disable_tqdm=True,
        # float32 without autocast: TRL's configs default to bf16, whose autocast on a CPU made every
        # step 7x slower (a 5,000-token conversation: 8 s instead of 1.1 s); the model is 1M parameters.
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[ProgressLog(f"SFT warm start of the stand-in ({len(dataset)} conversations)")],
    )
    logger.info("building the stand-in's SFT warm start once (cached in %s)", target)
    trainer.train()
    if report is not None:
        report["losses"] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        report["n_examples"] = len(dataset)
    staging = Path(tempfile.mkdtemp(prefix=target.name + "-", dir=target.parent if target.parent.exists() else None))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)  # a self-contained model folder (its tokenizer: lib.tokenizer.load_tokenizer)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(staging, target)  # atomic: a concurrent build of the same model wins or loses whole
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    # loaded back from its folder, as a cache hit is: a LoRA adapter trained on it must name a base
    # that loads (the model trained in memory had no name: the full run's adapter_config.json said
    # "base_model_name_or_path": null, and loading the trained policy went to the Hugging Face Hub)
    return Qwen2ForCausalLM.from_pretrained(target)


def main() -> int:
    """`python -m lib.policy_model`: build the stand-in's warm start in this one process (or find it
    cached) and print its folder. A run in several processes needs it built first: a Trainer in the
    main process alone falls out of step with the other processes' collectives (tried: the run
    crashed, "Connection closed by peer")."""
    from lib.tokenizer import build_tokenizer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    tokenizer = build_tokenizer()
    warm_start(tokenizer)
    print(cached_model_dir(tokenizer))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
