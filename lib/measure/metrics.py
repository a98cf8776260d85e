"""The metrics an agent is measured by, each with one name, and their 95% bootstrap intervals.

`METRICS` lists them (what each means, which episodes it averages over, its value per
episode); `agent_metrics` gives all of them for a list of episodes; `bootstrap_mean` and
`bootstrap_difference` are the intervals, `paired_difference` the paired one of a change
on the same tasks; `comparison_table` and `correct_count` write them for a reader. Evidence
files keep the column names of the original evidence logger for some of them (`mass_acc`,
`mass_correct_rate`): `lib.measure.comparison.SUMMARY_METRICS` maps those to these names.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from scipy import stats

from lib.episodes.records import NO_CLAIM_ENDINGS, as_episode_dict, episode_ending, pair_key

CONFIDENCE = 0.95
N_BOOTSTRAP = 2000


@dataclass(frozen=True)
class Estimate:
    """A mean with its 95% bootstrap confidence interval."""

    mean: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        if self.n == 0:
            return "—"
        return f"{self.mean:.3g} [{self.low:.3g}, {self.high:.3g}]"


def as_number(value: Any) -> float:
    """`value` as a float; NaN when it is not a finite number (None, text, inf)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return math.nan
    return number if math.isfinite(number) else math.nan


def bootstrap_mean(values: Sequence[float], *, seed: int = 0) -> Estimate:
    """Mean and percentile-bootstrap 95% interval (scipy.stats.bootstrap, 2000 resamples)."""
    data = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    if data.size == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    mean = float(data.mean())
    if data.size == 1 or np.all(data == data[0]):
        return Estimate(mean, mean, mean, int(data.size))
    result = stats.bootstrap(
        (data,),
        np.mean,
        n_resamples=N_BOOTSTRAP,
        confidence_level=CONFIDENCE,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    interval = result.confidence_interval
    return Estimate(mean, float(interval.low), float(interval.high), int(data.size))


def bootstrap_difference(before: Sequence[float], after: Sequence[float], *, seed: int = 0) -> Estimate:
    """mean(after) − mean(before) of two independent samples, with the 95% percentile-bootstrap
    interval (each sample resampled on its own). For the same episodes on both sides, prefer
    the paired `bootstrap_mean` of per-episode differences: it removes task-to-task variance."""
    a = np.asarray([v for v in before if v is not None and np.isfinite(v)], dtype=float)
    b = np.asarray([v for v in after if v is not None and np.isfinite(v)], dtype=float)
    if a.size == 0 or b.size == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    mean = float(b.mean() - a.mean())
    if a.size == 1 and b.size == 1 or (np.all(a == a[0]) and np.all(b == b[0])):
        return Estimate(mean, mean, mean, int(min(a.size, b.size)))
    result = stats.bootstrap(
        (a, b),
        lambda x, y, axis=-1: np.mean(y, axis=axis) - np.mean(x, axis=axis),
        n_resamples=N_BOOTSTRAP,
        confidence_level=CONFIDENCE,
        method="percentile",
        random_state=np.random.default_rng(seed),
        vectorized=True,
    )
    interval = result.confidence_interval
    return Estimate(mean, float(interval.low), float(interval.high), int(min(a.size, b.size)))


def has_particle(episode: Mapping[str, Any]) -> Optional[bool]:
    """Whether a particle existed in the episode's hidden truth (`EpisodeRecord.truth`);
    None for a record without a recorded truth."""
    truth = episode.get("truth")
    return bool(truth["exists"]) if isinstance(truth, Mapping) and "exists" in truth else None


def _exists(episode: Mapping[str, Any]) -> bool:
    return bool(has_particle(episode))


def _parse_rate(episode: Mapping[str, Any]) -> Optional[float]:
    steps = episode.get("steps") or []
    if not steps:
        return None
    return float(np.mean([bool(step.get("parsed_ok", True)) for step in steps]))


_FITTED_MASS = re.compile(r"Last \(fit_resonance\):[^\n]*? mass_gev=([-+0-9.eE]+)|fit \S+ ([-+0-9.eE]+)±")


def _claim(episode: Mapping[str, Any]) -> Optional[Mapping[str, Any]]:
    """The parameters of the episode's discovery claim, if it ended with one."""
    steps = episode.get("steps") or []
    action = steps[-1].get("action") if steps else None
    if isinstance(action, Mapping) and action.get("action_type") == "submit_discovery_claim":
        parameters = action.get("parameters") or {}
        return parameters if parameters.get("discovered") is True else None
    return None


def _quotes_own_fit(episode: Mapping[str, Any]) -> Optional[float]:
    """1 when the claimed mass is the episode's own fit: the reference `"@fit.mass_gev"`, or, to the
    4 significant figures prompts show, a mass its fit returned (read from the prompts it saw); 0
    otherwise (another reference included); None without a discovery claim, or for a literal mass
    without prompts (a scripted agent's record)."""
    claim = _claim(episode)
    steps = episode.get("steps") or []
    if claim is not None and isinstance(claim.get("mass_gev"), str):
        return float(claim["mass_gev"] == "@fit.mass_gev")
    if claim is None or not isinstance(claim.get("mass_gev"), (int, float)) or not any(s.get("prompt") for s in steps):
        return None
    fitted = {
        float(format(float(a or b), ".4g"))
        for step in episode.get("steps") or []
        for a, b in _FITTED_MASS.findall(step.get("prompt") or "")
    }
    return float(float(format(float(claim["mass_gev"]), ".4g")) in fitted)


PROPORTIONS = frozenset(
    {
        "success_rate",
        "mass_accuracy",
        "channel_accuracy",
        "spin_accuracy",
        "false_discovery_rate",
        "parse_rate",
        "claims_quote_own_fit",
        "budget_used_fraction",
        "time_used_fraction",
        "no_claim_rate",
        "null_claim_rate",
    }
)
"""The metrics of `METRICS` whose values lie between 0 and 1 (a share of episodes, actions or budget)."""

# Metric name → (what it means, which episodes it averages over, value per episode).
METRICS: Dict[str, Tuple[str, Callable[[Mapping[str, Any]], bool], Callable[[Mapping[str, Any]], Any]]] = {
    "mean_reward": ("episode reward", lambda e: True, lambda e: e.get("cumulative_reward")),
    "success_rate": (
        "correct discovery or correct null",
        lambda e: True,
        lambda e: float(bool(e.get("correct_outcome"))),
    ),
    "mass_accuracy": ("right mass, particle exists", _exists, lambda e: float(bool(e.get("correct_mass")))),
    "channel_accuracy": ("right channel, particle exists", _exists, lambda e: float(bool(e.get("correct_channel")))),
    "spin_accuracy": ("right spin, particle exists", _exists, lambda e: float(bool(e.get("correct_spin")))),
    "false_discovery_rate": (
        "discovery claimed, nothing there",
        lambda e: not _exists(e),
        lambda e: float(bool(e.get("discovered"))),
    ),
    "no_claim_rate": (
        "ended without a claim (refusals in a row, budget, time, step limit, or cut short by the rollout)",
        lambda e: True,
        lambda e: float(episode_ending(e) in NO_CLAIM_ENDINGS),
    ),
    "null_claim_rate": (
        "claimed nothing there",
        lambda e: True,
        lambda e: float(episode_ending(e) == "claimed nothing there"),
    ),
    "parse_rate": ("actions that parsed", lambda e: True, _parse_rate),
    "claims_quote_own_fit": (
        "discovery claims at a mass the episode's own fit returned",
        lambda e: _claim(e) is not None,
        _quotes_own_fit,
    ),
    "mean_steps": ("steps per episode", lambda e: True, lambda e: e.get("n_steps", len(e.get("steps") or []))),
    "budget_used_fraction": (
        "budget spent",
        lambda e: True,
        lambda e: _fraction(e, "budget_used_musd", "budget_remaining_musd"),
    ),
    "time_used_fraction": (
        "time spent",
        lambda e: True,
        lambda e: _fraction(e, "time_used_days", "time_remaining_days"),
    ),
}


def _fraction(episode: Mapping[str, Any], used: str, remaining: str) -> Optional[float]:
    resources = episode.get("resources") or {}
    if used not in resources or remaining not in resources:
        return None
    total = resources[used] + resources[remaining]
    return resources[used] / total if total > 0 else None


UNFINISHED_VALUES: Dict[str, float] = {
    "success_rate": 0.0,
    "mass_accuracy": 0.0,
    "channel_accuracy": 0.0,
    "spin_accuracy": 0.0,
    "no_claim_rate": 1.0,
    "null_claim_rate": 0.0,
}
"""What each rate counts for an episode record marked `unfinished` (a scored run's task abandoned,
as when the agent raised, or never played, `lib.measure.scorecard`): a failure. Such a record is in
the population of every metric its truth allows but `UNFINISHED_LEFT_OUT`'s, and of all of them
when its truth is unknown (never played); its steps, budget and time count as it recorded them,
nothing when it recorded none."""
UNFINISHED_LEFT_OUT = frozenset({"false_discovery_rate"})
"""The metrics an `unfinished` record is left out of: the false-discovery rate is the share of the
null tasks played to their end whose claim was a discovery; an episode that ended in no claim made no
false discovery (counting it one read "false_discovery_rate 1 [1, 1]" for an agent that raised in
every episode and never claimed anything), and counting it a correct "nothing there" would let an
agent lower its rate by walking away. Left out, walking away never beats giving up ("nothing there"
counts 0 in the rate, and every other metric counts the walk-away as a failure); a scorecard counts
the abandoned and unplayed tasks on their own."""
_NOTHING_SPENT = ("mean_steps", "budget_used_fraction", "time_used_fraction")


def metric_values(name: str, episodes: Sequence[Any]) -> List[Any]:
    """The values metric `name` of `METRICS` averages, one per episode in its population (see
    `UNFINISHED_VALUES` and `UNFINISHED_LEFT_OUT` for the unfinished)."""
    _, include, value = METRICS[name]
    values = []
    for episode in map(as_episode_dict, episodes):
        if not episode.get("unfinished"):
            if include(episode):
                values.append(value(episode))
        elif name in UNFINISHED_LEFT_OUT:
            continue
        elif include(episode) or has_particle(episode) is None:
            own = value(episode)
            values.append(UNFINISHED_VALUES.get(name, 0.0 if own is None and name in _NOTHING_SPENT else own))
    return values


def agent_metrics(episodes: Sequence[Any], *, seed: int = 0) -> Dict[str, Estimate]:
    """Every metric of `METRICS` with its 95% bootstrap interval."""
    records = [as_episode_dict(e) for e in episodes]
    return {name: bootstrap_mean(metric_values(name, records), seed=seed) for name in METRICS}


def paired_difference(before: Sequence[Any], after: Sequence[Any], metric: str, *, seed: int = 0) -> Estimate:
    """after − before of `metric`, paired by task (`lib.episodes.records.PAIR_KEY`): the mean per-task
    difference with its 95% percentile-bootstrap interval, which removes task-to-task variance.
    The episodes `metric` averages over must be the same tasks on both sides, each once
    (ValueError otherwise; `bootstrap_difference` compares independent samples). Differences
    are taken in the order of `after`; values that are None or not finite are left out."""
    pre_items, post_items = _task_values(before, metric), _task_values(after, metric)
    pre, post = dict(pre_items), dict(post_items)
    if set(pre) != set(post) or len(pre) != len(pre_items) or len(post) != len(post_items):
        raise ValueError(
            "paired_difference needs the same episodes before and after, each once "
            f"({len(set(pre) ^ set(post))} tasks differ); evaluate both on the same suite"
        )
    return bootstrap_mean([as_number(post[k]) - as_number(pre[k]) for k in post], seed=seed)  # NaN: left out


def _task_values(episodes: Sequence[Any], metric: str) -> List[Tuple[Tuple, Any]]:
    """(task key, value of `metric`) for the episodes it averages over, in their order."""
    _, include, value = METRICS[metric]
    return [(pair_key(e), value(e)) for e in map(as_episode_dict, episodes) if include(e)]


def correct_count(success_rate: Estimate) -> str:
    """ "k of n": the episodes with a correct outcome, from the success rate over n episodes."""
    return "—" if success_rate.n == 0 else f"{round(success_rate.mean * success_rate.n)} of {success_rate.n}"


def comparison_table(
    results: Mapping[str, Mapping[str, Estimate]],
    metrics: Sequence[str] = (
        "mean_reward",
        "success_rate",
        "mass_accuracy",
        "channel_accuracy",
        "spin_accuracy",
        "false_discovery_rate",
        "parse_rate",
        "mean_steps",
        "budget_used_fraction",
    ),
) -> str:
    """A Markdown table: one row per agent, `mean [95% CI]` per metric."""
    header = "| agent | " + " | ".join(metrics) + " |"
    rule = "|---|" + "---|" * len(metrics)
    rows = [f"| {agent} | " + " | ".join(str(result[m]) for m in metrics) + " |" for agent, result in results.items()]
    return "\n".join([header, rule, *rows])


SPLIT_TABLE_METRICS = ("mean_reward", "success_rate", "mass_accuracy", "false_discovery_rate")


def estimates_to_json(results: Mapping[str, Mapping[str, Estimate]]) -> Dict[str, Dict[str, Dict[str, float]]]:
    return {agent: {name: asdict(est) for name, est in metrics.items()} for agent, metrics in results.items()}


def estimates_from_json(payload: Mapping[str, Mapping[str, Mapping[str, float]]]) -> Dict[str, Dict[str, Estimate]]:
    """The inverse of `estimates_to_json` (e.g. the `metrics` of evidence/baselines.json); an
    undefined statistic may be `null` (strict JSON) or `NaN` (files written before): NaN here."""
    return {
        agent: {
            name: Estimate(as_number(est["mean"]), as_number(est["low"]), as_number(est["high"]), int(est["n"]))
            for name, est in metrics.items()
        }
        for agent, metrics in payload.items()
    }
