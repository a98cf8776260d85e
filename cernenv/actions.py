"""The action table: every verb's parameters, cost, prerequisites and result, defined once.

The rules engine, the environment, the LLM prompt's JSON schema and docs/environment.md
all read `ACTION_TABLE`; nothing else lists actions.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, List, Literal, Optional, Tuple, Type

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cernenv.detector import RECONSTRUCTIONS
from cernenv.models import ActionType, DiscoveryClaim

_FINITE = {"allow_inf_nan": False}
# The smallest quantities an action accepts: far below any physical use, far above the
# subnormal floats whose ratios overflow (a scan step of 1e-320 GeV would be 10^323 points).
MIN_MASS_GEV = 1e-3
MIN_LUMINOSITY_FB = 1e-6
MAX_MASS_GEV = 1.0e5


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConfigureBeamParams(_Params):
    beam_energy_tev: float = Field(ge=0.1, le=100, description="√s [TeV]; one of the task's beam energies.", **_FINITE)
    pileup: Literal["low", "nominal", "high"] = Field(
        default="nominal", description="Collisions per crossing: more data per day, worse resolution and trigger."
    )


class LuminosityParams(_Params):
    luminosity_fb: float = Field(
        ge=MIN_LUMINOSITY_FB, le=1.0e4, description="Integrated luminosity [fb^-1].", **_FINITE
    )


class TriggerParams(_Params):
    trigger: str = Field(max_length=40, description="One of the task's triggers.")


class ChannelParams(_Params):
    channel: str = Field(max_length=40, description="One of the task's decay channels.")


class ReconstructParams(ChannelParams):
    quality: Literal["fast", "standard", "tight"] = Field(
        default="standard", description="fast: cheap, worse resolution and purity; tight: purer, fewer signal events."
    )


class SpectrumParams(_Params):
    mass_min_gev: Optional[float] = Field(
        default=None, ge=MIN_MASS_GEV, lt=MAX_MASS_GEV, description="Lower edge [GeV]; default: window.", **_FINITE
    )
    mass_max_gev: Optional[float] = Field(
        default=None, ge=MIN_MASS_GEV, lt=MAX_MASS_GEV, description="Upper edge [GeV]; default: window.", **_FINITE
    )
    bin_width_gev: Optional[float] = Field(
        default=None,
        ge=MIN_MASS_GEV,
        lt=MAX_MASS_GEV,
        description="Bin width [GeV]; default: ~resolution/2.",
        **_FINITE,
    )

    @model_validator(mode="after")
    def _ordered(self) -> "SpectrumParams":
        if self.mass_min_gev is not None and self.mass_max_gev is not None and self.mass_min_gev >= self.mass_max_gev:
            raise ValueError("mass_min_gev must be below mass_max_gev")
        return self


class BackgroundParams(_Params):
    method: Literal["sideband", "fit"] = Field(
        default="fit", description="fit: smooth fit to the whole spectrum; sideband: fit with the signal region masked."
    )
    signal_region_gev: Optional[Tuple[float, float]] = Field(
        default=None, description="[lo, hi] region [GeV] to test for an excess; required for sideband."
    )

    @model_validator(mode="after")
    def _region(self) -> "BackgroundParams":
        region = self.signal_region_gev
        if region is not None and not (
            all(math.isfinite(edge) for edge in region) and MIN_MASS_GEV <= region[0] < region[1] < MAX_MASS_GEV
        ):
            raise ValueError(
                f"signal_region_gev must be [lo, hi] [GeV] with {MIN_MASS_GEV:g} <= lo < hi < {MAX_MASS_GEV:g}"
            )
        if self.method == "sideband" and region is None:
            raise ValueError("method 'sideband' needs signal_region_gev")
        return self


class FitParams(_Params):
    mass_hint_gev: Optional[float] = Field(
        default=None, ge=MIN_MASS_GEV, lt=MAX_MASS_GEV, description="Starting mass [GeV].", **_FINITE
    )
    float_width: bool = Field(default=True, description="Fit the natural width Γ (else Γ = 0).")


class ScanParams(_Params):
    step_gev: Optional[float] = Field(
        default=None, ge=MIN_MASS_GEV, le=1.0e4, description="Scan step [GeV]; default: half the resolution.", **_FINITE
    )


class MassParams(_Params):
    mass_gev: float = Field(ge=MIN_MASS_GEV, lt=MAX_MASS_GEV, description="Mass hypothesis [GeV].", **_FINITE)


class AngularParams(MassParams):
    window_sigma: float = Field(
        default=2.0, ge=0.5, le=5.0, description="Half-width of the signal region [σ_m].", **_FINITE
    )


class NoParams(_Params):
    pass


class Prerequisite(str, Enum):
    """Conditions an action needs; the rules engine checks them before it runs."""

    BEAM_CONFIGURED = "beam_configured"
    TRIGGER_SET = "trigger_set"
    LUMINOSITY_ALLOCATED = "luminosity_allocated"
    CHANNEL_DATA = "channel_data"
    CHANNEL_SELECTED = "channel_selected"
    RECONSTRUCTED = "reconstructed"
    SPECTRUM_BUILT = "spectrum_built"
    FIT_DONE = "fit_done"


@dataclass(frozen=True)
class ActionSpec:
    action_type: ActionType
    params: Type[BaseModel]
    cost_musd: float
    time_days: float
    prerequisites: Tuple[Prerequisite, ...]
    summary: str
    returns: str
    cost_note: str = ""


P = Prerequisite
ACTION_TABLE: Dict[ActionType, ActionSpec] = {
    spec.action_type: spec
    for spec in [
        ActionSpec(
            ActionType.CONFIGURE_BEAM,
            ConfigureBeamParams,
            5.0,
            3.0,
            (),
            "Set √s and the pileup regime. Locked once collisions are recorded.",
            "cost and days per fb^-1 at this setting",
        ),
        ActionSpec(
            ActionType.ALLOCATE_LUMINOSITY,
            LuminosityParams,
            0.0,
            1.0,
            (P.BEAM_CONFIGURED,),
            "Book beam time with the machine; pays the luminosity up front.",
            "luminosity booked, budget left",
            cost_note="+ cost per fb^-1 of the beam energy × fb^-1",
        ),
        ActionSpec(
            ActionType.SET_TRIGGER,
            TriggerParams,
            0.2,
            0.5,
            (P.BEAM_CONFIGURED,),
            "Choose which events are recorded: each trigger keeps some channels.",
            "trigger efficiency per channel",
        ),
        ActionSpec(
            ActionType.COLLECT_COLLISIONS,
            LuminosityParams,
            0.0,
            0.0,
            (P.BEAM_CONFIGURED, P.TRIGGER_SET, P.LUMINOSITY_ALLOCATED),
            "Take booked luminosity; every channel the trigger keeps records events.",
            "events recorded per channel",
            cost_note="+ days per fb^-1 of the beam and pileup × fb^-1",
        ),
        ActionSpec(
            ActionType.CALIBRATE_DETECTOR,
            ChannelParams,
            2.0,
            5.0,
            (P.CHANNEL_DATA,),
            "Calibrate a channel's energy scale and resolution on control samples (2 levels).",
            "calibration level, residual scale uncertainty, resolution",
        ),
        ActionSpec(
            ActionType.RECONSTRUCT_TRACKS,
            ReconstructParams,
            0.0,
            0.0,
            (P.CHANNEL_DATA,),
            "Reconstruct and select a channel's events at a chosen quality.",
            "selected events, resolution",
            cost_note="+ " + ", ".join(f"{r.name} {r.cost_musd:g} M$/{r.days:g} d" for r in RECONSTRUCTIONS.values()),
        ),
        ActionSpec(
            ActionType.SELECT_CHANNEL,
            ChannelParams,
            0.0,
            0.1,
            (),
            "Choose the decay channel the analysis works on.",
            "recorded events in that channel",
        ),
        ActionSpec(
            ActionType.BUILD_INVARIANT_MASS,
            SpectrumParams,
            0.1,
            0.5,
            (P.CHANNEL_SELECTED, P.RECONSTRUCTED),
            "Histogram the selected channel's invariant mass.",
            "events, bins, range, expected resolution",
        ),
        ActionSpec(
            ActionType.SUBTRACT_BACKGROUND,
            BackgroundParams,
            0.1,
            1.0,
            (P.SPECTRUM_BUILT,),
            "Fit the smooth background and measure the excess over it.",
            "observed, expected and excess events in the signal region; largest excess",
        ),
        ActionSpec(
            ActionType.FIT_RESONANCE,
            FitParams,
            0.2,
            1.0,
            (P.SPECTRUM_BUILT,),
            "Extended binned likelihood fit, signal (Breit–Wigner ⊗ Gauss) + background.",
            "mass ± stat. error, width, signal yield ± error, fit χ²/ndf",
        ),
        ActionSpec(
            ActionType.SCAN_BUMP,
            ScanParams,
            0.2,
            1.0,
            (P.SPECTRUM_BUILT,),
            "Local-significance scan over the window.",
            "best mass, best local Z, candidate masses",
        ),
        ActionSpec(
            ActionType.MEASURE_ANGULAR,
            AngularParams,
            0.3,
            2.0,
            (P.SPECTRUM_BUILT,),
            "cos θ* of signal-region events; likelihood of spin 0, 1, 2.",
            "relative likelihood per allowed spin, best spin, separation",
        ),
        ActionSpec(
            ActionType.ESTIMATE_SIGNIFICANCE,
            MassParams,
            0.2,
            1.0,
            (P.SPECTRUM_BUILT,),
            "Profile-likelihood significance at a mass, with the look-elsewhere effect.",
            "q0, local Z, global Z, trials factor, systematics included?",
        ),
        ActionSpec(
            ActionType.REQUEST_SYSTEMATICS,
            NoParams,
            1.0,
            5.0,
            (P.SPECTRUM_BUILT,),
            "Evaluate systematic uncertainties of the selected channel; later significances include them.",
            "energy-scale, resolution, luminosity and spurious-signal uncertainties",
        ),
        ActionSpec(
            ActionType.REQUEST_THEORY_REVIEW,
            MassParams,
            0.5,
            7.0,
            (P.FIT_DONE,),
            "Ask theorists: allowed spins (Landau–Yang), and the luminosity for an expected 5σ at the fitted yield.",
            "allowed spins, luminosity for 5σ, background per fb^-1 under the peak",
        ),
        ActionSpec(
            ActionType.SUBMIT_DISCOVERY_CLAIM,
            DiscoveryClaim,
            0.0,
            0.0,
            (),
            "End the campaign with a claim (a discovery, or that nothing is there).",
            "the grade",
        ),
    ]
}
assert set(ACTION_TABLE) == set(ActionType), "every ActionType needs a row in ACTION_TABLE"


def parameter_schema(action_type: ActionType) -> Dict[str, Any]:
    """JSON schema of one verb's parameters."""
    return ACTION_TABLE[action_type].params.model_json_schema()


def type_label(annotation: Any) -> str:
    """A type as a person reads it in the docs: `Optional[float]`, `Literal['fast', 'tight']`."""
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return re.sub(r"\b(typing|cernenv\.models|cernenv\.actions)\.", "", text)


def markdown_cell(text: str) -> str:
    """Escape what would break a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _parameter_summary(model: Type[BaseModel]) -> str:
    parts: List[str] = []
    for name, field in model.model_fields.items():
        default = "" if field.is_required() else f"={field.default!r}"
        parts.append(f"{name}: {type_label(field.annotation)}{default}")
    return markdown_cell(", ".join(parts)) or "—"


def render_action_table_markdown() -> str:
    """docs/environment.md's action table, from `ACTION_TABLE`."""
    rows = ["| action | parameters | cost | needs | what it does; returns |", "|---|---|---|---|---|"]
    for spec in ACTION_TABLE.values():
        cost = f"{spec.cost_musd:g} M$, {spec.time_days:g} d" + (f" {spec.cost_note}" if spec.cost_note else "")
        needs = ", ".join(p.value for p in spec.prerequisites) or "—"
        rows.append(
            f"| `{spec.action_type.value}` | {_parameter_summary(spec.params)} | {cost} | {needs} | "
            f"{markdown_cell(spec.summary)} Returns: {markdown_cell(spec.returns)}. |"
        )
    return "\n".join(rows)
