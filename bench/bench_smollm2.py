"""What SmolLM2-135M-Instruct plays on the validation split, zero-shot and after training, on a CPU.

    python bench/bench_smollm2.py zero-shot --episodes 30 --out build/smollm2-bench
    python -m lib.training --config configs/train/smollm2-cpu.yaml        # warm start, then GRPO
    python bench/bench_smollm2.py summary build/smollm2-bench/zero_shot.jsonl.gz \\
        build/smollm2-cpu/evidence/pre_eval.jsonl.gz build/smollm2-cpu/evidence/post_eval.jsonl.gz

`zero-shot` plays the model as it comes (no warm start, no training) greedily on the first campaigns
of the validation split (`lib.measure.evaluation.validation_suite`) in the Colab path's setting:
one conversation per campaign, the system prompt, replies held to the action grammar. Its settings
(sampling, context, max_new_tokens, max_turns) are the config's (`--config`, default
configs/train/smollm2-cpu.yaml), so the three evaluations play alike. It writes the episodes and
prints the wall-clock time and the load (`os.getloadavg`). `summary` prints, for each file of
episodes, the campaigns, the correct outcomes, the success rate and the mean reward, each with its
95% bootstrap interval (`lib.measure.comparison.bootstrap_interval`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = ROOT / "configs" / "train" / "smollm2-cpu.yaml"


def zero_shot(args: argparse.Namespace) -> int:
    from lib.episodes.records import save_episodes_jsonl
    from lib.measure.evaluation import validation_suite
    from lib.training.backends import load_policy
    from lib.training.cli import read_config_file
    from lib.training.config import TrainConfig
    from lib.training.policy_evaluation import evaluate_policy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    values = {**read_config_file(args.config), "warm_start_episodes": 0, "lora_r": 0}
    for name in ("max_turns", "generation_engine"):
        if getattr(args, name):
            values[name] = getattr(args, name)
    config = TrainConfig(**values)
    start = time.perf_counter()
    policy = load_policy(config, "trl")
    loaded = time.perf_counter() - start
    specs = validation_suite(args.episodes)
    start = time.perf_counter()
    episodes = evaluate_policy(policy.model, policy.tokenizer, specs, config, agent_name="zero-shot")
    seconds = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_episodes_jsonl(episodes, str(out / "zero_shot.jsonl.gz"))
    turns = sum(len(e["steps"]) for e in episodes)
    print(
        f"zero-shot: {len(episodes)} campaigns, {turns} turns in {seconds:.0f} s ({seconds / len(episodes):.1f} s a "
        f"campaign; model loaded in {loaded:.1f} s); load average {os.getloadavg()[0]:.1f}; "
        f"episodes in {out / 'zero_shot.jsonl.gz'}"
    )
    print(summary_line("zero-shot", episodes))
    return 0


def summary_line(label: str, episodes) -> str:
    from lib.measure.comparison import bootstrap_interval, episode_values, summarise_episodes

    s = summarise_episodes(episodes)
    parts = [f"{label}: {s['n']} campaigns, {s['n_correct']} correct"]
    for key in ("success_rate", "mean_reward"):
        values = [v for _, v in episode_values(episodes, key)]
        interval = bootstrap_interval(values)
        if values:
            parts.append(f"{key} {s[key]:+.3f} [{interval[0]:+.3f}, {interval[1]:+.3f}]")
    turns = [len(e["steps"]) for e in episodes]
    parsed = sum(step["parsed_ok"] for e in episodes for step in e["steps"])
    parts.append(f"{sum(turns)} turns, {parsed} parsed")
    parts.append("endings " + ", ".join(f"{k} {v}" for k, v in s["endings"].items()))
    return "; ".join(parts)


def summary(args: argparse.Namespace) -> int:
    from lib.episodes.records import load_episodes_jsonl

    for path in args.files:
        print(summary_line(str(path), load_episodes_jsonl(str(path))))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    zero = commands.add_parser("zero-shot", help="play the model as it comes on the validation split")
    zero.add_argument("--episodes", type=int, default=30, help="campaigns of the validation split")
    zero.add_argument("--config", default=str(DEFAULT_CONFIG), help="the TrainConfig file whose play settings to use")
    zero.add_argument("--max-turns", dest="max_turns", type=int, default=None, help="replace the config's max_turns")
    zero.add_argument(
        "--generation-engine", dest="generation_engine", default=None, help="replace the config's generation_engine"
    )
    zero.add_argument("--out", default="build/smollm2-bench", help="folder for zero_shot.jsonl.gz")
    summarise = commands.add_parser("summary", help="success rate and mean reward of episode files, with intervals")
    summarise.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    return zero_shot(args) if args.command == "zero-shot" else summary(args)


if __name__ == "__main__":
    sys.exit(main())
