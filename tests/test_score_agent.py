"""`make evaluate` (`python -m lib.measure.score_agent`) fails loudly when the agent cannot be
scored as asked, scores an agent kept outside the repository, survives an agent's exception, and
says how many actions were refused and how many tasks ended without a claim."""

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
    assert last.startswith("error: the agent outside_agent:Flaky raised in 1 of 4 episodes (first: episode 2")
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
