"""A trained language-model policy as an agent like any other (`reset()`, `act(observation)`), so that
`make evaluate` scores it through the server as an outside entrant:

    make evaluate AGENT=lib.training.policy_agent:TrainedPolicyAgent SUITE=dev:20 \\
        POLICY_CONFIG=configs/train/smollm2-cpu.yaml POLICY_ADAPTER=build/smollm2/grpo/final

The agent plays a campaign exactly as `lib.episodes.llm_rollouts.play_episodes` plays it in the
`conversation` context (the training's and the evaluations' way): one growing chat laid out by the
model's chat template, each observation written in the configuration's style, each reply decoded
greedily (`TrainConfig.evaluation_sampling`) and held to the grammar of the references its
observation shows, with the conversation's KV cache kept between turns (`CachedGenerator`). The
configuration file and the LoRA adapter (a folder `save_pretrained` wrote; none: the base model) come
from the environment variables `POLICY_CONFIG` and `POLICY_ADAPTER`, which `make evaluate` passes to
the agent's process, or from the constructor's arguments.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from cernenv.models import CollisionObservation
from lib.agents.prompting import ReplyScope, parse_reply
from lib.episodes.chat import ChatLayout
from lib.episodes.generation import hf_generate_fn

POLICY_CONFIG_ENV = "POLICY_CONFIG"
"""The environment variable naming the policy's training configuration (a `configs/train/*.yaml` file)."""
POLICY_ADAPTER_ENV = "POLICY_ADAPTER"
"""The environment variable naming the folder of its LoRA adapter (unset: the base model alone)."""


def check_adapter_readable(adapter: str) -> None:
    """Refuse an adapter folder this process's user cannot read whole (make evaluate plays the agent
    as a user of its own, and a model's weights are often written 0600), saying the `chmod` that
    fixes it, and a folder that holds no adapter."""
    if os.path.isdir(adapter):
        names = os.listdir(adapter) if os.access(adapter, os.R_OK | os.X_OK) else None
        if names is None or not all(os.access(os.path.join(adapter, name), os.R_OK) for name in names):
            raise PermissionError(
                f"{POLICY_ADAPTER_ENV}={adapter} cannot be read whole by this process's user (make evaluate "
                f"plays the agent as a user of its own): chmod -R a+rX {adapter}"
            )
    if not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        raise FileNotFoundError(
            f"{POLICY_ADAPTER_ENV}={adapter} holds no adapter_config.json: name an adapter's folder"
        )


class TrainedPolicyAgent:
    """A policy trained by `lib.training` (its base model, its adapter, its observation style) as an agent."""

    def __init__(self, config_path: Optional[str] = None, adapter: Optional[str] = None) -> None:
        from lib.training.backends import load_policy
        from lib.training.cli import parse_train_config

        config_path = config_path or os.environ.get(POLICY_CONFIG_ENV)
        adapter = adapter or os.environ.get(POLICY_ADAPTER_ENV) or None
        if not config_path:
            raise ValueError(
                f"say which policy to play: {POLICY_CONFIG_ENV}=configs/train/NAME.yaml "
                f"[{POLICY_ADAPTER_ENV}=folder of its LoRA adapter]"
            )
        if adapter is not None:
            check_adapter_readable(adapter)
        config, _ = parse_train_config(["--config", config_path])
        policy = load_policy(config, "trl")
        model = policy.model
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()  # played, not trained: merged
        self._start(model, policy.tokenizer, config)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, config: Any) -> "TrainedPolicyAgent":
        """The agent of a policy already in memory (`config`: its `TrainConfig`)."""
        agent = cls.__new__(cls)
        agent._start(model, tokenizer, config)
        return agent

    def _start(self, model: Any, tokenizer: Any, config: Any) -> None:
        if config.policy_context != "conversation":
            raise ValueError(
                f"the agent plays a campaign as one conversation; the policy's context is {config.policy_context!r}"
            )
        self.tokenizer = tokenizer
        self.layout = ChatLayout(tokenizer, config.observation_config)
        self.sampling = config.evaluation_sampling
        self.generate = hf_generate_fn(model, tokenizer, "cached")
        self.reset()

    def reset(self) -> None:
        self.messages: List[Dict[str, str]] = []
        self.context: List[int] = []
        self._reply_ended = True

    def act(self, observation: CollisionObservation) -> Any:
        """The policy's reply to `observation`, parsed (`parse_reply`'s payload: the action, or what
        the environment will refuse)."""
        if not self.messages:
            self.messages = self.layout.first_messages(observation)
            self.context = self.layout.prompt_ids(self.messages)
        else:
            self.context += self.layout.environment_ids(self.messages, observation, reply_ended=self._reply_ended)
            self.messages.append(self.layout.followup_message(observation, self.messages))
        shown = {"shown": [ReplyScope.of(observation)]} if self.sampling.constrained else {}
        [(tokens, _)] = self.generate([list(self.context)], self.sampling, **shown)
        self._reply_ended = bool(tokens) and tokens[-1] == self.tokenizer.eos_token_id
        text = self.tokenizer.decode(tokens[:-1] if self._reply_ended else tokens, skip_special_tokens=True)
        self.context += tokens
        self.messages.append({"role": "assistant", "content": text})
        return parse_reply(text, observation.references).payload
