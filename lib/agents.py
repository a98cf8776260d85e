"""Agents that play CERNenv: baselines (random, heuristic physicist, oracle).

Every agent follows one protocol: `reset()` at the start of an episode, then
`act(observation) -> ExperimentAction` each step.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol

import numpy as np

from cernenv.detector import BEAM_ENERGIES, TRIGGERS
from cernenv.models import ActionType, CollisionObservation, ExperimentAction


class Agent(Protocol):
    def reset(self) -> None: ...

    def act(self, observation: CollisionObservation) -> ExperimentAction: ...


def _action(action_type: ActionType, justification: str = "", **parameters: Any) -> ExperimentAction:
    return ExperimentAction(action_type=action_type, parameters=parameters, justification=justification)


def best_trigger(channel: str, available: List[str]) -> str:
    """The trigger with the highest efficiency for `channel` (a physicist knows the trigger menu)."""
    return max(available, key=lambda t: TRIGGERS.get(t, {}).get(channel, 0.0))


class RandomAgent:
    """Uniformly random verbs with random (but well-formed) parameters drawn from the task's options."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._episodes = 0
        self.rng = np.random.default_rng(seed)

    def reset(self) -> None:
        self._episodes += 1
        self.rng = np.random.default_rng([self._seed, self._episodes])

    def act(self, observation: CollisionObservation) -> ExperimentAction:
        rng, task = self.rng, observation.task
        lo, hi = task.search_window_gev
        mass = float(rng.uniform(lo, hi))
        channel = str(rng.choice(task.available_channels))
        action_type = ActionType(rng.choice([a.value for a in ActionType]))
        parameters: Dict[str, Any] = {
            ActionType.CONFIGURE_BEAM: lambda: {"beam_energy_tev": float(rng.choice(task.available_beam_energies_tev)),
                                                "pileup": str(rng.choice(["low", "nominal", "high"]))},
            ActionType.ALLOCATE_LUMINOSITY: lambda: {"luminosity_fb": float(task.luminosity_total_fb * rng.uniform(0.05, 0.5))},
            ActionType.SET_TRIGGER: lambda: {"trigger": str(rng.choice(task.available_triggers))},
            ActionType.COLLECT_COLLISIONS: lambda: {"luminosity_fb": float(task.luminosity_total_fb * rng.uniform(0.05, 0.5))},
            ActionType.CALIBRATE_DETECTOR: lambda: {"channel": channel},
            ActionType.RECONSTRUCT_TRACKS: lambda: {"channel": channel,
                                                    "quality": str(rng.choice(["fast", "standard", "tight"]))},
            ActionType.SELECT_CHANNEL: lambda: {"channel": channel},
            ActionType.BUILD_INVARIANT_MASS: lambda: {},
            ActionType.SUBTRACT_BACKGROUND: lambda: {"method": "fit"},
            ActionType.FIT_RESONANCE: lambda: {"mass_hint_gev": mass},
            ActionType.SCAN_BUMP: lambda: {},
            ActionType.MEASURE_ANGULAR: lambda: {"mass_gev": mass},
            ActionType.ESTIMATE_SIGNIFICANCE: lambda: {"mass_gev": mass},
            ActionType.REQUEST_SYSTEMATICS: lambda: {},
            ActionType.REQUEST_THEORY_REVIEW: lambda: {"mass_gev": mass},
            ActionType.SUBMIT_DISCOVERY_CLAIM: lambda: {
                "discovered": bool(rng.random() < 0.5), "mass_gev": mass,
                "mass_uncertainty_gev": float(0.01 * mass), "channel": channel, "spin": int(rng.integers(0, 3)),
                "significance_sigma": float(rng.uniform(0, 8)), "confidence": float(rng.random())},
        }[action_type]()
        return _action(action_type, "random", **parameters)


class HeuristicAgent:
    """A scripted physicist that reads only its observations.

    Plan: highest beam energy at nominal pileup; the best trigger for the first listed
    channel; take a first luminosity block, calibrate twice, reconstruct tight, build the
    spectrum, scan, fit the best candidate, evaluate systematics and the significance;
    take the rest of the luminosity if the evidence is short of 5σ; measure the spin;
    claim a discovery when the global significance (with systematics) reaches
    `discovery_z_global`, else claim that nothing is there.
    """

    def __init__(self, discovery_z_global: float = 3.0, first_block_fraction: float = 0.4) -> None:
        self.discovery_z_global = discovery_z_global
        self.first_block_fraction = first_block_fraction
        self.reset()

    def reset(self) -> None:
        self.queue: List[ExperimentAction] = []
        self.phase = "start"
        self.channel: Optional[str] = None
        self.fit: Dict[str, Any] = {}
        self.significance: Dict[str, Any] = {}
        self.systematics: Dict[str, Any] = {}
        self.spin: Optional[int] = None
        self.took_second_block = False
        self.asked_systematics = False

    # Planning helpers ---------------------------------------------------------------

    @staticmethod
    def _affordable_luminosity(obs: CollisionObservation, fraction: float) -> float:
        """fb^-1 that can be booked and collected, keeping a reserve for the analysis steps."""
        usage, task = obs.resource_usage, obs.task
        reserve_musd = min(25.0, 0.2 * task.budget_total_musd)
        reserve_days = min(40.0, 0.2 * task.time_total_days)
        beam = BEAM_ENERGIES[obs.selected_beam_energy]
        rate = {"low": 0.5, "nominal": 1.0, "high": 1.8}[obs.selected_pileup or "nominal"]
        by_budget = (usage.budget_remaining_musd - reserve_musd) / beam.cost_musd_per_fb
        by_time = (usage.time_remaining_days - reserve_days) / (beam.days_per_fb / rate)
        by_cap = usage.luminosity_remaining_fb - usage.luminosity_allocated_fb
        return float(max(0.0, min(by_budget, by_time, by_cap * fraction)))

    def _analysis(self) -> List[ExperimentAction]:
        return [_action(ActionType.BUILD_INVARIANT_MASS, "histogram the selected channel"),
                _action(ActionType.SCAN_BUMP, "look for local excesses over the window")]

    # Protocol -----------------------------------------------------------------------

    def act(self, obs: CollisionObservation) -> ExperimentAction:
        result = obs.latest_result
        action = result.get("action")
        if "error" not in result:
            if action == ActionType.FIT_RESONANCE.value:
                self.fit = dict(result)
            elif action == ActionType.ESTIMATE_SIGNIFICANCE.value:
                self.significance = dict(result)
            elif action == ActionType.REQUEST_SYSTEMATICS.value:
                self.systematics = dict(result)
            elif action == ActionType.MEASURE_ANGULAR.value:
                self.spin = result.get("best_spin")
        if self.queue:
            return self.queue.pop(0)
        return self._next(obs)

    def _next(self, obs: CollisionObservation) -> ExperimentAction:
        task = obs.task
        if self.phase == "start":
            self.channel = task.available_channels[0]
            self.phase = "first_block"
            self.queue = [_action(ActionType.SET_TRIGGER, "record the analysis channel",
                                  trigger=best_trigger(self.channel, task.available_triggers))]
            return _action(ActionType.CONFIGURE_BEAM, "highest energy maximises the signal cross-section",
                           beam_energy_tev=max(task.available_beam_energies_tev), pileup="nominal")
        if self.phase == "first_block":
            block = self._affordable_luminosity(obs, self.first_block_fraction)
            self.phase = "fit"
            self.queue = [
                _action(ActionType.COLLECT_COLLISIONS, "take the first block", luminosity_fb=block),
                _action(ActionType.CALIBRATE_DETECTOR, "fix the energy scale", channel=self.channel),
                _action(ActionType.CALIBRATE_DETECTOR, "refine the energy scale", channel=self.channel),
                _action(ActionType.RECONSTRUCT_TRACKS, "tight selection for purity", channel=self.channel,
                        quality="tight"),
                _action(ActionType.SELECT_CHANNEL, "analyse the channel", channel=self.channel),
                *self._analysis(),
            ]
            return _action(ActionType.ALLOCATE_LUMINOSITY, "book a first block", luminosity_fb=block)
        if self.phase == "fit":
            mass = obs.candidate_masses_gev[0] if obs.candidate_masses_gev else None
            if mass is None:
                lo, hi = task.search_window_gev
                mass = obs.latest_result.get("best_mass_gev") or 0.5 * (lo + hi)
            self.fit = {}
            self.phase = "significance"
            return _action(ActionType.FIT_RESONANCE, "fit the strongest candidate", mass_hint_gev=mass)
        if self.phase == "significance":
            if not self.asked_systematics:
                self.asked_systematics = True
                return _action(ActionType.REQUEST_SYSTEMATICS, "include systematic uncertainties")
            self.phase = "decide"
            mass = self.fit.get("mass_gev") or obs.latest_result.get("mass_gev")
            lo, hi = task.search_window_gev
            if not mass or not lo < mass < hi:
                mass = 0.5 * (lo + hi)
            return _action(ActionType.ESTIMATE_SIGNIFICANCE, "how significant is it?", mass_gev=mass)
        if self.phase == "decide":
            z_global = self.significance.get("z_global") or 0.0
            block = self._affordable_luminosity(obs, 1.0)
            if (z_global < 5.0 and not self.took_second_block
                    and block > 0.05 * obs.resource_usage.luminosity_used_fb):
                self.took_second_block = True
                self.phase = "fit"
                self.queue = [_action(ActionType.COLLECT_COLLISIONS, "more data", luminosity_fb=block),
                              *self._analysis()]
                return _action(ActionType.ALLOCATE_LUMINOSITY, "evidence short of 5σ: book the rest",
                               luminosity_fb=block)
            self.phase = "claim"
            z_local = self.significance.get("z_local") or 0.0
            if z_local >= 3.0 and self.fit.get("mass_gev"):
                return _action(ActionType.MEASURE_ANGULAR, "which spin?", mass_gev=self.fit["mass_gev"])
        return self._claim(obs)

    def _claim(self, obs: CollisionObservation) -> ExperimentAction:
        z_global = float(self.significance.get("z_global") or 0.0)
        mass = self.fit.get("mass_gev")
        if z_global >= self.discovery_z_global and mass:
            stat = float(self.fit.get("mass_err_gev") or 0.01 * mass)
            scale = float(self.systematics.get("energy_scale_frac") or 0.0) * mass
            confidence = float(np.clip(0.5 + 0.45 * np.tanh((z_global - 2.5) / 1.5), 0.05, 0.97))
            return _action(ActionType.SUBMIT_DISCOVERY_CLAIM, "significant, consistent excess", discovered=True,
                           mass_gev=mass, mass_uncertainty_gev=float(np.hypot(stat, scale)), channel=self.channel,
                           spin=self.spin, significance_sigma=z_global, confidence=confidence)
        confidence = float(np.clip(0.9 - 0.15 * z_global, 0.5, 0.9))
        return _action(ActionType.SUBMIT_DISCOVERY_CLAIM, "no significant excess", discovered=False,
                       significance_sigma=0.0, confidence=confidence)


class OracleAgent:
    """An upper bound: reads the hidden truth (given to its constructor or `reset`) and runs
    the ideal analysis of the true channel, claiming the true mass and spin."""

    def __init__(self, truth: Optional[Dict[str, Any]] = None) -> None:
        self.truth = truth
        self._heuristic = HeuristicAgent(discovery_z_global=-1.0, first_block_fraction=1.0)

    def reset(self, truth: Optional[Dict[str, Any]] = None) -> None:
        if truth is not None:
            self.truth = truth
        self._heuristic.reset()
        self._claimed = False

    def act(self, obs: CollisionObservation) -> ExperimentAction:
        if self.truth is None:
            raise ValueError("OracleAgent needs the hidden truth: OracleAgent(env.hidden_truth()) or reset(truth=...)")
        heuristic = self._heuristic
        if heuristic.phase == "start" and self.truth["exists"]:
            # Analyse the channel with the best signal, not the first listed one.
            channels = [c for c in obs.task.available_channels if c in self.truth["channels"]]
            heuristic.phase, heuristic.channel = "first_block", channels[0]
            heuristic.queue = [_action(ActionType.SET_TRIGGER, "oracle", trigger=best_trigger(
                heuristic.channel, obs.task.available_triggers))]
            return _action(ActionType.CONFIGURE_BEAM, "oracle", beam_energy_tev=max(obs.task.available_beam_energies_tev))
        action = heuristic.act(obs)
        if action.action_type is ActionType.MEASURE_ANGULAR or action.action_type is ActionType.SUBMIT_DISCOVERY_CLAIM:
            truth = self.truth
            if not truth["exists"]:
                return _action(ActionType.SUBMIT_DISCOVERY_CLAIM, "oracle: nothing there", discovered=False,
                               confidence=1.0)
            stat = float(heuristic.fit.get("mass_err_gev") or 0.001 * truth["mass_gev"])
            return _action(ActionType.SUBMIT_DISCOVERY_CLAIM, "oracle", discovered=True, mass_gev=truth["mass_gev"],
                           mass_uncertainty_gev=stat, channel=heuristic.channel, spin=truth["spin"],
                           significance_sigma=float(heuristic.significance.get("z_global") or 0.0), confidence=1.0)
        return action
