"""A language model plays whole campaigns, in token space, in one of two contexts (`CONTEXTS`).

This is how the policy is both trained (GRPO's `rollout_func`) and evaluated.

`conversation`: the episode is a single growing chat (`lib.episodes.chat`), system prompt and
first observation, then the model's action, the environment's next observation, the model's
next action, and so on:

    prompt_ids     = template([system, user(obs_0)], add_generation_prompt=True)
    completion_ids = action_0 <eos> | env: next turn's header, user(obs_1), assistant header | action_1 <eos> | ...
    env_mask       =    1 ... 1     |                           0 ... 0                      |    1 ... 1    | ...

`turn`: each action is decided from a fresh chat of the current observation alone
(`lib.agents.prompting.build_chat`: the task, the state, the recent history, the last result
and the logbook's numbers), so a context stays a few hundred tokens however long the campaign;
each turn is kept as its own (prompt, reply) pair (`PlayedEpisode.turns`).

Every action is generated from exactly the token sequence the trainer later scores, so the
log-probabilities GRPO optimises are those the actions were sampled from. Environment text is
tokenised once, here, and never in the loss. A batch of episodes is played in lockstep, turn
by turn, through a `GenerateFn` (`lib.episodes.generation`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from cernenv import CERNCollisionEnvironment, CollisionObservation
from lib.agents.prompting import LLMAgentConfig, ReplyScope, Sampling, build_chat, parse_reply
from lib.episodes.agent_rollouts import episode_record, step_record
from lib.episodes.chat import ChatLayout
from lib.episodes.generation import GenerateFn
from lib.episodes.records import EpisodeRecord, StepRecord, spec_fields
from lib.progress import Progress

CONTEXTS = ("conversation", "turn")
"""What the policy reads before each action: the whole campaign as one chat, or the current
observation alone (see the module's docstring)."""


@dataclass
class PlayedTurn:
    """One decision of an episode played in the `turn` context: the chat it read, and its reply."""

    prompt_ids: List[int]
    completion_ids: List[int]
    logprobs: List[float]
    """Sampling log-probability of each reply token."""


@dataclass
class PlayedEpisode:
    """One episode as the trainer sees it (token ids and masks) and as evaluation records it.

    In the `conversation` context, `prompt_ids` + `completion_ids` is the whole campaign and
    `env_mask` tells the model's tokens from the environment's. In the `turn` context each
    decision is one of `turns`; `prompt_ids` is the first one's prompt and `completion_ids` the
    replies one after another (all the model's, `env_mask` all 1): what the episode wrote."""

    prompt_ids: List[int]
    completion_ids: List[int] = field(default_factory=list)
    env_mask: List[int] = field(default_factory=list)
    """1 for a token the model generated, 0 for environment text."""
    logprobs: List[float] = field(default_factory=list)
    """Sampling log-probability of each completion token (0.0 for environment tokens)."""
    record: Optional[EpisodeRecord] = None
    truncated: bool = False
    """True when the episode stopped before the environment ended it (`max_turns` or context length)."""
    turns: List[PlayedTurn] = field(default_factory=list)
    """Each decision's prompt and reply (`turn` context only)."""
    shown: List[ReplyScope] = field(default_factory=list)
    """Before each reply, in order, the references its observation showed and the options its task
    offered: what a reply held to the grammar could name, so which of its tokens the grammar forced
    (`lib.episodes.grammar.train_chosen_tokens_only`)."""

    @property
    def n_model_tokens(self) -> int:
        return sum(self.env_mask)


def play_episodes(
    generate_fn: GenerateFn,
    tokenizer: Any,
    specs: Sequence[Any],
    *,
    sampling: Sampling,
    context: str = "conversation",
    max_turns: Optional[int] = None,
    max_context_tokens: Optional[int] = None,
    make_env: Callable[[], CERNCollisionEnvironment] = CERNCollisionEnvironment,
    observation_config: LLMAgentConfig = LLMAgentConfig(),
    agent_name: str = "LLM",
    batch_size: int = 32,
    seed: int = 0,
    progress: Optional[str] = None,
) -> List[PlayedEpisode]:
    """Play one episode per spec (`lib.episodes.records.EpisodeSpec`, mapping or tuple), in
    lockstep batches of `batch_size`; returns them in the order of `specs`. `progress`: a
    label under which the episodes played so far are logged (`lib.progress`). `sampling` has no
    default: a run takes it from its configuration (`TrainConfig.sampling` for training rollouts,
    `TrainConfig.evaluation_sampling` for evaluations), so no caller plays at a temperature it did
    not choose. `context` is one of `CONTEXTS`; a run takes it from `TrainConfig.policy_context`,
    and the prompt's form from `TrainConfig.observation_config`.

    `max_turns` (default: the environment's step limit) and `max_context_tokens` stop an
    episode early, marked `truncated`; it then gets no terminal grade. Sampling draws
    from torch's generator seeded with `seed` + batch index, so a call is reproducible.
    """
    if context not in CONTEXTS:
        raise ValueError(f"context must be one of {CONTEXTS}, got {context!r}")
    layout = ChatLayout(tokenizer, observation_config)
    specs = [spec_fields(s) for s in specs]
    played: List[PlayedEpisode] = []
    counter = Progress(progress, len(specs), unit="episode") if progress else None
    for index in range(0, len(specs), batch_size):
        torch.manual_seed(seed + index)
        on_turn = None
        if counter is not None:  # a batch of long campaigns takes minutes: its episodes are counted as they end

            def on_turn(finished: int, turn: int, before: int = len(played)) -> None:
                counter.set_postfix(f"turn {turn}")
                counter.update(before + finished)

        played.extend(
            _play_batch(
                generate_fn,
                layout,
                specs[index : index + batch_size],
                sampling=sampling,
                per_turn=context == "turn",
                max_turns=max_turns,
                max_context_tokens=max_context_tokens,
                make_env=make_env,
                agent_name=agent_name,
                on_turn=on_turn,
            )
        )
        if counter is not None:
            counter.update(len(played))
    return played


def _play_batch(
    generate_fn: GenerateFn,
    layout: ChatLayout,
    specs: List[Dict[str, Any]],
    *,
    sampling: Sampling,
    per_turn: bool,
    max_turns: Optional[int],
    max_context_tokens: Optional[int],
    make_env: Callable[[], CERNCollisionEnvironment],
    agent_name: str,
    on_turn: Optional[Callable[[int, int], None]] = None,
) -> List[PlayedEpisode]:
    """One lockstep batch; `on_turn(finished, turn)` after each turn: the episodes of the batch ended so
    far and the turns played."""
    envs = [make_env() for _ in specs]
    observations = [env.reset(**spec) for env, spec in zip(envs, specs)]
    turn_limit = min(max_turns or envs[0].max_steps, envs[0].max_steps)
    messages = [layout.first_messages(obs) for obs in observations]
    episodes = [PlayedEpisode(prompt_ids=layout.prompt_ids(m)) for m in messages]
    steps: List[List[StepRecord]] = [[] for _ in specs]
    last_obs: List[CollisionObservation] = list(observations)
    contexts = [list(episode.prompt_ids) for episode in episodes]  # what each next action is generated from
    active = list(range(len(specs)))
    for _turn in range(turn_limit):
        if max_context_tokens is not None:
            for i in [i for i in active if len(contexts[i]) + sampling.max_new_tokens > max_context_tokens]:
                episodes[i].truncated = True
                active.remove(i)
        if not active:
            break
        scopes = [ReplyScope.of(last_obs[i]) for i in active]
        shown = {"shown": scopes} if sampling.constrained else {}
        outputs = generate_fn([contexts[i] for i in active], sampling, **shown)
        still_active = []
        for i, scope, (tokens, logprobs) in zip(active, scopes, outputs):
            episode, obs = episodes[i], last_obs[i]
            ended = bool(tokens) and tokens[-1] == layout.tokenizer.eos_token_id
            text = layout.tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=True)
            episode.shown.append(scope)
            if per_turn:
                episode.turns.append(PlayedTurn(contexts[i], list(tokens), list(logprobs)))
            episode.completion_ids += tokens
            episode.env_mask += [1] * len(tokens)
            episode.logprobs += logprobs
            parse = parse_reply(text, obs.references)
            next_obs = envs[i].step(parse.payload)
            steps[i].append(
                step_record(
                    obs,
                    parse.payload,
                    next_obs,
                    prompt=messages[i][-1]["content"],
                    completion=text,
                    parsed_ok=parse.ok,
                    parse_error=parse.error,
                )
            )
            last_obs[i] = next_obs
            if next_obs.done:
                continue
            if per_turn:
                messages[i] = build_chat(next_obs, layout.observation_config)
                contexts[i] = layout.prompt_ids(messages[i])
            else:
                messages[i].append({"role": "assistant", "content": text})
                env_ids = layout.environment_ids(messages[i], next_obs, reply_ended=ended)
                messages[i].append(layout.followup_message(next_obs, messages[i]))
                episode.completion_ids += env_ids
                episode.env_mask += [0] * len(env_ids)
                episode.logprobs += [0.0] * len(env_ids)
                contexts[i] = episode.prompt_ids + episode.completion_ids
            still_active.append(i)
        active = still_active
        if on_turn is not None:
            on_turn(len(specs) - len(active), _turn + 1)
    for i in active:
        episodes[i].truncated = True
    for i, (env, spec) in enumerate(zip(envs, specs)):
        _drop_trailing_environment_text(episodes[i])
        episodes[i].record = episode_record(
            env, seed=spec["seed"], steps=steps[i], last_obs=last_obs[i], agent_name=agent_name
        )
    return episodes


def _drop_trailing_environment_text(episode: PlayedEpisode) -> None:
    """A truncated episode ends on environment text the model never answered: cut it, so the
    completion ends with the model's last token."""
    while episode.env_mask and episode.env_mask[-1] == 0:
        episode.completion_ids.pop()
        episode.env_mask.pop()
        episode.logprobs.pop()
