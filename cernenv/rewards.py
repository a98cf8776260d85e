"""Reward components, defined once, and the grading of a discovery claim.

Per-step shaping is small and bounded (milestones are paid once, at most
`MILESTONE_REWARD * len(MILESTONES)` per episode); the terminal grade dominates.
Each component is its own number in `CollisionObservation.reward_breakdown`, so a
trainer can log (and optimise) them one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import numpy as np

from cernenv.actions import markdown_cell
from cernenv.models import DiscoveryClaim


@dataclass(frozen=True)
class RewardComponent:
    name: str
    when: str
    value_range: Tuple[float, float]
    description: str


MILESTONE_REWARD = 0.05
MILESTONES = ("collisions_collected", "spectrum_built", "resonance_fitted", "significance_estimated")
VIOLATION_PENALTY = -0.1
REDUNDANCY_PENALTY = -0.05
# Outcome grades.
CORRECT_DISCOVERY = 3.0
CORRECT_NULL = 3.0
FALSE_DISCOVERY = -3.0
WRONG_MASS_DISCOVERY = -2.0
MISSED_DISCOVERY = -1.0
NO_CLAIM = -1.0
# A discovery counts only if the agent's own data support it at this local significance.
EVIDENCE_Z_LOCAL = 3.0
# A claimed mass uncertainty above this fraction of the mass is too vague to count as a
# measurement (a dijet resonance's statistical precision is ~2-4%).
MAX_CLAIM_UNCERTAINTY_FRAC = 0.05
# A null claim earns full credit only with at least this fraction of the luminosity cap analysed.
NULL_EVIDENCE_LUMINOSITY_FRACTION = 0.25

REWARD_COMPONENTS: Tuple[RewardComponent, ...] = (
    RewardComponent(
        "milestones",
        "step",
        (0.0, MILESTONE_REWARD),
        f"+{MILESTONE_REWARD} the first time each of {', '.join(MILESTONES)} happens.",
    ),
    RewardComponent(
        "violations",
        "step",
        (VIOLATION_PENALTY, 0.0),
        f"{VIOLATION_PENALTY} for an action the rules reject (it does not run).",
    ),
    RewardComponent(
        "redundancy",
        "step",
        (REDUNDANCY_PENALTY, 0.0),
        f"{REDUNDANCY_PENALTY} for repeating an action with the same parameters on unchanged data.",
    ),
    RewardComponent(
        "outcome",
        "terminal",
        (FALSE_DISCOVERY, CORRECT_DISCOVERY),
        f"{CORRECT_DISCOVERY:+g} correct discovery (right mass, own data ≥ {EVIDENCE_Z_LOCAL:g}σ local); "
        f"{CORRECT_NULL:+g} correct null, scaled by the luminosity analysed (full at "
        f"{NULL_EVIDENCE_LUMINOSITY_FRACTION:.0%} of the cap); {FALSE_DISCOVERY:+g} false discovery; "
        f"{WRONG_MASS_DISCOVERY:+g} discovery at a wrong mass; {MISSED_DISCOVERY:+g} missed; "
        f"{NO_CLAIM:+g} no claim; 0 for a right guess without evidence.",
    ),
    RewardComponent(
        "mass",
        "terminal",
        (-0.5, 1.0),
        f"+1 if |m_claim − m_true| ≤ 2·√(σ_claim² + (0.001 m)²) with σ_claim ≤ "
        f"{MAX_CLAIM_UNCERTAINTY_FRAC:.0%} of m; else −0.5. Mass, channel and spin are graded "
        "for discoveries of a real particle that the agent's data support; else 0.",
    ),
    RewardComponent("channel", "terminal", (-0.25, 0.5), "+0.5 right decay channel, −0.25 wrong."),
    RewardComponent("spin", "terminal", (-0.25, 0.5), "+0.5 right spin, −0.25 wrong, 0 not claimed."),
    RewardComponent(
        "significance_calibration",
        "terminal",
        (-2.0, 0.0),
        "−0.5 per σ that the claimed significance exceeds the reference analysis's global Z "
        "(with systematics) by more than 1σ; at most −2.",
    ),
    RewardComponent(
        "confidence_calibration",
        "terminal",
        (-0.5, 0.5),
        "0.5·(1 − 2·(confidence − correct)²): a Brier score, so honest confidence pays best.",
    ),
    RewardComponent("efficiency", "terminal", (0.0, 0.5), "+0.5 × fraction of the budget left, for a correct outcome."),
)
COMPONENT_NAMES = tuple(c.name for c in REWARD_COMPONENTS)


def render_reward_table_markdown() -> str:
    rows = ["| component | paid | range | rule |", "|---|---|---|---|"]
    for c in REWARD_COMPONENTS:
        rows.append(
            f"| `{c.name}` | {c.when} | [{c.value_range[0]:g}, {c.value_range[1]:g}] | {markdown_cell(c.description)} |"
        )
    return "\n".join(rows)


@dataclass(frozen=True)
class Grade:
    components: Dict[str, float]
    discovered: bool
    correct_outcome: bool
    correct_mass: Optional[bool]
    correct_channel: Optional[bool]
    correct_spin: Optional[bool]


def mass_is_correct(claim_mass_gev: float, claim_uncertainty_gev: float, true_mass_gev: float) -> bool:
    tolerance = 2.0 * float(np.hypot(claim_uncertainty_gev, 0.001 * true_mass_gev))
    return (
        claim_uncertainty_gev <= MAX_CLAIM_UNCERTAINTY_FRAC * true_mass_gev
        and abs(claim_mass_gev - true_mass_gev) <= tolerance
    )


def grade_claim(
    claim: Optional[DiscoveryClaim],
    truth: Optional[dict],
    *,
    reference_z_local: float,
    reference_z_global: float,
    luminosity_analysed_fraction: float,
    budget_left_fraction: float,
) -> Grade:
    """Terminal reward components for `claim` (None: the episode ended without one).

    `truth` is `Scenario.hidden_truth()`; the reference significances are the environment's
    own analysis of the agent's data at the claimed mass and channel.
    """
    components = {name: 0.0 for name in COMPONENT_NAMES if name not in ("milestones", "violations", "redundancy")}
    exists = bool(truth and truth["exists"])
    if claim is None:
        components["outcome"] = NO_CLAIM
        return Grade(
            components, False, False, False if exists else None, False if exists else None, False if exists else None
        )

    correct_mass = correct_channel = correct_spin = None
    if exists and claim.discovered:
        correct_mass = mass_is_correct(claim.mass_gev, claim.mass_uncertainty_gev, truth["mass_gev"])
        correct_channel = claim.channel in truth["channels"]
        correct_spin = claim.spin == truth["spin"]
        supported = reference_z_local >= EVIDENCE_Z_LOCAL
        correct = correct_mass and supported
        if correct:
            components["outcome"] = CORRECT_DISCOVERY
        elif correct_mass:
            components["outcome"] = 0.0  # a right guess, without evidence
        else:
            components["outcome"] = WRONG_MASS_DISCOVERY
        if supported:
            components["mass"] = 1.0 if correct_mass else -0.5
            components["channel"] = 0.5 if correct_channel else -0.25
            components["spin"] = 0.0 if claim.spin is None else (0.5 if correct_spin else -0.25)
        else:  # a guess is not a measurement: nothing counts as right
            correct_mass = correct_channel = correct_spin = False
    elif exists:
        correct = False
        correct_mass = correct_channel = correct_spin = False
        components["outcome"] = MISSED_DISCOVERY
    elif claim.discovered:
        correct = False
        components["outcome"] = FALSE_DISCOVERY
    else:
        weight = min(1.0, luminosity_analysed_fraction / NULL_EVIDENCE_LUMINOSITY_FRACTION)
        correct = weight >= 1.0
        components["outcome"] = CORRECT_NULL * weight

    if claim.discovered:
        overclaim = claim.significance_sigma - reference_z_global - 1.0
        components["significance_calibration"] = -min(2.0, 0.5 * max(0.0, overclaim))
    components["confidence_calibration"] = 0.5 * (1.0 - 2.0 * (claim.confidence - float(correct)) ** 2)
    if correct:
        components["efficiency"] = 0.5 * min(1.0, max(0.0, budget_left_fraction))
    return Grade(components, claim.discovered, correct, correct_mass, correct_channel, correct_spin)
