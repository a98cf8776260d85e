"""Batched token generation for multi-turn play: the `GenerateFn` protocol and its engines.

`BatchedGenerate` calls the model's own `generate` once per turn for all live episodes (the
GPU engine; compiled, with a static KV cache, as the `compiled` engine); `CachedGenerator`
keeps each episode's KV cache between turns, so a turn costs the new tokens only (the CPU
default). `hf_generate_fn` picks one for a transformers model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from lib.agents.prompting import Sampling
from lib.runtime import attend_grouped_queries, keep_freed_memory

GenerateFn = Callable[..., List[tuple[List[int], List[float]]]]
"""Batched generation, `generate_fn(contexts, sampling, shown=None)`: token contexts → per context
(new token ids, their log-probabilities), each stopped after the eos token (included) or at
`max_new_tokens`. `shown` (given where `sampling.constrained`): per context, the references its
observation shows and the options its task offers (`lib.agents.prompting.ReplyScope`), which its
reply alone may name (`lib.episodes.grammar.action_grammar`)."""

Shown = Optional[Sequence[Optional[Mapping[str, Any]]]]
"""Per context, the references its reply may quote, a `ReplyScope` where the task's options also
hold it (None: every known name)."""


SINGLE_THREAD_MAX_PARAMETERS = 10_000_000
"""Largest model [parameters] that `CachedGenerator` runs on one CPU thread whatever torch's setting:
the stand-in's (~1M) small forwards were chosen one-threaded where two threads only synchronised. A
larger model keeps the threads its caller set (`lib.runtime.use_cpu_threads`): SmolLM2-135M's
677-token prefill and its batch-30 decode step ran 1.6-1.8x faster on two threads than on one."""


class CachedGenerator:
    """`GenerateFn` on a transformers causal LM (PEFT and Unsloth models too) that keeps each
    episode's KV cache between turns: a turn feeds only the tokens added since the last one
    (the environment's text), instead of re-reading the whole conversation.

    The episodes' caches are stacked with left padding into one batch; a first forward pass feeds
    every episode its new tokens (left-padded to the longest), and the replies are then decoded
    for all episodes at once (`_decode`) and each cache split back afterwards. A context is matched
    to the cache whose tokens are a strict prefix of it; caches a call does not use (finished
    episodes) are dropped.
    """

    def __init__(self, model: Any, tokenizer: Any) -> None:
        keep_freed_memory()  # its caches are megabytes, allocated and freed at every pass
        if next(model.parameters()).device.type == "cpu":
            attend_grouped_queries()  # each turn's prefill reads the cached keys without copying them
        self.model = model
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self._parameters = sum(p.numel() for p in model.parameters())
        self._layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self._sessions: List[_Session] = []

    def _session_for(self, context: List[int]) -> "_Session":
        for session in self._sessions:
            n = len(session.tokens)
            if n < len(context) and context[:n] == session.tokens:
                self._sessions.remove(session)
                return session
        return _Session(tokens=[], cache=None)

    @torch.no_grad()
    def __call__(
        self, contexts: List[List[int]], sampling: Sampling, shown: Shown = None
    ) -> List[tuple[List[int], List[float]]]:
        if any(not context for context in contexts):
            raise ValueError("every context needs at least one token")
        device = next(self.model.parameters()).device
        was_training, threads = self.model.training, torch.get_num_threads()
        self.model.eval()
        if device.type == "cpu" and self._parameters <= SINGLE_THREAD_MAX_PARAMETERS:
            torch.set_num_threads(1)  # small sequential forwards: more threads only add synchronisation
        try:
            sessions = [self._session_for(context) for context in contexts]
            replies = self._decode(sessions, contexts, sampling, device, shown)
        finally:
            self.model.train(was_training)
            torch.set_num_threads(threads)
        self._sessions = sessions
        return replies

    def _decode(
        self,
        sessions: List["_Session"],
        contexts: List[List[int]],
        sampling: Sampling,
        device: Any,
        shown: Shown = None,
    ) -> List[tuple[List[int], List[float]]]:
        """Feed each session the rest of its context, then decode one reply per session; leaves in
        each session's cache its context and the reply's tokens but its last.

        The first forward pass feeds every row its context's new tokens (left-padded to the longest;
        the LM head at the last position alone: over SmolLM2's 49,152-token vocabulary it is a fifth
        of the model). Each pass after feeds every live reply the token it chose and, held to the
        grammar, the run of tokens the grammar then forces (`ActionGrammar.only_token`: a reply's
        opening, the keys its schema fixes, the eos after its closing brace), so a reply costs one
        pass per token the model chose rather than one per token (jump-forward decoding). A pass's
        rows are left-padded and the padding masked out of the cache. A forced token's
        log-probability is read from that pass, the model's own as for a chosen one.

        The batch's cache is written in place into room reserved after the contexts
        (`_reserved_layer_class`), not concatenated afresh at every pass. A row whose reply has ended
        takes its slice of the cache without the padding and stays in the batch, fed nothing, until
        the ended rows are as many as the live ones: then the batch is compacted, so each row's cache
        is copied a few times a turn rather than at every ending."""
        from transformers import DynamicCache

        lengths = [len(s.tokens) for s in sessions]
        width = max(lengths)
        new_tokens = [context[length:] for context, length in zip(contexts, lengths)]
        room = max(len(tokens) for tokens in new_tokens) + sampling.max_new_tokens + RESERVED_SLACK_TOKENS
        layer_class = _reserved_layer_class()
        cache = DynamicCache()
        cache.layers = [
            layer_class(
                _left_pad_cache([None if s.cache is None else s.cache[layer][0] for s in sessions], width, room),
                _left_pad_cache([None if s.cache is None else s.cache[layer][1] for s in sessions], width, room),
                width,
                room,
            )
            for layer in range(self._layers)
        ]
        mask = torch.zeros((len(sessions), width), dtype=torch.long, device=device)
        for row, length in enumerate(lengths):
            mask[row, width - length :] = 1
        rows = list(range(len(sessions)))  # session index of each batch row
        fed = list(lengths)  # per session: the tokens in its cache (its context and the reply's fed tokens)
        mask, step_logits = self._feed(cache, mask, new_tokens, rows, fed, device, last_only=True)
        logits = step_logits[:, -1]
        replies: List[tuple[List[int], List[float]]] = [([], []) for _ in sessions]
        live = list(range(len(sessions)))  # the batch rows whose reply goes on
        grammar = _action_grammar(self.tokenizer, logits.shape[-1]) if sampling.constrained else None
        matchers = _matchers(self.tokenizer, logits.shape[-1], len(sessions), shown) if grammar is not None else None
        while live:
            allowed = None
            if grammar is not None:
                allowed = grammar.restrict(logits[torch.tensor(live, device=device)], [matchers[rows[i]] for i in live])
            chunks: List[List[int]] = [[] for _ in rows]  # per batch row, the tokens this pass feeds
            reads: List[List[tuple[int, int]]] = [[] for _ in rows]  # (forced token's place, its logits' offset)
            ended = []
            for j, i in enumerate(live):
                row = rows[i]
                tokens, logprobs = replies[row]
                token, logprob = _choose(logits[i], sampling, None if allowed is None else allowed[j])
                while True:
                    if grammar is not None:
                        grammar.accept(matchers[row], token)
                    tokens.append(token)
                    logprobs.append(logprob)
                    if token == self.eos_id or len(tokens) == sampling.max_new_tokens:
                        ended.append(i)  # a reply's last token is not fed
                        break
                    chunks[i].append(token)
                    token = grammar.only_token(matchers[row]) if grammar is not None else None
                    if token is None:
                        break
                    logprob = None  # the model's, from the logits after the token before it
                    reads[i].append((len(tokens), len(chunks[i]) - 1))
            step = max(len(chunk) for chunk in chunks)
            if step:
                mask, step_logits = self._feed(cache, mask, chunks, rows, fed, device)
                for i in live:
                    tokens, logprobs = replies[rows[i]]
                    for place, offset in reads[i]:
                        logprobs[place] = _logprob(
                            step_logits[i, step - len(chunks[i]) + offset], tokens[place], sampling
                        )
                logits = step_logits[:, -1]
            for i in ended:  # the reply's tokens but the last are in the cache: hand the row its slice
                row = rows[i]
                kept = mask[i].nonzero()[:, 0]
                sessions[row].cache = [
                    (layer.keys[i : i + 1, :, kept], layer.values[i : i + 1, :, kept]) for layer in cache.layers
                ]
                sessions[row].tokens = contexts[row] + replies[row][0][:-1]
            live = [i for i in live if i not in set(ended)]
            if live and len(rows) - len(live) >= len(live):  # as many rows ended as go on: drop them
                index = torch.tensor(live, device=device)
                for layer in cache.layers:
                    layer.keep_rows(index)
                mask, logits = mask.index_select(0, index), logits.index_select(0, index)
                rows, live = [rows[i] for i in live], list(range(len(live)))
        return replies

    def _feed(
        self,
        cache: Any,
        mask: torch.Tensor,
        chunks: List[List[int]],
        rows: List[int],
        fed: List[int],
        device: Any,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward pass feeding batch row i the tokens `chunks[i]` (none: the row is padding),
        left-padded to the longest, at the positions after the `fed[rows[i]]` its session's cache
        holds (`fed` is advanced). The attention mask with the pass's columns, and the float logits
        (batch, columns, vocabulary): of the last column alone when `last_only`."""
        step = max(len(chunk) for chunk in chunks)
        input_ids = torch.zeros((len(chunks), step), dtype=torch.long, device=device)
        new_mask = torch.zeros_like(input_ids)
        positions = torch.zeros_like(input_ids)
        for i, chunk in enumerate(chunks):
            if chunk:
                row = rows[i]
                input_ids[i, step - len(chunk) :] = torch.tensor(chunk, device=device)
                new_mask[i, step - len(chunk) :] = 1
                positions[i, step - len(chunk) :] = torch.arange(fed[row], fed[row] + len(chunk))
                fed[row] += len(chunk)
        mask = torch.cat([mask, new_mask], dim=1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        return mask, out.logits.float()


RESERVED_SLACK_TOKENS = 16
"""Positions reserved in a decoding batch's cache beyond a reply's `max_new_tokens` (a pass adds as many
columns as its longest run, so the columns can outgrow one row's tokens; the cache grows if they do)."""


@functools.cache
def _reserved_layer_class() -> type:
    """`ReservedLayer`, a transformers `DynamicLayer` (defined on first use: only then is transformers imported)."""
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """One layer's KV cache for a decoding batch, written in place into positions reserved
        ahead; `keys` and `values` are views of the filled positions. transformers'
        `DynamicLayer` concatenates the whole cache with each pass's new positions instead, a copy
        of every cached key and value per layer per pass, which on a CPU costs more than the pass."""

        def __init__(
            self, keys: Optional[torch.Tensor], values: Optional[torch.Tensor], length: int, room: int
        ) -> None:
            super().__init__()
            self.store_keys, self.store_values, self.length, self.room = keys, values, length, room
            if keys is not None:
                self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
                self._show()

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            """No cache to start from: a store of `room` positions shaped as the first keys."""
            self.store_keys = _with_room(key_states[:, :, :0], self.room)
            self.store_values = _with_room(value_states[:, :, :0], self.room)
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True

        def _show(self) -> None:
            self.keys = self.store_keys[:, :, : self.length]
            self.values = self.store_values[:, :, : self.length]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            new = key_states.shape[-2]
            capacity = self.store_keys.shape[-2]
            if self.length + new > capacity:  # out of room (rare): copied into a store with room again
                grown = self.length + new + max(new, RESERVED_SLACK_TOKENS)
                self.store_keys = _with_room(self.keys, grown)
                self.store_values = _with_room(self.values, grown)
            self.store_keys[:, :, self.length : self.length + new] = key_states
            self.store_values[:, :, self.length : self.length + new] = value_states
            self.length += new
            self._show()
            return self.keys, self.values

        def keep_rows(self, index: torch.Tensor) -> None:
            """Keep only the batch rows `index`, with the room they had."""
            self.store_keys = self.store_keys.index_select(0, index)
            self.store_values = self.store_values.index_select(0, index)
            self._show()

    return ReservedLayer


def _with_room(tensor: torch.Tensor, positions: int) -> torch.Tensor:
    """`tensor` (batch, heads, length, dim) copied into a new one of `positions` positions."""
    out = tensor.new_empty((tensor.shape[0], tensor.shape[1], positions, tensor.shape[3]))
    out[:, :, : tensor.shape[2]] = tensor
    return out


def _left_pad_cache(tensors: List[Optional[torch.Tensor]], width: int, room: int = 0) -> Optional[torch.Tensor]:
    """(1, heads, length_i, dim) tensors → (n, heads, width + room, dim), zero-padded on the left to `width`
    (a None, a session without a cache, is all padding); the `room` positions after are left unwritten.
    None when every one is None."""
    first = next((tensor for tensor in tensors if tensor is not None), None)
    if first is None:
        return None
    out = first.new_empty((len(tensors), first.shape[1], width + room, first.shape[3]))
    for row, tensor in enumerate(tensors):
        length = 0 if tensor is None else tensor.shape[2]
        out[row, :, : width - length] = 0
        if tensor is not None:
            out[row, :, width - length : width] = tensor[0]
    return out


@dataclass
class _Session:
    tokens: List[int]
    """Tokens already in `cache`."""
    cache: Optional[List[tuple[torch.Tensor, torch.Tensor]]]
    """Per layer, its (keys, values), each (1, heads, len(tokens), dim); None before the first turn."""


def _choose(logits: torch.Tensor, sampling: Sampling, allowed: Optional[torch.Tensor] = None) -> tuple[int, float]:
    """Next token and its log-probability: argmax when greedy, else a draw from softmax(logits /
    temperature) restricted to the top-p nucleus (torch's global generator). `allowed`: the same
    logits with the tokens the action grammar forbids at -inf (`ActionGrammar.restrict`), from which
    the token is chosen; the log-probability is the model's own, over the whole vocabulary."""
    if sampling.temperature <= 0:
        logprobs = torch.log_softmax(logits, -1)
        token = int(torch.argmax(logprobs if allowed is None else allowed))
        return token, float(logprobs[token])
    logprobs = torch.log_softmax(logits / sampling.temperature, -1)
    probs = logprobs.exp() if allowed is None else torch.softmax(allowed / sampling.temperature, -1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < sampling.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    token = int(torch.multinomial(probs, 1))
    return token, float(logprobs[token])


def _logprob(logits: torch.Tensor, token: int, sampling: Sampling) -> float:
    """The log-probability `_choose` returns with `token` from these logits: log_softmax(logits /
    temperature) over the whole vocabulary (of the raw logits when greedy)."""
    scale = sampling.temperature if sampling.temperature > 0 else 1.0
    return float(torch.log_softmax(logits / scale, -1)[token])


class BatchedGenerate:
    """`GenerateFn` through the model's own engine, `model.generate` (transformers; Unsloth's
    fast inference path when `unsloth` is set): one call per turn for all live episodes, their
    whole contexts left-padded and prefilled together, which a GPU does in one pass.

    Decoding is exactly `Sampling`'s, whatever the model's `generation_config` says (no top-k,
    no repetition penalty): greedy at temperature 0, else softmax(logits / temperature) cut to
    the top-p nucleus. Each token's log-probability is log_softmax(logits / temperature) of
    the raw logits `generate` returns, the quantity the trainer scores (TRL divides by the
    same temperature), as `CachedGenerator` returns it.

    `compiled` (the `compiled` engine): the KV cache is transformers' `StaticCache`, whose fixed
    shapes let `generate` run its one-token decoding step through `torch.compile` (mode
    "reduce-overhead": CUDA graphs on a GPU, one launch per step instead of one per kernel). So that
    a compiled step is reused rather than compiled again, the shapes take few values: the batch is
    padded with copies of its first context up to the next of `BATCH_BUCKETS`, and the cache is
    `CACHE_BUCKET_TOKENS`-rounded and never shrinks; one cache per batch size is kept and reset
    between calls (the same tensors, so a CUDA graph replays). `compile_backend` is
    torch.compile's backend ("inductor"; a test passes "eager" to check the plumbing on a CPU,
    where transformers compiles only when asked to).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        unsloth: bool = False,
        compiled: bool = False,
        compile_backend: str = "inductor",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.unsloth = unsloth
        self.compiled = compiled
        self.compile_backend = compile_backend
        self._caches: Dict[int, Any] = {}
        self._cache_tokens = 0

    def _generation_config(self, sampling: Sampling):
        from transformers import GenerationConfig

        greedy = sampling.temperature <= 0
        sampled = {} if greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        config = GenerationConfig(
            do_sample=not greedy,
            **sampled,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
        )
        if self.compiled:
            from transformers import CompileConfig

            mode = "reduce-overhead" if self.compile_backend == "inductor" else None  # the others take no mode
            config.compile_config = CompileConfig(backend=self.compile_backend, mode=mode)
            config.compile_config._compile_all_devices = True  # transformers compiles on a GPU only unless told
        return config

    def _static_cache(self, batch: int, tokens: int) -> Any:
        """The `StaticCache` for a call of `batch` rows needing `tokens` positions: the one kept for that
        batch size, reset, while it is long enough; else a new one of the longest length seen so far."""
        from transformers import StaticCache

        needed = -(-tokens // CACHE_BUCKET_TOKENS) * CACHE_BUCKET_TOKENS
        if needed > self._cache_tokens:
            self._cache_tokens, self._caches = needed, {}  # longer contexts: every size made again at the new length
        cache = self._caches.get(batch)
        if cache is None:
            config = self.model.config.get_text_config(decoder=True) if hasattr(self.model, "config") else None
            cache = self._caches[batch] = StaticCache(config=config, max_cache_len=self._cache_tokens)
        else:
            cache.reset()
        return cache

    @torch.no_grad()
    def __call__(
        self, contexts: List[List[int]], sampling: Sampling, shown: Shown = None
    ) -> List[tuple[List[int], List[float]]]:
        device = next(self.model.parameters()).device
        n_contexts = len(contexts)
        if self.compiled:  # a batch of a bucket's size: the rows past n_contexts are dropped below
            contexts = contexts + [contexts[0]] * (_bucket(n_contexts) - n_contexts)
            shown = None if shown is None else list(shown) + [shown[0]] * (len(contexts) - n_contexts)
        width = max(len(context) for context in contexts)
        input_ids = torch.full((len(contexts), width), self.pad_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros_like(input_ids)
        for row, context in enumerate(contexts):
            input_ids[row, width - len(context) :] = torch.tensor(context, device=device)
            attention_mask[row, width - len(context) :] = 1
        extra = {}
        if self.compiled:
            extra["past_key_values"] = self._static_cache(len(contexts), width + sampling.max_new_tokens)
        if sampling.constrained:
            extra["logits_processor"] = [_GrammarProcessor(self.tokenizer, width, shown)]
        was_training = self.model.training
        # generate() fills what a passed config leaves unset from the model's own generation_config
        # (a checkpoint's top_k, repetition penalty...): swap it for ours while generating
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        saved, base.generation_config = base.generation_config, self._generation_config(sampling)
        self._inference_mode(True)
        try:
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=base.generation_config, **extra
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
        for tokens, row_logprobs in zip(new[:n_contexts].tolist(), logprobs[:n_contexts].tolist()):
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


def _action_grammar(tokenizer: Any, n_vocab: int, shown: Optional[Mapping[str, Any]] = None) -> Any:
    """`lib.episodes.grammar.action_grammar`, imported when a reply is first held to the grammar (only
    such a run needs llguidance)."""
    from lib.episodes.grammar import action_grammar

    return action_grammar(tokenizer, n_vocab, shown)


def _matchers(tokenizer: Any, n_vocab: int, rows: int, shown: Shown) -> List[Any]:
    """A reply's start for each of `rows` contexts, under the grammar of what its observation shows
    (`shown[row]`; every known name where `shown` is None)."""
    if shown is not None and len(shown) != rows:
        raise ValueError(f"shown has {len(shown)} entries for {rows} contexts")
    return [_action_grammar(tokenizer, n_vocab, None if shown is None else shown[row]).matcher() for row in range(rows)]


class _GrammarProcessor:
    """A transformers logits processor that holds each row's reply to the action grammar
    (`lib.episodes.grammar`): before each token, the tokens its matcher forbids are set to -inf;
    a row whose reply has ended (its eos consumed) is left alone. `generate` returns the raw logits
    besides, from which `BatchedGenerate` takes the model's own log-probabilities."""

    def __init__(self, tokenizer: Any, prompt_width: int, shown: Shown = None) -> None:
        self.tokenizer, self.prompt_width, self.shown = tokenizer, prompt_width, shown
        self.grammar = self.matchers = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.grammar is None:
            self.grammar = _action_grammar(self.tokenizer, scores.shape[-1])
            self.matchers = _matchers(self.tokenizer, scores.shape[-1], scores.shape[0], self.shown)
        elif input_ids.shape[1] > self.prompt_width:
            for row, token in enumerate(input_ids[:, -1].tolist()):
                if self.matchers[row] is not None:
                    self.grammar.accept(self.matchers[row], token)
                    if token == self.tokenizer.eos_token_id:  # the reply ended: padding follows
                        self.matchers[row] = None
        return self.grammar.restrict(scores, self.matchers).to(scores.dtype)


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""The batch sizes the `compiled` engine generates with (the next one up from the live episodes;
beyond the last, multiples of it): each size is one compiled decoding step."""
CACHE_BUCKET_TOKENS = 1024
"""The `compiled` engine's static KV cache is a multiple of this many positions long."""


def _bucket(n: int) -> int:
    """The smallest of `BATCH_BUCKETS` at least `n` (beyond them, the next multiple of the last)."""
    for size in BATCH_BUCKETS:
        if n <= size:
            return size
    return -(-n // BATCH_BUCKETS[-1]) * BATCH_BUCKETS[-1]


GENERATION_ENGINES = ("auto", "cached", "generate", "compiled")
"""`hf_generate_fn`'s engines: `generate` (`BatchedGenerate`, the model's own engine), `compiled`
(the same with a static KV cache and the decoding step compiled: CUDA graphs on a GPU), `cached`
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
    if engine in ("generate", "compiled"):
        return BatchedGenerate(model, tokenizer, unsloth=unsloth, compiled=engine == "compiled")
    if unsloth:
        raise ValueError(
            "the cached engine calls the model one token at a time, which Unsloth's patched "
            "forward does not support; use engine='generate' (or 'auto') with Unsloth"
        )
    return CachedGenerator(model, tokenizer)
