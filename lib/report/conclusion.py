"""What a run shows, in plain words: the opening of notebook 04, computed from its evaluations.

`run_changes` measures, for each of `HEADLINE_METRICS`, the policy before and after GRPO on the
held-out suite and the after − before difference with its 95% bootstrap interval (paired by task
where both sides played the same episodes, `lib.measure.metrics.paired_difference`; else the two
sides resampled on their own). A change is clear when its interval leaves out zero, and a gain
or a harm by the metric's direction. `conclusion_markdown` says it: the clear harms and the clear
gains first, then what did not clearly change, every figure from the episodes.
`baseline_episodes_note` says whether the reference agents and the policy played the same episodes.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence

from cernenv.suite import part_of
from lib.episodes.records import as_episode_dict
from lib.measure.comparison import same_tasks
from lib.measure.evaluation import episode_groups, heldout_suite
from lib.measure.metrics import (
    Estimate,
    as_number,
    bootstrap_difference,
    bootstrap_mean,
    metric_values,
    paired_difference,
)
from lib.seeds import BOOTSTRAP_SEED


@dataclass(frozen=True)
class HeadlineMetric:
    """A number the conclusion reports: its name for a reader, the group of the suite it is
    taken on (`lib.measure.evaluation.GROUPS`), its metric (`lib.measure.metrics.METRICS`),
    whether higher is better, and what a clear change of it means, in words."""

    label: str
    group: str
    metric: str
    higher_is_better: bool
    meaning_up: str
    meaning_down: str


HEADLINE_METRICS = (
    HeadlineMetric(
        "success", "all", "success_rate", True, "more tasks ended with the right outcome", "fewer right outcomes"
    ),
    HeadlineMetric("mean reward", "all", "mean_reward", True, "a higher return per episode", "a lower return"),
    HeadlineMetric(
        "null-task success",
        "null",
        "success_rate",
        True,
        "it says more often that nothing is there when nothing is",
        "it says less often that nothing is there when nothing is",
    ),
    HeadlineMetric(
        "false-discovery rate",
        "null",
        "false_discovery_rate",
        False,
        "more discoveries claimed where there is nothing",
        "fewer discoveries claimed where there is nothing",
    ),
)


@dataclass(frozen=True)
class Change:
    """One headline metric before and after GRPO, and the difference with its 95% interval."""

    metric: HeadlineMetric
    before: Estimate
    after: Estimate
    delta: Estimate
    paired: bool

    @property
    def clear(self) -> bool:
        """The 95% interval of the difference leaves out zero."""
        return self.delta.n > 0 and (self.delta.low > 0 or self.delta.high < 0)

    @property
    def verdict(self) -> str:
        """`gain`, `harm` or `unclear`."""
        if not self.clear:
            return "unclear"
        return "gain" if (self.delta.mean > 0) == self.metric.higher_is_better else "harm"

    def figures(self) -> str:
        """ "0.943 → 0.839 (Δ −0.103 [−0.172, −0.046])"."""
        delta = self.delta
        interval = f" [{_signed(delta.low)}, {_signed(delta.high)}]" if delta.n else ""
        return f"{self.before.mean:.3f} → {self.after.mean:.3f} (Δ {_signed(delta.mean)}{interval})"

    def meaning(self) -> str:
        return self.metric.meaning_up if self.delta.mean > 0 else self.metric.meaning_down


def _signed(value: float) -> str:
    return f"{value:+.3f}".replace("-", "−")


def _numbers(values: Sequence[Any]) -> List[float]:
    return [as_number(v) for v in values if not math.isnan(as_number(v))]


def run_changes(pre: Sequence[Any], post: Sequence[Any]) -> List[Change]:
    """Each of `HEADLINE_METRICS` before and after, with the difference's 95% interval (paired
    when both sides hold the same tasks); a metric no episode of its group measures is left out."""
    pre_groups, post_groups = episode_groups(pre), episode_groups(post)
    changes = []
    for headline in HEADLINE_METRICS:
        before, after = pre_groups[headline.group], post_groups[headline.group]
        before_values = _numbers(metric_values(headline.metric, before))
        after_values = _numbers(metric_values(headline.metric, after))
        if not before_values or not after_values:
            continue
        paired = same_tasks(before, after)
        if paired:
            delta = paired_difference(before, after, headline.metric, seed=BOOTSTRAP_SEED)
        else:
            delta = bootstrap_difference(before_values, after_values, seed=BOOTSTRAP_SEED)
        sides = [bootstrap_mean(values, seed=BOOTSTRAP_SEED) for values in (before_values, after_values)]
        changes.append(Change(headline, *sides, delta, paired))
    return changes


VERDICT_WORDS = {"harm": "**Clearly worse**", "gain": "**Clearly better**", "unclear": "No clear change"}
MIN_EPISODES_TO_CONCLUDE = 30
"""Below this many episodes a side, the conclusion names no effect: a bootstrap interval of a few
episodes (a smoke run's 6, whose differences may all be equal) says little about the policy."""


def _summary(harms: int, gains: int) -> str:
    if harms and gains:
        return "Training's clear effects are gains and harms alike:"
    if harms:
        return "Training's only clear effects are harms:"
    if gains:
        return "Training's clear effects are gains:"
    return "No change is clear: every interval holds zero."


def conclusion_markdown(pre: Sequence[Any], post: Sequence[Any]) -> str:
    """The run's conclusion in plain words, from its episodes before and after GRPO: a sentence
    saying whether its clear effects are gains, harms or none (or that a side has fewer than
    `MIN_EPISODES_TO_CONCLUDE` episodes to tell), then each headline metric, clear harms first, then
    clear gains, then what did not clearly change: before → after with the difference and its 95%
    interval, and what a clear change means."""
    changes = run_changes(pre, post)
    if not changes:
        return "**What this run shows:** nothing yet: the evaluations hold no episodes."
    order = {"harm": 0, "gain": 1, "unclear": 2}
    changes = sorted(changes, key=lambda c: order[c.verdict])
    paired = all(c.paired for c in changes)
    how = (
        f"{len(pre)} held-out episodes played by the policy before and after GRPO, paired by task"
        if paired
        else f"{len(pre)} and {len(post)} held-out episodes before and after GRPO, not the same ones (unpaired)"
    )
    verdicts = [c.verdict for c in changes]
    too_few = min(len(pre), len(post)) < MIN_EPISODES_TO_CONCLUDE
    summary = (
        f"Too few episodes to conclude anything (fewer than {MIN_EPISODES_TO_CONCLUDE}): "
        "the figures check the pipeline."
        if too_few
        else _summary(verdicts.count("harm"), verdicts.count("gain"))
    )
    lines = [f"**What this run shows** ({how}; Δ is after − before, with its 95% bootstrap interval). {summary}", ""]
    for c in changes:
        meaning = f": {c.meaning()}" if c.clear and not too_few else ""
        words = "Too few to tell" if too_few else VERDICT_WORDS[c.verdict]
        lines.append(f"- {words}: {c.metric.label} {c.figures()}{meaning}.")
    return "\n".join(lines)


def _tasks(episodes: Sequence[Any]) -> Counter:
    return Counter((int(e["seed"]), part_of(e.get("scenario"))) for e in map(as_episode_dict, episodes))


def baseline_episodes_note(baselines: Optional[Mapping[str, Any]], policy_episodes: Sequence[Any]) -> str:
    """Whether the reference agents of `baselines` (a baselines.json: notebook 02 plays the first
    `n_episodes` of its held-out suite) and the policy (`policy_episodes`, its evaluation) played
    the same episodes, in a sentence: a smoke run's play different ones, which a comparison must say."""
    if not baselines:
        return ""
    counts = set((baselines.get("n_episodes") or {}).values())
    if len(counts) != 1:
        return "The reference agents played different numbers of episodes: their rows are not of the same tasks."
    (n,) = counts
    suite = heldout_suite(baselines["suite_version"])
    theirs = Counter((spec.seed, spec.part) for spec in suite[:n])
    ours = _tasks(policy_episodes)
    if theirs == ours:
        return f"The reference agents and the policy played the same {n} held-out episodes."
    shared = sum((theirs & ours).values())
    whose = "the whole held-out suite" if n >= len(suite) else f"the first {n} episodes of the held-out suite"
    return (
        f"**Not the same episodes:** the reference agents played {whose}, the policy {sum(ours.values())} "
        f"episodes of its own evaluation ({shared} of them in common), so their rows compare different tasks: "
        "read them as a check of the pipeline, not as a comparison."
    )


STILL_GRAD_NORM = 1e-6
"""A GRPO step whose gradient norm is below this did not move the policy (float32 round-off of a
zero gradient is ~1e-7; the smallest step that moved the stand-in measured above 1e-2)."""


def _finite(value: Any) -> Optional[float]:
    number = as_number(value) if value is not None and value != "" else math.nan
    return None if math.isnan(number) else number


def still_step(row: Mapping[str, Any]) -> Optional[str]:
    """Why a GRPO step (a training_log.csv row, or a Trainer's log) could not move the policy, in
    words, or None when it could: its gradient norm is about zero (`STILL_GRAD_NORM`), or every
    group's episodes scored alike (`frac_reward_zero_std` 1), so the reward ranked nothing and only
    the KL or decision-credit terms could have moved it."""
    grad_norm = _finite(row.get("grad_norm"))
    alike = _finite(row.get("frac_reward_zero_std"))
    reward, spread = _finite(row.get("reward")), _finite(row.get("reward_std"))
    scored = f" (reward {reward:+.3f} ± {spread:.3f})" if reward is not None and spread is not None else ""
    every_alike = alike is not None and alike >= 1.0
    if grad_norm is not None and grad_norm < STILL_GRAD_NORM:
        cause = (
            f"every group's episodes scored alike{scored}, so no episode had an advantage to learn from"
            if every_alike
            else "no sample had a loss to follow"
        )
        return f"gradient norm {grad_norm:.2g}: {cause}"
    if every_alike:
        moved = f" (gradient norm {grad_norm:.2g})" if grad_norm is not None else ""
        return (
            f"every group's episodes scored alike{scored}: the reward ranked nothing, and only the KL or "
            f"decision-credit terms moved the policy{moved}"
        )
    return None


STILL_STEP_ADVICE = (
    "groups differ when their episodes do: try a higher `temperature`, more `num_generations` or "
    "`dynamic_sampling` (docs/exploration.md), and read the episodes for replies refused alike"
)
"""What to try when GRPO steps cannot move the policy."""


def still_steps_markdown(training_log: Sequence[Mapping[str, Any]]) -> str:
    """A warning for the steps of a run's training log that could not move the policy (`still_step`),
    one line each, with what to try; "" when every step could."""
    still = [(row.get("step"), reason) for row in training_log for reason in [still_step(row)] if reason]
    if not still:
        return ""
    steps = len(training_log)
    lines = [
        f"**Warning: {len(still)} of {steps} GRPO steps could not move the policy by the reward.** "
        f"What {'that step' if len(still) == 1 else 'those steps'} learned did not come from GRPO's ranking of "
        f"episodes; {STILL_STEP_ADVICE}.",
        "",
    ]
    lines += [f"- step {step}: {reason}." for step, reason in still]
    return "\n".join(lines)
