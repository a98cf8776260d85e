"""Replies held to the action grammar while they are generated: a token that would take a reply
outside the JSON schema of an action (`lib.agents.prompting.action_json_schema`) gets probability 0
before the next token is chosen, so a reply that is not one schema-valid action cannot be written
(`Sampling.constrained`). The grammar engine is llguidance (Microsoft's, the one vLLM and SGLang
also use): it compiles the JSON schema against the tokenizer's vocabulary once and answers, token by
token, which tokens may come next, as a bitmask.

The log-probability recorded with each token stays the model's own, over the whole vocabulary (as
with top-p, the restriction picks from the distribution; it does not change the number recorded),
which is what GRPO's loss recomputes from the model by default; with `renormalise_to_grammar` the
trainer scores each token within what the grammar admitted there (`reply_admitted`) instead.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

from lib.agents.prompting import action_json_schema, offered_text
from lib.episodes.chat import model_spans
from lib.extras import missing_modules

if missing_modules(["llguidance"]):  # only a run that holds its replies to the grammar needs it
    raise ModuleNotFoundError(
        "replies held to the action grammar (constrained_replies) need llguidance, which the 'train' extra "
        "installs: pip install llguidance==1.9.1, or `make setup`",
        name="llguidance",
    )
import llguidance  # noqa: E402
import llguidance.hf  # noqa: E402
import llguidance.torch  # noqa: E402

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
"""llguidance's JSON options: no whitespace between tokens, `,` and `:` as `action_to_json` writes
replies (the demonstrations the policy learns from)."""


def action_grammar_text(shown: Optional[Mapping[str, Any]] = None) -> str:
    """The action schema as llguidance compiles it (`action_json_schema(shown)`: with `shown`, an
    observation's `references` or `ReplyScope`, a reply may quote only what it shows and name only
    the channels and triggers its task offers): its references' pattern
    without the trailing `(?!\\n)` look-ahead (which makes Python's `re` stop at the string's end, as
    llguidance's regular expressions, matched against whole strings, always do, and which they do not
    support)."""
    schema = json.loads(json.dumps(action_json_schema(shown)).replace("$(?!\\\\n)", "$"))
    schema["x-guidance"] = COMPACT_JSON
    return llguidance.grammar_from("json_schema", json.dumps(schema))


def shown_key(shown: Optional[Mapping[str, Any]]) -> Optional[Tuple[Any, ...]]:
    """What of an observation's `references` its reply grammar depends on: each name, and its value's
    type (which parameters may quote it, and whether it may be scaled) or, for text, the value itself
    (an enum parameter quotes only its own values), then the options a `ReplyScope` holds its text to
    (`offered_text`); None for the grammar of every known name."""
    if shown is None:
        return None
    names = tuple(
        sorted((name, value if isinstance(value, str) else type(value).__name__) for name, value in shown.items())
    )
    return names + tuple(sorted(offered_text(shown).items()))


class ActionGrammar:
    """The action grammar for one tokenizer and vocabulary size (the model's logits' width, which
    may exceed the tokenizer's): `matcher()` starts a reply, `restrict` masks a batch of logits.
    `shown` (an observation's `references`, or its `ReplyScope`): the grammar of a reply to that
    observation, whose references name only the values it shows and, for a scope, whose channels and
    triggers are ones its task offers (`action_json_schema`); None admits every known name.
    `restrict`, `only_token` and `forced` read the matchers they are given, so one grammar's methods
    serve matchers of another's (the same tokenizer and width)."""

    def __init__(self, tokenizer: Any, n_vocab: int, shown: Optional[Mapping[str, Any]] = None) -> None:
        self.n_vocab = n_vocab
        self.tokenizer = _llguidance_tokenizer(tokenizer, n_vocab)
        self.grammar = action_grammar_text(shown)
        error = llguidance.LLMatcher.validate_grammar(self.grammar, self.tokenizer)
        if error:
            raise ValueError(f"the action grammar does not compile: {error}")
        self._start = llguidance.LLMatcher(self.tokenizer, self.grammar)
        """A matcher at the start of a reply, never moved: each reply's is a copy of it."""

    def matcher(self) -> Any:
        """A matcher at the start of a reply: a copy of one made once (making one compiles the
        grammar again; a copy does not)."""
        return self._start.deep_copy()

    def restrict(self, logits: torch.Tensor, matchers: List[Optional[Any]]) -> torch.Tensor:
        """`logits` (rows, vocab) with every token its row's matcher forbids at -inf (a copy); a row
        whose matcher is None (a finished reply) is left as it is."""
        bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), self.n_vocab)
        bitmask.fill_(-1)  # every bit set: a row without a matcher allows every token
        for row, matcher in enumerate(matchers):
            if matcher is not None:
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)
        # the bitmask's bits unpacked, token order (llguidance's own apply_token_bitmask_inplace does the
        # same through torch.compile, which compiles it again in every process, for each batch size)
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[-1]]
        restricted = logits.float().clone()
        restricted[torch.from_numpy(allowed == 0).to(restricted.device)] = float("-inf")
        return restricted

    def only_token(self, matcher: Any) -> Optional[int]:
        """The one token `matcher` allows next, where it allows a single one (`{` to open a reply, a
        key's quotes, the eos after the closing brace): a token the policy cannot but write. None
        where it allows several, or none (a stopped or failed matcher)."""
        if matcher.is_stopped() or matcher.is_error():
            return None
        bitmask = llguidance.torch.allocate_token_bitmask(1, self.n_vocab)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        allowed = np.flatnonzero(np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: self.n_vocab])
        return int(allowed[0]) if len(allowed) == 1 else None

    def admitted(self, tokens: Sequence[int], matcher: Any = None) -> np.ndarray:
        """For each token of a reply written under the grammar, the tokens the grammar admitted at
        its place, as llguidance's bitmask rows (int32, `n_vocab` bits each, token t at bit t % 32 of
        word t // 32): the support of the distribution the token was sampled from. Rows from the
        first token the grammar refuses on (a reply written without it) admit every token. `matcher`:
        a reply's start under another grammar of the same tokenizer (the one it was written under)."""
        matcher = self.matcher() if matcher is None else matcher
        rows = llguidance.torch.allocate_token_bitmask(len(tokens), self.n_vocab)
        rows.fill_(-1)
        for row, token in enumerate(tokens):
            if matcher.is_stopped() or matcher.is_error():
                break
            llguidance.torch.fill_next_token_bitmask(matcher, rows, row)
            if not matcher.consume_token(token):
                rows[row].fill_(-1)
                break
        return rows.numpy()

    def forced(self, tokens: Sequence[int], matcher: Any = None) -> List[bool]:
        """For each token of a reply written under the grammar, whether the grammar allowed that
        token alone there (`admitted` holds that one bit): a token the policy did not choose. Stops at
        the first token the grammar refuses (a reply written without it); the rest count as chosen."""
        return forced_tokens(tokens, self.admitted(tokens, matcher))

    @staticmethod
    def accept(matcher: Any, token: int) -> None:
        """Move `matcher` past `token` (one it allowed)."""
        if not matcher.consume_token(token):
            raise RuntimeError(f"the action grammar refused a token it allowed: {matcher.get_error()}")


def forced_tokens(tokens: Sequence[int], admitted: np.ndarray) -> List[bool]:
    """For each of `tokens`, whether its row of `admitted` (`ActionGrammar.admitted`) admits it alone."""
    octets = np.ascontiguousarray(admitted).view(np.uint8)  # little-endian words: token t is bit t % 8 of octet t // 8
    single = _BITS_SET[octets].sum(axis=1, dtype=np.int64) == 1
    return [bool(single[i]) and bool(octets[i, token // 8] >> (token % 8) & 1) for i, token in enumerate(tokens)]


def admitted_mask(admitted: np.ndarray, n_vocab: int) -> np.ndarray:
    """`admitted`'s rows (`ActionGrammar.admitted`) as a bool array (rows, `n_vocab`): True where a
    token was admitted; a row that admits every token (no grammar held that place) is True across
    all `n_vocab` columns, those past the grammar's own width too."""
    bits = np.unpackbits(np.ascontiguousarray(admitted).view(np.uint8), axis=1, bitorder="little").astype(bool)
    mask = np.zeros((len(admitted), n_vocab), dtype=bool)
    width = min(bits.shape[1], n_vocab)
    mask[:, :width] = bits[:, :width]
    mask[bits.all(axis=1)] = True
    return mask


_BITS_SET = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1).sum(axis=1).astype(np.uint8)
"""The number of bits set in each octet value."""


def reply_admitted(
    tokenizer: Any,
    completion_ids: Sequence[int],
    env_mask: Sequence[int],
    shown: Optional[Sequence[Optional[Mapping[str, Any]]]] = None,
    n_vocab: Optional[int] = None,
) -> np.ndarray:
    """What the grammar admitted at each token of a completion (`ActionGrammar.admitted`'s rows, one
    per token of `completion_ids`; every token admitted where `env_mask` is 0, the environment's
    text): each run of 1s in `env_mask` is one reply, read from its start under the grammar it was
    written under: `shown[k]`, the references the observation showed before reply k
    (`PlayedEpisode.shown`); without them, the grammar of every known name. `n_vocab`: the model's
    logits' width (the tokenizer's size unless given)."""
    n_vocab = len(tokenizer) if n_vocab is None else n_vocab
    grammar = action_grammar(tokenizer, n_vocab)
    rows = llguidance.torch.allocate_token_bitmask(len(completion_ids), n_vocab).numpy()
    rows.fill(-1)
    for k, (start, end) in enumerate(model_spans(env_mask)):
        written = shown[k] if shown is not None and k < len(shown) else None
        matcher = action_grammar(tokenizer, n_vocab, written).matcher() if written is not None else None
        rows[start:end] = grammar.admitted(completion_ids[start:end], matcher)
    return rows


def train_chosen_tokens_only(
    tokenizer: Any,
    completion_ids: Sequence[int],
    env_mask: Sequence[int],
    shown: Optional[Sequence[Optional[Mapping[str, Any]]]] = None,
    admitted: Optional[np.ndarray] = None,
) -> List[int]:
    """`env_mask` (1: a token the model wrote) with the tokens the grammar forced set to 0, read from
    what the grammar admitted at each token (`admitted`, or `reply_admitted(tokenizer, completion_ids,
    env_mask, shown)`). Under the grammar a forced token had probability 1 whatever the model's, so it
    carries no gradient of the policy that sampled it; left in GRPO's loss, its advantage pushes the
    model's own probability of it around (and its KL term with it), which changes nothing the policy
    does."""
    if admitted is None:
        admitted = reply_admitted(tokenizer, completion_ids, env_mask, shown)
    forced = forced_tokens(completion_ids, admitted)
    return [0 if chosen and forced[i] else chosen for i, chosen in enumerate(env_mask)]


_TOKENIZERS: dict = {}


def _llguidance_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    """llguidance's view of `tokenizer`'s vocabulary for `n_vocab` logits, made once per process (making
    it took most of a grammar's ~1 s with SmolLM2's 49,152 tokens; every grammar of a tokenizer shares it)."""
    key = (id(tokenizer), n_vocab)
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = (tokenizer, llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab))
    return _TOKENIZERS[key][1]


_GRAMMARS: "OrderedDict[Any, ActionGrammar]" = OrderedDict()
MAX_GRAMMARS = 512
"""Grammars a process keeps compiled (least recently used dropped first): one per tokenizer, width
and set of shown references and offered options (`shown_key`); a campaign shows ten or so such sets."""


def action_grammar(tokenizer: Any, n_vocab: int, shown: Optional[Mapping[str, Any]] = None) -> ActionGrammar:
    """The `ActionGrammar` of `tokenizer` for `n_vocab` logits and the references `shown` (None: every
    known name), compiled once per process (`MAX_GRAMMARS` kept)."""
    key = (id(tokenizer), n_vocab, shown_key(shown))
    if key in _GRAMMARS:
        _GRAMMARS.move_to_end(key)
    else:
        _GRAMMARS[key] = ActionGrammar(tokenizer, n_vocab, shown)
        if len(_GRAMMARS) > MAX_GRAMMARS:
            _GRAMMARS.popitem(last=False)
    return _GRAMMARS[key]
