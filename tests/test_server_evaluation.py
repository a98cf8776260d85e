"""The server's evaluation mode (its default) against an outside evaluator who wants the answers.

In evaluation mode every reset draws a fresh world with a secret the server holds, and nothing
on the wire carries a grade: the grades go to the operator's results ledger. Here the bisection
attack (reset a seed, claim blind, read every answer, halve the interval by what was read) runs
against a live server, with and without data, and every answer it reads is the same whatever the
world and whatever the claim (what it recovered before: docs/openenv.md). Also: the secret the
server makes and names by fingerprint, the ledger's lines, MCP under the same rules, and
`openenv validate --url`.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any, Dict, List

import pytest
from test_server import Server, call

from cernenv import CERNCollisionEnvironment
from cernenv.client import parse_observation
from cernenv.models import DiscoveryClaim
from cernenv.scenarios import procedural_scenario
from cernenv.server.evaluation import fingerprint, generated_secret
from cernenv.server.ledger import read_ledger

from truth_leaks import blank_random_ids

pytestmark = pytest.mark.slow  # a server in its own process, attacked (`make test-slow` runs them)

SEEDS = range(902_000, 902_005)
QUERIES = 29


@pytest.fixture(scope="module")
def evaluation_server():
    """`python -m cernenv.server` as an operator starts it: no flag but the port (evaluation mode)."""
    server = Server(mode=None)
    yield server
    server.stop()


def _claim(seed: int, lo: float, hi: float) -> Dict[str, Any]:
    middle = 0.5 * (lo + hi)
    parameters = {
        "discovered": True,
        "mass_gev": middle,
        "mass_uncertainty_gev": max(0.25 * (hi - lo), 1e-3),
        "channel": procedural_scenario(seed, "easy").channels[0],
        "significance_sigma": 5.0,
        "confidence": 0.9,
    }
    return {"action_type": "submit_discovery_claim", "parameters": parameters}


def _read_everything(server: Server, ws: Any, action: Dict[str, Any]) -> str:
    """The answer to `action` (a claim) and the state after it, ids blanked: all the attacker reads."""
    answer = call(ws, {"type": "step", "data": action})
    assert answer["type"] == "observation" and answer["data"]["done"] is True, answer
    observation = answer["data"]["observation"]
    state = call(ws, {"type": "state"})["data"]
    return blank_random_ids(json.dumps([observation["latest_result"], answer["data"]["reward"], observation, state]))


def test_the_bisection_attack_recovers_nothing_from_a_server_in_its_default_mode(evaluation_server):
    """The evaluator's attack: for each of 5 seeds, 29 rounds of reset, a blind claim at the
    middle of the interval left, everything read back (the claim's answer, the state, the HTTP
    routes), and the interval halved by what was read. Every answer for a seed is the same, while
    the ledger shows that the worlds behind them differed: with and without a particle, at
    different masses, each reset a new world."""
    server = evaluation_server
    before = len(read_ledger(server.ledger)) if server.ledger.exists() else 0
    server.wait_open_environments(0)
    routes_before = [server.http("GET", path)[1] for path in ("/state", "/sessions", "/evaluation", "/metadata")]
    with server.ws() as ws:
        for seed in SEEDS:
            lo, hi = procedural_scenario(seed, "easy").search_window_gev
            read: List[str] = []
            for _ in range(QUERIES):
                reply = call(ws, {"type": "reset", "data": {"seed": seed, "difficulty": "easy"}})
                assert reply["type"] == "observation"
                read.append(_read_everything(server, ws, _claim(seed, lo, hi)))
                middle = 0.5 * (lo + hi)
                lo, hi = (middle, hi) if ("-2" in read[-1] or "unsupported" in read[-1]) else (lo, middle)
            assert len(set(read)) == 1, f"seed {seed}: {len(set(read))} different answers"
            assert "withheld" in read[0] and '"outcome"' not in read[0] and '"terminal_reward": null' in read[0]
    server.wait_open_environments(0)  # the last session's close reaches the server after its socket's
    routes_after = [server.http("GET", path)[1] for path in ("/state", "/sessions", "/evaluation", "/metadata")]
    assert routes_after == routes_before
    episodes = read_ledger(server.ledger)[before:]
    assert len(episodes) == len(SEEDS) * QUERIES and {e.ended for e in episodes} == {"claim"}
    exists = {e.truth["exists"] for e in episodes}
    masses = {e.truth["mass_gev"] for e in episodes if e.truth["exists"]}
    assert exists == {True, False} and len(masses) > QUERIES  # the answers hid different worlds
    for seed in SEEDS:
        nonces = [e.world_nonce for e in episodes if e.seed == seed]
        assert len(set(nonces)) == QUERIES  # no seed is ever replayed into the same world


def test_a_claim_made_after_taking_data_answers_alike_in_every_world_and_at_every_mass(evaluation_server):
    """With data the observations before the claim differ from world to world (they are the
    data), but the claim's own answer, its reward and the state after it say the same in every
    world, whatever mass and uncertainty are claimed."""
    server = evaluation_server
    answers: Dict[int, set] = {902_010: set(), 902_011: set()}  # per seed: its task, hence its milestones
    with server.ws() as ws:
        for query in range(8):
            seed = 902_010 + query % 2
            reply = call(ws, {"type": "reset", "data": {"seed": seed, "difficulty": "easy"}})
            task = parse_observation(reply["data"]).task
            lumi = 0.1 * task.luminosity_total_fb
            for verb, parameters in (
                ("configure_beam", {"beam_energy_tev": max(task.available_beam_energies_tev)}),
                ("set_trigger", {"trigger": task.available_triggers[0]}),
                ("allocate_luminosity", {"luminosity_fb": lumi}),
                ("collect_collisions", {"luminosity_fb": lumi}),
            ):
                reply = call(ws, {"type": "step", "data": {"action_type": verb, "parameters": parameters}})
                assert reply["type"] == "observation"
            lo, hi = task.search_window_gev
            claim = _claim(seed, lo + (hi - lo) * query / 8, lo + (hi - lo) * (query + 1) / 8)
            answer = call(ws, {"type": "step", "data": claim})["data"]
            observation = answer["observation"]
            state = call(ws, {"type": "state"})["data"]
            said = [observation["latest_result"], answer["reward"], observation["reward_breakdown"], answer["done"]]
            said.append({k: v for k, v in state.items() if k != "episode_id"})
            answers[seed].add(json.dumps(said))
    assert [len(said) for said in answers.values()] == [1, 1], answers


def test_the_server_makes_its_secret_once_names_it_by_fingerprint_and_never_shows_it(evaluation_server):
    server = evaluation_server
    secret_file = Path(server.state_dir.name) / "evaluation.secret"
    secret = secret_file.read_text().strip()
    assert len(secret) >= 40 and stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    status, described = server.http("GET", "/evaluation")
    assert status == 200 and described == {
        "mode": "evaluation",
        "secret_fingerprint": fingerprint(secret),
        "fresh_worlds": True,
        "grades": "withheld: recorded for the operator when each episode ends",
        "scored_run": None,
    }
    output = server.output()
    assert f"evaluation secret {fingerprint(secret)}" in output and secret not in output
    assert str(server.ledger) in output
    for path in ("/metadata", "/schema", "/openapi.json", "/sessions", "/state"):
        assert secret not in json.dumps(server.http("GET", path)[1])


def test_a_generated_secret_is_made_once_even_by_two_servers_at_once(tmp_path):
    path = tmp_path / "state" / "evaluation.secret"
    made: List[str] = []
    threads = [threading.Thread(target=lambda: made.append(generated_secret(path))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(made)) == 1 and generated_secret(path) == made[0] and len(made[0]) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and os.listdir(path.parent) == ["evaluation.secret"]


def test_the_ledger_keeps_one_whole_line_per_ended_episode(evaluation_server):
    """A graded episode (the WebSocket's, an MCP session's), one cut short by a reset, and one
    left unfinished when its session ended: one line each, with where it was played, its seed,
    world nonce, grade (none if abandoned) and truth. Lines are appended whole."""
    server = evaluation_server
    before = len(read_ledger(server.ledger))
    blind = {"action_type": "submit_discovery_claim", "parameters": {"discovered": False, "confidence": 0.6}}
    with server.ws(source="127.0.0.7") as ws:
        call(ws, {"type": "reset", "data": {"seed": 902_020, "difficulty": "medium", "episode_id": "left-by-reset"}})
        call(ws, {"type": "reset", "data": {"seed": 902_021, "difficulty": "medium", "episode_id": "graded"}})
        assert call(ws, {"type": "step", "data": blind})["data"]["done"]
        call(ws, {"type": "reset", "data": {"seed": 902_022, "difficulty": "medium", "episode_id": "left-open"}})
    session = server.mcp("openenv/session/create", source="127.0.0.8")["result"]["session_id"]
    arguments = {"seed": 902_023, "difficulty": "hard", "episode_id": "over-mcp"}
    server.mcp("tools/call", {"session_id": session, "name": "new_campaign", "arguments": arguments}, "127.0.0.8")
    server.mcp("tools/call", {"session_id": session, "name": "act", "arguments": blind}, "127.0.0.8")
    server.mcp("openenv/session/close", {"session_id": session}, source="127.0.0.8")
    assert server.wait_open_environments(0) == 0
    records = {r.episode_id: r for r in read_ledger(server.ledger)[before:]}
    in_process = CERNCollisionEnvironment()  # what a blind claim's step earns besides its grade
    in_process.reset(seed=902_021, difficulty="medium")
    in_process.step(blind)
    step_reward = in_process.state.cumulative_reward - in_process.state.terminal_reward
    assert set(records) == {"left-by-reset", "graded", "left-open", "over-mcp"}
    assert records["left-by-reset"].ended == "abandoned: reset" and records["left-by-reset"].grade is None
    assert records["left-open"].ended == "abandoned: session ended" and records["left-open"].grade is None
    for name, client in (("graded", "127.0.0.7"), ("over-mcp", "127.0.0.8")):
        record = records[name]
        assert record.ended == "claim" and record.client == client and record.mode == "evaluation"
        assert record.grade is not None and record.claim == DiscoveryClaim(**blind["parameters"]).model_dump(
            mode="json"
        )
        assert set(record.truth) >= {"exists", "mass_gev"} and len(record.world_nonce) == 32
        assert record.secret_fingerprint == server.http("GET", "/evaluation")[1]["secret_fingerprint"]
        assert record.episode_reward == pytest.approx(record.grade.terminal_reward + step_reward)
    assert records["over-mcp"].seed == 902_023 and records["over-mcp"].session_id == session
    assert stat.S_IMODE(server.ledger.stat().st_mode) == 0o600


def test_an_mcp_agent_plays_an_episode_with_openenvs_own_client_and_grades_withheld(evaluation_server):
    """OpenEnv's `MCPToolClient` (its HTTP path: a session made by `openenv/session/create`,
    then `tools/list` and `tools/call`) plays a HeuristicAgent episode through the `act` tool;
    the answers carry no grade, the ledger gets it, and closing the client ends the session."""
    from openenv.core.mcp_client import MCPToolClient

    from lib.agents.baselines import HeuristicAgent

    server = evaluation_server
    before = len(read_ledger(server.ledger))

    async def play() -> Dict[str, Any]:
        client = MCPToolClient(base_url=server.url)
        try:
            tools = {tool.name for tool in await client.list_tools()}
            assert tools == {"new_campaign", "act", "campaign_state"}
            reply = await client.call_tool("new_campaign", seed=902_040, difficulty="medium")
            agent, observation = HeuristicAgent(), parse_observation(reply)
            while not observation.done:
                action = agent.act(observation).model_dump(mode="json")
                observation = parse_observation(await client.call_tool("act", **action))
            assert observation.latest_result["grade"] == "withheld until the evaluation ends"
            return await client.call_tool("campaign_state")
        finally:
            await client.close()

    state = asyncio.run(play())
    assert state["terminal_reward"] is None and "outcome" not in state["reward_components"]
    assert server.wait_open_environments(0) == 0
    (record,) = read_ledger(server.ledger)[before:]
    assert record.seed == 902_040 and record.grade is not None


def test_openenv_validate_passes_against_a_live_server(evaluation_server):
    """What `openenv validate --url` checks (OpenEnv's `validate_running_environment`, which the
    command runs: OpenAPI, health, metadata, schema, a JSON-RPC answer from `POST /mcp`, the
    mode's routes), against the server in its default mode; every criterion passes. (The command
    itself spends 10 s importing its CLI: `openenv validate --url http://127.0.0.1:8000` does the same.)"""
    from openenv.cli._validation import validate_running_environment

    report = validate_running_environment(evaluation_server.url, timeout_s=30.0)
    failed = [c for c in report["criteria"] if not c["passed"]]
    assert report["passed"] and not failed, failed
    assert {"mcp_endpoint", "health_endpoint", "schema_endpoint", "mode_endpoint_consistency"} <= {
        c["id"] for c in report["criteria"]
    }
