"""Typed actions, observations and state of CERNenv (pydantic v2, OpenEnv base classes).

These are the only objects that cross the boundary between the environment and an
agent (in process or over OpenEnv's HTTP/WebSocket API). Nothing in an observation
or in `CernState` reveals the hidden particle before the episode is graded.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Dict, List, Optional, Tuple

from openenv.core.env_server.types import Action, Observation, State
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class ActionType(str, Enum):
    """The 16 verbs of a discovery campaign, in the order a physicist would use them."""

    CONFIGURE_BEAM = "configure_beam"
    ALLOCATE_LUMINOSITY = "allocate_luminosity"
    SET_TRIGGER = "set_trigger"
    COLLECT_COLLISIONS = "collect_collisions"
    CALIBRATE_DETECTOR = "calibrate_detector"
    RECONSTRUCT_TRACKS = "reconstruct_tracks"
    SELECT_CHANNEL = "select_channel"
    BUILD_INVARIANT_MASS = "build_invariant_mass"
    SUBTRACT_BACKGROUND = "subtract_background"
    FIT_RESONANCE = "fit_resonance"
    SCAN_BUMP = "scan_bump"
    MEASURE_ANGULAR = "measure_angular"
    ESTIMATE_SIGNIFICANCE = "estimate_significance"
    REQUEST_SYSTEMATICS = "request_systematics"
    REQUEST_THEORY_REVIEW = "request_theory_review"
    SUBMIT_DISCOVERY_CLAIM = "submit_discovery_claim"


class ExperimentAction(Action):
    """One action: a verb, its parameters (validated per verb by `cernenv.actions`), and why."""

    action_type: ActionType = Field(description="Which of the 16 verbs to perform.")
    parameters: Dict[str, Any] = Field(
        default_factory=dict, description="Verb-specific parameters; see the action table."
    )
    justification: str = Field(default="", max_length=2000, description="Free-text reasoning (not graded).")


class DiscoveryClaim(BaseModel):
    """The parameters of `submit_discovery_claim`: what the agent says it found."""

    model_config = ConfigDict(extra="forbid")

    discovered: bool = Field(description="True: a new resonance exists in the search window; False: nothing there.")
    mass_gev: Optional[float] = Field(
        default=None,
        ge=1e-3,
        lt=1.0e5,
        allow_inf_nan=False,
        description="Claimed mass [GeV]; required when discovered.",
    )
    mass_uncertainty_gev: Optional[float] = Field(
        default=None,
        ge=1e-6,
        lt=1.0e5,
        allow_inf_nan=False,
        description="One-sigma uncertainty on the mass [GeV]; required when discovered.",
    )
    channel: Optional[str] = Field(default=None, max_length=40, description="Decay channel in which it was seen.")
    spin: Optional[int] = Field(default=None, ge=0, le=2, description="Claimed spin J (0, 1 or 2).")
    significance_sigma: float = Field(
        default=0.0,
        ge=0,
        le=1000,
        allow_inf_nan=False,
        description="Claimed global significance [standard deviations].",
    )
    confidence: float = Field(
        ge=0, le=1, allow_inf_nan=False, description="Probability the agent gives that this claim is correct."
    )

    @field_validator("mass_uncertainty_gev")
    @classmethod
    def _uncertainty_needs_mass(cls, value: Optional[float], info: Any) -> Optional[float]:
        if value is not None and info.data.get("mass_gev") is None:
            raise ValueError("mass_uncertainty_gev given without mass_gev")
        return value

    @model_validator(mode="after")
    def _discovery_needs_mass(self) -> "DiscoveryClaim":
        if self.discovered and (self.mass_gev is None or self.mass_uncertainty_gev is None):
            raise ValueError("a discovery claim (discovered=true) needs mass_gev and mass_uncertainty_gev")
        return self


class TaskInfo(BaseModel):
    """The problem statement the agent is given at reset. It never states the answer."""

    model_config = ConfigDict(extra="forbid")

    campaign_type: str = Field(
        description="curated or procedural (a curated campaign's name is withheld: it would give the answer away)."
    )
    difficulty: str
    problem_statement: str
    search_window_gev: Tuple[float, float]
    available_channels: List[str]
    available_triggers: List[str]
    available_beam_energies_tev: List[float]
    budget_total_musd: float
    luminosity_total_fb: float
    time_total_days: float
    max_steps: int

    def offered_options(self) -> Dict[str, List[Any]]:
        """The values this task offers for each action parameter the environment holds to them
        (refusing any other as `UNAVAILABLE_OPTION`): parameter name → the task's list."""
        return {
            "channel": list(self.available_channels),
            "trigger": list(self.available_triggers),
            "beam_energy_tev": list(self.available_beam_energies_tev),
        }


class ResourceUsage(BaseModel):
    """Money [M$], integrated luminosity [fb^-1] and calendar time [days], used and left."""

    model_config = ConfigDict(extra="forbid")

    budget_used_musd: float = 0.0
    budget_remaining_musd: float = 0.0
    luminosity_used_fb: float = 0.0
    luminosity_remaining_fb: float = 0.0
    luminosity_allocated_fb: float = Field(default=0.0, description="Booked with the machine, not yet collected.")
    luminosity_bookings: int = Field(default=0, description="How many times luminosity was booked this campaign.")
    luminosity_affordable_fb: float = Field(
        default=0.0,
        description="What can still be booked and collected at the configured beam within the cap, keeping back "
        "the analysis reserve of budget and time (0 before the beam is configured).",
    )
    time_used_days: float = 0.0
    time_remaining_days: float = 0.0


class ChannelData(BaseModel):
    """What has been recorded and done in one decay channel."""

    model_config = ConfigDict(extra="forbid")

    luminosity_fb: float = 0.0
    recorded_events: int = 0
    calibration_level: int = 0
    reconstruction: Optional[str] = None


class CollisionObservation(Observation):
    """What the agent sees after each step (compact and text-friendly)."""

    task: TaskInfo = Field(description="The problem statement and the options of this campaign.")
    step_index: int = Field(default=0, description="Steps taken so far.")
    resource_usage: ResourceUsage = Field(
        default_factory=ResourceUsage, description="Budget [M$], luminosity [fb^-1] and time [days] used and left."
    )
    selected_beam_energy_tev: Optional[float] = Field(default=None, description="Beam energy √s [TeV].")
    selected_pileup: Optional[str] = Field(default=None, description="Pileup regime: low, nominal or high.")
    selected_trigger: Optional[str] = Field(default=None, description="Trigger recording collisions now.")
    selected_channel: Optional[str] = Field(default=None, description="Decay channel under analysis.")
    data_collected: Dict[str, ChannelData] = Field(
        default_factory=dict, description="Per channel: luminosity, events, calibration, reconstruction."
    )
    latest_result: Dict[str, Any] = Field(
        default_factory=dict, description="Numeric summary of the last action's result."
    )
    candidate_masses_gev: List[float] = Field(
        default_factory=list, description="Local excesses from the last bump scan [GeV]."
    )
    cumulative_significance: float = Field(default=0.0, description="Best global significance measured so far [sigma].")
    logbook: Dict[str, Dict[str, Any]] = Field(
        default_factory=dict,
        description="The latest result of each analysis verb this episode (`scan_bump/<channel>` per channel): "
        "the numbers a physicist writes down, so a claim can quote them.",
    )
    outdated_logbook_entries: List[str] = Field(
        default_factory=list,
        description="Logbook entries made on data that has changed since (more collisions, a calibration, "
        "another reconstruction or histogram).",
    )
    references: Dict[str, Any] = Field(
        default_factory=dict,
        description='Values an action parameter may quote by name, as "@name" (`cernenv.references`): '
        "the scan's best mass and candidates, the fit, the significance, the spin, the luminosity left.",
    )
    pipeline_history: List[str] = Field(
        default_factory=list, description="The last actions and their status (ok or a violation code)."
    )
    rule_violations: List[str] = Field(
        default_factory=list, description="'CODE: what to do' for each rule the last action broke."
    )
    reward_breakdown: Dict[str, float] = Field(
        default_factory=dict, description="The last step's reward, component by component."
    )


class CernState(State):
    """Episode bookkeeping. Grading fields stay None until the episode is graded."""

    scenario_name: Optional[str] = None
    difficulty: Optional[str] = None
    cumulative_reward: float = 0.0
    terminal_reward: Optional[float] = None
    discovered: Optional[bool] = None
    correct_outcome: Optional[bool] = Field(
        default=None, description="A supported discovery at the right mass, or a well-founded null claim."
    )
    correct_mass: Optional[bool] = None
    correct_channel: Optional[bool] = None
    correct_spin: Optional[bool] = None
    reward_components: Dict[str, float] = Field(
        default_factory=dict, description="Episode total of each reward component."
    )
