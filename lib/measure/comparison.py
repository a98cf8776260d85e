"""Before and after training: the comparison of two evaluations of the same tasks, and its Markdown.

`before_after_metrics` summarises both sides (`summarise_episodes`: counts, rewards and the
accuracies of `SUMMARY_METRICS`), their differences with 95% bootstrap intervals (paired by
task, `lib.measure.metrics.paired_difference`, where both sides hold the same tasks), per group of
the suite as well; `before_after_markdown` and `group_table` write it for a reader;
`checkpoint_row` is a checkpoint's row of checkpoint_evals.csv. The intervals use
`BOOTSTRAP_SEED`, so a re-render gives the same numbers.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from lib.episodes.records import ENDINGS, PAIR_KEY, episode_ending, pair_key
from lib.measure.evaluation import GROUPS, PARTS, episode_groups, group_label
from lib.measure.metrics import (
    CONFIDENCE,
    METRICS,
    N_BOOTSTRAP,
    as_number,
    bootstrap_difference,
    bootstrap_mean,
    paired_difference,
)
from lib.seeds import BOOTSTRAP_SEED

# Key in the JSON and checkpoint CSV → metric of `lib.measure.evaluation.METRICS` (one definition of each).
SUMMARY_METRICS = {
    "mean_reward": "mean_reward",
    "success_rate": "success_rate",
    "mass_acc": "mass_accuracy",
    "channel_acc": "channel_accuracy",
    "spin_acc": "spin_accuracy",
}
DIFFERENCE_METRICS = ("mean_reward", "success_rate")
"""Metrics whose post − pre difference gets a bootstrap interval."""


def episode_values(episodes: Sequence[Mapping[str, Any]], key: str) -> List[Tuple[Tuple, float]]:
    """(pair key, value) for the episodes `key` averages over; None and non-numbers dropped."""
    _, include, value = METRICS[SUMMARY_METRICS[key]]
    out = []
    for episode in episodes:
        if include(episode):
            number = as_number(value(episode))
            if not math.isnan(number):
                out.append((pair_key(episode), number))
    return out


def _mean(values: Sequence[float]) -> Optional[float]:
    return float(np.mean(values)) if len(values) else None


def summarise_episodes(episodes: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """n, correct outcomes, mean/median reward, success rate and mass/channel/spin accuracy
    (None when no episode qualifies; accuracies count only episodes whose particle exists)."""
    rewards = [v for _, v in episode_values(episodes, "mean_reward")]
    summary: Dict[str, Any] = {
        "n": len(episodes),
        "n_with_particle": sum(bool((e.get("truth") or {}).get("exists")) for e in episodes),
        "n_correct": sum(bool(e.get("correct_outcome")) for e in episodes),
        "mean_reward": _mean(rewards),
        "median_reward": float(np.median(rewards)) if rewards else None,
    }
    for key in SUMMARY_METRICS:
        summary[key] = _mean([v for _, v in episode_values(episodes, key)])
    endings = Counter(episode_ending(e) for e in episodes)
    summary["endings"] = {ending: endings[ending] for ending in ENDINGS if endings[ending]}
    return summary


def endings_line(payload: Mapping[str, Any]) -> str:
    """How the episodes ended, before → after ("claimed nothing there 60 → 71; no claim: ..."),
    every ending either side had; "" for a payload written before endings were counted."""
    pre, post = payload["pre"].get("endings"), payload["post"].get("endings")
    if pre is None or post is None:
        return ""
    shown = [ending for ending in ENDINGS if ending in pre or ending in post]
    return "; ".join(f"{ending} {pre.get(ending, 0)} → {post.get(ending, 0)}" for ending in shown)


def checkpoint_row(
    step: int, episodes: Sequence[Mapping[str, Any]], *, fraction_done: Optional[float] = None
) -> Dict[str, Any]:
    """A `CheckpointEvalWriter.append(**row)` row computed from evaluated episodes, with the mean
    reward's 95% bootstrap interval and the count of episodes with a particle (the accuracies' `n`),
    so a plot of the row can draw every mean and rate with its interval."""
    s = summarise_episodes(episodes)
    interval = bootstrap_interval([v for _, v in episode_values(episodes, "mean_reward")]) or [None, None]
    return {
        "step": step,
        "fraction_done": fraction_done,
        "episodes": s["n"],
        **{k: s[k] for k in ("mean_reward", "success_rate", "mass_acc", "channel_acc")},
        "episodes_with_particle": s["n_with_particle"],
        "mean_reward_low": interval[0],
        "mean_reward_high": interval[1],
    }


def bootstrap_interval(values: Sequence[float]) -> Optional[List[float]]:
    """Percentile-bootstrap 95% interval of a mean ([low, high]; None without values)."""
    estimate = bootstrap_mean(values, seed=BOOTSTRAP_SEED)
    return None if estimate.n == 0 else [estimate.low, estimate.high]


def same_tasks(pre: Sequence[Mapping[str, Any]], post: Sequence[Mapping[str, Any]]) -> bool:
    keys = [[pair_key(e) for e in side] for side in (pre, post)]
    return bool(pre) and all(len(set(k)) == len(k) for k in keys) and set(keys[0]) == set(keys[1])


def difference_interval(
    pre: Sequence[Mapping[str, Any]], post: Sequence[Mapping[str, Any]], key: str
) -> Dict[str, Any]:
    """95% bootstrap interval of post − pre for `key` (a `SUMMARY_METRICS` name).

    Paired (resampling per-task differences) when both sides hold the same episodes by
    (seed, scenario, difficulty), which removes task-to-task variance; otherwise the two
    sides are resampled independently. The statistics live in `lib.measure.metrics`.
    """
    if same_tasks(pre, post):
        estimate = paired_difference(pre, post, SUMMARY_METRICS[key], seed=BOOTSTRAP_SEED)
        return {
            "method": "paired",
            "n_pairs": estimate.n,
            "ci95": None if estimate.n == 0 else [estimate.low, estimate.high],
        }
    pre_values, post_values = episode_values(pre, key), episode_values(post, key)
    estimate = bootstrap_difference([v for _, v in pre_values], [v for _, v in post_values], seed=BOOTSTRAP_SEED)
    return {"method": "unpaired", "n_pairs": 0, "ci95": None if estimate.n == 0 else [estimate.low, estimate.high]}


def _comparison(pre: Sequence[Mapping[str, Any]], post: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Summaries of both sides, their differences and 95% intervals, the counts and the pairing."""
    pre_stats, post_stats = summarise_episodes(pre), summarise_episodes(post)
    keys = ("mean_reward", "median_reward", *[k for k in SUMMARY_METRICS if k != "mean_reward"])
    delta = {
        k: (post_stats[k] - pre_stats[k] if pre_stats[k] is not None and post_stats[k] is not None else None)
        for k in keys
    }
    intervals = {k: difference_interval(pre, post, k) for k in DIFFERENCE_METRICS}
    return {
        "pre": pre_stats,
        "post": post_stats,
        "delta": delta,
        "delta_ci95": {k: v["ci95"] for k, v in intervals.items()},
        "pre_ci95": {k: bootstrap_interval([v for _, v in episode_values(pre, k)]) for k in SUMMARY_METRICS},
        "post_ci95": {k: bootstrap_interval([v for _, v in episode_values(post, k)]) for k in SUMMARY_METRICS},
        "n": {"pre": len(pre), "post": len(post), "pairs": intervals["mean_reward"]["n_pairs"]},
        "pairing": intervals["mean_reward"]["method"],
    }


def before_after_metrics(pre: Sequence[Mapping[str, Any]], post: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """The content of before_after_metrics.json (documented in `render_before_after`)."""
    payload = _comparison(pre, post)
    pairing = payload.pop("pairing")
    payload["bootstrap"] = {
        "pairing": pairing,
        "paired_by": list(PAIR_KEY),
        "interval": "percentile (scipy.stats.bootstrap)",
        "confidence": CONFIDENCE,
        "n_resamples": N_BOOTSTRAP,
        "numpy_seed": BOOTSTRAP_SEED,
    }
    pre_groups, post_groups = episode_groups(pre), episode_groups(post)
    payload["groups"] = {name: _comparison(pre_groups[name], post_groups[name]) for name in GROUPS if name != "all"}
    return payload


def training_reward_trend(rows: Sequence[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """Whether the training reward rose: the mean batch reward (training_log.csv's `reward`) of the
    last quarter of the steps against the first quarter's, with the 95% bootstrap interval of
    the difference (the steps resampled on each side); None with fewer than 8 logged steps."""
    pairs = sorted(
        (int(as_number(row.get("step"))), as_number(row.get("reward")))
        for row in rows
        if not math.isnan(as_number(row.get("step"))) and not math.isnan(as_number(row.get("reward")))
    )
    if len(pairs) < 8:
        return None
    rewards = [reward for _, reward in pairs]
    quarter = len(rewards) // 4
    first, last = rewards[:quarter], rewards[-quarter:]
    difference = bootstrap_difference(first, last, seed=BOOTSTRAP_SEED)
    return {
        "steps": len(rewards),
        "steps_per_quarter": quarter,
        "first_quarter_mean": float(np.mean(first)),
        "last_quarter_mean": float(np.mean(last)),
        "difference": difference.mean,
        "difference_ci95": [difference.low, difference.high],
    }


def before_after_markdown(payload: Mapping[str, Any], keys: Sequence[str] = DIFFERENCE_METRICS) -> str:
    """`before_after_metrics` as Markdown: the pair count, then before, after and the difference
    with its 95% interval for each of `keys`; then, when the payload has `groups` (files written
    before the split have none), the same per group of `lib.measure.evaluation.GROUPS` (`group_table`)."""
    rows = ["| metric | before | after | after − before [95% CI] |", "|---|---|---|---|"]
    for key in keys:
        interval = payload["delta_ci95"].get(key)
        ci = "—" if interval is None else f"[{interval[0]:+.3f}, {interval[1]:+.3f}]"
        rows.append(
            f"| {key} | {_format_stat(payload['pre'][key])} | {_format_stat(payload['post'][key])} "
            f"| {_format_stat(payload['delta'][key], signed=True)} {ci} |"
        )
    text = f"{payload['n']['pairs']} paired episodes.\n\n" + "\n".join(rows)
    if endings_line(payload):
        text += "\n\nHow the episodes ended, before → after: " + endings_line(payload) + "."
    if payload.get("groups"):
        text += (
            "\n\nBy part of the suite ("
            + "; ".join(f"{group_label(p)}: {m}" for p, m in PARTS.items())
            + ") and by task, with a particle or null:\n\n"
            + group_table(payload)
        )
    return text


def correct_change(comparison: Mapping[str, Any]) -> str:
    """Correct outcomes before → after, "7 → 14 of 28" (each side's own n when they differ)."""
    pre, post = comparison["pre"], comparison["post"]
    pre_correct, post_correct = pre.get("n_correct"), post.get("n_correct")
    if pre_correct is None or post_correct is None:
        return "—"
    if pre["n"] == post["n"]:
        return f"{pre_correct} → {post_correct} of {pre['n']}"
    return f"{pre_correct} of {pre['n']} → {post_correct} of {post['n']}"


def group_table(payload: Mapping[str, Any]) -> str:
    """A Markdown table of `before_after_metrics`: one row for the whole suite and one per group
    of its `groups`, with the correct outcomes before → after and, for mean reward and success
    rate, before → after and the difference with its 95% interval."""
    rows = [
        "| group | correct | mean reward | Δ reward [95% CI] | success rate | Δ success [95% CI] |",
        "|---|---|---|---|---|---|",
    ]
    for name, comparison in [("all", payload), *payload.get("groups", {}).items()]:
        cells = []
        for key in DIFFERENCE_METRICS:
            interval = comparison["delta_ci95"].get(key)
            ci = "" if interval is None else f" [{interval[0]:+.3f}, {interval[1]:+.3f}]"
            cells += [
                f"{_format_stat(comparison['pre'][key])} → {_format_stat(comparison['post'][key])}",
                f"{_format_stat(comparison['delta'][key], signed=True)}{ci}",
            ]
        rows.append(f"| {group_label(name)} | {correct_change(comparison)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _format_stat(value: Any, signed: bool = False) -> str:
    return "—" if value is None else (f"{value:+.3f}" if signed else f"{value:.3f}")
