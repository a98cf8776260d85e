"""After training: load the saved policy, merge its LoRA adapter, publish it on the Hub.

`train` saves the final policy to `<output_dir>/final`: the LoRA adapter (PEFT's
`adapter_config.json` + weights, on top of the base model it names) or, with `lora_r=0`,
the whole model, and the tokenizer beside it. `load_trained_policy` loads either form;
`save_merged` writes the base model with the adapter folded in (a plain transformers
model, for inference engines that take no adapters); `push_to_hub` uploads a folder, or
with `dry_run` only checks it and lists what would be sent (no network).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

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

    from lib.tokenizer import load_tokenizer

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
    return out_dir


def push_to_hub(
    model_dir: Path, repo_id: str, *, dry_run: bool = False, private: bool = True, token: Optional[str] = None
) -> Dict[str, Any]:
    """Upload a saved policy folder to the Hugging Face Hub as `repo_id` ("user/name"; created
    private if missing). `dry_run`: check the folder and the id and return the plan, sending
    nothing. Returns {"repo_id", "kind", "files": {name: bytes}, "dry_run", "url"}."""
    model_dir = Path(model_dir)
    if not REPO_ID.match(repo_id or ""):
        raise ValueError(f"hub repo id must look like 'user/name', got {repo_id!r}")
    kind = model_kind(model_dir)
    files = {str(p.relative_to(model_dir)): p.stat().st_size for p in sorted(model_dir.rglob("*")) if p.is_file()}
    if kind == "adapter":
        base = json.loads((model_dir / "adapter_config.json").read_text()).get("base_model_name_or_path", "")
        if Path(base).is_absolute():  # a local base (the CPU stand-in): nobody else can load the adapter
            raise ValueError(
                f"the adapter's base model is the local folder {base}; publish merged weights "
                "(save_merged) or train on a model from the Hub"
            )
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
