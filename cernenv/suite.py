"""The held-out evaluation suite's tasks: which seed, curated scenario or difficulty each episode
of a suite version plays, its parts, fresh draws of evaluation-split tasks, and the development
tasks of the validation split that two agents are compared on (`development_tasks`).

The suite is defined here, beside the scenarios, so that the evaluation server can assign it
(`cernenv.server.runs`) without the learning side; `lib.measure.evaluation` measures agents on it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from cernenv.scenarios import DIFFICULTIES, list_scenarios

SUITE_VERSION = "v3"
PARTS = {
    "unseen": "procedural campaigns whose particle no training task can produce within 2σ_m "
    "(evaluation mass bands), and procedural null campaigns: the generalisation measure",
    "known_physics": "the curated campaigns of known physics, which training plays too: recall, not generalisation",
}
"""The parts of the held-out suite, reported on their own."""


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
    "v3": SuiteLayout(first_seed=902_000, curated_seeds_per_scenario=4, procedural_seeds_per_difficulty=95),
}
"""v1: 7×6 + 3×26 = 120 episodes on seeds 900000-900119; v2: 7×4 + 3×31 = 121 on seeds
901000-901120 (both kept so old evidence stays readable; their "unseen" particles lay within
reach of training's). v3: 7×4 = 28 known-physics + 3×95 = 285 unseen = 313 episodes on seeds
902000-902312, none of v1's or v2's: over 192 unseen particles, so that a 0.10 difference in
success there is measured to within ±0.10 (95%) even between independent samples."""

DRAW_SEED_START = 1_000_000_000
"""Fresh draws (`drawn_tasks`) take their seeds at or above this: evaluation-split seeds (held-out
mass bands) far above every suite's and the validation split's."""


@dataclass(frozen=True)
class SuiteTask:
    """One task of a suite: the seed and either a curated scenario or a difficulty."""

    seed: int
    scenario: Optional[str] = None
    difficulty: Optional[str] = None

    @property
    def part(self) -> str:
        """ "known_physics" (a curated scenario) or "unseen" (procedural): see `PARTS`."""
        return part_of(self.scenario)

    def to_dict(self) -> Dict[str, Optional[object]]:
        return {"seed": self.seed, "scenario": self.scenario, "difficulty": self.difficulty}


def part_of(scenario: Optional[str]) -> str:
    """The suite part of an episode (spec or record) from its scenario: "known_physics" for a
    curated scenario, "unseen" for a procedural one (None in a spec, "procedural_*" in a record)."""
    return "known_physics" if scenario in list_scenarios() else "unseen"


def suite_tasks(version: str = SUITE_VERSION) -> Tuple[SuiteTask, ...]:
    """The fixed held-out suite of `version` (`SUITES`): every curated scenario (null ones
    included) and procedural campaigns of every difficulty (which include null cases)."""
    if version not in SUITES:
        raise ValueError(f"unknown suite version {version!r}; this code knows {', '.join(map(repr, SUITES))}")
    layout = SUITES[version]
    tasks: List[SuiteTask] = []
    seed = layout.first_seed
    for scenario in list_scenarios():
        for _ in range(layout.curated_seeds_per_scenario):
            tasks.append(SuiteTask(seed, scenario=scenario))
            seed += 1
    for difficulty in DIFFICULTIES:
        for _ in range(layout.procedural_seeds_per_difficulty):
            tasks.append(SuiteTask(seed, difficulty=difficulty))
            seed += 1
    return tuple(tasks)


def drawn_tasks(n_tasks: int) -> Tuple[SuiteTask, ...]:
    """`n_tasks` procedural tasks on fresh evaluation-split seeds no one chose in advance (each
    difficulty in turn, seeds drawn at random at or above `DRAW_SEED_START`): a suite nobody has
    seen, not even as seeds."""
    if not 1 <= n_tasks <= 100_000:
        raise ValueError(f"a fresh draw holds 1 to 100000 tasks, not {n_tasks}")
    seeds: List[int] = []
    while len(seeds) < n_tasks:
        seed = DRAW_SEED_START + secrets.randbelow(2**62)
        if seed not in seeds:
            seeds.append(seed)
    return tuple(SuiteTask(seed, difficulty=DIFFICULTIES[i % len(DIFFICULTIES)]) for i, seed in enumerate(seeds))


DEVELOPMENT_SEED_START = 905_000
"""The first seed of the validation split (`lib.seeds.VALIDATION_SEED`): evaluation-split seeds that
no suite holds, which `development_tasks` plays."""
DEVELOPMENT_PREFIX = "dev"
MAX_DEVELOPMENT_TASKS = 10_000


def development_tasks(n_tasks: int) -> Tuple[SuiteTask, ...]:
    """The first `n_tasks` procedural tasks of the validation split (`DEVELOPMENT_SEED_START` on, each
    difficulty in turn: `lib.measure.evaluation.validation_suite`'s): the same tasks in every run, so
    a scored run of them (`dev:N`, whose worlds are public and fixed: `cernenv.server.runs`) plays
    two agents on the same worlds. No held-out suite's seed, no fresh draw's."""
    if not 1 <= n_tasks <= MAX_DEVELOPMENT_TASKS:
        raise ValueError(f"a development run holds 1 to {MAX_DEVELOPMENT_TASKS} tasks, not {n_tasks}")
    return tuple(
        SuiteTask(DEVELOPMENT_SEED_START + i, difficulty=DIFFICULTIES[i % len(DIFFICULTIES)]) for i in range(n_tasks)
    )


def is_development(selection: str) -> bool:
    """Whether `selection` names development tasks (`dev:N`), whose worlds are public and fixed."""
    return selection.partition(":")[0] == DEVELOPMENT_PREFIX


SELECTION_HELP = (
    "a suite version (v3), one part of it (v3:unseen, v3:known_physics), a fresh draw of N "
    "procedural tasks under the secret (draw:N), or the first N tasks of the validation split in "
    "public worlds, the same every run, to compare agents on (dev:N)"
)


def selected_tasks(selection: str) -> Tuple[SuiteTask, ...]:
    """The tasks `selection` names (see `SELECTION_HELP`); a ValueError that says what is accepted."""
    name, _, rest = selection.partition(":")
    if name == "draw":
        if not (rest.isascii() and rest.isdigit()):  # ASCII digits only: str.isdigit takes every script's
            raise ValueError(f"{selection!r}: a fresh draw is draw:N with N a number of tasks, e.g. draw:60")
        return drawn_tasks(int(rest))
    if name == DEVELOPMENT_PREFIX:
        if not (rest.isascii() and rest.isdigit()):
            raise ValueError(f"{selection!r}: development tasks are dev:N with N a number of tasks, e.g. dev:40")
        return development_tasks(int(rest))
    if name not in SUITES:
        raise ValueError(f"{selection!r} names no suite; give {SELECTION_HELP}")
    tasks = suite_tasks(name)
    if not rest:
        return tasks
    if rest not in PARTS:
        raise ValueError(f"{selection!r}: the suite's parts are {', '.join(PARTS)}")
    return tuple(task for task in tasks if task.part == rest)
