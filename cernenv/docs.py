"""docs/environment.md, generated from the code so that it cannot drift.

    python -m cernenv.docs                 # print the Markdown
    python -m cernenv.docs --write [PATH]  # write it (default docs/environment.md); `make docs`

Every table comes from the objects the environment itself uses: `ACTION_TABLE`, the
observation models, `REWARD_COMPONENTS`, `CURATED`, `Violation` and `PREREQUISITE_HINTS`.
Nothing here reveals a scenario's hidden particle.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from cernenv.actions import ACTION_TABLE, Prerequisite, render_action_table_markdown
from cernenv.environment import _field_table
from cernenv.models import ActionType, ChannelData, CollisionObservation, ResourceUsage, TaskInfo
from cernenv.rewards import REDUNDANCY_PENALTY, VIOLATION_PENALTY, render_reward_table_markdown
from cernenv.rules import PREREQUISITE_HINTS, SOFT_VIOLATIONS, Violation
from cernenv.scenarios import CURATED, DIFFICULTIES

DEFAULT_PATH = Path("docs") / "environment.md"
# Stepping a finished episode is refused without a penalty (the episode is already graded).
_UNPENALISED = frozenset({Violation.EPISODE_DONE})

# What each violation code means (the messages themselves are written where they are raised).
VIOLATION_MEANINGS: Dict[Violation, str] = {
    Violation.INVALID_ACTION: "The input is not an action: unknown `action_type` or a malformed object.",
    Violation.INVALID_PARAMETERS: "The parameters do not validate against the verb's model, or make no sense "
                                  "for the current data (range outside the window, too many bins, ...).",
    Violation.EPISODE_DONE: "The episode has ended; call `reset()`.",
    Violation.MISSING_PREREQUISITE: "A condition the verb needs is not met (see the table below).",
    Violation.UNAVAILABLE_OPTION: "A channel, trigger or beam energy that this task does not offer.",
    Violation.BEAM_LOCKED: "The beam cannot be reconfigured once collisions are recorded.",
    Violation.INSUFFICIENT_BUDGET: "The action costs more money than is left.",
    Violation.INSUFFICIENT_TIME: "The action takes more days than are left.",
    Violation.LUMINOSITY_LIMIT: "Booking more luminosity than the campaign's cap allows.",
    Violation.NOT_ENOUGH_BOOKED: "Collecting more luminosity than was booked with `allocate_luminosity`.",
    Violation.FULLY_CALIBRATED: "The channel is already at the highest calibration level.",
    Violation.REDUNDANT_ACTION: "The same action with the same parameters on unchanged data: it runs, "
                                "but gives the same result.",
}

OVERVIEW = """\
CERNenv simulates an LHC resonance search as an [OpenEnv](https://pypi.org/project/openenv/)
environment. An agent configures the beam, books and collects luminosity with a
trigger, calibrates and reconstructs a decay channel, builds its invariant-mass
spectrum, fits it (signal: Breit–Wigner ⊗ Gauss on a smooth "dijet-function"
background, extended binned likelihood), scans for local excesses, measures the
decay-angle distribution, estimates the profile-likelihood significance q0 with the
look-elsewhere effect, and ends the campaign with a discovery claim — or with the
claim that nothing is there. The claim is graded against a hidden particle (or its
absence in null scenarios), which the agent never sees.

Every action costs money [M$] and calendar time [days]; luminosity [fb^-1] is capped
per campaign. An episode ends with `submit_discovery_claim`, when the budget or the
time runs out, or after `max_steps` steps (the last three are graded as "no claim").

```python
from cernenv import CERNCollisionEnvironment, ExperimentAction

env = CERNCollisionEnvironment()
obs = env.reset(seed=7, scenario="higgs_diphoton_125")
obs = env.step(ExperimentAction(action_type="configure_beam", parameters={"beam_energy_tev": 13.6}))
print(obs.latest_result, obs.reward, obs.done)
```"""


def _join(values: Sequence[object]) -> str:
    return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def render_scenario_table_markdown() -> str:
    """The curated scenarios as the agent is told them: resources and options, never the particle."""
    rows = ["| scenario | difficulty | search window [GeV] | channels | √s [TeV] | budget [M$] | "
            "luminosity cap [fb^-1] | time [days] | max steps |",
            "|---|---|---|---|---|---|---|---|---|"]
    for s in CURATED.values():
        lo, hi = s.search_window_gev
        rows.append(f"| `{s.name}` | {s.difficulty} | {lo:g}–{hi:g} | {_join(s.channels)} | "
                    f"{_join(s.beam_energies_tev)} | {s.budget_musd:g} | {s.luminosity_fb:g} | {s.time_days:g} | "
                    f"{s.max_steps} |")
    return "\n".join(rows)


def render_violation_table_markdown() -> str:
    rows = ["| code | kind | meaning |", "|---|---|---|"]
    for code in Violation:
        if code in SOFT_VIOLATIONS:
            kind = f"soft: runs, {REDUNDANCY_PENALTY:g}"
        else:
            kind = "hard: refused" + ("" if code in _UNPENALISED else f", {VIOLATION_PENALTY:g}")
        rows.append(f"| `{code.value}` | {kind} | {VIOLATION_MEANINGS.get(code, '—')} |")
    return "\n".join(rows)


def render_prerequisite_table_markdown() -> str:
    rows = ["| prerequisite | needed by | what to do |", "|---|---|---|"]
    for prerequisite in Prerequisite:
        users = [f"`{spec.action_type.value}`" for spec in ACTION_TABLE.values() if prerequisite in spec.prerequisites]
        rows.append(f"| `{prerequisite.value}` | {', '.join(users) or '—'} | {PREREQUISITE_HINTS[prerequisite]} |")
    return "\n".join(rows)


def render_environment_markdown() -> str:
    """The whole of docs/environment.md."""
    sections: List[str] = [
        "# CERNenv environment reference",
        "<!-- Generated by `python -m cernenv.docs --write` (`make docs`) from the code: do not edit. -->",
        "## Overview",
        OVERVIEW,
        "## Actions",
        f"An action is `ExperimentAction(action_type, parameters, justification)`, one of "
        f"{len(ActionType)} verbs. Its parameters are validated against the verb's model; costs are "
        "charged when the action runs (a refused action costs nothing but a penalty).",
        render_action_table_markdown(),
        "## Observation",
        "`CollisionObservation`, returned by `reset()` and `step()`:",
        _field_table(CollisionObservation),
        "`task` (`TaskInfo`) states the problem without the answer:",
        _field_table(TaskInfo),
        "`resource_usage` (`ResourceUsage`):",
        _field_table(ResourceUsage),
        "`data_collected[channel]` (`ChannelData`):",
        _field_table(ChannelData),
        "## Rewards",
        "Each component is reported separately in `reward_breakdown`; the step reward is their sum.",
        render_reward_table_markdown(),
        "## Scenarios",
        "Curated campaigns, `reset(scenario=name)`. Without a name, `reset(seed, difficulty=...)` draws a "
        f"procedural campaign of difficulty {' | '.join(DIFFICULTIES)} (drawn from the seed when not given); "
        "any campaign may hold a particle or nothing at all.",
        render_scenario_table_markdown(),
        "## Rule violations",
        "A refused action does not run and is reported in `rule_violations` as `CODE: message`, "
        "the message saying what to do next.",
        render_violation_table_markdown(),
        "### Prerequisites",
        render_prerequisite_table_markdown(),
    ]
    return "\n\n".join(sections) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cernenv.docs", description=__doc__.splitlines()[0])
    parser.add_argument("--write", nargs="?", const=str(DEFAULT_PATH), metavar="PATH",
                        help=f"write the Markdown to PATH (default {DEFAULT_PATH}) instead of stdout")
    args = parser.parse_args(argv)
    text = render_environment_markdown()
    if args.write is None:
        sys.stdout.buffer.write(text.encode("utf-8"))
        return 0
    path = Path(args.write)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
