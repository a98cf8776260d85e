"""What RL can reach from a policy: its greedy success, pass@1 and pass@k when it samples.

    make bench-pass-at-k                                   # the default warm start, unseen particles, k = 8
    python bench/bench_pass_at_k.py --policy PATH --k 8    # any saved policy folder
    python bench/bench_pass_at_k.py --split validation --episodes 60
    python bench/bench_pass_at_k.py --policy PATH --greedy-from evidence/pre_eval.jsonl.gz   # reuse its greedy play

Each episode of the chosen part (default: the held-out suite's unseen particles; `--split
validation` plays the validation split instead, `lib.measure.evaluation.validation_suite`) is
played greedily once and `k` times at the configuration's training temperature (GRPO's
sampling), with the published evaluation key. pass@1 is the mean success of the samples; pass@k
the share of episodes with at least one success among its k samples: an episode GRPO can learn
from is one a group of k samples sometimes solves; "mixed" the share whose samples both succeed and
fail. Success is the grade's `correct_outcome`.
`--greedy-from` reads the greedy play from an evaluation file of the same policy on the suite (a
run's `pre_eval.jsonl.gz` for its warm start) instead of playing it again.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Sequence


def pass_at_k(successes: Sequence[Sequence[bool]]) -> Dict[str, float]:
    """{"pass@1", "pass@k", "mixed"} from each episode's k sampled outcomes; "mixed" is the share of
    episodes whose samples both succeed and fail: the groups in which GRPO sees winning against losing."""
    if not successes or not all(successes):
        raise ValueError("pass_at_k needs at least one episode with at least one sample")
    return {
        "pass@1": sum(sum(s) / len(s) for s in successes) / len(successes),
        "pass@k": sum(any(s) for s in successes) / len(successes),
        "mixed": sum(any(s) and not all(s) for s in successes) / len(successes),
    }


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/bench_pass_at_k.py", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--policy", help="a saved policy folder (default: the configuration's warm start)")
    parser.add_argument("--config", help="a train_config.json or configs/train/*.yaml (default: TrainConfig's)")
    parser.add_argument("--k", type=int, default=8, help="samples per episode")
    parser.add_argument("--split", choices=("suite", "validation"), default="suite")
    parser.add_argument("--part", default="unseen_with_particle", help="a group of lib.measure.evaluation.GROUPS")
    parser.add_argument("--episodes", type=int, default=0, help="at most this many episodes of the part (0: all)")
    parser.add_argument("--greedy-from", help="the policy's greedy play of the suite (an evaluation JSONL)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    if args.k < 1:
        parser.error("--k must be at least 1")

    from lib.measure.evaluation import GROUPS, episode_groups, heldout_suite, validation_suite
    from lib.training import TrainConfig
    from lib.training.backends import load_policy
    from lib.training.cli import load_config_file
    from lib.training.policy_evaluation import evaluate_policy
    from lib.training.warm_start import sft_warm_start

    if args.part not in GROUPS:
        parser.error(f"--part must be one of {', '.join(GROUPS)}")
    try:
        config = load_config_file(args.config) if args.config else TrainConfig()
    except ValueError as error:
        parser.error(str(error))
    if args.policy:
        from transformers import AutoModelForCausalLM

        from lib.training.tokenizer import load_tokenizer

        model, tokenizer = AutoModelForCausalLM.from_pretrained(args.policy), load_tokenizer(args.policy)
        source = args.policy
    else:
        policy = load_policy(config, "trl")
        source = sft_warm_start(policy, config).get("cached")
        model, tokenizer = policy.model, policy.tokenizer
    model.eval()

    def play(specs: List[Any], sampling: Any, seed: int) -> List[Dict[str, Any]]:
        return evaluate_policy(model, tokenizer, specs, config, agent_name="pass@k", sampling=sampling, seed=seed)

    suite = list(heldout_suite() if args.split == "suite" else validation_suite(max(args.episodes, 60)))
    if args.greedy_from:
        from lib.episodes.records import load_episodes_jsonl, spec_fields
        from lib.training.run import task_key

        by_task = {
            task_key(r["seed"], r["scenario"], r["difficulty"]): r for r in load_episodes_jsonl(args.greedy_from)
        }
        tasks = [task_key(**spec_fields(spec)) for spec in suite]
        if any(task not in by_task for task in tasks):
            parser.error(f"{args.greedy_from} does not hold every episode of the {args.split}")
        greedy = [by_task[task] for task in tasks]
    else:
        greedy = play(suite, config.evaluation_sampling, config.seed)
    chosen = [i for i, record in enumerate(greedy) if episode_groups([record])[args.part]]
    chosen = chosen[: args.episodes] if args.episodes else chosen
    specs = [suite[i] for i in chosen]
    samples = [play(specs, config.sampling, config.seed + 1_000 * (r + 1)) for r in range(args.k)]
    successes = [[bool(samples[r][j].get("correct_outcome")) for r in range(args.k)] for j in range(len(specs))]
    result = {
        "policy": str(source),
        "split": args.split,
        "part": args.part,
        "episodes": len(specs),
        "k": args.k,
        "temperature": config.sampling.temperature,
        "greedy": sum(bool(greedy[i].get("correct_outcome")) for i in chosen) / len(chosen),
        **{key.replace("@k", f"@{args.k}"): value for key, value in pass_at_k(successes).items()},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
