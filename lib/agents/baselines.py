"""Scripted agents that play CERNenv: random, a heuristic physicist, an oracle.

Every agent follows one protocol (`Agent`): `reset()` at the start of an episode, then
`act(observation)` each step, which returns what is sent to `env.step`: an
`ExperimentAction` (from `lib.agents.prompting.LLMAgent`, whatever of its reply it could not parse).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Tuple

import numpy as np

from cernenv.detector import BEAM_ENERGIES, PILEUP_SETTINGS, RECONSTRUCTIONS, TRIGGERS
from cernenv.models import ActionType, CollisionObservation, ExperimentAction


class Agent(Protocol):
    def reset(self) -> None: ...

    def act(self, observation: CollisionObservation) -> Any: ...


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

        def random_luminosity() -> float:
            return float(task.luminosity_total_fb * rng.uniform(0.05, 0.5))

        parameters: Dict[str, Any] = {
            ActionType.CONFIGURE_BEAM: lambda: {
                "beam_energy_tev": float(rng.choice(task.available_beam_energies_tev)),
                "pileup": str(rng.choice(list(PILEUP_SETTINGS))),
            },
            ActionType.ALLOCATE_LUMINOSITY: lambda: {"luminosity_fb": random_luminosity()},
            ActionType.SET_TRIGGER: lambda: {"trigger": str(rng.choice(task.available_triggers))},
            ActionType.COLLECT_COLLISIONS: lambda: {"luminosity_fb": random_luminosity()},
            ActionType.CALIBRATE_DETECTOR: lambda: {"channel": channel},
            ActionType.RECONSTRUCT_TRACKS: lambda: {
                "channel": channel,
                "quality": str(rng.choice(list(RECONSTRUCTIONS))),
            },
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
                "discovered": bool(rng.random() < 0.5),
                "mass_gev": mass,
                "mass_uncertainty_gev": float(0.01 * mass),
                "channel": channel,
                "spin": int(rng.integers(0, 3)),
                "significance_sigma": float(rng.uniform(0, 8)),
                "confidence": float(rng.random()),
            },
        }[action_type]()
        return _action(action_type, "random", **parameters)


class HeuristicAgent:
    """A scripted physicist that reads only its observations.

    Plan: highest beam energy at nominal pileup. A first luminosity block surveys every
    offered channel (one trigger when it records them all, else the block is split between
    each channel's best trigger): reconstruct tight, build and scan each channel. The
    channel with the strongest local excess is analysed: calibrate twice, rebuild, fit the
    excess, evaluate systematics and the significance. If the evidence is short of 5σ, take
    the rest of the luminosity in that channel and refit. Measure the spin; claim a
    discovery when the global significance (with systematics) reaches `discovery_z_global`,
    else claim that nothing is there. At most 29 steps.
    """

    def __init__(self, discovery_z_global: float = 3.0, first_block_fraction: float = 0.4) -> None:
        self.discovery_z_global = discovery_z_global
        self.first_block_fraction = first_block_fraction
        self.reset()

    def reset(self) -> None:
        self.queue: List[ExperimentAction] = []
        self.phase = "start"
        self.channel: Optional[str] = None
        self.survey_channels: Optional[List[str]] = None  # None: every offered channel
        self.trigger: Optional[str] = None
        self.selected: Optional[str] = None
        self.survey: Dict[str, Tuple[float, Optional[float]]] = {}  # channel -> (best local Z, its mass)
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
        beam = BEAM_ENERGIES[obs.selected_beam_energy_tev]
        rate = PILEUP_SETTINGS[obs.selected_pileup or "nominal"].luminosity_rate_factor
        by_budget = (usage.budget_remaining_musd - reserve_musd) / beam.cost_musd_per_fb
        by_time = (usage.time_remaining_days - reserve_days) / (beam.days_per_fb / rate)
        by_cap = usage.luminosity_remaining_fb - usage.luminosity_allocated_fb
        return float(max(0.0, min(by_budget, by_time, by_cap * fraction)))

    @staticmethod
    def _records(trigger: Optional[str], channel: str) -> float:
        return TRIGGERS.get(trigger, {}).get(channel, 0.0)

    def _triggers_for(self, channels: List[str], available: List[str]) -> List[str]:
        """One trigger if the first channel's best records every channel at half its own best
        efficiency or more, else each channel's best trigger (in channel order, no repeats)."""
        first = best_trigger(channels[0], available)
        if all(self._records(first, ch) >= 0.5 * self._records(best_trigger(ch, available), ch) for ch in channels):
            return [first]
        return list(dict.fromkeys(best_trigger(ch, available) for ch in channels))

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
            elif action == ActionType.SELECT_CHANNEL.value:
                self.selected = result.get("channel")
            elif action == ActionType.SCAN_BUMP.value and self.phase == "choose" and self.selected:
                self.survey[self.selected] = (float(result.get("best_z_local") or 0.0), result.get("best_mass_gev"))
        if self.queue:
            return self.queue.pop(0)
        return self._next(obs)

    def _next(self, obs: CollisionObservation) -> ExperimentAction:
        task = obs.task
        channels = self.survey_channels or list(task.available_channels)
        if self.phase == "start":
            triggers = self._triggers_for(channels, list(task.available_triggers))
            self.trigger = triggers[0]
            self.phase = "first_block"
            self.queue = [_action(ActionType.SET_TRIGGER, "record the channels to survey", trigger=self.trigger)]
            return _action(
                ActionType.CONFIGURE_BEAM,
                "highest energy maximises the signal cross-section",
                beam_energy_tev=max(task.available_beam_energies_tev),
                pileup="nominal",
            )
        if self.phase == "first_block":
            block = self._affordable_luminosity(obs, self.first_block_fraction)
            triggers = self._triggers_for(channels, list(task.available_triggers))
            share = block / len(triggers)
            self.queue = [_action(ActionType.COLLECT_COLLISIONS, "survey block", luminosity_fb=share)]
            for trigger in triggers[1:]:
                self.trigger = trigger
                self.queue += [
                    _action(ActionType.SET_TRIGGER, "record the next channel", trigger=trigger),
                    _action(ActionType.COLLECT_COLLISIONS, "survey block", luminosity_fb=share),
                ]
            for channel in channels:
                self.queue += [
                    _action(
                        ActionType.RECONSTRUCT_TRACKS, "tight selection for purity", channel=channel, quality="tight"
                    ),
                    _action(ActionType.SELECT_CHANNEL, "survey the channel", channel=channel),
                    _action(ActionType.BUILD_INVARIANT_MASS, "histogram the channel"),
                    _action(ActionType.SCAN_BUMP, "look for local excesses over the window"),
                ]
            self.phase = "choose"
            return _action(ActionType.ALLOCATE_LUMINOSITY, "book a first block", luminosity_fb=block)
        if self.phase == "choose":
            self.channel = max(channels, key=lambda c: self.survey.get(c, (0.0, None))[0])
            lo, hi = task.search_window_gev
            mass = self.survey.get(self.channel, (0.0, None))[1] or 0.5 * (lo + hi)
            self.phase = "significance"
            self.queue = [_action(ActionType.CALIBRATE_DETECTOR, "refine the energy scale", channel=self.channel)]
            if self.selected != self.channel:
                self.queue.append(
                    _action(ActionType.SELECT_CHANNEL, "analyse the strongest excess", channel=self.channel)
                )
            self.queue += [
                _action(ActionType.BUILD_INVARIANT_MASS, "histogram the calibrated channel"),
                _action(ActionType.FIT_RESONANCE, "fit the strongest candidate", mass_hint_gev=mass),
            ]
            return _action(ActionType.CALIBRATE_DETECTOR, "fix the energy scale", channel=self.channel)
        if self.phase == "significance":
            if not self.asked_systematics:
                self.asked_systematics = True
                return _action(ActionType.REQUEST_SYSTEMATICS, "include systematic uncertainties")
            self.phase = "decide"
            return _action(ActionType.ESTIMATE_SIGNIFICANCE, "how significant is it?", mass_gev=self._mass(task))
        if self.phase == "decide":
            z_global = self.significance.get("z_global") or 0.0
            block = self._affordable_luminosity(obs, 1.0)
            if z_global < 5.0 and not self.took_second_block and block > 0.05 * obs.resource_usage.luminosity_used_fb:
                self.took_second_block = True
                self.phase = "significance"
                self.queue = [
                    _action(ActionType.ALLOCATE_LUMINOSITY, "evidence short of 5σ: book the rest", luminosity_fb=block),
                    _action(ActionType.COLLECT_COLLISIONS, "more data", luminosity_fb=block),
                    _action(ActionType.BUILD_INVARIANT_MASS, "histogram all the data"),
                    _action(ActionType.FIT_RESONANCE, "refit the candidate", mass_hint_gev=self._mass(task)),
                ]
                best = best_trigger(self.channel, task.available_triggers)
                if self._records(self.trigger, self.channel) < self._records(best, self.channel):
                    self.trigger = best
                    return _action(ActionType.SET_TRIGGER, "record the analysed channel", trigger=best)
                return self.queue.pop(0)
            self.phase = "claim"
            z_local = self.significance.get("z_local") or 0.0
            if z_local >= 3.0 and self.fit.get("mass_gev"):
                return _action(ActionType.MEASURE_ANGULAR, "which spin?", mass_gev=self.fit["mass_gev"])
        return self._claim(obs)

    def _mass(self, task) -> float:
        """The fitted mass, or the window centre when there is none inside the window."""
        mass = self.fit.get("mass_gev")
        lo, hi = task.search_window_gev
        return float(mass) if mass and lo < mass < hi else 0.5 * (lo + hi)

    def _claim(self, obs: CollisionObservation) -> ExperimentAction:
        z_global = float(self.significance.get("z_global") or 0.0)
        mass = self.fit.get("mass_gev")
        if z_global >= self.discovery_z_global and mass:
            stat = float(self.fit.get("mass_err_gev") or 0.01 * mass)
            scale = float(self.systematics.get("energy_scale_frac") or 0.0) * mass
            confidence = float(np.clip(0.5 + 0.45 * np.tanh((z_global - 2.5) / 1.5), 0.05, 0.97))
            return _action(
                ActionType.SUBMIT_DISCOVERY_CLAIM,
                "significant, consistent excess",
                discovered=True,
                mass_gev=mass,
                mass_uncertainty_gev=float(np.hypot(stat, scale)),
                channel=self.channel,
                spin=self.spin,
                significance_sigma=z_global,
                confidence=confidence,
            )
        confidence = float(np.clip(0.9 - 0.15 * z_global, 0.5, 0.9))
        return _action(
            ActionType.SUBMIT_DISCOVERY_CLAIM,
            "no significant excess",
            discovered=False,
            significance_sigma=0.0,
            confidence=confidence,
        )


class AlwaysNullAgent:
    """The trivial policy a reward must not favour: take just enough data for a null claim to be
    graded (`luminosity_fraction` of the cap, in the first offered channel), scan it once, and
    claim that nothing is there with the confidence the prior gives a null."""

    def __init__(self, luminosity_fraction: float = 0.26, confidence: float = 0.3) -> None:
        self.luminosity_fraction = luminosity_fraction
        self.confidence = confidence
        self.reset()

    def reset(self) -> None:
        self.queue: List[ExperimentAction] = []

    def act(self, obs: CollisionObservation) -> ExperimentAction:
        if obs.step_index == 0:
            task = obs.task
            channel = task.available_channels[0]
            luminosity = self.luminosity_fraction * task.luminosity_total_fb
            self.queue = [
                _action(ActionType.SET_TRIGGER, trigger=best_trigger(channel, task.available_triggers)),
                _action(ActionType.ALLOCATE_LUMINOSITY, luminosity_fb=luminosity),
                _action(ActionType.COLLECT_COLLISIONS, luminosity_fb=luminosity),
                _action(ActionType.RECONSTRUCT_TRACKS, channel=channel, quality="standard"),
                _action(ActionType.SELECT_CHANNEL, channel=channel),
                _action(ActionType.BUILD_INVARIANT_MASS),
                _action(ActionType.SCAN_BUMP),
            ]
            return _action(ActionType.CONFIGURE_BEAM, beam_energy_tev=max(task.available_beam_energies_tev))
        if self.queue:
            return self.queue.pop(0)
        return _action(ActionType.SUBMIT_DISCOVERY_CLAIM, "nothing there", discovered=False, confidence=self.confidence)


class OracleAgent:
    """An upper bound: reads the hidden truth and runs the ideal analysis of the true channel,
    claiming the true mass and spin. It gets the truth only by the evaluator's explicit word:
    `observe_truth`, which the harness calls where the evaluator passes `reveal_truth`
    (`lib.episodes.agent_rollouts.transitions`, `lib.measure.evaluation.evaluate_agents(..., reveal_truth_to=...)`),
    or `OracleAgent(truth)` for a single episode."""

    def __init__(self, truth: Optional[Dict[str, Any]] = None) -> None:
        self.truth = truth
        self._heuristic = HeuristicAgent(discovery_z_global=-1.0)

    def observe_truth(self, truth: Dict[str, Any]) -> None:
        """The hidden truth of the episode that has just been reset."""
        self.truth = truth

    def reset(self) -> None:
        self._heuristic.reset()

    def act(self, obs: CollisionObservation) -> ExperimentAction:
        if self.truth is None:
            raise ValueError(
                "OracleAgent needs the hidden truth: OracleAgent(env.hidden_truth()), or play it with "
                "reveal_truth=True (lib.episodes.agent_rollouts) / "
                "reveal_truth_to=('oracle',) (lib.measure.evaluation.evaluate_agents)"
            )
        heuristic = self._heuristic
        if heuristic.phase == "start" and self.truth["exists"]:
            # Analyse only a channel the particle decays to: no survey needed.
            heuristic.survey_channels = [c for c in obs.task.available_channels if c in self.truth["channels"]][:1]
        action = heuristic.act(obs)
        if action.action_type is ActionType.MEASURE_ANGULAR or action.action_type is ActionType.SUBMIT_DISCOVERY_CLAIM:
            truth = self.truth
            if not truth["exists"]:
                return _action(
                    ActionType.SUBMIT_DISCOVERY_CLAIM, "oracle: nothing there", discovered=False, confidence=1.0
                )
            stat = float(heuristic.fit.get("mass_err_gev") or 0.001 * truth["mass_gev"])
            return _action(
                ActionType.SUBMIT_DISCOVERY_CLAIM,
                "oracle",
                discovered=True,
                mass_gev=truth["mass_gev"],
                mass_uncertainty_gev=stat,
                channel=heuristic.channel,
                spin=truth["spin"],
                significance_sigma=float(heuristic.significance.get("z_global") or 0.0),
                confidence=1.0,
            )
        return action
