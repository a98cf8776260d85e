"""CERNCollisionEnvironment through its public API: reset, determinism, no leak of the
hidden truth, the rules engine, episode end, resources, physics effects and reward bookkeeping."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Dict, List, Optional, Tuple

import pytest

from cernenv.actions import ACTION_TABLE
from cernenv.detector import BEAM_ENERGIES, CHANNELS, PILEUP_SETTINGS, TRIGGERS
from cernenv.environment import CERNCollisionEnvironment
from cernenv.models import ActionType, CollisionObservation
from cernenv.rewards import (
    COMPONENT_NAMES,
    CORRECT_NULL,
    CORRECT_OBSERVATION,
    MILESTONE_REWARD,
    MILESTONES,
    NO_CLAIM,
    REDUNDANCY_PENALTY,
    UNSUPPORTED_NULL,
    VIOLATION_PENALTY,
)
from cernenv.rules import MAX_CONSECUTIVE_REFUSALS, Violation
from cernenv.scenarios import DIFFICULTIES, PROCEDURAL_CONFIGURATIONS, list_scenarios, procedural_scenario
from lib.agents.baselines import HeuristicAgent, RandomAgent, best_trigger

from truth_leaks import NUMBER_BOUNDARY, blank_random_ids, truth_patterns

SCENARIOS = list_scenarios()
TRUTH_KEYS = {"exists", "mass_gev", "width_gev", "spin", "channels", "cross_section_fb"}
# Procedural (difficulty, seed) pairs whose hidden world holds a particle.
PROCEDURAL_WITH_PARTICLE = [
    (difficulty, seed)
    for difficulty in DIFFICULTIES
    for seed in [s for s in range(50) if procedural_scenario(s, difficulty).truth][:2]
]


def A(verb: str, **parameters: Any) -> Dict[str, Any]:
    return {"action_type": verb, "parameters": parameters}


def fresh(
    scenario: Optional[str] = None, seed: int = 0, difficulty: Optional[str] = None, **kwargs: Any
) -> Tuple[CERNCollisionEnvironment, CollisionObservation]:
    env = CERNCollisionEnvironment(**kwargs)
    return env, env.reset(seed=seed, scenario=scenario, difficulty=difficulty)


def ok(env: CERNCollisionEnvironment, action: Any) -> CollisionObservation:
    obs = env.step(action)
    assert not obs.rule_violations, (action, obs.rule_violations)
    return obs


def data_actions(
    task, luminosity_fb: float, energy: Optional[float] = None, pileup: str = "nominal", channel: Optional[str] = None
) -> List[Dict[str, Any]]:
    channel = channel or task.available_channels[0]
    return [
        A("configure_beam", beam_energy_tev=energy or max(task.available_beam_energies_tev), pileup=pileup),
        A("set_trigger", trigger=best_trigger(channel, task.available_triggers)),
        A("allocate_luminosity", luminosity_fb=luminosity_fb),
        A("collect_collisions", luminosity_fb=luminosity_fb),
    ]


def run_heuristic(env: CERNCollisionEnvironment, obs: CollisionObservation) -> List[CollisionObservation]:
    agent = HeuristicAgent()
    agent.reset()
    trajectory = [obs]
    while not obs.done:
        obs = env.step(agent.act(obs))
        trajectory.append(obs)
        assert len(trajectory) <= obs.task.max_steps + 1
    return trajectory


# Reset ----------------------------------------------------------------------------------


def assert_fresh(obs: CollisionObservation) -> None:
    task, usage = obs.task, obs.resource_usage
    assert obs.step_index == 0 and not obs.done and obs.reward == 0.0
    assert usage.budget_used_musd == 0 and usage.budget_remaining_musd == task.budget_total_musd > 0
    assert usage.luminosity_used_fb == 0 and usage.luminosity_remaining_fb == task.luminosity_total_fb > 0
    assert usage.luminosity_allocated_fb == 0
    assert usage.time_used_days == 0 and usage.time_remaining_days == task.time_total_days > 0
    lo, hi = task.search_window_gev
    assert 0 < lo < hi
    assert task.available_channels and set(task.available_channels) <= set(CHANNELS)
    assert task.available_triggers and set(task.available_triggers) <= set(TRIGGERS)
    assert task.available_beam_energies_tev and set(task.available_beam_energies_tev) <= set(BEAM_ENERGIES)
    # Every channel of the task can be recorded by one of its triggers.
    for channel in task.available_channels:
        assert any(TRIGGERS[t].get(channel, 0.0) > 0.1 for t in task.available_triggers), channel
    assert task.max_steps > 0 and task.problem_statement
    assert obs.selected_beam_energy_tev is obs.selected_pileup is obs.selected_trigger is obs.selected_channel is None
    assert obs.data_collected == {} and obs.candidate_masses_gev == [] and obs.cumulative_significance == 0.0
    assert obs.rule_violations == [] and obs.pipeline_history == []


@pytest.mark.parametrize("name", SCENARIOS)
def test_reset_curated_scenarios(name):
    env, obs = fresh(name, seed=3)
    assert_fresh(obs)
    assert obs.task.campaign_type == "curated"
    state = env.state
    assert state.step_count == 0 and state.scenario_name == name and state.difficulty == obs.task.difficulty
    assert state.cumulative_reward == 0.0 and state.terminal_reward is None
    assert set(state.reward_components) == set(COMPONENT_NAMES)
    assert all(v == 0.0 for v in state.reward_components.values())


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
@pytest.mark.parametrize("seed", [0, 1, 2, 7, 123456])
def test_reset_procedural_scenarios(difficulty, seed):
    env, obs = fresh(difficulty=difficulty, seed=seed)
    assert_fresh(obs)
    assert obs.task.difficulty == difficulty == env.state.difficulty
    assert obs.task.campaign_type == "procedural"
    assert str(seed) not in obs.task.campaign_type


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_reset_without_difficulty_draws_it_from_the_seed(seed):
    _, obs = fresh(seed=seed)
    assert obs.task.difficulty == DIFFICULTIES[seed % 3]


def test_reset_starts_over_after_an_episode():
    env, obs = fresh("higgs_4l_125", seed=1)
    for action in data_actions(obs.task, 3.0):
        ok(env, action)
    obs = env.reset(seed=1, scenario="higgs_4l_125")
    assert_fresh(obs)
    assert env.state.step_count == 0 and env.state.cumulative_reward == 0.0


@pytest.mark.parametrize(
    "kwargs", [{"scenario": "higgs_4l_126"}, {"difficulty": "insane"}, {"seed": -1}, {"seed": 1.5}, {"seed": True}]
)
def test_reset_rejects_bad_arguments(kwargs):
    env = CERNCollisionEnvironment()
    with pytest.raises(ValueError):
        env.reset(**{"seed": 0, **kwargs})


# Determinism ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scenario, difficulty, seed", [("higgs_4l_125", None, 5), (None, "medium", 3), ("higgs_diphoton_125", None, 2)]
)
def test_same_seed_same_actions_same_bytes(scenario, difficulty, seed):
    runs = []
    for _ in range(2):
        env, obs = fresh(scenario, seed=seed, difficulty=difficulty)
        trajectory = run_heuristic(env, obs)
        runs.append(([o.model_dump_json() for o in trajectory], env.state.model_dump_json(exclude={"episode_id"})))
    (first, first_state), (second, second_state) = runs
    assert len(first) == len(second) > 8
    for step, (a, b) in enumerate(zip(first, second)):
        assert a == b, f"observation {step} differs"
    assert first_state == second_state


def test_same_seed_same_scripted_actions_same_bytes_including_violations():
    script = [
        A("build_invariant_mass"),
        A("configure_beam", beam_energy_tev=13.0, pileup="high"),
        A("set_trigger", trigger="single_lepton"),
        A("allocate_luminosity", luminosity_fb=8.0),
        A("collect_collisions", luminosity_fb=9.0),
        A("collect_collisions", luminosity_fb=8.0),
        A("reconstruct_tracks", channel="four_lepton", quality="fast"),
        A("select_channel", channel="four_lepton"),
        A("build_invariant_mass", bin_width_gev=2.0),
        A("scan_bump"),
        A("fit_resonance", mass_hint_gev=125.0),
        A("submit_discovery_claim", discovered=False, confidence=0.3),
    ]
    outputs = []
    for _ in range(2):
        env, obs = fresh("higgs_4l_125", seed=11)
        outputs.append([obs.model_dump_json()] + [env.step(a).model_dump_json() for a in script])
    assert outputs[0] == outputs[1]


def _events_after_collect(seed: int, scenario: str = "z_mumu_91") -> Dict[str, int]:
    env, obs = fresh(scenario, seed=seed)
    for action in data_actions(obs.task, 0.2 * obs.task.luminosity_total_fb):
        obs = ok(env, action)
    return obs.latest_result["events_recorded"]


def test_different_seeds_give_different_data():
    recorded = [_events_after_collect(seed) for seed in (0, 1, 2)]
    assert recorded[0] != recorded[1] and recorded[1] != recorded[2] and recorded[0] != recorded[2]
    assert _events_after_collect(1) == recorded[1]


def test_different_seeds_give_different_hidden_worlds_from_a_fixed_task_set():
    """Seeds change the hidden particle; the visible task is one of the difficulty's few
    configurations, shared by many seeds (so it cannot identify a seed)."""
    worlds, tasks = set(), {}
    for seed in range(60):
        env, obs = fresh(difficulty="medium", seed=seed)
        worlds.add(json.dumps(env.hidden_truth(), sort_keys=True))
        tasks.setdefault(obs.task.model_dump_json(), []).append(seed)
    assert len(worlds) > 40
    windows = {c.search_window_gev for c in PROCEDURAL_CONFIGURATIONS["medium"]}
    assert {tuple(json.loads(t)["search_window_gev"]) for t in tasks} <= windows
    assert len(tasks) <= len(PROCEDURAL_CONFIGURATIONS["medium"]) and min(map(len, tasks.values())) >= 3


# No leak of the hidden truth -----------------------------------------------------------


def public_json(model) -> str:
    """JSON of an observation or state with the scenario name and the (random) episode id blanked
    (both tested on their own below)."""
    data = json.loads(model.model_dump_json())
    if "episode_id" in data:
        data["episode_id"] = ""
    if isinstance(data.get("task"), dict):
        data["task"]["scenario_name"] = ""
    if "scenario_name" in data:
        data["scenario_name"] = ""
    return json.dumps(data, ensure_ascii=False)


def assert_no_truth(text: str, patterns: List[re.Pattern], where: str) -> None:
    text = blank_random_ids(text)
    found = [p.pattern for p in patterns if p.search(text)]
    assert not found, f"hidden truth {found} appears in {where}: {text[:3000]}"


def assert_ungraded(state) -> None:
    assert state.terminal_reward is None
    assert state.discovered is None
    assert state.correct_mass is None and state.correct_channel is None and state.correct_spin is None


LEAK_CASES = [(name, None, seed) for name in SCENARIOS if not name.startswith("null") for seed in (0, 1)] + [
    (None, difficulty, seed) for difficulty, seed in PROCEDURAL_WITH_PARTICLE
]


@pytest.mark.parametrize("scenario, difficulty, seed", LEAK_CASES)
def test_no_truth_in_observations_and_state_before_any_fit(scenario, difficulty, seed):
    env, obs = fresh(scenario, seed=seed, difficulty=difficulty)
    truth = env.hidden_truth()
    assert truth["exists"]
    patterns = truth_patterns(truth)
    channel = obs.task.available_channels[0]
    script = data_actions(obs.task, 0.2 * obs.task.luminosity_total_fb) + [
        A("calibrate_detector", channel=channel),
        A("reconstruct_tracks", channel=channel, quality="standard"),
        A("select_channel", channel=channel),
        A("calibrate_detector", channel=channel),
    ]
    observations = [obs]
    for action in script:
        observations.append(ok(env, action))
        assert_no_truth(public_json(env.state), patterns, f"state after {action['action_type']}")
        assert_ungraded(env.state)
    for step, o in enumerate(observations):
        assert not o.done
        assert_no_truth(public_json(o), patterns, f"observation {step}")


@pytest.mark.parametrize(
    "scenario, difficulty, seed",
    [
        ("higgs_4l_125", None, 0),
        ("higgs_diphoton_125", None, 1),
        ("dijet_2500", None, 0),
        (None, "easy", 2),
        (None, "medium", 3),
    ],
)
def test_state_never_reveals_truth_before_done(scenario, difficulty, seed):
    env, obs = fresh(scenario, seed=seed, difficulty=difficulty)
    truth = env.hidden_truth()
    patterns = truth_patterns(truth)
    agent = HeuristicAgent()
    agent.reset()
    while True:
        obs = env.step(agent.act(obs))
        state = env.state
        if obs.done:
            break
        assert_ungraded(state)
        assert_no_truth(public_json(state), patterns, f"state at step {obs.step_index}")
    assert state.terminal_reward is not None and state.discovered is not None


def test_hidden_truth_is_not_an_attribute_of_observation_or_state():
    env, obs = fresh("higgs_4l_125", seed=0)
    forbidden = {"truth", "hidden_truth", "mass_gev", "width_gev", "spin", "cross_section_fb"}
    assert not forbidden & set(type(obs).model_fields)
    assert not forbidden & set(json.loads(env.state.model_dump_json()))


def _mass_texts(mass: float) -> List[str]:
    texts = {repr(mass), f"{mass:g}", str(int(round(mass)))}
    for digits in (3, 4, 5, 6):
        texts.add(f"{mass:.{digits}g}")
    if mass >= 1000:
        texts.add(f"{mass / 1000:g} TeV")
    return sorted(texts)


@pytest.mark.parametrize(
    "scenario, difficulty, seed",
    [(name, None, 0) for name in SCENARIOS if not name.startswith("null")]
    + [(None, d, s) for d, s in PROCEDURAL_WITH_PARTICLE],
)
def test_problem_statement_does_not_state_the_mass(scenario, difficulty, seed):
    env, obs = fresh(scenario, seed=seed, difficulty=difficulty)
    mass = env.hidden_truth()["mass_gev"]
    statement = obs.task.problem_statement
    for text in _mass_texts(mass):
        assert not re.search(NUMBER_BOUNDARY % re.escape(text), statement), (text, statement)


@pytest.mark.parametrize("difficulty, seed", [("easy", 2), ("medium", 17), ("hard", 8), ("hard", 4)])
def test_procedural_task_name_reveals_no_seed(difficulty, seed):
    env, obs = fresh(difficulty=difficulty, seed=seed)
    for o in [obs, env.step(A("configure_beam", beam_energy_tev=max(obs.task.available_beam_energies_tev)))]:
        assert o.task.campaign_type == "procedural"
        assert f"_{seed}" not in o.model_dump_json()


def test_curated_task_names_do_not_reveal_the_answer():
    revealing = []
    for name in SCENARIOS:
        env, obs = fresh(name, seed=0)
        truth = env.hidden_truth()
        shown = obs.task.campaign_type.lower()
        if not truth["exists"] and "null" in shown:
            revealing.append(name)
        if truth["exists"] and re.search(NUMBER_BOUNDARY % str(int(round(truth["mass_gev"]))), shown):
            revealing.append(name)
    assert not revealing, revealing


def test_episode_id_is_random_and_changes_no_data():
    """The id is a fresh UUID (no function of the seed), and naming one changes nothing else."""
    trajectories, ids = [], []
    for episode_id in (None, None, "run-5"):
        env = CERNCollisionEnvironment()
        obs = env.reset(seed=5, scenario="higgs_4l_125", episode_id=episode_id)
        ids.append(env.state.episode_id)
        trajectories.append([o.model_dump_json() for o in run_heuristic(env, obs)])
    assert ids[0] != ids[1] and ids[2] == "run-5"
    assert trajectories[0] == trajectories[1] == trajectories[2]


def test_a_secret_salt_hides_the_particle_from_the_public_code_but_not_the_task():
    """With a secret, the seed still draws the same visible task, but another particle and other
    data; the same secret gives the same world; the constructor's and reset's secrets combine."""
    changed = 0
    for seed in range(30):
        public, salted = CERNCollisionEnvironment(), CERNCollisionEnvironment(secret_salt="s3cret")
        assert public.reset(seed=seed, difficulty="medium").task == salted.reset(seed=seed, difficulty="medium").task
        changed += public.hidden_truth() != salted.hidden_truth()
        again = CERNCollisionEnvironment()
        again.reset(seed=seed, difficulty="medium", secret_salt="s3cret")
        assert again.hidden_truth() == salted.hidden_truth()
    assert changed >= 20  # two null worlds are equal; particles differ
    runs = {}
    salted = {"secret_salt": "s3cret"}
    for name, kwargs, reset_salt in (
        ("public", {}, None),
        ("salted", salted, None),
        ("both", salted, "mine"),
        ("twice", salted, None),
    ):
        env = CERNCollisionEnvironment(**kwargs)
        obs = env.reset(seed=4, scenario="higgs_4l_125", secret_salt=reset_salt)
        runs[name] = [o.model_dump_json() for o in run_heuristic(env, obs)][:6]
    assert runs["salted"] == runs["twice"]
    assert len({json.dumps(runs[k]) for k in ("public", "salted", "both")}) == 3


@pytest.mark.parametrize("salt", ["", 7, b"bytes"])
def test_a_secret_salt_must_be_a_non_empty_string(salt):
    with pytest.raises(ValueError, match="secret_salt must be a non-empty string"):
        CERNCollisionEnvironment(secret_salt=salt)
    with pytest.raises(ValueError, match="secret_salt must be a non-empty string"):
        CERNCollisionEnvironment().reset(seed=0, secret_salt=salt)


def test_state_does_not_reveal_the_procedural_seed():
    seed = 424242
    env, _ = fresh(difficulty="hard", seed=seed)
    state = env.state
    assert str(seed) not in state.model_dump_json()
    assert f"{seed:x}" not in (state.episode_id or "").replace("-", "")


# hidden_truth() -------------------------------------------------------------------------


@pytest.mark.parametrize("name", SCENARIOS)
def test_hidden_truth_curated(name):
    env, obs = fresh(name, seed=0)
    truth = env.hidden_truth()
    assert set(truth) == TRUTH_KEYS
    if name.startswith("null"):
        assert truth["exists"] is False and truth["mass_gev"] is None and truth["channels"] == []
        assert truth["cross_section_fb"] == 0.0
        return
    lo, hi = obs.task.search_window_gev
    assert truth["exists"] is True and lo < truth["mass_gev"] < hi
    assert truth["width_gev"] >= 0 and truth["spin"] in (0, 1, 2) and truth["cross_section_fb"] > 0
    assert truth["channels"] and set(truth["channels"]) <= set(obs.task.available_channels)
    json.dumps(truth)  # plain JSON types


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_hidden_truth_procedural(difficulty):
    kinds = set()
    for seed in range(40):
        env, obs = fresh(difficulty=difficulty, seed=seed)
        truth = env.hidden_truth()
        assert set(truth) == TRUTH_KEYS
        kinds.add(truth["exists"])
        if truth["exists"]:
            lo, hi = obs.task.search_window_gev
            assert lo < truth["mass_gev"] < hi and set(truth["channels"]) <= set(obs.task.available_channels)
        else:
            assert truth["mass_gev"] is None and truth["width_gev"] is None and truth["channels"] == []
    assert kinds == {True, False}, "40 seeds should give both particles and null worlds"


def test_hidden_truth_before_reset_raises_and_is_stable_across_steps():
    env = CERNCollisionEnvironment()
    with pytest.raises(RuntimeError):
        env.hidden_truth()
    env.reset(seed=9, difficulty="easy")
    before = env.hidden_truth()
    env.step(A("configure_beam", beam_energy_tev=13.0))
    assert env.hidden_truth() == before
    other, _ = fresh(difficulty="easy", seed=9)
    assert other.hidden_truth() == before


# Rules -------------------------------------------------------------------------------------

H4L_DATA = [
    A("configure_beam", beam_energy_tev=13.6),
    A("set_trigger", trigger="dilepton"),
    A("allocate_luminosity", luminosity_fb=5.0),
    A("collect_collisions", luminosity_fb=5.0),
]
H4L_SPECTRUM = H4L_DATA + [
    A("reconstruct_tracks", channel="four_lepton"),
    A("select_channel", channel="four_lepton"),
    A("build_invariant_mass"),
]

# (scenario, setup actions, refused action, code, what the message must tell the agent)
HARD_VIOLATIONS = [
    ("higgs_4l_125", [], A("build_invariant_mass"), "MISSING_PREREQUISITE", "select_channel first"),
    ("higgs_4l_125", [], A("collect_collisions", luminosity_fb=1.0), "MISSING_PREREQUISITE", "configure_beam first"),
    (
        "higgs_4l_125",
        H4L_DATA[:2],
        A("collect_collisions", luminosity_fb=1.0),
        "MISSING_PREREQUISITE",
        "allocate_luminosity first",
    ),
    ("higgs_4l_125", [], A("calibrate_detector", channel="four_lepton"), "MISSING_PREREQUISITE", "collect_collisions"),
    (
        "higgs_4l_125",
        H4L_DATA + [A("select_channel", channel="four_lepton")],
        A("build_invariant_mass"),
        "MISSING_PREREQUISITE",
        "reconstruct_tracks",
    ),
    (
        "higgs_4l_125",
        H4L_DATA,
        A("fit_resonance", mass_hint_gev=125.0),
        "MISSING_PREREQUISITE",
        "build_invariant_mass first",
    ),
    (
        "higgs_4l_125",
        H4L_SPECTRUM,
        A("request_theory_review", mass_gev=125.0),
        "MISSING_PREREQUISITE",
        "fit_resonance first",
    ),
    ("higgs_4l_125", [], A("select_channel", channel="dijet"), "UNAVAILABLE_OPTION", "four_lepton"),
    ("higgs_4l_125", [], A("configure_beam", beam_energy_tev=7.0), "UNAVAILABLE_OPTION", "13.6"),
    ("higgs_4l_125", H4L_DATA[:1], A("set_trigger", trigger="muon_plus_jets"), "UNAVAILABLE_OPTION", "dilepton"),
    ("z_mumu_91", H4L_DATA[:0], A("reconstruct_tracks", channel="diphoton"), "UNAVAILABLE_OPTION", "dimuon"),
    ("higgs_4l_125", H4L_DATA, A("configure_beam", beam_energy_tev=13.0), "BEAM_LOCKED", "13.6"),
    ("higgs_4l_125", H4L_DATA[:1], A("allocate_luminosity", luminosity_fb=31.0), "LUMINOSITY_LIMIT", "30"),
    ("higgs_4l_125", H4L_DATA, A("allocate_luminosity", luminosity_fb=25.5), "LUMINOSITY_LIMIT", "25"),
    (
        "higgs_4l_125",
        H4L_DATA[:2] + [A("allocate_luminosity", luminosity_fb=2.0)],
        A("collect_collisions", luminosity_fb=3.0),
        "NOT_ENOUGH_BOOKED",
        "allocate_luminosity",
    ),
    (
        "zprime_dilepton_4000",
        [A("configure_beam", beam_energy_tev=13.0)],
        A("allocate_luminosity", luminosity_fb=160.0),
        "INSUFFICIENT_BUDGET",
        "395",
    ),
    (
        "dijet_2500",
        [
            A("configure_beam", beam_energy_tev=13.6, pileup="low"),
            A("set_trigger", trigger="single_jet"),
            A("allocate_luminosity", luminosity_fb=80.0),
        ],
        A("collect_collisions", luminosity_fb=80.0),
        "INSUFFICIENT_TIME",
        "195.5",
    ),
    (
        "higgs_4l_125",
        H4L_DATA + [A("calibrate_detector", channel="four_lepton")] * 2,
        A("calibrate_detector", channel="four_lepton"),
        "FULLY_CALIBRATED",
        "highest calibration level",
    ),
    ("higgs_4l_125", [], A("warp_drive"), "INVALID_ACTION", "configure_beam"),
    ("higgs_4l_125", [], None, "INVALID_ACTION", "JSON object"),
    ("higgs_4l_125", [], "configure_beam", "INVALID_ACTION", "JSON object"),
    ("higgs_4l_125", [], {"action_type": "scan_bump", "params": {}}, "INVALID_ACTION", "params"),
    ("higgs_4l_125", [], A("configure_beam", beam_energy_tev="fast"), "INVALID_PARAMETERS", "beam_energy_tev"),
    ("higgs_4l_125", [], A("configure_beam", beam_energy_tev=math.nan), "INVALID_PARAMETERS", "beam_energy_tev"),
    ("higgs_4l_125", [], A("configure_beam"), "INVALID_PARAMETERS", "beam_energy_tev"),
    (
        "higgs_4l_125",
        [],
        A("submit_discovery_claim", discovered=True, confidence=0.5),
        "INVALID_PARAMETERS",
        "mass_gev",
    ),
    ("higgs_4l_125", H4L_SPECTRUM, A("estimate_significance", mass_gev=500.0), "INVALID_PARAMETERS", "spectrum"),
    ("higgs_4l_125", H4L_SPECTRUM, A("scan_bump", step_gev=0.001), "INVALID_PARAMETERS", "step_gev"),
]


def _snapshot(obs: CollisionObservation) -> Dict[str, Any]:
    return {
        "resources": obs.resource_usage.model_dump(),
        "data": {k: v.model_dump() for k, v in obs.data_collected.items()},
        "beam": obs.selected_beam_energy_tev,
        "pileup": obs.selected_pileup,
        "trigger": obs.selected_trigger,
        "channel": obs.selected_channel,
        "candidates": obs.candidate_masses_gev,
        "significance": obs.cumulative_significance,
    }


@pytest.mark.parametrize(
    "scenario, setup, action, code, hint", HARD_VIOLATIONS, ids=[f"{c[3]}-{i}" for i, c in enumerate(HARD_VIOLATIONS)]
)
def test_hard_violation_is_reported_penalised_and_changes_nothing(scenario, setup, action, code, hint):
    env, obs = fresh(scenario, seed=0)
    for step in setup:
        obs = ok(env, step)
    before, state_before = _snapshot(obs), env.state
    obs = env.step(action)
    assert len(obs.rule_violations) == 1, obs.rule_violations
    message = obs.rule_violations[0]
    assert message.startswith(f"{code}: "), message
    assert hint in message and len(message) > len(code) + 20, message
    assert obs.reward_breakdown["violations"] == VIOLATION_PENALTY < 0
    assert obs.reward == pytest.approx(VIOLATION_PENALTY)
    assert obs.latest_result["error"] == message
    assert obs.step_index == len(setup) + 1 and not obs.done
    assert _snapshot(obs) == before
    state = env.state
    assert state.step_count == state_before.step_count + 1
    assert state.cumulative_reward == pytest.approx(state_before.cumulative_reward + VIOLATION_PENALTY)
    assert state.reward_components["violations"] == pytest.approx(VIOLATION_PENALTY)


def test_every_violation_code_is_exercised():
    exercised = {case[3] for case in HARD_VIOLATIONS} | {"REDUNDANT_ACTION", "EPISODE_DONE"}
    assert exercised == {v.value for v in Violation}


def test_refused_action_does_not_block_the_same_action_later():
    env, obs = fresh("higgs_4l_125", seed=0)
    env.step(A("select_channel", channel="four_lepton"))
    obs = env.step(A("build_invariant_mass"))
    assert obs.rule_violations[0].startswith("MISSING_PREREQUISITE")
    for action in H4L_DATA + [A("reconstruct_tracks", channel="four_lepton")]:
        ok(env, action)
    obs = ok(env, A("build_invariant_mass"))
    assert obs.latest_result["events"] > 0


def test_redundant_action_runs_and_is_penalised_softly():
    env, obs = fresh("higgs_4l_125", seed=0)
    for action in H4L_DATA:
        ok(env, action)
    first = ok(env, A("select_channel", channel="four_lepton"))
    second = env.step(A("select_channel", channel="four_lepton"))
    assert len(second.rule_violations) == 1 and second.rule_violations[0].startswith("REDUNDANT_ACTION: ")
    assert "same" in second.rule_violations[0]
    assert second.reward_breakdown["redundancy"] == REDUNDANCY_PENALTY < 0
    assert second.reward_breakdown["violations"] == 0.0
    assert second.reward == pytest.approx(REDUNDANCY_PENALTY)
    # Soft: the action ran (and was charged again).
    assert "error" not in second.latest_result and second.latest_result["channel"] == "four_lepton"
    assert second.resource_usage.time_used_days == pytest.approx(first.resource_usage.time_used_days + 0.1)
    assert env.state.reward_components["redundancy"] == pytest.approx(REDUNDANCY_PENALTY)


@pytest.mark.parametrize(
    "setup, first, second",
    [
        (H4L_SPECTRUM, A("scan_bump"), A("scan_bump", step_gev=None)),  # a default spelt out
        (
            H4L_SPECTRUM[:-1],
            A("build_invariant_mass"),
            A("build_invariant_mass", mass_min_gev=1.0, mass_max_gev=10_000.0),
        ),  # clipped to the same window
        (
            H4L_DATA,
            A("reconstruct_tracks", channel="four_lepton"),
            A("reconstruct_tracks", channel="four_lepton", quality="standard"),
        ),
    ],
)
def test_the_same_action_spelt_another_way_is_still_redundant(setup, first, second):
    """Redundancy is judged on what the action did, not on how its parameters were written."""
    env, obs = fresh("higgs_4l_125", seed=0)
    for action in setup:
        ok(env, action)
    ok(env, first)
    obs = env.step(second)
    assert obs.reward_breakdown["redundancy"] == REDUNDANCY_PENALTY, (second, obs.rule_violations)


def test_same_action_on_changed_data_is_not_redundant():
    env, obs = fresh("higgs_4l_125", seed=0)
    for action in H4L_SPECTRUM[:2] + [
        A("allocate_luminosity", luminosity_fb=6.0),
        A("collect_collisions", luminosity_fb=3.0),
    ]:
        ok(env, action)
    for action in H4L_SPECTRUM[4:]:
        ok(env, action)
    ok(env, A("collect_collisions", luminosity_fb=3.0))  # new data
    obs = ok(env, A("build_invariant_mass"))
    assert obs.reward_breakdown["redundancy"] == 0.0


@pytest.mark.parametrize("action_type", [["configure_beam"], {"verb": "configure_beam"}])
def test_unhashable_action_type_is_an_invalid_action(action_type):
    env, _ = fresh("higgs_4l_125", seed=0)
    obs = env.step({"action_type": action_type, "parameters": {}})
    assert obs.rule_violations[0].startswith("INVALID_ACTION: ")


# Pipeline actions that currently fail inside the environment -----------------------------


@pytest.mark.parametrize("method, region", [("fit", None), ("sideband", [120.0, 130.0])])
def test_subtract_background_then_fit_without_hint(method, region):
    # Regression: subtract_background passed an unknown `mask` argument, and a hint-less fit after it
    # called a misspelt helper; both surfaced as INVALID_PARAMETERS "could not run".
    env, obs = fresh("higgs_4l_125", seed=3)
    for action in H4L_SPECTRUM:
        ok(env, action)
    params = {"method": method} if region is None else {"method": method, "signal_region_gev": region}
    obs = env.step(A("subtract_background", **params))
    assert not obs.rule_violations, obs.rule_violations
    assert obs.latest_result["background_fit_converged"] is True
    obs = env.step(A("fit_resonance"))
    assert not obs.rule_violations, obs.rule_violations
    assert 110 < obs.latest_result["mass_gev"] < 160


# Episode end ------------------------------------------------------------------------------


def test_claim_ends_and_grades_the_episode():
    env, obs = fresh("higgs_4l_125", seed=0)
    for action in H4L_DATA:
        ok(env, action)
    obs = ok(env, A("submit_discovery_claim", discovered=False, confidence=0.6))
    assert obs.done and obs.latest_result["graded"] is True
    state = env.state
    assert state.terminal_reward is not None and state.discovered is False
    assert state.correct_mass is None  # nothing analysed: an unsupported claim, graded without the truth
    assert state.reward_components["outcome"] == UNSUPPORTED_NULL
    assert obs.reward_breakdown["outcome"] == UNSUPPORTED_NULL
    assert state.terminal_reward == pytest.approx(
        sum(v for k, v in state.reward_components.items() if k not in ("milestones", "violations", "redundancy"))
    )


NULL_DIPHOTON_FIT = [
    A("reconstruct_tracks", channel="diphoton"),
    A("select_channel", channel="diphoton"),
    A("build_invariant_mass"),
    A("fit_resonance", mass_hint_gev=1000.0),
]
"""null_diphoton_750's analysis after its data: the fit that counts the luminosity analysed."""


def test_correct_null_claim_on_null_scenario_is_rewarded():
    env, obs = fresh("null_diphoton_750", seed=0)
    for action in data_actions(obs.task, 0.3 * obs.task.luminosity_total_fb, energy=13.6):
        ok(env, action)
    for action in NULL_DIPHOTON_FIT:
        ok(env, action)
    obs = ok(env, A("submit_discovery_claim", discovered=False, confidence=0.9))
    state = env.state
    assert obs.done and state.discovered is False and state.reward_components["outcome"] == pytest.approx(3.0)
    assert state.correct_outcome is True and state.correct_mass is None  # nothing to be right about


@pytest.mark.parametrize("fraction, outcome", [(0.2, UNSUPPORTED_NULL), (0.3, CORRECT_NULL)])
def test_a_null_claim_is_graded_only_past_a_quarter_of_the_luminosity_cap_analysed(fraction, outcome):
    """ "Nothing there" is graded against the truth only with at least a quarter of the task's
    luminosity cap analysed (the fit's spectrum holds it all); with a fifth it is unsupported (−1),
    though the world is empty, and the state says the outcome was not right."""
    env, obs = fresh("null_diphoton_750", seed=0)
    cap = obs.task.luminosity_total_fb
    for action in data_actions(obs.task, fraction * cap, energy=13.6):
        ok(env, action)
    for action in NULL_DIPHOTON_FIT:
        ok(env, action)
    assert env._episode.analysed_luminosity_fb == pytest.approx(fraction * cap)
    ok(env, A("submit_discovery_claim", discovered=False, confidence=0.9))
    assert env.state.reward_components["outcome"] == outcome
    assert env.state.correct_outcome is (outcome == CORRECT_NULL)


@pytest.mark.parametrize("max_steps", [3, 5])
def test_max_steps_ends_the_episode_graded_as_no_claim(max_steps):
    env, obs = fresh("higgs_4l_125", seed=0, default_max_steps=max_steps)
    assert obs.task.max_steps == max_steps
    for step in range(1, max_steps + 1):
        obs = env.step(H4L_DATA[step - 1] if step <= 2 else A("select_channel", channel="four_lepton"))
        assert obs.done is (step == max_steps)
    assert "max_steps" in obs.latest_result["episode_end"]
    state = env.state
    assert state.terminal_reward is not None and state.terminal_reward < 0
    assert state.reward_components["outcome"] == NO_CLAIM and state.discovered is False


def test_scenario_max_steps_counts_refused_actions_too():
    env, obs = fresh("z_mumu_91", seed=0)
    limit = obs.task.max_steps
    for step in range(1, limit + 1):
        obs = env.step(A("warp_drive") if step % 2 else A("select_channel", channel="dimuon"))
        assert obs.step_index == step and obs.done is (step == limit)
    assert env.state.reward_components["outcome"] == NO_CLAIM


def test_refused_actions_in_a_row_end_the_episode_graded_as_no_claim():
    env, obs = fresh("z_mumu_91", seed=0)
    for _ in range(MAX_CONSECUTIVE_REFUSALS - 1):
        assert not env.step(A("warp_drive")).done
    # an action that runs starts the count again
    obs = ok(env, A("configure_beam", beam_energy_tev=obs.task.available_beam_energies_tev[0]))
    assert not obs.done
    for step in range(1, MAX_CONSECUTIVE_REFUSALS + 1):
        # refused: unparseable text, or data taken before any luminosity is booked
        obs = env.step("not an action" if step % 2 else A("collect_collisions", luminosity_fb=1.0))
        assert obs.rule_violations and obs.done is (step == MAX_CONSECUTIVE_REFUSALS)
    assert obs.latest_result["episode_end"] == f"{MAX_CONSECUTIVE_REFUSALS} refused actions in a row without a claim"
    assert env.state.reward_components["outcome"] == NO_CLAIM and env.state.discovered is False
    assert obs.reward == pytest.approx(VIOLATION_PENALTY + NO_CLAIM)


def test_budget_exhaustion_ends_the_episode():
    env, obs = fresh("zprime_dilepton_4000", seed=0)
    ok(env, A("configure_beam", beam_energy_tev=13.0))
    obs = ok(env, A("allocate_luminosity", luminosity_fb=395.0 / BEAM_ENERGIES[13.0].cost_musd_per_fb))
    assert obs.done and "budget" in obs.latest_result["episode_end"]
    assert obs.resource_usage.budget_remaining_musd == pytest.approx(0.0, abs=1e-6)
    assert env.state.reward_components["outcome"] == NO_CLAIM
    assert obs.reward == pytest.approx(NO_CLAIM)


def test_time_exhaustion_ends_the_episode():
    env, obs = fresh("dijet_2500", seed=0)
    for action in [
        A("configure_beam", beam_energy_tev=13.6, pileup="low"),
        A("set_trigger", trigger="single_jet"),
        A("allocate_luminosity", luminosity_fb=80.0),
    ]:
        ok(env, action)
    left = obs.task.time_total_days - 3.0 - 0.5 - 1.0
    luminosity = left * PILEUP_SETTINGS["low"].luminosity_rate_factor / BEAM_ENERGIES[13.6].days_per_fb
    obs = ok(env, A("collect_collisions", luminosity_fb=luminosity))
    assert obs.done and "time" in obs.latest_result["episode_end"]
    assert obs.resource_usage.time_remaining_days == pytest.approx(0.0, abs=1e-6)
    assert env.state.reward_components["outcome"] == NO_CLAIM
    assert obs.reward == pytest.approx(NO_CLAIM + MILESTONE_REWARD)  # the collection milestone, then the grade


@pytest.mark.parametrize("ending", ["claim", "max_steps"])
def test_stepping_after_done_changes_nothing(ending):
    env, obs = fresh("higgs_4l_125", seed=0, default_max_steps=None if ending == "claim" else 4)
    for action in H4L_DATA:
        obs = ok(env, action)
    if ending == "claim":
        obs = ok(env, A("submit_discovery_claim", discovered=False, confidence=0.5))
    assert obs.done
    done_obs, done_state = obs, env.state.model_dump_json()
    for action in [
        A("configure_beam", beam_energy_tev=13.0),
        A("submit_discovery_claim", discovered=False, confidence=1.0),
        None,
        A("warp_drive"),
    ]:
        after = env.step(action)
        assert after.done
        assert len(after.rule_violations) == 1 and after.rule_violations[0].startswith("EPISODE_DONE: ")
        assert "reset" in after.rule_violations[0]
        assert after.reward == 0.0 and after.step_index == done_obs.step_index
        assert after.resource_usage == done_obs.resource_usage and after.data_collected == done_obs.data_collected
        assert env.state.model_dump_json() == done_state


def test_state_is_a_copy():
    env, _ = fresh("higgs_4l_125", seed=0)
    state = env.state
    state.cumulative_reward, state.terminal_reward = 99.0, 5.0
    state.reward_components["outcome"] = 3.0
    assert env.state.cumulative_reward == 0.0 and env.state.terminal_reward is None
    assert env.state.reward_components["outcome"] == 0.0


def test_step_before_reset_does_not_raise():
    env = CERNCollisionEnvironment()
    obs = env.step(A("configure_beam", beam_energy_tev=13.0))
    assert isinstance(obs, CollisionObservation) and obs.step_index == 1


# Resources ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scenario, difficulty, seed, energy, pileup",
    [
        ("z_mumu_91", None, 0, 7.0, "nominal"),
        ("higgs_4l_125", None, 0, 13.0, "low"),
        ("higgs_4l_125", None, 0, 13.6, "high"),
        (None, "medium", 1, 8.0, "high"),
        (None, "medium", 1, 13.6, "low"),
    ],
)
def test_collect_charges_time_and_allocate_charges_budget(scenario, difficulty, seed, energy, pileup):
    env, obs = fresh(scenario, seed=seed, difficulty=difficulty)
    luminosity = 0.1 * obs.task.luminosity_total_fb
    configure, trigger, allocate, collect = data_actions(obs.task, luminosity, energy=energy, pileup=pileup)
    ok(env, configure)
    before = ok(env, trigger).resource_usage
    after_allocate = ok(env, allocate).resource_usage
    beam, setting = BEAM_ENERGIES[energy], PILEUP_SETTINGS[pileup]
    assert after_allocate.budget_used_musd - before.budget_used_musd == pytest.approx(
        luminosity * beam.cost_musd_per_fb, rel=1e-5
    )
    assert after_allocate.time_used_days - before.time_used_days == pytest.approx(1.0, rel=1e-5)
    assert after_allocate.luminosity_allocated_fb == pytest.approx(luminosity, rel=1e-5)
    assert after_allocate.luminosity_used_fb == 0.0
    after_collect = ok(env, collect).resource_usage
    assert after_collect.time_used_days - after_allocate.time_used_days == pytest.approx(
        luminosity * beam.days_per_fb / setting.luminosity_rate_factor, rel=1e-5
    )
    assert after_collect.budget_used_musd == after_allocate.budget_used_musd
    assert after_collect.luminosity_used_fb == pytest.approx(luminosity, rel=1e-5)
    assert after_collect.luminosity_allocated_fb == pytest.approx(0.0, abs=1e-9)
    assert after_collect.luminosity_remaining_fb == pytest.approx(obs.task.luminosity_total_fb - luminosity, rel=1e-5)
    for usage in (before, after_allocate, after_collect):
        # Used and remaining are each rounded to 6 significant figures.
        assert usage.budget_used_musd + usage.budget_remaining_musd == pytest.approx(
            obs.task.budget_total_musd, rel=1e-5
        )
        assert usage.time_used_days + usage.time_remaining_days == pytest.approx(obs.task.time_total_days, rel=1e-5)


def test_table_costs_are_charged():
    env, obs = fresh("higgs_4l_125", seed=0)
    previous = obs.resource_usage
    for action in H4L_DATA[:2] + [A("select_channel", channel="four_lepton")]:
        usage = ok(env, action).resource_usage
        spec = ACTION_TABLE[ActionType(action["action_type"])]
        assert usage.budget_used_musd - previous.budget_used_musd == pytest.approx(spec.cost_musd, abs=1e-6)
        assert usage.time_used_days - previous.time_used_days == pytest.approx(spec.time_days, abs=1e-6)
        previous = usage


@pytest.mark.parametrize("seed", range(6))
def test_resources_stay_in_bounds_under_random_play(seed):
    agent = RandomAgent(seed=seed)
    env, obs = fresh(["higgs_4l_125", "z_mumu_91", "dijet_2500"][seed % 3], seed=seed)
    agent.reset()
    task = obs.task
    while not obs.done:
        obs = env.step(agent.act(obs))
        usage = obs.resource_usage
        for used, left, total in [
            (usage.budget_used_musd, usage.budget_remaining_musd, task.budget_total_musd),
            (usage.time_used_days, usage.time_remaining_days, task.time_total_days),
            (usage.luminosity_used_fb, usage.luminosity_remaining_fb, task.luminosity_total_fb),
        ]:
            assert 0 <= used <= total and 0 <= left <= total
        assert usage.luminosity_used_fb + usage.luminosity_allocated_fb <= task.luminosity_total_fb * (1 + 1e-9)


def test_budget_remaining_never_negative_at_the_tolerance_edge():
    env, _ = fresh("zprime_dilepton_4000", seed=0)
    ok(env, A("configure_beam", beam_energy_tev=13.0))
    obs = ok(env, A("allocate_luminosity", luminosity_fb=(395.0 + 5e-10) / BEAM_ENERGIES[13.0].cost_musd_per_fb))
    assert obs.resource_usage.budget_remaining_musd >= 0.0


# Physics through the API -----------------------------------------------------------------


def test_calibration_reduces_the_reported_resolution():
    env, obs = fresh("higgs_diphoton_125", seed=0)
    for action in data_actions(obs.task, 5.0):
        ok(env, action)
    resolutions = [
        ok(env, A("reconstruct_tracks", channel="diphoton")).latest_result["resolution_at_window_centre_gev"]
    ]
    for level in (1, 2):
        obs = ok(env, A("calibrate_detector", channel="diphoton"))
        assert obs.latest_result["calibration_level"] == level == obs.data_collected["diphoton"].calibration_level
        resolutions.append(obs.latest_result["resolution_at_window_centre_gev"])
    assert resolutions[0] > resolutions[1] > resolutions[2] > 0
    assert resolutions[0] / resolutions[1] > 1.2  # uncalibrated is markedly worse


def test_calibration_reduces_the_energy_scale_uncertainty():
    env, obs = fresh("higgs_4l_125", seed=0)
    for action in H4L_DATA:
        ok(env, action)
    first = ok(env, A("calibrate_detector", channel="four_lepton")).latest_result
    second = ok(env, A("calibrate_detector", channel="four_lepton")).latest_result
    assert first["energy_scale_uncertainty_frac"] > second["energy_scale_uncertainty_frac"] > 0


def test_reconstruction_quality_trades_events_for_purity():
    env, obs = fresh("z_mumu_91", seed=0)
    for action in data_actions(obs.task, 0.02):
        ok(env, action)
    ok(env, A("select_channel", channel="dimuon"))
    events, resolution = {}, {}
    for quality in ("standard", "tight", "fast"):
        resolution[quality] = ok(env, A("reconstruct_tracks", channel="dimuon", quality=quality)).latest_result[
            "resolution_at_window_centre_gev"
        ]
        events[quality] = ok(env, A("build_invariant_mass", bin_width_gev=1.0)).latest_result["events"]
    assert events["tight"] < events["standard"] < events["fast"]
    assert events["tight"] > 0.7 * events["standard"]
    assert resolution["tight"] < resolution["standard"] < resolution["fast"]


def test_more_luminosity_records_proportionally_more_events():
    env, obs = fresh("z_mumu_91", seed=0)
    for action in data_actions(obs.task, 0.01)[:3]:
        ok(env, action)
    ok(env, A("allocate_luminosity", luminosity_fb=0.02))
    small = ok(env, A("collect_collisions", luminosity_fb=0.01)).latest_result["events_recorded"]
    obs = ok(env, A("collect_collisions", luminosity_fb=0.02))
    large = obs.latest_result["events_recorded"]
    assert set(small) == set(large) == {"dimuon", "dielectron"}
    for channel in small:
        assert small[channel] > 1000
        assert 1.85 < large[channel] / small[channel] < 2.15, (channel, small, large)
        assert obs.data_collected[channel].recorded_events == small[channel] + large[channel]
        assert obs.data_collected[channel].luminosity_fb == pytest.approx(0.03)


def test_a_trigger_records_only_its_channels():
    env, obs = fresh("higgs_diphoton_125", seed=0)
    for action in data_actions(obs.task, 2.0, channel="diphoton"):
        obs = ok(env, action)
    assert set(obs.latest_result["events_recorded"]) == {"diphoton"}
    assert set(obs.data_collected) == {"diphoton"}
    obs = env.step(A("calibrate_detector", channel="four_lepton"))
    assert obs.rule_violations[0].startswith("MISSING_PREREQUISITE")


def _last_fit(trajectory: List[CollisionObservation]) -> Dict[str, Any]:
    fits = [
        o.latest_result
        for o in trajectory
        if o.latest_result.get("action") == "fit_resonance" and "error" not in o.latest_result
    ]
    assert fits, "the heuristic agent never fitted"
    return fits[-1]


@pytest.mark.parametrize("scenario, seed", [("higgs_4l_125", 0), ("higgs_4l_125", 1), ("z_mumu_91", 0)])
def test_heuristic_fit_mass_within_one_percent(scenario, seed):
    env, obs = fresh(scenario, seed=seed)
    trajectory = run_heuristic(env, obs)
    fit = _last_fit(trajectory)
    true_mass = env.hidden_truth()["mass_gev"]
    assert abs(fit["mass_gev"] - true_mass) < 0.01 * true_mass, (fit, true_mass)
    assert 0 < fit["mass_err_gev"] < 0.01 * true_mass


def test_heuristic_discovers_the_higgs_in_four_leptons():
    """In 20 campaigns: always a discovery in the right channel, at the right mass in all but the
    few whose fitted mass fluctuates beyond the 2σ window (5% expected)."""
    outcomes = []
    for seed in range(20):
        env, obs = fresh("higgs_4l_125", seed=seed)
        run_heuristic(env, obs)
        state = env.state
        assert state.discovered is True and state.correct_channel is True
        outcomes.append(state.reward_components["outcome"])
    assert outcomes.count(CORRECT_OBSERVATION) >= 17, outcomes


def test_z_discovery_with_systematics_is_significant_and_graded_correct():
    # Regression: the spurious-signal systematic once made the Z peak's significance NaN.
    env, obs = fresh("z_mumu_91", seed=0)
    for action in data_actions(obs.task, 0.02) + [
        A("reconstruct_tracks", channel="dimuon"),
        A("select_channel", channel="dimuon"),
        A("build_invariant_mass"),
        A("request_systematics"),
    ]:
        ok(env, action)
    obs = ok(env, A("estimate_significance", mass_gev=91.19))
    assert obs.latest_result["systematics_included"] is True
    assert obs.latest_result["z_local"] is not None and obs.latest_result["z_local"] > 10
    ok(
        env,
        A(
            "submit_discovery_claim",
            discovered=True,
            mass_gev=91.19,
            mass_uncertainty_gev=0.1,
            channel="dimuon",
            spin=1,
            significance_sigma=10.0,
            confidence=0.95,
        ),
    )
    assert env.state.reward_components["outcome"] == CORRECT_OBSERVATION


Z_FULL_DATA = [
    A("configure_beam", beam_energy_tev=7.0),
    A("set_trigger", trigger="dilepton"),
    A("allocate_luminosity", luminosity_fb=0.05),
    A("collect_collisions", luminosity_fb=0.05),
    A("reconstruct_tracks", channel="dimuon"),
    A("select_channel", channel="dimuon"),
    A("build_invariant_mass"),
]


def test_claiming_the_reported_significance_is_accepted():
    # Regression: the Z reaches z_global ~188 with 50 pb^-1, once above the claim model's cap.
    env, obs = fresh("z_mumu_91", seed=0)
    for action in Z_FULL_DATA:
        ok(env, action)
    z_global = ok(env, A("estimate_significance", mass_gev=91.19)).latest_result["z_global"]
    obs = env.step(
        A(
            "submit_discovery_claim",
            discovered=True,
            mass_gev=91.19,
            mass_uncertainty_gev=0.1,
            channel="dimuon",
            spin=1,
            significance_sigma=z_global,
            confidence=0.95,
        )
    )
    assert not obs.rule_violations, obs.rule_violations
    assert obs.done and env.state.reward_components["outcome"] == CORRECT_OBSERVATION


def test_heuristic_agent_gets_its_z_claim_graded():
    # Regression: the heuristic agent's over-cap claim was refused until max_steps.
    env, obs = fresh("z_mumu_91", seed=0)
    trajectory = run_heuristic(env, obs)
    assert trajectory[-1].latest_result.get("graded") is True, trajectory[-1].latest_result
    assert env.state.reward_components["outcome"] == CORRECT_OBSERVATION


# Reward bookkeeping ------------------------------------------------------------------------


def _episode(scenario: str, seed: int) -> Tuple[CERNCollisionEnvironment, List[CollisionObservation]]:
    env, obs = fresh(scenario, seed=seed)
    return env, run_heuristic(env, obs)


@pytest.mark.parametrize("scenario, seed", [("higgs_4l_125", 2), ("higgs_diphoton_125", 1), ("dijet_2500", 0)])
def test_reward_components_sum_to_cumulative_reward(scenario, seed):
    env, trajectory = _episode(scenario, seed)
    state = env.state
    assert set(state.reward_components) == set(COMPONENT_NAMES)
    assert sum(state.reward_components.values()) == pytest.approx(state.cumulative_reward, abs=1e-9)
    assert state.terminal_reward is not None
    # Step rewards are rounded to 6 significant figures in the observation.
    assert sum(o.reward for o in trajectory) == pytest.approx(state.cumulative_reward, abs=1e-5)
    for obs in trajectory[1:]:
        assert set(obs.reward_breakdown) <= set(COMPONENT_NAMES)
        assert {"milestones", "violations", "redundancy"} <= set(obs.reward_breakdown)
        assert sum(obs.reward_breakdown.values()) == pytest.approx(obs.reward, abs=1e-5)
    assert trajectory[-1].reward_breakdown.keys() == set(COMPONENT_NAMES)
    assert 0 < state.reward_components["milestones"] <= MILESTONE_REWARD * len(MILESTONES) + 1e-12


def test_step_rewards_sum_exactly_to_cumulative_reward():
    env, trajectory = _episode("higgs_diphoton_125", 1)
    assert sum(o.reward for o in trajectory) == pytest.approx(env.state.cumulative_reward, abs=1e-6)


def test_penalties_accumulate_in_the_state():
    env, obs = fresh("higgs_4l_125", seed=0)
    rewards = [env.step(A("warp_drive")).reward, env.step(A("build_invariant_mass")).reward]
    ok(env, A("select_channel", channel="four_lepton"))
    rewards.append(env.step(A("select_channel", channel="four_lepton")).reward)
    state = env.state
    assert state.reward_components["violations"] == pytest.approx(2 * VIOLATION_PENALTY)
    assert state.reward_components["redundancy"] == pytest.approx(REDUNDANCY_PENALTY)
    assert (
        state.cumulative_reward
        == pytest.approx(sum(rewards))
        == pytest.approx(2 * VIOLATION_PENALTY + REDUNDANCY_PENALTY)
    )


def test_milestones_are_paid_once():
    env, obs = fresh("higgs_4l_125", seed=0)
    rewards = []
    for action in H4L_SPECTRUM + [
        A("allocate_luminosity", luminosity_fb=2.0),
        A("collect_collisions", luminosity_fb=2.0),
        A("build_invariant_mass"),
    ]:
        rewards.append(ok(env, action).reward_breakdown["milestones"])
    assert rewards.count(MILESTONE_REWARD) == 2  # collisions_collected, spectrum_built
    assert env.state.reward_components["milestones"] == pytest.approx(2 * MILESTONE_REWARD)


def test_random_agent_reward_bookkeeping():
    agent = RandomAgent(seed=3)
    for episode in range(3):
        env, obs = fresh("higgs_4l_125", seed=episode)
        agent.reset()
        total = 0.0
        while not obs.done:
            obs = env.step(agent.act(obs))
            total += obs.reward
            assert set(obs.reward_breakdown) <= set(COMPONENT_NAMES)
        state = env.state
        assert total == pytest.approx(state.cumulative_reward, abs=1e-5)
        assert sum(state.reward_components.values()) == pytest.approx(state.cumulative_reward, abs=1e-9)


def test_analysis_objects_are_the_episodes_own_and_none_until_made():
    """The public view plots and replays read (lib.report.plotting.analysis_snapshot), instead of the
    environment's private episode."""
    env = CERNCollisionEnvironment()
    with pytest.raises(RuntimeError, match="reset"):
        env.analysis_objects()
    agent = HeuristicAgent()
    obs = env.reset(seed=3, scenario="z_mumu_91")
    assert env.analysis_objects() == dict.fromkeys(CERNCollisionEnvironment.ANALYSIS_OBJECTS)
    while not obs.done and env.analysis_objects()["scan"] is None:
        obs = env.step(agent.act(obs))
    objects = env.analysis_objects()
    assert objects["scan"].best_mass_gev == pytest.approx(obs.latest_result["best_mass_gev"], abs=1e-4)
    assert objects["spectrum"].counts.sum() > 0 and objects["resonance_fit"] is None  # no fit made yet


def test_a_fit_s_values_are_shown_to_the_second_digit_of_their_error():
    """`handlers._r_within`: a fitted value keeps no digit below its error's second significant one
    (those say where a minimisation stopped, which rounding moves), and never more significant
    figures than asked; a value with no finite error keeps its significant figures."""
    from cernenv.handlers import _r_within

    assert _r_within(3697.5, 2450.0) == 3700.0
    assert _r_within(91.094637, 0.0302, 6) == 91.095
    assert _r_within(22.1834, 4.74) == 22.2
    assert _r_within(0.0053421, 4.96, 3) == 0.0
    assert _r_within(1234.5678, 0.001) == 1235.0  # four significant figures at most
    assert _r_within(2879.754, math.inf, 6) == 2879.75
    assert _r_within(2879.754, 0.0, 6) == 2879.75
    assert _r_within(None, 1.0) is None
