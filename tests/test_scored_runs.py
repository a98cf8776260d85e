"""Scored runs and the records they leave: the server assigns every task and counts abandoned ones
(`cernenv.server.runs`), the results ledger is typed on write and on read (`cernenv.server.ledger`),
one scorer reads it (`lib.measure.scorecard`), and an agent scored out of process
(`lib.measure.score_agent`) finds nothing of the truth by introspecting its own process."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
import pytest
from test_server import Server, call

from cernenv.scenarios import EVALUATION_SEED_START
from cernenv.server import ledger as ledger_module
from cernenv.server.audit import read_run
from cernenv.server.ledger import LedgerError, ResultsLedger, read_ledger, utc_now
from cernenv.server.runs import reveal_path
from cernenv.suite import DRAW_SEED_START, selected_tasks, suite_tasks
from lib.measure.scorecard import main as scorecard_main
from lib.measure.scorecard import score_run

TESTS = Path(__file__).resolve().parent
ENTRANT_NONCE = "entrant-nonce-sent-after-the-commitment"


def signed_nonce(server: Any, nonce: str = ENTRANT_NONCE) -> Dict[str, Any]:
    """The body of `POST /evaluation/nonce` for the scored run `server` serves: `nonce`, signed by an
    entrant of its own with the heuristic as the agent (lib.agents.remote_player.Entrant)."""
    from lib.agents.remote_player import Entrant

    run = server.http("GET", "/evaluation")[1]["scored_run"]
    return Entrant("lib.agents.baselines:HeuristicAgent", "0" * 64, nonce).nonce_body(run["run_id"], run["commitment"])


NULL_CLAIM = {"action_type": "submit_discovery_claim", "parameters": {"discovered": False, "confidence": 0.6}}


# The typed ledger ------------------------------------------------------------------------------


def episode_line(task_index: int = 0, *, run_id: str = "r1", correct: bool = True, abandoned: bool = False, **more):
    """A valid `EpisodeEnded` record of task `task_index` of run `run_id`."""
    grade = {
        "terminal_reward": 3.0 if correct else -2.0,
        "components": {"outcome": 3.0 if correct else -2.0},
        "discovered": False,
        "correct_outcome": correct,
        "correct_mass": None,
        "correct_channel": None,
        "correct_spin": None,
        "reference_z_global": 0.0,
    }
    return {
        "record": "episode",
        "ended_at": utc_now(),
        "mode": "evaluation",
        "secret_fingerprint": "0" * 16,
        "session_id": f"s{task_index}",
        "client": "127.0.0.1",
        "episode_id": f"e{task_index}",
        "seed": 902_000 + task_index,
        "scenario": "procedural_easy",
        "difficulty": "easy",
        "world_nonce": "0" * 32,
        "steps": 4,
        "ended": "abandoned: reset" if abandoned else "claim",
        "grade": None if abandoned else grade,
        "truth": {"exists": False, "mass_gev": None},
        "episode_reward": 2.5,
        "resources": {"budget_used_musd": 1.0, "budget_remaining_musd": 3.0},
        "claim": None,
        "run_id": run_id,
        "task_index": task_index,
        **more,
    }


def test_the_ledger_writes_plain_json_and_refuses_what_is_not_a_record(tmp_path):
    """A numpy boolean from a grade is written true/false (once it was "False", which is truthy);
    NaN, an unknown field, a string where a boolean belongs and a foreign object are refused before
    anything is written."""
    path = tmp_path / "results.jsonl"
    ledger = ResultsLedger(path)
    line = episode_line(steps=np.int64(4), episode_reward=np.float32(0.5))
    line["grade"]["correct_outcome"] = np.bool_(False)
    ledger.append(line)
    for bad, match in (
        (episode_line(episode_reward=float("nan")), "Out of range float values|finite"),
        (episode_line(extra_field=1), "extra_field"),
        ({**episode_line(), "grade": {**episode_line()["grade"], "correct_outcome": "False"}}, "correct_outcome"),
        (episode_line(truth={"exists": object()}), "plain JSON values"),
    ):
        with pytest.raises((ValueError, TypeError), match=match):
            ledger.append(bad)
    ledger.close()
    (record,) = read_ledger(path)
    assert record.grade.correct_outcome is False and record.steps == 4 and record.episode_reward == 0.5
    assert json.loads(path.read_text())["grade"]["correct_outcome"] is False


@pytest.mark.parametrize(
    "damage, field",
    [
        (lambda line: line.replace('"correct_outcome": true', '"correct_outcome": "True"'), "correct_outcome"),
        (lambda line: "{}", "ended_at"),
        (lambda line: line.replace('"episode_reward": 2.5', '"episode_reward": NaN'), "finite"),
        (lambda line: line[: len(line) // 2], "Expecting|Unterminated|delimiter|control character"),
        (lambda line: line.replace('"steps": 4', '"steps": 4.5'), "steps"),
    ],
)
def test_a_damaged_ledger_line_is_an_error_naming_file_line_and_field(tmp_path, damage, field):
    """A string boolean, an empty object, NaN, a line cut short, a float count: each an error that
    names the file, the line and what is wrong; `skip_damaged` reads past it and reports it."""
    path = tmp_path / "results.jsonl"
    good = json.dumps(episode_line(0))
    path.write_text(good + "\n" + damage(json.dumps(episode_line(1))) + "\n" + json.dumps(episode_line(2)) + "\n")
    with pytest.raises(LedgerError, match=rf"results.jsonl:2: .*({field})"):
        read_ledger(path)
    records, problems = read_ledger(path, skip_damaged=True)
    assert [r.task_index for r in records] == [0, 2] and len(problems) == 1 and ":2:" in problems[0]


def test_a_write_the_disk_cuts_short_leaves_no_partial_line_and_is_reported_at_a_bounded_rate(
    tmp_path, monkeypatch, caplog
):
    path = tmp_path / "results.jsonl"
    ledger = ResultsLedger(path)
    ledger.append(episode_line(0))
    real_write = os.write
    monkeypatch.setattr(ledger_module.os, "write", lambda fd, data: real_write(fd, data[: len(data) // 2]))
    with pytest.raises(OSError, match="could not be written whole"):
        ledger.append(episode_line(1))
    with caplog.at_level("ERROR", logger="cernenv.server"):
        assert not any(ledger.append_or_report(episode_line(2)) for _ in range(300))  # a full disk, 300 episodes
    assert len([r for r in caplog.records if "could not record" in r.getMessage()]) == 1
    monkeypatch.setattr(ledger_module.os, "write", real_write)
    ledger.append(episode_line(3))
    ledger.close()
    assert [r.task_index for r in read_ledger(path)] == [0, 3]  # nothing cut, nothing merged


def test_the_ledger_rotates_by_size_is_read_across_its_files_and_once_full_refuses_rather_than_delete(tmp_path, caplog):
    """3 lines a file, 2 rotated files kept: 9 lines fill it; the 10th and every one after are
    refused with one line that says what to do (nothing deleted), and a reset is refused too."""
    path = tmp_path / "results.jsonl"
    one_line = len(json.dumps(episode_line(0), sort_keys=True)) + 1
    ledger = ResultsLedger(path, max_bytes=3 * one_line + 10, rotated_files=2, client_max_bytes=10**9)
    for index in range(9):
        ledger.append(episode_line(index))
    with pytest.raises(
        ledger_module.LedgerFull, match=r"results.jsonl is full \(3 files of up to [0-9]+ bytes\): .*move"
    ):
        ledger.append(episode_line(9))
    with caplog.at_level("ERROR", logger="cernenv.server"):
        assert not any(ledger.append_or_report(episode_line(10 + k)) for k in range(50))
    assert len([r for r in caplog.records if "is full" in r.getMessage()]) == 1
    from cernenv.server.scheduler import FairScheduler
    from cernenv.server.served import EnvironmentCount, ServedEnvironment
    from cernenv.server.wire import RequestError

    env = ServedEnvironment(EnvironmentCount(), FairScheduler(), "secret", evaluation=True, ledger=ledger)
    with pytest.raises(RequestError, match="results ledger is full"):
        env.reset(seed=902_000, difficulty="easy")
    ledger.close()
    files = ["results.jsonl", "results.jsonl.1", "results.jsonl.2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [*files, "results.jsonl.lock"]  # the lock outlives rotations
    assert max((tmp_path / name).stat().st_size for name in files) <= 3 * one_line + 10
    assert [r.task_index for r in read_ledger(path)] == list(range(9))  # oldest first, nothing deleted


def test_a_clients_episodes_without_a_step_are_counted_past_their_bound_and_a_run_file_is_nobody_elses(tmp_path):
    """A reset storm's episodes (abandoned without a step) write at most `stepless_lines` lines per
    address, then are counted; an episode with a step still goes in, and another address's
    stepless ones too. A scored run's ledger is locked while its run is open (a second server on
    the path is refused at start) and refused to a plain server after it closed."""
    from cernenv.server.runs import ScoredRun

    path = tmp_path / "results.jsonl"
    ledger = ResultsLedger(path, stepless_lines=3)
    stepless = dict(abandoned=True, steps=0, client="10.0.0.1")
    assert [ledger.append_or_report(episode_line(i, **stepless)) for i in range(5)] == [True] * 3 + [False] * 2
    assert ledger.stepless_unrecorded == {"10.0.0.1": 2}
    ledger.append(episode_line(5, abandoned=True, steps=1, client="10.0.0.1"))
    ledger.append(episode_line(6, abandoned=True, steps=0, client="10.0.0.2"))
    ledger.close()
    assert [r.task_index for r in read_ledger(path)] == [0, 1, 2, 5, 6]

    run = ScoredRun("draw:2", tmp_path / "run.jsonl")
    for plain in (lambda: ResultsLedger(run.ledger_path), lambda: ScoredRun("draw:2", run.ledger_path)):
        with pytest.raises(OSError, match="being written by another process"):
            plain()
    run.end("server shut down")
    run.ledger.close()
    before = run.ledger_path.read_bytes()
    with pytest.raises(OSError, match="is a scored run's ledger, which no other server writes or rotates"):
        ResultsLedger(run.ledger_path)
    assert run.ledger_path.read_bytes() == before and read_run(run.ledger_path).ended is not None


def test_ledger_lines_written_at_once_stay_whole(tmp_path):
    ledger = ResultsLedger(tmp_path / "ledger.jsonl")
    payload = "x" * 20_000  # longer than a pipe's atomic write

    def write(index: int) -> None:
        for k in range(50):
            ledger.append(episode_line(k, session_id=f"writer-{index}", truth={"exists": False, "payload": payload}))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ledger.close()
    records = read_ledger(tmp_path / "ledger.jsonl")
    assert len(records) == 300 and all(r.truth["payload"] == payload for r in records)


# The scorecard (the run's ledger checked line by line, the metrics: tests/test_run_audit.py) ------


def test_a_damaged_line_in_a_run_ledger_is_refused_not_read_past(tmp_path, capsys):
    """A run's ledger whose line is not a record is refused with its file and line: a scorer that
    read past damaged lines would read past a line removed from the chain, too."""
    from cernenv.server.runs import ScoredRun

    run = ScoredRun("draw:2", tmp_path)
    run.end("server shut down")
    path = run.ledger_path
    path.write_text(path.read_text() + "{}\n")
    assert scorecard_main([str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path.name}:3: not a results-ledger record" in err and err.count("\n") == 1


def test_a_selection_names_a_suite_a_part_or_a_fresh_draw():
    assert selected_tasks("v3") == suite_tasks("v3")
    assert {t.part for t in selected_tasks("v3:unseen")} == {"unseen"} and len(selected_tasks("v3:known_physics")) == 28
    drawn = selected_tasks("draw:30")
    assert len({t.seed for t in drawn}) == 30 and min(t.seed for t in drawn) >= DRAW_SEED_START > EVALUATION_SEED_START
    assert drawn != selected_tasks("draw:30")  # nobody chose them in advance
    for bad, match in (
        ("v9", "names no suite"),
        ("v3:everything", "parts"),
        ("draw:x", "draw:N"),
        ("draw:١٢", "draw:N"),
    ):
        with pytest.raises(ValueError, match=match):
            selected_tasks(bad)


# The server's scored runs ----------------------------------------------------------------------


@pytest.mark.slow
def test_the_server_assigns_every_task_once_and_records_the_abandoned_ones(tmp_path):
    """In a scored run a reset that names a seed, a scenario, a difficulty or a secret is refused;
    each bare reset gets the next task, in an order that is not the suite's; every task is played
    once; an episode cut short by a reset is recorded as abandoned, and the scorecard counts it as
    failed. The commitment is served before the first reset, and the reveal written at the end
    replays every episode."""
    ledger = tmp_path / "results.jsonl"
    server = Server("--scored-run", "v3:known_physics", "--results-ledger", str(ledger), mode=None)
    try:
        before_play = server.http("GET", "/evaluation")[1]
        with server.ws() as ws:  # no task before the entrant's nonce
            reply = call(ws, {"type": "reset", "data": {}})
            assert reply["type"] == "error" and "waits for the entrant's nonce" in reply["data"]["message"]
        assert server.http("POST", "/evaluation/nonce", {"nonce": "short"})[0] == 400
        assert server.http("POST", "/evaluation/nonce", signed_nonce(server))[0] == 200
        assert server.http("POST", "/evaluation/nonce", signed_nonce(server, ENTRANT_NONCE + "2"))[0] == 409
        status, answer = server.http("POST", "/reset", {})  # HTTP's one-off environment takes no task
        assert status == 400 and "played in sessions" in answer["detail"], answer
        with server.ws() as ws:
            chosen_resets = ({"seed": 902_000}, {"difficulty": "easy"}, {"scenario": "z_mumu_91"}, {"secret_salt": "x"})
            for chosen in chosen_resets:
                reply = call(ws, {"type": "reset", "data": chosen})
                assert reply["type"] == "error" and "the server assigns every task" in reply["data"]["message"]
            for index in range(28):
                assert call(ws, {"type": "reset", "data": {}})["type"] == "observation"
                if index % 3 == 0:
                    assert call(ws, {"type": "step", "data": NULL_CLAIM})["data"]["done"]
            assert call(ws, {"type": "step", "data": NULL_CLAIM})["data"]["done"]
            reply = call(ws, {"type": "reset", "data": {}})
            assert reply["type"] == "error" and "nothing more to play" in reply["data"]["message"]
        described = server.http("GET", "/evaluation")[1]["scored_run"]
        assert (described["n_tasks"], described["assigned"], described["ended"], described["open"]) == (
            28,
            28,
            28,
            False,
        )
    finally:
        server.stop()
    run = read_run(ledger)  # the run's own file, its lines chained
    episodes = [episode for _, episode in run.episodes]
    assert run.ended is not None and run.ended.reason == "every task played"
    assert before_play["scored_run"]["commitment"] == run.opened.commitment == described["commitment"]
    assert (
        before_play["secret_fingerprint"] == run.opened.secret_fingerprint
        and before_play["scored_run"]["assigned"] == 0
    )
    assert described["last_line_sha256"] == run.last_sha256 and "last_line_sha256" not in before_play["scored_run"]
    indices = [e.task_index for e in episodes]
    assert sorted(indices) == list(range(28)) and indices != sorted(indices)
    assert [e.assignment for e in episodes] == list(range(28))
    assert {e.seed for e in episodes} == {t.seed for t in selected_tasks("v3:known_physics")}
    abandoned = [e for e in episodes if e.abandoned]
    assert len(abandoned) == 28 - 10 and {e.ended for e in abandoned} == {"abandoned: reset"}
    card = score_run(ledger, reveal_path(ledger))
    assert card["verified"] == 28
    graded_correct = sum(e.grade.correct_outcome for e in episodes if not e.abandoned)
    assert card["abandoned"] == 18 and card["groups"]["all"]["success_rate"]["mean"] == pytest.approx(
        graded_correct / 28
    )


@pytest.mark.slow
def test_a_shutdown_records_the_open_episodes_of_every_kind_and_ends_the_run(tmp_path):
    """SIGTERM with a WebSocket episode and an MCP episode in play: both are in the ledger as
    abandoned, the run's end says why, and the task never handed out counts as not played."""
    ledger = tmp_path / "results.jsonl"
    server = Server("--scored-run", "draw:3", "--results-ledger", str(ledger), mode=None)
    try:
        assert server.http("POST", "/evaluation/nonce", signed_nonce(server))[0] == 200
        with server.ws() as ws:
            assert call(ws, {"type": "reset", "data": {}})["type"] == "observation"
            session = server.mcp("openenv/session/create")["result"]["session_id"]
            answer = server.mcp("tools/call", {"session_id": session, "name": "new_campaign", "arguments": {}})
            assert "error" not in answer, answer
            server.stop()  # SIGTERM with both episodes in play
    finally:
        if server.process.poll() is None:
            server.stop()
    run = read_run(ledger)
    episodes = [episode for _, episode in run.episodes]
    assert len(episodes) == 2 and all(e.abandoned for e in episodes)
    assert {e.ended for e in episodes} <= {"abandoned: session ended", "abandoned: server shut down"}
    assert run.ended is not None and run.ended.reason == "server shut down"
    card = score_run(ledger, reveal_path(ledger))
    assert (card["abandoned"], card["unplayed"], card["groups"]["all"]["success_rate"]["mean"]) == (2, 1, 0.0)
    assert card["verified"] == 2


# No client can erase a run ---------------------------------------------------------------------


def test_each_client_address_writes_at_most_its_share_and_one_ledger_has_one_writer(tmp_path):
    """Past its share (here 4 lines' worth) an address's episodes are not recorded, while another
    address's still are; a second writer of the same ledger is refused with what to do, and once
    the first has closed it, the file is free again."""
    path = tmp_path / "results.jsonl"
    one_line = len(json.dumps(episode_line(0), sort_keys=True)) + 1
    ledger = ResultsLedger(path, client_max_bytes=4 * one_line + 10)
    for index in range(4):
        ledger.append(episode_line(index, client="10.0.0.1"))
    with pytest.raises(ledger_module.LedgerShareSpent, match="client 10.0.0.1 has written .* its share"):
        ledger.append(episode_line(4, client="10.0.0.1"))
    assert not ledger.append_or_report(episode_line(5, client="10.0.0.1"))
    ledger.append(episode_line(6, client="10.0.0.2"))
    with pytest.raises(OSError, match="being written by another process .* --results-ledger PATH or CERNENV_STATE_DIR"):
        ResultsLedger(path)
    ledger.close()
    ResultsLedger(path).close()
    assert [(r.client, r.task_index) for r in read_ledger(path)] == [("10.0.0.1", i) for i in range(4)] + [
        ("10.0.0.2", 6)
    ]


@pytest.mark.slow
def test_a_flood_of_resets_erases_neither_a_finished_run_nor_another_clients_episodes(tmp_path):
    """The flood that once rotated a finished scored run away (two servers sharing one state
    directory, one socket resetting again and again with 255-character episode ids), with limits
    small enough to be quick: the run has a ledger of its own, which still scores and verifies;
    the flooder's lines stop at its share; another address's episodes stay; and a third server
    given the flooded ledger is refused instead of sharing it."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    runs = state / "runs"
    runs.mkdir(mode=0o700)
    scored = Server("--scored-run", "draw:2", "--results-ledger", str(runs), mode=None)
    try:
        assert scored.http("POST", "/evaluation/nonce", signed_nonce(scored))[0] == 200
        with scored.ws() as ws:
            for _ in range(2):
                assert call(ws, {"type": "reset", "data": {}})["type"] == "observation"
                assert call(ws, {"type": "step", "data": NULL_CLAIM})["data"]["done"]
    finally:
        scored.stop()
    (run_ledger,) = runs.glob("*.jsonl")
    before = run_ledger.read_bytes()

    ledger = state / "results.jsonl"
    flooded = Server("--results-ledger", str(ledger), "--ledger-max-mib", "0.02", mode=None)
    try:
        with flooded.ws(source="127.0.0.2") as ws:
            for index in range(2):
                call(
                    ws,
                    {
                        "type": "reset",
                        "data": {"seed": 7 + index, "difficulty": "easy", "episode_id": f"honest-{index}"},
                    },
                )
                assert call(ws, {"type": "step", "data": NULL_CLAIM})["data"]["done"]
        with flooded.ws(source="127.0.0.1") as ws:
            for index in range(60):
                episode_id = f"{index:03d}" + "x" * 252
                assert call(ws, {"type": "reset", "data": {"episode_id": episode_id}})["type"] == "observation"
        with pytest.raises(RuntimeError, match="is being written by another process"):
            Server("--results-ledger", str(ledger), mode=None)
    finally:
        flooded.stop()
    records = read_ledger(ledger)
    assert {r.episode_id for r in records if r.client == "127.0.0.2"} == {"honest-0", "honest-1"}
    flood_bytes = sum(len(json.dumps(r.model_dump(), sort_keys=True)) + 1 for r in records if r.client == "127.0.0.1")
    assert 0 < flood_bytes <= 0.02 * 2**20 and sum(r.client == "127.0.0.1" for r in records) < 60
    assert run_ledger.read_bytes() == before
    card = score_run(run_ledger, reveal_path(run_ledger))
    assert card["verified"] == 2 and card["unplayed"] == 0


# An agent scored out of process ----------------------------------------------------------------


@pytest.mark.slow
def test_an_agent_scored_out_of_process_finds_nothing_by_introspection(tmp_path, monkeypatch):
    """The introspecting agent finds the hidden truth in process (the control: its search works)
    and nothing out of process: no truth in its frames or its heap, no CERNENV_* variable, no file
    holding the server's secret; the run is scored like any other."""
    from introspecting_agent import IntrospectingAgent

    from lib.episodes.agent_rollouts import collect_episodes
    from lib.measure.evaluation import PUBLISHED_KEY
    from lib.measure.score_agent import score_agent

    folder = Path(tempfile.mkdtemp(prefix="cernenv-test-agent-"))
    folder.chmod(0o777)  # the sandboxed agent's user writes its report here
    report = folder / "found.jsonl"
    monkeypatch.setenv("INTROSPECTION_REPORT", str(report))
    (episode,) = collect_episodes(
        selected_tasks("v3:unseen")[:1], make_env=PUBLISHED_KEY.make_env, agent=IntrospectingAgent(), progress=False
    )
    in_process = json.loads(report.read_text())
    assert (in_process["frames"] or in_process["gc"]) == episode.truth  # what it found was the truth
    report.unlink()

    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    monkeypatch.setenv("CERNENV_SECRET_SALT", "an operator's secret the agent must not see")
    card = score_agent("introspecting_agent:IntrospectingAgent", "draw:2", progress_every_s=1e9)
    found: List[Dict[str, Any]] = [json.loads(line) for line in report.read_text().splitlines()]
    assert len(found) == 2 and card["graded"] == 2 and card["unplayed"] == 0
    for search in found:
        assert search["frames"] is None and search["gc"] is None and search["variables"] == []
        for path in search["files"]:
            assert "an operator's secret" not in Path(path).read_text()


# A state directory another user could have planted --------------------------------------------


def test_a_planted_ledger_or_secret_is_refused_with_a_line_that_says_what_to_do(tmp_path):
    """A link (whose target would get the grades), a FIFO (which hung start-up), a folder others
    can write: each refused with what to do; a ledger others could read is made private."""
    import stat

    from cernenv.server.evaluation import generated_secret, private_dir

    target = tmp_path / "elsewhere.jsonl"
    (tmp_path / "linked.jsonl").symlink_to(target)
    with pytest.raises(OSError, match="is a symbolic link, not a regular file"):
        ResultsLedger(tmp_path / "linked.jsonl")
    assert not target.exists()
    os.mkfifo(tmp_path / "fifo.jsonl")
    with pytest.raises(OSError, match="is a FIFO"):
        ResultsLedger(tmp_path / "fifo.jsonl")
    readable = tmp_path / "readable.jsonl"
    readable.write_text("")
    readable.chmod(0o644)
    ResultsLedger(readable).close()
    assert stat.S_IMODE(readable.stat().st_mode) == 0o600
    shared = tmp_path / "shared-state"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(OSError, match="writable by other users"):
        private_dir(shared)
    with pytest.raises(OSError, match="writable by other users"):
        generated_secret(shared / "evaluation.secret")
    (tmp_path / "state").mkdir(mode=0o700)
    (tmp_path / "state" / "evaluation.secret").symlink_to(tmp_path / "planted")
    (tmp_path / "planted").write_text("a secret somebody else knows\n")
    with pytest.raises(OSError, match="symbolic link"):
        generated_secret(tmp_path / "state" / "evaluation.secret")


# One end per episode ---------------------------------------------------------------------------


def test_an_episode_ends_once_when_close_races_its_claim_and_nothing_keeps_the_environment(tmp_path):
    """A session's close sent while its claim is queued on the physics thread, 40 rounds: each
    episode has exactly one ledger line (the claim's or the abandon's, whichever came first), and
    no closed environment stays alive (the scheduler's charge table once held them)."""
    import asyncio
    import gc
    import weakref

    from cernenv.server.scheduler import FairScheduler
    from cernenv.server.served import EnvironmentCount, ServedEnvironment

    scheduler, count = FairScheduler(), EnvironmentCount()
    ledger = ResultsLedger(tmp_path / "results.jsonl", stepless_lines=40)  # a close may beat the claim's step
    alive: List[weakref.ref] = []

    async def one_round(index: int) -> None:
        env = ServedEnvironment(count, scheduler, "secret", evaluation=True, ledger=ledger)
        env.adopt_session(f"session-{index}", "127.0.0.1")
        await env.reset_async(seed=902_000 + index, difficulty="easy", episode_id=f"episode-{index}")
        claim = asyncio.ensure_future(env.step_async(NULL_CLAIM))
        await asyncio.sleep(0)  # the claim is queued
        await asyncio.get_running_loop().run_in_executor(None, env.close)  # as OpenEnv closes a session
        await claim
        alive.append(weakref.ref(env))

    async def rounds() -> None:
        for index in range(40):
            await one_round(index)

    asyncio.run(rounds())
    ledger.close()
    episodes = [r.episode_id for r in read_ledger(tmp_path / "results.jsonl")]
    assert sorted(episodes) == sorted(f"episode-{i}" for i in range(40))  # one line each
    gc.collect()
    assert count.open == 0 and [ref for ref in alive if ref() is not None] == []
    scheduler.shutdown()
