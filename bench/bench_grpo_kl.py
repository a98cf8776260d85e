"""Which reply tokens carry a GRPO policy's KL to its warm start, over the whole vocabulary and within
the action grammar.

    python bench/bench_grpo_kl.py --policy RUN/outputs/checkpoint-24 --reference .cache/warm_start/NAME \
        --config RUN/outputs/train_config.json --episodes 20

The policy plays `--episodes` validation campaigns at its training temperature, its replies held to
the grammar (the rollouts GRPO trains on, `lib.episodes.llm_rollouts.play_episodes` in the `turn`
context). Each reply token it chose (not one the grammar forced) is scored by both models at that
temperature, as TRL scores it: its log-probability over the whole vocabulary, and renormalised over
the tokens the grammar admitted there (`renormalise_to_grammar`); TRL's KL estimate on the sampled
token (k3: exp(r) - r - 1, r = log p_ref - log p_policy) for each, and each model's probability mass
on the admitted tokens. Prints the means, the share of the KL the top 1% of tokens hold, and the
`--top` tokens by whole-vocabulary KL with their text and admitted mass.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List


def k3(log_ratio: Any) -> Any:
    """TRL's per-token KL estimate from log p_ref - log p_policy of a sampled token."""
    import torch

    return torch.exp(log_ratio) - log_ratio - 1


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/bench_grpo_kl.py", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--policy", required=True, help="the GRPO policy's saved folder (a checkpoint)")
    parser.add_argument("--reference", required=True, help="its warm start's saved folder (TRL's KL reference)")
    parser.add_argument("--config", required=True, help="the run's train_config.json or configs/train/*.yaml")
    parser.add_argument("--episodes", type=int, default=20, help="validation campaigns played")
    parser.add_argument("--top", type=int, default=15, help="tokens listed, by whole-vocabulary KL")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be at least 1")

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from lib.episodes.generation import hf_generate_fn
    from lib.episodes.grammar import admitted_mask, forced_tokens, reply_admitted
    from lib.episodes.llm_rollouts import play_episodes
    from lib.measure.evaluation import PUBLISHED_KEY, validation_suite
    from lib.training.cli import load_config_file
    from lib.training.tokenizer import load_tokenizer

    config = load_config_file(args.config)
    if not config.constrained_replies or config.policy_context != "turn":
        parser.error("the run must hold its replies to the grammar (constrained_replies) in the turn context")
    tokenizer = load_tokenizer(args.policy)
    policy = AutoModelForCausalLM.from_pretrained(args.policy).eval()
    reference = AutoModelForCausalLM.from_pretrained(args.reference).eval()
    played = play_episodes(
        hf_generate_fn(policy, tokenizer, config.generation_engine),
        tokenizer,
        list(validation_suite(max(args.episodes, 60)))[: args.episodes],
        sampling=config.sampling,
        context="turn",
        observation_config=config.observation_config,
        max_turns=config.max_turns,
        max_context_tokens=config.max_seq_length,
        batch_size=config.eval_batch_size,
        agent_name="policy",
        seed=config.seed + 7_000,
        make_env=PUBLISHED_KEY.make_env,
    )
    rows: List[Dict[str, Any]] = []
    temperature = config.sampling.temperature
    with torch.no_grad():
        for episode in played:
            for turn, shown in zip(episode.turns, episode.shown):
                reply = list(turn.completion_ids)
                admitted = reply_admitted(tokenizer, reply, [1] * len(reply), [shown])
                forced = forced_tokens(reply, admitted)
                ids = torch.tensor([list(turn.prompt_ids) + reply])
                width = len(turn.prompt_ids)
                scored = {}
                for name, model in (("policy", policy), ("reference", reference)):
                    logits = model(input_ids=ids).logits[0, width - 1 : -1].float() / temperature
                    allowed = torch.from_numpy(admitted_mask(admitted, logits.size(1)))
                    whole = torch.log_softmax(logits, dim=-1)
                    within = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
                    target = torch.tensor(reply)[:, None]
                    scored[name] = {
                        "whole": whole.gather(1, target)[:, 0],
                        "within": within.gather(1, target)[:, 0],
                        "admitted_mass": torch.logsumexp(whole.masked_fill(~allowed, float("-inf")), dim=-1).exp(),
                    }
                kl_whole = k3(scored["reference"]["whole"] - scored["policy"]["whole"])
                kl_within = k3(scored["reference"]["within"] - scored["policy"]["within"])
                for i, token in enumerate(reply):
                    if forced[i]:
                        continue
                    rows.append(
                        {
                            "token": tokenizer.decode([token]),
                            "kl_whole": float(kl_whole[i]),
                            "kl_within": float(kl_within[i]),
                            "policy_logp_whole": float(scored["policy"]["whole"][i]),
                            "reference_logp_whole": float(scored["reference"]["whole"][i]),
                            "policy_admitted_mass": float(scored["policy"]["admitted_mass"][i]),
                            "reference_admitted_mass": float(scored["reference"]["admitted_mass"][i]),
                        }
                    )
    if not rows:
        raise SystemExit("the policy wrote no chosen reply token in these campaigns")
    whole = np.array([r["kl_whole"] for r in rows])
    within = np.array([r["kl_within"] for r in rows])
    top_share = int(np.ceil(len(rows) / 100))
    result = {
        "policy": args.policy,
        "reference": args.reference,
        "episodes": len(played),
        "chosen_tokens": len(rows),
        "temperature": temperature,
        "mean_kl_whole": float(whole.mean()),
        "mean_kl_within": float(within.mean()),
        "top_1pct_share_whole": float(np.sort(whole)[::-1][:top_share].sum() / max(whole.sum(), 1e-12)),
        "top_1pct_share_within": float(np.sort(within)[::-1][:top_share].sum() / max(within.sum(), 1e-12)),
        "min_policy_admitted_mass": float(min(r["policy_admitted_mass"] for r in rows)),
        "min_reference_admitted_mass": float(min(r["reference_admitted_mass"] for r in rows)),
        "top": sorted(rows, key=lambda r: -r["kl_whole"])[: args.top],
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
