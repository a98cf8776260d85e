"""A language model plays whole campaigns as one conversation, in token space.

This is how the policy is both trained (GRPO's `rollout_func`) and evaluated: the episode
is a single growing chat, system prompt and first observation, then the model's action,
the environment's next observation, the model's next action, and so on:

    prompt_ids     = template([system, user(obs_0)], add_generation_prompt=True)
    completion_ids = action_0 <eos> | env: next turn's header, user(obs_1), assistant header | action_1 <eos> | ...
    env_mask       =    1 ... 1     |                           0 ... 0                      |    1 ... 1    | ...

Every action is generated from exactly the token sequence the trainer later scores
(prompt_ids + completion_ids so far), so the log-probabilities GRPO optimises are those
the actions were sampled from. Environment text is tokenised once, here, and masked out
of the loss (`env_mask` = 0). A batch of episodes is played in lockstep, turn by turn,
through a `GenerateFn`: `BatchedGenerate` (the model's own `generate`, one call per turn for
all live episodes: the GPU engine) or `CachedGenerator` (keeps each episode's KV cache
between turns, so a turn costs the new tokens only: the CPU default).

The chat template decides the layout, so any chat model works (the project's tokenizer,
Qwen's ChatML): each environment segment is the template's text between the end of the
model's reply and the opening of its next turn, found by rendering the chat with and
without the new user message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from cernenv import CERNCollisionEnvironment, CollisionObservation
from lib.progress import Progress
from lib.prompting import SYSTEM_PROMPT, LLMAgentConfig, Sampling, parse_reply, render_observation
from lib.records import EpisodeRecord, StepRecord, spec_fields
from lib.rollouts import episode_record, step_record


@dataclass
class PlayedEpisode:
    """One episode as the trainer sees it (token ids and masks) and as evaluation records it."""

    prompt_ids: List[int]
    completion_ids: List[int] = field(default_factory=list)
    env_mask: List[int] = field(default_factory=list)
    """1 for a token the model generated, 0 for environment text."""
    logprobs: List[float] = field(default_factory=list)
    """Sampling log-probability of each completion token (0.0 for environment tokens)."""
    record: Optional[EpisodeRecord] = None
    truncated: bool = False
    """True when the episode stopped before the environment ended it (`max_turns` or context length)."""

    @property
    def n_model_tokens(self) -> int:
        return sum(self.env_mask)


def first_messages(obs: CollisionObservation, config: LLMAgentConfig = LLMAgentConfig()) -> List[Dict[str, str]]:
    """The conversation's opening: the system prompt and the whole first observation."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": render_observation(obs, config)}]


def followup_message(obs: CollisionObservation, config: LLMAgentConfig = LLMAgentConfig()) -> Dict[str, str]:
    """A later observation: what changed (resources, data, the last result) and the logbook's key
    numbers, without the task the first message stated, so a conversation grows by ~100 tokens a
    turn and the numbers a claim quotes are always in its last message."""
    return {"role": "user", "content": render_observation(obs, config, include_task=False)}


_PROBE = "\u2063probe-reply\u2063"
"""A reply no model writes, to find what the template puts after a reply."""


class ChatLayout:
    """Token segments of the conversation for one tokenizer's chat template."""

    def __init__(self, tokenizer: Any, observation_config: LLMAgentConfig = LLMAgentConfig()) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; multi-turn play needs one")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token: the model could not end its turn")
        self.tokenizer = tokenizer
        self.observation_config = observation_config
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id])

    def _render(self, messages: List[Dict[str, str]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _ids(self, text: str) -> List[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def first_messages(self, obs: CollisionObservation) -> List[Dict[str, str]]:
        return first_messages(obs, self.observation_config)

    def followup_message(self, obs: CollisionObservation) -> Dict[str, str]:
        return followup_message(obs, self.observation_config)

    def prompt_ids(self, messages: List[Dict[str, str]]) -> List[int]:
        return self._ids(self._render(messages, add_generation_prompt=True))

    def environment_ids(
        self, messages: List[Dict[str, str]], obs: CollisionObservation, *, reply_ended: bool
    ) -> List[int]:
        """Tokens between the model's last reply (the last message of `messages`) and its
        next turn: what the template closes the reply with (less the eos the model already
        wrote, when it did), the user message showing `obs`, and the next assistant header."""
        before = self._render(messages, add_generation_prompt=False)
        user = self.followup_message(obs)
        after = self._render(messages + [user], add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError(
                "the chat template re-renders earlier turns when a message is added; "
                "multi-turn token masks need a template that only appends"
            )
        probe = messages[:-1] + [{"role": "assistant", "content": _PROBE}]
        rendered = self._render(probe, add_generation_prompt=False)
        tail = rendered[rendered.rindex(_PROBE) + len(_PROBE) :]
        if reply_ended and tail.startswith(self.eos_text):
            tail = tail[len(self.eos_text) :]
        return self._ids(tail + after[len(before) :])


GenerateFn = Callable[[List[List[int]], Sampling], List[tuple[List[int], List[float]]]]
"""Batched generation: token contexts → per context (new token ids, their log-probabilities),
each stopped after the eos token (included) or at `max_new_tokens`."""


class CachedGenerator:
    """`GenerateFn` on a transformers causal LM (PEFT and Unsloth models too) that keeps each
    episode's KV cache between turns: a turn feeds only the tokens added since the last one
    (the environment's text), instead of re-reading the whole conversation.

    Each episode's new tokens are prefilled on their own (no padding); the reply is then
    decoded for all episodes at once, their caches stacked with left padding, one token
    per episode per forward pass, and split back afterwards. A context is matched to the
    cache whose tokens are its prefix; caches a call does not use (finished episodes) are
    dropped.
    """

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.eos_id = tokenizer.eos_token_id
        self._sessions: List[_Session] = []

    def _session_for(self, context: List[int]) -> "_Session":
        for session in self._sessions:
            n = len(session.tokens)
            if n <= len(context) and context[:n] == session.tokens:
                self._sessions.remove(session)
                return session
        from transformers import DynamicCache

        return _Session(tokens=[], cache=DynamicCache(config=self.model.config))

    def _prefill(self, session: "_Session", tokens: List[int], device: Any) -> torch.Tensor:
        out = self.model(input_ids=torch.tensor([tokens], device=device), past_key_values=session.cache, use_cache=True)
        session.cache = out.past_key_values
        session.tokens += tokens
        return out.logits[0, -1].float()

    @torch.no_grad()
    def __call__(self, contexts: List[List[int]], sampling: Sampling) -> List[tuple[List[int], List[float]]]:
        device = next(self.model.parameters()).device
        was_training, threads = self.model.training, torch.get_num_threads()
        self.model.eval()
        if device.type == "cpu":
            torch.set_num_threads(1)  # small sequential forwards: more threads only add synchronisation
        try:
            sessions = [self._session_for(context) for context in contexts]
            logits = torch.stack(
                [
                    self._prefill(session, context[len(session.tokens) :], device)
                    for session, context in zip(sessions, contexts)
                ]
            )
            replies = self._decode(sessions, logits, sampling, device)
        finally:
            self.model.train(was_training)
            torch.set_num_threads(threads)
        self._sessions = sessions
        return replies

    def _decode(
        self, sessions: List["_Session"], logits: torch.Tensor, sampling: Sampling, device: Any
    ) -> List[tuple[List[int], List[float]]]:
        """Decode one reply per session; leaves in each cache the reply's tokens but its last.
        A row leaves the batch as soon as its reply ends, taking its slice of the cache."""
        from transformers import DynamicCache

        lengths = [len(s.tokens) for s in sessions]
        width = max(lengths)
        n_layers = len(sessions[0].cache.layers)
        keys = [_left_pad_cache([s.cache.layers[layer].keys for s in sessions], width) for layer in range(n_layers)]
        values = [_left_pad_cache([s.cache.layers[layer].values for s in sessions], width) for layer in range(n_layers)]
        mask = torch.zeros((len(sessions), width), dtype=torch.long, device=device)
        for row, length in enumerate(lengths):
            mask[row, width - length :] = 1
        replies: List[tuple[List[int], List[float]]] = [([], []) for _ in sessions]
        rows = list(range(len(sessions)))  # session index of each batch row
        while True:
            ended = []
            for i, row in enumerate(rows):
                token, logprob = _choose(logits[i], sampling)
                replies[row][0].append(token)
                replies[row][1].append(logprob)
                if token == self.eos_id or len(replies[row][0]) == sampling.max_new_tokens:
                    ended.append(i)
            for i in ended:  # the reply's tokens but the last are in the cache: hand the row its slice
                row = rows[i]
                start = width - lengths[row]
                cache = DynamicCache()
                for layer in range(n_layers):
                    cache.update(
                        keys[layer][i : i + 1, :, start:].clone(), values[layer][i : i + 1, :, start:].clone(), layer
                    )
                sessions[row].cache = cache
                sessions[row].tokens = sessions[row].tokens + replies[row][0][:-1]
            if ended:
                keep = [i for i in range(len(rows)) if i not in set(ended)]
                if not keep:
                    break
                index = torch.tensor(keep, device=device)
                keys = [k.index_select(0, index) for k in keys]
                values = [v.index_select(0, index) for v in values]
                mask, logits, rows = mask.index_select(0, index), logits.index_select(0, index), [rows[i] for i in keep]
            batched = DynamicCache()
            for layer in range(n_layers):
                batched.update(keys[layer], values[layer], layer)
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long, device=device)], dim=1)
            positions = torch.tensor(
                [[len(sessions[row].tokens) + len(replies[row][0]) - 1] for row in rows], device=device
            )
            last = torch.tensor([replies[row][0][-1] for row in rows], device=device)[:, None]
            out = self.model(
                input_ids=last, attention_mask=mask, position_ids=positions, past_key_values=batched, use_cache=True
            )
            keys = [out.past_key_values.layers[layer].keys for layer in range(n_layers)]
            values = [out.past_key_values.layers[layer].values for layer in range(n_layers)]
            logits = out.logits[:, -1].float()
        return replies


def _left_pad_cache(tensors: List[torch.Tensor], width: int) -> torch.Tensor:
    """(1, heads, length_i, dim) tensors → (n, heads, width, dim), zero-padded on the left."""
    first = tensors[0]
    out = first.new_zeros((len(tensors), first.shape[1], width, first.shape[3]))
    for row, tensor in enumerate(tensors):
        out[row, :, width - tensor.shape[2] :] = tensor[0]
    return out


@dataclass
class _Session:
    tokens: List[int]
    """Tokens already in `cache`."""
    cache: Any


def _choose(logits: torch.Tensor, sampling: Sampling) -> tuple[int, float]:
    """Next token and its log-probability: argmax when greedy, else a draw from softmax(logits /
    temperature) restricted to the top-p nucleus (torch's global generator)."""
    if sampling.temperature <= 0:
        logprobs = torch.log_softmax(logits, -1)
        token = int(torch.argmax(logprobs))
        return token, float(logprobs[token])
    logprobs = torch.log_softmax(logits / sampling.temperature, -1)
    probs = logprobs.exp()
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < sampling.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    token = int(torch.multinomial(probs, 1))
    return token, float(logprobs[token])


class BatchedGenerate:
    """`GenerateFn` through the model's own engine, `model.generate` (transformers; Unsloth's
    fast inference path when `unsloth` is set): one call per turn for all live episodes, their
    whole contexts left-padded and prefilled together, which a GPU does in one pass.

    Decoding is exactly `Sampling`'s, whatever the model's `generation_config` says (no top-k,
    no repetition penalty): greedy at temperature 0, else softmax(logits / temperature) cut to
    the top-p nucleus. Each token's log-probability is log_softmax(logits / temperature) of
    the raw logits `generate` returns, the quantity the trainer scores (TRL divides by the
    same temperature), as `CachedGenerator` returns it.
    """

    def __init__(self, model: Any, tokenizer: Any, *, unsloth: bool = False) -> None:
        self.model = model
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.unsloth = unsloth

    def _generation_config(self, sampling: Sampling):
        from transformers import GenerationConfig

        greedy = sampling.temperature <= 0
        sampled = {} if greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        return GenerationConfig(
            do_sample=not greedy,
            **sampled,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
        )

    @torch.no_grad()
    def __call__(self, contexts: List[List[int]], sampling: Sampling) -> List[tuple[List[int], List[float]]]:
        device = next(self.model.parameters()).device
        width = max(len(context) for context in contexts)
        input_ids = torch.full((len(contexts), width), self.pad_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros_like(input_ids)
        for row, context in enumerate(contexts):
            input_ids[row, width - len(context) :] = torch.tensor(context, device=device)
            attention_mask[row, width - len(context) :] = 1
        was_training = self.model.training
        # generate() fills what a passed config leaves unset from the model's own generation_config
        # (a checkpoint's top_k, repetition penalty...): swap it for ours while generating
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        saved, base.generation_config = base.generation_config, self._generation_config(sampling)
        self._inference_mode(True)
        try:
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=base.generation_config
            )
        finally:
            self._inference_mode(False, was_training)
            base.generation_config = saved
        new = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float()  # raw logits, before any logits processor
        if sampling.temperature > 0:
            logits = logits / sampling.temperature
        logprobs = torch.log_softmax(logits, -1).gather(-1, new[..., None])[..., 0]
        replies = []
        for tokens, row_logprobs in zip(new.tolist(), logprobs.tolist()):
            end = tokens.index(self.eos_id) + 1 if self.eos_id in tokens else len(tokens)
            replies.append((tokens[:end], row_logprobs[:end]))
        return replies

    def _inference_mode(self, on: bool, was_training: bool = False) -> None:
        """eval() for generation, the previous mode after; Unsloth models switch their fast paths."""
        if self.unsloth:
            from unsloth import FastLanguageModel

            if on:
                FastLanguageModel.for_inference(self.model)
            elif was_training:
                FastLanguageModel.for_training(self.model)
        if on:
            self.model.eval()
        else:
            self.model.train(was_training)


GENERATION_ENGINES = ("auto", "cached", "generate")
"""`hf_generate_fn`'s engines: `generate` (`BatchedGenerate`, the model's own engine), `cached`
(`CachedGenerator`, one decoding step per forward with per-episode KV caches kept between
turns, so long contexts are not re-read), `auto` (generate on a GPU, cached on a CPU;
`make bench-generate` compares them: see docs/training.md)."""


def hf_generate_fn(model: Any, tokenizer: Any, engine: str = "auto", *, unsloth: bool = False) -> GenerateFn:
    """The `GenerateFn` for a transformers model (PEFT and Unsloth models too): `engine` is one of
    `GENERATION_ENGINES`; `unsloth` (the model is Unsloth's) makes `generate` use its inference mode."""
    if engine not in GENERATION_ENGINES:
        raise ValueError(f"engine must be one of {GENERATION_ENGINES}, got {engine!r}")
    if engine == "auto":
        engine = "generate" if next(model.parameters()).device.type == "cuda" else "cached"
    if engine == "generate":
        return BatchedGenerate(model, tokenizer, unsloth=unsloth)
    if unsloth:
        raise ValueError(
            "the cached engine calls the model one token at a time, which Unsloth's patched "
            "forward does not support; use engine='generate' (or 'auto') with Unsloth"
        )
    return CachedGenerator(model, tokenizer)


def play_episodes(
    generate_fn: GenerateFn,
    tokenizer: Any,
    specs: Sequence[Any],
    *,
    sampling: Sampling = Sampling(),
    max_turns: Optional[int] = None,
    max_context_tokens: Optional[int] = None,
    make_env: Callable[[], CERNCollisionEnvironment] = CERNCollisionEnvironment,
    observation_config: LLMAgentConfig = LLMAgentConfig(),
    agent_name: str = "LLM",
    batch_size: int = 32,
    seed: int = 0,
    progress: Optional[str] = None,
) -> List[PlayedEpisode]:
    """Play one episode per spec (`lib.records.EpisodeSpec`, mapping or tuple), in
    lockstep batches of `batch_size`; returns them in the order of `specs`. `progress`: a
    label under which the episodes played so far are logged (`lib.progress`).

    `max_turns` (default: the environment's step limit) and `max_context_tokens` stop an
    episode early, marked `truncated`; it then gets no terminal grade. Sampling draws
    from torch's generator seeded with `seed` + batch index, so a call is reproducible.
    """
    layout = ChatLayout(tokenizer, observation_config)
    specs = [spec_fields(s) for s in specs]
    played: List[PlayedEpisode] = []
    counter = Progress(progress, len(specs), unit="episode") if progress else None
    for index in range(0, len(specs), batch_size):
        torch.manual_seed(seed + index)
        played.extend(
            _play_batch(
                generate_fn,
                layout,
                specs[index : index + batch_size],
                sampling=sampling,
                max_turns=max_turns,
                max_context_tokens=max_context_tokens,
                make_env=make_env,
                agent_name=agent_name,
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
    max_turns: Optional[int],
    max_context_tokens: Optional[int],
    make_env: Callable[[], CERNCollisionEnvironment],
    agent_name: str,
) -> List[PlayedEpisode]:
    envs = [make_env() for _ in specs]
    observations = [env.reset(**spec) for env, spec in zip(envs, specs)]
    turn_limit = min(max_turns or envs[0].max_steps, envs[0].max_steps)
    messages = [layout.first_messages(obs) for obs in observations]
    episodes = [PlayedEpisode(prompt_ids=layout.prompt_ids(m)) for m in messages]
    steps: List[List[StepRecord]] = [[] for _ in specs]
    last_obs: List[CollisionObservation] = list(observations)
    active = list(range(len(specs)))
    for _turn in range(turn_limit):
        if max_context_tokens is not None:
            for i in [
                i
                for i in active
                if len(episodes[i].prompt_ids) + len(episodes[i].completion_ids) + sampling.max_new_tokens
                > max_context_tokens
            ]:
                episodes[i].truncated = True
                active.remove(i)
        if not active:
            break
        outputs = generate_fn([episodes[i].prompt_ids + episodes[i].completion_ids for i in active], sampling)
        still_active = []
        for i, (tokens, logprobs) in zip(active, outputs):
            episode, obs = episodes[i], last_obs[i]
            ended = bool(tokens) and tokens[-1] == layout.tokenizer.eos_token_id
            text = layout.tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=True)
            episode.completion_ids += tokens
            episode.env_mask += [1] * len(tokens)
            episode.logprobs += logprobs
            parse = parse_reply(text)
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
            messages[i].append({"role": "assistant", "content": text})
            last_obs[i] = next_obs
            if next_obs.done:
                continue
            env_ids = layout.environment_ids(messages[i], next_obs, reply_ended=ended)
            messages[i].append(layout.followup_message(next_obs))
            episode.completion_ids += env_ids
            episode.env_mask += [0] * len(env_ids)
            episode.logprobs += [0.0] * len(env_ids)
            still_active.append(i)
        active = still_active
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
