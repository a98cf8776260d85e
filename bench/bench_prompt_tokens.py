"""Tokens per decision with a real model's tokenizer, in the `turn` and `conversation` contexts.

    python bench/bench_prompt_tokens.py                          # SmolLM2-135M-Instruct's tokenizer
    python bench/bench_prompt_tokens.py --model cernenv-tiny     # the stand-in's, for comparison

Plays `HeuristicAgent` on the first campaigns of the validation split (`--episodes`) and lays each
one out as the policy reads it, with the system prompt (a real model's setting):

* `turn`: one fresh chat per decision (the system prompt and the whole observation), so a decision
  costs its whole prompt: its tokens, and the system prompt's share of them;
* `conversation`: the campaign as one chat: a decision costs the tokens added since the last one
  (the environment's message and the reply), a campaign the whole conversation; with and
  without `compact_followups` (the logbook and references lines left out while they repeat), and
  in the `brief` style (`LLMAgentConfig.style`: what SmolLM2's configurations play).

Prints one table (median and 95th percentile over decisions, or over campaigns).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List

import numpy as np

from lib.agents.baselines import HeuristicAgent
from lib.agents.prompting import SYSTEM_PROMPT, LLMAgentConfig, action_to_json, build_chat
from lib.episodes.agent_rollouts import transitions
from lib.episodes.chat import ChatLayout
from lib.measure.evaluation import PUBLISHED_KEY, validation_suite


def campaign_tokens(tokenizer: Any, specs, config: LLMAgentConfig) -> Dict[str, List[float]]:
    """Per decision: `turn` prompt tokens and, after the first, the `conversation` tokens added (the
    environment's message and the reply); per campaign: the conversation's tokens, its first prompt,
    and the decisions."""
    layout, env, agent = ChatLayout(tokenizer, config), PUBLISHED_KEY.make_env(), HeuristicAgent()
    out: Dict[str, List[float]] = {"turn": [], "added": [], "campaign": [], "first": [], "decisions": []}
    for spec in specs:
        messages: List[Dict[str, str]] = []
        total = decisions = 0
        message_tokens = None  # the environment's message before this decision
        for obs, action, next_obs in transitions(
            env, agent, seed=spec.seed, scenario=spec.scenario, difficulty=spec.difficulty
        ):
            out["turn"].append(len(layout.prompt_ids(build_chat(obs, config))))
            reply = action_to_json(action, justification=False)
            reply_tokens = len(tokenizer(reply, add_special_tokens=False)["input_ids"]) + 1  # its eos
            if message_tokens is not None:
                out["added"].append(message_tokens + reply_tokens)
            if not messages:
                messages = layout.first_messages(obs)
                total = len(layout.prompt_ids(messages))
                out["first"].append(total)
            messages.append({"role": "assistant", "content": reply})
            total += reply_tokens
            decisions += 1
            if next_obs.done:
                break
            message_tokens = len(layout.environment_ids(messages, next_obs, reply_ended=True))
            messages.append(layout.followup_message(next_obs, messages))
            total += message_tokens
        out["campaign"].append(total)
        out["decisions"].append(decisions)
    return out


def load_tokenizer_named(name: str) -> Any:
    from lib.training.config import TINY_MODEL

    if name == TINY_MODEL:
        from lib.training.tokenizer import build_tokenizer

        return build_tokenizer()
    from lib.training.backends import model_source
    from lib.training.tokenizer import load_tokenizer

    return load_tokenizer(model_source(name))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer (a model_name)")
    parser.add_argument("--episodes", type=int, default=30, help="campaigns of the validation split")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer_named(args.model)
    specs = validation_suite(args.episodes)
    plain = campaign_tokens(tokenizer, specs, LLMAgentConfig())
    compact = campaign_tokens(tokenizer, specs, LLMAgentConfig(compact_followups=True))
    brief = campaign_tokens(tokenizer, specs, LLMAgentConfig(style="brief"))
    system = len(tokenizer(SYSTEM_PROMPT, add_special_tokens=False)["input_ids"])
    decisions = int(sum(plain["decisions"]))
    print(f"tokenizer of {args.model}: {len(specs)} validation campaigns, {decisions} decisions")
    print(f"system prompt alone: {system} tokens")
    print(f"{'tokens':<52}{'median':>9}{'p95':>9}{'mean':>9}")

    def row(label: str, values: List[float]) -> None:
        v = np.asarray(values, dtype=float)
        print(f"{label:<52}{np.median(v):>9.0f}{np.percentile(v, 95):>9.0f}{v.mean():>9.1f}")

    row("turn: prompt per decision", plain["turn"])
    print(f"{'turn: the system prompt share of it':<52}{system / np.median(plain['turn']):>9.0%}")
    row("conversation: first prompt", plain["first"])
    row("conversation: new tokens per later decision", plain["added"])
    row("conversation: whole campaign", plain["campaign"])
    row("conversation, compact: new tokens per later decision", compact["added"])
    row("conversation, compact: whole campaign", compact["campaign"])
    row("conversation, brief: first prompt", brief["first"])
    row("conversation, brief: new tokens per later decision", brief["added"])
    row("conversation, brief: whole campaign", brief["campaign"])
    per_decision = [c / d for c, d in zip(plain["campaign"], plain["decisions"])]
    per_decision_compact = [c / d for c, d in zip(compact["campaign"], compact["decisions"])]
    row("conversation: campaign tokens / decisions", per_decision)
    row("conversation, compact: campaign tokens / decisions", per_decision_compact)
    return 0


if __name__ == "__main__":
    sys.exit(main())
