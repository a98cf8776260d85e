"""Scored runs, round three: the agent under test cannot reach its scorer (`make evaluate` runs it
as a user of its own, in namespaces of its own, on the evaluation's own loopback), a run verifies
only with its entrant's receipts, which must be in order and cover its end, a run is bound to the
agent that played it, the entrant plays only a run whose nonce it sent, and a server whose ledger
cannot be written plays no new episode."""

from __future__ import annotations

import json
import os
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_run_audit import ENTRANT, copy_of, play

from cernenv.server import ledger as ledger_module
from cernenv.server.ledger import ResultsLedger, public_key_hex
from cernenv.server.runs import receipts_statement, reveal_path
from cernenv.server.scheduler import FairScheduler
from cernenv.server.served import EnvironmentCount, ServedEnvironment
from cernenv.server.wire import RequestError
from lib.agents.remote_player import Receipts, RunRefused, check_own_nonce
from lib.measure.scorecard import main as scorecard_main


@pytest.fixture(scope="module")
def played(tmp_path_factory):
    """A run of 4 drawn tasks, 2 played by the heuristic, then the server stopped; the entrant's
    receipts kept after each episode and at the end, signed."""
    directory = tmp_path_factory.mktemp("run")
    plan = ["heuristic", "heuristic", None, None]
    run = play(directory, "draw:4", lambda k: plan[k], receipts=(receipts := Receipts({}, ENTRANT)))
    receipts.header.update(run_id=run.run_id, commitment=run.commitment, public_key=run.public_key)
    return {
        "run": run,
        "ledger": run.ledger_path,
        "reveal": reveal_path(run.ledger_path),
        "receipts": receipts.signed(),
    }


def verdict(files, *extra):
    return scorecard_main([str(files["ledger"]), "--reveal", str(files["reveal"]), *map(str, extra)])


def resigned(kept, **changes):
    """The entrant's receipts with `changes`, signed again by the entrant (what it could do itself)."""
    kept = {**kept, **changes}
    return {**kept, "entrant_signature": ENTRANT.sign(receipts_statement(kept))}


def test_without_the_entrants_receipts_a_run_is_unattested_and_refused_unless_accepted(played, tmp_path, capsys):
    files = copy_of(played, tmp_path)
    assert verdict(files) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and "unattested: no entrant's receipts" in line
    assert verdict(files, "--accept-unattested") == 0
    assert "\nunattested: 2 of 2 episodes replayed identically" in capsys.readouterr().out
    sent = tmp_path / "sent.json"
    assert verdict(files, "--receipts", files["receipts"], "--json", sent) == 0
    out = capsys.readouterr().out
    assert "verified: 2 of 2" in out and "the ledger holds all 4 of the entrant's receipts, the last its end" in out
    assert verdict(files, "--accept-unattested", "--expect", sent) == 2  # the count is compared with the scorecard's
    assert "receipts_checked is 4; the ledger gives null" in capsys.readouterr().err


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda r: r[::-1], "not after receipt"),
        (lambda r: [x for x in r for _ in range(2)], "not after receipt"),
        (lambda r: r[:1], "the entrant's receipts end at line 2, not at the run's end"),
        (lambda r: r[:-1], "not at the run's end"),
        (lambda r: [], "the entrant's receipts end at line 0"),
    ],
    ids=["reversed", "each twice", "cut to one", "without the end", "none"],
)
def test_receipts_are_in_order_each_line_once_and_cover_the_runs_end(played, tmp_path, capsys, damage, message):
    files = copy_of(played, tmp_path)
    kept = played["receipts"]
    files["receipts"].write_text(json.dumps(resigned(kept, receipts=damage(kept["receipts"]))))
    assert verdict(files, "--receipts", files["receipts"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert message in line, line


@pytest.mark.parametrize(
    "change, message",
    [
        ({"entrant_nonce": None}, "is not the one the entrant sent"),
        ({"agent": "examples.template_agent:TemplateAgent"}, "is not the one the entrant sent"),
        ({"entrant_public_key": public_key_hex(Ed25519PrivateKey.generate())}, "is not the ledger's"),
    ],
    ids=["no nonce", "another agent", "another entrant"],
)
def test_receipts_name_the_runs_nonce_agent_and_entrant(played, tmp_path, capsys, change, message):
    files = copy_of(played, tmp_path)
    files["receipts"].write_text(json.dumps(resigned(played["receipts"], **change)))
    assert verdict(files, "--receipts", files["receipts"]) == 2
    assert message in capsys.readouterr().err
    forged = {**played["receipts"], "receipts": played["receipts"]["receipts"][:-1]}  # not signed again
    files["receipts"].write_text(json.dumps(forged))
    assert verdict(files, "--receipts", files["receipts"]) == 2
    assert "not signed by the entrant's key" in capsys.readouterr().err


def test_a_run_is_bound_to_its_agent_and_another_name_is_refused(played, tmp_path, capsys):
    files = copy_of(played, tmp_path)
    agent = "lib.agents.baselines:HeuristicAgent"
    assert verdict(files, "--receipts", files["receipts"], "--agent", agent) == 0
    assert f"played by {agent}" in capsys.readouterr().out
    assert verdict(files, "--receipts", files["receipts"], "--agent", "examples.template_agent:TemplateAgent") == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f":2: run {played['run'].run_id} was played by {agent} (its nonce line, signed by the entrant)" in line


def test_the_commitment_in_git_needs_a_nonce_that_names_a_commit_of_this_history(played, tmp_path, capsys):
    """A run whose nonce is not a commit of this checkout (a folder bringing a run and a
    commitment.json of its own) has no commitment in git to be checked against: refused."""
    files = copy_of(played, tmp_path)
    (tmp_path / "commitment.json").write_text(json.dumps({"commitment": played["run"].commitment}))
    assert verdict(files, "--receipts", files["receipts"], "--commitment-in-git", "commitment.json") == 2
    assert "names no git commit" in capsys.readouterr().err


def test_an_entrant_plays_only_a_run_whose_nonce_it_sent():
    check_own_nonce({"run_id": "r", "entrant_nonce": None}, None)
    check_own_nonce({"run_id": "r", "entrant_nonce": "mine-0123456789abcdef"}, "mine-0123456789abcdef")
    for sent in (None, "mine-0123456789abcdef"):
        with pytest.raises(RunRefused, match="already has an entrant's nonce .* that this side did not send"):
            check_own_nonce({"run_id": "r", "entrant_nonce": "the-operators-own-nonce"}, sent)


def test_while_the_ledger_cannot_be_written_no_new_episode_is_played_and_the_log_says_so_once(
    tmp_path, monkeypatch, caplog
):
    ledger = ResultsLedger(tmp_path / "results.jsonl")
    scheduler, count = FairScheduler(), EnvironmentCount()
    env = ServedEnvironment(count, scheduler, "a secret", evaluation=True, ledger=ledger)
    env.adopt_session("session-1", "127.0.0.1")
    real = os.statvfs

    class Full:
        f_bavail, f_frsize = 3, 4096

    try:
        monkeypatch.setattr(ledger_module.os, "statvfs", lambda path: Full())
        for _ in range(3):
            with pytest.raises(RequestError, match="cannot be written: its file system has 12288 bytes free"):
                env.reset(difficulty="easy")
        assert sum("plays no new episode" in r.getMessage() for r in caplog.records) == 1
        monkeypatch.setattr(ledger_module.os, "statvfs", real)
        assert not env.reset(difficulty="easy").done  # room again: played
    finally:
        env.close()
        scheduler.shutdown()
        ledger.close()


ATTACKER = textwrap.dedent(
    '''
    """An agent that attacks its scorer instead of playing, and says what it reached."""
    import glob
    import os
    import socket
    import time
    from pathlib import Path


    def attempt(name, action):
        try:
            action()
            print(f"ATTACK {name}: reached", flush=True)
        except Exception as error:
            print(f"ATTACK {name}: refused ({type(error).__name__})", flush=True)


    def write(path):
        with open(path, "a") as handle:
            handle.write("forged\\n")


    def memory():
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) != os.getpid():
                try:
                    open(f"/proc/{pid}/mem", "rb").close()
                    return
                except OSError:
                    pass
        raise PermissionError("no other process's memory")


    def attack():
        repository = os.environ["REPOSITORY"]
        attempt("another process's memory", memory)
        folders = glob.glob("/tmp/cernenv-score-*")
        attempt("the scorer's work folder", lambda: [write(d + "/run.jsonl") for d in folders] or 1 / 0)
        attempt("the repository", lambda: write(repository + "/README.md"))
        attempt("the scorecards", lambda: write(repository + "/build/scorecards/forged.json"))
        attempt("the outside", lambda: socket.create_connection(("192.0.2.1", 80), timeout=2))
        if os.fork() == 0:  # a detached child that outlives the agent
            os.setsid()
            while True:
                try:
                    Path(os.environ["HEARTBEAT"]).write_text(str(time.monotonic()))
                except OSError:
                    pass
                time.sleep(0.05)


    class Attacker:
        attacked = False

        def reset(self):
            if not Attacker.attacked:
                Attacker.attacked = True
                attack()
            raise RuntimeError("an attacker plays nothing")

        def act(self, observation):
            raise RuntimeError("never")
    '''
)


def open_folder() -> Path:
    """A folder every user may read and write (the sandboxed agent's user included)."""
    folder = Path(tempfile.mkdtemp(prefix="cernenv-test-agent-"))
    folder.chmod(0o777)
    return folder


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="make evaluate isolates the agent as a user of its own: root only")
def test_the_agent_under_test_reaches_neither_its_scorer_nor_the_network_and_leaves_nothing_running(
    tmp_path, capfd, monkeypatch
):
    from lib.measure.score_agent import ROOT
    from lib.measure.score_agent import main as score_agent_main

    folder = open_folder()
    (folder / "attacker.py").write_text(ATTACKER)
    (ROOT / "build" / "scorecards").mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("REPOSITORY", str(ROOT))
    monkeypatch.setenv("HEARTBEAT", str(folder / "heartbeat"))
    out = tmp_path / "out"
    status = score_agent_main(["--agent", "attacker:Attacker", "--agent-path", str(folder), "--suite", "draw:2",
                               "--out", str(out)])  # fmt: skip
    captured = capfd.readouterr()
    attacks = [line for line in captured.err.splitlines() if "ATTACK" in line]
    assert len(attacks) == 5 and all("refused" in line for line in attacks), attacks
    assert status == 1 and "crashed in 2 of 2 episodes (it raised" in captured.err.strip().splitlines()[-1]
    assert "verified: 2 of 2 episodes replayed identically" in captured.out
    assert not (ROOT / "build" / "scorecards" / "forged.json").exists()
    beat = (folder / "heartbeat").read_text()
    time.sleep(1.0)  # the child wrote every 0.05 s while it lived
    assert (folder / "heartbeat").read_text() == beat, "the agent's detached child outlived the evaluation"
    (card_file,) = out.glob("scorecard-*.json")
    card = json.loads(card_file.read_text())
    assert (
        card["agent_run"]["isolation"].startswith("user ")
        and "evaluation's own loopback" in card["agent_run"]["isolation"]
    )
