"""An episode as Markdown (what the agent saw, said and earned, step by step), and a fair
sample of episodes to read: spread over the reward ranking, never the best ones alone."""

from __future__ import annotations

import json
import math
from typing import Any, List, Mapping, Sequence, Tuple

import numpy as np

from cernenv.suite import part_of
from lib.episodes.records import as_episode_dict, pair_key
from lib.measure.comparison import correct_change, same_tasks, summarise_episodes
from lib.measure.evaluation import GROUP_WORDS, PARTS, episode_groups, group_label
from lib.measure.metrics import as_number

MAX_TABLE_STEPS = 40
"""Steps listed per episode; the rest are counted."""


def _md(text: Any, limit: int = 120) -> str:
    """Text safe inside a Markdown table cell, cut to `limit` characters."""
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), default=str)
    return str(value)


def _format_reward(value: Any) -> str:
    number = as_number(value)
    return "—" if math.isnan(number) else f"{number:+.3f}"


def _truth_summary(truth: Any) -> str:
    if not isinstance(truth, Mapping) or "exists" not in truth:
        return "unknown (no truth recorded)"
    if not truth["exists"]:
        return "no particle (a null scenario: the right answer is no discovery)"
    parts = []
    if truth.get("mass_gev") is not None:
        parts.append(f"mass {_format_value(as_number(truth['mass_gev']))} GeV")
    if truth.get("width_gev") is not None:
        parts.append(f"width {_format_value(as_number(truth['width_gev']))} GeV")
    if truth.get("spin") is not None:
        parts.append(f"spin {truth['spin']}")
    if truth.get("channels"):
        parts.append("channels " + ", ".join(map(str, truth["channels"])))
    if truth.get("cross_section_fb") is not None:
        parts.append(f"σ {_format_value(as_number(truth['cross_section_fb']))} fb")
    return "a particle" + (": " + "; ".join(parts) if parts else "")


def _verdict(value: Any) -> str:
    return "n/a" if value is None else ("✓" if value else "✗")


def episode_markdown_lines(episode: Mapping[str, Any], heading: str) -> List[str]:
    steps = episode.get("steps") or []
    steps = steps if isinstance(steps, list) else []
    outcome = episode.get("correct_outcome")
    lines = [
        f"### {heading}",
        "",
        f"- **Task**: scenario `{episode.get('scenario') or 'procedural'}`, "
        f"difficulty `{episode.get('difficulty')}`, "
        f"seed `{episode.get('seed')}`; part: {group_label(part_of(episode.get('scenario')))}",
        f"- **Truth**: {_truth_summary(episode.get('truth'))}",
        f"- **Outcome**: {'correct ✓' if outcome else 'wrong ✗' if outcome is not None else 'not graded'}; "
        f"discovery claimed {_verdict(episode.get('discovered'))}, mass {_verdict(episode.get('correct_mass'))}, "
        f"channel {_verdict(episode.get('correct_channel'))}, spin {_verdict(episode.get('correct_spin'))}",
        f"- **Reward**: {_format_reward(episode.get('cumulative_reward'))} over {len(steps)} step(s)",
        "",
    ]
    if not steps:
        return lines + ["_No steps recorded._", ""]
    lines += ["| # | action | key parameters | reward | parsed | rule violations |", "|---|---|---|---|---|---|"]
    for i, step in enumerate(steps[:MAX_TABLE_STEPS], start=1):
        step = step if isinstance(step, Mapping) else {"action": step}
        action = step.get("action")
        if isinstance(action, Mapping):
            kind = action.get("action_type", "?")
            params = action.get("parameters") or {}
            params = (
                ", ".join(f"{k}={_format_value(v)}" for k, v in params.items())
                if isinstance(params, Mapping)
                else _format_value(params)
            )
        else:
            kind, params = "(unparsed)", "" if action is None else f"raw: {action}"
        violations = step.get("rule_violations") or []
        violations = "; ".join(map(str, violations)) if isinstance(violations, list) else str(violations)
        parsed = step.get("parsed_ok")
        lines.append(
            f"| {i} | `{_md(kind, 40)}` | {_md(params) or '—'} | {_format_reward(step.get('reward'))} "
            f"| {_verdict(parsed) if parsed is not None else '—'} | {_md(violations) or '—'} |"
        )
    if len(steps) > MAX_TABLE_STEPS:
        lines.append(f"| … | {len(steps) - MAX_TABLE_STEPS} more step(s) | | | | |")
    return lines + [""]


def format_episode_markdown(episode: Any, heading: str) -> str:
    """One episode (an `EpisodeRecord` or its dict) as readable Markdown: task, truth, outcome, steps."""
    return "\n".join(episode_markdown_lines(as_episode_dict(episode), heading))


def reward_breakdown_table(components: Mapping[str, float], total: float) -> str:
    """Markdown: an episode's reward, component by component (`cernenv.rewards`), and its total."""
    rows = [f"| `{name}` | {value:+.3f} |" for name, value in components.items()]
    return "\n".join(["| component | episode total |", "|---|---|", *rows, f"| **total** | **{total:+.3f}** |"])


def episodes_summary_table(episodes: Sequence[Any]) -> str:
    """Markdown: one row per episode (`EpisodeRecord` or a JSONL row): its task, length, claim,
    the budget it used, the best global significance it reached and its reward."""
    lines = [
        "| scenario | seed | steps | claimed discovery | budget used [M$] | best Z_global [σ] | reward |",
        "|---|---|---|---|---|---|---|",
    ]
    for episode in map(as_episode_dict, episodes):
        last = episode["steps"][-1]["observation_summary"] if episode["steps"] else {}
        lines.append(
            f"| `{episode['scenario']}` | {episode['seed']} | {episode['n_steps']} | {episode['discovered']} | "
            f"{as_number(episode['resources'].get('budget_used_musd')):.1f} | "
            f"{as_number(last.get('best_significance')):.2f} | {as_number(episode['cumulative_reward']):+.2f} |"
        )
    return "\n".join(lines)


def _reward_rank(episode: Mapping[str, Any]) -> Tuple[bool, float]:
    reward = as_number(episode.get("cumulative_reward"))
    return (True, 0.0) if math.isnan(reward) else (False, reward)


def spread_by_reward(episodes: Sequence[Mapping[str, Any]], n: int) -> List[Mapping[str, Any]]:
    """`n` episodes spread evenly over the reward ranking (lowest, …, highest): not cherry-picked."""
    ranked = sorted(episodes, key=_reward_rank)
    if len(ranked) <= n:
        return ranked
    return [ranked[int(round(i))] for i in np.linspace(0, len(ranked) - 1, n)]


def sample_pairs(
    pre: Sequence[Mapping[str, Any]], post: Sequence[Mapping[str, Any]], n: int
) -> List[Tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """`n` tasks played both before and after training, as (pre, post) episode pairs, spread
    evenly over the pre-training reward ranking (lowest first): not cherry-picked. Empty
    when the two sides are not the same tasks."""
    if not same_tasks(pre, post):
        return []
    after = {pair_key(e): e for e in post}
    return [(episode, after[pair_key(episode)]) for episode in spread_by_reward(pre, n)]


def correct_by_part(pre: Sequence[Mapping[str, Any]], post: Sequence[Mapping[str, Any]]) -> List[str]:
    """One line per part of the suite with episodes: correct outcomes before → after training,
    in all, with a particle and in null tasks ("unseen particles: 2 → 7 of 78 (...)")."""
    pre_groups, post_groups = episode_groups(pre), episode_groups(post)

    def correct(name: str) -> str:
        return correct_change(
            {"pre": summarise_episodes(pre_groups[name]), "post": summarise_episodes(post_groups[name])}
        )

    return [
        f"{group_label(part)}: {correct(part)} ("
        + "; ".join(f"{GROUP_WORDS[split]} {correct(f'{part}_{split}')}" for split in ("with_particle", "null"))
        + ")"
        for part in PARTS
        if pre_groups[part] or post_groups[part]
    ]
