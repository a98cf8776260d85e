"""A scored run anyone can check: its worlds committed to before play and revealed after
(`cernenv.server.runs`), a ledger whose lines chain, checked line by line and replayed episode by
episode (`cernenv.server.audit`), and a scorecard over every assigned task
(`lib.measure.scorecard`). Each way of tampering with a run's ledger the scorer once believed is
refused, with one line naming the file, the line and the reason."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest

from cernenv.server.audit import AuditError, read_run, verify_run
from cernenv.server.ledger import line_sha256
from cernenv.server.runs import ScoredRun, commitment_of, reveal_path, world_nonce
from cernenv.server.scheduler import FairScheduler
from cernenv.server.served import EnvironmentCount, ServedEnvironment
from lib.agents.baselines import HeuristicAgent
from lib.measure.scorecard import main as scorecard_main
from lib.measure.scorecard import score_run, scorecard

NULL_CLAIM = {"action_type": "submit_discovery_claim", "parameters": {"discovered": False, "confidence": 0.6}}


def play(
    directory: Path,
    selection: str,
    plan: Callable[[int], Optional[str]],
    *,
    end: Optional[str] = "server shut down",
) -> ScoredRun:
    """A scored run of `selection` whose ledger goes in `directory`, played in process as a server
    session plays it: `plan(k)` for the k-th task handed out says how ("heuristic", "null" claim,
    "abandon" after one step, None: stop handing out tasks); the run then ends with `end` unless
    every task was played."""
    run = ScoredRun(selection, directory)
    scheduler, count = FairScheduler(), EnvironmentCount()
    env = ServedEnvironment(count, scheduler, run.world_secret, evaluation=True, ledger=run.ledger, run=run)
    env.adopt_session("session-1", "127.0.0.1")
    for k in range(len(run.tasks)):
        how = plan(k)
        if how is None:
            break
        obs = env.reset()
        if how == "abandon":
            env.step({"action_type": "configure_beam", "parameters": {"beam_energy_tev": 13.6}})
            continue  # the next reset, or the session's end, abandons it
        agent = HeuristicAgent()
        while not obs.done:
            obs = env.step(agent.act(obs) if how == "heuristic" else NULL_CLAIM)
    env.close()
    scheduler.shutdown()
    if end is not None:
        run.end(end)
    return run


@pytest.fixture(scope="module")
def played(tmp_path_factory) -> Dict[str, Any]:
    """One run of 6 drawn tasks: 4 played by the heuristic, 1 abandoned, 1 never handed out; its
    ledger and reveal as the server wrote them."""
    directory = tmp_path_factory.mktemp("run")
    run = play(directory, "draw:6", lambda k: ["heuristic", "heuristic", "abandon", "heuristic", "heuristic", None][k])
    return {"run": run, "ledger": run.ledger_path, "reveal": reveal_path(run.ledger_path)}


def copy_of(played: Dict[str, Any], tmp_path: Path) -> Dict[str, Path]:
    ledger = tmp_path / played["ledger"].name
    shutil.copyfile(played["ledger"], ledger)
    reveal = tmp_path / played["reveal"].name
    shutil.copyfile(played["reveal"], reveal)
    return {"ledger": ledger, "reveal": reveal}


def lines_of(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(path: Path, records: List[Dict[str, Any]], *, rechain: bool) -> None:
    """Write `records` as ledger lines; `rechain`: recompute every `previous` as a forger who knows
    the format would (the chain alone then holds, and only the reveal can tell)."""
    texts: List[str] = []
    for record in records:
        if rechain:
            record = {**record, "previous": line_sha256(texts[-1]) if texts else None}
        texts.append(json.dumps(record, sort_keys=True))
    path.write_text("".join(text + "\n" for text in texts))


# The commitment and the reveal -----------------------------------------------------------------


def test_a_played_run_is_committed_to_before_play_and_every_episode_replays_from_its_reveal(played):
    """The run's opening carries the commitment (the hash of the document the reveal holds: tasks,
    order, world secret, code); every world's nonce derives from the secret; every episode, the
    abandoned one included, replays to its recorded grade, reward, truth, steps and refusals."""
    run, ledger = played["run"], read_run(played["ledger"])
    reveal = json.loads(played["reveal"].read_text())
    assert ledger.opened.commitment == run.commitment == commitment_of(reveal["document"]) == reveal["commitment"]
    assert (
        reveal["document"]["world_secret"] == run.world_secret and run.world_secret not in played["ledger"].read_text()
    )
    assert reveal["last_line_sha256"] == ledger.last_sha256
    assert [e.world_nonce for _, e in ledger.episodes] == [
        world_nonce(run.world_secret, e.task_index) for _, e in ledger.episodes
    ]
    assert len(ledger.episodes) == 5 and sum(e.abandoned for _, e in ledger.episodes) == 1
    assert all(e.actions for _, e in ledger.episodes) and ledger.ended.recorded == 5
    verified, document = verify_run(ledger, played["reveal"])
    assert verified == 5 and document["order"][: len(ledger.episodes)] == [e.task_index for _, e in ledger.episodes]


def test_the_scorer_verifies_and_says_so(played, tmp_path, capsys):
    files = copy_of(played, tmp_path)
    assert (
        scorecard_main([str(files["ledger"]), "--reveal", str(files["reveal"]), "--json", str(tmp_path / "c.json")])
        == 0
    )
    out = capsys.readouterr().out
    assert "verified: 5 of 5 episodes replayed identically" in out
    assert json.loads((tmp_path / "c.json").read_text())["verified"] == 5
    assert scorecard_main([str(files["ledger"])]) == 0
    assert "not verified: the ledger's chain and its run were checked" in capsys.readouterr().out


# Tampering: each case refused with the file, the line and the reason --------------------------


def forged_episode(records):
    """A graded episode of the task the run never played: another episode's line, relabelled."""
    index = next(i for i in range(6) if i not in {r.get("task_index") for r in records})
    task = records[0]["tasks"][index]
    episode = next(r for r in records[1:] if r.get("grade"))
    return {**episode, "task_index": index, "assignment": 5, "seed": task["seed"], "difficulty": task["difficulty"],
            "scenario": f"procedural_{task['difficulty']}"}  # fmt: skip


def forge_unplayed(records):
    """A forged `EpisodeEnded` line for the unplayed task, appended after the end."""
    return records + [forged_episode(records)]


def forge_inside(records):
    """A forged episode inserted before the end, the end's counts left as they were."""
    return records[:-1] + [forged_episode(records), records[-1]]


def flip(records):
    """A graded episode's outcome flipped in place."""
    for record in records[1:-1]:
        if record.get("grade") and not record["grade"]["correct_outcome"]:
            record["grade"] = {**record["grade"], "correct_outcome": True}
            return records
    record = records[1]
    record["grade"] = {**record["grade"], "correct_outcome": not record["grade"]["correct_outcome"]}
    return records


def change(field, value, index=1):
    def tamper(records):
        records[index] = {**records[index], field: value}
        return records

    return tamper


TAMPERING = {
    # name: (tamper with the records, rechain, where the error is, what it says)
    "forged after the end": (forge_unplayed, True, 8, "a line after the run's end"),
    "forged inside, chain recomputed": (forge_inside, True, 8, r"the run's end says recorded 5 \(the ledger holds 6\)"),
    "reordered": (lambda r: [r[0], r[2], r[1], *r[3:]], False, 2, "the hash it carries is not line 1's"),
    "flipped in place": (flip, False, None, "the hash it carries is not line"),
    "another secret's fingerprint": (change("secret_fingerprint", "f" * 16), True, 2, "drawn with secret ffff"),
    "training mode": (change("mode", "training"), True, 2, "played in training mode"),
    "another seed": (change("seed", 12345), True, 2, "its seed 12345 is not task"),
    "another difficulty": (change("difficulty", "impossible"), True, 2, "procedural"),
    "before the opening": (lambda r: [r[1], *r], True, 1, r"not the run's opening \(RunOpened\)"),
    "another run's line": (change("run_id", "0123456789abcdef"), True, 2, "a line of run 0123456789abcdef"),
    "opened twice": (lambda r: r[:3] + [r[0]] + r[3:], True, 4, "the run opened a second time"),
    "every task played, rewritten": (
        change("reason", "every task played", index=-1),
        False,
        7,
        "ended 5 of 6 tasks, yet 'every task played'",
    ),
    "a task twice": (lambda r: r[:-1] + [dict(r[1]), r[-1]], True, 7, "again"),
    "the chain's start": (change("previous", "0" * 64, index=0), False, 1, "carries a previous line's hash"),
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_a_tampered_run_ledger_is_refused_naming_file_line_and_reason(played, tmp_path, case, capsys):
    tamper, rechain, line, reason = TAMPERING[case]
    files = copy_of(played, tmp_path)
    write_lines(files["ledger"], tamper(lines_of(files["ledger"])), rechain=rechain)
    where = rf"{files['ledger'].name}:{line if line is not None else '[0-9]+'}: "
    with pytest.raises(AuditError, match=where + f".*{reason}"):
        read_run(files["ledger"])
    assert scorecard_main([str(files["ledger"])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and files["ledger"].name in err


def test_a_forger_who_rewrites_the_chain_and_the_end_is_caught_by_the_reveal(played, tmp_path):
    """Every line rechained and the end's counts made to agree: the ledger alone reads as whole,
    but its last line is not the one the server wrote last, and a flipped grade does not replay."""
    files = copy_of(played, tmp_path)
    records = forge_inside(lines_of(files["ledger"]))
    records[-1] = {**records[-1], "recorded": 6, "graded": 5, "ended": 6, "assigned": 6}
    write_lines(files["ledger"], records, rechain=True)
    run = read_run(files["ledger"])  # the chain holds
    with pytest.raises(AuditError, match=rf"{files['ledger'].name}: its last line is not the one the server wrote"):
        verify_run(run, files["reveal"])

    files = copy_of(played, tmp_path)
    records = flip(lines_of(files["ledger"]))[:-1]  # as if never ended: no last line to compare
    write_lines(files["ledger"], records, rechain=True)
    with pytest.raises(
        AuditError, match=r":[0-9]+: task [0-9]+ \(seed [0-9]+\) does not replay as recorded: grade recorded"
    ):
        verify_run(read_run(files["ledger"]), files["reveal"])


def test_a_planted_rotated_file_and_a_link_are_refused(played, tmp_path):
    files = copy_of(played, tmp_path)
    planted = files["ledger"].with_name(files["ledger"].name + ".7")
    planted.write_text(files["ledger"].read_text())
    with pytest.raises(AuditError, match=rf"{planted.name}: a rotated file beside the scored run's ledger"):
        read_run(files["ledger"])
    planted.unlink()
    link = tmp_path / "link.jsonl"
    link.symlink_to(files["ledger"])
    with pytest.raises(AuditError, match=r"link.jsonl: a symbolic link, not a scored run's ledger"):
        read_run(link)
    with pytest.raises(AuditError, match=r"no such file"):
        read_run(tmp_path / "missing.jsonl")


def test_a_reveal_that_is_not_the_committed_one_is_refused(played, tmp_path):
    files = copy_of(played, tmp_path)
    reveal = json.loads(files["reveal"].read_text())
    reveal["document"]["world_secret"] = "another secret, chosen after the fact"
    files["reveal"].write_text(json.dumps(reveal))
    with pytest.raises(AuditError, match=r"its document hashes to [0-9a-f]{64}, not to the commitment run"):
        verify_run(read_run(files["ledger"]), files["reveal"])
    files["reveal"].write_text("{not json")
    with pytest.raises(AuditError, match=r"reveal.json: not JSON"):
        verify_run(read_run(files["ledger"]), files["reveal"])


def test_a_run_file_is_new_and_never_rotated(tmp_path):
    """A scored run's ledger is made when it opens (an existing file is refused, with what to do)."""
    existing = tmp_path / "taken.jsonl"
    existing.write_text("")
    with pytest.raises(OSError, match="exists: a scored run's ledger is a file of its own"):
        ScoredRun("draw:2", existing)


# Every metric over every assigned task ----------------------------------------------------------


def test_the_reckless_early_quitter_is_reported_at_least_its_true_false_discovery_rate(tmp_path):
    """An agent that claims a discovery on every task (true false-discovery rate 1.0), plays 5 of
    draw:20 and walks away: the whole run's false-discovery rate is at least 1.0 (it was 0.062 when
    unplayed tasks counted as "nothing there"), every rate and mean is over the 20 tasks, and a
    walk-away earns no more than giving up."""
    run = ScoredRun("draw:20", tmp_path)
    scheduler, count = FairScheduler(), EnvironmentCount()
    env = ServedEnvironment(count, scheduler, run.world_secret, evaluation=True, ledger=run.ledger, run=run)
    env.adopt_session("quitter", "127.0.0.1")
    for _ in range(5):
        task = env.reset().task
        low, high = task.search_window_gev
        discovery = {
            "action_type": "submit_discovery_claim",
            "parameters": {"discovered": True, "mass_gev": (low + high) / 2, "mass_uncertainty_gev": 5.0,
                           "channel": task.available_channels[0], "significance_sigma": 5.0, "confidence": 0.99},
        }  # fmt: skip
        assert env.step(discovery).done
    env.close()
    scheduler.shutdown()
    run.end("server shut down")
    card = score_run(run.ledger_path, reveal_path(run.ledger_path))
    whole = card["groups"]["all"]
    assert card["verified"] == 5 and card["coverage"] == 5 / 20 and card["unplayed"] == 15
    assert whole["false_discovery_rate"]["mean"] >= 1.0 and whole["false_discovery_rate"]["n"] >= 15
    assert whole["success_rate"]["n"] == whole["mean_reward"]["n"] == 20 and whole["success_rate"]["mean"] == 0.0
    assert whole["mass_accuracy"]["n"] >= 15 and whole["mass_accuracy"]["mean"] == 0.0
    played_rewards = [e.episode_reward for _, e in read_run(run.ledger_path).episodes]
    assert whole["mean_reward"]["mean"] == pytest.approx((sum(played_rewards) + 15 * -1.0) / 20)


def test_an_abandoned_task_counts_as_a_give_up_and_the_counts_say_what_happened(played):
    """The abandoned episode is worth its shaping plus the grade of ending without a claim, never
    more than giving up; the counts per part say what was played, abandoned, never played, ended
    without a claim or claiming that nothing is there, and how many actions were refused."""
    run = read_run(played["ledger"])
    card = scorecard(run)
    (abandoned,) = [e for _, e in run.episodes if e.abandoned]
    assert (card["graded"], card["abandoned"], card["unplayed"]) == (4, 1, 1)
    assert card["counts"]["all"] == {
        "tasks": 6,
        "played": 4,
        "abandoned": 1,
        "unplayed": 1,
        "ended_without_claim": sum(1 for _, e in run.episodes if not e.abandoned and e.claim is None),
        "claimed_nothing_there": sum(
            1 for _, e in run.episodes if not e.abandoned and e.claim is not None and not e.claim.get("discovered")
        ),
        "refused_actions": sum(e.refused_actions for _, e in run.episodes),
    }
    rewards = [e.episode_reward for _, e in run.episodes if not e.abandoned]
    expected = (sum(rewards) + abandoned.episode_reward - 1.0 - 1.0) / 6
    assert card["groups"]["all"]["mean_reward"]["mean"] == pytest.approx(expected)


def test_a_ledger_written_before_runs_were_committed_to_is_refused_with_why(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(
        json.dumps(
            {
                "record": "run_opened",
                "opened_at": "t",
                "run_id": "r1",
                "selection": "v3",
                "n_tasks": 1,
                "tasks": [{"seed": 1, "scenario": None, "difficulty": "easy"}],
                "secret_fingerprint": None,
                "cernenv_version": "0",
                "commit": None,
            }
        )
        + "\n"  # fmt: skip
    )
    with pytest.raises(AuditError, match="old.jsonl:1: run r1 published no commitment"):
        read_run(path)
    assert os.path.exists(path)


def test_a_scorecard_someone_was_sent_is_checked_field_by_field_against_a_compressed_ledger(played, tmp_path, capsys):
    """The published form: the ledger gzip-compressed (the chain is over its lines), the reveal
    and the scorecard beside it. The scorecard recomputed from the ledger must be the one sent: a
    success rate bent in it is named, field and values."""
    import gzip

    files = copy_of(played, tmp_path)
    compressed = tmp_path / "ledger.jsonl.gz"
    compressed.write_bytes(gzip.compress(files["ledger"].read_bytes()))
    sent = tmp_path / "scorecard.json"
    assert scorecard_main([str(compressed), "--reveal", str(files["reveal"]), "--json", str(sent)]) == 0
    assert scorecard_main([str(compressed), "--reveal", str(files["reveal"]), "--expect", str(sent)]) == 0
    assert f"{sent}: the scorecard this ledger gives, field by field" in capsys.readouterr().out
    card = json.loads(sent.read_text())
    true_rate = card["groups"]["all"]["success_rate"]["mean"]
    card["groups"]["all"]["success_rate"]["mean"] = 0.9
    sent.write_text(json.dumps(card))
    assert scorecard_main([str(compressed), "--expect", str(sent)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: {sent}: not the scorecard this ledger gives: groups.all.success_rate.mean is 0.9; "
        f"the ledger gives {json.dumps(true_rate)}"
    )
    compressed.write_bytes(gzip.compress(files["ledger"].read_bytes())[:-20])
    with pytest.raises(AuditError, match="ledger.jsonl.gz: not a whole gzip file"):
        read_run(compressed)


def test_the_published_scored_run_is_whole_and_its_scorecard_is_the_ledgers(capsys):
    """evidence/scored_run/ (make scored-run-example): its ledger reads whole (chain, one run, every
    task played), its reveal is the document its commitment names, and its scorecard is the one the
    ledger gives. `make verify-scored-run` (CI) also replays every episode: that needs this
    machine's arithmetic, this does not."""
    from cernenv.server.audit import check_reveal, load_reveal

    folder = Path(__file__).resolve().parents[1] / "evidence" / "scored_run"
    run = read_run(folder / "ledger.jsonl.gz")
    document = check_reveal(run, load_reveal(folder / "reveal.json"), folder / "reveal.json")
    assert run.ended is not None and run.ended.reason == "every task played"
    assert len(run.episodes) == run.opened.n_tasks == 313 and document["selection"] == "v3"
    assert scorecard_main([str(folder / "ledger.jsonl.gz"), "--expect", str(folder / "scorecard.json")]) == 0
    assert "the scorecard this ledger gives, field by field" in capsys.readouterr().out
