"""One GRPO run over several processes (`accelerate launch`): who plays what, who writes.

    make train NPROC=2        # accelerate launch --num_processes 2 -m lib.training
                              # (CPU: gloo; GPU: one process per GPU, NCCL)

What each process does:

- **Training episodes.** TRL's sampler hands every process a contiguous share of the
  step's episodes (`per_device_train_batch_size × gradient_accumulation_steps /
  num_processes` of them); each plays its share and TRL gathers the rewards before it
  computes the group advantages, so a group may span processes. `train` divides
  `gradient_accumulation_steps` by the number of processes: a step trains on
  `TrainConfig.episodes_per_step` episodes however many processes play them.
- **Evaluations** (pre, checkpoints, post): the episodes are split into contiguous shards
  (`shard`), each process plays its own, and `gather` puts the records back in order on
  every process.
- **Files**: only the main process writes (evidence CSVs and JSONL, plots, the final model,
  train_result.json); the others wait at the points where it must have finished.

With one process (plain `python -m lib.training`) every function here is the identity.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, List, Sequence, TypeVar

T = TypeVar("T")


def _state():
    """accelerate's process state (torch.distributed set up from what the launcher exported), shared
    with the Trainer's Accelerator. Without CUDA it must be told: gloo over CPU processes."""
    import torch
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def process_index() -> int:
    """This process's rank (0 with one process)."""
    return _state().process_index


def num_processes() -> int:
    """How many processes play this run (1 without `accelerate launch`)."""
    return _state().num_processes


def is_main_process() -> bool:
    """True in the one process that writes files."""
    return _state().is_main_process


def wait_for_everyone() -> None:
    """A barrier: every process gets here before any goes on (nothing with one process)."""
    _state().wait_for_everyone()


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """The main process runs the block first (e.g. building a cached model), then the others
    (which then find the cache)."""
    with _state().main_process_first():
        yield


def shard_bounds(n_items: int, n_shards: int, index: int) -> tuple[int, int]:
    """[start, stop) of shard `index` when `n_items` are split into `n_shards` contiguous
    shards whose sizes differ by at most one (the first ones take the remainder)."""
    if n_shards < 1 or not 0 <= index < n_shards:
        raise ValueError(f"shard {index} of {n_shards} does not exist")
    size, extra = divmod(n_items, n_shards)
    start = index * size + min(index, extra)
    return start, start + size + (1 if index < extra else 0)


def shard(items: Sequence[T]) -> List[T]:
    """This process's contiguous share of `items` (all of them with one process)."""
    start, stop = shard_bounds(len(items), num_processes(), process_index())
    return list(items[start:stop])


def gather(local: Sequence[Any]) -> List[Any]:
    """Every process's `local` list, concatenated in process order, on every process: the
    inverse of `shard`. Objects travel pickled (`accelerate.utils.gather_object`)."""
    if num_processes() == 1:
        return list(local)
    from accelerate.utils import gather_object

    return list(gather_object(list(local)))
