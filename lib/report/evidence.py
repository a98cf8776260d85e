"""Evidence that training improved the agent, from the files of one run: the before/after
comparison (`render_before_after`: before_after_metrics.json with paired 95% bootstrap
intervals, and its two figures), a Markdown sample of trajectories
(`render_sample_trajectories`), and `render_all`, which redraws every artifact from what exists,
reading each file of the folder once into an `Evidence` (`read_evidence`) that every renderer draws from.

Three kinds of evidence, all under one folder (`EvidencePaths`):

1. Per-step training metrics (`TrainingLogWriter` → training_log.csv) and per-rollout
   reward components (`RewardComponentLogWriter` → reward_components.csv).
2. Held-out evaluations at checkpoints (`CheckpointEvalWriter` → checkpoint_evals.csv).
3. Episodes before and after training (pre_eval.jsonl.gz / post_eval.jsonl.gz, one episode per
   line, gzip-compressed).

The logs and their reading are `lib.report.evidence_logs`', the figures
`lib.report.evidence_figures`', the statistics `lib.measure.comparison`'s, an episode's
Markdown `lib.report.episode_markdown`'s. This module is also the one import of the evidence
interface (`__all__`: the writers, readers and renderers), as the project's first evidence
logger had it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

from cernenv.suite import part_of
from lib.files import atomic_write, write_json
from lib.measure.comparison import (
    before_after_metrics,
    same_tasks,
    training_reward_trend,
)
from lib.measure.evaluation import PARTS, group_label, split_of
from lib.report.conclusion import run_changes
from lib.report.episode_markdown import correct_by_part, episode_markdown_lines, sample_pairs, spread_by_reward
from lib.report.evidence_figures import (
    figure_png,
    palette_png,
    plot_checkpoint_progression,
    plot_reward_components,
    plot_training_curve,
    render_checkpoint_progression,
    render_distribution,
    render_reward_components,
    render_summary,
    render_training_curve,
)
from lib.report.evidence_logs import (
    CheckpointEvalWriter,
    Evidence,
    EvidencePaths,
    Records,
    RewardComponentLogWriter,
    TrainingLogWriter,
    read_evidence,
    read_records,
)

logger = logging.getLogger(__name__)


def _before_after(
    pre: Sequence[Mapping[str, Any]],
    post: Sequence[Mapping[str, Any]],
    sources: Mapping[str, str],
    *,
    metrics_json: Path,
    summary_png: Path,
    distribution_png: Path,
    training_log: Optional[Records] = None,
) -> Tuple[Optional[Dict[str, Any]], Dict[str, Optional[Path]]]:
    written: Dict[str, Optional[Path]] = {"metrics_json": None, "summary_png": None, "distribution_png": None}
    if not pre and not post:
        return None, written
    payload = before_after_metrics(pre, post)
    if training_log is not None:
        payload["training_reward_trend"] = training_reward_trend(training_log.rows)
    payload["sources"] = dict(sources)
    written["metrics_json"] = write_json(metrics_json, payload)
    null_changes = [change for change in run_changes(pre, post) if change.metric.group == "null"]
    written["summary_png"] = render_summary(payload, summary_png, null_changes)
    written["distribution_png"] = render_distribution(pre, post, distribution_png)
    return payload, written


def render_before_after(
    *, pre_jsonl: Path, post_jsonl: Path, summary_png: Path, distribution_png: Path, metrics_json: Path
) -> Optional[Dict[str, Any]]:
    """Before/after metrics JSON, bar chart with 95% intervals and shared-bin reward histogram.

    Returns the JSON payload, or None (nothing written) when neither file holds an episode;
    with one side only, that side is drawn and deltas are null. JSON keys: `pre`/`post`
    (n, n_with_particle, n_correct, mean_reward, median_reward, success_rate = correct_outcome
    rate, mass_acc/channel_acc/spin_acc over episodes whose particle exists, None counted wrong),
    `delta` (post − pre), `pre_ci95`/`post_ci95` (bootstrap interval of each mean),
    `delta_ci95` (interval of post − pre for mean_reward and success_rate), `n`,
    `bootstrap` (pairing "paired" or "unpaired", resamples, numpy seed), `training_reward_trend`
    (`lib.measure.comparison.training_reward_trend` of training_log.csv, in `render_all`), and `groups`: the
    same keys (with `pairing` in place of `bootstrap`) for each group of
    `lib.measure.evaluation.GROUPS` but "all" (the unseen-particle and rediscovery parts, tasks with
    a particle and null tasks). Files written before `groups` and `n_correct` existed still
    render with `before_after_markdown`.
    """
    pre, post = read_records(Path(pre_jsonl)).rows, read_records(Path(post_jsonl)).rows
    outputs = {
        "metrics_json": Path(metrics_json),
        "summary_png": Path(summary_png),
        "distribution_png": Path(distribution_png),
    }
    return _before_after(pre, post, {"pre": str(pre_jsonl), "post": str(post_jsonl)}, **outputs)[0]


# ----------------------------------------------------------------------------- trajectories


def sample_trajectories_markdown(
    pre: Sequence[Mapping[str, Any]], post: Sequence[Mapping[str, Any]], n_samples: int = 3
) -> Optional[str]:
    """Markdown of sample episodes before and after training; None without episodes.

    Opens with the correct outcomes before → after per part of the suite (`correct_by_part`).
    Samples are chosen per part (`lib.measure.evaluation.PARTS`), `n_samples` each: when both sides
    hold the same tasks, the same tasks are shown before and after, chosen evenly over the
    pre-training reward ranking; otherwise each side's own episodes are chosen that way.
    Every step lists its action, key parameters, reward and rule violations.
    """
    if not pre and not post:
        return None
    md = [
        "# CERNenv: sample trajectories before and after training",
        "",
        "Correct outcomes, before → after training:",
        "",
    ]
    md += [f"- {line}" for line in correct_by_part(pre, post)] + [""]
    by_part = {
        part: (
            [e for e in pre if part_of(e.get("scenario")) == part],
            [e for e in post if part_of(e.get("scenario")) == part],
        )
        for part in PARTS
    }
    if same_tasks(pre, post):
        pairs = [
            (part, pair)
            for part, (part_pre, part_post) in by_part.items()
            for pair in sample_pairs(part_pre, part_post, n_samples)
        ]
        md += [
            f"The same {len(pairs)} task(s) before and after training, up to {n_samples} per part of the "
            f"suite, spread from the lowest to the highest pre-training reward ({len(pre)} tasks evaluated).",
            "",
        ]
        for i, (part, (before, after)) in enumerate(pairs, start=1):
            md += [f"## Task {i} · {group_label(part)}", ""]
            md += episode_markdown_lines(before, "Before training")
            md += episode_markdown_lines(after, "After training")
    else:
        md += [
            "Episodes spread from the lowest to the highest reward of each side and part of the suite "
            "(the two sides are different tasks).",
            "",
        ]
        for side, label in ((0, "Before training"), (1, "After training")):
            md += [f"## {label} ({len((pre, post)[side])} episodes)", ""]
            chosen = [
                (part, episode)
                for part, episodes in by_part.items()
                for episode in spread_by_reward(episodes[side], n_samples)
            ]
            for i, (part, episode) in enumerate(chosen, start=1):
                md += episode_markdown_lines(episode, f"Episode {i} of {len(chosen)} · {group_label(part)}")
            if not chosen:
                md += ["_No episodes yet._", ""]
    return "\n".join(md)


def render_sample_trajectories(
    *, pre_jsonl: Path, post_jsonl: Path, md_path: Path, n_samples: int = 3
) -> Optional[Path]:
    """`sample_trajectories_markdown` of two episode files, written to `md_path`; None (nothing
    written) without episodes."""
    pre, post = read_records(Path(pre_jsonl)).rows, read_records(Path(post_jsonl)).rows
    return _write_markdown(sample_trajectories_markdown(pre, post, n_samples), Path(md_path))


def _write_markdown(text: Optional[str], path: Path) -> Optional[Path]:
    return None if text is None else atomic_write(path, text)


# ----------------------------------------------------------------------------- tables


def _signed(value: Any) -> str:
    return "—" if value in ("", None) else f"{float(value):+.3f}"


def reward_components_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: each reward component's mean in the first and the last logged rollout batch
    (rows of reward_components.csv); "" without rows."""
    if not rows:
        return ""
    first, last = rows[0], rows[-1]
    lines = [f"| component | step {first['step']} | step {last['step']} |", "|---|---|---|"]
    lines += [f"| {k} | {_signed(first[k])} | {_signed(last[k])} |" for k in first if k not in ("step", "n")]
    return "\n".join(lines)


def checkpoint_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown: the held-out checkpoint evaluations (rows of checkpoint_evals.csv); "" without rows."""
    if not rows:
        return ""
    lines = ["| step | episodes | mean reward | success rate |", "|---|---|---|---|"]
    lines += [
        f"| {r['step']} | {r['episodes']} | {float(r['mean_reward']):+.3f} | {float(r['success_rate']):.3f} |"
        for r in rows
    ]
    return "\n".join(lines)


def policy_and_baselines_table(baselines: Mapping[str, Any], before_after: Mapping[str, Any]) -> str:
    """Markdown: the baselines' mean reward and success rate (the `metrics` of baselines.json,
    written by notebook 02) beside the policy's before and after GRPO (`TrainResult.before_after`),
    means only (the intervals are in the evidence's before/after report)."""
    lines = ["| agent | mean reward | success rate |", "|---|---|---|"]
    for agent, metrics in baselines.items():
        lines.append(f"| {agent} | {metrics['mean_reward']['mean']:.3f} | {metrics['success_rate']['mean']:.3f} |")
    for label, key in (("policy before GRPO", "pre"), ("policy after GRPO", "post")):
        metrics = before_after[key]
        lines.append(f"| {label} | {metrics['mean_reward']:.3f} | {metrics['success_rate']:.3f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- everything


def render_all(evidence: Union[Evidence, EvidencePaths]) -> Dict[str, Optional[Path]]:
    """Regenerate every PNG, JSON and Markdown artifact from the data that exist, each file of the
    folder read once (`read_evidence`; pass an `Evidence` already read to read none).

    Keys are `EvidencePaths` attribute names; a value is None when there was nothing to
    render or rendering failed (logged, never raised: a training callback must not die
    because a plot did).
    """
    keys = (
        "training_curve_png",
        "reward_components_png",
        "checkpoint_progression_png",
        "sample_trajectories_md",
        "before_after_metrics_json",
        "before_after_summary_png",
        "reward_distribution_png",
    )
    out: Dict[str, Optional[Path]] = dict.fromkeys(keys)
    if not isinstance(evidence, Evidence):
        try:
            evidence = read_evidence(evidence)
        except Exception:
            logger.exception("reading the evidence in %s failed; nothing was rendered", evidence.root)
            return out
    paths = evidence.paths
    plots = {
        "training_curve_png": lambda: plot_training_curve(evidence.training_log, paths.training_curve_png),
        "reward_components_png": lambda: plot_reward_components(
            evidence.reward_components, paths.reward_components_png
        ),
        "checkpoint_progression_png": lambda: plot_checkpoint_progression(
            evidence.checkpoint_evals,
            paths.checkpoint_progression_png,
            split=split_of(evidence.pre or evidence.post or ()),
        ),
        "sample_trajectories_md": lambda: _write_markdown(
            sample_trajectories_markdown(evidence.pre, evidence.post), paths.sample_trajectories_md
        ),
    }
    for key, render in plots.items():
        try:
            out[key] = render()
        except Exception:
            logger.exception("rendering %s failed; the other evidence is still rendered", key)
    try:
        # the episode files beside the metrics, by name: no path of the machine that wrote them, which
        # would be wrong once the folder is copied (make promote-evidence) and says nothing to a reader
        sources = {"pre": paths.pre_eval_jsonl.name, "post": paths.post_eval_jsonl.name}
        written = _before_after(
            evidence.pre,
            evidence.post,
            sources,
            metrics_json=paths.before_after_metrics_json,
            summary_png=paths.before_after_summary_png,
            distribution_png=paths.reward_distribution_png,
            training_log=evidence.training_log,
        )[1]
    except Exception:
        logger.exception("rendering the before/after metrics failed; the other evidence is still rendered")
        written = {}
    out["before_after_metrics_json"] = written.get("metrics_json")
    out["before_after_summary_png"] = written.get("summary_png")
    out["reward_distribution_png"] = written.get("distribution_png")
    return out


__all__ = [
    "Evidence",
    "EvidencePaths",
    "read_evidence",
    "plot_training_curve",
    "plot_reward_components",
    "plot_checkpoint_progression",
    "sample_trajectories_markdown",
    "figure_png",
    "palette_png",
    "TrainingLogWriter",
    "RewardComponentLogWriter",
    "CheckpointEvalWriter",
    "Records",
    "read_records",
    "render_training_curve",
    "render_reward_components",
    "render_checkpoint_progression",
    "render_before_after",
    "render_sample_trajectories",
    "render_all",
    "reward_components_table",
    "checkpoint_table",
    "policy_and_baselines_table",
]
