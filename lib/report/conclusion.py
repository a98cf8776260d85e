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
