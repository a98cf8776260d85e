"""Context budget of the policy: tokens of a whole campaign as GRPO plays it, and of its first prompt.

    python bench/bench_prompt.py                 # or: --every 4

Plays HeuristicAgent over the held-out evaluation suite (`lib.measure.evaluation.heldout_suite`, the
published key's worlds: curated and procedural scenarios) and lays each campaign out as the
policy plays it (`lib.episodes.chat.ChatLayout` with the project's tokenizer: the system prompt and
the first observation, then each action and the environment's next message), and measures the
tokens of the whole conversation (what the policy reads at its last turn and the trainer
scores), of its first prompt, and of each later turn. Target: median campaign under 3,500 tokens
(3,000 before every message carried the references line, ~14 tokens a turn).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from lib.agents.baselines import HeuristicAgent
from lib.agents.prompting import action_to_json
from lib.episodes.agent_rollouts import transitions
from lib.episodes.chat import ChatLayout
from lib.measure.evaluation import PUBLISHED_KEY, heldout_suite

CAMPAIGN_TOKENS_MEDIAN_TARGET = 3500


def campaign_lengths(tokenizer, specs):
    """(first prompt tokens, whole campaign tokens, turns) of each HeuristicAgent campaign on `specs`."""
    layout, env, agent = ChatLayout(tokenizer), PUBLISHED_KEY.make_env(), HeuristicAgent()
    out = []
    for spec in specs:
        messages, first, total, turns = [], 0, 0, 0
        for obs, action, next_obs in transitions(
            env, agent, seed=spec.seed, scenario=spec.scenario, difficulty=spec.difficulty
        ):
            if not messages:
                messages = layout.first_messages(obs)
                first = total = len(layout.prompt_ids(messages))
            reply = action_to_json(action, justification=False)
            total += len(tokenizer(reply, add_special_tokens=False)["input_ids"]) + 1
            messages.append({"role": "assistant", "content": reply})
            turns += 1
            if next_obs.done:
                break
            total += len(layout.environment_ids(messages, next_obs, reply_ended=True))
            messages.append(layout.followup_message(next_obs))
        out.append((first, total, turns))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--every", type=int, default=1, help="play every n-th episode of the held-out suite")
    args = parser.parse_args()
    from lib.training.tokenizer import build_tokenizer

    specs = heldout_suite()[:: args.every]
    lengths = np.array(campaign_lengths(build_tokenizer(), specs), dtype=float)
    first, total, turns = lengths[:, 0], lengths[:, 1], lengths[:, 2]
    per_turn = (total - first) / np.maximum(turns, 1)
    print(f"{len(specs)} campaigns, {int(turns.sum())} turns")
    print(f"{'tokens':<28}{'median':>10}{'p95':>10}{'target':>10}")
    print(f"{'whole campaign':<28}{np.median(total):>10.0f}{np.percentile(total, 95):>10.0f}", end="")
    print(f"{CAMPAIGN_TOKENS_MEDIAN_TARGET:>10}")
    print(f"{'first prompt':<28}{np.median(first):>10.0f}{np.percentile(first, 95):>10.0f}")
    print(f"{'per later turn':<28}{np.median(per_turn):>10.0f}{np.percentile(per_turn, 95):>10.0f}")
    return 0 if np.median(total) < CAMPAIGN_TOKENS_MEDIAN_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
