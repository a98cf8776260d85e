"""References to shown values ("@fit.mass_gev"), and a demonstrator that decides from what the policy is shown."""

from __future__ import annotations

import pytest

from cernenv import CERNCollisionEnvironment
from cernenv.references import REFERENCES, resolve_reference
from lib.agents.baselines import HeuristicAgent
from lib.agents.prompting import UNSHOWN_RESULT_KEYS, LLMAgentConfig, parse_reply, render_observation, round_significant
from lib.episodes.agent_rollouts import transitions


def play_until(env, agent, verb, **spec):
    """Play `agent` until it is about to send `verb`; (observation, its action)."""
    for obs, action, _ in transitions(env, agent, **spec):
        if action.action_type.value == verb:
            return obs, action
    raise AssertionError(f"the campaign never reached {verb}")


def test_a_reference_plays_exactly_as_the_value_it_names():
    """The heuristic's significance estimate, sent once as "@fit.mass_gev" and once as the number
    the observation holds under that name, in two copies of the same world: the same result."""
    results = []
    for literal in (False, True):
        env = CERNCollisionEnvironment()
        obs, action = play_until(env, HeuristicAgent(), "estimate_significance", seed=3, scenario="higgs_4l_125")
        assert action.parameters == {"mass_gev": "@fit.mass_gev"}
        parameters = {"mass_gev": obs.references["fit.mass_gev"]} if literal else action.parameters
        results.append(env.step({"action_type": "estimate_significance", "parameters": parameters}).latest_result)
    assert results[0] == results[1] and "error" not in results[0]
    assert results[0]["mass_gev"] == pytest.approx(obs.references["fit.mass_gev"], rel=1e-3)


def test_a_reference_to_nothing_is_refused_with_what_to_write():
    env = CERNCollisionEnvironment()
    env.reset(seed=3, scenario="higgs_4l_125")
    affordable = env.step({"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6}}).references[
        "luminosity.affordable_fb"
    ]
    cases = {
        "@fit.mass_gev": "refers to nothing the observation shows now (references shown: @luminosity.affordable_fb)",
        "@fit.mass": "is not a reference; write one of @scan.best_mass_gev",
        "@luminosity.affordable_fb*0": "must be in (0, 100]",
        "@scan.candidates[0]": "refers to nothing",
    }
    for reference, message in cases.items():
        obs = env.step({"action_type": "allocate_luminosity", "parameters": {"luminosity_fb": reference}})
        assert len(obs.rule_violations) == 1 and obs.rule_violations[0].startswith("INVALID_PARAMETERS")
        assert message in obs.rule_violations[0], obs.rule_violations[0]
        assert obs.resource_usage.luminosity_allocated_fb == 0
    obs = env.step(
        {"action_type": "allocate_luminosity", "parameters": {"luminosity_fb": "@luminosity.affordable_fb*0.5"}}
    )
    assert not obs.rule_violations
    assert obs.resource_usage.luminosity_allocated_fb == pytest.approx(0.5 * affordable)
    assert obs.resource_usage.luminosity_bookings == 1
    with pytest.raises(ValueError, match="not a number"):
        resolve_reference("@fit.channel*2", {"fit.channel": "diphoton"})


def test_every_documented_reference_is_shown_in_a_campaign():
    """Each name `REFERENCES` documents appears in some heuristic campaign's observations, with the
    value the logbook holds, and the prompt writes it as a reply quotes it."""
    seen = {}
    env = CERNCollisionEnvironment()
    for seed, scenario in ((3, "higgs_4l_125"), (5, "higgs_diphoton_125")):
        for obs, _, next_obs in transitions(env, HeuristicAgent(), seed=seed, scenario=scenario):
            for name, value in next_obs.references.items():
                seen[name.split("[")[0] + ("[i]" if "[" in name else "")] = value
                if not name.startswith("scan.candidates["):
                    assert f"@{name}=" in render_observation(next_obs)
            fit = next_obs.logbook.get("fit_resonance")
            if fit:
                assert next_obs.references["fit.mass_gev"] == fit["mass_gev"]
    assert set(seen) == set(REFERENCES) - {"luminosity.booked_fb"} | {"luminosity.booked_fb"} & set(seen)
    assert "luminosity.booked_fb" in seen and "angular.spin" in seen


def test_an_omitted_mass_hint_fits_the_strongest_scan_candidate():
    """A rebuilt histogram clears the scan; a fit without a hint still starts at the best mass the
    channel's last scan found (the logbook's), as the heuristic's "@scan.best_mass_gev" does."""
    fits = []
    for parameters in ({}, {"mass_hint_gev": "@scan.best_mass_gev"}):
        env = CERNCollisionEnvironment()
        obs, action = play_until(env, HeuristicAgent(), "fit_resonance", seed=11, difficulty="medium")
        assert obs.latest_result["action"] == "build_invariant_mass" and "scan.best_mass_gev" in obs.references
        fits.append(env.step({"action_type": "fit_resonance", "parameters": parameters}).latest_result)
    assert fits[0] == fits[1]


def shown_only(obs, config=LLMAgentConfig()):
    """`obs` with everything the prompt does not show changed or dropped: older history, unshown
    result keys, the problem statement, logbook fields the logbook line does not print, the
    digits past the fourth of every number, the reward breakdown."""
    logbook_fields = {
        "scan_bump": ("channel", "best_mass_gev", "best_z_local"),
        "fit_resonance": ("channel", "mass_gev"),
        "request_systematics": ("channel",),
        "estimate_significance": ("z_global",),
        "measure_angular": ("best_spin",),
    }
    logbook = {
        key: {field: entry.get(field) for field in logbook_fields.get(key.split("/")[0], ())}
        for key, entry in obs.logbook.items()
    }
    result = {k: v for k, v in obs.latest_result.items() if k not in UNSHOWN_RESULT_KEYS}
    task = obs.task.model_copy(update={"problem_statement": "another statement"})
    return obs.model_copy(
        update={
            "task": task,
            "pipeline_history": obs.pipeline_history[-config.max_history_steps :],
            "latest_result": round_significant(result),
            "logbook": round_significant(logbook),
            "references": round_significant(dict(obs.references)),
            "reward_breakdown": {},
            "reward": None,
        }
    )


@pytest.mark.parametrize(
    "spec",
    [
        {"seed": 3, "scenario": "higgs_4l_125"},
        {"seed": 40_001, "difficulty": "hard"},
        {"seed": 40_002, "difficulty": "easy"},
        {"seed": 40_005, "difficulty": "medium"},
    ],
)
def test_the_heuristic_decides_from_what_the_policy_is_shown(spec):
    """At every step: a fresh heuristic sends what the playing one sends (it keeps no memory), and
    so does one handed the observation with everything the prompt does not show changed (what it
    reads is what the policy reads). Every number it takes from an observation is a reference."""
    env, playing = CERNCollisionEnvironment(), HeuristicAgent()
    for obs, action, _ in transitions(env, playing, **spec):
        hidden_changed = shown_only(obs)
        assert render_observation(hidden_changed) == render_observation(obs), "shown_only changed what is shown"
        assert HeuristicAgent().act(obs) == action
        assert HeuristicAgent().act(hidden_changed) == action
        assert parse_reply(action.model_dump_json(), obs.references).ok
        for name in ("mass_gev", "mass_hint_gev", "mass_uncertainty_gev", "significance_sigma", "luminosity_fb"):
            value = action.parameters.get(name)
            assert value is None or isinstance(value, str) or value == 0.0, (name, value)


def test_a_claim_quoting_its_fit_by_reference_counts_as_quoting_its_own_fit():
    from lib.measure.metrics import METRICS

    _, include, quotes = METRICS["claims_quote_own_fit"]

    def episode(mass):
        claim = {"action_type": "submit_discovery_claim", "parameters": {"discovered": True, "mass_gev": mass}}
        return {"steps": [{"action": claim, "prompt": "Last (fit_resonance): mass_gev=125.3"}]}

    assert include(episode("@fit.mass_gev")) and quotes(episode("@fit.mass_gev")) == 1.0
    assert quotes(episode("@scan.best_mass_gev")) == 0.0
    assert quotes(episode(125.3)) == 1.0 and quotes(episode(130.0)) == 0.0


REFERENCE_TEXTS = (
    "@fit.mass_gev",
    "@fit.mass_gev*0.5",
    "@luminosity.affordable_fb*100",
    "@scan.candidates[0]",
    "@scan.candidates[00]",
    "@scan.candidates[007]",
    "@scan.candidates[0000]",
    "@fit.mass_gev*١",  # ARABIC-INDIC DIGIT ONE
    "@fit.mass_gev*۲",  # EXTENDED ARABIC-INDIC DIGIT TWO
    "@fit.mass_gev*１",  # FULLWIDTH DIGIT ONE
    "@scan.candidates[١]",
    "@scan.candidates[߀]",  # NKO DIGIT ZERO
    "@fit.mass_gev*1.٥",
    "@fit.mass_gev\n",
    "@colleccollec.collec",  # a name that does not exist: no reference for the schema either
    "@scan.candidates",  # an indexed name without its index
    "@fit.mass_gev[0]",  # a plain name with one
    "@fit.mass_gev*2\n",
    "\n@fit.mass_gev",
    "@fit.mass_gev*1e3",
    "@fit.mass_gev*-1",
    "@ｆit.mass_gev",
    "@fit.mass_gev ",
)


def test_references_take_ascii_digits_only_and_the_published_schema_accepts_what_the_parser_does():
    """Digits of other scripts (which Python's `\\d` matches) are no reference, for the parser and
    for the JSON schema the action schema publishes alike; a trailing newline neither, nor a name
    that does not exist (a model held to the schema cannot write one). Every
    string is accepted by both or refused by both, and an index means its number: [00] is [0]."""
    import jsonschema

    from cernenv.references import reference_json_schema
    from lib.agents.prompting import action_json_schema

    shown = {
        "fit.mass_gev": 125.0,
        "luminosity.affordable_fb": 2.0,
        "scan.candidates[0]": 120.0,
        "scan.candidates[7]": 7.0,
    }
    schema = reference_json_schema()
    estimate = next(b for b in action_json_schema()["oneOf"] if b["title"] == "estimate_significance")
    accepted = {}
    for text in REFERENCE_TEXTS:
        valid = jsonschema.Draft202012Validator(schema).is_valid(text)
        action_valid = jsonschema.Draft202012Validator(estimate).is_valid(
            {"action_type": "estimate_significance", "parameters": {"mass_gev": text}}
        )
        try:
            value = resolve_reference(text, shown)
        except ValueError as error:
            value = error
        assert valid == action_valid, text
        assert valid == (not isinstance(value, ValueError) or "refers to nothing" in str(value)), (text, value)
        accepted[text] = value
    assert accepted["@scan.candidates[00]"] == accepted["@scan.candidates[0]"] == 120.0
    assert accepted["@scan.candidates[007]"] == 7.0
    for text in (
        "@fit.mass_gev*١",
        "@scan.candidates[١]",
        "@fit.mass_gev*１",
        "@fit.mass_gev\n",
        "@colleccollec.collec",
    ):
        assert isinstance(accepted[text], ValueError) and "is not a reference" in str(accepted[text])


def test_a_fit_that_ran_to_the_edge_says_so_and_the_heuristic_claims_rather_than_repeat_a_refusal():
    """A resonance fit whose mass ran to the spectrum's edge says so in its result; a significance
    estimate quoting that mass is refused with why and what to do; the heuristic, told no, claims
    instead of sending the refused action again (which once ended campaigns on 5 refusals in a row)."""
    env = CERNCollisionEnvironment()
    for seed in range(1000, 1400):
        for obs, action, next_obs in transitions(env, HeuristicAgent(), seed=seed, difficulty="hard"):
            if "ran to the spectrum's edge" in (next_obs.logbook.get("fit_resonance") or {}).get("note", ""):
                break
        else:
            continue
        break
    else:
        raise AssertionError("no fit ran to the spectrum's edge in 400 hard campaigns")
    fit = next_obs.logbook["fit_resonance"]
    assert "ran to the spectrum's edge" in fit["note"] and "no peak inside the window" in fit["note"]
    obs = next_obs
    while not obs.done:  # on to the refused estimate, as the heuristic plays it
        action = HeuristicAgent().act(obs)
        if action.action_type.value == "estimate_significance":
            break
        obs = env.step(action)
    refused = env.step(action)
    (violation,) = refused.rule_violations
    assert (
        f"not at {fit['mass_gev']:g}" in violation
        and "the latest fit's mass, which ran to the spectrum's edge" in violation
    )
    assert "fit again from another mass_hint_gev" in violation
    after = HeuristicAgent().act(refused)
    assert after.action_type.value == "submit_discovery_claim" and after.parameters["discovered"] is False


@pytest.mark.slow
def test_the_heuristic_never_ends_a_campaign_on_refusals_in_a_row():
    """150 procedural campaigns on evaluation-split seeds, in hidden worlds: at most one ends
    on refused actions in a row (3 of 150 did before the heuristic stopped repeating a refused
    significance estimate)."""
    import numpy as np

    from cernenv.scenarios import DIFFICULTIES
    from cernenv.suite import DRAW_SEED_START

    env = CERNCollisionEnvironment(secret_salt="a fixed test secret")
    rng = np.random.default_rng(48)
    endings = []
    for index in range(150):
        seed = DRAW_SEED_START + int(rng.integers(2**62))
        for _, _, next_obs in transitions(env, HeuristicAgent(), seed=seed, difficulty=DIFFICULTIES[index % 3]):
            pass
        endings.append(next_obs.latest_result.get("episode_end", "claim"))
    refusals = [ending for ending in endings if "refused actions in a row" in ending]
    assert len(refusals) <= 1, refusals
