"""Prompt budget of the LLM agent: characters and tokens per prompt.

    python bench/bench_prompt.py                 # or: --every 4 --no-tokenizer

Plays HeuristicAgent over the held-out evaluation suite (`lib.evaluation.heldout_suite`:
curated and procedural scenarios) and measures,
for every observation it sees, the prompt `build_chat` makes: characters of the plain
text (system + user) and tokens of the chat-templated prompt with the project's
tokenizer (`lib.tokenizer.build_tokenizer`, trained and cached on first use).
Target: median below 2,000 characters.
"""

from __future__ import annotations

import argparse
import sys

from cernenv import CERNCollisionEnvironment
from lib.baselines import HeuristicAgent
from lib.evaluation import heldout_suite
from lib.prompting import prompt_budget
from lib.rollouts import transitions

CHARS_MEDIAN_TARGET = 2000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=int, default=1, help="play every n-th episode of the held-out suite")
    parser.add_argument("--no-tokenizer", action="store_true", help="characters only (skips the tokenizer)")
    args = parser.parse_args()
    env, agent = CERNCollisionEnvironment(), HeuristicAgent()
    specs = heldout_suite()[:: args.every]
    observations = [
        obs
        for spec in specs
        for obs, _, _ in transitions(env, agent, seed=spec.seed, scenario=spec.scenario, difficulty=spec.difficulty)
    ]
    tokenizer = None
    if not args.no_tokenizer:
        from lib.tokenizer import build_tokenizer

        tokenizer = build_tokenizer()
    budget = prompt_budget(observations, tokenizer)
    print(f"{len(specs)} episodes, {budget['n_prompts']} prompts; system prompt {budget['system_chars']} characters")
    print(f"{'prompt size':<24}{'median':>10}{'p95':>10}{'target':>10}")
    print(f"{'characters':<24}{budget['chars_median']:>10.0f}{budget['chars_p95']:>10.0f}{CHARS_MEDIAN_TARGET:>10}")
    if tokenizer is not None:
        print(f"{'tokens (chat template)':<24}{budget['tokens_median']:>10.0f}{budget['tokens_p95']:>10.0f}{'':>10}")
    return 0 if budget["chars_median"] < CHARS_MEDIAN_TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
