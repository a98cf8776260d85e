"""One campaign's state (`Episode`) and what the agent is shown of it (`observe`).

The environment keeps an `Episode` per reset and its action handlers change it; `observe` turns it
into the `CollisionObservation` the agent reads: the task without its answer, the resources used
and left, the data per channel, the latest result, the logbook and the values an action may quote
by reference (`cernenv.references`), which it records on the episode as what was shown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

from cernenv.handlers import _r
from cernenv.models import ChannelData, CollisionObservation, ResourceUsage, TaskInfo
from cernenv.references import observation_references
from cernenv.scenarios import Scenario
from cernenv.simulation import CollisionRecorder, Spectrum

HISTORY_LENGTH = 12
"""Entries of the episode's history the observation's `pipeline_history` shows (the latest)."""


@dataclass
class Episode:
    """One campaign's state: its task and hidden world (`scenario`, `recorder`), the choices made,
    the resources used, the analysis objects, the logbook and what the last observation showed."""

    scenario: Scenario
    seed: int
    recorder: CollisionRecorder
    episode_id: str
    beam_energy_tev: Optional[float] = None
    pileup: Optional[str] = None
    trigger: Optional[str] = None
    channel: Optional[str] = None
    booked_fb: float = 0.0
    luminosity_fb: float = 0.0
    budget_used_musd: float = 0.0
    time_used_days: float = 0.0
    spectrum: Optional[Spectrum] = None
    fits: Dict[tuple, Any] = field(default_factory=dict)  # fits by (kind, Spectrum.fit_key, ...): each made once
    background_fit: Any = None  # from subtract_background (possibly a sideband fit)
    resonance_fit: Any = None
    scan: Any = None
    angular: Any = None  # the last `measure_angular`'s `AngularMeasurement`
    systematics: Dict[str, Dict[str, float]] = field(default_factory=dict)
    analysed_luminosity_fb: float = 0.0
    candidates_gev: List[float] = field(default_factory=list)
    best_significance: float = 0.0
    world_nonce: str = ""  # mixed into the hidden streams by `fresh_worlds` (empty: the seed's world)
    grade: Optional[Dict[str, Any]] = None  # `episode_grade()`, once graded
    claim: Any = None  # the `DiscoveryClaim` graded (None: ended without one)
    milestones: Set[str] = field(default_factory=set)
    paid_milestones: Set[str] = field(default_factory=set)
    terminal_components: Dict[str, float] = field(default_factory=dict)
    seen_actions: Set[str] = field(default_factory=set)
    data_version: int = 0
    history: List[str] = field(default_factory=list)
    latest_result: Dict[str, Any] = field(default_factory=dict)
    logbook: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    logbook_versions: Dict[str, int] = field(default_factory=dict)  # data_version each entry was made on
    bookings: int = 0
    references: Dict[str, Any] = field(default_factory=dict)  # what the last observation showed by name
    done: bool = False


def observe(
    episode: Episode,
    *,
    step_index: int,
    max_steps: int,
    affordable_fb: Optional[float],
    reward: float,
    breakdown: Dict[str, float],
    violations: List[str],
) -> CollisionObservation:
    """What the agent sees of `episode` after step `step_index` (0: the reset): `affordable_fb` is
    the luminosity it can still book (None before the beam is configured), `reward`, `breakdown` and
    `violations` the step's. Records on the episode the references the observation shows."""
    scenario = episode.scenario
    task = TaskInfo(
        campaign_type="curated" if scenario.curated else "procedural",
        difficulty=scenario.difficulty,
        problem_statement=scenario.summary,
        search_window_gev=scenario.search_window_gev,
        available_channels=list(scenario.channels),
        available_triggers=list(scenario.triggers),
        available_beam_energies_tev=list(scenario.beam_energies_tev),
        budget_total_musd=scenario.budget_musd,
        luminosity_total_fb=scenario.luminosity_fb,
        time_total_days=scenario.time_days,
        max_steps=max_steps,
    )
    usage = ResourceUsage(
        budget_used_musd=_r(episode.budget_used_musd, 6),
        budget_remaining_musd=_r(scenario.budget_musd - episode.budget_used_musd, 6),
        luminosity_used_fb=_r(episode.luminosity_fb, 6),
        luminosity_remaining_fb=_r(scenario.luminosity_fb - episode.luminosity_fb, 6),
        luminosity_allocated_fb=_r(episode.booked_fb, 6),
        luminosity_bookings=episode.bookings,
        luminosity_affordable_fb=_r(affordable_fb or 0.0, 4),
        time_used_days=_r(episode.time_used_days, 6),
        time_remaining_days=_r(scenario.time_days - episode.time_used_days, 6),
    )
    data = {
        name: ChannelData(
            luminosity_fb=_r(rec.luminosity_fb, 6),
            recorded_events=rec.recorded_events,
            calibration_level=rec.calibration_level,
            reconstruction=rec.reconstruction,
        )
        for name, rec in episode.recorder.records.items()
        if rec.luminosity_fb > 0
    }
    episode.references = observation_references(
        episode.logbook,
        episode.channel,
        episode.candidates_gev,
        booked_fb=episode.booked_fb,
        affordable_fb=affordable_fb,
    )
    return CollisionObservation(
        task=task,
        step_index=step_index,
        resource_usage=usage,
        selected_beam_energy_tev=episode.beam_energy_tev,
        selected_pileup=episode.pileup,
        selected_trigger=episode.trigger,
        selected_channel=episode.channel,
        data_collected=data,
        latest_result=dict(episode.latest_result),
        candidate_masses_gev=list(episode.candidates_gev),
        logbook={key: dict(entry) for key, entry in episode.logbook.items()},
        outdated_logbook_entries=[
            key for key, version in episode.logbook_versions.items() if version < episode.data_version
        ],
        references=dict(episode.references),
        cumulative_significance=_r(episode.best_significance, 3) or 0.0,
        pipeline_history=episode.history[-HISTORY_LENGTH:],
        rule_violations=violations,
        reward_breakdown=dict(breakdown),
        done=episode.done,
        reward=float(reward),
    )
