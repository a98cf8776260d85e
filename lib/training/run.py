"""`train(config)`: the whole GRPO run, the same from `make train`, notebook 03 and tests.

1. Load the policy for the backend (`lib.training.backends`); with `warm_start_episodes`,
   fine-tune it on heuristic campaigns first (`lib.training.warm_start`).
2. Evaluate it on the held-out suite, greedily: evidence/pre_eval.jsonl.gz (the checkpoint
   row of step 0 is the checkpoint subset of these episodes).
3. GRPO (`lib.training.grpo`) with `EvidenceCallback` logging and checkpoint evaluations.
4. Save the final model; evaluate it on the same suite: evidence/post_eval.jsonl.gz (the
   checkpoint row of the last step is the checkpoint subset of these episodes).
5. Render every artifact: before_after_metrics.json, plots, sample_trajectories.md.

Under `accelerate launch` (`make train NPROC=2`) every process runs this function: each plays
its share of the episodes and the main process writes every file (`lib.training.processes`).

Before any of it, the evidence and output folders are checked (folders, writable) and locked
(`lib.files.FolderLock`): a second run on a folder a live run holds is refused, naming that
run (pid, host, start time); the lock of a run that died is taken over. A fresh run then moves
the previous run's evidence files (not baselines.*) to `<output_dir>/previous_evidence/<UTC
time>/` (`lib.training.resume`), so logs of two runs never mix and nothing is deleted. A resumed run keeps them, minus
rows logged after the checkpoint it resumes (and the last step's checkpoint row, which it
writes again from its own post-training evaluation). A run stopped by a full disk (a
checkpoint, a log) says so (`lib.files.DiskFullError`), whatever the library that failed. The
run's state is kept in `<output_dir>/run_state.json` (`lib.training.run_state`): a run stopped
by SIGTERM, Ctrl-C or an error, or killed, is named by the next run in the folder and by
`make report`, with the checkpoint it can resume from.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from cernenv.scenarios import list_scenarios
from lib.episodes.records import load_episodes_jsonl, save_episodes_jsonl
from lib.files import DiskFullError, FolderLock, check_writable_dir, disk_full_error, is_disk_full, share_folder
from lib.measure.comparison import before_after_metrics
from lib.report.evidence import EvidencePaths, render_all
from lib.runtime import warm_start_estimate
from lib.training.backends import OPTIMISER_ARGS, load_policy, precision_flags, resolve_backend
from lib.training.callbacks import CpuThreads, EvidenceCallback, trainer_progress
from lib.training.config import TINY_MODEL, TrainConfig
from lib.training.grpo import REWARD_FUNCS, CampaignRollout, checkpoint_suite, evaluation_suite, training_dataset
from lib.training.policy_evaluation import evaluate_policy, split_name
from lib.training.processes import is_main_process, main_process_first, num_processes, wait_for_everyone
from lib.training.publish import push_to_hub, save_merged
from lib.training.resume import archive_previous_evidence, drop_rows_after, logged_seconds, resolve_resume
from lib.training.run_state import RunState, unfinished_run
from lib.training.trainer_class import grpo_trainer_class
from lib.training.warm_start import cached_warm_start_dir, sft_warm_start

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run produced and how long its parts took [s]."""

    config: Dict[str, Any]
    backend: str
    model_name: str
    final_model_dir: str
    evidence: Dict[str, Optional[str]]
    before_after: Dict[str, Any]
    seconds: Dict[str, float] = field(default_factory=dict)
    merged_model_dir: Optional[str] = None
    published: Optional[Dict[str, Any]] = None
    """What `push_to_hub` sent (or, in a dry run, would send)."""
    checkpoint_evals: List[Dict[str, Any]] = field(default_factory=list)
    warm_start: Optional[Dict[str, Any]] = None
    """What the SFT warm start did (`lib.training.warm_start.sft_warm_start`), if it ran."""


def task_key(seed: int, scenario: Optional[str], difficulty: Optional[str]) -> tuple:
    """One task, however it is written: a spec (scenario None for a procedural task, difficulty
    None for a curated one) or a record (scenario "procedural_<difficulty>", the curated
    scenario's difficulty)."""
    if scenario in list_scenarios():
        return seed, scenario, None
    return seed, None, difficulty


def grpo_args(config: TrainConfig, **overrides: Any):
    """TRL's `GRPOConfig` for `config` (generation is ours: `rollout_func`). With several
    processes each accumulates `gradient_accumulation_steps / num_processes` passes, so that a
    step still trains on `config.episodes_per_step` episodes."""
    from trl import GRPOConfig

    cuda = torch.cuda.is_available()
    values = dict(
        output_dir=config.output_dir,
        max_steps=config.max_steps,
        num_generations=config.num_generations,
        # a pass trains per_device_train_batch_size episodes: each of them is samples_per_episode samples
        per_device_train_batch_size=config.per_device_train_batch_size * config.samples_per_episode,
        gradient_accumulation_steps=accumulation_per_process(config, num_processes()),
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant_with_warmup" if config.lr_schedule == "constant" else config.lr_schedule,
        warmup_steps=0,
        beta=config.beta,
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        entropy_coef=config.entropy_coef,
        use_adaptive_entropy=config.use_adaptive_entropy,
        entropy_target=config.entropy_target,
        top_entropy_quantile=config.top_entropy_quantile,
        scale_rewards=config.scale_rewards,
        # TRL divides logits by this temperature when it scores completions: it must be the sampling one.
        temperature=config.temperature,
        top_p=config.top_p,
        max_completion_length=config.max_new_tokens if config.use_vllm else config.max_seq_length,
        max_grad_norm=config.max_grad_norm,
        logging_steps=config.logging_steps,
        save_strategy="steps",
        save_steps=config.save_steps,
        seed=config.seed,
        data_seed=config.seed,
        shuffle_dataset=False,
        report_to=list(config.report_to) or "none",
        use_cpu=not cuda,
        **precision_flags(),
        **OPTIMISER_ARGS,
        # TRL turns activation recomputation on by default: it saves GPU memory; on a CPU it only
        # costs a second forward pass per step for the stand-in (its activations fit in memory many
        # times over), but a LoRA adapter's real model needs it there too: SmolLM2-135M-Instruct's GRPO
        # pass of 4 whole campaigns without it outgrew a 24 GB machine (killed at 24.3 GB resident)
        gradient_checkpointing=(cuda or config.lora_r > 0)
        if config.gradient_checkpointing is None
        else config.gradient_checkpointing,
        use_vllm=config.use_vllm,
        disable_tqdm=True,
        # several processes (DDP): every trainable weight takes part in each forward pass, so DDP
        # need not search the graph for unused ones (it warned that the search found none)
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )
    if config.use_vllm:
        values.update(vllm_mode="colocate")
    values.update(overrides)
    args = GRPOConfig(**values)
    clip = (config.epsilon, config.epsilon_high)
    if clip != (TrainConfig.epsilon, TrainConfig.epsilon_high) and samples_trained_once(args):
        logger.warning(
            "epsilon=%s, epsilon_high=%s change nothing here: each sample is trained once, by the policy that "
            "generated it, so its probability ratio is 1 and the clip never binds (TRL scores no old policy "
            "unless num_iterations > 1 or steps_per_generation > gradient_accumulation_steps)",
            config.epsilon,
            config.epsilon_high,
        )
    return args


def samples_trained_once(args: Any) -> bool:
    """Whether TRL trains every generated sample once, by the policy that generated it (`GRPOConfig`
    `args`): then it scores no old policy, the probability ratio of PPO's clipped objective is 1, and
    `epsilon` / `epsilon_high` (DAPO's clip-higher) cannot bind. TRL scores one where a generation
    serves several optimiser steps (`steps_per_generation` × `num_iterations` not dividing
    `gradient_accumulation_steps`) or with vLLM's importance-sampling correction."""
    generate_every = args.steps_per_generation * args.num_iterations
    return args.gradient_accumulation_steps % generate_every == 0 and not (
        args.use_vllm and getattr(args, "vllm_importance_sampling_correction", False)
    )


def accumulation_per_process(config: TrainConfig, processes: int) -> int:
    """`config.gradient_accumulation_steps` shared among `processes` (an error if it does not divide)."""
    if config.gradient_accumulation_steps % processes:
        raise ValueError(
            f"gradient_accumulation_steps ({config.gradient_accumulation_steps}) must be a multiple of "
            f"the number of processes ({processes}): each process plays an equal share of a step's "
            f"{config.episodes_per_step} episodes; change one of them"
        )
    return config.gradient_accumulation_steps // processes


def output_folders(config: TrainConfig) -> Dict[Path, str]:
    """The folders a run writes, each with what it is for (one entry when they are the same)."""
    folders: Dict[Path, str] = {}
    for path, what in ((config.evidence_dir, "evidence folder"), (config.output_dir, "output folder")):
        folders.setdefault(Path(path).resolve(), what)
    return folders


def check_run_outputs(config: TrainConfig) -> None:
    """What a run needs to write its results, checked before any expensive work: its folders
    (not files, writable: `lib.files.check_writable_dir`) and the experiment trackers it
    reports to (TensorBoard's writer installed)."""
    for folder, what in output_folders(config).items():
        check_writable_dir(folder, what)
    trackers = [name for name in config.report_to if name != "none"]
    if "tensorboard" in trackers and not any(
        importlib.util.find_spec(name) for name in ("tensorboard", "tensorboardX")
    ):
        raise ModuleNotFoundError(
            "report_to includes tensorboard, which is not installed: pip install tensorboard "
            "(requirements.txt has it), or train with --report_to none"
        )


def train(config: TrainConfig, pre_eval: Optional[List[Dict[str, Any]]] = None) -> TrainResult:
    """Run `config` end to end (see the module docstring); returns the measured result. `pre_eval`:
    the warm start's evaluation on `evaluation_suite(config)` made before, which the run takes as
    its evaluation before training instead of playing it again.

    The main process checks and locks the output folders first (`check_run_outputs`,
    `lib.files.FolderLock`) and holds them until the run ends, however it ends; it says how the
    folder's last run ended where it did not finish, and keeps this run's state in the output
    folder (`lib.training.run_state`: a run stopped by SIGTERM says where)."""
    if pre_eval is not None:
        check_pre_eval(config, pre_eval)
    check_run_outputs(config)
    with contextlib.ExitStack() as locks:
        state = None
        if is_main_process():
            for folder, what in output_folders(config).items():
                locks.enter_context(FolderLock(folder, what))
            previous = unfinished_run(config.output_dir)
            if previous:
                logger.warning(
                    "%s. This run %s",
                    previous,
                    f"resumes from {config.resume_from_checkpoint}"
                    if config.resume_from_checkpoint
                    else "starts afresh (the folder's evidence is kept aside)",
                )
            state = locks.enter_context(RunState(config.output_dir))
        try:
            return _train(config, state, pre_eval)
        except Exception as error:
            if isinstance(error, DiskFullError):
                raise
            full = next((f for f in output_folders(config) if is_disk_full(error, f)), None)
            if full is not None:
                raise disk_full_error(full, error) from error
            raise


def check_pre_eval(config: TrainConfig, pre_eval: List[Dict[str, Any]]) -> None:
    """A ValueError unless `pre_eval` played the seeds of `evaluation_suite(config)`, in its order."""
    played, wanted = [e.get("seed") for e in pre_eval], [spec.seed for spec in evaluation_suite(config)]
    if played != wanted:
        raise ValueError(
            f"pre_eval plays {len(played)} campaigns, not the {len(wanted)} seeds of the evaluation suite in "
            "their order: hand train() the warm start's evaluation on evaluation_suite(config), or none to play it"
        )


def adapter_policy(policy: Any, adapter: str) -> Any:
    """`policy` with the LoRA adapter saved in `adapter` over its model, trainable (the trainer is then
    given no `peft_config`: it trains this adapter)."""
    from peft import PeftModel

    if not (Path(adapter) / "adapter_config.json").is_file():
        raise FileNotFoundError(f"warm_start_adapter {adapter} holds no adapter_config.json: name an adapter's folder")
    policy.model = PeftModel.from_pretrained(policy.model, adapter, is_trainable=True)
    policy.peft_config = None
    return policy


def reload_warm_start_for_reference(policy: Any, config: TrainConfig, output_dir: Path) -> None:
    """A resumed run of every weight with a warm start and a KL penalty: TRL loads its KL
    reference by the model's name, which must be the warm start the run began from (saved in
    `<output_dir>/warm_start/`), not the untrained model `load_policy` named; the trainer then
    loads the checkpoint's weights over it."""
    if not (config.warm_start_episodes and config.beta and policy.peft_config is None):
        return
    saved = Path(output_dir) / "warm_start"
    if not (saved / "config.json").is_file():
        raise FileNotFoundError(
            f"{saved} holds no warm start: a resumed run with beta={config.beta} needs the one its run began "
            "from as the KL reference; resume in the run's own output_dir, or start the run again"
        )
    from transformers import AutoModelForCausalLM

    policy.model = AutoModelForCausalLM.from_pretrained(saved).to(policy.model.device)


def _train(
    config: TrainConfig, state: Optional[RunState] = None, pre_eval: Optional[List[Dict[str, Any]]] = None
) -> TrainResult:
    seconds: Dict[str, float] = {}
    phase = state.phase if state is not None else lambda text: None
    start = time.perf_counter()
    backend = resolve_backend(config)  # imports unsloth (when used) before trl

    accumulation_per_process(config, num_processes())  # fails before anything is loaded or moved
    resume = resolve_resume(config)
    output_dir = Path(config.output_dir)
    paths = EvidencePaths(Path(config.evidence_dir))
    main = is_main_process()
    with main_process_first():  # a model fetched or built on first use (a Hub download) is fetched once
        policy = load_policy(config, backend)
    if config.warm_start_adapter is not None:  # a warm start made before: GRPO trains its adapter
        policy = adapter_policy(policy, config.warm_start_adapter)
    seconds["load"] = time.perf_counter() - start
    warm_start = bool(config.warm_start_episodes) and resume is None  # a resumed run's checkpoint holds it
    if warm_start and policy.model_name == TINY_MODEL and main:
        logger.warning(
            "no GPU model: the CPU stand-in %s trains, warm-started first on %d campaigns (%s) unless .cache/ "
            "holds that warm start already",
            TINY_MODEL,
            config.warm_start_episodes,
            warm_start_estimate(config.warm_start_episodes, config.warm_start_epochs, config.warm_start_batch_size),
        )
    if warm_start and num_processes() > 1 and policy.peft_config is None:
        cached = cached_warm_start_dir(policy, config)
        if not (cached / "warm_start.json").is_file():
            raise RuntimeError(
                f"the warm start of every weight is not built yet ({cached}), and it must be built in one "
                "process (its Trainer in the main process alone falls out of step with the others' "
                "collectives): run `python -m lib.training.warm_start` with this run's flags once (it is "
                "cached), then launch again"
            )
    phase("preparing the folders")  # the run's state is written from here, with its first files
    if main:
        if resume is None:
            archive_previous_evidence(paths, output_dir)
        paths.ensure()
        config.save(output_dir / "train_config.json")
    wait_for_everyone()

    warm = None
    if resume is not None:
        reload_warm_start_for_reference(policy, config, output_dir)
    if warm_start:
        phase("the SFT warm start")
        t = time.perf_counter()
        with trainer_progress("SFT warm start"):
            warm = sft_warm_start(policy, config)
        if main:
            policy.model.save_pretrained(str(output_dir / "warm_start"))
            policy.tokenizer.save_pretrained(str(output_dir / "warm_start"))
            share_folder(output_dir / "warm_start")  # playable by make evaluate's agent user too
        seconds["warm_start"] = time.perf_counter() - t
        logger.info(
            "SFT warm start: %d campaigns (%d examples), %d steps, loss %.3f -> %.3f%s",
            warm["episodes"],
            warm.get("examples", warm["episodes"]),
            warm["steps"],
            warm["first_loss"] or float("nan"),
            warm["last_loss"] or float("nan"),
            " (loaded from its cache)" if warm.get("loaded") else "",
        )
    tokenizer = policy.tokenizer
    eval_specs, checkpoint_specs = evaluation_suite(config), checkpoint_suite(config)

    t = time.perf_counter()
    if pre_eval is not None:
        pre = pre_eval
        if main:
            save_episodes_jsonl(pre, str(paths.pre_eval_jsonl))
    elif resume is not None and paths.pre_eval_jsonl.exists():
        pre = load_episodes_jsonl(str(paths.pre_eval_jsonl))
    else:
        phase(f"the {split_name(config)} evaluation before training")
        pre = evaluate_policy(policy.model, tokenizer, eval_specs, config, agent_name="pre", backend=backend)
        if main:
            save_episodes_jsonl(pre, str(paths.pre_eval_jsonl))
    seconds["pre_eval"] = time.perf_counter() - t

    def evaluate_checkpoint(model: Any) -> List[Dict[str, Any]]:
        return evaluate_policy(model, tokenizer, checkpoint_specs, config, agent_name="checkpoint", backend=backend)

    def checkpoint_subset(episodes: List[Dict[str, Any]]) -> Optional[List[Dict[str, Any]]]:
        """The checkpoint episodes out of a full evaluation (same policy, greedy, same tasks), if it has them."""
        by_key = {task_key(e["seed"], e.get("scenario"), e.get("difficulty")): e for e in episodes}
        keys = [task_key(s.seed, s.scenario, s.difficulty) for s in checkpoint_specs]
        return [by_key[k] for k in keys] if all(k in by_key for k in keys) else None

    resumed_step = None if resume is None else int(Path(resume).name.rsplit("-", 1)[-1])
    seconds_before = 0.0 if resumed_step is None else logged_seconds(paths.training_log_csv, resumed_step)
    callback = EvidenceCallback(
        paths,
        elapsed_s=seconds_before,
        eval_every_steps=config.eval_every_steps,
        evaluate=evaluate_checkpoint,
        max_steps=config.max_steps,
        final_from_post_eval=bool(config.eval_every_steps),
        write=main,
    )
    if resume is None:  # step 0: the initial policy, from the pre-evaluation when it covers the subset
        callback.record_checkpoint(0, policy.model, episodes=checkpoint_subset(pre))
    elif main:
        for name in ("training_log_csv", "reward_components_csv", "checkpoint_evals_csv"):
            drop_rows_after(getattr(paths, name), resumed_step)
    wait_for_everyone()  # the logs are cut before any process appends to them

    rollout = CampaignRollout(config, tokenizer, evidence_dir=paths.root if main else None, backend=backend)
    with trainer_progress("GRPO"):  # a bar over the steps and a line of metrics per step (lib.progress)
        trainer_class = grpo_trainer_class(config, backend)
        trainer = trainer_class(
            model=policy.model,
            reward_funcs=REWARD_FUNCS,
            args=grpo_args(config),
            train_dataset=training_dataset(config),
            processing_class=tokenizer,
            peft_config=policy.peft_config,
            rollout_func=rollout,
            callbacks=[callback, CpuThreads()],
        )
    phase("GRPO")
    if state is not None:
        state.step = lambda: f"step {trainer.state.global_step + 1} of {config.max_steps}"
    t = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    seconds["grpo"] = seconds_before + time.perf_counter() - t  # a resumed run's steps before it included
    seconds["checkpoint_evals"] = callback.eval_seconds
    final_dir = output_dir / "final"
    trainer.save_model(str(final_dir))  # the Trainer writes from the main process only
    if main:
        tokenizer.save_pretrained(str(final_dir))
        share_folder(final_dir)  # safetensors writes 0600: make evaluate's agent user must read it

    phase(f"the {split_name(config)} evaluation after training")
    t = time.perf_counter()
    post = evaluate_policy(trainer.model, tokenizer, eval_specs, config, agent_name="post", backend=backend)
    if main:
        save_episodes_jsonl(post, str(paths.post_eval_jsonl))
    seconds["post_eval"] = time.perf_counter() - t
    if callback.final_from_post_eval:  # the last step's checkpoint row, from the post-training evaluation
        t = time.perf_counter()
        if main:  # a resumed run may hold it already (resumed from the last checkpoint, or killed after the row)
            drop_rows_after(paths.checkpoint_evals_csv, trainer.state.global_step - 1)
        callback.record_checkpoint(
            trainer.state.global_step, trainer.model, max_steps=config.max_steps, episodes=checkpoint_subset(post)
        )
        seconds["checkpoint_evals"] += time.perf_counter() - t
    merged_dir = published = None
    rendered: Dict[str, Any] = {}
    if main:
        merged_dir = save_merged(trainer.model, tokenizer, output_dir / "merged") if config.save_merged else None
        published = (
            push_to_hub(
                merged_dir or final_dir, config.hub_repo_id, dry_run=config.hub_dry_run, base_model=policy.model_name
            )
            if config.hub_repo_id
            else None
        )
        rendered = render_all(paths)
    wait_for_everyone()
    seconds["total"] = time.perf_counter() - start
    return TrainResult(
        config=config.to_dict(),
        backend=backend,
        model_name=policy.model_name,
        final_model_dir=str(final_dir),
        evidence={k: (str(v) if v else None) for k, v in rendered.items()},
        before_after=before_after_metrics(pre, post),
        seconds=seconds,
        checkpoint_evals=callback.checkpoint_results,
        merged_model_dir=str(merged_dir) if merged_dir else None,
        published=published,
        warm_start=warm,
    )
