"""The GRPO trainer class a run uses: TRL's `GRPOTrainer`, scoring each batch without the padding
its rows share (`padding_trimmed_trainer`), with decision credit where the config asks for it
(`lib.training.credit.decision_credit_trainer`).

TRL pads every sample of a step to the step's longest prompt (on the left) and longest completion
(on the right), then scores the samples `per_device_train_batch_size` at a time (the reference
model's log-probabilities, then each optimisation pass's forward and backward). A batch whose own
samples are shorter still carries the step's longest widths: columns where none of its rows holds
a token. Cutting those columns changes no log-probability (every row's positions move by the same
number, and rotary position embeddings see only differences of positions) and saves their compute.
The passes of a step are dealt its samples sorted by length, so that each pass's own padding is
small too: all of a step's passes add up to one update, and the loss (TRL's default, DAPO's,
normalised by the step's token count) does not depend on which pass holds which sample.
On a CPU, the LM head projects the completions' positions alone: TRL's fused head does that only
where Triton runs, and elsewhere projects every position, the prompt's too.

With `renormalise_to_grammar`, each token a reply held to the action grammar wrote is scored by its
log-probability under the distribution it was sampled from: the model's, renormalised over the
tokens the grammar admitted at its place (`AdmittedTokens`, filled by the rollout). Over the whole
vocabulary, a sampled token's log-probability can fall without bound while the policy's behaviour
barely moves (the mass goes to tokens the grammar never lets it write), and its KL term to the
reference with it; within the grammar it cannot.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from lib.training.config import TrainConfig
from lib.training.credit import decision_credit_trainer

PARTITION_FREE_LOSSES = ("dapo", "cispo", "grpo", "sapo", "dr_grpo", "luspo")
"""TRL's loss types whose step loss is the same however a step's samples are dealt into its passes
(of equal sizes): token terms normalised by the step's tokens, or a mean over sequences. Not
"bnpo", which normalises each pass by its own tokens, nor the others, left as TRL deals them."""


class AdmittedTokens:
    """What the action grammar admitted at each completion token of a step's samples
    (`lib.episodes.grammar.reply_admitted`'s bitmask rows), found again from a sample's tokens: TRL
    hands the log-probability computation a padded batch of token ids, not its samples' names."""

    def __init__(self) -> None:
        self._by_prompt: Dict[bytes, List[Tuple[np.ndarray, np.ndarray]]] = {}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._by_prompt.values())

    def clear(self) -> None:
        self._by_prompt.clear()

    def add(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], rows: np.ndarray) -> None:
        """Keep `rows` (one per token of `completion_ids`) for the sample (`prompt_ids`, `completion_ids`)."""
        if len(rows) != len(completion_ids):
            raise ValueError(f"{len(rows)} rows of admitted tokens for a completion of {len(completion_ids)} tokens")
        key = np.asarray(prompt_ids, dtype=np.int64).tobytes()
        self._by_prompt.setdefault(key, []).append((np.asarray(completion_ids, dtype=np.int64), rows))

    def rows(self, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> Optional[np.ndarray]:
        """The rows kept for the sample with these tokens (its completion, or the start of it that
        the trainer attends to), or None for a sample never added. Samples alike in their tokens
        have alike rows: the grammar of a reply follows from the tokens before it."""
        completion = np.asarray(completion_ids, dtype=np.int64)
        for kept, rows in self._by_prompt.get(np.asarray(prompt_ids, dtype=np.int64).tobytes(), []):
            if len(kept) >= len(completion) and np.array_equal(kept[: len(completion)], completion):
                return rows[: len(completion)]
        return None

    def allowed(self, ids: Any, mask: Any, keep: int, n_vocab: int) -> Optional[Any]:
        """For a batch of token ids (`ids`, `mask`: prompt left-padded, completion right-padded, the
        completion the last `keep` columns) a bool tensor (rows, `keep`, `n_vocab`): the tokens each
        completion position may take, every token where no grammar held it; None where no sample of
        the batch was added."""
        import torch

        from lib.episodes.grammar import admitted_mask

        allowed = torch.ones(ids.size(0), keep, n_vocab, dtype=torch.bool, device=ids.device)
        found = False
        for row in range(ids.size(0)):
            visible = mask[row].bool()
            prompt = ids[row, :-keep][visible[:-keep]].tolist()
            completion = ids[row, -keep:][visible[-keep:]].tolist()
            rows = self.rows(prompt, completion)
            if rows is None:
                continue
            found = True
            allowed[row, : len(rows)] = torch.from_numpy(admitted_mask(rows, n_vocab)).to(ids.device)
        return allowed if found else None


def admitted_tokens_of(trainer: Any) -> AdmittedTokens:
    """The `AdmittedTokens` of `trainer` (a `padding_trimmed_trainer` class's instance), made on first use."""
    if not hasattr(type(trainer), "_completion_logps"):
        raise TypeError(
            f"renormalise_to_grammar needs the trainer that scores replies within the grammar (TRL's backend); "
            f"{type(trainer).__name__} does not: set renormalise_to_grammar: false, or train with backend 'trl'"
        )
    if getattr(trainer, "admitted_tokens", None) is None:
        trainer.admitted_tokens = AdmittedTokens()
    return trainer.admitted_tokens


def padding_trimmed_trainer(base: type) -> type:
    """`base` (TRL's `GRPOTrainer`) whose per-token log-probabilities are computed batch by batch on
    the columns some row of the batch uses: the left padding all of a batch's prompts share and the
    right padding all of its completions share are cut before the forward pass, and the
    log-probabilities (and entropies) padded back with zeros to the completion width TRL expects,
    where its completion mask is 0; a step's passes are dealt its samples by length
    (`grouped_by_length`) where that changes nothing but speed. Batches with images are TRL's own."""
    import torch.nn.functional as F

    class PaddingTrimmed(base):
        def _prepare_inputs(self, generation_batch):
            generate_every = self.args.steps_per_generation * self.num_iterations
            fresh = self.model.training and (self._step % generate_every == 0 or self._buffered_inputs is None)
            inputs = super()._prepare_inputs(generation_batch)
            # Regroup only where the passes' partition changes nothing but speed: they all belong to one
            # optimisation step (one generation, one pass over it) and no per-pass statistic is taken
            # (the entropy quantile is a pass's own).
            one_step = self.args.steps_per_generation == self.args.gradient_accumulation_steps
            unchanged = self.loss_type in PARTITION_FREE_LOSSES and self.top_entropy_quantile >= 1.0
            if fresh and one_step and self.num_iterations == 1 and unchanged:
                self._buffered_inputs = grouped_by_length(self._buffered_inputs)
                inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]
            return inputs

        def _get_per_token_logps_and_entropies(
            self,
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size=None,
            compute_entropy=False,
            compute_aux_loss=False,
            **multimodal,
        ):
            parent = super()._get_per_token_logps_and_entropies
            if any(value is not None for value in multimodal.values()):
                return parent(
                    model,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    batch_size=batch_size,
                    compute_entropy=compute_entropy,
                    compute_aux_loss=compute_aux_loss,
                    **multimodal,
                )
            import torch

            width = input_ids.size(1)
            batch_size = batch_size or input_ids.size(0)
            logps, entropies, aux_losses = [], [], []
            for start in range(0, input_ids.size(0), batch_size):
                ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
                used = mask.any(dim=0).nonzero()[:, 0]
                # every prompt holds a token in the prompt's last column and every completion one in the
                # completion's first, so the cut stays within each part's padding
                first, end = int(used[0]), int(used[-1]) + 1
                keep = logits_to_keep - (width - end)
                within_grammar = getattr(self, "admitted_tokens", None) is not None
                if (ids.device.type == "cpu" or within_grammar) and not compute_aux_loss:
                    lp, entropy, aux = self._completion_logps(
                        model, ids[:, first:end], mask[:, first:end], keep, compute_entropy
                    )
                else:
                    lp, entropy, aux = parent(
                        model,
                        ids[:, first:end],
                        mask[:, first:end],
                        keep,
                        batch_size=None,
                        compute_entropy=compute_entropy,
                        compute_aux_loss=compute_aux_loss,
                    )
                logps.append(F.pad(lp, (0, logits_to_keep - keep)))
                if entropy is not None:
                    entropies.append(F.pad(entropy, (0, logits_to_keep - keep)))
                if aux is not None:
                    aux_losses.append(aux)
            return (
                torch.cat(logps, dim=0),
                torch.cat(entropies, dim=0) if entropies else None,
                torch.stack(aux_losses).mean() if aux_losses else None,
            )

        def _completion_logps(self, model, ids, mask, keep, compute_entropy):
            """On a CPU, the log-probabilities (and entropies) of the last `keep` tokens from the model's
            own forward with its LM head on those positions alone (`logits_to_keep`): TRL's fused head
            projects every position off a GPU (its compact path needs Triton), the prompt's too, which
            here is most of a sample. The numbers are TRL's (`selective_log_softmax`, at the trainer's
            temperature), over the tokens the grammar admitted where the trainer holds them
            (`admitted_tokens`, GPU runs too)."""
            import torch
            from trl.trainer.utils import selective_log_softmax, selective_log_softmax_and_entropy

            with self.accelerator.autocast():
                logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=keep + 1).logits[:, :-1]
            admitted = getattr(self, "admitted_tokens", None)
            allowed = admitted.allowed(ids, mask, keep, logits.size(-1)) if admitted is not None else None
            if allowed is not None:  # a finite floor: 0 * floor is 0 in the entropy, where -inf gives NaN
                logits = logits.masked_fill(~allowed, torch.finfo(logits.dtype).min / 4)
            targets, padding = ids[:, -keep:], mask[:, -keep:] == 0  # TRL's numbers are 0 on the padding
            if compute_entropy:
                logps, entropy = selective_log_softmax_and_entropy(logits, targets, temperature=self.temperature)
                return logps.masked_fill(padding, 0.0), entropy.masked_fill(padding, 0.0), None
            logps = selective_log_softmax(logits, targets, temperature=self.temperature)
            return logps.masked_fill(padding, 0.0), None, None

    PaddingTrimmed.__name__ = PaddingTrimmed.__qualname__ = f"PaddingTrimmed{base.__name__}"
    return PaddingTrimmed


def grouped_by_length(batches: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The samples of `batches` (a step's passes, TRL's buffered inputs: dicts of per-sample tensors
    and lists, and per-step scalars) sorted by length (prompt and completion tokens) and dealt back
    into as many passes of the same sizes, so that each pass's samples are alike in length and its
    shared padding is most of its padding."""
    import torch

    sizes = [len(batch["prompt_ids"]) for batch in batches]
    merged: Dict[str, Any] = {}
    for key, first in batches[0].items():
        values = [batch[key] for batch in batches]
        if isinstance(first, torch.Tensor) and first.ndim >= 1:
            merged[key] = torch.cat(values)
        elif isinstance(first, list):
            merged[key] = [item for value in values for item in value]
        else:  # None, or one number for the whole step
            merged[key] = first
    lengths = merged["prompt_mask"].sum(1) + merged["completion_mask"].sum(1)
    order = torch.argsort(lengths, stable=True)
    out, start = [], 0
    for size in sizes:
        index = order[start : start + size]
        out.append(
            {
                key: value[index]
                if isinstance(value, torch.Tensor) and value.ndim >= 1
                else [value[i] for i in index.tolist()]
                if isinstance(value, list)
                else value
                for key, value in merged.items()
            }
        )
        start += size
    return out


def grpo_trainer_class(config: TrainConfig, backend: str = "trl") -> type:
    """The trainer class for `config` on `backend`: TRL's `GRPOTrainer` (Unsloth's patched one when
    `backend` is "unsloth", left as Unsloth made it), padding trimmed on the TRL backend (which alone
    scores replies within the grammar, `renormalise_to_grammar`), with decision credit when
    `config.credit` is "decision"."""
    from trl import GRPOTrainer

    if config.renormalise_to_grammar and backend != "trl":
        raise ValueError(
            f"renormalise_to_grammar scores replies within the grammar in the TRL backend's trainer, not "
            f"{backend!r}'s: set renormalise_to_grammar: false, or train with the TRL backend"
        )
    trainer_class = padding_trimmed_trainer(GRPOTrainer) if backend == "trl" else GRPOTrainer
    return decision_credit_trainer(trainer_class) if config.credit == "decision" else trainer_class
