"""How an episode ended (`lib.episodes.records.episode_ending`), on episodes the environment played."""

from __future__ import annotations

import pytest

from cernenv import CERNCollisionEnvironment
from lib.agents.baselines import AlwaysNullAgent, HeuristicAgent
from lib.episodes.agent_rollouts import collect_agent_episode
from lib.episodes.records import ENDINGS, episode_ending
from lib.measure.metrics import metric_values

CONFIGURE_BEAM = {"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6}}


class Scripted:
    """Sends the same payload every step."""

    def __init__(self, payload):
        self.payload = payload

    def reset(self):
        pass

    def act(self, obs):
        return self.payload


def play(agent, seed=3, **env_kwargs):
    env = CERNCollisionEnvironment(**env_kwargs)
    return collect_agent_episode(env=env, agent=agent, seed=seed, difficulty="easy")


def test_a_claim_of_either_kind_is_told_from_no_claim():
    claimed = play(HeuristicAgent())
    assert episode_ending(claimed) in ("claimed a discovery", "claimed nothing there")
    assert episode_ending(claimed) == ("claimed a discovery" if claimed.discovered else "claimed nothing there")
    null = play(AlwaysNullAgent())
    assert episode_ending(null) == "claimed nothing there" and null.discovered is False

    refused = play(Scripted({"action_type": "fit_resonance", "parameters": {}}))
    assert refused.discovered is False, "the grade says 'not discovered' for an episode that never claimed"
    assert episode_ending(refused) == "no claim: refusals in a row"
    assert [metric_values(name, [refused])[0] for name in ("no_claim_rate", "null_claim_rate")] == [1.0, 0.0]
    assert [metric_values(name, [null])[0] for name in ("no_claim_rate", "null_claim_rate")] == [0.0, 1.0]


def test_the_step_limit_and_a_rollout_that_stopped_early():
    stalling = Scripted(CONFIGURE_BEAM)
    capped = play(stalling, default_max_steps=3)  # runs, then is redundant: never five refusals
    assert episode_ending(capped) == "no claim: step limit"
    stopped = capped.to_dict()
    stopped["steps"] = stopped["steps"][:-1]
    assert episode_ending(stopped) == "no claim: stopped before the end"
    assert episode_ending({**stopped, "unfinished": True}) == "not played"


def test_a_refused_claim_is_no_claim():
    """A claim the rules refuse (here: before any data) does not end the episode as a claim."""
    premature = Scripted(
        {"action_type": "submit_discovery_claim", "parameters": {"discovered": True, "mass_gev": 125.0}}
    )
    episode = play(premature)
    assert episode.steps[-1].rule_violations
    assert episode_ending(episode) == "no claim: refusals in a row"


@pytest.mark.parametrize("ending", ENDINGS)
def test_every_ending_is_a_short_phrase(ending):
    assert ending == ending.strip() and len(ending) <= 40


@pytest.mark.parametrize(
    "agent, env_kwargs",
    [
        (Scripted({"action_type": "fit_resonance", "parameters": {}}), {}),
        (Scripted(CONFIGURE_BEAM), {"default_max_steps": 3}),
        (AlwaysNullAgent(), {}),
        (HeuristicAgent(), {}),
    ],
)
def test_a_server_s_record_and_the_steps_tell_the_same_ending(agent, env_kwargs):
    """A scored run names an ending from the environment's end reason and the claim sent
    (`ending_of_end`, what a ledger holds); an episode record from its steps: the same ending."""
    from cernenv.rules import END_WITHOUT_CLAIM
    from lib.episodes.agent_rollouts import transitions
    from lib.episodes.records import ending_of_end

    env = CERNCollisionEnvironment(**env_kwargs)
    last = None
    for _, payload, next_obs in transitions(env, agent, seed=3, difficulty="easy"):
        last = (payload, next_obs)
    payload, final = last
    claimed = final.latest_result.get("episode_end") is None
    claim = (payload if isinstance(payload, dict) else payload.model_dump())["parameters"] if claimed else None
    ended = "claim" if claimed else final.latest_result["episode_end"]
    assert claimed or ended in END_WITHOUT_CLAIM.values()
    assert ending_of_end(ended, claim, abandoned=False) == episode_ending(play(agent, **env_kwargs))


def test_an_unknown_end_reason_is_refused():
    from lib.episodes.records import ending_of_end

    assert ending_of_end("abandoned: reset", None, abandoned=True) == "not played"
    with pytest.raises(ValueError, match="none of"):
        ending_of_end("the cat ate it", None, abandoned=False)
