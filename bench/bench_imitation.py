"""How well a warm-started policy imitates the heuristic, action by action, on campaigns it never saw.

    make bench-imitation                                  # the default configuration's warm start
    python bench/bench_imitation.py --policy PATH         # any saved policy folder (the stand-in's tokenizer)

Teacher-forced: each of `--campaigns` heuristic demonstrations is read by the model in one pass
(each decision in one pass, in the `turn` context), laid out as GRPO plays them in the
configuration's context (`lib.training.warm_start`), and an action counts as imitated when the
model's most likely next token is the demonstrated one at every token of the action. Two bands of
campaigns, never trained on: training-split seeds (`lib.seeds.IMITATION_PROBE_SEED`, particles from
the training bands) and the validation split (`lib.seeds.VALIDATION_SEED`, evaluation-split seeds
whose particles lie in the bands training never sees). Reported per action type, and per quoted
value: each parameter the heuristic quotes from the observation (a reference such as
`"@fit.mass_gev"`) counts as copied when every token of its value is predicted. Teacher forcing
spares the model its own earlier mistakes, which greedy play must also recover from.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from typing import Any, Dict, Tuple


def imitated_actions(model: Any, tokenizer: Any, examples) -> Dict[str, Tuple[int, int]]:
    """{action type: (imitated, demonstrated)} over `examples` (`demonstration_examples(...,
    loss="actions")`: the mask marks each action's tokens and its eos)."""
    import torch

    from lib.episodes.chat import model_spans

    counts: Dict[str, list] = collections.defaultdict(lambda: [0, 0])
    with torch.no_grad():
        for example in examples:
            ids, mask = example["input_ids"], example["completion_mask"]
            predicted = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
            for start, end in model_spans(mask):
                action_type = json.loads(tokenizer.decode(ids[start : end - 1]))["action_type"]
                counts[action_type][0] += all(predicted[k - 1] == ids[k] for k in range(start, end))
                counts[action_type][1] += 1
    return {name: (hits, total) for name, (hits, total) in sorted(counts.items())}


def quoted_values(model: Any, tokenizer: Any, examples) -> Tuple[int, int]:
    """(copied, quoted) over `examples`: the parameters of the demonstrated actions written as a
    reference to a shown value, and how many of them the model predicts token for token."""
    import torch

    from cernenv.references import is_reference
    from lib.episodes.chat import model_spans

    copied = quoted = 0
    with torch.no_grad():
        for example in examples:
            ids, mask = example["input_ids"], example["completion_mask"]
            predicted = model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
            for start, end in model_spans(mask):
                text = tokenizer.decode(ids[start : end - 1])
                encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
                if encoding["input_ids"] != ids[start : end - 1]:
                    raise ValueError("a reply does not re-tokenize to its own tokens; cannot locate its values")
                for name, value in json.loads(text)["parameters"].items():
                    if not is_reference(value):
                        continue
                    key = f'"{name}":'
                    first = text.index(key) + len(key)
                    last = first + len(json.dumps(value))
                    positions = [
                        start + k for k, (a, b) in enumerate(encoding["offset_mapping"]) if a < last and b > first
                    ]
                    quoted += 1
                    copied += all(predicted[k - 1] == ids[k] for k in positions)
    return copied, quoted


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/bench_imitation.py", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("--policy", help="a saved policy folder (default: the default configuration's warm start)")
    parser.add_argument("--campaigns", type=int, default=30, help="held-out demonstrations to score, per band")
    parser.add_argument(
        "--config",
        help="a configs/train/*.yaml or a run's train_config.json: its context and prompt (default: TrainConfig's)",
    )
    args = parser.parse_args(argv)
    from lib.measure.evaluation import validation_suite
    from lib.seeds import IMITATION_PROBE_SEED
    from lib.training import TrainConfig
    from lib.training.backends import load_policy
    from lib.training.cli import load_config_file
    from lib.training.tokenizer import corpus_specs
    from lib.training.warm_start import demonstration_examples, sft_warm_start

    try:
        config = load_config_file(args.config) if args.config else TrainConfig()
    except ValueError as error:
        parser.error(str(error))
    if args.policy:
        from transformers import AutoModelForCausalLM

        from lib.training.tokenizer import load_tokenizer

        model, tokenizer = AutoModelForCausalLM.from_pretrained(args.policy), load_tokenizer(args.policy)
    else:
        policy = load_policy(config, "trl")
        report = sft_warm_start(policy, config)  # loaded from .cache/warm_start/ when it was built before
        model, tokenizer = policy.model, policy.tokenizer
        print(f"policy: the default warm start ({report.get('cached')})")
    bands = {
        "training bands": corpus_specs(args.campaigns, IMITATION_PROBE_SEED),
        "evaluation bands": [
            {"seed": spec.seed, "difficulty": spec.difficulty} for spec in validation_suite(args.campaigns)
        ],
    }
    results = {}
    for band, specs in bands.items():
        examples = demonstration_examples(
            tokenizer,
            len(specs),
            loss="actions",
            context=config.policy_context,
            observation_config=config.observation_config,
            specs=specs,
        )
        results[band] = (imitated_actions(model.eval(), tokenizer, examples), quoted_values(model, tokenizer, examples))
    print(
        f"imitated / demonstrated ({args.campaigns} campaigns per band, never trained on; teacher-forced, "
        f"{config.policy_context} context)"
    )
    print(f"{'action':<24} " + " ".join(f"{band:>18}" for band in results))
    names = sorted({name for counts, _ in results.values() for name in counts})
    for name in names:
        cells = [
            f"{counts.get(name, (0, 0))[0]:>8} / {counts.get(name, (0, 0))[1]:<7}" for counts, _ in results.values()
        ]
        print(f"{name:<24} " + " ".join(f"{cell:>18}" for cell in cells))
    totals = [f"{sum(h for h, _ in c.values()):>8} / {sum(t for _, t in c.values()):<7}" for c, _ in results.values()]
    print(f"{'all actions':<24} " + " ".join(f"{cell:>18}" for cell in totals))
    quoted = [f"{copied:>8} / {total:<7}" for _, (copied, total) in results.values()]
    print(f"{'quoted values copied':<24} " + " ".join(f"{cell:>18}" for cell in quoted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
