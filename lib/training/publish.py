"""After training: load the saved policy, merge its LoRA adapter, publish it on the Hub.

`train` saves the final policy to `<output_dir>/final`: the LoRA adapter (PEFT's
`adapter_config.json` + weights, on top of the base model it names) or, with `lora_r=0`,
the whole model, and the tokenizer beside it. `load_trained_policy` loads either form;
`save_merged` writes the base model with the adapter folded in (a plain transformers
model, for inference engines that take no adapters); `push_to_hub` writes the folder's model
card (`model_card`: it names the base model, where TRL's draft said "fine-tuned version of
[None]" for a base loaded from a folder) and uploads the folder, or with `dry_run` only checks
it and lists what would be sent (no network).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from lib.files import atomic_write, share_folder
from lib.training.backends import policy_dtype
from lib.training.config import HUB_REPO_ID

REPO_ID = HUB_REPO_ID


def model_kind(model_dir: Path) -> str:
    """ "adapter" (a PEFT LoRA adapter) or "model" (whole weights) for a saved policy folder."""
    model_dir = Path(model_dir)
    if (model_dir / "adapter_config.json").is_file():
        return "adapter"
    if (model_dir / "config.json").is_file():
        return "model"
    raise FileNotFoundError(
        f"{model_dir} holds no saved policy (no adapter_config.json or config.json): "
        "give the final_model_dir a training run reported"
    )


def load_trained_policy(model_dir: Path) -> Tuple[Any, Any]:
    """(model, tokenizer) of a policy `train` saved, on the GPU when there is one, in eval mode.
    An adapter is loaded on top of the base model its adapter_config.json names."""
    from transformers import AutoModelForCausalLM

    from lib.training.tokenizer import load_tokenizer

    model_dir = Path(model_dir)
    if model_kind(model_dir) == "adapter":
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(str(model_dir), dtype=policy_dtype())
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=policy_dtype())
    if torch.cuda.is_available():
        model = model.to("cuda")
    tokenizer = load_tokenizer(str(model_dir))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def save_merged(model: Any, tokenizer: Any, out_dir: Path) -> Path:
    """The policy with its LoRA adapter folded into the base weights, saved to `out_dir` (a
    model without an adapter is saved as it is). Merging changes `model` in place."""
    out_dir = Path(out_dir)
    merged = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
    merged.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    share_folder(out_dir)
    return out_dir


def base_model_of(model_dir: Path) -> Optional[str]:
    """The base a saved policy was trained from: its adapter's base, else the run's model_name
    (train_config.json beside the folder), else the weights' own `_name_or_path`."""
    model_dir = Path(model_dir)
    for path, key in (
        (model_dir / "adapter_config.json", "base_model_name_or_path"),
        (model_dir.parent / "train_config.json", "model_name"),
        (model_dir / "config.json", "_name_or_path"),
    ):
        try:
            value = json.loads(path.read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if value:
            return str(value)
    return None


def model_card(model_dir: Path, repo_id: str, base_model: Optional[str] = None) -> str:
    """The model card (README.md) of a policy pushed as `repo_id`: its base model named (a Hub
    model as the card's `base_model`, which links it; a local one, such as the CPU stand-in, by its
    name, said not to be on the Hub), how it was trained and how to load it."""
    from huggingface_hub import ModelCard, ModelCardData

    base = base_model or base_model_of(model_dir)
    on_hub = bool(base) and not Path(base).exists() and bool(REPO_ID.match(base))
    adapter = model_kind(model_dir) == "adapter"
    data = ModelCardData(
        base_model=base if on_hub else None,
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        tags=["cernenv", "grpo", "trl", "reinforcement-learning"],
    )
    if on_hub:
        origin = f"a fine-tuned version of [{base}](https://huggingface.co/{base})"
    else:
        origin = (
            f"trained from {Path(base).name if base else 'a base model that was not recorded'}, which is not on "
            "the Hub (`cernenv-tiny` is the project's CPU stand-in, built by `lib.training.policy_model`)"
        )
    form = "a LoRA adapter (PEFT)" if adapter else "the whole model"
    body = (
        f"# {repo_id}\n\nA CERNenv policy: {origin}, trained with GRPO (TRL's `GRPOTrainer`) on whole "
        "CERNenv discovery campaigns (`lib.training` of the CERNenv Lab repository): it writes each action of "
        "an LHC resonance search as JSON and reads the environment's observation after each.\n\n"
        f"This repository holds {form}. Load it with `lib.training.publish.load_trained_policy`, or with "
        f"`{'peft.AutoPeftModelForCausalLM' if adapter else 'transformers.AutoModelForCausalLM'}"
        f'.from_pretrained("{repo_id}")`.\n'
    )
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def push_to_hub(
    model_dir: Path,
    repo_id: str,
    *,
    dry_run: bool = False,
    private: bool = True,
    token: Optional[str] = None,
    base_model: Optional[str] = None,
) -> Dict[str, Any]:
    """Upload a saved policy folder to the Hugging Face Hub as `repo_id` ("user/name"; created
    private if missing), with its model card (`model_card`, written into the folder as README.md,
    naming `base_model`, by default the one `base_model_of` finds). `dry_run`: check the folder and
    the id, write the card, and return the plan, sending nothing. Returns {"repo_id", "kind",
    "files": {name: bytes}, "dry_run", "url"}."""
    model_dir = Path(model_dir)
    if not REPO_ID.match(repo_id or ""):
        raise ValueError(f"hub repo id must look like 'user/name', got {repo_id!r}")
    kind = model_kind(model_dir)
    if kind == "adapter":
        base = json.loads((model_dir / "adapter_config.json").read_text()).get("base_model_name_or_path", "")
        if Path(base).is_absolute():  # a local base (the CPU stand-in): nobody else can load the adapter
            raise ValueError(
                f"the adapter's base model is the local folder {base}; publish merged weights "
                "(save_merged) or train on a model from the Hub"
            )
    atomic_write(model_dir / "README.md", model_card(model_dir, repo_id, base_model))
    files = {str(p.relative_to(model_dir)): p.stat().st_size for p in sorted(model_dir.rglob("*")) if p.is_file()}
    plan = {"repo_id": repo_id, "kind": kind, "files": files, "dry_run": dry_run, "url": None}
    if dry_run:
        return plan
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.upload_folder(
        folder_path=str(model_dir), repo_id=repo_id, commit_message="CERNenv GRPO policy (lib.training)"
    )
    plan["url"] = getattr(commit, "commit_url", None) or f"https://huggingface.co/{repo_id}"
    return plan
