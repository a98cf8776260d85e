"""Generated tokens per second of each generation engine, on the same episodes.

    make bench-generate                    # the default model of this machine, 16 episodes
    python bench/bench_generate.py --episodes 32 --model_name cernenv-tiny-untrained

The episodes are one GRPO step's worth (groups of `num_generations` on training tasks),
sampled at the training temperature with the same seed for every engine, played to the
end (or `--max-turns`). Reported per engine (`lib.multiturn.GENERATION_ENGINES`): wall
seconds, tokens the model generated, tokens/s. `auto` picks the fastest of this table for
the device (`cached` on a CPU, `generate` on a GPU); run this where you train to check.
"""

from __future__ import annotations

import sys
import time

from lib.training.cli import parse_train_config, train_config_parser

ENGINES = ("cached", "generate")


def main(argv=None) -> int:
    parser = train_config_parser("bench/bench_generate.py", description=__doc__, argv=argv)  # TrainConfig's flags
    parser.add_argument("--episodes", type=int, default=16, help="episodes played by each engine")
    parser.add_argument("--max-turns", type=int, default=None, help="turns per episode (default: to the end)")
    config, args = parse_train_config(argv, parser)  # imports unsloth first where the run may use it
    import torch

    from lib.multiturn import Sampling, hf_generate_fn, play_episodes
    from lib.training.backends import load_policy, resolve_backend

    backend = resolve_backend(config)
    policy = load_policy(config, backend)
    sampling = Sampling(temperature=config.temperature, top_p=config.top_p, max_new_tokens=config.max_new_tokens)
    specs = [(config.train_seed_start + i // config.num_generations, None, "easy") for i in range(args.episodes)]
    engines = [e for e in ENGINES if not (backend == "unsloth" and e == "cached")]
    device = next(policy.model.parameters()).device
    print(
        f"model {policy.model_name} on {device}, backend {backend}, {args.episodes} episodes, "
        f"temperature {config.temperature}, threads {torch.get_num_threads()}"
    )
    print(f"{'engine':<10}{'seconds':>10}{'tokens':>10}{'tokens/s':>10}")
    for engine in engines:
        generate = hf_generate_fn(policy.model, policy.tokenizer, engine, unsloth=backend == "unsloth")
        play_episodes(generate, policy.tokenizer, specs[:2], sampling=sampling, max_turns=2)  # warm-up
        start = time.perf_counter()
        played = play_episodes(
            generate,
            policy.tokenizer,
            specs,
            sampling=sampling,
            max_turns=args.max_turns,
            max_context_tokens=config.max_seq_length,
            batch_size=len(specs),
            seed=config.seed,
        )
        seconds = time.perf_counter() - start
        tokens = sum(sum(episode.env_mask) for episode in played)
        print(f"{engine:<10}{seconds:>10.1f}{tokens:>10d}{tokens / seconds:>10.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
