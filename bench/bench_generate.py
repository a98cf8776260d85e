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

On a GPU (`bench/gpu_session.sh` runs it there): `--engines` picks engines (`compiled`: a static
KV cache and a compiled decoding step), `--batch-sizes 16 64 128` plays each engine at several
numbers of episodes per `generate` call, `--load_in_4bit true` loads 4-bit base weights, and
`--json-lines FILE` appends each row to FILE as soon as it is measured. Every row also says how far
the log-probabilities the engine returned are from a plain forward pass's over the same tokens
(`logprob_max_abs_diff`, the quantity GRPO's importance ratio divides by), the seconds of its first
call (`warmup_s`: compilation included), how many graphs torch.compile made in the process so far
(`compiled_graphs`: 0 means nothing ran compiled) and, on a GPU, the peak memory torch allocated. With LoRA
(`--lora_r 16`) the adapters are on the model as in training.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from lib.training.cli import parse_train_config, train_config_parser

ENGINES = ("cached", "generate", "compiled")
DEFAULT_ENGINES = ("cached", "generate")
RESCORED_CALLS = 3
"""Generate calls per row whose first reply is scored again by a plain forward pass (first, middle, last)."""


def main(argv=None) -> int:
    parser = train_config_parser("bench/bench_generate.py", description=__doc__, argv=argv)  # TrainConfig's flags
    parser.add_argument("--episodes", type=int, default=16, help="episodes played by each engine")
    parser.add_argument(
        "--campaign-contexts", action="store_true", help="contexts that grow as whole campaigns' do (see above)"
    )
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(DEFAULT_ENGINES))
    parser.add_argument("--batch-sizes", nargs="+", type=int, help="episodes per generate call (default: --episodes)")
    parser.add_argument("--json-lines", type=Path, help="append each measured row to this file as one JSON line")
    config, args = parse_train_config(argv, parser)  # imports unsloth first where the run may use it
    import torch

    from lib.agents.prompting import Sampling
    from lib.episodes.generation import hf_generate_fn
    from lib.training.backends import load_policy, resolve_backend
    from lib.training.warm_start import sft_warm_start

    backend = resolve_backend(config)
    policy = load_policy(config, backend)
    if config.warm_start_episodes:  # the run's policy: warm-started (cached after its first build)
        sft_warm_start(policy, config)
    model = policy.model
    if policy.peft_config is not None:  # the adapters on, as the trainer generates with them
        from peft import get_peft_model

        model = get_peft_model(model, policy.peft_config)
    sampling = Sampling(temperature=config.temperature, top_p=config.top_p, max_new_tokens=config.max_new_tokens)
    engines = [e for e in args.engines if not (backend == "unsloth" and e == "cached")]
    device = next(model.parameters()).device
    batch_sizes = args.batch_sizes or [args.episodes]
    print(
        f"model {policy.model_name} on {device}, backend {backend}, 4-bit {config.load_in_4bit}, "
        f"LoRA r {config.lora_r}, temperature {config.temperature}, threads {torch.get_num_threads()}",
        flush=True,
    )
    print(f"{'engine':<10}{'batch':>6}{'seconds':>10}{'tokens':>10}{'tokens/s':>10}{'warm-up s':>11}", flush=True)
    campaigns = campaign_segments(policy.tokenizer, max(batch_sizes)) if args.campaign_contexts else None
    for engine in engines:
        generate = hf_generate_fn(model, policy.tokenizer, engine, unsloth=backend == "unsloth")
        for batch in batch_sizes:
            row = measure(generate, model, policy.tokenizer, config, sampling, batch, campaigns)
            row.update(engine=engine, backend=backend, load_in_4bit=config.load_in_4bit, device=str(device))
            print(
                f"{engine:<10}{batch:>6}{row['seconds']:>10.1f}{row['tokens']:>10d}{row['tokens_per_s']:>10.0f}"
                f"{row['warmup_s']:>11.1f}   (longest context {row['longest_context']} tokens; "
                f"log-prob gap {row['logprob_max_abs_diff']:.1e}; peak {row['peak_gpu_memory_gib']} GiB; "
                f"{row['compiled_graphs']} compiled graphs)",
                flush=True,
            )
            print(json.dumps(row), flush=True)
            if args.json_lines:
                with open(args.json_lines, "a") as handle:
                    handle.write(json.dumps(row) + "\n")
    return 0


def measure(generate, model, tokenizer, config, sampling, batch, campaigns) -> dict:
    """One engine at `batch` episodes per call: a warm-up call, then the timed play; its row."""
    import torch

    from lib.episodes.llm_rollouts import play_episodes

    specs = [(config.train_seed_start + i // config.num_generations, None, "easy") for i in range(batch)]
    warmup_contexts = [list(prompt) for prompt, _ in campaigns[:batch]] if campaigns else None
    start = time.perf_counter()
    if warmup_contexts:  # the first call compiles what the engine compiles, at this batch size
        generate(warmup_contexts, sampling)
    else:
        play_episodes(generate, tokenizer, specs[:batch], sampling=sampling, max_turns=1)
    warmup_s = time.perf_counter() - start
    recorder = Recorder(generate)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(config.seed)
    start = time.perf_counter()
    if campaigns is not None:
        tokens, context = replay_campaigns(
            recorder, campaigns[:batch], sampling, config.max_turns, config.max_seq_length
        )
    else:
        played = play_episodes(
            recorder,
            tokenizer,
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
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {
        "batch": batch,
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "longest_context": context,
        "warmup_s": warmup_s,
        "generate_calls": len(recorder.calls),
        "logprob_max_abs_diff": recorder.logprob_gap(model, sampling),
        "compiled_graphs": compiled_graphs(),
        "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
    }


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled in this process so far (0: nothing ran compiled)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class Recorder:
    """A `GenerateFn` that passes calls on and keeps each call's first context and reply."""

    def __init__(self, generate) -> None:
        self.generate, self.calls = generate, []

    def __call__(self, contexts, sampling, **kwargs):
        replies = self.generate(contexts, sampling, **kwargs)
        self.calls.append((list(contexts[0]), *replies[0]))
        return replies

    def logprob_gap(self, model, sampling) -> float:
        """Largest |log-probability returned - log_softmax(logits / T) of a plain forward pass| over
        the replies of `RESCORED_CALLS` calls (greedy: T = 1)."""
        import torch

        picked = sorted({0, len(self.calls) // 2, len(self.calls) - 1})[:RESCORED_CALLS] if self.calls else []
        temperature = sampling.temperature if sampling.temperature > 0 else 1.0
        device = next(model.parameters()).device
        gap = 0.0
        for index in picked:
            context, reply, logprobs = self.calls[index]
            if not reply:
                continue
            ids = torch.tensor([context + reply], device=device)
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(context) - 1 : -1].float() / temperature
            expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(reply, device=device)[:, None])[:, 0]
            gap = max(gap, float((expected.cpu() - torch.tensor(logprobs)).abs().max()))
        return gap


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
