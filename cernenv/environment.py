"""`CERNCollisionEnvironment`: an LHC discovery campaign as an OpenEnv environment."""

from __future__ import annotations

import json
import secrets
import uuid
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import EnvironmentMetadata

from cernenv._version import __version__
from cernenv.actions import Prerequisite, markdown_cell, render_action_table_markdown, type_label
from cernenv.detector import BEAM_ENERGIES, PILEUP_SETTINGS
from cernenv.episode import Episode, observe
from cernenv.handlers import ActionHandlers, _r
from cernenv.models import (
    ActionType,
    CernState,
    CollisionObservation,
    DiscoveryClaim,
    ExperimentAction,
    TaskInfo,
)
from cernenv.references import REFERENCES
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
    END_WITHOUT_CLAIM,
    MAX_CONSECUTIVE_REFUSALS,
    RuleViolation,
    Violation,
    check_resources,
    parse_action,
)
from cernenv.scenarios import make_scenario
from cernenv.seeding import data_rng
from cernenv.simulation import CollisionRecorder

ANALYSIS_RESERVE = (25.0, 0.2, 40.0, 0.2)
"""(M$, fraction of the budget, days, fraction of the time): `luminosity_affordable_fb` keeps back the
smaller of each pair for the analysis after the data are in (calibrations, fits, systematics: a
standard analysis costs ~5 M$ and ~25 days)."""
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


class CERNCollisionEnvironment(ActionHandlers, Environment[ExperimentAction, CollisionObservation, CernState]):
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
        self._episode: Optional[Episode] = None
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
        *,
        world_nonce: Optional[str] = None,
        **kwargs: Any,
    ) -> CollisionObservation:
        """Start a campaign. Same `seed` (and scenario/difficulty, and secret) → same hidden world,
        unless the environment makes `fresh_worlds`.

        `secret_salt` is an evaluation secret mixed, with the environment's own (the
        constructor's), into the hidden streams: the procedural particle and the recorded
        data. With a secret, the public code and the seed no longer tell the answer; the
        visible task stays the one the seed draws. `world_nonce`: the nonce to mix in as well
        (what `world_nonce()` returned for an episode, to draw its world again; default: a fresh
        random one with `fresh_worlds`, none without). `episode_id` is a fresh random UUID unless
        given: it is no function of the seed."""
        if seed is None:
            seed = int(np.random.SeedSequence().entropy % (2**31))
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if world_nonce is not None and not isinstance(world_nonce, str):
            raise ValueError(f"world_nonce must be a string (what world_nonce() returned), got {world_nonce!r}")
        nonce = world_nonce if world_nonce is not None else secrets.token_hex(16) if self._fresh_worlds else ""
        salt = "\x00".join(s for s in (self._secret_salt, _check_salt(secret_salt), nonce) if s) or None
        chosen = make_scenario(int(seed), scenario=scenario, difficulty=difficulty, secret_salt=salt)
        rng = data_rng(int(seed), salt)
        recorder = CollisionRecorder(
            chosen.search_window_gev, chosen.channels, chosen.truth, rng, chosen.signal_capacity_per_fb
        )
        episode_id = episode_id or str(uuid.uuid4())
        self._episode = Episode(
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
            parsed, params = parse_action(action, episode.references)
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
                episode.logbook_versions[key] = episode.data_version
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

    def episode_claim(self) -> Optional[Dict[str, Any]]:
        """The claim that ended the episode, as JSON (None: no claim, or no episode)."""
        if self._episode is None or self._episode.claim is None:
            return None
        return self._episode.claim.model_dump(mode="json")

    def world_nonce(self) -> str:
        """The random nonce `fresh_worlds` mixed into this episode's hidden streams ("" without
        it): with the secret, what an auditor needs to replay the episode. Never for the agent."""
        if self._episode is None:
            raise RuntimeError("call reset() before world_nonce()")
        return self._episode.world_nonce

    def refused_actions(self) -> int:
        """How many of this episode's actions were refused: a hard rule violation, so the action
        did not run (a redundant action runs; a step after the end is not counted)."""
        if self._episode is None:
            raise RuntimeError("call reset() before refused_actions()")
        return sum(1 for entry in self._episode.history if not entry.endswith(": ok"))

    def hidden_truth(self) -> Dict[str, Any]:
        """The hidden particle, for graders and evaluation code only (never for the agent)."""
        if self._episode is None:
            raise RuntimeError("call reset() before hidden_truth()")
        return self._episode.scenario.hidden_truth()

    ANALYSIS_OBJECTS = ("spectrum", "resonance_fit", "background_fit", "scan", "angular")

    def analysis_objects(self) -> Dict[str, Any]:
        """The episode's current analysis objects, for plots and replays (never for the agent,
        which sees their numbers in its observations): the `Spectrum`, the `ResonanceFit` and
        `BackgroundFit` made from it, the `BumpScan`, the `AngularMeasurement` (`angular`); None
        until the action that makes each has run (a `select_channel` to another channel clears
        them). Like `hidden_truth`, not served."""
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
            return END_WITHOUT_CLAIM["step limit"]
        recent = episode.history[-MAX_CONSECUTIVE_REFUSALS:]  # "<verb>: ok" for each action that ran
        if len(recent) == MAX_CONSECUTIVE_REFUSALS and not any(entry.endswith(": ok") for entry in recent):
            return END_WITHOUT_CLAIM["refusals"]
        if episode.scenario.budget_musd - episode.budget_used_musd <= 1e-9:
            return END_WITHOUT_CLAIM["budget"]
        if episode.scenario.time_days - episode.time_used_days <= 1e-9:
            return END_WITHOUT_CLAIM["time"]
        return None

    def _affordable_luminosity(self) -> Optional[float]:
        """fb^-1 that can still be booked and collected at the configured beam: within the cap, and
        with the budget and time left after `ANALYSIS_RESERVE` (and after collecting what is
        booked already); None before the beam is configured."""
        episode = self._episode
        if episode.beam_energy_tev is None:
            return None
        scenario = episode.scenario
        reserve_musd_cap, reserve_budget_frac, reserve_days_cap, reserve_time_frac = ANALYSIS_RESERVE
        beam = BEAM_ENERGIES[episode.beam_energy_tev]
        days_per_fb = beam.days_per_fb / PILEUP_SETTINGS[episode.pileup].luminosity_rate_factor
        budget_left = scenario.budget_musd - episode.budget_used_musd
        budget_left -= min(reserve_musd_cap, reserve_budget_frac * scenario.budget_musd)
        time_left = scenario.time_days - episode.time_used_days - episode.booked_fb * days_per_fb
        time_left -= min(reserve_days_cap, reserve_time_frac * scenario.time_days)
        by_cap = scenario.luminosity_fb - episode.luminosity_fb - episode.booked_fb
        return float(max(0.0, min(budget_left / beam.cost_musd_per_fb, time_left / days_per_fb, by_cap)))

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

    def _grade(self, claim: Optional[DiscoveryClaim]) -> Dict[str, Any]:
        """Grade the claim (None: the episode ended without one) and end the episode. Returns
        what the claim's step reports: the components, or only that the claim was recorded
        when grades are withheld."""
        episode = self._episode
        episode.claim = claim
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
        if breakdown:
            self._state.cumulative_reward += reward
            for name, value in breakdown.items():
                self._state.reward_components[name] = self._state.reward_components.get(name, 0.0) + value
        return observe(
            self._episode,
            step_index=self._state.step_count,
            max_steps=self.max_steps,
            affordable_fb=self._affordable_luminosity(),
            reward=reward,
            breakdown=breakdown,
            violations=violations,
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


REFERENCES_DOC = """A parameter may quote a value the last observation showed, by name: `"@fit.mass_gev"` is the
number its `references` field holds under `fit.mass_gev`, and `"@luminosity.affordable_fb*0.4"`
40% of a number (`cernenv.references`); an index and a factor are written in ASCII digits (`[0-9]`),
and the action schema's pattern accepts exactly what the parser does. The environment replaces a
reference before it validates the action; a reference to a value not shown yet is refused
(`INVALID_PARAMETERS`) with the names that are shown. A fit without `mass_hint_gev` starts at the
best mass of the channel's last scan; a fit whose mass runs to the spectrum's edge says so (it found
no peak inside the window), and a significance estimate at that mass is refused with why."""


def reference_table() -> str:
    """The references an action may quote, as a Markdown table (from `REFERENCES`)."""
    rows = ["| reference | what it holds |", "|---|---|"]
    rows += [f"| `@{name}` | {markdown_cell(text)} |" for name, text in REFERENCES.items()]
    return "\n".join(rows)


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

{REFERENCES_DOC}

{reference_table()}

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
