"""`make evaluate` (`python -m lib.measure.score_agent`) fails loudly when the agent cannot be
scored as asked, scores an agent kept outside the repository, survives an agent's exception, and
says how many actions were refused and how many tasks ended without a claim; an agent whose every
action is refused fails with why, an agent that crashes is reported once as crashed, and two agents
are compared on the same development worlds (`--baseline`)."""

from __future__ import annotations

import json
import tempfile
import textwrap
from pathlib import Path

import pytest

from lib.agents.remote_player import load_agent
from lib.measure.score_agent import main as score_agent_main

FLAKY_AGENT = textwrap.dedent(
    '''
    """An agent kept outside the repository: the heuristic, but it raises in its second episode and
    sends nonsense in its third."""
    from lib.agents.baselines import HeuristicAgent


    class Flaky:
        def __init__(self):
            self.episode = -1

        def reset(self):
            self.episode += 1
            self.inner, self.steps = HeuristicAgent(), 0

        def act(self, observation):
            self.steps += 1
            if self.episode == 1 and self.steps == 3:
                raise ZeroDivisionError("the agent's own bug")
            if self.episode == 2:
                return {"hello": "world"}
            return self.inner.act(observation)
    '''
)


def open_folder() -> Path:
    """A folder outside the test's own (pytest's are closed to other users): the sandboxed agent's
    user must read the agent's module there."""
    folder = Path(tempfile.mkdtemp(prefix="cernenv-test-agent-"))
    folder.chmod(0o755)
    return folder


def test_an_agent_outside_the_repository_needs_its_folder_and_the_error_says_how(tmp_path):
    (tmp_path / "outside_agent.py").write_text(FLAKY_AGENT)
    with pytest.raises(ValueError, match=r"cannot import outside_agent .*AGENT_PATH=its/folder"):
        load_agent("outside_agent:Flaky")


@pytest.mark.slow
def test_an_agent_that_raises_fails_its_episode_the_run_goes_on_and_the_exit_says_so(tmp_path, capfd):
    """The agent, imported from a folder outside the repository (--agent-path, make evaluate's
    AGENT_PATH), raises in one episode: that episode is abandoned (a failure), its traceback printed
    once, the run goes on to the end and is scored and verified, and the exit is 1 with one line
    saying why. Its nonsense episode is counted: five refused actions, ended without a claim."""
    folder = open_folder()
    (folder / "outside_agent.py").write_text(FLAKY_AGENT)
    out = tmp_path / "out"
    status = score_agent_main(
        ["--agent", "outside_agent:Flaky", "--agent-path", str(folder), "--suite", "draw:4", "--out", str(out)]
    )
    captured = capfd.readouterr()
    assert status == 1
    assert captured.err.count("Traceback (most recent call last)") == 1 and "ZeroDivisionError" in captured.err
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith(
        "error: the agent outside_agent:Flaky crashed in 1 of 4 episodes (it raised; first: episode 2"
    )
    assert "verified: 4 of 4 episodes replayed identically" in captured.out
    (card_file,) = out.glob("scorecard-*.json")
    card = json.loads(card_file.read_text())
    assert (card["graded"], card["abandoned"], card["unplayed"]) == (3, 1, 0)
    assert card["counts"]["all"]["refused_actions"] >= 5 and card["counts"]["all"]["ended_without_claim"] >= 1
    assert card["agent_run"]["played"] == 3 and card["agent_run"]["failed"] == 1
    assert len(list(out.glob("*.reveal.json"))) == 1 and len(list(out.glob("*.jsonl"))) == 1


def test_an_agent_that_cannot_be_imported_is_one_line_and_a_failed_exit_before_any_server_starts(tmp_path, capfd):
    status = score_agent_main(["--agent", "no_such_module:Thing", "--suite", "draw:1", "--out", str(tmp_path)])
    captured = capfd.readouterr()
    assert status == 2
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("error: the agent could not be loaded: --agent 'no_such_module:Thing': cannot import")
    assert "Scorecard" not in captured.out and "scored run" not in captured.out and not list(tmp_path.glob("*"))


LYING_AGENT = textwrap.dedent(
    '''
    """An agent that writes its player's summary itself (the path is on its command line) claiming
    a perfect run, then leaves before playing anything."""
    import json
    import sys


    class Liar:
        def reset(self):
            path = sys.argv[sys.argv.index("--summary") + 1]
            with open(path, "w") as handle:
                json.dump({"played": 28, "failed": 0, "first_error": None, "load_error": None}, handle)
            sys.exit(0)

        def act(self, observation):
            raise AssertionError("never reached")
    '''
)

QUITTER_AGENT = textwrap.dedent(
    '''
    """The heuristic for one episode; its process ends at the start of the second."""
    import os

    from lib.agents.baselines import HeuristicAgent


    class Quitter:
        def __init__(self):
            self.episodes = 0

        def reset(self):
            self.episodes += 1
            if self.episodes == 2:
                os._exit(0)
            self.inner = HeuristicAgent()

        def act(self, observation):
            return self.inner.act(observation)
    '''
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "source, name, counts, error",
    [
        (LYING_AGENT, "liar_agent:Liar", (0, 1, 2), "played no episode to its end"),
        (QUITTER_AGENT, "quitter_agent:Quitter", (1, 1, 1), r"left 1 of 2 episodes unfinished \(its process ended"),
    ],
    ids=["overwrites its summary", "exits after one episode"],
)
def test_what_an_agent_played_is_read_from_the_runs_ledger_not_from_its_process(
    tmp_path, capfd, source, name, counts, error
):
    """The agent's process can write anything as its player's summary, or end at any moment: the
    scorecard's `agent_run` and the exit say what the run's ledger holds (played to the end,
    abandoned, never played), and what the process said is kept apart as `player_said`."""
    import re

    folder = open_folder()
    (folder / f"{name.split(':')[0]}.py").write_text(source)
    out = tmp_path / "out"
    status = score_agent_main(["--agent", name, "--agent-path", str(folder), "--suite", "draw:3", "--out", str(out)])
    captured = capfd.readouterr()
    assert status == 1
    assert re.search(error, captured.err.strip().splitlines()[-1]), captured.err[-2000:]
    (card_file,) = out.glob("scorecard-*.json")
    card = json.loads(card_file.read_text())
    assert (card["graded"], card["abandoned"], card["unplayed"]) == counts
    run = card["agent_run"]
    assert (run["played"], run["failed"], run["unplayed"]) == counts and run["exit_status"] == 0
    if name.startswith("liar"):
        assert run["player_said"]["played"] == 28  # kept, not believed
    assert "incomplete" not in captured.out and f"verified: {counts[0] + counts[1]} of" in captured.out
    (receipts,) = out.glob("*.receipts.json")
    assert json.loads(receipts.read_text())["receipts"], "the entrant's client kept no receipt"


MISTAKEN_AGENTS = textwrap.dedent(
    '''
    """Two agents with a beginner's mistake each."""


    class Texter:
        """Returns the JSON text of an action, not the action."""

        def reset(self):
            pass

        def act(self, observation):
            return '{"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6}}'


    class Crasher:
        """Raises in every episode."""

        def reset(self):
            pass

        def act(self, observation):
            raise ValueError("the agent's own bug")
    '''
)


@pytest.mark.slow
def test_an_agent_whose_every_action_is_refused_is_told_why_and_the_run_fails(tmp_path, capfd):
    """act() returns a string: every action is refused (five an episode, then the campaign ends
    without a claim); the exit is 1 and the last line gives the first refusal and what to return."""
    folder = open_folder()
    (folder / "mistaken_agents.py").write_text(MISTAKEN_AGENTS)
    status = score_agent_main(
        ["--agent", "mistaken_agents:Texter", "--agent-path", str(folder), "--suite", "dev:3", "--out", str(tmp_path)]
    )
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert status == 1
    assert last.startswith(
        "error: the environment refused every one of the agent mistaken_agents:Texter's 15 actions (first: episode 1, "
        "step 1: act() returned a str; return an ExperimentAction or a dict"
    ), last


@pytest.mark.slow
def test_an_agent_that_crashes_in_every_episode_is_reported_once_and_claims_no_false_discovery(tmp_path, capfd):
    """One traceback and one line with the count, not a line per episode; the scorecard's
    false-discovery rate leaves the crashed episodes out (n 0: '—'), where it read 1 [1, 1]."""
    folder = open_folder()
    (folder / "mistaken_agents.py").write_text(MISTAKEN_AGENTS)
    out = tmp_path / "out"
    status = score_agent_main(
        ["--agent", "mistaken_agents:Crasher", "--agent-path", str(folder), "--suite", "dev:6", "--out", str(out)]
    )
    captured = capfd.readouterr()
    assert status == 1
    assert captured.err.count("Traceback (most recent call last)") == 1
    assert captured.err.count("ValueError: the agent's own bug") == 3  # the traceback, the player's end, the error
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith(
        "error: the agent mistaken_agents:Crasher crashed in 6 of 6 episodes (it raised; first: episode 1: "
        "ValueError: the agent's own bug; its traceback is above)"
    )
    (card_file,) = out.glob("scorecard-*.json")
    card = json.loads(card_file.read_text())
    assert card["groups"]["null"]["false_discovery_rate"]["n"] == 0 and card["groups"]["null"]["success_rate"]["n"]
    assert "| whole suite, null tasks | mistaken_agents:Crasher | 0 of 2 |" in captured.out
    assert "| — |" in captured.out and "1 [1, 1]" not in captured.out


@pytest.mark.slow
def test_two_agents_are_compared_on_the_same_worlds_with_a_paired_interval(tmp_path, capfd):
    """make evaluate AGENT=... BASELINE=... SUITE=dev:6: both runs verified, on the same tasks and
    worlds (the same truth for each task), then each agent's success and mean reward and
    agent − baseline with its 95% interval; exit 0."""
    out = tmp_path / "out"
    status = score_agent_main(
        ["--agent", "examples.template_agent:TemplateAgent", "--baseline", "lib.agents.baselines:HeuristicAgent",
         "--suite", "dev:6", "--out", str(out)]
    )  # fmt: skip
    captured = capfd.readouterr()
    assert status == 0, captured.err[-2000:]
    assert captured.out.count("verified: 6 of 6 episodes replayed identically, in the public development worlds") == 2
    assert "| | baseline lib.agents.baselines:HeuristicAgent | agent examples.template_agent:TemplateAgent |" in (
        captured.out
    )
    rows = [line for line in captured.out.splitlines() if line.startswith(("| success |", "| mean reward |"))]
    assert len(rows) == 2 and all(row.count("[") == 3 for row in rows), rows
    runs = [
        {(line["task_index"], line["seed"], line["world_nonce"], json.dumps(line["truth"], sort_keys=True))
         for line in map(json.loads, path.open()) if line.get("record") == "episode"}
        for path in out.glob("*.jsonl")
    ]  # fmt: skip
    assert len(runs) == 2 and runs[0] == runs[1] and len(runs[0]) == 6
