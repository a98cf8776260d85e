"""The held-out evaluation suite, the keys that hide its worlds, and agent metrics with 95%
bootstrap confidence intervals.

Every agent — baselines, the policy before training and after — is measured on the same
fixed, versioned suite, so "before" and "after" are comparable. Seeds of the suite live
in their own range, disjoint from any training seed (`TRAINING_SEEDS`), and the suite holds
out particles, not only seeds: its procedural particles lie in mass bands no training seed's
particle comes within 2σ_m of (`cernenv.scenarios.mass_bands`). Its parts (`PARTS`) are
reported apart: only the unseen part measures generalisation.

An `EvaluationKey` is mixed into every held-out episode's hidden streams: with a private key
(`private_key`, made on first use and kept out of git) the public code and the seeds no longer
say what the worlds hold, and each evaluation run adds a fresh nonce, so no run's worlds can be
learnt from another's. The project's own committed evidence is made with `PUBLISHED_KEY`, so a
fresh clone replays it (`make verify-evidence`); the project's training cannot see those episodes
for another reason: its seeds and its particles are disjoint from the suite's (tested).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from cernenv import CERNCollisionEnvironment
from cernenv.scenarios import DIFFICULTIES, EVALUATION_SEED_START
from cernenv.suite import DRAW_SEED_START, PARTS, SUITE_VERSION, SUITES, part_of, suite_tasks
from lib.episodes.agent_rollouts import collect_episodes
from lib.episodes.records import EpisodeSpec, as_episode_dict
from lib.measure.metrics import (
    CONFIDENCE,
    METRICS,
    N_BOOTSTRAP,
    SPLIT_TABLE_METRICS,
    Estimate,
    agent_metrics,
    comparison_table,
    correct_count,
    estimates_from_json,
    estimates_to_json,
    has_particle,
)

HELDOUT_SEED_START = EVALUATION_SEED_START
TRAINING_SEEDS = range(0, HELDOUT_SEED_START)
"""Seeds training may use; the held-out suite never does. Procedural particles of the seeds
above lie in the evaluation mass bands (`cernenv.scenarios.mass_bands`)."""
PARTICLE_SPLITS = {"with_particle": True, "null": False}
"""Tasks with a particle and null tasks (no particle: the right answer is no discovery)."""


@dataclass(frozen=True)
class EvaluationKey:
    """A secret mixed into the hidden streams of held-out episodes (`CERNCollisionEnvironment`'s
    `secret_salt`), with the nonce of one evaluation run: `name` says which key it is
    ("published" or "private"), `fingerprint` identifies it in records without revealing it."""

    name: str
    secret: str
    run_nonce: str = ""

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.secret.encode("utf-8")).hexdigest()[:16]

    @property
    def salt(self) -> str:
        """What the environment mixes in: the secret, and the run's nonce when there is one."""
        return "\x00".join(part for part in (self.secret, self.run_nonce) if part)

    def make_env(self) -> CERNCollisionEnvironment:
        """An environment whose episodes are drawn with this key."""
        return CERNCollisionEnvironment(secret_salt=self.salt)

    def record_fields(self) -> Dict[str, str]:
        """What an episode record keeps of the key (`EpisodeRecord.evaluation_key`): no secret."""
        return {"name": self.name, "fingerprint": self.fingerprint, "run_nonce": self.run_nonce}


PUBLISHED_KEY = EvaluationKey("published", "cernenv held-out suite: the published evaluation key")
"""The key of the project's own committed evidence (baselines, before/after training): public, so a
fresh clone replays that evidence. Never the key to score an agent the project did not train with."""

KEY_FILE_VARIABLE = "CERNENV_EVALUATION_KEY_FILE"
DEFAULT_KEY_FILE = Path(__file__).resolve().parents[2] / ".cache" / "evaluation.key"


def private_key(path: Optional[os.PathLike] = None, *, new_run: bool = True) -> EvaluationKey:
    """The evaluator's own key, read from `path` (default: $CERNENV_EVALUATION_KEY_FILE, else
    .cache/evaluation.key, git-ignored) and made there on first use (32 random bytes, readable by
    its owner only); `new_run`: with a fresh run nonce, so this run's worlds are new too."""
    path = Path(path or os.environ.get(KEY_FILE_VARIABLE) or DEFAULT_KEY_FILE)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    secret = path.read_text().strip()
    if len(secret) < 32:
        raise ValueError(f"{path} holds no evaluation key (32 hex digits or more); delete it to make a new one")
    return EvaluationKey("private", secret, secrets.token_hex(8) if new_run else "")


def key_of_record(episode: Mapping[str, Any], path: Optional[os.PathLike] = None) -> Optional[EvaluationKey]:
    """The key an episode record was played with (None: the seed's public world): the published
    key, or the private key of `path` (as `private_key` finds it) when its fingerprint matches."""
    fields = episode.get("evaluation_key")
    if not fields:
        return None
    if fields.get("fingerprint") == PUBLISHED_KEY.fingerprint:
        return EvaluationKey(PUBLISHED_KEY.name, PUBLISHED_KEY.secret, fields.get("run_nonce", ""))
    key_path = Path(path or os.environ.get(KEY_FILE_VARIABLE) or DEFAULT_KEY_FILE)
    if key_path.exists():
        secret = key_path.read_text().strip()
        if hashlib.sha256(secret.encode("utf-8")).hexdigest()[:16] == fields.get("fingerprint"):
            return EvaluationKey("private", secret, fields.get("run_nonce", ""))
    raise LookupError(
        f"episode seed {episode.get('seed')} was played with a private evaluation key (fingerprint "
        f"{fields.get('fingerprint')}) that {key_path} does not hold: replay it where that key is, "
        f"with ${KEY_FILE_VARIABLE} naming its file"
    )


def heldout_suite(version: str = SUITE_VERSION) -> Tuple[EpisodeSpec, ...]:
    """The fixed held-out suite of `version` (`cernenv.suite.SUITES`)."""
    return suite_tasks(version)


def validation_suite(n_episodes: int) -> Tuple[EpisodeSpec, ...]:
    """`n_episodes` procedural campaigns on the validation split (`lib.seeds.VALIDATION_SEED` on,
    each difficulty in turn): evaluation-split seeds, whose particles come from the bands training
    never sees, held by no suite. Settings are chosen here; the held-out suite is for the evidence."""
    from lib.seeds import VALIDATION_SEED

    specs = tuple(
        EpisodeSpec(VALIDATION_SEED + i, difficulty=DIFFICULTIES[i % len(DIFFICULTIES)]) for i in range(n_episodes)
    )
    if every_suite_seed() & {spec.seed for spec in specs}:
        raise ValueError("the validation split overlaps a held-out suite; move VALIDATION_SEED")
    return specs


def every_suite_seed() -> set:
    """The seeds of every held-out suite version (`cernenv.suite.SUITES`)."""
    return {spec.seed for version in SUITES for spec in heldout_suite(version)}


def split_of(episodes: Iterable[Mapping[str, Any]]) -> str:
    """Which split `episodes` were played on, as the evidence names it: "held-out" when every seed is
    one of a held-out suite's, "validation" when every seed is the validation split's
    (`validation_suite`: from `lib.seeds.VALIDATION_SEED`, below the fresh draws' seeds), else
    "evaluation" (none, a draw, or a mix)."""
    from lib.seeds import VALIDATION_SEED

    seeds, suite_seeds = {episode.get("seed") for episode in episodes}, every_suite_seed()
    if seeds and seeds <= suite_seeds:
        return "held-out"
    validation = range(VALIDATION_SEED, DRAW_SEED_START)
    if seeds and all(seed in validation and seed not in suite_seeds for seed in seeds):
        return "validation"
    return "evaluation"


def assert_disjoint_from_suite(training_seeds: Iterable[int], suite: Sequence[EpisodeSpec] = ()) -> None:
    """Raise if any training seed is an evaluation seed (≥ `HELDOUT_SEED_START`, whose particles
    come from the held-out mass bands) or a seed of `suite` (default: the current suite)."""
    heldout = {spec.seed for spec in (suite or heldout_suite())}
    overlap = {seed for seed in training_seeds if seed >= HELDOUT_SEED_START or seed in heldout}
    if overlap:
        raise ValueError(
            f"training seeds overlap the evaluation seeds: {sorted(overlap)[:5]}...; "
            f"train on seeds below {HELDOUT_SEED_START}"
        )


GROUPS: Dict[str, Tuple[Optional[str], Optional[str]]] = {
    "_".join(filter(None, (part, split))) or "all": (part, split)
    for part in (None, *PARTS)
    for split in (None, *PARTICLE_SPLITS)
}
"""The groups results are reported for, by name ("all", "null", "unseen_with_particle", ...):
(part of `PARTS`, None for the whole suite; split of `PARTICLE_SPLITS`, None for both)."""
GROUP_WORDS = {
    "unseen": "unseen particles",
    "known_physics": "known physics (recall)",
    "with_particle": "with a particle",
    "null": "null tasks",
}
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
        groups[name] = [
            e
            for e in records
            if (part is None or part_of(e.get("scenario")) == part)
            and (split is None or has_particle(e) is PARTICLE_SPLITS[split])
        ]
    return groups


def group_metrics(episodes: Sequence[Any], *, seed: int = 0) -> Dict[str, Dict[str, Estimate]]:
    """`agent_metrics` of each group of `GROUPS`: {group: {metric: Estimate}}."""
    return {name: agent_metrics(group, seed=seed) for name, group in episode_groups(episodes).items()}


def split_comparison_table(
    results_by_group: Mapping[str, Mapping[str, Mapping[str, Estimate]]], metrics: Sequence[str] = SPLIT_TABLE_METRICS
) -> str:
    """A Markdown table of `{group: {agent: metrics}}` (as `group_metrics` gives per agent):
    one row per group and agent, the correct outcomes as "k of n", then `mean [95% CI]` per metric."""
    header = "| group | agent | correct | " + " | ".join(metrics) + " |"
    rule = "|---|---|---|" + "---|" * len(metrics)
    rows = [
        f"| {group_label(group)} | {agent} | {correct_count(result['success_rate'])} | "
        + " | ".join(str(result[m]) for m in metrics)
        + " |"
        for group, results in results_by_group.items()
        for agent, result in results.items()
    ]
    return "\n".join([header, rule, *rows])


def evaluate_agents(
    agents: Mapping[str, Any],
    suite: Sequence[EpisodeSpec],
    *,
    key: Optional[EvaluationKey] = None,
    reveal_truth_to: Iterable[str] = (),
    progress: bool = True,
) -> Dict[str, List[Any]]:
    """Play every agent on every episode of `suite`: {agent name: [EpisodeRecord, ...]}.

    `key`: the evaluation key the worlds are drawn with; by default the evaluator's private key
    with a fresh run nonce (`private_key`), as scoring an agent the project did not train needs.
    `reveal_truth_to`: the names of the agents (oracles) the evaluator hands the hidden truth;
    no other agent gets it, whatever its methods are called.

    For trusted agents only: an agent is Python running in this process, so one that reads the
    caller's stack frames, walks the garbage collector or opens the key file can find the truth.
    An agent you did not write is scored as a client of the evaluation server, in a process of
    its own (docs/openenv.md)."""
    key = key or private_key()
    oracles = set(reveal_truth_to)
    unknown = oracles - set(agents)
    if unknown:
        raise ValueError(f"reveal_truth_to names agents that are not evaluated: {sorted(unknown)}")
    return {
        name: collect_episodes(
            suite,
            make_env=key.make_env,
            agent=agent,
            progress=progress,
            desc=name,
            reveal_truth=name in oracles,
            evaluation_key=key.record_fields(),
        )
        for name, agent in agents.items()
    }


def write_baseline_evidence(
    episodes_by_agent: Mapping[str, Sequence[Any]], evidence_dir: Any, *, suite_version: str = SUITE_VERSION
) -> Dict[str, Any]:
    """evidence/baselines.json (every metric with its interval, for the whole suite under
    `metrics` and per group of `GROUPS` under `groups.<group>.metrics`; strict JSON, an
    undefined statistic written null) and evidence/baselines.md (the tables), each written
    atomically (`lib.files`). Refused (`lib.files.EmptyResultError`, nothing written) when no
    agent or an agent with no episode is given: existing baselines are never replaced by n=0."""
    from pathlib import Path

    from lib.files import atomic_write, check_writable_dir, json_text, refuse_empty, write_json

    directory = Path(evidence_dir)
    n_episodes = {name: len(episodes) for name, episodes in episodes_by_agent.items()}
    refuse_empty(directory / "baselines.json", min(n_episodes.values(), default=0), "baselines")
    check_writable_dir(directory, "evidence folder")
    by_group = baseline_groups(episodes_by_agent)
    results = by_group["all"]
    payload = {
        "suite_version": suite_version,
        "n_episodes": n_episodes,
        "confidence": CONFIDENCE,
        "bootstrap_resamples": N_BOOTSTRAP,
        "metrics": estimates_to_json(results),
        "groups": {
            group: {
                "n_episodes": {agent: m["mean_reward"].n for agent, m in agents.items()},
                "metrics": estimates_to_json(agents),
            }
            for group, agents in by_group.items()
            if group != "all"
        },
    }
    BaselinesFile.model_validate_json(json_text(payload))  # the schema the file is read with
    write_json(directory / "baselines.json", payload)
    lines = [
        f"# Baselines on the held-out suite {suite_version}",
        "",
        f"Episodes per agent: {', '.join(f'{k} {v}' for k, v in n_episodes.items())}. "
        f"Each cell: mean [{CONFIDENCE:.0%} bootstrap interval].",
        "",
        comparison_table(results),
        "",
        "Metrics: " + "; ".join(f"`{name}`: {meaning}" for name, (meaning, _, _) in METRICS.items()) + ".",
        "",
        "## By part of the suite, tasks with a particle and null tasks",
        "",
        "Parts: " + "; ".join(f"{GROUP_WORDS[part]}: {meaning}" for part, meaning in PARTS.items()) + ".",
        "",
        split_comparison_table({g: a for g, a in by_group.items() if g != "all"}),
    ]
    atomic_write(directory / "baselines.md", "\n".join(lines) + "\n")
    return results


FiniteOrNull = Optional[Annotated[float, Field(strict=True, allow_inf_nan=False)]]


class EstimateEntry(BaseModel):
    """One metric of one agent in baselines.json: its mean and interval (null when undefined) and n."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mean: FiniteOrNull
    low: FiniteOrNull
    high: FiniteOrNull
    n: StrictInt


class GroupEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    n_episodes: Dict[str, StrictInt]
    metrics: Dict[str, Dict[str, EstimateEntry]]


class BaselinesFile(BaseModel):
    """The schema of evidence/baselines.json (`write_baseline_evidence`), held on write and on read."""

    model_config = ConfigDict(extra="forbid", strict=True)
    suite_version: StrictStr
    n_episodes: Dict[str, StrictInt]
    confidence: Annotated[float, Field(strict=True, allow_inf_nan=False)]
    bootstrap_resamples: StrictInt
    metrics: Dict[str, Dict[str, EstimateEntry]]
    groups: Dict[str, GroupEntry] = {}


def read_baselines(path: os.PathLike) -> Dict[str, Any]:
    """A baselines.json, checked against `BaselinesFile`: a ValueError naming the file and the
    field when it is not one (a boolean or a string where a number belongs, NaN, an unknown key)."""
    try:
        return BaselinesFile.model_validate_json(Path(path).read_text(encoding="utf-8")).model_dump()
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{path}: {where}: {first['msg']}; rewrite it with notebook 02 (make reproduce)") from None


def baseline_groups(episodes_by_agent: Mapping[str, Sequence[Any]]) -> Dict[str, Dict[str, Dict[str, Estimate]]]:
    """`group_metrics` of every agent, turned group-first: {group: {agent: {metric: Estimate}}}."""
    per_agent = {agent: group_metrics(episodes) for agent, episodes in episodes_by_agent.items()}
    return {group: {agent: per_agent[agent][group] for agent in per_agent} for group in GROUPS}


def baseline_groups_from_json(payload: Mapping[str, Any]) -> Dict[str, Dict[str, Dict[str, Estimate]]]:
    """{group: {agent: {metric: Estimate}}} of a baselines.json; empty for a file written before
    the groups were (it has the whole suite's `metrics` only)."""
    return {group: estimates_from_json(entry["metrics"]) for group, entry in (payload.get("groups") or {}).items()}
