"""The tokenizer of the project's CPU stand-in model: byte-level BPE trained on CERNenv's own text.

The corpus is what such a model reads and writes: the system prompt, the rendered
observations and the JSON actions of `HeuristicAgent` and `RandomAgent` episodes over
curated and procedural scenarios (fixed seeds). Byte-level BPE encodes any text (a
model's odd output included) without unknown tokens. Training is deterministic, and the
result is cached on disk under a name that changes when any of its inputs does.

    tokenizer = build_tokenizer()          # trains once, then loads .cache/tokenizer/...
    prompt = make_prompt_fn(tokenizer)(build_chat(obs))
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from cernenv import CERNCollisionEnvironment, ExperimentAction
from cernenv.scenarios import DIFFICULTIES, list_scenarios
from lib.agents.baselines import HeuristicAgent, RandomAgent
from lib.agents.prompting import SYSTEM_PROMPT, action_to_json, render_observation
from lib.episodes.agent_rollouts import transitions
from lib.files import PROJECT_CACHE
from lib.measure.evaluation import assert_disjoint_from_suite
from lib.seeds import CORPUS_SEED

SYSTEM, USER, ASSISTANT, END, PAD = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, SYSTEM, USER, ASSISTANT, END]
WARM_START_CACHE = PROJECT_CACHE / "warm_start"
"""Where `lib.training.warm_start` keeps the warm starts it built, one folder each."""
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""`<|role|>\\ncontent<|end|>\\n` per message (role: system, user or assistant); the
generation prompt opens the assistant's turn, which the model ends with `<|end|>` (eos).
The `{% generation %}` markers tell `apply_chat_template(..., return_assistant_tokens_mask=True)`
which tokens the model writes (its replies and their `<|end|>`), for assistant-only SFT loss.
transformers renders with `trim_blocks`, which eats a newline written right after a block
tag: hence `{{ '\\n' }}` after `{% endgeneration %}`."""
WORD_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?[\p{L}_]+| ?\p{N}+| ?[^\s\p{L}\p{N}_]+|\s+(?!\S)|\s+"""
"""GPT-2's pre-tokenization, except that `_` joins letters: `estimate_significance` and
`mass_gev` can become single tokens."""
CORPUS_VERSION = 2
"""Bump when the corpus changes in a way the fingerprint cannot see (2: fits whose errors the data do
not constrain show none, and a note says so)."""


def corpus_specs(n_episodes: int, first_seed: int = CORPUS_SEED) -> List[Dict[str, Any]]:
    """`n_episodes` training seeds alternating curated scenarios (in turn) and procedural
    ones (each difficulty in turn); never a held-out evaluation seed."""
    curated = list_scenarios()
    specs = [
        {"seed": first_seed + i, "scenario": curated[(i // 2) % len(curated)]}
        if i % 2 == 0
        else {"seed": first_seed + i, "difficulty": DIFFICULTIES[(i // 2) % len(DIFFICULTIES)]}
        for i in range(n_episodes)
    ]
    assert_disjoint_from_suite(spec["seed"] for spec in specs)
    return specs


def corpus(n_episodes: int) -> Iterator[str]:
    """The training text: the system prompt, then per step of `n_episodes` heuristic and
    `n_episodes` random episodes the user message and the action as a JSON reply."""
    env = CERNCollisionEnvironment()
    agents = ((HeuristicAgent(), CORPUS_SEED), (RandomAgent(seed=CORPUS_SEED), CORPUS_SEED + n_episodes))
    for agent, first_seed in agents:
        for spec in corpus_specs(n_episodes, first_seed):
            yield SYSTEM_PROMPT
            for obs, action, _ in transitions(env, agent, **spec):
                yield render_observation(obs, include_task=obs.step_index == 0)
                if isinstance(action, ExperimentAction):
                    yield action_to_json(action)


def _fingerprint(vocab_size: int, n_episodes: int) -> str:
    """A hash of everything the trained tokenizer depends on: its settings, the tokenizers
    version, and the text of three probe episodes of the corpus, one of each kind it holds
    (the heuristic on a curated and on a procedural campaign, the random agent), which changes
    if the prompt, the environment's numbers or either agent's choices do."""
    env = CERNCollisionEnvironment()
    curated, procedural = corpus_specs(2)
    probes = (
        (HeuristicAgent(), curated),
        (HeuristicAgent(), procedural),
        (RandomAgent(seed=CORPUS_SEED), corpus_specs(1, CORPUS_SEED + n_episodes)[0]),
    )
    probe = [
        render_observation(obs, include_task=obs.step_index == 0)
        + (action_to_json(action) if isinstance(action, ExperimentAction) else "")
        for agent, spec in probes
        for obs, action, _ in transitions(env, agent, **spec)
    ]
    payload = json.dumps(
        [
            CORPUS_VERSION,
            vocab_size,
            n_episodes,
            tokenizers.__version__,
            SPECIAL_TOKENS,
            WORD_PATTERN,
            CHAT_TEMPLATE,
            SYSTEM_PROMPT,
            probe,
        ]
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def train_tokenizer(texts: List[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE on `texts`. Deterministic: each merge is the most frequent pair, ties
    broken by the pair itself, whatever the number of threads."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(WORD_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=END,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tokenizer(
    cache_dir: Optional[str] = None, vocab_size: int = 2048, n_episodes: int = 100
) -> PreTrainedTokenizerFast:
    """The project's tokenizer: loaded from `cache_dir` (default `PROJECT_CACHE/tokenizer`) when a
    matching one is there, else trained on `corpus(n_episodes)` and saved (atomically: concurrent
    builders are safe)."""
    cache_dir = cache_dir or str(PROJECT_CACHE / "tokenizer")
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must cover the 256 bytes and {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}"
        )
    target = Path(cache_dir) / f"bpe-v{vocab_size}-n{n_episodes}-{_fingerprint(vocab_size, n_episodes)}"
    if (target / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(target))
    tokenizer = train_tokenizer(list(corpus(n_episodes)), vocab_size)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(dir=target.parent, prefix=".tmp-")
    os.chmod(staging, 0o755)
    tokenizer.save_pretrained(staging)
    try:
        os.rename(staging, target)
    except OSError:  # another process saved the same tokenizer first
        shutil.rmtree(staging, ignore_errors=True)
    return PreTrainedTokenizerFast.from_pretrained(str(target))


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""`tokenizer_config.json` classes that mean "the pipeline in tokenizer.json, as it is" (the
project tokenizer saves itself so)."""


def load_tokenizer(name_or_path: str) -> Any:
    """The tokenizer of a saved policy folder (or a Hub model name), as it was saved.

    transformers' `AutoTokenizer` loads a folder whose config.json names a model type (the
    stand-in is a `qwen2` model) with that type's tokenizer class, which rebuilds the
    pre-tokenizer its own way: the project tokenizer then splits text differently (a first
    prompt: 549 tokens instead of the 398 the model was trained on) and the policy reads
    nonsense. A folder whose tokenizer_config.json names a generic class
    (`GENERIC_TOKENIZER_CLASSES`) is loaded from its tokenizer.json as is; anything else (a
    real model's own tokenizer) with `AutoTokenizer`."""
    if saves_its_own_pipeline(name_or_path):
        return PreTrainedTokenizerFast.from_pretrained(str(name_or_path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(name_or_path))


def saves_its_own_pipeline(name_or_path: str) -> bool:
    """True for a folder whose tokenizer must be read from its tokenizer.json as is (its
    tokenizer_config.json names a class of `GENERIC_TOKENIZER_CLASSES`: the project tokenizer)."""
    config = Path(name_or_path) / "tokenizer_config.json"
    return config.is_file() and json.loads(config.read_text()).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES


def make_prompt_fn(tokenizer: PreTrainedTokenizerFast):
    """The `prompt_fn` of `LLMAgent` / `collect_episode` for `tokenizer`: its chat template,
    with the assistant's turn opened."""
    return lambda chat: tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
