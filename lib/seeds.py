"""Every seed the learning side uses, named, with what it drives (the environment's own streams,
drawn from an episode's seed, are in `cernenv.seeding`).

| seed                               | drives                                       | used in                  |
|------------------------------------|----------------------------------------------|--------------------------|
| `CORPUS_SEED` + i                  | the campaigns whose text trains the stand-in | `lib.training.tokenizer` |
|                                    | tokenizer                                    |                          |
| `DEMONSTRATION_SEED` + i           | the warm start's heuristic campaigns         | `lib.training.warm_start`|
| `DAGGER_SEED` + i                  | the campaigns the warm-started learner plays | `lib.training.dagger`    |
|                                    | for the demonstrator to label (DAgger)       |                          |
| `IMITATION_PROBE_SEED` + i         | the demonstrations a warm start is scored on | `bench/bench_imitation.py`|
|                                    | (never trained on)                           |                          |
| `TrainConfig.train_seed_start` + i | GRPO's training tasks (their order shuffled  | `lib.training.grpo`      |
|                                    | with the run seed)                           |                          |
| `TrainConfig.train_seed_start` +   | the fresh tasks dynamic sampling plays in    | `lib.training.grpo`      |
| `replacement_seed_offset(...)`     | place of groups whose episodes scored alike  |                          |
| `rollout_sampling_seed(...)`       | torch's sampling of a GRPO step's rollouts   | `lib.training.grpo`      |
| `TrainConfig.seed`                 | the stand-in's initial weights, the trainers'| `lib.training`           |
|                                    | data order                                   |                          |
| the suite's layout (900000 on)     | the held-out evaluation episodes             | `lib.measure.evaluation` |
| `VALIDATION_SEED` + i              | evaluation-split campaigns of no suite, for  | `bench/bench_imitation.py`|
|                                    | choosing settings (unseen particle bands)    |                          |
| `BOOTSTRAP_SEED`                   | every bootstrap interval of the evidence     | `lib.measure.comparison` |

Training seeds lie below `cernenv.scenarios.EVALUATION_SEED_START` (900000), and every builder
of training tasks checks it with `lib.measure.evaluation.assert_disjoint_from_suite`.
"""

from __future__ import annotations

CORPUS_SEED = 20_000
"""First seed of the tokenizer corpus's campaigns."""
DEMONSTRATION_SEED = 40_000
"""First seed of the warm start's demonstration campaigns."""
DAGGER_SEED = 50_000
"""First seed of the campaigns the learner plays in DAgger's rounds (`lib.training.dagger`)."""
IMITATION_PROBE_SEED = 70_000
"""First seed of the held-out demonstrations `bench/bench_imitation.py` scores a warm start on."""
VALIDATION_SEED = 905_000
"""First seed of the validation split: evaluation-split seeds (their particles drawn from the bands
training never sees) that no held-out suite holds (v1-v3 lie in 900000-902312). Settings and
ablations are chosen on these; the held-out suite is read for the evidence alone."""
BOOTSTRAP_SEED = 0
"""numpy seed of every bootstrap resampling of the evidence: a re-render gives the same numbers."""

_RUN_SEED_STRIDE = 1_000_003
"""Between the sampling seeds of consecutive run seeds (prime)."""
_STEP_STRIDE = 7_919
"""Between the sampling seeds of consecutive GRPO steps: more than any step's episodes (prime)."""


def rollout_sampling_seed(run_seed: int, step: int, first_task: int) -> int:
    """The torch seed of GRPO step `step`'s rollouts, from the task index `first_task` on: a
    resumed run samples what the uninterrupted run would. Within a run every (step, first task)
    has its own seed while a step has fewer than `_STEP_STRIDE` episodes; the seeds of two
    neighbouring run seeds meet only past step 126."""
    return run_seed * _RUN_SEED_STRIDE + _STEP_STRIDE * step + first_task


REPLACEMENT_SEED_OFFSET = 500_000
"""Dynamic sampling's replacement tasks take seeds from `train_seed_start` + this on: past every
training dataset's seeds (`lib.training.grpo.training_tasks`, one per group) and below the
evaluation seeds."""
REPLACEMENT_STEP_STRIDE = 1_024
"""Replacement seeds each (step, process) may use: more than a step's groups times its rounds."""
REPLACEMENT_PROCESSES = 8
"""Processes whose replacement seeds a step's stretch holds."""


def replacement_seed_offset(step: int, index: int, process: int = 0) -> int:
    """The seed (past `train_seed_start`) of the `index`-th replacement task of GRPO step `step` on
    process `process`: the same in a resumed run as in the run that was not interrupted."""
    if not (0 <= index < REPLACEMENT_STEP_STRIDE and 0 <= process < REPLACEMENT_PROCESSES):
        raise ValueError(
            f"replacement task {index} on process {process}: a step reserves {REPLACEMENT_STEP_STRIDE} "
            f"per process for {REPLACEMENT_PROCESSES} processes"
        )
    return REPLACEMENT_SEED_OFFSET + (step * REPLACEMENT_PROCESSES + process) * REPLACEMENT_STEP_STRIDE + index
