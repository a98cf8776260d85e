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
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cernenv.environment import CERNCollisionEnvironment
from cernenv.server.audit import AuditError, read_run, verify_run
from cernenv.server.ledger import line_digest, line_sha256, public_key_hex, record_text, sign_digest
from cernenv.server.runs import ScoredRun, commitment_of, receipts_statement, reveal_path, world_nonce, worlds_secret
from cernenv.server.scheduler import FairScheduler
from cernenv.server.served import EnvironmentCount, ServedEnvironment
from lib.agents.baselines import HeuristicAgent, OracleAgent
from lib.agents.remote_player import Entrant, Receipts
from lib.measure.scorecard import main as scorecard_main
from lib.measure.scorecard import score_run, scorecard

ENTRANT_NONCE = "entrant-nonce-sent-after-the-commitment"
ENTRANT = Entrant("lib.agents.baselines:HeuristicAgent", "0" * 64, ENTRANT_NONCE)
NULL_CLAIM = {"action_type": "submit_discovery_claim", "parameters": {"discovered": False, "confidence": 0.6}}


def play(
    directory: Path,
    selection: str,
    plan: Callable[[int], Optional[str]],
    *,
    end: Optional[str] = "server shut down",
    receipts: Optional[Receipts] = None,
) -> ScoredRun:
    """A scored run of `selection` whose ledger goes in `directory`, played in process as a server
    session plays it: `plan(k)` for the k-th task handed out says how ("heuristic", "null" claim,
    "abandon" after one step, None: stop handing out tasks); the run then ends with `end` unless
    every task was played; `receipts` keeps the head the run serves after each episode, as an
    entrant's client does."""
    run = ScoredRun(selection, directory)
    keep = receipts.keep if receipts is not None else (lambda state: None)
    keep(run.seed(ENTRANT_NONCE, ENTRANT.nonce_body(run.run_id, run.commitment)))
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
        keep(run.describe())
    env.close()
    scheduler.shutdown()
    if end is not None:
        run.end(end)
    keep(run.describe())
    return run


@pytest.fixture(scope="module")
def played(tmp_path_factory) -> Dict[str, Any]:
    """One run of 6 drawn tasks: 4 played by the heuristic, 1 abandoned, 1 never handed out; its
    ledger and reveal as the server wrote them."""
    directory = tmp_path_factory.mktemp("run")
    plan = ["heuristic", "heuristic", "abandon", "heuristic", "heuristic", None]
    run = play(directory, "draw:6", lambda k: plan[k], receipts=(receipts := Receipts({}, ENTRANT)))
    receipts.header.update(run_id=run.run_id, commitment=run.commitment, public_key=run.public_key)
    kept = receipts.signed()
    return {"run": run, "ledger": run.ledger_path, "reveal": reveal_path(run.ledger_path), "receipts": kept}


def copy_of(played: Dict[str, Any], tmp_path: Path) -> Dict[str, Path]:
    ledger = tmp_path / played["ledger"].name
    shutil.copyfile(played["ledger"], ledger)
    reveal = tmp_path / played["reveal"].name
    shutil.copyfile(played["reveal"], reveal)
    receipts = tmp_path / "entrant.receipts.json"
    receipts.write_text(json.dumps(played["receipts"]))
    return {"ledger": ledger, "reveal": reveal, "receipts": receipts}


def lines_of(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_lines(
    path: Path, records: List[Dict[str, Any]], *, rechain: bool, key: Optional[Ed25519PrivateKey] = None
) -> None:
    """Write `records` as ledger lines; `rechain`: recompute every `previous` as a forger who knows
    the format would; `key`: sign every line with it, as the operator (who holds the run's key) or
    a forger with a key of its own would (without it, each line keeps the signature it had)."""
    texts: List[str] = []
    for record in records:
        if rechain:
            record = {**record, "previous": line_sha256(texts[-1]) if texts else None}
        if key is not None:
            record = {k: v for k, v in record.items() if k != "signature"}
            record["signature"] = sign_digest(key, line_digest(record_text(record)))
        texts.append(record_text(record))
    path.write_text("".join(text + "\n" for text in texts))


# The commitment and the reveal -----------------------------------------------------------------


def test_a_played_run_is_committed_to_before_play_and_every_episode_replays_from_its_reveal(played):
    """The run's opening carries the commitment (the hash of the document the reveal holds: tasks,
    order, world secret, code); every world's nonce derives from the secret; every episode, the
    abandoned one included, replays to its recorded grade, reward, truth, steps and refusals."""
    run, ledger = played["run"], read_run(played["ledger"])
    reveal = json.loads(played["reveal"].read_text())
    assert ledger.opened.commitment == run.commitment == commitment_of(reveal["document"]) == reveal["commitment"]
    text = played["ledger"].read_text()
    assert reveal["document"]["operator_secret"] == run.operator_secret and run.operator_secret not in text
    assert reveal["document"]["public_key"] == run.public_key == ledger.opened.public_key
    assert reveal["entrant_nonce"] == ENTRANT_NONCE == ledger.seeded.entrant_nonce
    assert (
        run.world_secret == worlds_secret(run.operator_secret, run.run_id, ENTRANT_NONCE)
        and run.world_secret not in text
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
        scorecard_main(
            [
                str(files["ledger"]),
                "--reveal",
                str(files["reveal"]),
                "--receipts",
                str(files["receipts"]),
                "--json",
                str(tmp_path / "c.json"),
            ]
        )  # fmt: skip
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
    episode = next(r for r in records[2:] if r.get("grade"))
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
    for record in records[2:-1]:
        if record.get("grade") and not record["grade"]["correct_outcome"]:
            record["grade"] = {**record["grade"], "correct_outcome": True}
            return records
    record = records[2]
    record["grade"] = {**record["grade"], "correct_outcome": not record["grade"]["correct_outcome"]}
    return records


def change(field, value, index=2):
    def tamper(records):
        records[index] = {**records[index], field: value}
        return records

    return tamper


def first_claimed(records):
    """The index of the first episode that ended by its claim."""
    return next(i for i, r in enumerate(records) if r.get("ended") == "claim")


def change_claimed(field, value):
    def tamper(records):
        index = first_claimed(records)
        records[index] = {**records[index], field: value(records[index]) if callable(value) else value}
        return records

    return tamper


# Lines: 1 the opening, 2 the entrant's nonce, 3 to 7 the five episodes, 8 the end.
TAMPERING = {
    # name: (tamper with the records, rechain, where the error is, what it says)
    "forged after the end": (forge_unplayed, True, 9, "a line after the run's end"),
    "forged inside, chain recomputed": (forge_inside, True, 9, r"the run's end says recorded 5 \(the ledger holds 6\)"),
    "reordered": (lambda r: [r[0], r[1], r[3], r[2], *r[4:]], False, 3, "the hash it carries is not line 2's"),
    "flipped in place": (flip, False, None, "the hash it carries is not line"),
    "another secret's fingerprint": (change("secret_fingerprint", "f" * 16), True, 3, "drawn with secret ffff"),
    "training mode": (change("mode", "training"), True, 3, "played in training mode"),
    "another seed": (change("seed", 12345), True, 3, "its seed 12345 is not task"),
    "another difficulty": (change("difficulty", "impossible"), True, 3, "procedural"),
    "before the opening": (lambda r: [r[2], *r], True, 1, r"not the run's opening \(RunOpened\)"),
    "another run's line": (change("run_id", "0123456789abcdef"), True, 3, "a line of run 0123456789abcdef"),
    "opened twice": (lambda r: r[:3] + [r[0]] + r[3:], True, 4, "the run opened a second time"),
    "nonce moved": (lambda r: [r[0], r[2], r[1], *r[3:]], True, 2, "an episode before the entrant's nonce"),
    "every task played, rewritten": (
        change("reason", "every task played", index=-1),
        False,
        8,
        "ended 5 of 6 tasks, yet 'every task played'",
    ),
    "a task twice": (lambda r: r[:-1] + [dict(r[2]), r[-1]], True, 8, "again"),
    "the chain's start": (change("previous", "0" * 64, index=0), False, 1, "carries a previous line's hash"),
    # the graded fields: a damaged one is a one-line refusal, never a traceback
    "claim null": (change_claimed("claim", None), True, None, "claim: null, yet the episode ended by its claim"),
    "claim not an object": (change_claimed("claim", "yes"), True, None, "claim"),
    "resources null": (change("resources", None), True, 3, r"resources: null"),
    "resources a list": (change("resources", [1, 2]), True, 3, "resources"),
    "reward null": (change("episode_reward", None), True, 3, r"episode_reward: null"),
    "steps negative": (change("steps", -3), True, 3, "steps -3"),
    "end unknown": (change_claimed("ended", "the agent won"), True, None, "a claim, yet the episode ended"),
    "a time that is not one": (change("ended_at", "yesterday"), True, 3, "ended_at 'yesterday' is not an ISO 8601"),
    "a time before the opening": (
        change("ended_at", "2001-01-01T00:00:00.000+00:00"),
        True,
        3,
        "at or after the run's opening",
    ),
    "assigned a million": (change("assigned", 1_000_000, index=-1), True, 8, "tasks 6 >= assigned 1000000"),
    "an end the server never writes": (change("reason", "the agent won", index=-1), True, 8, "never writes"),
    "a nonce line twice": (lambda r: r[:3] + [r[1]] + r[3:], True, 4, "the entrant's nonce on line 4"),
}


@pytest.mark.parametrize("case", list(TAMPERING))
def test_a_run_ledger_the_operator_tampered_with_and_signed_again_is_refused_naming_file_line_and_reason(
    played, tmp_path, case, capsys
):
    """The operator holds the run's key: it can sign whatever it writes, so every check of what a
    line holds must still catch the change, with one line naming the file, the line and the reason."""
    tamper, rechain, line, reason = TAMPERING[case]
    files = copy_of(played, tmp_path)
    write_lines(files["ledger"], tamper(lines_of(files["ledger"])), rechain=rechain, key=played["run"]._signing_key)
    where = rf"{files['ledger'].name}:{line if line is not None else '[0-9]+'}: "
    with pytest.raises(AuditError, match=where + f".*{reason}"):
        read_run(files["ledger"])
    assert scorecard_main([str(files["ledger"]), "--reveal", str(files["reveal"])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and files["ledger"].name in err
    assert "Traceback" not in err


@pytest.mark.parametrize("case", list(TAMPERING))
def test_a_run_ledger_changed_by_anyone_without_the_key_fails_its_signature(played, tmp_path, case, capsys):
    """Anyone else (the chain recomputed where the case does, as it is public arithmetic) leaves a
    line whose signature does not verify under the run's key (or, lines only moved, a broken chain):
    refused at the first line changed."""
    tamper, rechain, _line, _reason = TAMPERING[case]
    files = copy_of(played, tmp_path)
    write_lines(files["ledger"], tamper(lines_of(files["ledger"])), rechain=rechain)
    expected = (
        "its signature does not verify|not the run's opening|the hash it carries is not line|not a results-ledger "
        "record|the run's first line carries a previous line's hash"
    )
    with pytest.raises(AuditError, match=rf"jsonl:[0-9]+: ({expected})"):
        read_run(files["ledger"])
    assert scorecard_main([str(files["ledger"])]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_a_forger_who_rewrites_the_chain_and_the_end_is_caught_by_the_reveal(played, tmp_path):
    """Signed again with the run's key (the operator), every line rechained and the end's counts
    made to agree: the ledger alone reads as whole, but its last line is not the one the server
    wrote last, and a flipped grade does not replay."""
    key = played["run"]._signing_key
    files = copy_of(played, tmp_path)
    records = forge_inside(lines_of(files["ledger"]))
    records[-1] = {**records[-1], "recorded": 6, "graded": 5, "ended": 6, "assigned": 6}
    write_lines(files["ledger"], records, rechain=True, key=key)
    run = read_run(files["ledger"])  # the chain and the signatures hold
    with pytest.raises(AuditError, match=rf"{files['ledger'].name}: its last line is not the one the server wrote"):
        verify_run(run, files["reveal"])

    files = copy_of(played, tmp_path)
    write_lines(files["ledger"], flip(lines_of(files["ledger"])), rechain=True, key=key)
    reveal = json.loads(files["reveal"].read_text())
    reveal["last_line_sha256"] = read_run(files["ledger"]).last_sha256  # the commitment does not cover it
    files["reveal"].write_text(json.dumps(reveal))
    with pytest.raises(
        AuditError, match=r":[0-9]+: task [0-9]+ \(seed [0-9]+\) does not replay as recorded: grade recorded"
    ):
        verify_run(read_run(files["ledger"]), files["reveal"])


def test_a_ledger_without_its_end_is_incomplete_never_verified(played, tmp_path, capsys):
    """The tail and the end cut off (no key needed: every line left is as signed): the chain holds,
    the scorecard says incomplete, and the reveal refuses it rather than verify the rest."""
    files = copy_of(played, tmp_path)
    records = lines_of(files["ledger"])[:-3]
    write_lines(files["ledger"], records, rechain=False)
    assert read_run(files["ledger"]).ended is None
    with pytest.raises(AuditError, match=r"jsonl:5: incomplete: the ledger has no end \(RunEnded\)"):
        verify_run(read_run(files["ledger"]), files["reveal"])
    assert scorecard_main([str(files["ledger"]), "--reveal", str(files["reveal"])]) == 2
    assert "incomplete" in capsys.readouterr().err
    assert scorecard_main([str(files["ledger"])]) == 0
    out = capsys.readouterr().out
    assert "incomplete: the ledger has no end" in out and "verified:" not in out


def oracle_replayed(episode: Dict[str, Any], task: Dict[str, Any], secret: str) -> Dict[str, Any]:
    """`episode` played again by the oracle in its committed world (the reveal's secret gives it the
    truth), with every field a replay compares: what a third party holding the reveal can make."""
    env = CERNCollisionEnvironment(secret_salt=secret)
    obs = env.reset(
        seed=task["seed"], scenario=task.get("scenario"), world_nonce=episode["world_nonce"],
        difficulty=None if task.get("scenario") else task["difficulty"],
    )  # fmt: skip
    agent, actions = OracleAgent(env.hidden_truth()), []
    agent.reset()
    while not obs.done:
        action = agent.act(obs)
        actions.append(action.model_dump(mode="json"))
        obs = env.step(action)
    usage = obs.resource_usage.model_dump()
    return {
        **episode,
        "actions": actions,
        "steps": env.state.step_count,
        "grade": env.episode_grade(),
        "episode_reward": env.state.cumulative_reward,
        "ended": obs.latest_result.get("episode_end") or "claim",
        "claim": env.episode_claim(),
        "resources": {k: v for k, v in usage.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
        "refused_actions": env.refused_actions(),
    }


def replayed_by_the_oracle(files: Dict[str, Path]) -> List[Dict[str, Any]]:
    """The run's ledger with its episodes that were not a correct outcome played again by the oracle."""
    reveal = json.loads(files["reveal"].read_text())
    records = lines_of(files["ledger"])
    secret = worlds_secret(reveal["document"]["operator_secret"], records[0]["run_id"], records[1]["entrant_nonce"])
    replaced = 0
    for index, record in enumerate(records):
        if record.get("record") == "episode" and not (record.get("grade") or {}).get("correct_outcome"):
            records[index] = oracle_replayed(record, records[0]["tasks"][record["task_index"]], secret)
            replaced += 1
    assert replaced >= 1
    ended = records[-1]
    graded = sum(1 for r in records if r.get("record") == "episode" and r.get("grade"))
    records[-1] = {**ended, "graded": graded, "abandoned": ended["recorded"] - graded}
    return records


def test_the_play_replayed_by_the_oracle_fails_without_the_runs_key(played, tmp_path, capsys):
    """The attack that once verified: with the published reveal, the failed episodes are played
    again by the oracle in their committed worlds (they replay identically), the chain recomputed
    and the reveal's last-line hash reset. Without the run's key the first replaced line fails its
    signature; signed with a key of the forger's own (its public half swapped into the opening and
    the reveal, the commitment recomputed), the commitment is not the one the entrant signed its
    nonce for, published before play, nor the one in the entrant's receipts."""
    files = copy_of(played, tmp_path)
    receipts = tmp_path / "receipts.json"
    receipts.write_text(json.dumps(played["receipts"]))
    records = replayed_by_the_oracle(files)
    write_lines(files["ledger"], records, rechain=True)
    with pytest.raises(AuditError, match=r"jsonl:[0-9]+: its signature does not verify under the run's key"):
        read_run(files["ledger"])

    forger = Ed25519PrivateKey.generate()
    reveal = json.loads(files["reveal"].read_text())
    reveal["document"]["public_key"] = public_key_hex(forger)
    reveal["commitment"] = commitment_of(reveal["document"])
    records[0] = {**records[0], "public_key": public_key_hex(forger), "commitment": reveal["commitment"]}
    write_lines(files["ledger"], records, rechain=True, key=forger)
    reveal["last_line_sha256"] = line_sha256(files["ledger"].read_text().splitlines()[-1])
    files["reveal"].write_text(json.dumps(reveal))
    # the entrant signed its nonce with the commitment it read: a run of another commitment is not its run
    for extra in ([], ["--commitment", played["run"].commitment], ["--receipts", str(receipts)]):
        assert scorecard_main([str(files["ledger"]), "--reveal", str(files["reveal"]), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert "jsonl:2: the entrant's signature of its nonce" in err and err.count("\n") == 0, err


def test_an_edit_the_operator_signs_after_the_fact_is_caught_by_the_entrants_receipts(played, tmp_path, capsys):
    """The operator holds the key: it can replay a failed episode by the oracle and sign the whole
    ledger again, and the ledger with its reveal verifies. The entrant's receipts, the heads the
    server signed while the run was played, are not that ledger's: refused at the first changed line."""
    files = copy_of(played, tmp_path)
    receipts = tmp_path / "receipts.json"
    receipts.write_text(json.dumps(played["receipts"]))
    assert scorecard_main([str(files["ledger"]), "--reveal", str(files["reveal"]), "--receipts", str(receipts)]) == 0
    kept = len(played["receipts"]["receipts"])
    assert kept == 6 and f"the ledger holds all {kept} of the entrant's receipts" in capsys.readouterr().out
    records = replayed_by_the_oracle(files)
    write_lines(files["ledger"], records, rechain=True, key=played["run"]._signing_key)
    reveal = json.loads(files["reveal"].read_text())
    reveal["last_line_sha256"] = read_run(files["ledger"]).last_sha256
    files["reveal"].write_text(json.dumps(reveal))
    assert score_run(files["ledger"], files["reveal"])["verified"] == 5  # the limit: the key signs anything
    assert scorecard_main([str(files["ledger"]), "--reveal", str(files["reveal"]), "--receipts", str(receipts)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not the line the server signed for the entrant while the run was played" in err and err.count("\n") == 0
    forged = json.loads(receipts.read_text())
    forged["receipts"][-1]["digest"] = "0" * 64  # a receipt the entrant made up, and signed its receipts again
    forged["entrant_signature"] = ENTRANT.sign(receipts_statement(forged))
    receipts.write_text(json.dumps(forged))
    files = copy_of(played, tmp_path)
    assert scorecard_main([str(files["ledger"]), "--receipts", str(receipts)]) == 2
    assert "is not signed by the run's key" in capsys.readouterr().err


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
    for stated in ("0" * 64, None):  # the document untouched, the hash it states edited or gone
        reveal = json.loads(played["reveal"].read_text())
        reveal["commitment"] = stated
        files["reveal"].write_text(json.dumps(reveal))
        with pytest.raises(AuditError, match=r"its commitment field .* is not its document's hash"):
            verify_run(read_run(files["ledger"]), files["reveal"])


def test_a_run_file_is_new_and_never_rotated(tmp_path):
    """A scored run's ledger is made when it opens (an existing file is refused, with what to do)."""
    existing = tmp_path / "taken.jsonl"
    existing.write_text("")
    with pytest.raises(OSError, match="exists: a scored run's ledger is a file of its own"):
        ScoredRun("draw:2", existing)


# Every metric over every assigned task ----------------------------------------------------------


def test_the_reckless_early_quitter_is_reported_its_true_false_discovery_rate(tmp_path):
    """An agent that claims a discovery on every task (true false-discovery rate 1.0) plays some of
    dev:20, at least 5 and one null task, and walks away: the false-discovery rate is 1.0 over the
    null tasks it played (it was 0.062 when unplayed tasks counted as "nothing there"; the tasks it
    walked away from claimed nothing and are left out of it, as giving up on them would count 0),
    every other rate and mean is over the 20 tasks, and a walk-away earns no more than giving up."""
    run = ScoredRun("dev:20", tmp_path)
    run.seed(ENTRANT_NONCE, ENTRANT.nonce_body(run.run_id, run.commitment))
    scheduler, count = FairScheduler(), EnvironmentCount()
    env = ServedEnvironment(count, scheduler, run.world_secret, evaluation=True, ledger=run.ledger, run=run)
    env.adopt_session("quitter", "127.0.0.1")
    played, played_nulls = 0, 0
    while played < 5 or not played_nulls:
        task = env.reset().task
        low, high = task.search_window_gev
        discovery = {
            "action_type": "submit_discovery_claim",
            "parameters": {"discovered": True, "mass_gev": (low + high) / 2, "mass_uncertainty_gev": 5.0,
                           "channel": task.available_channels[0], "significance_sigma": 5.0, "confidence": 0.99},
        }  # fmt: skip
        assert env.step(discovery).done
        played, played_nulls = played + 1, played_nulls + (not CERNCollisionEnvironment.hidden_truth(env)["exists"])
    env.close()
    scheduler.shutdown()
    run.end("server shut down")
    card = score_run(run.ledger_path, reveal_path(run.ledger_path))
    whole = card["groups"]["all"]
    assert card["verified"] == played and card["coverage"] == played / 20 and card["unplayed"] == 20 - played
    # the unplayed tasks' truths are drawn from the reveal: each is in its particle split, a failure there
    assert whole["false_discovery_rate"]["mean"] == 1.0 and whole["false_discovery_rate"]["n"] == played_nulls
    assert card["groups"]["null"]["success_rate"]["n"] + whole["mass_accuracy"]["n"] == 20
    assert whole["success_rate"]["n"] == whole["mean_reward"]["n"] == 20 and whole["success_rate"]["mean"] == 0.0
    assert whole["mass_accuracy"]["mean"] == 0.0
    played_rewards = [e.episode_reward for _, e in read_run(run.ledger_path).episodes]
    assert whole["mean_reward"]["mean"] == pytest.approx((sum(played_rewards) + (20 - played) * -1.0) / 20)


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
    attested = ["--reveal", str(files["reveal"]), "--receipts", str(files["receipts"])]
    assert scorecard_main([str(compressed), *attested, "--json", str(sent)]) == 0
    assert scorecard_main([str(compressed), *attested, "--expect", str(sent)]) == 0
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
    """evidence/scored_run/ (make scored-run-example): its ledger reads whole (signed chain, one run,
    every task played), its reveal is the document its committed commitment names, the entrant's
    receipts are the ledger's lines, and its scorecard is the one the ledger gives. Its entrant's
    nonce is the git commit that added commitment.json (where this clone has that commit, it holds
    that very file and precedes this one). `make verify-scored-run` (CI) also replays every
    episode: that needs this machine's arithmetic, this does not."""
    import subprocess

    from cernenv.server.audit import check_receipts, check_reveal, load_reveal

    root = Path(__file__).resolve().parents[1]
    folder = root / "evidence" / "scored_run"
    committed = json.loads((folder / "commitment.json").read_text())
    run = read_run(folder / "ledger.jsonl.gz")
    document = check_reveal(run, load_reveal(folder / "reveal.json"), folder / "reveal.json", committed["commitment"])
    assert run.ended is not None and run.ended.reason == "every task played"
    assert len(run.episodes) == run.opened.n_tasks == 313 and document["selection"] == "v3"
    assert check_receipts(run, folder / "receipts.json") >= 2
    kept = json.loads((folder / "receipts.json").read_text())["receipts"]
    assert kept[-1]["line"] == len(run.heads)  # the last receipt is the run's end: it covers every line
    nonce = run.seeded.entrant_nonce
    assert len(nonce) == 40 and all(c in "0123456789abcdef" for c in nonce)
    git = ["git", "-C", str(root)]
    if subprocess.run([*git, "cat-file", "-e", f"{nonce}^{{commit}}"], capture_output=True).returncode == 0:
        shown = subprocess.run([*git, "show", f"{nonce}:evidence/scored_run/commitment.json"], capture_output=True)
        assert json.loads(shown.stdout) == committed
        assert subprocess.run([*git, "merge-base", "--is-ancestor", nonce, "HEAD"]).returncode == 0
    assert scorecard_main([str(folder / "ledger.jsonl.gz"), "--expect", str(folder / "scorecard.json")]) == 0
    assert "the scorecard this ledger gives, field by field" in capsys.readouterr().out


def test_the_docs_figures_of_the_published_run_are_its_scorecards():
    """docs/reports.md quotes the published run; every figure it quotes is read from
    evidence/scored_run/scorecard.json, rounded as shown."""
    import re

    root = Path(__file__).resolve().parents[1]
    card = json.loads((root / "evidence" / "scored_run" / "scorecard.json").read_text())
    text = " ".join((root / "docs" / "reports.md").read_text().split())
    found = re.search(
        r"(\d+) fresh worlds: (\d+) of (\d+) correct \(success ([0-9.]+) \[([0-9.]+), ([0-9.]+)\]\), mean reward "
        r"([0-9.-]+) \[([0-9.-]+), ([0-9.-]+)\], false-discovery rate ([0-9.]+), (\d+) refused actions, (\d+) "
        r"campaigns ended without a claim",
        text,
    )
    assert found, "docs/reports.md no longer quotes the published run's figures in the form this test reads"
    whole = card["groups"]["all"]
    success, reward = whole["success_rate"], whole["mean_reward"]
    assert found.groups() == (
        str(card["n_tasks"]),
        str(round(success["mean"] * success["n"])),
        str(card["n_tasks"]),
        f"{success['mean']:.3f}",
        f"{success['low']:.3f}",
        f"{success['high']:.3f}",
        f"{reward['mean']:.2f}",
        f"{reward['low']:.2f}",
        f"{reward['high']:.2f}",
        f"{whole['false_discovery_rate']['mean']:.3f}",
        str(card["counts"]["all"]["refused_actions"]),
        str(card["counts"]["all"]["ended_without_claim"]),
    )


# -- what the audit counts as the same, and how it quotes a value --------------------------------


@pytest.mark.parametrize(
    "recorded, replayed, differs",
    [
        (True, 1, True),  # a bool is not a number, whichever side it is on
        (1, True, True),
        (False, False, False),
        (1, "1", True),  # a number is not its text
        (0.5, 0.5 + 1e-7, False),  # within REPLAY_TOLERANCE (1e-6), absolute
        (0.0, 2e-6, True),
        (100000.0, 100000.00001, True),  # 1e-5 apart: beyond 1e-6, whatever the size of the numbers
        ({"a": 1}, {"a": 1, "b": 2}, True),  # a key more
        ({"a": [1, 2.0]}, {"a": [1, 2.0000001]}, False),
        ({"a": 1}, [1], True),  # a mapping is not a list
        (["a"], "a", True),  # a list is not its one element
        ([1], [1, 2], True),  # an element more
        ([1, 2], [1, 3], True),
        ("x", "x", False),
        (None, 0, True),
    ],
)
def test_a_replayed_value_differs_only_beyond_the_tolerance_and_never_across_types(recorded, replayed, differs):
    from cernenv.server.audit import REPLAY_TOLERANCE, _differs

    assert REPLAY_TOLERANCE == 1e-6
    assert _differs(recorded, replayed) is differs


def test_a_quoted_value_is_its_sorted_json_cut_to_120_characters():
    from cernenv.server.audit import _short

    assert _short({"b": 1, "a": 2}) == '{"a": 2, "b": 1}'
    exactly = "x" * 118  # with its quotes, 120 characters: quoted whole
    assert _short(exactly) == json.dumps(exactly)
    longer = "x" * 119  # 121 characters: its first 117 and "..."
    assert _short(longer) == json.dumps(longer)[:117] + "..." and len(_short(longer)) == 120


# -- verify_run: the order, the worlds' nonces, the commitment published, its progress ---------------


def test_verify_run_reports_its_progress_episode_by_episode(played):
    calls = []
    verified, _ = verify_run(
        read_run(played["ledger"]), played["reveal"], lambda done, total: calls.append((done, total))
    )
    assert verified == 5 and calls == [(done, 5) for done in range(1, 6)]


def test_verify_run_holds_the_run_to_the_commitment_published_before_play(played):
    run = read_run(played["ledger"])
    assert verify_run(run, played["reveal"], commitment=run.opened.commitment)[0] == 5
    with pytest.raises(AuditError) as refused:
        verify_run(run, played["reveal"], commitment="0" * 64)
    assert str(refused.value) == (
        f"{played['ledger']}:1: run {run.opened.run_id} opened with the commitment {run.opened.commitment}, not the "
        f"one published before play ({'0' * 64}): this is not the run that was committed to"
    )


@pytest.mark.parametrize("field", ["assignment", "world_nonce"])
def test_an_episode_out_of_the_committed_order_or_in_another_world_is_refused_whole(played, tmp_path, field):
    """The operator re-signs an episode line with another place in the order, or another world's
    nonce: the line reads, and the verification names the ledger's line and what disagrees."""
    files = copy_of(played, tmp_path)
    records = lines_of(files["ledger"])
    index = next(i for i, r in enumerate(records) if r.get("record") == "episode" and r.get("assignment") == 1)
    episode = records[index]
    document = json.loads(files["reveal"].read_text())["document"]
    if field == "assignment":  # the first two places swapped: each place once, in another order
        first = next(i for i, r in enumerate(records) if r.get("record") == "episode" and r.get("assignment") == 0)
        records[first] = {**records[first], "assignment": 1}
        records[index] = {**episode, "assignment": 0}
        index = min(first, index)
        place = records[index]["assignment"]
        expected = (
            f"{files['ledger']}:{index + 1}: task {records[index]['task_index']} at place {place} of the order, where "
            f"the committed order has task {document['order'][place]}"
        )
    else:
        records[index] = {**episode, "world_nonce": "f" * 32}
        expected = (
            f"{files['ledger']}:{index + 1}: task {episode['task_index']}'s world nonce is not the one the worlds' "
            "secret gives"
        )
    write_lines(files["ledger"], records, rechain=True, key=played["run"]._signing_key)
    reveal = json.loads(files["reveal"].read_text())  # the operator writes the reveal too: its last line moved
    reveal["last_line_sha256"] = line_sha256(files["ledger"].read_text().splitlines()[-1])
    files["reveal"].write_text(json.dumps(reveal))
    with pytest.raises(AuditError) as refused:
        verify_run(read_run(files["ledger"]), files["reveal"])
    assert str(refused.value) == expected
