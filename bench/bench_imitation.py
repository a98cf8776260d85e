"""How well a warm-started policy imitates the heuristic, action by action, on campaigns it never saw.

    make bench-imitation                                  # the default configuration's warm start
    python bench/bench_imitation.py --policy PATH         # any saved policy folder (the stand-in's tokenizer)

Teacher-forced: each of `--campaigns` heuristic demonstrations (seeds from
`lib.seeds.IMITATION_PROBE_SEED`, laid out as GRPO plays them in the configuration's context,
`lib.training.warm_start`) is read by the model in one pass (each decision in one pass, in the
`turn` context), and an action counts as imitated when the model's most likely next
token is the demonstrated one at every token of the action. Reported per action type. The
actions that quote a number the environment showed (`fit_resonance`'s mass hint is the scan's
best mass, `estimate_significance` and `measure_angular` the fit's mass, a claim the fit's mass,
error and significance) say whether the policy copies what it reads; the others, whether it
plays the procedure. Teacher forcing spares the model its own earlier mistakes, which greedy
play must also recover from.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Any, Dict, Tuple

QUOTING_ACTIONS = ("fit_resonance", "estimate_significance", "measure_angular", "submit_discovery_claim")
"""Action types whose parameters quote numbers from the observations."""


def imitated_actions(model: Any, tokenizer: Any, examples) -> Dict[str, Tuple[int, int]]:
    """{action type: (imitated, demonstrated)} over `examples` (`demonstration_examples(...,
    loss="actions")`: the mask marks each action's tokens and its eos)."""
    import torch

    counts: Dict[str, list] = collections.defaultdict(lambda: [0, 0])
    with torch.no_grad():
        for example in examples:
            ids, mask = example["input_ids"], example["completion_mask"]
            predicted = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
            start = 0
            while start < len(mask):
                if not mask[start]:
                    start += 1
                    continue
                end = start
                while end < len(mask) and mask[end]:
                    end += 1
                action_type = json.loads(tokenizer.decode(ids[start : end - 1]))["action_type"]
                counts[action_type][0] += all(predicted[k - 1] == ids[k] for k in range(start, end))
                counts[action_type][1] += 1
                start = end
    return {name: (hits, total) for name, (hits, total) in sorted(counts.items())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/bench_imitation.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", help="a saved policy folder (default: the default configuration's warm start)")
    parser.add_argument("--campaigns", type=int, default=30, help="held-out demonstrations to score")
    parser.add_argument(
        "--config", help="a run's train_config.json: its context and prompt (default: TrainConfig's defaults)"
    )
    args = parser.parse_args(argv)
    from lib.seeds import IMITATION_PROBE_SEED
    from lib.training import TrainConfig
    from lib.training.backends import load_policy
    from lib.training.warm_start import demonstration_examples, sft_warm_start

    config = TrainConfig.load(args.config) if args.config else TrainConfig()
    if args.policy:
        from transformers import AutoModelForCausalLM

        from lib.training.tokenizer import load_tokenizer

        model, tokenizer = AutoModelForCausalLM.from_pretrained(args.policy), load_tokenizer(args.policy)
    else:
        policy = load_policy(config, "trl")
        report = sft_warm_start(policy, config)  # loaded from .cache/warm_start/ when it was built before
        model, tokenizer = policy.model, policy.tokenizer
        print(f"policy: the default warm start ({report.get('cached')})")
    examples = demonstration_examples(
        tokenizer,
        args.campaigns,
        loss="actions",
        context=config.policy_context,
        observation_config=config.observation_config,
        first_seed=IMITATION_PROBE_SEED,
    )
    counts = imitated_actions(model.eval(), tokenizer, examples)
    print(
        f"{'action':<24} imitated / demonstrated ({args.campaigns} held-out campaigns, teacher-forced, "
        f"{config.policy_context} context)"
    )
    for name, (hits, total) in counts.items():
        print(f"{name:<24} {hits:>4} / {total:<4} {'(quotes numbers it read)' if name in QUOTING_ACTIONS else ''}")
    quoting = [counts.get(name, (0, 0)) for name in QUOTING_ACTIONS]
    print(f"{'quoting actions':<24} {sum(h for h, _ in quoting):>4} / {sum(t for _, t in quoting)}")
    print(f"{'all actions':<24} {sum(h for h, _ in counts.values()):>4} / {sum(t for _, t in counts.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
