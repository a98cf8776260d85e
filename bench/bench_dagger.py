"""Does DAgger lift the warm start beyond plain imitation for the same training? On the validation split.

    make bench-dagger                                   # the default configuration's warm start
    python bench/bench_dagger.py --campaigns 50 --episodes 120
    python bench/bench_dagger.py --warm_start_episodes 600 --campaigns 100   # from a larger warm start

From the cached default warm start (built first if it is not), two continuations of the same
size, each one pass of SFT (`lib.training.warm_start.continuation_pass`) on as many examples, from
`--learning_rate` (default `TrainConfig.warm_start_dagger_learning_rate`):

* **imitation**: the decisions of `--campaigns` fresh heuristic campaigns (seeds after the warm
  start's), with as many of the warm start's own demonstrated decisions;
* **DAgger**: one round (`lib.training.dagger`): the learner plays `--campaigns` training
  campaigns, the demonstrator labels every decision it made, with as many demonstrated decisions.

Each policy, the warm start included, then plays the validation split's first `--episodes`
campaigns greedily (`lib.measure.evaluation.validation_suite`, never the held-out suite). Prints
successes, unseen particles found, how the episodes ended, and each arm's seconds (DAgger's
include the learner's campaigns); `--json PATH` writes them.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections import Counter
from dataclasses import astuple
from typing import Any, Dict, List


def outcome(episodes: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Successes, particles found (of the episodes with one) and endings of a validation evaluation."""
    from lib.episodes.records import episode_ending

    with_particle = [e for e in episodes if (e.get("truth") or {}).get("exists")]
    return {
        "episodes": len(episodes),
        "correct": sum(bool(e.get("correct_outcome")) for e in episodes),
        "particles_found": sum(bool(e.get("correct_outcome")) for e in with_particle),
        "with_particle": len(with_particle),
        "mean_reward": sum(e["cumulative_reward"] for e in episodes) / max(1, len(episodes)),
        "endings": dict(Counter(episode_ending(e) for e in episodes)),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--campaigns", type=int, default=50, help="campaigns per continuation")
    parser.add_argument("--episodes", type=int, default=120, help="validation campaigns each policy plays")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--learning_rate", type=float, help="each continuation's peak learning rate")
    parser.add_argument(
        "--warm_start_episodes", type=int, help="the warm start continued from (default: the configuration's)"
    )
    args = parser.parse_args(argv)

    import numpy as np

    from lib.measure.evaluation import validation_suite
    from lib.measure.metrics import paired_difference
    from lib.seeds import BOOTSTRAP_SEED, DAGGER_SEED, DEMONSTRATION_SEED
    from lib.training.backends import load_policy
    from lib.training.config import TrainConfig
    from lib.training.dagger import labelled_learner_decisions
    from lib.training.policy_evaluation import evaluate_policy
    from lib.training.tokenizer import corpus_specs
    from lib.training.warm_start import continuation_pass, demonstration_examples, demonstration_layout, sft_warm_start

    config = TrainConfig()
    if args.learning_rate is not None:
        config = TrainConfig(**{**config.to_dict(), "warm_start_dagger_learning_rate": args.learning_rate})
    if args.warm_start_episodes is not None:
        config = TrainConfig(**{**config.to_dict(), "warm_start_episodes": args.warm_start_episodes})
    policy = load_policy(config, "trl")
    report = sft_warm_start(policy, config)
    print(f"warm start: {report.get('cached')} ({config.warm_start_episodes} campaigns)", flush=True)
    layout = demonstration_layout(config)
    demonstrations = demonstration_examples(policy.tokenizer, config.warm_start_episodes, **layout)
    suite = list(validation_suite(args.episodes))
    results: Dict[str, Any] = {
        "campaigns": args.campaigns,
        "episodes": len(suite),
        "learning_rate": config.warm_start_dagger_learning_rate,
    }

    start = time.perf_counter()
    warm = evaluate_policy(policy.model, policy.tokenizer, suite, config, agent_name="warm")
    results["warm start"] = outcome(warm)
    results["warm start"]["evaluation_s"] = time.perf_counter() - start
    print("warm start:", json.dumps(results["warm start"]), flush=True)

    rng = np.random.default_rng(config.seed)
    fresh_specs = corpus_specs(config.warm_start_episodes + args.campaigns, DEMONSTRATION_SEED)
    for arm in ("imitation", "DAgger"):
        learner = copy.copy(policy)
        learner.model = copy.deepcopy(policy.model)
        start = time.perf_counter()
        if arm == "imitation":
            new = demonstration_examples(
                policy.tokenizer, args.campaigns, specs=fresh_specs[config.warm_start_episodes :], **layout
            )
            stats: Dict[str, Any] = {}
        else:
            new, stats = labelled_learner_decisions(learner, config, args.campaigns, first_seed=DAGGER_SEED)
        trainer, examples = continuation_pass(learner, config, new, demonstrations, rng)
        seconds = time.perf_counter() - start
        played = evaluate_policy(trainer.model, policy.tokenizer, suite, config, agent_name=arm)
        results[arm] = {
            **outcome(played),
            **{
                f"delta_{metric}": list(astuple(paired_difference(warm, played, metric, seed=BOOTSTRAP_SEED))[:3])
                for metric in ("success_rate", "mean_reward")
            },
            "training_s": seconds,
            "examples": len(examples),
            "steps": trainer.state.global_step,
            **{f"round_{k}": v for k, v in stats.items()},
        }
        print(f"{arm}:", json.dumps(results[arm]), flush=True)

    print()
    print("| policy | correct | Δ success [95%] | unseen particles found | mean reward | seconds of training |")
    print("|---|---|---|---|---|---|")
    for name in ("warm start", "imitation", "DAgger"):
        r = results[name]
        delta = "{:+.3f} [{:+.3f}, {:+.3f}]".format(*r["delta_success_rate"]) if "delta_success_rate" in r else "—"
        print(
            f"| {name} | {r['correct']} of {r['episodes']} | {delta} | {r['particles_found']} of {r['with_particle']} "
            f"| {r['mean_reward']:+.2f} | {r.get('training_s', 0):.0f} |"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
