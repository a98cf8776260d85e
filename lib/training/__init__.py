"""GRPO training of an LLM policy on CERNenv (TRL's GRPOTrainer; Unsloth on a GPU).

    from lib.training import TrainConfig, train
    result = train(TrainConfig(max_steps=40))

`python -m lib.training` runs the same from the command line (`make train`). The names below
are imported on first use: `python -m lib.training --help` reads no more than it needs.
"""

from typing import Any

__all__ = ["BACKENDS", "GPU_DEFAULT_MODEL", "TINY_MODEL", "TrainConfig", "train"]


def __getattr__(name: str) -> Any:
    if name in ("BACKENDS", "GPU_DEFAULT_MODEL", "TINY_MODEL", "TrainConfig"):
        from lib.training import config

        return getattr(config, name)
    raise AttributeError(f"module 'lib.training' has no attribute {name!r}")


def train(config, pre_eval=None):
    """See `lib.training.run.train` (imported on first use, after unsloth: it imports transformers,
    peft and trl, which Unsloth must patch first). A `model_name` that cannot be had here is
    refused first (`lib.training.model_source`), before any of them is imported."""
    from lib.extras import require
    from lib.training.model_source import model_source_problem

    problem = model_source_problem(config.model_name) if config.model_name else None
    if problem:  # said in seconds, before torch and transformers are imported
        raise FileNotFoundError(problem)
    require("train", "training")
    from lib.training.backends import import_unsloth_first

    import_unsloth_first(config)
    from lib.training.run import train as _train

    return _train(config, pre_eval)
