"""The imitation probe counts an action as imitated, and a quoted value as copied, only when every one
of its tokens is predicted."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bench.bench_imitation import imitated_actions, quoted_values
from lib.seeds import IMITATION_PROBE_SEED
from lib.training.warm_start import demonstration_examples


class Teacher:
    """A "model" whose most likely next token is the demonstrated one, except at `wrong` positions."""

    def __init__(self, ids, vocab, wrong=()):
        self.ids, self.vocab, self.wrong = ids, vocab, set(wrong)

    def __call__(self, input_ids):
        ids = input_ids[0].tolist()
        assert ids == self.ids
        logits = torch.zeros(len(ids), self.vocab)
        for t in range(len(ids) - 1):
            logits[t, (ids[t + 1] + (1 if t + 1 in self.wrong else 0)) % self.vocab] = 1.0
        return SimpleNamespace(logits=logits[None])


def test_an_action_counts_only_when_all_its_tokens_are_predicted(tokenizer):
    (example,) = demonstration_examples(tokenizer, 1, loss="actions", first_seed=IMITATION_PROBE_SEED)
    ids, vocab = example["input_ids"], len(tokenizer)
    perfect = imitated_actions(Teacher(ids, vocab), tokenizer, [example])
    assert perfect and all(hits == total > 0 for hits, total in perfect.values())
    assert sum(total for _, total in perfect.values()) == tokenizer.decode(ids).count("<|assistant|>")
    # one wrong token in the fit's mass hint (a reference to the scan's best mass): that action is
    # not imitated and its quoted value not copied; every other one still is
    text_so_far = ""
    for position, token in enumerate(ids):
        text_so_far += tokenizer.decode([token])
        if '"mass_hint_gev":"@scan' in text_so_far:
            wrong = position
            break
    one_wrong = imitated_actions(Teacher(ids, vocab, wrong=[wrong]), tokenizer, [example])
    hits, total = one_wrong["fit_resonance"]
    assert (hits, total) == (perfect["fit_resonance"][0] - 1, perfect["fit_resonance"][1])
    assert {k: v for k, v in one_wrong.items() if k != "fit_resonance"} == {
        k: v for k, v in perfect.items() if k != "fit_resonance"
    }
    copied, quoted = quoted_values(Teacher(ids, vocab), tokenizer, [example])
    assert copied == quoted == tokenizer.decode(ids).count('":"@')
    assert quoted_values(Teacher(ids, vocab, wrong=[wrong]), tokenizer, [example]) == (quoted - 1, quoted)
