"""The SFT warm start of a policy: heuristic campaigns, in the tokens GRPO plays.

One warm start for every model; what differs is configuration (`TrainConfig.warm_start_*`,
`policy_context`, `system_prompt`):

* the CPU stand-in (`cernenv-tiny`, a randomly initialised ~1M-parameter Qwen2 network) learns
  the environment from scratch: one example per decision (the `turn` context: the chat of the
  observation it answered, without the system prompt, and the reply), every weight, a large
  learning rate, the loss on the whole example (`warm_start_loss="conversation"`: predicting the
  observation's text too is how it learns to read one);
* a real instruct model (Qwen2.5-1.5B-Instruct) knows JSON but not this environment's verbs,
  channels and numbers: a few hundred campaigns on its LoRA adapter, each one conversation, the
  loss on its actions only (`warm_start_loss="actions"`), so that GRPO starts from a policy that
  plays valid campaigns instead of groups of refused episodes that carry no signal.

Each example is laid out exactly as `lib.episodes.llm_rollouts.play_episodes` lays out the
policy's own play in the same context (tested equal); the demonstrator is `HeuristicAgent` with
its numbers written as the policy can copy them (`RoundedDemonstrator`), on training seeds apart
from every evaluation seed (`DEMONSTRATION_SEED`). TRL's `SFTTrainer` trains on these
pre-tokenized examples (`input_ids` + `completion_mask`).

A warm start that trains every weight (`lora_r=0`) is cached under `.cache/warm_start/`, named
by a fingerprint of everything it depends on (the base model, the tokenizer, the settings, a
probe demonstration), and loaded from there by the next run; `python -m lib.training.warm_start`
builds the default one in one process (what a run in several processes needs first).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from cernenv import CERNCollisionEnvironment
from lib.agents.baselines import HeuristicAgent, RoundedDemonstrator, family_member
from lib.agents.prompting import LLMAgentConfig, action_to_json, build_chat
from lib.episodes.agent_rollouts import transitions
from lib.episodes.chat import ChatLayout
from lib.episodes.llm_rollouts import CONTEXTS
from lib.files import read_json, share_folder, staging_folder
from lib.seeds import DAGGER_SEED, DEMONSTRATION_SEED
from lib.training.backends import OPTIMISER_ARGS, Policy, precision_flags
from lib.training.callbacks import CpuThreads
from lib.training.config import FINGERPRINT_CHARACTERS, WARM_START_DEMONSTRATORS, WARM_START_LOSSES, TrainConfig
from lib.training.dagger import labelled_learner_decisions
from lib.training.tokenizer import WARM_START_CACHE, corpus_specs

logger = logging.getLogger(__name__)

CACHE_DIR = WARM_START_CACHE


def demonstration_examples(
    tokenizer: Any,
    n_episodes: int,
    *,
    loss: str = "actions",
    context: str = "conversation",
    observation_config: LLMAgentConfig = LLMAgentConfig(),
    first_seed: int = DEMONSTRATION_SEED,
    specs: Optional[Sequence[Dict[str, Any]]] = None,
    demonstrators: str = "heuristic",
) -> List[Dict[str, List[int]]]:
    """`n_episodes` HeuristicAgent campaigns as {"input_ids", "completion_mask"} for `tokenizer`, laid
    out as `play_episodes` plays in `context` (`lib.episodes.llm_rollouts.CONTEXTS`): one example
    per campaign (`conversation`: `ChatLayout`'s layout) or one per decision (`turn`: the decision's
    chat, `build_chat`, and the reply). `loss="actions"`: the mask is 1 on the tokens the policy
    would write (its replies and their eos) and 0 on the prompt and the environment's text, as
    GRPO's env_mask; `loss="conversation"`: 1 on every token, the prompt's and the environment's too.
    `specs` (seed, scenario or difficulty per campaign) replace the training seeds from `first_seed`:
    how a benchmark lays out campaigns it only scores. `demonstrators` (`WARM_START_DEMONSTRATORS`):
    "heuristic", every campaign by `HeuristicAgent()`; "family", each campaign by the member of the
    heuristic family its seed draws (`lib.agents.baselines.family_member`), so the demonstrations
    span the family's strategies."""
    if demonstrators not in WARM_START_DEMONSTRATORS:
        raise ValueError(f"demonstrators must be one of {WARM_START_DEMONSTRATORS}, got {demonstrators!r}")
    if loss not in WARM_START_LOSSES:
        raise ValueError(f"loss must be one of {WARM_START_LOSSES}, got {loss!r}")
    if context not in CONTEXTS:
        raise ValueError(f"context must be one of {CONTEXTS}, got {context!r}")
    layout = ChatLayout(tokenizer, observation_config)
    env = CERNCollisionEnvironment()
    agent = RoundedDemonstrator(HeuristicAgent())
    eos = tokenizer.eos_token_id
    examples = []
    for spec in specs if specs is not None else corpus_specs(n_episodes, first_seed):
        if demonstrators == "family":
            agent = RoundedDemonstrator(HeuristicAgent(**family_member(spec["seed"])))
        if context == "turn":
            for obs, action, next_obs in transitions(env, agent, **spec):
                prompt_ids = layout.prompt_ids(build_chat(obs, observation_config))
                reply = action_to_json(action, justification=False)
                reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [eos]
                mask = [int(loss == "conversation")] * len(prompt_ids) + [1] * len(reply_ids)
                examples.append({"input_ids": prompt_ids + reply_ids, "completion_mask": mask})
                if next_obs.done:
                    break
            continue
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
            messages.append(layout.followup_message(next_obs, messages))
            input_ids += env_ids
            mask += [0] * len(env_ids)
        if loss == "conversation":
            mask = [1] * len(input_ids)
        examples.append({"input_ids": input_ids, "completion_mask": mask})
    return examples


def demonstration_layout(config: TrainConfig) -> Dict[str, Any]:
    """`demonstration_examples`' layout arguments for `config`: its loss, context and prompt form."""
    return {
        "loss": config.warm_start_loss,
        "context": config.policy_context,
        "observation_config": config.observation_config,
        "demonstrators": config.warm_start_demonstrators,
    }


def gradient_checkpointing_for(policy: Policy, config: TrainConfig, asked: Optional[bool] = None) -> bool:
    """Whether the warm start recomputes activations: `asked`, else `config.gradient_checkpointing`,
    else on a GPU and for a LoRA adapter."""
    import torch

    if asked is not None:
        return asked
    if config.gradient_checkpointing is not None:
        return config.gradient_checkpointing
    return torch.cuda.is_available() or policy.peft_config is not None


def sft_trainer(
    policy: Policy,
    config: TrainConfig,
    examples: List[Dict[str, List[int]]],
    output_dir: str,
    *,
    epochs: Optional[float] = None,
    learning_rate: Optional[float] = None,
    lr_scheduler_type: Optional[str] = None,
    gradient_checkpointing: Optional[bool] = None,
    bf16: Optional[bool] = None,
):
    """TRL's `SFTTrainer` for `examples` (`demonstration_examples`) on `policy`: LoRA when
    `policy.peft_config` is given, loss on the `completion_mask` tokens, `warm_start_batch_size`
    examples per step, `epochs` passes (default `warm_start_epochs`) from `learning_rate` (default
    `warm_start_learning_rate`) on the `warm_start_lr_schedule` (or `lr_scheduler_type`, transformers'
    name), the device's precision (float32 without autocast on a CPU; `bf16` True: bf16 autocast,
    False: none), gradient checkpointing on a GPU and for an adapter unless `gradient_checkpointing`
    says otherwise, torch's threads the cores free before each step (`lib.training.callbacks.CpuThreads`)."""
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    epochs = config.warm_start_epochs if epochs is None else epochs
    lr_scheduler_type = config.warm_start_lr_schedule if lr_scheduler_type is None else lr_scheduler_type
    steps = math.ceil(len(examples) / config.warm_start_batch_size * epochs)
    args = SFTConfig(
        output_dir=output_dir,
        num_train_epochs=epochs,
        per_device_train_batch_size=config.warm_start_batch_size,
        learning_rate=config.warm_start_learning_rate if learning_rate is None else learning_rate,
        lr_scheduler_type=lr_scheduler_type,
        warmup_steps=0 if lr_scheduler_type == "constant" else 0.05,
        seed=config.seed,
        logging_steps=max(1, steps // 100),
        save_strategy="no",
        report_to=[],
        completion_only_loss=True,
        max_length=config.max_seq_length,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=gradient_checkpointing_for(policy, config, gradient_checkpointing),
        **(precision_flags() if bf16 is None else {"bf16": bf16, "fp16": False}),
        **OPTIMISER_ARGS,
    )
    return SFTTrainer(
        model=policy.model,
        args=args,
        train_dataset=Dataset.from_list(examples),
        processing_class=policy.tokenizer,
        peft_config=policy.peft_config,
        callbacks=[CpuThreads()],
    )


def loss_mask(trainer: Any) -> List[List[bool]]:
    """Per training example, which tokens the trainer's loss covers (its collated labels != -100):
    what TRL made of `completion_mask`, read back rather than assumed."""
    masks = []
    for example in trainer.train_dataset:
        labels = trainer.data_collator([example])["labels"][0]
        masks.append((labels != -100).tolist())
    return masks


SETTINGS = (
    "warm_start_episodes",
    "warm_start_epochs",
    "warm_start_learning_rate",
    "warm_start_loss",
    "warm_start_batch_size",
    "policy_context",
    "system_prompt",
    "seed",
)
"""The `TrainConfig` fields a warm start depends on (with the base model, the tokenizer and the demonstrations)."""
STYLE_SETTINGS = ("observation_style", "compact_followups", "warm_start_lr_schedule")
"""Fields a warm start depends on when they are not their defaults (one with the defaults keeps its fingerprint)."""
DAGGER_SETTINGS = ("warm_start_dagger_rounds", "warm_start_dagger_episodes", "warm_start_dagger_learning_rate")
"""The fields a warm start with DAgger rounds also depends on (one without keeps its fingerprint);
likewise `warm_start_demonstrators` when it is not "heuristic"."""


def fingerprint(policy: Policy, config: TrainConfig) -> str:
    """A hash of everything a full warm start of `policy` under `config` depends on: the base
    model's name and weights, the tokenizer, the settings, and one probe demonstration (which
    changes when the environment, the prompt or the demonstrator does)."""
    import torch

    digest = hashlib.sha256()
    digest.update(policy.model_name.encode())
    for name, tensor in sorted(policy.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu", torch.float32).numpy().tobytes())
    digest.update(json.dumps(policy.tokenizer.get_vocab(), sort_keys=True).encode())
    settings = SETTINGS + (DAGGER_SETTINGS if config.warm_start_dagger_rounds else ())
    settings += ("warm_start_demonstrators",) if config.warm_start_demonstrators != "heuristic" else ()
    settings += tuple(name for name in STYLE_SETTINGS if getattr(config, name) != getattr(TrainConfig, name))
    digest.update(json.dumps({name: getattr(config, name) for name in settings}, sort_keys=True).encode())
    probe = demonstration_examples(policy.tokenizer, 1, **demonstration_layout(config))
    digest.update(json.dumps(probe).encode())
    return digest.hexdigest()[:FINGERPRINT_CHARACTERS]


def cached_warm_start_dir(policy: Policy, config: TrainConfig, cache_dir: Optional[os.PathLike] = None) -> Path:
    """Where the full warm start of `policy` under `config` is kept (`CACHE_DIR` unless `cache_dir`)."""
    return Path(cache_dir or CACHE_DIR) / f"{Path(policy.model_name).name}-{fingerprint(policy, config)}"


def sft_warm_start(policy: Policy, config: TrainConfig, *, cache_dir: Optional[os.PathLike] = None) -> Dict[str, Any]:
    """Fine-tune `policy` in place on `config.warm_start_episodes` demonstrations; afterwards
    `policy.model` is the trained model (a PEFT model when `policy.peft_config` was given, which
    is then cleared: GRPO goes on training the same adapter). A warm start of every weight is
    cached (`cached_warm_start_dir`) and loaded from there when it was built before. Returns
    what it did: examples, tokens, the tokens the loss covered, steps, losses, where it is cached."""
    from transformers import AutoModelForCausalLM

    target = cached_warm_start_dir(policy, config, cache_dir) if policy.peft_config is None else None
    if target is not None and (target / "warm_start.json").is_file():
        logger.info("the warm start is cached in %s: loading it", target)
        policy.model = AutoModelForCausalLM.from_pretrained(target).to(policy.model.device)
        report = read_json(target / "warm_start.json", f"delete {target}: the next run builds it again")
        return {**report, "cached": str(target), "loaded": True}
    examples = demonstration_examples(policy.tokenizer, config.warm_start_episodes, **demonstration_layout(config))
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
    train_seconds = trainer.state.log_history[-1].get("train_runtime") if trainer.state.log_history else None
    policy.model = trainer.model
    policy.peft_config = None
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    dagger = dagger_rounds(policy, config, examples) if config.warm_start_dagger_rounds else None
    report = {
        "episodes": config.warm_start_episodes,
        "examples": len(examples),
        "tokens": sum(len(e["input_ids"]) for e in examples),
        "action_tokens": sum(sum(e["completion_mask"]) for e in examples)
        if config.warm_start_loss == "actions"
        else None,
        "loss_tokens": loss_tokens,
        "steps": trainer.state.global_step,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "losses": losses,
        "train_seconds": train_seconds,
    }
    if dagger is not None:
        report["dagger"] = dagger
    if target is not None:
        _save_atomically(policy, report, target)
        # loaded back from its folder, as a cache hit is: a model trained in memory has no name,
        # and an adapter trained on it later must name a base that loads
        policy.model = AutoModelForCausalLM.from_pretrained(target).to(policy.model.device)
        report["cached"] = str(target)
    return report


def continuation_pass(
    policy: Policy,
    config: TrainConfig,
    new: List[Dict[str, List[int]]],
    demonstrations: List[Dict[str, List[int]]],
    rng: np.random.Generator,
) -> Tuple[Any, List[Dict[str, List[int]]]]:
    """One pass of SFT on `policy` (in its trainer; `policy.model` is left as it was) over `new`
    examples and as many of `demonstrations` (drawn by `rng` without replacement), from
    `warm_start_dagger_learning_rate`: a DAgger round's training, or plain imitation's for the same
    steps. Returns the trained trainer and the examples it trained on."""
    replayed = rng.choice(len(demonstrations), size=min(len(new), len(demonstrations)), replace=False)
    examples = new + [demonstrations[i] for i in replayed]
    with tempfile.TemporaryDirectory(prefix="continuation-") as work:
        trainer = sft_trainer(
            policy, config, examples, work, epochs=1.0, learning_rate=config.warm_start_dagger_learning_rate
        )
        trainer.train()
    return trainer, examples


def dagger_rounds(policy: Any, config: TrainConfig, demonstrations: List[Dict[str, List[int]]]) -> List[Dict[str, Any]]:
    """`config.warm_start_dagger_rounds` rounds of DAgger on `policy` (trained in place), each on the
    learner's labelled decisions and as many of `demonstrations` (drawn without replacement, with
    the run's seed); returns each round's stats with its SFT steps and losses."""
    rng = np.random.default_rng(config.seed)
    reports = []
    for round_index in range(config.warm_start_dagger_rounds):
        first_seed = DAGGER_SEED + round_index * config.warm_start_dagger_episodes
        labelled, stats = labelled_learner_decisions(policy, config, config.warm_start_dagger_episodes, first_seed)
        trainer, examples = continuation_pass(policy, config, labelled, demonstrations, rng)
        policy.model = trainer.model
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        stats.update(round=round_index, examples=len(examples), steps=trainer.state.global_step, losses=losses)
        logger.info(
            "DAgger round %d: the learner agreed with the demonstrator on %.0f%% of %d decisions "
            "(%.0f%% refused, %.0f%% of its campaigns won); trained %d steps on %d examples",
            round_index + 1,
            100 * stats["agreement"],
            stats["decisions"],
            100 * stats["refused"],
            100 * stats["success"],
            trainer.state.global_step,
            len(examples),
        )
        reports.append(stats)
    return reports


def _save_atomically(policy: Policy, report: Dict[str, Any], target: Path) -> None:
    """The model, its tokenizer and the report in `target`, whole or not at all (a concurrent
    build of the same warm start wins or loses whole)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(target)
    policy.model.save_pretrained(staging)
    policy.tokenizer.save_pretrained(staging)
    (staging / "warm_start.json").write_text(json.dumps(report, indent=1) + "\n")
    try:
        share_folder(staging)
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: Optional[List[str]] = None) -> int:
    """`python -m lib.training.warm_start [--field value ...] [--evaluate DIR]`: build the warm start
    of a config (the default: the CPU stand-in's) in this one process, or find it cached, and print
    its folder. A run in several processes needs it built first: a Trainer in the main process alone
    falls out of step with the other processes' collectives. With `--evaluate DIR`, then play the
    configuration's evaluation split greedily (`eval_split`, `eval_episodes`: the held-out suite, or
    the validation split where the warm start's size is chosen) and write the episodes to
    `DIR/pre_eval.jsonl.gz`: an imitation-only policy as `python -m lib.report.seed_runs --sft DIR` reads it."""
    from lib.training.backends import load_policy
    from lib.training.cli import parse_train_config, train_config_parser

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = train_config_parser("python -m lib.training.warm_start", description=main.__doc__)
    parser.add_argument(
        "--evaluate",
        metavar="DIR",
        default=None,
        help="then play the evaluation split (eval_split, eval_episodes) greedily into DIR/pre_eval.jsonl.gz",
    )
    config, extra = parse_train_config(argv, parser)
    if not config.warm_start_episodes:
        raise SystemExit("warm_start_episodes is 0: there is no warm start to build")
    policy = load_policy(config, "trl")
    report = sft_warm_start(policy, config)
    print(report.get("cached") or "built (not cached: a LoRA warm start is trained with its run)", flush=True)
    if extra.evaluate:
        print(evaluate_warm_start(policy, config, Path(extra.evaluate)), flush=True)
    return 0


def evaluate_warm_start(policy: Policy, config: TrainConfig, folder: Path) -> str:
    """Play `config`'s evaluation split greedily with `policy` (a warm start), write the episodes to
    `folder/pre_eval.jsonl.gz` and say in a line how many succeeded and the mean reward."""
    from lib.episodes.records import save_episodes_jsonl
    from lib.measure.comparison import summarise_episodes
    from lib.report.evidence_logs import EvidencePaths
    from lib.training.grpo import evaluation_suite
    from lib.training.policy_evaluation import evaluate_policy, split_name

    paths = EvidencePaths(folder)
    paths.ensure()
    episodes = evaluate_policy(
        policy.model, policy.tokenizer, evaluation_suite(config), config, agent_name="warm_start"
    )
    save_episodes_jsonl(episodes, str(paths.pre_eval_jsonl))
    summary = summarise_episodes(episodes)
    return (
        f"{split_name(config)} evaluation: {summary['n_correct']} of {summary['n']} correct, "
        f"mean reward {summary['mean_reward'] or 0.0:+.3f}; episodes in {paths.pre_eval_jsonl}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
