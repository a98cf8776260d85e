"""The conversation of a campaign, laid out by a tokenizer's chat template.

An episode is one growing chat: the system prompt and the whole first observation, then
the model's action, the environment's next observation (`followup_message`), the model's
next action, and so on. `ChatLayout` turns it into token segments: the template decides
the layout, so any chat model works (the project's tokenizer, Qwen's ChatML). Each
environment segment is the template's text between the end of the model's reply and the
opening of its next turn, found by rendering the chat with and without the new user message.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Sequence, Tuple

from cernenv import CollisionObservation
from lib.agents.prompting import LLMAgentConfig, build_chat, compact_followup, render_brief, render_observation


def first_messages(obs: CollisionObservation, config: LLMAgentConfig = LLMAgentConfig()) -> List[Dict[str, str]]:
    """The conversation's opening: the system prompt and the whole first observation, the chat
    of a single decision (`lib.agents.prompting.build_chat`)."""
    return build_chat(obs, config)


def followup_message(
    obs: CollisionObservation, config: LLMAgentConfig = LLMAgentConfig(), messages: Sequence[Dict[str, str]] = ()
) -> Dict[str, str]:
    """A later observation: what changed (resources, data, the last result) and the logbook's key
    numbers, without the task the first message stated, so a conversation grows by ~100 tokens a
    turn and the numbers a claim quotes are always in its last message. With
    `config.compact_followups`, the logbook and references lines are left out where they repeat
    what the conversation so far (`messages`) last said (`lib.agents.prompting.compact_followup`); the
    `brief` style (`config.style`) writes `render_brief`'s message, its logbook line likewise only when
    it changed."""
    brief = config.style == "brief"
    text = render_brief(obs, include_task=False) if brief else render_observation(obs, config, include_task=False)
    if config.compact_followups or brief:
        text = compact_followup(text, [m["content"] for m in messages if m["role"] == "user"])
    return {"role": "user", "content": text}


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

    def followup_message(self, obs: CollisionObservation, messages: Sequence[Dict[str, str]] = ()) -> Dict[str, str]:
        return followup_message(obs, self.observation_config, messages)

    def prompt_ids(self, messages: List[Dict[str, str]]) -> List[int]:
        return self._ids(self._render(messages, add_generation_prompt=True))

    def environment_ids(
        self, messages: List[Dict[str, str]], obs: CollisionObservation, *, reply_ended: bool
    ) -> List[int]:
        """Tokens between the model's last reply (the last message of `messages`) and its
        next turn: what the template closes the reply with (less the eos the model already
        wrote, when it did), the user message showing `obs`, and the next assistant header."""
        before = self._render(messages, add_generation_prompt=False)
        user = self.followup_message(obs, messages)
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


def model_spans(mask: Sequence[int]) -> Iterator[Tuple[int, int]]:
    """(start, end) of each run of 1s in `mask` (an `env_mask` or a loss mask): one reply of the
    model, eos included, between the environment's texts."""
    start = 0
    while start < len(mask):
        if not mask[start]:
            start += 1
            continue
        end = start
        while end < len(mask) and mask[end]:
            end += 1
        yield start, end
        start = end
