"""The rules engine: every way an action can be refused, with a message a person can act on.

Hard violations stop the action from running (and cost `VIOLATION_PENALTY`); the
soft one (`REDUNDANT_ACTION`) lets it run and costs `REDUNDANCY_PENALTY`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, Mapping, Optional, Tuple

from pydantic import BaseModel, ValidationError

from cernenv.actions import ACTION_TABLE, Prerequisite
from cernenv.models import ActionType, ExperimentAction
from cernenv.references import has_references, resolve_parameters


class Violation(str, Enum):
    INVALID_ACTION = "INVALID_ACTION"
    INVALID_PARAMETERS = "INVALID_PARAMETERS"
    EPISODE_DONE = "EPISODE_DONE"
    MISSING_PREREQUISITE = "MISSING_PREREQUISITE"
    UNAVAILABLE_OPTION = "UNAVAILABLE_OPTION"
    BEAM_LOCKED = "BEAM_LOCKED"
    INSUFFICIENT_BUDGET = "INSUFFICIENT_BUDGET"
    INSUFFICIENT_TIME = "INSUFFICIENT_TIME"
    LUMINOSITY_LIMIT = "LUMINOSITY_LIMIT"
    NOT_ENOUGH_BOOKED = "NOT_ENOUGH_BOOKED"
    FULLY_CALIBRATED = "FULLY_CALIBRATED"
    REDUNDANT_ACTION = "REDUNDANT_ACTION"


SOFT_VIOLATIONS = frozenset({Violation.REDUNDANT_ACTION})

MAX_CONSECUTIVE_REFUSALS = 5
"""A campaign ends, graded as "no claim", when this many actions in a row were refused
(hard violations): the collaboration stops a run that has lost its way. No valid plan
meets it, and it grades the same as running out of steps without a claim, so it cannot
be used to dodge a grade; it spares a derailed policy 20 turns of refusals."""

END_WITHOUT_CLAIM = {
    "step limit": "max_steps reached without a claim",
    "refusals": f"{MAX_CONSECUTIVE_REFUSALS} refused actions in a row without a claim",
    "budget": "budget exhausted without a claim",
    "time": "time exhausted without a claim",
}
"""Why a campaign ended without a claim, as its last result's `episode_end` (and a ledger's
`ended`) says it, by cause; checked in the order listed."""

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


# What to do when a prerequisite is missing.
PREREQUISITE_HINTS: Dict[Prerequisite, str] = {
    Prerequisite.BEAM_CONFIGURED: "configure_beam first",
    Prerequisite.TRIGGER_SET: "set_trigger first",
    Prerequisite.LUMINOSITY_ALLOCATED: "allocate_luminosity first",
    Prerequisite.CHANNEL_DATA: "collect_collisions with a trigger that records this channel first",
    Prerequisite.CHANNEL_SELECTED: "select_channel first",
    Prerequisite.RECONSTRUCTED: "reconstruct_tracks for the selected channel first",
    Prerequisite.SPECTRUM_BUILT: (
        "build_invariant_mass first, with events in it (an empty spectrum has nothing "
        "to fit: collect more luminosity, or build a wider range)"
    ),
    Prerequisite.FIT_DONE: "fit_resonance first",
}


@dataclass(frozen=True)
class RuleViolation(Exception):
    code: Violation
    message: str

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"


def _describe(error: ValidationError, limit: int = 3) -> str:
    parts = []
    for item in error.errors()[:limit]:
        where = ".".join(str(p) for p in item.get("loc", ())) or "parameters"
        parts.append(f"{where}: {item.get('msg', 'invalid')}")
    more = len(error.errors()) - limit
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def parse_action(raw: Any, references: Optional[Mapping[str, Any]] = None) -> Tuple[ExperimentAction, BaseModel]:
    """Validate any JSON-compatible input into (action, its typed parameters), or raise RuleViolation.

    `references`: the values the last observation showed by name (its `references` field); a
    parameter written `"@name"` is replaced by its value before the parameters are validated
    (`cernenv.references`). The action is returned as written, references and all."""
    if isinstance(raw, ExperimentAction):
        action = raw
    elif isinstance(raw, dict):
        action_type = raw.get("action_type")
        if not isinstance(action_type, str) or action_type not in ActionType._value2member_map_:
            raise RuleViolation(
                Violation.INVALID_ACTION,
                f"unknown action_type {str(action_type)[:60]!r}; use one of {', '.join(a.value for a in ActionType)}",
            )
        try:
            action = ExperimentAction.model_validate(raw)
        except ValidationError as error:
            raise RuleViolation(Violation.INVALID_ACTION, f"malformed action: {_describe(error)}") from None
    else:
        raise RuleViolation(
            Violation.INVALID_ACTION,
            f'an action is a JSON object {{"action_type": ..., "parameters": {{...}}}}, got {type(raw).__name__}',
        )
    spec = ACTION_TABLE[action.action_type]
    parameters = action.parameters
    if has_references(parameters):
        try:
            parameters = resolve_parameters(parameters, references or {})
        except ValueError as error:
            raise RuleViolation(Violation.INVALID_PARAMETERS, f"{action.action_type.value}: {error}") from None
    try:
        params = spec.params.model_validate(parameters)
    except ValidationError as error:
        raise RuleViolation(Violation.INVALID_PARAMETERS, f"{action.action_type.value}: {_describe(error)}") from None
    return action, params


def missing_prerequisite(action_type: ActionType, satisfied: Dict[Prerequisite, bool]) -> Optional[RuleViolation]:
    for prerequisite in ACTION_TABLE[action_type].prerequisites:
        if not satisfied[prerequisite]:
            return RuleViolation(
                Violation.MISSING_PREREQUISITE,
                f"{action_type.value} needs {prerequisite.value}: {PREREQUISITE_HINTS[prerequisite]}",
            )
    return None


def check_resources(cost_musd: float, time_days: float, budget_left_musd: float, time_left_days: float) -> None:
    if cost_musd > budget_left_musd + 1e-9:
        raise RuleViolation(
            Violation.INSUFFICIENT_BUDGET,
            f"needs {cost_musd:.4g} M$ but {budget_left_musd:.4g} M$ are left; do less, or claim",
        )
    if time_days > time_left_days + 1e-9:
        raise RuleViolation(
            Violation.INSUFFICIENT_TIME,
            f"needs {time_days:.4g} days but {time_left_days:.4g} are left; do less, or claim",
        )
