"""`CERNCollisionEnvironment`: an LHC discovery campaign as an OpenEnv environment."""

from __future__ import annotations

import json
import math
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from cernenv import analysis
from cernenv._version import __version__
from cernenv.actions import ACTION_TABLE, Prerequisite, markdown_cell, render_action_table_markdown, type_label
from cernenv.detector import (
    BEAM_ENERGIES,
    CALIBRATION_BIAS_FACTOR,
    MAX_CALIBRATION_LEVEL,
    PILEUP_SETTINGS,
    RECONSTRUCTIONS,
    TRIGGERS,
    mass_resolution_gev,
)
from cernenv.models import (
    ActionType,
    CernState,
    ChannelData,
    CollisionObservation,
    DiscoveryClaim,
    ExperimentAction,
    ResourceUsage,
    TaskInfo,
)
from cernenv.physics.angular import allowed_spins, spin_likelihoods
from cernenv.physics.fitting import fit_background_only, fit_signal_plus_background
from cernenv.physics.shapes import signal_bin_fractions
from cernenv.physics.significance import asimov_significance, count_upcrossings
from cernenv.rewards import (
    COMPONENT_NAMES,
    MILESTONE_REWARD,
    REDUNDANCY_PENALTY,
    STEP_COMPONENT_NAMES,
    VIOLATION_PENALTY,
    grade_claim,
    render_reward_table_markdown,
)
from cernenv.rules import (
    MAX_CONSECUTIVE_REFUSALS,
    RuleViolation,
    Violation,
    check_resources,
    missing_prerequisite,
    parse_action,
)
from cernenv.scenarios import Scenario, make_scenario
from cernenv.seeding import data_rng
from cernenv.simulation import MAX_SPECTRUM_BINS, MIN_SPECTRUM_BINS, CollisionRecorder, Spectrum

LUMINOSITY_UNCERTAINTY_FRAC = 0.017  # ATLAS Run-2 luminosity, EPJC 83 (2023) 982
HISTORY_LENGTH = 12
LOGBOOK_VERBS = (
    ActionType.SCAN_BUMP,
    ActionType.SUBTRACT_BACKGROUND,
    ActionType.FIT_RESONANCE,
    ActionType.MEASURE_ANGULAR,
    ActionType.ESTIMATE_SIGNIFICANCE,
    ActionType.REQUEST_SYSTEMATICS,
    ActionType.REQUEST_THEORY_REVIEW,
)
"""The analysis verbs whose latest result the observation's `logbook` keeps."""
PER_CHANNEL_LOGBOOK_VERBS = (ActionType.SCAN_BUMP,)
"""Logbook verbs kept per channel ("scan_bump/diphoton"): a survey scans every channel."""


_SIGNIFICANT_FIGURES = {digits: f".{digits}g" for digits in range(1, 18)}  # format specs, made once


def _r(value: Optional[float], digits: int = 4) -> Optional[float]:
    """Round to `digits` (1-17) significant figures: compact, text-friendly and byte-stable.
    (Called some 300 times an episode, so with `math` and ready-made format specs.)"""
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        return None
    return float(format(value, _SIGNIFICANT_FIGURES[digits]))


@dataclass
class _Episode:
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
    systematics: Dict[str, Dict[str, float]] = field(default_factory=dict)
    analysed_luminosity_fb: float = 0.0
    candidates_gev: List[float] = field(default_factory=list)
    best_significance: float = 0.0
    world_nonce: str = ""  # mixed into the hidden streams by `fresh_worlds` (empty: the seed's world)
    grade: Optional[Dict[str, Any]] = None  # `episode_grade()`, once graded
    milestones: Set[str] = field(default_factory=set)
    paid_milestones: Set[str] = field(default_factory=set)
    terminal_components: Dict[str, float] = field(default_factory=dict)
    seen_actions: Set[str] = field(default_factory=set)
    data_version: int = 0
    history: List[str] = field(default_factory=list)
    latest_result: Dict[str, Any] = field(default_factory=dict)
    logbook: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    done: bool = False


class CERNCollisionEnvironment(Environment[ExperimentAction, CollisionObservation, CernState]):
    __doc__ = ""  # assembled below from the models, so the tables cannot drift

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(
        self,
        default_max_steps: Optional[int] = None,
        secret_salt: Optional[str] = None,
        *,
        fresh_worlds: bool = False,
        withhold_grades: bool = False,
    ) -> None:
        """`secret_salt`: an evaluation secret mixed into every episode's hidden streams.
        `fresh_worlds`: every reset also mixes in a fresh random nonce, so no seed can be played
        twice in the same hidden world (an evaluation task is single-use). `withhold_grades`:
        the terminal grade is kept out of observations and state (`episode_grade()` reads it),
        so an agent never sees how a claim was graded."""
        super().__init__()
        self._default_max_steps = default_max_steps
        self._secret_salt = _check_salt(secret_salt)
        self._fresh_worlds = bool(fresh_worlds)
        self._withhold_grades = bool(withhold_grades)
        self._episode: Optional[_Episode] = None
        self._state = CernState()

    # OpenEnv API -----------------------------------------------------------------------

    @property
    def max_steps(self) -> int:
        if self._episode is not None:
            return self._default_max_steps or self._episode.scenario.max_steps
        return self._default_max_steps or 30

    @property
    def state(self) -> CernState:
        return self._state.model_copy(deep=True)

    def reset(
        self,
        seed: Optional[int] = None,
        episode_id: Optional[str] = None,
        scenario: Optional[str] = None,
        difficulty: Optional[str] = None,
        secret_salt: Optional[str] = None,
        **kwargs: Any,
    ) -> CollisionObservation:
        """Start a campaign. Same `seed` (and scenario/difficulty, and secret) → same hidden world,
        unless the environment makes `fresh_worlds`.

        `secret_salt` is an evaluation secret mixed, with the environment's own (the
        constructor's), into the hidden streams: the procedural particle and the recorded
        data. With a secret, the public code and the seed no longer tell the answer; the
        visible task stays the one the seed draws. `episode_id` is a fresh random UUID unless
        given: it is no function of the seed."""
        if seed is None:
            seed = int(np.random.SeedSequence().entropy % (2**31))
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        nonce = secrets.token_hex(16) if self._fresh_worlds else ""
        salt = "\x00".join(s for s in (self._secret_salt, _check_salt(secret_salt), nonce) if s) or None
        chosen = make_scenario(int(seed), scenario=scenario, difficulty=difficulty, secret_salt=salt)
        rng = data_rng(int(seed), salt)
        recorder = CollisionRecorder(
            chosen.search_window_gev, chosen.channels, chosen.truth, rng, chosen.signal_capacity_per_fb
        )
        episode_id = episode_id or str(uuid.uuid4())
        self._episode = _Episode(
            scenario=chosen, seed=int(seed), recorder=recorder, episode_id=episode_id, world_nonce=nonce
        )
        self._state = CernState(
            episode_id=episode_id,
            step_count=0,
            scenario_name=chosen.name,
            difficulty=chosen.difficulty,
            reward_components={
                name: 0.0 for name in (STEP_COMPONENT_NAMES if self._withhold_grades else COMPONENT_NAMES)
            },
        )
        self._episode.latest_result = {"message": "campaign started: configure the beam"}
        return self._observation(reward=0.0, breakdown={}, violations=[])

    def step(self, action: Any, timeout_s: Optional[float] = None, **kwargs: Any) -> CollisionObservation:
        """Apply one action. Never raises on bad input: the observation carries the violation.

        A step before any `reset()` first resets with seed 0, so a bare environment is usable."""
        episode = self._episode
        if episode is None:
            self.reset(seed=0)
            episode = self._episode
        if episode.done:
            message = str(RuleViolation(Violation.EPISODE_DONE, "the episode is over; call reset() to start another"))
            return self._observation(reward=0.0, breakdown={}, violations=[message])

        self._state.step_count += 1
        breakdown = {name: 0.0 for name in STEP_COMPONENT_NAMES}
        violations: List[str] = []
        label = "invalid"
        try:
            parsed, params = parse_action(action)
            label = parsed.action_type.value
            result = self._execute(parsed.action_type, params)
            redundancy_key = self._redundancy_key(parsed.action_type, result)
            if redundancy_key in episode.seen_actions:
                violations.append(
                    str(
                        RuleViolation(
                            Violation.REDUNDANT_ACTION, "same action and parameters on unchanged data: same result"
                        )
                    )
                )
                breakdown["redundancy"] = REDUNDANCY_PENALTY
            episode.seen_actions.add(redundancy_key)
            episode.latest_result = {"action": label, **result}
            episode.history.append(f"{label}: ok")
            if parsed.action_type in LOGBOOK_VERBS:
                channel = result.get("channel")
                key = f"{label}/{channel}" if parsed.action_type in PER_CHANNEL_LOGBOOK_VERBS else label
                episode.logbook[key] = dict(result)
        except RuleViolation as violation:
            violations.append(str(violation))
            breakdown["violations"] = VIOLATION_PENALTY
            episode.latest_result = {"action": label, "error": str(violation)}
            episode.history.append(f"{label}: {violation.code.value}")
        except Exception as error:  # a bug must not take the episode down; report it as a violation
            violations.append(
                f"{Violation.INVALID_PARAMETERS.value}: could not run {label}: "
                f"{type(error).__name__}: {str(error)[:200]}"
            )
            breakdown["violations"] = VIOLATION_PENALTY
            episode.latest_result = {"action": label, "error": violations[-1]}
            episode.history.append(f"{label}: failed")

        new_milestones = episode.milestones - episode.paid_milestones
        episode.paid_milestones |= new_milestones
        breakdown["milestones"] = MILESTONE_REWARD * len(new_milestones)
        if not episode.done:
            ended = self._end_reason()
            if ended:
                episode.latest_result["episode_end"] = ended
                episode.latest_result.update(self._grade(None))
        if episode.done and not self._withhold_grades:
            breakdown.update(episode.terminal_components)
        return self._observation(reward=float(sum(breakdown.values())), breakdown=breakdown, violations=violations)

    def episode_grade(self) -> Optional[Dict[str, Any]]:
        """How the ended episode was graded: the terminal reward components, their sum, and
        whether the outcome, mass, channel and spin were right (None: not graded), with the
        reference analysis's global Z at the claim; None while the episode runs. For graders and
        evaluation code only (never for the agent; with `withhold_grades` the only place the
        grade can be read)."""
        if self._episode is None or self._episode.grade is None:
            return None
        return dict(self._episode.grade)

    def world_nonce(self) -> str:
        """The random nonce `fresh_worlds` mixed into this episode's hidden streams ("" without
        it): with the secret, what an auditor needs to replay the episode. Never for the agent."""
        if self._episode is None:
            raise RuntimeError("call reset() before world_nonce()")
        return self._episode.world_nonce

    def hidden_truth(self) -> Dict[str, Any]:
        """The hidden particle, for graders and evaluation code only (never for the agent)."""
        if self._episode is None:
            raise RuntimeError("call reset() before hidden_truth()")
        return self._episode.scenario.hidden_truth()

    ANALYSIS_OBJECTS = ("spectrum", "resonance_fit", "background_fit", "scan")

    def analysis_objects(self) -> Dict[str, Any]:
        """The episode's current analysis objects, for plots and replays (never for the agent,
        which sees their numbers in its observations): the `Spectrum`, the `ResonanceFit` and
        `BackgroundFit` made from it, the `BumpScan`; None until the action that makes each has
        run (a `select_channel` to another channel clears them). Like `hidden_truth`, not served."""
        if self._episode is None:
            raise RuntimeError("call reset() before analysis_objects()")
        return {name: getattr(self._episode, name, None) for name in self.ANALYSIS_OBJECTS}

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="cernenv",
            description="A simulated LHC discovery campaign: take data, fit a spectrum, claim a discovery (or not).",
            version=__version__,
        )

    # Bookkeeping -----------------------------------------------------------------------

    def _redundancy_key(self, action_type: ActionType, result: Dict[str, Any]) -> str:
        """What an action did: its verb, its result and the data it worked on. Two requests
        with one effect, however spelt (`{}` and `{"step_gev": null}`, a range clipped to the
        same window), have one key; so do two that differ only in what the rules ignore."""
        outcome = json.dumps(result, sort_keys=True, default=str)
        return f"{action_type.value}|{outcome}|{self._episode.data_version}"

    def _end_reason(self) -> Optional[str]:
        episode = self._episode
        if self._state.step_count >= self.max_steps:
            return "max_steps reached without a claim"
        recent = episode.history[-MAX_CONSECUTIVE_REFUSALS:]  # "<verb>: ok" for each action that ran
        if len(recent) == MAX_CONSECUTIVE_REFUSALS and not any(entry.endswith(": ok") for entry in recent):
            return f"{MAX_CONSECUTIVE_REFUSALS} refused actions in a row without a claim"
        if episode.scenario.budget_musd - episode.budget_used_musd <= 1e-9:
            return "budget exhausted without a claim"
        if episode.scenario.time_days - episode.time_used_days <= 1e-9:
            return "time exhausted without a claim"
        return None

    def _charge(self, cost_musd: float, time_days: float) -> None:
        episode = self._episode
        check_resources(
            cost_musd,
            time_days,
            episode.scenario.budget_musd - episode.budget_used_musd,
            episode.scenario.time_days - episode.time_used_days,
        )
        # within the rounding tolerance of check_resources, never past the totals
        episode.budget_used_musd = min(episode.budget_used_musd + cost_musd, episode.scenario.budget_musd)
        episode.time_used_days = min(episode.time_used_days + time_days, episode.scenario.time_days)

    def _satisfied(self, channel: Optional[str]) -> Dict[Prerequisite, bool]:
        episode = self._episode
        record = episode.recorder.records.get(channel) if channel else None
        selected = episode.recorder.records.get(episode.channel) if episode.channel else None
        return {
            Prerequisite.BEAM_CONFIGURED: episode.beam_energy_tev is not None,
            Prerequisite.TRIGGER_SET: episode.trigger is not None,
            Prerequisite.LUMINOSITY_ALLOCATED: episode.booked_fb > 0,
            Prerequisite.CHANNEL_DATA: record is not None and record.luminosity_fb > 0,
            Prerequisite.CHANNEL_SELECTED: episode.channel is not None,
            Prerequisite.RECONSTRUCTED: selected is not None and selected.reconstruction is not None,
            Prerequisite.SPECTRUM_BUILT: episode.spectrum is not None and episode.spectrum.counts.sum() > 0,
            Prerequisite.FIT_DONE: episode.resonance_fit is not None,
        }

    def _require_option(self, kind: str, value: Any, options: Tuple[Any, ...]) -> None:
        if value not in options:
            raise RuleViolation(
                Violation.UNAVAILABLE_OPTION,
                f"{kind} {value!r} is not available in this task; choose one of {list(options)}",
            )

    # Actions ---------------------------------------------------------------------------

    def _execute(self, action_type: ActionType, params: Any) -> Dict[str, Any]:
        channel = getattr(params, "channel", None)
        if channel is not None:
            self._require_option("channel", channel, self._episode.scenario.channels)
        prerequisite = missing_prerequisite(action_type, self._satisfied(channel))
        if prerequisite is not None:
            raise prerequisite
        handler: Callable[[Any], Dict[str, Any]] = getattr(self, f"_do_{action_type.value}")
        return handler(params)  # each handler checks its rules and charges before it changes state

    def _charge_table(self, action_type: ActionType, extra_musd: float = 0.0, extra_days: float = 0.0) -> None:
        spec = ACTION_TABLE[action_type]
        self._charge(spec.cost_musd + extra_musd, spec.time_days + extra_days)

    def _do_configure_beam(self, params) -> Dict[str, Any]:
        episode = self._episode
        energy = float(params.beam_energy_tev)
        self._require_option("beam_energy_tev", energy, episode.scenario.beam_energies_tev)
        if episode.luminosity_fb > 0:
            raise RuleViolation(
                Violation.BEAM_LOCKED,
                "collisions are already recorded at "
                f"{episode.beam_energy_tev:g} TeV; one campaign runs at one beam setting",
            )
        self._charge_table(ActionType.CONFIGURE_BEAM)
        episode.beam_energy_tev, episode.pileup = energy, params.pileup
        beam, pileup = BEAM_ENERGIES[energy], PILEUP_SETTINGS[params.pileup]
        return {
            "beam_energy_tev": energy,
            "pileup": params.pileup,
            "cost_musd_per_fb": beam.cost_musd_per_fb,
            "days_per_fb": _r(beam.days_per_fb / pileup.luminosity_rate_factor),
        }

    def _do_allocate_luminosity(self, params) -> Dict[str, Any]:
        episode = self._episode
        requested = float(params.luminosity_fb)
        left = episode.scenario.luminosity_fb - episode.luminosity_fb - episode.booked_fb
        if requested > left + 1e-9:
            raise RuleViolation(
                Violation.LUMINOSITY_LIMIT,
                f"only {left:.4g} fb^-1 of the campaign's {episode.scenario.luminosity_fb:g} are left",
            )
        cost = requested * BEAM_ENERGIES[episode.beam_energy_tev].cost_musd_per_fb
        self._charge_table(ActionType.ALLOCATE_LUMINOSITY, extra_musd=cost)
        episode.booked_fb += requested
        return {"booked_fb": _r(episode.booked_fb), "cost_musd": _r(cost)}

    def _do_set_trigger(self, params) -> Dict[str, Any]:
        episode = self._episode
        self._require_option("trigger", params.trigger, episode.scenario.triggers)
        self._charge_table(ActionType.SET_TRIGGER)
        episode.trigger = params.trigger
        factor = PILEUP_SETTINGS[episode.pileup].trigger_efficiency_factor
        return {
            "trigger": params.trigger,
            "efficiency": {ch: _r(TRIGGERS[params.trigger].get(ch, 0.0) * factor) for ch in episode.scenario.channels},
        }

    def _do_collect_collisions(self, params) -> Dict[str, Any]:
        episode = self._episode
        requested = float(params.luminosity_fb)
        if requested > episode.booked_fb + 1e-9:
            raise RuleViolation(
                Violation.NOT_ENOUGH_BOOKED, f"{episode.booked_fb:.4g} fb^-1 booked; allocate_luminosity for more"
            )
        days = requested * BEAM_ENERGIES[episode.beam_energy_tev].days_per_fb
        days /= PILEUP_SETTINGS[episode.pileup].luminosity_rate_factor
        self._charge_table(ActionType.COLLECT_COLLISIONS, extra_days=days)
        recorded = episode.recorder.collect(
            requested, episode.beam_energy_tev, episode.pileup, TRIGGERS[episode.trigger]
        )
        episode.booked_fb -= requested
        episode.luminosity_fb += requested
        episode.data_version += 1
        if any(recorded.values()):
            episode.milestones.add("collisions_collected")
        return {"luminosity_fb": _r(requested), "days": _r(days), "events_recorded": recorded}

    def _do_calibrate_detector(self, params) -> Dict[str, Any]:
        episode = self._episode
        record = episode.recorder.records[params.channel]
        if record.calibration_level >= MAX_CALIBRATION_LEVEL:
            raise RuleViolation(
                Violation.FULLY_CALIBRATED, f"{params.channel} is already at the highest calibration level"
            )
        self._charge_table(ActionType.CALIBRATE_DETECTOR)
        record.calibration_level += 1
        episode.data_version += 1
        return {
            "channel": params.channel,
            "calibration_level": record.calibration_level,
            "energy_scale_uncertainty_frac": _r(self._scale_uncertainty(params.channel)),
            "resolution_at_window_centre_gev": _r(self._resolution(params.channel)),
        }

    def _do_reconstruct_tracks(self, params) -> Dict[str, Any]:
        episode = self._episode
        quality = RECONSTRUCTIONS[params.quality]
        self._charge(quality.cost_musd, quality.days)
        record = episode.recorder.records[params.channel]
        if record.reconstruction != params.quality:
            episode.data_version += 1  # re-running the same reconstruction changes no data
        record.reconstruction = params.quality
        return {
            "channel": params.channel,
            "quality": params.quality,
            "resolution_at_window_centre_gev": _r(self._resolution(params.channel)),
        }

    def _do_select_channel(self, params) -> Dict[str, Any]:
        episode = self._episode
        self._charge_table(ActionType.SELECT_CHANNEL)
        if episode.channel != params.channel:
            episode.channel = params.channel
            episode.spectrum = episode.background_fit = None
            episode.resonance_fit = episode.scan = None
        record = episode.recorder.records[params.channel]
        return {
            "channel": params.channel,
            "luminosity_fb": _r(record.luminosity_fb),
            "recorded_events": record.recorded_events,
            "reconstructed": record.reconstruction is not None,
        }

    def _do_build_invariant_mass(self, params) -> Dict[str, Any]:
        episode = self._episode
        lo_window, hi_window = episode.scenario.search_window_gev
        lo = max(lo_window, params.mass_min_gev or lo_window)
        hi = min(hi_window, params.mass_max_gev or hi_window)
        if hi <= lo:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"the range must overlap the search window [{lo_window:g}, {hi_window:g}] GeV",
            )
        finest = float(self._record_resolution(episode.channel, lo))
        width = params.bin_width_gev or self._default_bin_width(episode.channel, lo, hi)
        if width > finest * 1.0001:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"bin_width_gev {width:.4g} is wider than the mass resolution {finest:.4g} GeV at "
                f"{lo:g} GeV: a narrow peak would be lost in one bin; choose bins ≤ {finest:.4g} GeV",
            )
        n_bins = (hi - lo) / width
        if not MIN_SPECTRUM_BINS <= n_bins <= MAX_SPECTRUM_BINS:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"{n_bins:.0f} bins; choose bin_width_gev between {(hi - lo) / MAX_SPECTRUM_BINS:.3g} "
                f"and {(hi - lo) / MIN_SPECTRUM_BINS:.3g} GeV",
            )
        self._charge_table(ActionType.BUILD_INVARIANT_MASS)
        spectrum = episode.recorder.build_spectrum(
            episode.channel, (lo, hi), width, episode.beam_energy_tev, episode.pileup
        )
        if episode.spectrum is None or episode.spectrum.fit_key != spectrum.fit_key:
            episode.data_version += 1  # the same histogram again is the same data
        episode.spectrum, episode.background_fit = spectrum, None
        episode.resonance_fit = episode.scan = None
        episode.milestones.add("spectrum_built")
        counts, edges = spectrum.counts, spectrum.edges_gev
        peak = int(np.argmax(counts / np.diff(edges)))
        return {
            "channel": episode.channel,
            "events": int(counts.sum()),
            "bins": int(counts.size),
            "range_gev": [_r(edges[0]), _r(edges[-1])],
            "bin_width_gev": _r(edges[1] - edges[0]),
            "resolution_at_window_centre_gev": _r(self._resolution(episode.channel)),
            "densest_bin_gev": _r(0.5 * (edges[peak] + edges[peak + 1])),
        }

    def _do_subtract_background(self, params) -> Dict[str, Any]:
        episode = self._episode
        spectrum = episode.spectrum
        edges, counts = spectrum.edges_gev, spectrum.counts
        centres = 0.5 * (edges[:-1] + edges[1:])
        mask = np.ones_like(counts, dtype=bool)
        region = params.signal_region_gev
        if params.method == "sideband":
            mask = (centres < region[0]) | (centres > region[1])
            if mask.sum() < 6:
                raise RuleViolation(Violation.INVALID_PARAMETERS, "the signal region leaves too few sideband bins")
        self._charge_table(ActionType.SUBTRACT_BACKGROUND)
        fit = (
            fit_background_only(edges, counts, spectrum.sqrt_s_tev, mask=mask)
            if params.method == "sideband"
            else self._background_only(spectrum)
        )
        expected = analysis.background_expectation(fit, edges, spectrum.sqrt_s_tev)
        episode.background_fit = fit
        residual = (counts - expected) / np.sqrt(np.maximum(expected, 1.0))
        worst = int(np.argmax(residual))
        result: Dict[str, Any] = {
            "method": params.method,
            "background_fit_converged": bool(fit.converged),
            "largest_excess_gev": _r(centres[worst]),
            "largest_excess_bin_pull": _r(residual[worst], 3),
        }
        if region is not None:
            inside = (centres >= region[0]) & (centres <= region[1])
            observed, background = float(counts[inside].sum()), float(expected[inside].sum())
            result.update(
                {
                    "signal_region_gev": [_r(region[0]), _r(region[1])],
                    "observed": int(observed),
                    "expected_background": _r(background),
                    "excess": _r(observed - background),
                    "excess_error": _r(np.sqrt(max(observed, 1.0))),
                }
            )
        return result

    def _do_fit_resonance(self, params) -> Dict[str, Any]:
        episode = self._episode
        spectrum = episode.spectrum
        edges = spectrum.edges_gev
        start = params.mass_hint_gev or (episode.scan.best_mass_gev if episode.scan else None)
        if start is None:
            counts = spectrum.counts
            background = (
                analysis.background_expectation(episode.background_fit, edges, spectrum.sqrt_s_tev)
                if episode.background_fit
                else np.median(counts)
            )
            centres = 0.5 * (edges[:-1] + edges[1:])
            start = float(centres[int(np.argmax(counts - background))])
        if not edges[0] < start < edges[-1]:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"mass_hint_gev must lie in the spectrum [{edges[0]:g}, {edges[-1]:g}] GeV",
            )
        self._charge_table(ActionType.FIT_RESONANCE)
        resolution = float(spectrum.resolution_gev(start))
        window_width = edges[-1] - edges[0]
        fit = fit_signal_plus_background(
            edges,
            spectrum.counts,
            spectrum.sqrt_s_tev,
            resolution,
            start,
            max_width_gev=(0.25 * window_width if params.float_width else 0.0),
            background=self._background_only(spectrum),
        )
        episode.resonance_fit = fit
        episode.analysed_luminosity_fb = max(episode.analysed_luminosity_fb, spectrum.luminosity_fb)
        episode.milestones.add("resonance_fitted")
        return {
            "channel": spectrum.channel,
            "mass_gev": _r(fit.mass_gev, 6),
            "mass_err_gev": _r(fit.mass_err_gev, 3),
            "width_gev": _r(fit.width_gev, 3),
            "width_err_gev": _r(fit.width_err_gev, 3),
            "signal_yield": _r(fit.signal_yield),
            "signal_yield_err": _r(fit.signal_yield_err, 3),
            "background_yield": _r(fit.background_yield),
            "resolution_gev": _r(resolution, 3),
            "chi2_per_ndof": _r(fit.chi2 / max(fit.ndof, 1), 3),
            "fit_p_value": _r(fit.fit_p_value, 3),
            "converged": bool(fit.converged),
        }

    def _do_scan_bump(self, params) -> Dict[str, Any]:
        episode = self._episode
        spectrum = episode.spectrum
        edges = spectrum.edges_gev
        step = params.step_gev or analysis.default_scan_step(spectrum)  # grid ≤ σ_m/2: no peak missed
        n_points = int((edges[-1] - edges[0]) / step)
        if not 5 <= n_points <= 400:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"{n_points} scan points; choose step_gev between {(edges[-1] - edges[0]) / 400:.3g} "
                f"and {(edges[-1] - edges[0]) / 5:.3g} GeV",
            )
        self._charge_table(ActionType.SCAN_BUMP)
        grid = analysis.scan_grid(edges, step)
        scan = analysis.bump_scan(spectrum, grid, self._background_only(spectrum))
        episode.scan = scan
        episode.analysed_luminosity_fb = max(episode.analysed_luminosity_fb, spectrum.luminosity_fb)
        episode.candidates_gev = [_r(m, 5) for m in scan.candidates_gev]
        return {
            "channel": spectrum.channel,
            "best_mass_gev": _r(scan.best_mass_gev, 5),
            "best_z_local": _r(scan.best_z_local, 3),
            "candidates_gev": episode.candidates_gev,
            "points": int(len(grid)),
            "upcrossings_z1": int(count_upcrossings(np.asarray(scan.z_local), 1.0)),
        }

    def _do_measure_angular(self, params) -> Dict[str, Any]:
        episode = self._episode
        spectrum = episode.spectrum
        sigma = float(spectrum.resolution_gev(params.mass_gev))
        half = params.window_sigma * sigma
        cos_counts = spectrum.cos_counts(params.mass_gev - half, params.mass_gev + half)
        if cos_counts.sum() < 5:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS,
                f"only {int(cos_counts.sum())} events within ±{params.window_sigma:g}σ of "
                f"{params.mass_gev:g} GeV; pick the candidate mass or widen window_sigma",
            )
        self._charge_table(ActionType.MEASURE_ANGULAR)
        result = spin_likelihoods(
            cos_counts,
            spectrum.channel,
            signal_fraction=self._fitted_signal_fraction(params.mass_gev, half, cos_counts.sum()),
        )
        return {
            "mass_gev": _r(params.mass_gev),
            "events": int(cos_counts.sum()),
            "allowed_spins": list(allowed_spins(spectrum.channel)),
            "relative_likelihood": {f"spin_{j}": _r(p, 3) for j, p in result.relative_likelihood.items()},
            "best_spin": int(result.best_spin),
            "separation_2dlnl": _r(result.separation, 3),
            "signal_fraction": _r(result.signal_fraction, 3),
        }

    def _do_estimate_significance(self, params) -> Dict[str, Any]:
        episode = self._episode
        spectrum = episode.spectrum
        edges = spectrum.edges_gev
        if not edges[0] < params.mass_gev < edges[-1]:
            raise RuleViolation(
                Violation.INVALID_PARAMETERS, f"mass_gev must lie in the spectrum [{edges[0]:g}, {edges[-1]:g}] GeV"
            )
        self._charge_table(ActionType.ESTIMATE_SIGNIFICANCE)
        with_systematics = spectrum.channel in episode.systematics
        result = self._significance(spectrum, params.mass_gev, with_systematics, scan=episode.scan)
        episode.analysed_luminosity_fb = max(episode.analysed_luminosity_fb, spectrum.luminosity_fb)
        episode.best_significance = max(episode.best_significance, result["z_global"] or 0.0)
        episode.milestones.add("significance_estimated")
        return result

    def _do_request_systematics(self, params) -> Dict[str, Any]:
        episode = self._episode
        self._charge_table(ActionType.REQUEST_SYSTEMATICS)
        channel = episode.spectrum.channel
        spectrum = episode.spectrum
        centre = 0.5 * (spectrum.edges_gev[0] + spectrum.edges_gev[-1])
        systematics = {
            "energy_scale_frac": _r(self._scale_uncertainty(channel)),
            "resolution_frac": 0.1,
            "luminosity_frac": LUMINOSITY_UNCERTAINTY_FRAC,
            "spurious_signal_frac_of_stat_error": analysis.SPURIOUS_SIGNAL_STAT_FRACTION,
            "mass_scale_error_at_centre_gev": _r(self._scale_uncertainty(channel) * centre, 3),
        }
        episode.systematics[channel] = systematics
        return {"channel": channel, **systematics, "note": "estimate_significance now includes systematics"}

    def _do_request_theory_review(self, params) -> Dict[str, Any]:
        episode = self._episode
        spectrum, fit = episode.spectrum, episode.resonance_fit
        self._charge_table(ActionType.REQUEST_THEORY_REVIEW)
        sigma = float(spectrum.resolution_gev(params.mass_gev))
        background = self._background_under_peak(spectrum, params.mass_gev, sigma)
        signal = max(fit.signal_yield, 0.0) * 0.95
        z_now = float(asimov_significance(signal, max(background, 1e-3))) if signal > 0 else 0.0
        lumi = spectrum.luminosity_fb
        needed = lumi * (5.0 / z_now) ** 2 if z_now > 0 else None
        narrow = fit.width_gev < 2.0 * max(fit.width_err_gev, 1e-9) or fit.width_gev < 0.5 * sigma
        return {
            "channel": spectrum.channel,
            "allowed_spins": list(allowed_spins(spectrum.channel)),
            "landau_yang": spectrum.channel == "diphoton",
            "expected_z_at_current_yield": _r(z_now, 3),
            "luminosity_for_expected_5sigma_fb": _r(needed, 3),
            "background_per_fb_under_peak": _r(background / max(lumi, 1e-12), 3),
            "width_consistent_with_resolution": bool(narrow),
        }

    def _do_submit_discovery_claim(self, claim: DiscoveryClaim) -> Dict[str, Any]:
        return self._grade(claim)

    # Physics helpers -------------------------------------------------------------------

    def _record_resolution(self, channel: str, mass_gev: float) -> float:
        """Mass resolution [GeV] of `channel` at `mass_gev` in its current detector state."""
        episode = self._episode
        record = episode.recorder.records[channel]
        return float(
            mass_resolution_gev(
                record.channel,
                mass_gev,
                record.calibration_level,
                record.reconstruction or "standard",
                episode.pileup or "nominal",
            )
        )

    def _default_bin_width(self, channel: str, lo_gev: float, hi_gev: float) -> float:
        """Half the resolution at the window centre, with 20 to 100 bins, never wider than the
        resolution at the low edge (so a narrow peak spans several bins)."""
        finest = self._record_resolution(channel, lo_gev)
        span = hi_gev - lo_gev
        return min(finest, span / 20, max(0.5 * self._resolution(channel), span / 100))

    def _resolution(self, channel: str) -> float:
        lo, hi = self._episode.scenario.search_window_gev
        return self._record_resolution(channel, 0.5 * (lo + hi))

    def _fitted_signal_fraction(self, mass_gev: float, half_width_gev: float, events: float) -> Optional[float]:
        """Signal fraction in [m − half, m + half] from the resonance fit, when one was made near
        `mass_gev`; None lets the spin fit profile it (less powerful: spin 0 + background can
        mimic spin 1)."""
        fit = self._episode.resonance_fit
        if fit is None or abs(fit.mass_gev - mass_gev) > half_width_gev or events <= 0:
            return None
        sigma = float(self._episode.spectrum.resolution_gev(fit.mass_gev))
        edges = np.linspace(mass_gev - half_width_gev, mass_gev + half_width_gev, 41)
        inside = float(signal_bin_fractions(edges, fit.mass_gev, fit.width_gev, sigma).sum())
        return float(np.clip(max(fit.signal_yield, 0.0) * inside / events, 0.0, 1.0))

    def _scale_uncertainty(self, channel: str) -> float:
        """Residual energy-scale uncertainty (1σ of the uniform bias range) after calibration."""
        record = self._episode.recorder.records[channel]
        bias_factor = CALIBRATION_BIAS_FACTOR[record.calibration_level]
        return record.channel.energy_scale_bias_max_frac * bias_factor / np.sqrt(3)

    def _cached_fit(self, key: tuple, fit: Callable[[], Any]) -> Any:
        """`fit()`, made once per episode for each `key` (fits are deterministic functions of their
        inputs, which the key holds, so a repeat, e.g. the grader's reference spectrum when it is
        the agent's own, reuses the result)."""
        fits = self._episode.fits
        if key not in fits:
            fits[key] = fit()
        return fits[key]

    def _background_only(self, spectrum: Spectrum):
        """The background-only fit of `spectrum`, fitted once and reused by every action."""
        return self._cached_fit(("background_only", spectrum.fit_key), lambda: analysis.background_fit(spectrum))

    def _background_under_peak(self, spectrum: Spectrum, mass_gev: float, sigma_gev: float, background=None) -> float:
        return analysis.background_under_peak(
            spectrum, mass_gev, sigma_gev, background or self._background_only(spectrum)
        )

    def _significance(
        self, spectrum: Spectrum, mass_gev: float, with_systematics: bool, scan: Optional[Any]
    ) -> Dict[str, Any]:
        """`cernenv.analysis.significance` at `mass_gev`, with the episode's cached fits; `scan`: a
        bump scan of this spectrum (its upcrossings), or None (the analytic count)."""
        background = self._background_only(spectrum)
        spurious = analysis.spurious_signal_events(spectrum, mass_gev, background) if with_systematics else 0.0
        local = self._cached_fit(
            ("local_significance", spectrum.fit_key, float(mass_gev), float(spurious)),
            lambda: analysis.local_significance(spectrum, mass_gev, spurious, background),
        )
        result = analysis.significance(spectrum, mass_gev, with_systematics, scan, background, local)
        return {
            "mass_gev": _r(mass_gev),
            "q0": _r(result["q0"], 4),
            "z_local": _r(result["z_local"], 3),
            "p_local": _r(result["p_local"], 3),
            "local_p_method": result["local_p_method"],
            "z_global": _r(result["z_global"], 3),
            "p_global": _r(result["p_global"], 3),
            "trials_factor": _r(result["trials_factor"], 3),
            "upcrossings_source": result["upcrossings_source"],
            "systematics_included": bool(with_systematics),
        }

    def _grade(self, claim: Optional[DiscoveryClaim]) -> Dict[str, Any]:
        """Grade the claim (None: the episode ended without one) and end the episode. Returns
        what the claim's step reports: the components, or only that the claim was recorded
        when grades are withheld."""
        episode = self._episode
        z_global = 0.0
        if claim is not None and claim.discovered and claim.channel in episode.recorder.records:
            record = episode.recorder.records[claim.channel]
            lo, hi = episode.scenario.search_window_gev
            if record.luminosity_fb > 0 and lo < claim.mass_gev < hi:
                reference = episode.recorder.build_spectrum(
                    claim.channel,
                    (lo, hi),
                    self._default_bin_width(claim.channel, lo, hi),
                    episode.beam_energy_tev,
                    episode.pileup,
                )
                z_global = self._significance(reference, claim.mass_gev, False, None)["z_global"] or 0.0
        grade = grade_claim(
            claim,
            episode.scenario.hidden_truth(),
            reference_z_global=z_global,
            luminosity_analysed_fraction=episode.analysed_luminosity_fb / episode.scenario.luminosity_fb,
            budget_left_fraction=1.0 - episode.budget_used_musd / episode.scenario.budget_musd,
        )
        episode.done = True
        episode.terminal_components = dict(grade.components)
        episode.grade = {
            "terminal_reward": float(sum(grade.components.values())),
            "components": dict(grade.components),
            "discovered": grade.discovered,
            "correct_outcome": grade.correct_outcome,
            "correct_mass": grade.correct_mass,
            "correct_channel": grade.correct_channel,
            "correct_spin": grade.correct_spin,
            "reference_z_global": _r(z_global, 3),
        }
        if self._withhold_grades:
            return {"claim_recorded": claim is not None, "grade": "withheld until the evaluation ends"}
        state = self._state
        state.terminal_reward = episode.grade["terminal_reward"]
        state.discovered = grade.discovered
        state.correct_outcome = grade.correct_outcome
        state.correct_mass, state.correct_channel, state.correct_spin = (
            grade.correct_mass,
            grade.correct_channel,
            grade.correct_spin,
        )
        return {
            "graded": True,
            "reference_z_global": episode.grade["reference_z_global"],
            **{k: _r(v, 3) for k, v in grade.components.items()},
        }

    # Observation -----------------------------------------------------------------------

    def _observation(self, reward: float, breakdown: Dict[str, float], violations: List[str]) -> CollisionObservation:
        episode = self._episode
        scenario = episode.scenario
        if breakdown:
            self._state.cumulative_reward += reward
            for name, value in breakdown.items():
                self._state.reward_components[name] = self._state.reward_components.get(name, 0.0) + value
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
            max_steps=self.max_steps,
        )
        usage = ResourceUsage(
            budget_used_musd=_r(episode.budget_used_musd, 6),
            budget_remaining_musd=_r(scenario.budget_musd - episode.budget_used_musd, 6),
            luminosity_used_fb=_r(episode.luminosity_fb, 6),
            luminosity_remaining_fb=_r(scenario.luminosity_fb - episode.luminosity_fb, 6),
            luminosity_allocated_fb=_r(episode.booked_fb, 6),
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
        return CollisionObservation(
            task=task,
            step_index=self._state.step_count,
            resource_usage=usage,
            selected_beam_energy_tev=episode.beam_energy_tev,
            selected_pileup=episode.pileup,
            selected_trigger=episode.trigger,
            selected_channel=episode.channel,
            data_collected=data,
            latest_result=dict(episode.latest_result),
            candidate_masses_gev=list(episode.candidates_gev),
            logbook={key: dict(entry) for key, entry in episode.logbook.items()},
            cumulative_significance=_r(episode.best_significance, 3) or 0.0,
            pipeline_history=episode.history[-HISTORY_LENGTH:],
            rule_violations=violations,
            reward_breakdown=dict(breakdown),
            done=episode.done,
            reward=float(reward),
        )


def _check_salt(secret_salt: Optional[str]) -> Optional[str]:
    """`secret_salt` if it is None or a non-empty string; else a ValueError that says what to pass."""
    if secret_salt is None:
        return None
    if not isinstance(secret_salt, str) or not secret_salt:
        raise ValueError(
            "secret_salt must be a non-empty string (or None for no evaluation secret), "
            f"got {type(secret_salt).__name__}"
        )
    return secret_salt


def field_table(model) -> str:
    rows = ["| field | type | description |", "|---|---|---|"]
    for name, info in model.model_fields.items():
        if name == "metadata":
            continue
        rows.append(
            f"| `{name}` | {markdown_cell(type_label(info.annotation))} | {markdown_cell(info.description or '')} |"
        )
    return "\n".join(rows)


CERNCollisionEnvironment.__doc__ = f"""A simulated LHC discovery campaign, as an OpenEnv environment.

## Description
The agent runs a resonance search: it configures the beam, books and collects
luminosity, chooses a trigger and a decay channel, calibrates and reconstructs,
builds an invariant-mass spectrum, fits it (extended binned maximum likelihood),
scans for bumps, measures the decay-angle distribution, estimates the
profile-likelihood significance with the look-elsewhere effect, and finally
submits a discovery claim. The claim is graded against a hidden particle, or
against "nothing there" in null scenarios.

## Action Space
`ExperimentAction(action_type, parameters, justification)`; the parameters of each
verb are validated against its model in `cernenv.actions.ACTION_TABLE`:

{render_action_table_markdown()}

## Observation Space
`CollisionObservation`:

{field_table(CollisionObservation)}

`task` (`TaskInfo`) states the problem without the answer:

{field_table(TaskInfo)}

## Rewards
{render_reward_table_markdown()}

## Starting State
`reset(seed, scenario=None, difficulty=None)` picks a curated scenario by name
(`cernenv.scenarios.list_scenarios()`), else a procedural one of the difficulty
(`easy|medium|hard`, drawn from the seed when not given). Nothing is configured,
no data are recorded, the full budget, luminosity and time are available.

## Episode End
The episode ends on `submit_discovery_claim`, when the budget or the time is
exhausted, after `max_steps` steps, or after {MAX_CONSECUTIVE_REFUSALS} refused actions in a row
(hard violations); all but the first are graded as "no claim".
Stepping after the end returns an observation with an `EPISODE_DONE` violation.

## Example
>>> from cernenv import CERNCollisionEnvironment, ExperimentAction
>>> env = CERNCollisionEnvironment()
>>> obs = env.reset(seed=7, scenario="higgs_diphoton_125")
>>> obs = env.step(ExperimentAction(action_type="configure_beam", parameters={{"beam_energy_tev": 13.6}}))
>>> obs.selected_beam_energy_tev
13.6
"""
