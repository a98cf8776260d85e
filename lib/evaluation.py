"""The held-out evaluation suite and agent metrics with 95% bootstrap confidence intervals.

Every agent — baselines, the policy before training and after — is measured on the same
fixed, versioned suite, so "before" and "after" are comparable. Seeds of the suite live
in their own range, disjoint from any training seed (`TRAINING_SEEDS`), and from v2 on the
suite holds out particles, not only seeds: it has two parts (`PARTS`), reported apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
from scipy import stats

from cernenv.scenarios import DIFFICULTIES, EVALUATION_SEED_START, list_scenarios
from lib.records import EpisodeSpec, as_episode_dict, part_of
from lib.rollouts import collect_episodes

SUITE_VERSION = "v2"
HELDOUT_SEED_START = EVALUATION_SEED_START
TRAINING_SEEDS = range(0, HELDOUT_SEED_START)
"""Seeds training may use; the held-out suite never does. Procedural particles of the seeds
above are drawn from mass bands training never produces (`cernenv.scenarios.MASS_BANDS`)."""
CONFIDENCE = 0.95
N_BOOTSTRAP = 2000

PARTS = {
    "unseen": "procedural campaigns whose particle training never produces (evaluation mass bands)",
    "rediscovery": "curated campaigns of known physics (the same particles training plays)",
}
"""The parts of the held-out suite, reported on their own. Episodes of suite v1 evidence
written before evaluation seeds had their own mass bands count as "unseen" by this rule too,
though their particles came from the training bands."""
PARTICLE_SPLITS = {"with_particle": True, "null": False}
"""Tasks with a particle and null tasks (no particle: the right answer is no discovery)."""


@dataclass(frozen=True)
class SuiteLayout:
    """How one version of the held-out suite is built: curated scenarios first, each on
    consecutive seeds, then procedural campaigns of each difficulty."""

    first_seed: int
    curated_seeds_per_scenario: int
    procedural_seeds_per_difficulty: int


SUITES = {
    "v1": SuiteLayout(first_seed=900_000, curated_seeds_per_scenario=6, procedural_seeds_per_difficulty=26),
    "v2": SuiteLayout(first_seed=901_000, curated_seeds_per_scenario=4, procedural_seeds_per_difficulty=31),
}
"""v1: 7×6 + 3×26 = 120 episodes on seeds 900000-900119 (kept so old evidence stays readable).
v2: 7×4 = 28 rediscovery + 3×31 = 93 unseen = 121 episodes on seeds 901000-901120, none of v1's."""


def heldout_suite(version: str = SUITE_VERSION) -> Tuple[EpisodeSpec, ...]:
    """The fixed held-out suite of `version` (`SUITES`): every curated scenario (null ones
    included) and procedural campaigns of every difficulty (which include null cases)."""
    if version not in SUITES:
        raise ValueError(f"unknown suite version {version!r}; this code knows {', '.join(map(repr, SUITES))}")
    layout = SUITES[version]
    specs: List[EpisodeSpec] = []
    seed = layout.first_seed
    for scenario in list_scenarios():
        for _ in range(layout.curated_seeds_per_scenario):
            specs.append(EpisodeSpec(seed, scenario=scenario))
            seed += 1
    for difficulty in DIFFICULTIES:
        for _ in range(layout.procedural_seeds_per_difficulty):
            specs.append(EpisodeSpec(seed, difficulty=difficulty))
            seed += 1
    return tuple(specs)


def assert_disjoint_from_suite(training_seeds: Iterable[int], suite: Sequence[EpisodeSpec] = ()) -> None:
    """Raise if any training seed is an evaluation seed (≥ `HELDOUT_SEED_START`, whose particles
    come from the held-out mass bands) or a seed of `suite` (default: the current suite)."""
    heldout = {spec.seed for spec in (suite or heldout_suite())}
    overlap = {seed for seed in training_seeds if seed >= HELDOUT_SEED_START or seed in heldout}
    if overlap:
        raise ValueError(f"training seeds overlap the evaluation seeds: {sorted(overlap)[:5]}...; "
                         f"train on seeds below {HELDOUT_SEED_START}")


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


def bootstrap_mean(values: Sequence[float], *, seed: int = 0) -> Estimate:
    """Mean and percentile-bootstrap 95% interval (scipy.stats.bootstrap, 2000 resamples)."""
    data = np.asarray([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    if data.size == 0:
        return Estimate(float("nan"), float("nan"), float("nan"), 0)
    mean = float(data.mean())
    if data.size == 1 or np.all(data == data[0]):
        return Estimate(mean, mean, mean, int(data.size))
    result = stats.bootstrap((data,), np.mean, n_resamples=N_BOOTSTRAP, confidence_level=CONFIDENCE,
                             method="percentile", random_state=np.random.default_rng(seed))
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
    result = stats.bootstrap((a, b), lambda x, y, axis=-1: np.mean(y, axis=axis) - np.mean(x, axis=axis),
                             n_resamples=N_BOOTSTRAP, confidence_level=CONFIDENCE, method="percentile",
                             random_state=np.random.default_rng(seed), vectorized=True)
    interval = result.confidence_interval
    return Estimate(mean, float(interval.low), float(interval.high), int(min(a.size, b.size)))


def has_particle(episode: Mapping[str, Any]) -> Optional[bool]:
    """Whether a particle existed in the episode's hidden truth (`EpisodeRecord.truth`);
    None for a record without a recorded truth."""
    truth = episode.get("truth")
    return bool(truth["exists"]) if isinstance(truth, Mapping) and "exists" in truth else None


def _exists(episode: Mapping[str, Any]) -> bool:
    return bool(has_particle(episode))


GROUPS: Dict[str, Tuple[Optional[str], Optional[str]]] = {
    "_".join(filter(None, (part, split))) or "all": (part, split)
    for part in (None, *PARTS) for split in (None, *PARTICLE_SPLITS)}
"""The groups results are reported for, by name ("all", "null", "unseen_with_particle", ...):
(part of `PARTS`, None for the whole suite; split of `PARTICLE_SPLITS`, None for both)."""
GROUP_WORDS = {"unseen": "unseen particles", "rediscovery": "rediscovery of known physics",
               "with_particle": "with a particle", "null": "null tasks"}
"""A reader's words for each part and particle split."""


def group_label(name: str) -> str:
    """A reader's name for a group of `GROUPS`, e.g. "unseen particles, null tasks"."""
    part, split = GROUPS[name]
    return ", ".join([GROUP_WORDS[part] if part else "whole suite", *([GROUP_WORDS[split]] if split else [])])


def episode_groups(episodes: Sequence[Any]) -> Dict[str, List[Mapping[str, Any]]]:
    """The episodes of each group of `GROUPS` (records or their dicts; dicts returned). An
    episode without a recorded truth is in its part but in neither particle split."""
    records = [as_episode_dict(e) for e in episodes]
    groups: Dict[str, List[Mapping[str, Any]]] = {}
    for name, (part, split) in GROUPS.items():
        groups[name] = [e for e in records
                        if (part is None or part_of(e.get("scenario")) == part)
                        and (split is None or has_particle(e) is PARTICLE_SPLITS[split])]
    return groups


def _parse_rate(episode: Mapping[str, Any]) -> Optional[float]:
    steps = episode.get("steps") or []
    if not steps:
        return None
    return float(np.mean([bool(step.get("parsed_ok", True)) for step in steps]))


# Metric name → (what it means, which episodes it averages over, value per episode).
METRICS: Dict[str, Tuple[str, Callable[[Mapping[str, Any]], bool], Callable[[Mapping[str, Any]], Any]]] = {
    "mean_reward": ("episode reward", lambda e: True, lambda e: e.get("cumulative_reward")),
    "success_rate": ("correct discovery or correct null", lambda e: True,
                     lambda e: float(bool(e.get("correct_outcome")))),
    "mass_accuracy": ("right mass, particle exists", _exists, lambda e: float(bool(e.get("correct_mass")))),
    "channel_accuracy": ("right channel, particle exists", _exists,
                         lambda e: float(bool(e.get("correct_channel")))),
    "spin_accuracy": ("right spin, particle exists", _exists, lambda e: float(bool(e.get("correct_spin")))),
    "false_discovery_rate": ("discovery claimed, nothing there", lambda e: not _exists(e),
                             lambda e: float(bool(e.get("discovered")))),
    "parse_rate": ("actions that parsed", lambda e: True, _parse_rate),
    "mean_steps": ("steps per episode", lambda e: True, lambda e: e.get("n_steps", len(e.get("steps") or []))),
    "budget_used_fraction": ("budget spent", lambda e: True,
                             lambda e: _fraction(e, "budget_used_musd", "budget_remaining_musd")),
    "time_used_fraction": ("time spent", lambda e: True,
                           lambda e: _fraction(e, "time_used_days", "time_remaining_days")),
}


def _fraction(episode: Mapping[str, Any], used: str, remaining: str) -> Optional[float]:
    resources = episode.get("resources") or {}
    if used not in resources or remaining not in resources:
        return None
    total = resources[used] + resources[remaining]
    return resources[used] / total if total > 0 else None


def agent_metrics(episodes: Sequence[Any], *, seed: int = 0) -> Dict[str, Estimate]:
    """Every metric of `METRICS` with its 95% bootstrap interval."""
    records = [as_episode_dict(e) for e in episodes]
    return {name: bootstrap_mean([value(e) for e in records if include(e)], seed=seed)
            for name, (_, include, value) in METRICS.items()}


def group_metrics(episodes: Sequence[Any], *, seed: int = 0) -> Dict[str, Dict[str, Estimate]]:
    """`agent_metrics` of each group of `GROUPS`: {group: {metric: Estimate}}."""
    return {name: agent_metrics(group, seed=seed) for name, group in episode_groups(episodes).items()}


def paired_difference(before: Sequence[Any], after: Sequence[Any], metric: str, *, seed: int = 0) -> Estimate:
    """after − before of `metric`, paired by episode (seed, scenario, difficulty): the 95%
    interval of the mean per-episode difference. Both sides must cover the same episodes."""
    _, include, value = METRICS[metric]

    def keyed(episodes):
        out = {}
        for e in map(as_episode_dict, episodes):
            if include(e):
                out[(e.get("seed"), e.get("scenario"), e.get("difficulty"))] = value(e)
        return out

    pre, post = keyed(before), keyed(after)
    if set(pre) != set(post):
        raise ValueError("paired_difference needs the same episodes before and after "
                         f"({len(set(pre) ^ set(post))} differ); evaluate both on the same suite")
    return bootstrap_mean([post[k] - pre[k] for k in sorted(pre, key=str)
                           if pre[k] is not None and post[k] is not None], seed=seed)


def correct_count(success_rate: Estimate) -> str:
    """"k of n": the episodes with a correct outcome, from the success rate over n episodes."""
    return "—" if success_rate.n == 0 else f"{round(success_rate.mean * success_rate.n)} of {success_rate.n}"


def comparison_table(results: Mapping[str, Mapping[str, Estimate]],
                     metrics: Sequence[str] = ("mean_reward", "success_rate", "mass_accuracy",
                                               "channel_accuracy", "spin_accuracy", "false_discovery_rate",
                                               "parse_rate", "mean_steps", "budget_used_fraction")) -> str:
    """A Markdown table: one row per agent, `mean [95% CI]` per metric."""
    header = "| agent | " + " | ".join(metrics) + " |"
    rule = "|---|" + "---|" * len(metrics)
    rows = [f"| {agent} | " + " | ".join(str(result[m]) for m in metrics) + " |"
            for agent, result in results.items()]
    return "\n".join([header, rule, *rows])


SPLIT_TABLE_METRICS = ("mean_reward", "success_rate", "mass_accuracy", "false_discovery_rate")


def split_comparison_table(results_by_group: Mapping[str, Mapping[str, Mapping[str, Estimate]]],
                           metrics: Sequence[str] = SPLIT_TABLE_METRICS) -> str:
    """A Markdown table of `{group: {agent: metrics}}` (as `group_metrics` gives per agent):
    one row per group and agent, the correct outcomes as "k of n", then `mean [95% CI]` per metric."""
    header = "| group | agent | correct | " + " | ".join(metrics) + " |"
    rule = "|---|---|---|" + "---|" * len(metrics)
    rows = [f"| {group_label(group)} | {agent} | {correct_count(result['success_rate'])} | "
            + " | ".join(str(result[m]) for m in metrics) + " |"
            for group, results in results_by_group.items() for agent, result in results.items()]
    return "\n".join([header, rule, *rows])


def estimates_to_json(results: Mapping[str, Mapping[str, Estimate]]) -> Dict[str, Dict[str, Dict[str, float]]]:
    return {agent: {name: asdict(est) for name, est in metrics.items()} for agent, metrics in results.items()}


def estimates_from_json(payload: Mapping[str, Mapping[str, Mapping[str, float]]]) -> Dict[str, Dict[str, Estimate]]:
    """The inverse of `estimates_to_json` (e.g. the `metrics` of evidence/baselines.json)."""
    return {agent: {name: Estimate(float(est["mean"]), float(est["low"]), float(est["high"]), int(est["n"]))
                    for name, est in metrics.items()} for agent, metrics in payload.items()}


def evaluate_agents(agents: Mapping[str, Any], suite: Sequence[EpisodeSpec], *, progress: bool = True
                    ) -> Dict[str, List[Any]]:
    """Play every agent on every episode of `suite`: {agent name: [EpisodeRecord, ...]}."""
    return {name: collect_episodes(suite, agent=agent, progress=progress, desc=name)
            for name, agent in agents.items()}


def write_baseline_evidence(episodes_by_agent: Mapping[str, Sequence[Any]], evidence_dir: Any, *,
                            suite_version: str = SUITE_VERSION) -> Dict[str, Any]:
    """evidence/baselines.json (every metric with its interval, for the whole suite under
    `metrics` and per group of `GROUPS` under `groups.<group>.metrics`) and
    evidence/baselines.md (the tables)."""
    import json
    from pathlib import Path

    by_group = baseline_groups(episodes_by_agent)
    results = by_group["all"]
    n_episodes = {name: len(episodes) for name, episodes in episodes_by_agent.items()}
    directory = Path(evidence_dir)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"suite_version": suite_version, "n_episodes": n_episodes, "confidence": CONFIDENCE,
               "bootstrap_resamples": N_BOOTSTRAP, "metrics": estimates_to_json(results),
               "groups": {group: {"n_episodes": {agent: m["mean_reward"].n for agent, m in agents.items()},
                                  "metrics": estimates_to_json(agents)}
                          for group, agents in by_group.items() if group != "all"}}
    (directory / "baselines.json").write_text(json.dumps(payload, indent=2, allow_nan=True) + "\n")
    lines = [f"# Baselines on the held-out suite {suite_version}", "",
             f"Episodes per agent: {', '.join(f'{k} {v}' for k, v in n_episodes.items())}. "
             f"Each cell: mean [{CONFIDENCE:.0%} bootstrap interval].", "", comparison_table(results), "",
             "Metrics: " + "; ".join(f"`{name}`: {meaning}" for name, (meaning, _, _) in METRICS.items()) + ".",
             "", "## By part of the suite, tasks with a particle and null tasks", "",
             "Parts: " + "; ".join(f"{GROUP_WORDS[part]}: {meaning}" for part, meaning in PARTS.items()) + ".",
             "", split_comparison_table({g: a for g, a in by_group.items() if g != "all"})]
    (directory / "baselines.md").write_text("\n".join(lines) + "\n")
    return results


def baseline_groups(episodes_by_agent: Mapping[str, Sequence[Any]]) -> Dict[str, Dict[str, Dict[str, Estimate]]]:
    """`group_metrics` of every agent, turned group-first: {group: {agent: {metric: Estimate}}}."""
    per_agent = {agent: group_metrics(episodes) for agent, episodes in episodes_by_agent.items()}
    return {group: {agent: per_agent[agent][group] for agent in per_agent} for group in GROUPS}


def baseline_groups_from_json(payload: Mapping[str, Any]) -> Dict[str, Dict[str, Dict[str, Estimate]]]:
    """{group: {agent: {metric: Estimate}}} of a baselines.json; empty for a file written before
    the groups were (it has the whole suite's `metrics` only)."""
    return {group: estimates_from_json(entry["metrics"]) for group, entry in (payload.get("groups") or {}).items()}
