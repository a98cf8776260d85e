"""What a run keeps from the runs before it: the previous run's evidence moved aside
(`archive_previous_evidence`), the checkpoints a run may resume from (`resolve_resume`,
`latest_complete_checkpoint`), and the logs cut back to a resumed checkpoint's step
(`drop_rows_after`)."""

from __future__ import annotations

import csv
import io
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Optional

from lib.files import atomic_write
from lib.report.evidence import EvidencePaths
from lib.training.config import TrainConfig

logger = logging.getLogger(__name__)

RUN_FILES = EvidencePaths.training_run_fields()
"""`EvidencePaths` attributes that belong to one training run (notebook 02's baselines are not, and stay)."""


def archive_previous_evidence(paths: EvidencePaths, output_dir: Path) -> Optional[Path]:
    """Move the files of a previous run out of the evidence folder (returns where, or None)."""
    existing = [getattr(paths, name) for name in RUN_FILES if getattr(paths, name).exists()]
    if not existing:
        return None
    target = output_dir / "previous_evidence" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target.mkdir(parents=True, exist_ok=True)
    for path in existing:
        shutil.move(str(path), target / path.name)
    logger.info("moved %d files of the previous run from %s to %s", len(existing), paths.root, target)
    return target


def drop_rows_after(csv_path: Path, step: int) -> None:
    """Rewrite a step-indexed evidence CSV without rows after `step` (they are re-logged
    when a run resumes from that step's checkpoint), and without a torn last line (one a
    killed writer left without its newline: its numbers cannot be trusted)."""
    if not csv_path.exists():
        return
    text = csv_path.read_text()
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    rows = list(csv.reader(io.StringIO(text)))
    if not rows:
        return
    header, body = rows[0], rows[1:]
    index = header.index("step")
    kept = [row for row in body if row and _as_int(row[index]) is not None and _as_int(row[index]) <= step]
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([header, *kept])
    atomic_write(csv_path, out.getvalue())


def logged_seconds(csv_path: Path, step: int) -> float:
    """The `wall_time_s` a training log (`lib.report.evidence_logs.read_records`: a torn last line is
    not read) gave its last row at or before `step` (0.0 without one): the GRPO seconds a run
    resumed from that step's checkpoint had spent before it stopped, which its own clock goes on from."""
    from lib.report.evidence_logs import read_records

    rows = [r for r in read_records(csv_path).rows if r.get("wall_time_s") not in ("", None) and int(r["step"]) <= step]
    return float(rows[-1]["wall_time_s"]) if rows else 0.0


def _as_int(value: str) -> Optional[int]:
    try:
        return int(float(value))
    except ValueError:
        return None


CHECKPOINT_WEIGHTS = (
    "model.safetensors",
    "adapter_model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
)


def checkpoint_is_complete(folder: Path) -> bool:
    """A checkpoint the Trainer finished writing: its weights, optimiser state and a readable
    trainer_state.json (which the Trainer writes after the rest)."""
    folder = Path(folder)
    try:
        json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    return (folder / "optimizer.pt").is_file() and any((folder / name).is_file() for name in CHECKPOINT_WEIGHTS)


def latest_complete_checkpoint(output_dir: Path) -> Optional[Path]:
    """The `checkpoint-N` folder with the largest N that is complete (a run killed while saving
    leaves a partial newest one: it is skipped, with a warning)."""
    output_dir = Path(output_dir)
    folders = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and p.name.split("-", 1)[1].isdigit()]
    for folder in sorted(folders, key=lambda p: int(p.name.split("-", 1)[1]), reverse=True):
        if checkpoint_is_complete(folder):
            return folder
        logger.warning("skipping the incomplete checkpoint %s (a run stopped while saving it)", folder)
    return None


def resolve_resume(config: TrainConfig) -> Optional[str]:
    """The checkpoint folder `config.resume_from_checkpoint` names (\"latest\": the newest complete
    one in output_dir), checked complete; None for a fresh run."""
    if not config.resume_from_checkpoint:
        return None
    if config.resume_from_checkpoint == "latest":
        last = latest_complete_checkpoint(Path(config.output_dir)) if Path(config.output_dir).is_dir() else None
        if last is None:
            raise FileNotFoundError(
                f"resume_from_checkpoint='latest' but {config.output_dir} holds no complete "
                "checkpoint-* folder; start a fresh run (resume_from_checkpoint=None)"
            )
        return str(last)
    if not Path(config.resume_from_checkpoint).is_dir():
        raise FileNotFoundError(f"checkpoint {config.resume_from_checkpoint} does not exist")
    if not checkpoint_is_complete(Path(config.resume_from_checkpoint)):
        raise ValueError(
            f"checkpoint {config.resume_from_checkpoint} is incomplete (no weights, optimizer.pt or "
            "readable trainer_state.json): resume from an earlier one, or with 'latest'"
        )
    return config.resume_from_checkpoint
