"""Multi-turn play in token space: the layout the trainer scores is the chat the model saw."""

from __future__ import annotations

import json

import pytest
import torch

from cernenv import CERNCollisionEnvironment
from cernenv.rewards import COMPONENT_NAMES
from lib.agents.baselines import HeuristicAgent
from lib.agents.prompting import LLMAgentConfig, Sampling, action_to_json, build_chat, parse_reply
from lib.episodes.agent_rollouts import collect_agent_episode
from lib.episodes.chat import ChatLayout, first_messages
from lib.episodes.generation import hf_generate_fn
from lib.episodes.llm_rollouts import play_episodes

SCRIPTED = Sampling(temperature=0.0)
"""The sampling passed with `scripted`, which ignores it."""


def scripted(tokenizer, replies, *, eos=True):
    """A GenerateFn that answers the n-th call for each context length class with `replies` in turn."""
    calls = {"n": 0}

    def generate(contexts, sampling):
        reply = replies[min(calls["n"], len(replies) - 1)]
        calls["n"] += 1
        ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
        return [(list(ids), [-0.5] * len(ids)) for _ in contexts]

    return generate


def test_token_layout_is_the_chat_template_of_the_conversation(tokenizer):
    replies = [
        '{"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6}}',
        '{"action_type": "set_trigger", "parameters": {"trigger": "diphoton"}}',
        "not json at all",
    ]
    [episode] = play_episodes(
        scripted(tokenizer, replies), tokenizer, [(11, "higgs_diphoton_125", None)], sampling=SCRIPTED, max_turns=3
    )
    record = episode.record
    assert record.n_steps == 3 and episode.truncated
    # the model's tokens, in order, are exactly its three replies each closed by eos
    model_tokens = [t for t, m in zip(episode.completion_ids, episode.env_mask) if m]
    expected = sum(
        (tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in replies), []
    )
    assert model_tokens == expected
    # prompt + completion decodes to the conversation rendered by the chat template
    env = CERNCollisionEnvironment()
    messages = first_messages(env.reset(seed=11, scenario="higgs_diphoton_125"))
    layout = ChatLayout(tokenizer)
    for i, reply in enumerate(replies):
        messages.append({"role": "assistant", "content": reply})
        obs = env.step(parse_reply(reply).payload)
        if i < len(replies) - 1:
            messages.append(layout.followup_message(obs))
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    decoded = tokenizer.decode(episode.prompt_ids + episode.completion_ids)
    assert rendered.startswith(decoded) and rendered[len(decoded) :] == "\n", "only the template's final newline"
    # environment tokens carry no sampling log-probability
    assert all(lp == 0.0 for lp, m in zip(episode.logprobs, episode.env_mask) if not m)
    assert all(lp == -0.5 for lp, m in zip(episode.logprobs, episode.env_mask) if m)
    assert episode.env_mask[-1] == 1, "a completion ends on the model's last token"
    assert [s.parsed_ok for s in record.steps] == [True, True, False]
    assert record.steps[2].parse_error and "INVALID_ACTION" in " ".join(record.steps[2].rule_violations)


def test_a_policy_that_writes_the_heuristics_actions_earns_the_heuristics_reward(tokenizer):
    """The text round trip (JSON → tokens → decode → parse → env) changes nothing."""
    spec = dict(seed=321, scenario=None, difficulty="easy")
    reference = collect_agent_episode(env=CERNCollisionEnvironment(), agent=HeuristicAgent(), **spec)
    replies = [
        json.dumps({"action_type": s.action["action_type"], "parameters": s.action["parameters"]})
        for s in reference.steps
    ]
    [episode] = play_episodes(scripted(tokenizer, replies), tokenizer, [spec], sampling=SCRIPTED)
    assert not episode.truncated
    assert episode.record.total_reward == pytest.approx(reference.total_reward)
    assert episode.record.correct_outcome == reference.correct_outcome
    assert sum(episode.record.reward_components[n] for n in COMPONENT_NAMES) == pytest.approx(
        episode.record.total_reward
    )


@pytest.mark.parametrize("system_prompt", [True, False])
def test_in_the_turn_context_each_action_reads_the_current_observation_alone(tokenizer, system_prompt):
    """Each decision's context is the chat of the observation it answers (`build_chat`), nothing
    of earlier turns; the campaign plays as in the conversation context (same actions, same
    reward), and the episode's completion is its replies one after another."""
    spec = dict(seed=321, scenario=None, difficulty="easy")
    reference = collect_agent_episode(env=CERNCollisionEnvironment(), agent=HeuristicAgent(), **spec)
    replies = [json.dumps({k: s.action[k] for k in ("action_type", "parameters")}) for s in reference.steps]
    config = LLMAgentConfig(system_prompt=system_prompt)
    seen = []

    def generate(contexts, sampling):
        seen.extend(contexts)
        return scripted(tokenizer, [replies[len(seen) - 1]])(contexts, sampling)

    [episode] = play_episodes(generate, tokenizer, [spec], sampling=SCRIPTED, context="turn", observation_config=config)
    assert episode.record.total_reward == pytest.approx(reference.total_reward)
    assert len(episode.turns) == len(replies) == len(seen)
    env, layout = CERNCollisionEnvironment(), ChatLayout(tokenizer, config)
    obs = env.reset(**spec)
    for turn, context, reply in zip(episode.turns, seen, replies):
        assert turn.prompt_ids == context == layout.prompt_ids(build_chat(obs, config))
        assert tokenizer.decode(turn.completion_ids) == reply + tokenizer.eos_token
        obs = env.step(parse_reply(reply).payload)
    assert (SYSTEM_PROMPT_OPENING in tokenizer.decode(seen[-1])) == system_prompt
    assert max(len(c) for c in seen) < 800, "a context does not grow with the campaign"
    assert episode.completion_ids == sum((t.completion_ids for t in episode.turns), [])
    assert set(episode.env_mask) == {1} and episode.prompt_ids == seen[0]


SYSTEM_PROMPT_OPENING = "You are an experimental particle physicist"


def test_an_unknown_context_is_refused(tokenizer):
    with pytest.raises(ValueError, match="context must be one of"):
        play_episodes(scripted(tokenizer, ["{}"]), tokenizer, [(1, None, "easy")], sampling=SCRIPTED, context="window")


def test_an_unended_turn_is_closed_by_environment_text(tokenizer):
    reply = action_to_json(HeuristicAgent().act(CERNCollisionEnvironment().reset(seed=1, difficulty="easy")))
    [episode] = play_episodes(
        scripted(tokenizer, [reply], eos=False), tokenizer, [(1, None, "easy")], sampling=SCRIPTED, max_turns=2
    )
    text = tokenizer.decode(episode.completion_ids)
    assert text.count("<|end|>") >= 2
    first_env = episode.env_mask.index(0)
    assert episode.completion_ids[first_env] == tokenizer.eos_token_id, "eos added as environment text"


def test_sampling_is_reproducible_and_greedy_is_deterministic(tokenizer, model):
    specs = [(5, None, "easy"), (6, None, "medium")]
    generate = hf_generate_fn(model, tokenizer)
    sampled = Sampling(temperature=1.0, max_new_tokens=12)
    a = play_episodes(generate, tokenizer, specs, sampling=sampled, max_turns=2, seed=3)
    b = play_episodes(generate, tokenizer, specs, sampling=sampled, max_turns=2, seed=3)
    c = play_episodes(generate, tokenizer, specs, sampling=sampled, max_turns=2, seed=4)
    assert [e.completion_ids for e in a] == [e.completion_ids for e in b]
    assert [e.completion_ids for e in a] != [e.completion_ids for e in c]
    for e in a:
        assert len(e.completion_ids) == len(e.env_mask) == len(e.logprobs)
        assert all(lp <= 0.0 for lp in e.logprobs)
    greedy = Sampling(temperature=0.0, max_new_tokens=12)
    g1 = play_episodes(generate, tokenizer, specs, sampling=greedy, max_turns=2, seed=0)
    g2 = play_episodes(generate, tokenizer, specs, sampling=greedy, max_turns=2, seed=99)
    assert [e.completion_ids for e in g1] == [e.completion_ids for e in g2]


def test_sampling_logprobs_are_the_models(tokenizer, model):
    """The log-probabilities returned with a sample are the model's, at temperature 1."""
    [episode] = play_episodes(
        hf_generate_fn(model, tokenizer),
        tokenizer,
        [(8, None, "hard")],
        sampling=Sampling(temperature=1.0, max_new_tokens=10),
        max_turns=1,
    )
    ids = torch.tensor([episode.prompt_ids + episode.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(episode.prompt_ids) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(episode.completion_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(episode.logprobs), expected, atol=1e-4)


def test_context_limit_truncates(tokenizer):
    reply = '{"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6}}'
    [episode] = play_episodes(
        scripted(tokenizer, [reply]),
        tokenizer,
        [(2, None, "easy")],
        max_context_tokens=900,
        sampling=Sampling(max_new_tokens=50),
    )
    assert episode.truncated
    assert len(episode.prompt_ids) + len(episode.completion_ids) <= 900


def test_batched_decoding_matches_one_episode_at_a_time(tokenizer, model):
    """Stacking the episodes' caches with padding changes nothing but speed."""
    specs = [(21, None, "easy"), (22, "higgs_4l_125", None), (23, None, "hard")]
    greedy = Sampling(temperature=0.0, max_new_tokens=12)
    together = play_episodes(hf_generate_fn(model, tokenizer), tokenizer, specs, sampling=greedy, max_turns=3)
    alone = [
        play_episodes(hf_generate_fn(model, tokenizer), tokenizer, [spec], sampling=greedy, max_turns=3)[0]
        for spec in specs
    ]
    for a, b in zip(together, alone):
        assert a.completion_ids == b.completion_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.parametrize("constrained", [False, True])
def test_a_decoding_batch_that_outgrows_its_reserved_cache_decodes_the_same(tokenizer, model, monkeypatch, constrained):
    """The batch's cache is written into room reserved past the contexts; with almost none reserved
    it grows at nearly every pass, and the replies are those of the default room."""
    import lib.episodes.generation as generation

    specs = [(21, None, "easy"), (22, "higgs_4l_125", None), (23, None, "hard"), (24, None, None)]
    greedy = Sampling(temperature=0.0, max_new_tokens=40 if constrained else 12, constrained=constrained)
    roomy = play_episodes(hf_generate_fn(model, tokenizer), tokenizer, specs, sampling=greedy, max_turns=3)
    monkeypatch.setattr(generation, "RESERVED_SLACK_TOKENS", 1 - greedy.max_new_tokens)  # one position of room
    cramped = play_episodes(hf_generate_fn(model, tokenizer), tokenizer, specs, sampling=greedy, max_turns=3)
    for a, b in zip(roomy, cramped):
        assert a.completion_ids == b.completion_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_the_reserved_cache_layer_keeps_what_was_written_through_growth_and_row_drops():
    """`keys`/`values` are the positions written so far, in order, whether the room held them or the
    store was copied to grow; dropping batch rows keeps the others' positions."""
    from lib.episodes.generation import _left_pad_cache, _reserved_layer_class

    first = [torch.randn(1, 2, n, 4) for n in (3, 5)]
    layer = _reserved_layer_class()(_left_pad_cache(first, 5, 2), _left_pad_cache(first, 5, 2) * 2, 5, 2)
    assert torch.equal(layer.keys[0, :, :2], torch.zeros(2, 2, 4)) and torch.equal(layer.keys[0, :, 2:], first[0][0])
    written = [torch.randn(2, 2, n, 4) for n in (1, 3, 1)]  # the second outgrows the two positions of room
    for new in written:
        keys, values = layer.update(new, new * 2, 0)
        assert keys is layer.keys and values is layer.values
    expected = torch.cat([_left_pad_cache(first, 5)] + written, dim=2)
    assert layer.get_seq_length() == 10
    assert torch.equal(layer.keys, expected) and torch.equal(layer.values, expected * 2)
    layer.keep_rows(torch.tensor([1]))
    assert torch.equal(layer.keys, expected[1:]) and torch.equal(layer.values, expected[1:] * 2)


def test_a_turn_reads_every_contexts_new_tokens_in_one_pass_continuing_some_sessions_and_opening_others(
    tokenizer, model
):
    """The cached decoder's first pass of a call reads every context's new tokens together, left-padded
    to the longest: the cached prefix of a continued conversation is not read again. What it decodes
    for a call that continues one conversation and opens another is what a decoder with no caches
    decodes for each alone, and a context that is exactly a cached conversation is read afresh."""
    from lib.episodes.generation import CachedGenerator

    greedy = Sampling(temperature=0.0, max_new_tokens=6)
    texts = ["The beam is configured", "A spectrum of the dimuon channel with a bump at", "Claim"]
    contexts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    passes = []
    hook = model.register_forward_hook(
        lambda module, args, kwargs, out: passes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        generate = CachedGenerator(model, tokenizer)
        first = generate(contexts, greedy)
        assert passes[0] == (3, max(map(len, contexts)))
        assert len(passes) <= greedy.max_new_tokens  # one pass a token after the first (no grammar)
        more = tokenizer(" then the fit", add_special_tokens=False)["input_ids"]
        continued = contexts[0] + first[0][0] + more
        opened = tokenizer("Nothing there", add_special_tokens=False)["input_ids"]
        del passes[:]
        second = generate([continued, opened], greedy)
        assert passes[0] == (2, max(1 + len(more), len(opened)))  # a reply ends on a token its cache lacks
        again = generate([continued + second[0][0][:-1]], greedy)  # the whole of a cached conversation
    finally:
        hook.remove()
    alone = [CachedGenerator(model, tokenizer)([context], greedy)[0] for context in (continued, opened)]
    alone.append(CachedGenerator(model, tokenizer)([continued + second[0][0][:-1]], greedy)[0])
    for (tokens, logprobs), (tokens_alone, logprobs_alone) in zip(second + again, alone):
        assert tokens == tokens_alone
        assert logprobs == pytest.approx(logprobs_alone, abs=1e-4)
    with pytest.raises(ValueError, match="at least one token"):
        generate([[]], greedy)


def test_progress_counts_the_episodes_of_a_batch_as_they_end(tokenizer, monkeypatch):
    """A lockstep batch of long campaigns takes minutes: its progress counts each episode when it ends,
    with the turn reached, not all of them when the last one does."""
    import lib.episodes.llm_rollouts as llm_rollouts

    spec = dict(seed=321, scenario=None, difficulty="easy")
    reference = collect_agent_episode(env=CERNCollisionEnvironment(), agent=HeuristicAgent(), **spec)
    short = [
        json.dumps({"action_type": s.action["action_type"], "parameters": s.action["parameters"]})
        for s in reference.steps
    ]
    turn = {"n": 0}

    def generate(contexts, sampling):  # the second episode plays the same campaign a turn late
        n = turn["n"]
        late = short[n - 1] if n else "not json"
        replies = [short[n], late] if len(contexts) == 2 else [late]
        turn["n"] += 1
        ids = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in replies]
        return [(i, [-0.5] * len(i)) for i in ids]

    seen = []

    class Recorder:
        def __init__(self, label, total, unit):
            self.postfix = ""

        def set_postfix(self, text):
            self.postfix = text

        def update(self, done):
            seen.append((done, self.postfix))

    monkeypatch.setattr(llm_rollouts, "Progress", Recorder)
    played = play_episodes(
        generate,
        tokenizer,
        [spec, spec],
        sampling=SCRIPTED,
        progress="test",
    )
    assert [len(p.record.steps) for p in played] == [len(short), len(short) + 1]
    ended = len(short)
    assert seen[ended - 2] == (0, f"turn {ended - 1}"), "nothing counted before the first episode ends"
    assert seen[ended - 1] == (1, f"turn {ended}"), "the first episode counted at the turn it ends"
    assert seen[-1][0] == 2
