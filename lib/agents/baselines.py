"""Scripted agents that play CERNenv: random, a heuristic physicist, an oracle.

Every agent follows one protocol (`Agent`): `reset()` at the start of an episode, then
`act(observation)` each step, which returns what is sent to `env.step`: an
`ExperimentAction` (from `lib.agents.prompting.LLMAgent`, whatever of its reply it could not parse).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import numpy as np

from cernenv.detector import PILEUP_SETTINGS, RECONSTRUCTIONS, TRIGGERS
from cernenv.models import ActionType, CollisionObservation, ExperimentAction
from lib.agents.prompting import evidence_word, round_significant


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


SURVEY_QUALITY_REASON = {"tight": "tight selection for purity", "standard": "standard selection for efficiency"}
"""The heuristic's justification for the survey's reconstruction quality."""

CLAIM_CONFIDENCE = {"observation": 0.9, "evidence": 0.6, "no evidence": 0.8}
"""The heuristic's confidence in its claim, by what the logbook calls the global significance: a
discovery at 5σ or more, one at 3-5σ, a null claim."""


class HeuristicAgent:
    """A scripted physicist that decides from what the policy is shown, and from nothing else.

    It keeps no memory between steps: each action is a function of the observation as
    `lib.agents.prompting.render_observation` shows it (the task, the state, the last result, the
    logbook's state and the references line), and every number it takes from an observation it
    quotes by reference (`"@fit.mass_gev"`), so a policy imitating it can copy every decision.

    Plan: highest beam energy at nominal pileup. A first luminosity booking (`first_block_fraction`
    of what is affordable) surveys every offered channel (one trigger when it records them all at
    half their best efficiency, else the block is split between each channel's best trigger):
    reconstruct tight, build and scan each channel. The channel with the strongest local excess is
    analysed: calibrate twice, rebuild, fit the scan's best mass, evaluate systematics and the
    significance. Short of an observation (5σ global), book what is affordable once more in that
    channel and refit. Measure the spin of a discovery; claim a discovery when the global significance
    (with systematics) reaches `discovery_z_global`, else claim that nothing is there.

    The plan's choices are its parameters, the defaults being the plan above: `pileup` (the beam's),
    `first_block_fraction`, `survey_quality` (the survey's reconstruction), `calibration_passes`
    (before the fit, 1 or 2), `second_booking` (book the rest when short of an observation) and
    `discovery_z_global`. `HEURISTIC_FAMILY` gives the ranges a physicist would vary them over.
    """

    def __init__(
        self,
        discovery_z_global: float = 3.0,
        first_block_fraction: float = 0.4,
        *,
        pileup: str = "nominal",
        survey_quality: str = "tight",
        calibration_passes: int = 2,
        second_booking: bool = True,
    ) -> None:
        if pileup not in PILEUP_SETTINGS:
            raise ValueError(f"pileup must be one of {sorted(PILEUP_SETTINGS)}, got {pileup!r}")
        if survey_quality not in RECONSTRUCTIONS:
            raise ValueError(f"survey_quality must be one of {sorted(RECONSTRUCTIONS)}, got {survey_quality!r}")
        if calibration_passes not in (1, 2):
            raise ValueError(f"calibration_passes must be 1 or 2, got {calibration_passes!r}")
        if not 0.0 < first_block_fraction <= 1.0:
            raise ValueError(f"first_block_fraction must be in (0, 1], got {first_block_fraction!r}")
        self.discovery_z_global = discovery_z_global
        self.first_block_fraction = first_block_fraction
        self.pileup = pileup
        self.survey_quality = survey_quality
        self.calibration_passes = calibration_passes
        self.second_booking = second_booking
        self.survey_channels: Optional[List[str]] = None  # None: every offered channel

    def plan_parameters(self) -> Dict[str, Any]:
        """The plan's parameters, by name (`HEURISTIC_FAMILY`'s keys): what makes this member of the family."""
        return {name: getattr(self, name) for name in HEURISTIC_FAMILY}

    def reset(self) -> None:
        """Nothing to forget: every decision is read from the observation."""

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

    def act(self, obs: CollisionObservation) -> ExperimentAction:
        """The plan's next action; a claim instead of an action of the kind just refused: the plan,
        a function of the observation, would only send it again (a significance estimate at the
        mass of a fit that ran to the spectrum's edge is refused every time)."""
        action = self._plan(obs)
        refused = obs.latest_result.get("action") if "error" in obs.latest_result else None
        if refused == action.action_type.value and action.action_type != ActionType.SUBMIT_DISCOVERY_CLAIM:
            return self._claim(obs)
        return action

    def _plan(self, obs: CollisionObservation) -> ExperimentAction:
        task, usage = obs.task, obs.resource_usage
        last = obs.latest_result.get("action") if "error" not in obs.latest_result else None
        channels = self.survey_channels or list(task.available_channels)
        triggers = self._triggers_for(channels, list(task.available_triggers))
        if obs.selected_beam_energy_tev is None:
            return _action(
                ActionType.CONFIGURE_BEAM,
                "highest energy maximises the signal cross-section",
                beam_energy_tev=max(task.available_beam_energies_tev),
                pileup=self.pileup,
            )
        if obs.selected_trigger is None:
            return _action(ActionType.SET_TRIGGER, "record the channels to survey", trigger=triggers[0])
        if usage.luminosity_bookings == 0:
            return _action(
                ActionType.ALLOCATE_LUMINOSITY,
                "book a first block",
                luminosity_fb=f"@luminosity.affordable_fb*{self.first_block_fraction:g}",
            )
        fit = obs.logbook.get("fit_resonance")
        if fit is None:
            return self._survey(obs, channels, triggers, last)
        return self._analyse(obs, fit, last)

    def _survey(self, obs: CollisionObservation, channels: List[str], triggers: List[str], last: Optional[str]):
        """Collect the first block (shared between the survey triggers), scan every channel, then
        calibrate, rebuild and fit the channel with the strongest excess."""
        usage = obs.resource_usage
        if usage.luminosity_allocated_fb > 0:
            index = triggers.index(obs.selected_trigger) if obs.selected_trigger in triggers else -1
            if index < 0 or (last == ActionType.COLLECT_COLLISIONS.value and index + 1 < len(triggers)):
                return _action(ActionType.SET_TRIGGER, "record the next channel", trigger=triggers[index + 1])
            share = "" if index == len(triggers) - 1 else f"*{round(1.0 / (len(triggers) - index), 4):g}"
            return _action(ActionType.COLLECT_COLLISIONS, "survey block", luminosity_fb=f"@luminosity.booked_fb{share}")
        scanned = {key.split("/", 1)[1]: entry for key, entry in obs.logbook.items() if key.startswith("scan_bump/")}
        recorded = [channel for channel in channels if channel in obs.data_collected]
        surveying = all(data.calibration_level == 0 for data in obs.data_collected.values())
        # The survey goes through the channels in order, from the selected one on; a channel whose
        # scan was just refused (an empty spectrum) is passed over.
        position = recorded.index(obs.selected_channel) if obs.selected_channel in recorded else 0
        refused_scan = obs.latest_result.get("action") == ActionType.SCAN_BUMP.value and last is None
        for channel in recorded[position:] if surveying else []:
            if channel in scanned or (refused_scan and channel == obs.selected_channel):
                continue
            if obs.data_collected[channel].reconstruction != self.survey_quality:
                return _action(
                    ActionType.RECONSTRUCT_TRACKS,
                    SURVEY_QUALITY_REASON.get(self.survey_quality, "the survey's selection"),
                    channel=channel,
                    quality=self.survey_quality,
                )
            if obs.selected_channel != channel:
                return _action(ActionType.SELECT_CHANNEL, "survey the channel", channel=channel)
            if last == ActionType.BUILD_INVARIANT_MASS.value:
                return _action(ActionType.SCAN_BUMP, "look for local excesses over the window")
            return _action(ActionType.BUILD_INVARIANT_MASS, "histogram the channel")
        if not scanned:
            return self._claim(obs)
        strength = {channel: _shown(entry.get("best_z_local")) for channel, entry in scanned.items()}
        channel = max((c for c in channels if c in scanned), key=lambda c: strength[c])
        if obs.data_collected[channel].calibration_level < self.calibration_passes:
            return _action(ActionType.CALIBRATE_DETECTOR, "fix the energy scale", channel=channel)
        if obs.selected_channel != channel:
            return _action(ActionType.SELECT_CHANNEL, "analyse the strongest excess", channel=channel)
        if last == ActionType.BUILD_INVARIANT_MASS.value:
            hint = {"mass_hint_gev": "@scan.best_mass_gev"} if "scan.best_mass_gev" in obs.references else {}
            return _action(ActionType.FIT_RESONANCE, "fit the strongest candidate", **hint)
        return _action(ActionType.BUILD_INVARIANT_MASS, "histogram the calibrated channel")

    def _analyse(self, obs: CollisionObservation, fit: Dict[str, Any], last: Optional[str]) -> ExperimentAction:
        """From a fit: collect a second block if booked, refit outdated data, evaluate systematics and
        the significance, book more when short of 5σ, measure the spin of a discovery, claim."""
        task, usage = obs.task, obs.resource_usage
        channel, outdated = fit.get("channel"), set(obs.outdated_logbook_entries)
        if usage.luminosity_allocated_fb > 0:
            best = best_trigger(channel, task.available_triggers)
            if self._records(obs.selected_trigger, channel) < self._records(best, channel):
                return _action(ActionType.SET_TRIGGER, "record the analysed channel", trigger=best)
            return _action(ActionType.COLLECT_COLLISIONS, "more data", luminosity_fb="@luminosity.booked_fb")
        if "fit_resonance" in outdated:
            if last == ActionType.BUILD_INVARIANT_MASS.value:
                return _action(ActionType.FIT_RESONANCE, "refit the candidate", mass_hint_gev="@fit.mass_gev")
            return _action(ActionType.BUILD_INVARIANT_MASS, "histogram all the data")
        if (obs.logbook.get("request_systematics") or {}).get("channel") != channel:
            return _action(ActionType.REQUEST_SYSTEMATICS, "include systematic uncertainties")
        if "estimate_significance" not in obs.logbook or "estimate_significance" in outdated:
            return _action(ActionType.ESTIMATE_SIGNIFICANCE, "how significant is it?", mass_gev="@fit.mass_gev")
        z_global = _shown(obs.references.get("significance.significance_sigma"))
        used = _shown(task.luminosity_total_fb) - _shown(usage.luminosity_remaining_fb)
        affordable = _shown(obs.references.get("luminosity.affordable_fb"))
        if self.second_booking and z_global < 5.0 and usage.luminosity_bookings < 2 and affordable > 0.05 * used:
            return _action(
                ActionType.ALLOCATE_LUMINOSITY,
                "evidence short of 5σ: book the rest",
                luminosity_fb="@luminosity.affordable_fb",
            )
        discovering = z_global >= self.discovery_z_global
        if discovering and ("measure_angular" not in obs.logbook or "measure_angular" in outdated):
            return _action(ActionType.MEASURE_ANGULAR, "which spin?", mass_gev="@fit.mass_gev")
        return self._claim(obs)

    def _claim(self, obs: CollisionObservation) -> ExperimentAction:
        """A discovery quoting the fit, the significance and the spin by reference when the global
        significance reaches `discovery_z_global`, else a null claim."""
        references = obs.references
        z_global = _shown(references.get("significance.significance_sigma"))
        word = evidence_word(z_global)
        if z_global >= self.discovery_z_global and "fit.mass_uncertainty_gev" in references:
            spin = {"spin": "@angular.spin"} if "angular.spin" in references else {}
            return _action(
                ActionType.SUBMIT_DISCOVERY_CLAIM,
                "significant, consistent excess",
                discovered=True,
                mass_gev="@fit.mass_gev",
                mass_uncertainty_gev="@fit.mass_uncertainty_gev",
                channel="@fit.channel",
                **spin,
                significance_sigma="@significance.significance_sigma",
                confidence=CLAIM_CONFIDENCE.get(word, CLAIM_CONFIDENCE["evidence"]),
            )
        return _action(
            ActionType.SUBMIT_DISCOVERY_CLAIM,
            "no significant excess",
            discovered=False,
            significance_sigma=0.0,
            confidence=CLAIM_CONFIDENCE["no evidence"],
        )


HEURISTIC_FAMILY: Dict[str, Tuple[Any, ...]] = {
    "discovery_z_global": (2.5, 3.0, 3.5),
    "first_block_fraction": (0.25, 0.4, 0.55, 0.7, 1.0),
    "calibration_passes": (1, 2),
    "survey_quality": ("tight", "standard"),
    "second_booking": (True, False),
    "pileup": ("nominal", "low"),
}
"""The family of scripted physicists: each `HeuristicAgent` parameter with the values a physicist
would vary it over, the default (`HeuristicAgent()`) among them. The discovery threshold from 2.5σ
to 3.5σ global (the grade asks for 3σ); the first booking from a quarter of what is affordable to
all of it; one or two calibration passes before the fit; a tight or a standard survey selection;
a second booking or none; nominal or low pileup (a cleaner beam, half the luminosity rate).
`bench/bench_family.py` plays members directly."""

BEST_FAMILY_MEMBER: Dict[str, Any] = {"discovery_z_global": 2.5, "first_block_fraction": 0.7}
"""The best scripted physicist we know: of the family members played directly on the validation
split (`bench/bench_family.py`: each parameter varied alone and the threshold × first-block grid),
the one that won the most tasks, chosen there and never on the held-out suite. `HeuristicAgent()`
stays the baselines' reference; this member is a row beside it
(`HeuristicAgent(**BEST_FAMILY_MEMBER)`), the strategy a policy that learnt from reward could find."""

FAMILY_SEED = 0x5EED_FA
"""Seeds the draw of a campaign's family member (`family_member`), apart from every other stream."""


def family_member(seed: int, family: Mapping[str, Sequence[Any]] = HEURISTIC_FAMILY, draw: int = 0) -> Dict[str, Any]:
    """The family member that demonstrates the campaign of `seed`: each parameter drawn uniformly
    from its values, by a generator of its own seeded by (`FAMILY_SEED`, `seed`), so a campaign's
    member is the same in every run and on every machine. `draw` > 0: the campaign's `draw`-th
    other draw (`bench/bench_family.py --draws`: several members on one task)."""
    rng = np.random.default_rng([FAMILY_SEED, int(seed)] + ([int(draw)] if draw else []))
    return {name: _plain(values[int(rng.integers(len(values)))]) for name, values in family.items()}


def family_grid(family: Mapping[str, Sequence[Any]] = HEURISTIC_FAMILY) -> List[Dict[str, Any]]:
    """Every member of `family`, one dict of parameters each (the product of its values)."""
    import itertools

    names = list(family)
    return [dict(zip(names, map(_plain, values))) for values in itertools.product(*(family[n] for n in names))]


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python value it holds (a member is written to JSON)."""
    return value.item() if isinstance(value, np.generic) else value


def member_name(parameters: Mapping[str, Any]) -> str:
    """A family member as a short name: the parameters that differ from `HeuristicAgent()`'s, or
    "default" (e.g. "first_block_fraction=0.7,discovery_z_global=2.5")."""
    defaults = HeuristicAgent().plan_parameters()
    changed = [
        f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}"
        for name, value in parameters.items()
        if defaults.get(name) != value
    ]
    return ",".join(changed) or "default"


def _shown(value: Any) -> float:
    """A number as the prompt shows it (4 significant digits); 0 for none."""
    return float(round_significant(float(value))) if isinstance(value, (int, float)) else 0.0


SIGNIFICANT_DIGITS = 4
"""Numbers in the demonstrated actions are rounded to this many significant digits, as prompts show them."""


class RoundedDemonstrator:
    """An agent whose actions are another agent's with their literal numbers written as a policy
    can copy them: rounded to `digits` significant digits, as the prompts show numbers (`0.2111`
    where the heuristic computed 0.21110827456039238: the digits past the fourth carry no
    information a model could learn). Numbers the heuristic read from an observation it quotes by
    reference (`"@fit.mass_gev"`), which stay as written. The environment plays the action as
    written, so each demonstration is consistent."""

    def __init__(self, agent: Any, digits: int = SIGNIFICANT_DIGITS) -> None:
        self.agent, self.digits = agent, digits

    def reset(self) -> None:
        self.agent.reset()

    def act(self, obs: Any) -> ExperimentAction:
        action = self.agent.act(obs)
        return action.model_copy(update={"parameters": round_significant(action.parameters, self.digits)})


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
        truth, heuristic = self.truth, self._heuristic
        # Analyse only a channel the particle decays to: no survey needed.
        true_channels = [c for c in obs.task.available_channels if c in truth["channels"]][:1]
        heuristic.survey_channels = true_channels if truth["exists"] and true_channels else None
        action = heuristic.act(obs)
        if action.action_type is ActionType.MEASURE_ANGULAR or action.action_type is ActionType.SUBMIT_DISCOVERY_CLAIM:
            if not truth["exists"]:
                return _action(
                    ActionType.SUBMIT_DISCOVERY_CLAIM, "oracle: nothing there", discovered=False, confidence=1.0
                )
            fit = obs.logbook.get("fit_resonance") or {}
            significance = obs.logbook.get("estimate_significance") or {}
            return _action(
                ActionType.SUBMIT_DISCOVERY_CLAIM,
                "oracle",
                discovered=True,
                mass_gev=truth["mass_gev"],
                mass_uncertainty_gev=float(fit.get("mass_err_gev") or 0.001 * truth["mass_gev"]),
                channel=fit.get("channel") or (true_channels or obs.task.available_channels)[0],
                spin=truth["spin"],
                significance_sigma=max(0.0, float(significance.get("z_global") or 0.0)),
                confidence=1.0,
            )
        return action
