"""The template agent of docs/agents.md (`examples/template_agent.py`) plays whole episodes in
process and through the scoring path of `make evaluate`, and the forms docs/agents.md says `act`
may return are the ones the environment and the remote player accept."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from cernenv import CERNCollisionEnvironment, ExperimentAction
from cernenv.client import RAW_ACTION_KEY, action_payload
from examples.template_agent import TemplateAgent


def play(agent, env: CERNCollisionEnvironment, **reset_args):
    """The episode's observations, from the reset to the end."""
    agent.reset()
    observations = [env.reset(**reset_args)]
    while not observations[-1].done:
        observations.append(env.step(agent.act(observations[-1])))
    return observations


@pytest.mark.parametrize(
    "reset_args",
    [
        {"seed": 7, "scenario": "higgs_diphoton_125"},
        {"seed": 11, "difficulty": "easy"},
        {"seed": 12, "difficulty": "hard"},
    ],
)
def test_the_template_plays_an_episode_to_its_claim_with_no_action_refused(reset_args):
    env = CERNCollisionEnvironment()
    observations = play(TemplateAgent(), env, **reset_args)
    refused = [(o.step_index, o.rule_violations) for o in observations if o.rule_violations]
    assert not refused, f"the template's plan broke a rule: {refused}"
    assert observations[-1].latest_result.get("action") == "submit_discovery_claim", "it ends on its claim"
    assert len(observations) - 1 <= observations[0].task.max_steps


def test_a_fit_that_ran_to_the_spectrum_s_edge_costs_one_refused_estimate_and_ends_on_nothing_there():
    """The one refusal the plan meets, in about 2 of 100 fresh worlds: the significance estimate at
    the mass of a fit that found no peak inside the window. The plan moves on to its claim, and that
    claim is "nothing there", accepted."""
    env = CERNCollisionEnvironment()
    observations = play(TemplateAgent(), env, seed=1_000_000_021, difficulty="easy", secret_salt="s21")
    refused = [o.latest_result.get("action") for o in observations if o.rule_violations]
    assert refused == ["estimate_significance"], refused
    assert "ran to the spectrum's edge" in observations[-2].rule_violations[0]
    assert observations[-1].latest_result.get("action") == "submit_discovery_claim" and not env.state.discovered


def test_the_template_claims_a_discovery_only_with_a_mass_uncertainty_to_quote():
    """Without `fit.mass_uncertainty_gev` (the data did not constrain the fit's mass) a discovery
    claim would be refused at every step to the step limit: the template claims "nothing there"."""
    significant = {"significance.significance_sigma": 4.2, "fit.mass_gev": 2000.0}
    claim = TemplateAgent.claim(SimpleNamespace(references=significant), "dimuon")
    assert claim.parameters == {"discovered": False, "confidence": 0.7}
    measured = TemplateAgent.claim(
        SimpleNamespace(references={**significant, "fit.mass_uncertainty_gev": 9.0}), "dimuon"
    )
    assert (
        measured.parameters["discovered"] is True
        and measured.parameters["mass_uncertainty_gev"] == "@fit.mass_uncertainty_gev"
    )


def test_the_template_finds_the_curated_higgs():
    """A scripted physicist that cannot find the 125 GeV diphoton Higgs is broken, not unlucky."""
    env = CERNCollisionEnvironment()
    play(TemplateAgent(), env, seed=7, scenario="higgs_diphoton_125")
    state = env.state
    assert state.discovered and state.correct_outcome and state.correct_mass, state


def test_a_dict_of_the_action_s_shape_plays_the_same_episode_as_the_experiment_action():
    class AsDict(TemplateAgent):
        def act(self, observation):
            return super().act(observation).model_dump(mode="json")

    first = play(TemplateAgent(), CERNCollisionEnvironment(), seed=3, difficulty="medium")
    second = play(AsDict(), CERNCollisionEnvironment(), seed=3, difficulty="medium")
    assert [o.model_dump() for o in first] == [o.model_dump() for o in second]


@pytest.mark.parametrize("text", ['{"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6}}', 42])
def test_json_text_or_any_other_value_is_refused_as_an_invalid_action(text):
    """docs/agents.md: text is not parsed for the agent; the step is refused and counted."""
    env = CERNCollisionEnvironment()
    env.reset(seed=1, difficulty="easy")
    observation = env.step(text)
    assert observation.rule_violations and observation.rule_violations[0].startswith("INVALID_ACTION")
    assert observation.selected_beam_energy_tev is None and not observation.done


def test_the_remote_player_sends_each_form_as_the_environment_reads_it():
    action = ExperimentAction(action_type="configure_beam", parameters={"beam_energy_tev": 13.6})
    assert action_payload(action)["action_type"] == "configure_beam"
    assert action_payload({"action_type": "scan_bump", "parameters": {}}) == {
        "action_type": "scan_bump",
        "parameters": {},
    }
    assert action_payload("{}") == {RAW_ACTION_KEY: "{}"}, "text travels as it is, for the environment to refuse"
    with pytest.raises(TypeError, match="an action is an ExperimentAction, a JSON object or a JSON value"):
        action_payload(object())


@pytest.mark.slow
def test_make_evaluate_scores_the_template_as_it_is(tmp_path, capfd):
    """`make evaluate AGENT=examples.template_agent:TemplateAgent SUITE=draw:2`: imported from the
    repository by name, played out of process against an evaluation server, scored and verified."""
    from lib.measure.score_agent import main as score_agent_main

    out = tmp_path / "out"
    status = score_agent_main(
        ["--agent", "examples.template_agent:TemplateAgent", "--suite", "draw:2", "--out", str(out)]
    )
    captured = capfd.readouterr()
    assert status == 0, captured.err[-2000:]
    assert "verified: 2 of 2 episodes replayed identically" in captured.out
    (card_file,) = out.glob("scorecard-*.json")
    card = json.loads(card_file.read_text())
    assert (card["graded"], card["abandoned"], card["unplayed"]) == (2, 0, 0)
    # fresh worlds: an estimate at a fit that ran to the spectrum's edge is refused in about 2 of 100
    # (the test above), at most once an episode; every episode ends on the template's claim
    assert card["counts"]["all"]["refused_actions"] <= 2 and card["counts"]["all"]["ended_without_claim"] == 0
