"""`compact_followups` (`LLMAgentConfig`, `TrainConfig`): a conversation's later messages leave out the
logbook and references lines while they repeat what the conversation last said; off by default,
where every message is as it was (the committed evidence replays its prompts byte for byte)."""

from __future__ import annotations

import pytest

from lib.agents.baselines import HeuristicAgent
from lib.agents.prompting import REPEATABLE_LINES, LLMAgentConfig, Sampling, action_to_json, render_observation
from lib.episodes.agent_rollouts import transitions
from lib.episodes.chat import ChatLayout, followup_message
from lib.episodes.llm_rollouts import play_episodes
from lib.measure.evaluation import PUBLISHED_KEY, validation_suite
from lib.training import TrainConfig
from lib.training.warm_start import demonstration_examples

COMPACT = LLMAgentConfig(compact_followups=True)


def _campaign(config: LLMAgentConfig, tokenizer):
    """A heuristic campaign laid out as one conversation: (its messages, its observations after the first)."""
    spec = validation_suite(1)[0]
    layout, env = ChatLayout(tokenizer, config), PUBLISHED_KEY.make_env()
    messages, later = [], []
    for obs, action, next_obs in transitions(env, HeuristicAgent(), seed=spec.seed, difficulty=spec.difficulty):
        messages = messages or layout.first_messages(obs)
        messages.append({"role": "assistant", "content": action_to_json(action, justification=False)})
        if next_obs.done:
            break
        messages.append(layout.followup_message(next_obs, messages))
        later.append(next_obs)
    return messages, later


def test_by_default_a_later_message_is_the_observation_rendered_whole(tokenizer):
    messages, later = _campaign(LLMAgentConfig(), tokenizer)
    users = [m["content"] for m in messages if m["role"] == "user"][1:]
    assert users == [render_observation(obs, include_task=False) for obs in later]
    assert followup_message(later[0]) == followup_message(later[0], LLMAgentConfig(), messages)


def test_a_compact_message_drops_exactly_the_lines_that_repeat_the_last_ones_said(tokenizer):
    messages, later = _campaign(COMPACT, tokenizer)
    users = [m["content"] for m in messages if m["role"] == "user"]
    last_said = {head: line for line in users[0].split("\n") for head in REPEATABLE_LINES if line.startswith(head)}
    dropped = 0
    for text, obs in zip(users[1:], later):
        whole = render_observation(obs, include_task=False).split("\n")
        kept = text.split("\n")
        for line in whole:
            head = next((h for h in REPEATABLE_LINES if line.startswith(h)), None)
            if head and last_said.get(head) == line:
                assert line not in kept
                dropped += 1
            else:
                assert line in kept, line
                if head:
                    last_said[head] = line
        assert [line for line in whole if line in kept] == kept, "the kept lines in their order"
    assert dropped > len(later) / 2, "most later messages repeat a line"


def test_compact_demonstrations_are_laid_out_as_grpo_plays_them(tokenizer):
    """The warm start's conversation, replayed through `play_episodes` with its replies: the same tokens."""
    (example,) = demonstration_examples(tokenizer, 1, observation_config=COMPACT)
    ids, mask = example["input_ids"], example["completion_mask"]
    replies, start = [], None
    for i, bit in enumerate(mask + [0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            replies.append(ids[start:i])
            start = None

    def scripted(contexts, sampling):
        return [(reply, [0.0] * len(reply)) for reply in (replies.pop(0) for _ in contexts)]

    from lib.seeds import DEMONSTRATION_SEED
    from lib.training.tokenizer import corpus_specs

    (spec,) = corpus_specs(1, DEMONSTRATION_SEED)
    (played,) = play_episodes(
        scripted, tokenizer, [spec], sampling=Sampling(max_new_tokens=512), observation_config=COMPACT
    )
    assert played.prompt_ids + played.completion_ids == ids and not replies
    plain = demonstration_examples(tokenizer, 1)[0]["input_ids"]
    assert len(ids) < len(plain), "the compact conversation is shorter"


def test_compact_followups_are_a_conversation_setting():
    config = TrainConfig(policy_context="conversation", system_prompt=True, compact_followups=True)
    assert config.observation_config == COMPACT
    with pytest.raises(ValueError, match="compact_followups .* needs policy_context 'conversation'"):
        TrainConfig(policy_context="turn", compact_followups=True)
