"""The SFT warm start of a Hugging Face policy: heuristic campaigns, in the tokens GRPO plays.

A small instruct model (Qwen2.5-1.5B-Instruct) knows JSON but not this environment's verbs,
channels and numbers: where its first GRPO episodes are all refused actions, every episode of a
group earns the same and the groups carry no signal (how often that happens to a given model
has not been measured here: no weights can be downloaded on the project's machines).
`TrainConfig.warm_start_episodes > 0` first fine-tunes it (its LoRA adapter, or every weight
with `lora_r=0`) on `HeuristicAgent` campaigns, so GRPO starts from a policy that plays valid
campaigns and improves on them.

Each campaign is laid out exactly as `lib.multiturn.play_episodes` lays out the policy's own
episodes (`ChatLayout`: the first observation as the prompt, then each action and the
environment's reply, with the model's chat template), and the loss covers the actions only
(the model's eos included): the environment's text is masked as GRPO masks it. Numbers are
rounded as in the stand-in's warm start (`SFTSettings.significant_digits`,
`RoundedDemonstrator`), on the same training seeds (`lib.policy_model.SFT_SEED`, apart from
every evaluation seed). TRL's `SFTTrainer` trains on these pre-tokenized examples (`input_ids` + `completion_mask`).

The CPU stand-in `cernenv-tiny` has its own warm start (`lib.policy_model.warm_start`, from
scratch, loss on the whole conversation); this one is for a model that already speaks.
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any, Dict, List

from cernenv import CERNCollisionEnvironment
from lib.baselines import HeuristicAgent
from lib.multiturn import ChatLayout
from lib.policy_model import SFT_SEED, RoundedDemonstrator, SFTSettings
from lib.prompting import action_to_json
from lib.rollouts import transitions
from lib.tokenizer import corpus_specs
from lib.training.backends import OPTIMISER_ARGS, Policy, precision_flags
from lib.training.config import TrainConfig

logger = logging.getLogger(__name__)


def demonstration_examples(
    tokenizer: Any,
    n_episodes: int,
    *,
    first_seed: int = SFT_SEED,
    significant_digits: int = SFTSettings.significant_digits,
) -> List[Dict[str, List[int]]]:
    """`n_episodes` HeuristicAgent campaigns as {"input_ids", "completion_mask"} (1 on the
    action tokens the policy would write, eos included; 0 on the prompt and the environment's
    text), in `ChatLayout`'s token layout for `tokenizer`."""
    layout = ChatLayout(tokenizer)
    env = CERNCollisionEnvironment()
    agent = RoundedDemonstrator(HeuristicAgent(), significant_digits)
    eos = tokenizer.eos_token_id
    examples = []
    for spec in corpus_specs(n_episodes, first_seed):
        messages: List[Dict[str, str]] = []
        input_ids: List[int] = []
        mask: List[int] = []
        for obs, action, next_obs in transitions(env, agent, **spec):
            if not messages:
                messages = layout.first_messages(obs)
                input_ids = layout.prompt_ids(messages)
                mask = [0] * len(input_ids)
            reply = action_to_json(action, justification=False)
            reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [eos]
            input_ids += reply_ids
            mask += [1] * len(reply_ids)
            messages.append({"role": "assistant", "content": reply})
            if next_obs.done:
                break
            env_ids = layout.environment_ids(messages, next_obs, reply_ended=True)
            messages.append(layout.followup_message(next_obs))
            input_ids += env_ids
            mask += [0] * len(env_ids)
        examples.append({"input_ids": input_ids, "completion_mask": mask})
    return examples


def sft_trainer(policy: Policy, config: TrainConfig, examples: List[Dict[str, List[int]]], output_dir: str):
    """TRL's `SFTTrainer` for `examples` (`demonstration_examples`) on `policy`: LoRA when
    `policy.peft_config` is given, loss on the `completion_mask` tokens, the device's precision."""
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    args = SFTConfig(
        output_dir=output_dir,
        num_train_epochs=config.warm_start_epochs,
        per_device_train_batch_size=1,
        learning_rate=config.warm_start_learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,
        seed=config.seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        completion_only_loss=True,
        max_length=config.max_seq_length,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=cuda,
        **precision_flags(),
        **OPTIMISER_ARGS,
    )
    return SFTTrainer(
        model=policy.model,
        args=args,
        train_dataset=Dataset.from_list(examples),
        processing_class=policy.tokenizer,
        peft_config=policy.peft_config,
    )


def loss_mask(trainer: Any) -> List[List[bool]]:
    """Per training example, which tokens the trainer's loss covers (its collated labels != -100):
    what TRL made of `completion_mask`, read back rather than assumed."""
    masks = []
    for example in trainer.train_dataset:
        labels = trainer.data_collator([example])["labels"][0]
        masks.append((labels != -100).tolist())
    return masks


def sft_warm_start(policy: Policy, config: TrainConfig) -> Dict[str, Any]:
    """Fine-tune `policy` in place on `config.warm_start_episodes` demonstrations; afterwards
    `policy.model` is the trained model (a PEFT model when `policy.peft_config` was given, which
    is then cleared: GRPO goes on training the same adapter). Returns what it did: examples,
    tokens, the tokens the loss covered, losses."""
    examples = demonstration_examples(policy.tokenizer, config.warm_start_episodes)
    too_long = sum(len(e["input_ids"]) > config.max_seq_length for e in examples)
    if too_long:
        logger.warning(
            "%d of %d demonstrations are longer than max_seq_length=%d tokens: their ends are cut",
            too_long,
            len(examples),
            config.max_seq_length,
        )
    with tempfile.TemporaryDirectory(prefix="warm-start-") as work:
        trainer = sft_trainer(policy, config, examples, work)
        loss_tokens = sum(sum(mask) for mask in loss_mask(trainer))
        trainer.train()
    policy.model = trainer.model
    policy.peft_config = None
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {
        "episodes": len(examples),
        "tokens": sum(len(e["input_ids"]) for e in examples),
        "action_tokens": sum(sum(e["completion_mask"]) for e in examples),
        "loss_tokens": loss_tokens,
        "steps": trainer.state.global_step,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
    }
