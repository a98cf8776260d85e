"""Refused actions per campaign with replies held to the grammar of every known reference name, to
the grammar of the references each observation shows, and to that grammar with the channels and
triggers each task offers (`ReplyScope`, what every run plays now).

    python bench/bench_refusals.py --episodes 30                     # the stand-in, random weights
    python bench/bench_refusals.py --episodes 30 --model smollm2-135m-instruct --observation-style brief
    python bench/bench_refusals.py --episodes 30 --temperature 0 --policy "$(python -m lib.training.warm_start \
        --config configs/train/smoke.yaml | tail -1)"                 # the smoke run's warm start

Plays the first `--episodes` campaigns of the validation split with the model (the CPU stand-in's
architecture with random weights, a named model zero-shot, or a saved policy: `--policy`), sampled
at `--temperature`, the same seeds each way; prints, each way, the refused actions per campaign,
how many of them were references to nothing the observation showed, how many a channel or trigger
the task does not offer, and the most common refusal.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Any, Dict, List

from cernenv.rules import Violation


def refusals(episodes: List[Any]) -> Dict[str, float]:
    """Refused actions per campaign, those refused as references to nothing shown, and those refused
    as an option the task does not offer."""
    refused = [violation for e in episodes for step in e.record.steps for violation in step.rule_violations]
    unshown = [v for v in refused if "refers to nothing the observation shows" in v or "cannot be scaled" in v]
    unoffered = [v for v in refused if v.startswith(Violation.UNAVAILABLE_OPTION.value)]
    common = Counter(v.split(":")[0] for v in refused).most_common(1)
    return {
        "per_campaign": len(refused) / len(episodes),
        "unshown_per_campaign": len(unshown) / len(episodes),
        "unoffered_per_campaign": len(unoffered) / len(episodes),
        "unoffered": ", ".join(f"{n} {kind}" for kind, n in Counter(v.split()[1] for v in unoffered).most_common()),
        "most_common": f"{common[0][0]} ({common[0][1]} of {len(refused)})" if common else "none",
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="cernenv-tiny", help="a model_name (cernenv-tiny: random weights)")
    parser.add_argument("--policy", default=None, help="a saved policy's folder instead (a cached warm start)")
    parser.add_argument("--episodes", type=int, default=30, help="campaigns of the validation split")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--observation-style", default="full", help="LLMAgentConfig.style")
    parser.add_argument("--max-turns", type=int, default=None, help="stop each campaign after this many turns")
    args = parser.parse_args(argv)
    from lib.agents.prompting import LLMAgentConfig, Sampling
    from lib.episodes.generation import hf_generate_fn
    from lib.episodes.llm_rollouts import play_episodes
    from lib.measure.evaluation import validation_suite
    from lib.training.config import TINY_MODEL

    if args.policy:
        from transformers import AutoModelForCausalLM

        from lib.training.tokenizer import load_tokenizer

        tokenizer, model = load_tokenizer(args.policy), AutoModelForCausalLM.from_pretrained(args.policy)
    elif args.model == TINY_MODEL:
        from lib.training.policy_model import build_tiny_model
        from lib.training.tokenizer import build_tokenizer

        tokenizer = build_tokenizer()
        model = build_tiny_model(tokenizer)
    else:
        from transformers import AutoModelForCausalLM

        from lib.training.backends import model_source
        from lib.training.tokenizer import load_tokenizer

        source = model_source(args.model)
        tokenizer, model = load_tokenizer(source), AutoModelForCausalLM.from_pretrained(source)
    generate = hf_generate_fn(model, tokenizer, "cached")
    config = LLMAgentConfig(style=args.observation_style, system_prompt=args.model != TINY_MODEL)
    sampling = Sampling(temperature=args.temperature, max_new_tokens=96, constrained=True)
    specs = validation_suite(args.episodes)

    def every_name(contexts, sampling, shown=None):  # the first grammar: no observation's references
        return generate(contexts, sampling)

    def references_only(contexts, sampling, shown=None):  # the second: the references, not the options
        return generate(contexts, sampling, shown=[dict(scope) for scope in shown])

    print(f"{args.policy or args.model}, {len(specs)} validation campaigns, temperature {args.temperature:g}:")
    arms = (
        ("every known name", every_name),
        ("the references shown", references_only),
        ("the references shown and the options offered", generate),
    )
    for label, engine in arms:
        played = play_episodes(
            engine, tokenizer, specs, sampling=sampling, observation_config=config, max_turns=args.max_turns, seed=0
        )
        counts = refusals(played)
        print(
            f"  held to the grammar of {label}: {counts['per_campaign']:.2f} refused actions a campaign, "
            f"{counts['unshown_per_campaign']:.2f} of them references to nothing shown, "
            f"{counts['unoffered_per_campaign']:.2f} options the task does not offer "
            f"({counts['unoffered'] or 'none'}); "
            f"most common: {counts['most_common']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
