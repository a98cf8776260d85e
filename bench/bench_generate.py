"""Generated tokens per second of each generation engine, on the same episodes.

    make bench-generate                    # the default model of this machine, 16 episodes
    python bench/bench_generate.py --episodes 32 --warm_start_episodes 0   # the untrained stand-in

The episodes are one GRPO step's worth (groups of `num_generations` on training tasks),
sampled at the training temperature with the same seed for every engine, played to the
end (or `--max_turns`, TrainConfig's). Reported per engine (`lib.episodes.generation.GENERATION_ENGINES`): wall
seconds, tokens the model generated, tokens/s. `auto` picks the fastest of this table for
the device (`cached` on a CPU, `generate` on a GPU); run this where you train to check.

`--campaign-contexts` measures what a policy that plays whole campaigns costs, whatever the
model loaded can play: each episode's context starts as a heuristic campaign's prompt and,
every turn, grows by the engine's reply and the campaign's next environment message
(`lib.training.warm_start.demonstration_examples`), up to ~20 turns and ~6,000 tokens, where
an untrained model's own episodes end after a few refused turns.
"""

from __future__ import annotations

import sys
import time

from lib.training.cli import parse_train_config, train_config_parser

ENGINES = ("cached", "generate")


def main(argv=None) -> int:
    parser = train_config_parser("bench/bench_generate.py", description=__doc__, argv=argv)  # TrainConfig's flags
    parser.add_argument("--episodes", type=int, default=16, help="episodes played by each engine")
    parser.add_argument(
        "--campaign-contexts", action="store_true", help="contexts that grow as whole campaigns' do (see above)"
    )
    config, args = parse_train_config(argv, parser)  # imports unsloth first where the run may use it
    import torch

    from lib.agents.prompting import Sampling
    from lib.episodes.generation import hf_generate_fn
    from lib.episodes.llm_rollouts import play_episodes
    from lib.training.backends import load_policy, resolve_backend
    from lib.training.warm_start import sft_warm_start

    backend = resolve_backend(config)
    policy = load_policy(config, backend)
    if config.warm_start_episodes:  # the run's policy: warm-started (cached after its first build)
        sft_warm_start(policy, config)
    sampling = Sampling(temperature=config.temperature, top_p=config.top_p, max_new_tokens=config.max_new_tokens)
    specs = [(config.train_seed_start + i // config.num_generations, None, "easy") for i in range(args.episodes)]
    engines = [e for e in ENGINES if not (backend == "unsloth" and e == "cached")]
    device = next(policy.model.parameters()).device
    print(
        f"model {policy.model_name} on {device}, backend {backend}, {args.episodes} episodes, "
        f"temperature {config.temperature}, threads {torch.get_num_threads()}"
    )
    print(f"{'engine':<10}{'seconds':>10}{'tokens':>10}{'tokens/s':>10}")
    campaigns = campaign_segments(policy.tokenizer, args.episodes) if args.campaign_contexts else None
    for engine in engines:
        generate = hf_generate_fn(policy.model, policy.tokenizer, engine, unsloth=backend == "unsloth")
        play_episodes(generate, policy.tokenizer, specs[:2], sampling=sampling, max_turns=2)  # warm-up
        torch.manual_seed(config.seed)
        start = time.perf_counter()
        if campaigns is not None:
            tokens, context = replay_campaigns(generate, campaigns, sampling, config.max_turns, config.max_seq_length)
        else:
            played = play_episodes(
                generate,
                policy.tokenizer,
                specs,
                sampling=sampling,
                context=config.policy_context,
                observation_config=config.observation_config,
                max_turns=config.max_turns,
                max_context_tokens=config.max_seq_length,
                batch_size=len(specs),
                seed=config.seed,
            )
            tokens = sum(sum(episode.env_mask) for episode in played)
            context = max(len(e.prompt_ids) + len(e.completion_ids) for e in played)
        seconds = time.perf_counter() - start
        rate = tokens / seconds
        print(f"{engine:<10}{seconds:>10.1f}{tokens:>10d}{rate:>10.0f}   (longest context {context} tokens)")
    return 0


def campaign_segments(tokenizer, n_episodes: int):
    """Per heuristic campaign: its prompt, then the environment's tokens after each of its actions."""
    from lib.training.warm_start import demonstration_examples

    campaigns = []
    for example in demonstration_examples(tokenizer, n_episodes):
        runs, current, last = [], [], 0  # runs of equal mask bits, in order
        for token, bit in zip(example["input_ids"], example["completion_mask"]):
            if current and bit != last:
                runs.append((last, current))
                current = []
            current.append(token)
            last = bit
        runs.append((last, current))
        prompt, rest = runs[0][1], runs[1:]
        campaigns.append((prompt, [tokens for bit, tokens in rest if bit == 0]))
    return campaigns


def replay_campaigns(generate, campaigns, sampling, max_turns, max_context_tokens):
    """Every turn, one `generate` call for the live episodes; each context then grows by the reply
    and the campaign's next environment message. Returns (tokens generated, longest context)."""
    contexts = [list(prompt) for prompt, _ in campaigns]
    tokens, turn = 0, 0
    while max_turns is None or turn < max_turns:
        live = [
            i
            for i, (_, segments) in enumerate(campaigns)
            if turn <= len(segments) and len(contexts[i]) + sampling.max_new_tokens <= max_context_tokens
        ]
        if not live:
            break
        for i, (reply, _) in zip(live, generate([contexts[i] for i in live], sampling)):
            tokens += len(reply)
            segments = campaigns[i][1]
            contexts[i] += reply + (segments[turn] if turn < len(segments) else [])
        turn += 1
    return tokens, max(len(context) for context in contexts)


if __name__ == "__main__":
    sys.exit(main())
