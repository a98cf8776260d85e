"""The stand-in model's tokenizer: deterministic training, chat template, round trips, cache."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

import lib.training.tokenizer as tokenizer_module
from cernenv import CERNCollisionEnvironment
from lib.agents.baselines import HeuristicAgent
from lib.agents.prompting import SYSTEM_PROMPT, action_to_json, build_chat
from lib.episodes.agent_rollouts import transitions
from lib.training.tokenizer import ASSISTANT, END, PAD, SPECIAL_TOKENS, build_tokenizer, make_prompt_fn

SMALL = {"vocab_size": 512, "n_episodes": 4}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizer")


@pytest.fixture(scope="module")
def tokenizer(cache):
    return build_tokenizer(cache_dir=str(cache), **SMALL)


@pytest.fixture(scope="module")
def episode():
    env = CERNCollisionEnvironment()
    return list(transitions(env, HeuristicAgent(), seed=900_001, scenario="higgs_diphoton_125"))


def test_same_inputs_give_the_same_vocabulary(tokenizer, tmp_path):
    again = build_tokenizer(cache_dir=str(tmp_path), **SMALL)  # trained afresh in another directory
    assert again.get_vocab() == tokenizer.get_vocab()
    assert (
        json.loads(again.backend_tokenizer.to_str())["model"]["merges"]
        == json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    )
    assert len(tokenizer) == SMALL["vocab_size"] and isinstance(tokenizer, PreTrainedTokenizerFast)


def test_special_tokens_and_chat_template(tokenizer, episode):
    assert tokenizer.eos_token == END and tokenizer.pad_token == PAD
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    for token in SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(token) != tokenizer.unk_token_id
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(token)]
    obs, action, _ = episode[5]
    prompt = make_prompt_fn(tokenizer)(build_chat(obs))
    assert prompt.startswith(f"<|system|>\n{SYSTEM_PROMPT}<|end|>\n<|user|>\n")
    assert prompt.endswith(f"<|end|>\n{ASSISTANT}\n")
    full = tokenizer.apply_chat_template(
        build_chat(obs) + [{"role": "assistant", "content": action_to_json(action)}], tokenize=False
    )
    assert full == prompt + action_to_json(action) + "<|end|>\n"


def test_prompts_and_actions_round_trip(tokenizer, episode):
    prompt_fn = make_prompt_fn(tokenizer)
    for obs, action, _ in episode[::4]:
        for text in (prompt_fn(build_chat(obs)), action_to_json(action), 'odd output: ü ∆ {"x": 1e-9} \t\n'):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.decode(ids) == text
    ids = tokenizer(prompt_fn(build_chat(episode[0][0])), add_special_tokens=False)["input_ids"]
    assert len(ids) < 0.6 * len(prompt_fn(build_chat(episode[0][0])))  # BPE learned the environment's words


def test_cached_tokenizer_is_reloaded_not_retrained(tokenizer, cache, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("the cached tokenizer should have been loaded")

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", no_training)
    reloaded = build_tokenizer(cache_dir=str(cache), **SMALL)
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    assert reloaded.chat_template == tokenizer.chat_template and reloaded.eos_token == END
    with pytest.raises(AssertionError, match="cached"):  # other settings are another tokenizer
        build_tokenizer(cache_dir=str(cache), vocab_size=600, n_episodes=SMALL["n_episodes"])


def test_vocab_size_must_cover_the_bytes(cache):
    with pytest.raises(ValueError, match="256 bytes"):
        build_tokenizer(cache_dir=str(cache), vocab_size=100, n_episodes=1)


def test_default_caches_are_at_the_repository_root_whatever_the_working_directory(tmp_path, monkeypatch):
    """Notebooks run in notebooks/: a cwd-relative cache made them rebuild the 30-minute warm start."""
    from pathlib import Path

    from lib.training.policy_model import untrained_stand_in

    root = Path(tokenizer_module.__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    tokenizer = build_tokenizer()
    assert list((root / ".cache" / "tokenizer").glob("bpe-*/tokenizer.json"))
    assert Path(untrained_stand_in(tokenizer).name_or_path).parent == root / ".cache" / "policy"
    assert not (tmp_path / ".cache").exists(), "nothing cached under the working directory"


def test_fingerprint_sees_every_kind_of_corpus_episode(monkeypatch):
    """A cached tokenizer is reused only while the corpus it was trained on is unchanged: the
    fingerprint must move when the procedural campaigns or the random agent's episodes change
    (the heuristic on a curated campaign was the only probe before)."""
    settings = (SMALL["vocab_size"], SMALL["n_episodes"])
    before = tokenizer_module._fingerprint(*settings)
    assert tokenizer_module._fingerprint(*settings) == before  # deterministic

    with monkeypatch.context() as patch:  # the random agent draws other actions
        real_random = tokenizer_module.RandomAgent
        patch.setattr(tokenizer_module, "RandomAgent", lambda seed: real_random(seed=seed + 1))
        assert tokenizer_module._fingerprint(*settings) != before

    real_specs = tokenizer_module.corpus_specs

    def other_procedural(n_episodes, first_seed=tokenizer_module.CORPUS_SEED):
        specs = real_specs(n_episodes, first_seed)
        return [dict(spec, seed=spec["seed"] + 2) if "difficulty" in spec else spec for spec in specs]

    with monkeypatch.context() as patch:  # the procedural campaign is another one
        patch.setattr(tokenizer_module, "corpus_specs", other_procedural)
        assert tokenizer_module._fingerprint(*settings) != before
