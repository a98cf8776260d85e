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
CORRECT_OBSERVATION = 4.0
CORRECT_NULL = 3.0
FALSE_DISCOVERY = -3.0
WRONG_MASS_DISCOVERY = -2.0
UNSUPPORTED_DISCOVERY = -2.0
MISSED_DISCOVERY = -1.0
UNSUPPORTED_NULL = -1.0
NO_CLAIM = -1.0
EVIDENCE_Z_GLOBAL = 3.0
"""A discovery claim is graded against the truth only if the environment's reference analysis
of the agent's own data finds at least this global significance (look-elsewhere effect
included) at the claimed mass and channel: "evidence". Below it, the claim is unsupported and
its grade is the same whatever the truth, so a claim without data learns nothing of the answer."""
OBSERVATION_Z_GLOBAL = 5.0
"""A correct discovery whose reference global significance reaches this ("observation") earns
`CORRECT_OBSERVATION` instead of `CORRECT_DISCOVERY`."""
MAX_CLAIM_UNCERTAINTY_FRAC = 0.05
"""The mass window grows with the claimed uncertainty up to this fraction of the true mass and
no further: a vaguer claim is graded as if it said this much (a dijet resonance's statistical
precision is ~2-4%)."""
NULL_EVIDENCE_LUMINOSITY_FRACTION = 0.25
"""A null claim ("nothing there") is graded against the truth only with at least this fraction
of the luminosity cap analysed (fitted, scanned or tested); with less, it is unsupported."""
SIGNIFICANCE_TOLERANCE_SIGMA = 1.0
"""A discovery's claimed significance may differ from the reference global Z by this much
either way without cost; beyond, each σ costs 0.5 (at most 2)."""

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
        (FALSE_DISCOVERY, CORRECT_OBSERVATION),
        f"A discovery is supported when the reference analysis of the agent's own data finds global Z ≥ "
        f"{EVIDENCE_Z_GLOBAL:g} (look-elsewhere included) at the claimed mass and channel; a null claim when "
        f"≥ {NULL_EVIDENCE_LUMINOSITY_FRACTION:.0%} of the luminosity cap was analysed. Supported: "
        f"{CORRECT_DISCOVERY:+g} correct discovery ({CORRECT_OBSERVATION:+g} at global Z ≥ {OBSERVATION_Z_GLOBAL:g}); "
        f"{WRONG_MASS_DISCOVERY:+g} discovery at a wrong mass; {FALSE_DISCOVERY:+g} false discovery; "
        f"{CORRECT_NULL:+g} correct null; {MISSED_DISCOVERY:+g} missed. Unsupported, whatever the truth: "
        f"{UNSUPPORTED_DISCOVERY:+g} discovery, {UNSUPPORTED_NULL:+g} null; {NO_CLAIM:+g} no claim.",
    ),
    RewardComponent(
        "mass",
        "terminal",
        (-0.5, 1.0),
        f"+1 if |m_claim − m_true| ≤ 2·√(min(σ_claim, {MAX_CLAIM_UNCERTAINTY_FRAC:g}·m_true)² + (0.001·m_true)²) "
        "(a window symmetric about the true mass); else −0.5. Mass, channel and spin are graded "
        "for supported discoveries of a real particle; else 0.",
    ),
    RewardComponent("channel", "terminal", (-0.25, 0.5), "+0.5 right decay channel, −0.25 wrong."),
    RewardComponent("spin", "terminal", (-0.25, 0.5), "+0.5 right spin, −0.25 wrong, 0 not claimed."),
    RewardComponent(
        "significance_calibration",
        "terminal",
        (-2.0, 0.0),
        f"For a discovery: −0.5 per σ that the claimed significance differs from the reference analysis's "
        f"global Z (statistical, look-elsewhere included) by more than {SIGNIFICANCE_TOLERANCE_SIGMA:g}σ, "
        "either way; at most −2.",
    ),
    RewardComponent(
        "confidence_calibration",
        "terminal",
        (-0.5, 0.5),
        "0.5·(1 − 2·(confidence − correct)²): a Brier score, so honest confidence pays best "
        "(an unsupported claim counts as not correct).",
    ),
    RewardComponent("efficiency", "terminal", (0.0, 0.5), "+0.5 × fraction of the budget left, for a correct outcome."),
)
COMPONENT_NAMES = tuple(c.name for c in REWARD_COMPONENTS)
STEP_COMPONENT_NAMES = tuple(c.name for c in REWARD_COMPONENTS if c.when == "step")
TERMINAL_COMPONENT_NAMES = tuple(c.name for c in REWARD_COMPONENTS if c.when == "terminal")


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
    """Whether a claimed mass lies in the window 2·√(σ² + (0.001 m)²) about the true mass, σ the
    claimed uncertainty capped at `MAX_CLAIM_UNCERTAINTY_FRAC` of the true mass: symmetric
    about the true mass for any claimed uncertainty, and no wider for a vaguer claim."""
    sigma = min(float(claim_uncertainty_gev), MAX_CLAIM_UNCERTAINTY_FRAC * true_mass_gev)
    return bool(abs(claim_mass_gev - true_mass_gev) <= 2.0 * float(np.hypot(sigma, 0.001 * true_mass_gev)))


def grade_claim(
    claim: Optional[DiscoveryClaim],
    truth: Optional[dict],
    *,
    reference_z_global: float,
    luminosity_analysed_fraction: float,
    budget_left_fraction: float,
) -> Grade:
    """Terminal reward components for `claim` (None: the episode ended without one).

    `truth` is `Scenario.hidden_truth()`; `reference_z_global` is the environment's reference
    analysis of the agent's data at the claimed mass and channel. The truth is read only for a
    supported claim (`EVIDENCE_Z_GLOBAL`, `NULL_EVIDENCE_LUMINOSITY_FRACTION`): the grade of a
    claim without evidence, or of no claim, is the same in every hidden world.
    """
    components = {name: 0.0 for name in TERMINAL_COMPONENT_NAMES}
    if claim is None:
        components["outcome"] = NO_CLAIM
        return Grade(components, False, False, None, None, None)

    correct = False
    correct_mass = correct_channel = correct_spin = None
    if claim.discovered:
        overclaim = abs(claim.significance_sigma - reference_z_global) - SIGNIFICANCE_TOLERANCE_SIGMA
        components["significance_calibration"] = -min(2.0, 0.5 * max(0.0, overclaim))
        if reference_z_global < EVIDENCE_Z_GLOBAL:
            components["outcome"] = UNSUPPORTED_DISCOVERY
        elif not truth["exists"]:
            components["outcome"] = FALSE_DISCOVERY
        else:
            correct_mass = mass_is_correct(claim.mass_gev, claim.mass_uncertainty_gev, truth["mass_gev"])
            correct_channel = claim.channel in truth["channels"]
            correct_spin = claim.spin == truth["spin"]
            correct = correct_mass
            if correct_mass:
                observed = reference_z_global >= OBSERVATION_Z_GLOBAL
                components["outcome"] = CORRECT_OBSERVATION if observed else CORRECT_DISCOVERY
            else:
                components["outcome"] = WRONG_MASS_DISCOVERY
            components["mass"] = 1.0 if correct_mass else -0.5
            components["channel"] = 0.5 if correct_channel else -0.25
            components["spin"] = 0.0 if claim.spin is None else (0.5 if correct_spin else -0.25)
    elif luminosity_analysed_fraction < NULL_EVIDENCE_LUMINOSITY_FRACTION:
        components["outcome"] = UNSUPPORTED_NULL
    elif truth["exists"]:
        components["outcome"] = MISSED_DISCOVERY
        correct_mass = correct_channel = correct_spin = False
    else:
        correct = True
        components["outcome"] = CORRECT_NULL

    components["confidence_calibration"] = 0.5 * (1.0 - 2.0 * (claim.confidence - float(correct)) ** 2)
    if correct:
        components["efficiency"] = 0.5 * min(1.0, max(0.0, budget_left_fraction))
    return Grade(components, claim.discovered, correct, correct_mass, correct_channel, correct_spin)
