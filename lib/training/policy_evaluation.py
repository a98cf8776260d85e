"""A policy played on an evaluation split: greedy (or sampled) episodes of a model on the held-out
suite or the validation split, as a training run's evaluations, a warm start's `--evaluate` and the
benchmarks play them."""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from lib.agents.prompting import Sampling
from lib.episodes.generation import hf_generate_fn
from lib.episodes.llm_rollouts import play_episodes
from lib.episodes.records import EpisodeSpec
from lib.measure.evaluation import PUBLISHED_KEY
from lib.runtime import pinned_threads, use_cpu_threads
from lib.training.config import TrainConfig
from lib.training.processes import gather, is_main_process, shard


def split_name(config: TrainConfig) -> str:
    """What a run's evaluations play, as its progress lines say it: "held-out" or "validation"."""
    return "validation" if config.eval_split == "validation" else "held-out"


@contextlib.contextmanager
def adapter_merged(model: Any) -> Iterator[Any]:
    """`model` while it plays: on a CPU, a LoRA adapter merged into the weights it adapts for the block
    and taken out after (PEFT's `merge_adapter` and `unmerge_adapter`, as TRL hands a LoRA policy's
    weights to vLLM), so each adapted layer is one matrix product instead of three; the weights come
    back to within float rounding. On a GPU, and for a model without an adapter, `model` as it is."""
    if torch.cuda.is_available() or not hasattr(model, "merge_adapter") or not getattr(model, "peft_config", None):
        yield model
        return
    model.merge_adapter()
    try:
        yield model
    finally:
        model.unmerge_adapter()


def evaluate_policy(
    model: Any,
    tokenizer: Any,
    specs: Sequence[EpisodeSpec],
    config: TrainConfig,
    *,
    agent_name: str,
    backend: str = "trl",
    sampling: Optional[Sampling] = None,
    seed: Optional[int] = None,
    progress_note: str = "",
    show_progress: bool = True,
) -> List[Dict[str, Any]]:
    """Greedy episodes of `model` on `specs` (records as dicts, as the evidence files hold them),
    in the order of `specs`, drawn with the published evaluation key (`lib.measure.evaluation.PUBLISHED_KEY`:
    the project's own evidence, which a fresh clone replays). With several processes each plays
    its shard and every process gets all the records. It plays `adapter_merged` (an adapter merged, on a
    CPU). `sampling` and `seed` (default: the configuration's evaluation sampling and its seed) play
    sampled episodes instead. `progress_note` is added to the progress line's label; `show_progress`
    False plays without one. On a CPU, torch's threads are first set to the cores free now
    (`lib.runtime.use_cpu_threads`)."""
    if not torch.cuda.is_available() and pinned_threads() is None:
        use_cpu_threads()
    generate = hf_generate_fn(model, tokenizer, config.generation_engine, unsloth=backend == "unsloth")
    key = PUBLISHED_KEY
    with adapter_merged(model):
        played = play_episodes(
            generate,
            tokenizer,
            shard(specs),
            sampling=sampling or config.evaluation_sampling,
            context=config.policy_context,
            observation_config=config.observation_config,
            max_turns=config.max_turns,
            max_context_tokens=config.max_seq_length,
            batch_size=config.eval_batch_size,
            agent_name=agent_name,
            seed=config.seed if seed is None else seed,
            make_env=key.make_env,
            progress=f"{split_name(config)} evaluation ({agent_name}){progress_note}"
            if is_main_process() and show_progress
            else None,
        )
    return gather([{**episode.record.to_dict(), "evaluation_key": key.record_fields()} for episode in played])
