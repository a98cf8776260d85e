"""Each refusal `cernenv.server.audit.read_run` gives a scored run's ledger, its whole message: a file
that is missing, cut short or empty, a run that names no commitment or key, another run's id, a line
whose signature fails, an opening time without its offset, and an episode line the operator signed
again with a field no server writes (a task out of range, a place out of the order, no actions, no
resources or reward, steps and refusals that cannot be, another seed, scenario or difficulty than
its task's). The tampering cases of tests/test_run_audit.py check that each is caught at its line;
these pin what each message says."""

from __future__ import annotations

import gzip
from typing import Any, Callable, Dict, List

import pytest
from test_run_audit import ENTRANT, lines_of, play, write_lines

from cernenv.rules import END_WITHOUT_CLAIM
from cernenv.server.audit import AuditError, read_run
from lib.agents.remote_player import Receipts


@pytest.fixture(scope="module")
def ledger_lines(tmp_path_factory):
    """A run of 2 drawn tasks, 1 played by the heuristic, then the server stopped: its ledger's records,
    and the run (its signing key)."""
    directory = tmp_path_factory.mktemp("run")
    plan = ["heuristic", None]
    run = play(directory, "draw:2", lambda k: plan[k], receipts=Receipts({}, ENTRANT))
    return lines_of(run.ledger_path), run


def refusal(path, **kwargs) -> str:
    with pytest.raises(AuditError) as refused:
        read_run(path, **kwargs)
    return str(refused.value)


def test_a_ledger_that_is_missing_cut_short_or_empty_is_refused_whole(ledger_lines, tmp_path):
    records, run = ledger_lines
    path = tmp_path / "run.jsonl"
    assert refusal(path) == f"{path}: no such file: give the scored run's ledger (RUN_ID.jsonl, or .jsonl.gz)"
    text = run.ledger_path.read_text()
    path.write_text(text[:-1])
    assert refusal(path) == f"{path}:{len(records)}: cut short (no newline at its end)"
    path.write_text("")
    assert refusal(path) == f"{path}: empty: a scored run's ledger starts with the line that opens the run"
    compressed = tmp_path / "run.jsonl.gz"
    compressed.write_bytes(gzip.compress(text.encode()))
    assert len(read_run(compressed).heads) == len(records)


def test_a_ledger_of_another_run_is_named_with_both_ids(ledger_lines, tmp_path):
    records, run = ledger_lines
    path = tmp_path / "run.jsonl"
    path.write_text(run.ledger_path.read_text())
    assert read_run(path, run_id=run.run_id).opened.run_id == run.run_id
    assert refusal(path, run_id="another") == f"{path}:1: this ledger holds run {run.run_id}, not another"


@pytest.mark.parametrize("missing", ["commitment", "public_key"])
def test_a_run_without_its_commitment_or_its_key_cannot_be_checked(ledger_lines, tmp_path, missing):
    records, run = ledger_lines
    path = tmp_path / "run.jsonl"
    write_lines(path, [{**records[0], missing: None}, *records[1:]], rechain=True)
    assert refusal(path) == (
        f"{path}:1: run {run.run_id} published no commitment or signing key (a ledger written before scored runs "
        "committed to their worlds and signed their lines): it cannot be checked"
    )


def test_a_line_whose_signature_fails_is_named_whole(ledger_lines, tmp_path):
    records, _ = ledger_lines
    path = tmp_path / "run.jsonl"
    write_lines(path, [records[0], {**records[1], "agent": "another"}, *records[2:]], rechain=False)
    assert refusal(path) == (
        f"{path}:2: its signature does not verify under the run's key (line 1's public_key): the line was changed "
        "after the server signed it, or written without the run's key"
    )


@pytest.mark.parametrize("opened_at", ["yesterday", "2026-12-07T00:00:00"])
def test_an_opening_time_without_its_offset_is_refused(ledger_lines, tmp_path, opened_at):
    """A time is read with its offset (UTC as the server writes it): one without is not a time a
    later line can be ordered against."""
    records, run = ledger_lines
    path = tmp_path / "run.jsonl"
    write_lines(path, [{**records[0], "opened_at": opened_at}, *records[1:]], rechain=True, key=run._signing_key)
    assert refusal(path) == f"{path}:1: opened_at {opened_at!r} is not an ISO 8601 time with its offset"


def _episode_changed(records: List[Dict[str, Any]], change: Callable[[Dict[str, Any]], Dict[str, Any]]):
    """The records with the first graded episode changed, and that episode's line number."""
    index = next(i for i, r in enumerate(records) if r.get("record") == "episode" and r.get("grade"))
    return [*records[:index], change(dict(records[index])), *records[index + 1 :]], index + 1


def _task_of(records):
    """The first graded episode's task (as the run's opening lists it) and the episode."""
    episode = next(r for r in records if r.get("record") == "episode" and r.get("grade"))
    return records[0]["tasks"][episode["task_index"]], episode


CASES = {
    "a task out of range": (
        lambda e: {**e, "task_index": 2},
        lambda e, task: "an episode of task 2: the run has tasks 0 to 1",
    ),
    "a place out of the order": (
        lambda e: {**e, "assignment": 2},
        lambda e, task: f"task {e['task_index']} handed out at place 2 of the run's order, which has 2",
    ),
    "no actions": (
        lambda e: {**e, "actions": None},
        lambda e, task: "an episode without its actions: it cannot be replayed",
    ),
    "no refusal count": (
        lambda e: {**e, "refused_actions": None},
        lambda e, task: "an episode without its actions: it cannot be replayed",
    ),
    "no resources": (
        lambda e: {**e, "resources": None},
        lambda e, task: (
            "an episode without its final resources (resources: null): the budget and time metrics read them"
        ),
    ),
    "no reward": (
        lambda e: {**e, "episode_reward": None},
        lambda e, task: "an episode without its reward (episode_reward: null)",
    ),
    "more refusals than actions": (
        lambda e: {**e, "refused_actions": len(e["actions"]) + 1},
        lambda e, task: (
            f"steps {e['steps']} and refused_actions {len(e['actions']) + 1} of {len(e['actions'])} actions"
        ),
    ),
    "abandoned, yet with a claim": (
        lambda e: {**e, "grade": None, "ended": "abandoned: reset"},
        lambda e, task: "an abandoned episode with a claim: a claim ends an episode, graded",
    ),
    "ended by a claim it does not hold": (
        lambda e: {**e, "claim": None},
        lambda e, task: "claim: null, yet the episode ended by its claim (ended 'claim')",
    ),
    "an end the campaign has not": (
        lambda e: {**e, "claim": None, "ended": "the agent won"},
        lambda e, task: (
            f"ended 'the agent won': neither a claim nor one of the campaign's ends {list(END_WITHOUT_CLAIM.values())}"
        ),
    ),
    "another seed": (
        lambda e: {**e, "seed": 12345},
        lambda e, task: f"task {e['task_index']}: its seed 12345 is not task {e['task_index']}'s, {task['seed']}",
    ),
    "a curated scenario for a procedural task": (
        lambda e: {**e, "scenario": "higgs_diphoton_125"},
        lambda e, task: (
            f"task {e['task_index']}: it is higgs_diphoton_125 ({e['difficulty']}), not task {e['task_index']}'s "
            f"procedural {task['difficulty']} campaign"
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_episode_line_signed_again_with_a_field_no_server_writes_is_refused_whole(ledger_lines, tmp_path, case):
    records, run = ledger_lines
    change, message = CASES[case]
    task, episode = _task_of(records)
    changed, number = _episode_changed(records, change)
    path = tmp_path / "run.jsonl"
    write_lines(path, changed, rechain=True, key=run._signing_key)
    assert refusal(path) == f"{path}:{number}: {message(episode, task)}"


def test_every_action_refused_is_a_count_the_ledger_may_hold(ledger_lines, tmp_path):
    """An episode may have had every action it sent refused: as many refusals as actions reads."""
    records, run = ledger_lines
    path = tmp_path / "run.jsonl"
    changed, _ = _episode_changed(records, lambda e: {**e, "refused_actions": len(e["actions"])})
    write_lines(path, changed, rechain=True, key=run._signing_key)
    episode = read_run(path).episodes[0][1]
    assert episode.refused_actions == len(episode.actions)


def test_zero_steps_is_a_count_the_ledger_may_hold(ledger_lines, tmp_path):
    """The steps' lower bound is 0 (an episode abandoned before its first step has none): only a
    negative count is refused."""
    records, run = ledger_lines
    path = tmp_path / "run.jsonl"
    changed, _ = _episode_changed(records, lambda e: {**e, "steps": 0})
    write_lines(path, changed, rechain=True, key=run._signing_key)
    assert read_run(path).episodes[0][1].steps == 0
    changed, number = _episode_changed(records, lambda e: {**e, "steps": -1})
    write_lines(path, changed, rechain=True, key=run._signing_key)
    assert refusal(path).startswith(f"{path}:{number}: steps -1 and refused_actions ")


def _index(records, kind: str) -> int:
    return next(i for i, r in enumerate(records) if r.get("record") == kind)


def _with(records, kind: str, **changes):
    """The records with the first of `kind` changed by `changes`."""
    index = _index(records, kind)
    return [*records[:index], {**records[index], **changes}, *records[index + 1 :]]


def test_a_line_that_does_not_carry_the_hash_of_the_one_before_is_refused_whole(ledger_lines, tmp_path):
    records, _ = ledger_lines
    path = tmp_path / "run.jsonl"
    write_lines(path, [records[0], records[2], records[1], *records[3:]], rechain=False)
    assert refusal(path) == (
        f"{path}:2: the hash it carries is not line 1's: line 1 was changed, or lines were inserted, removed or "
        "moved there"
    )


def test_a_line_after_the_run_s_end_is_refused_whole(ledger_lines, tmp_path):
    records, run = ledger_lines
    path = tmp_path / "run.jsonl"
    end = _index(records, "run_ended")
    write_lines(path, [*records[: end + 1], records[end]], rechain=True, key=run._signing_key)
    assert refusal(path) == f"{path}:{end + 2}: a line after the run's end (RunEnded, line {end + 1})"


@pytest.mark.parametrize("missing", ["agent", "agent_sha256", "entrant_public_key"])
def test_a_nonce_line_that_binds_no_agent_is_refused_whole(ledger_lines, tmp_path, missing):
    records, run = ledger_lines
    path = tmp_path / "run.jsonl"
    write_lines(path, _with(records, "run_seeded", **{missing: None}), rechain=True, key=run._signing_key)
    assert refusal(path) == (
        f"{path}:2: the run is bound to no agent: its nonce line does not carry the agent, its code's SHA-256 and "
        "the entrant's key (a run played before runs were bound to their agent)"
    )


def test_a_nonce_line_the_entrant_did_not_sign_is_refused_whole(ledger_lines, tmp_path):
    records, run = ledger_lines
    path = tmp_path / "run.jsonl"
    write_lines(path, _with(records, "run_seeded", entrant_nonce="f" * 40), rechain=True, key=run._signing_key)
    assert refusal(path) == (
        f"{path}:2: the entrant's signature of its nonce and agent does not hold for this run and its commitment "
        "(cernenv.server.runs.entrant_statement): not the nonce its entrant sent to this run"
    )


def test_a_run_end_before_an_episode_s_end_and_every_wrong_count_are_named_together(ledger_lines, tmp_path):
    """The run's end is checked against the ledger as a whole: each thing it says wrong is named,
    joined by "; " (here a count and a time); an episode that ended at the very time the run did
    is not late."""
    records, run = ledger_lines
    path = tmp_path / "run.jsonl"
    end = _index(records, "run_ended")
    episode = _index(records, "episode")
    write_lines(
        path, _with(records, "run_ended", ended_at=records[episode]["ended_at"]), rechain=True, key=run._signing_key
    )
    assert read_run(path).ended is not None
    early = records[0]["opened_at"]
    write_lines(path, _with(records, "run_ended", ended_at=early, recorded=5), rechain=True, key=run._signing_key)
    recorded = sum(1 for r in records if r.get("record") == "episode")
    assert refusal(path) == (
        f"{path}:{end + 1}: the run's end says recorded 5 (the ledger holds {recorded}); it ended at {early}, "
        f"before the episode of line {episode + 1} ended"
    )


def test_a_planted_rotated_file_and_a_task_played_twice_are_refused_whole(ledger_lines, tmp_path):
    records, run = ledger_lines
    path = tmp_path / "run.jsonl"
    path.write_text(run.ledger_path.read_text())
    planted = path.with_name(path.name + ".7")
    planted.write_text(path.read_text())
    assert refusal(path) == (
        f"{planted}: a rotated file beside the scored run's ledger {path.name}, which is never rotated: the run's "
        "server did not write it; remove it, or score the ledger alone"
    )
    planted.unlink()
    episode = _index(records, "episode")
    twice = [*records[: episode + 1], {**records[episode], "assignment": 1}, *records[episode + 1 :]]
    write_lines(path, twice, rechain=True, key=run._signing_key)
    task = records[episode]["task_index"]
    assert refusal(path) == (
        f"{path}:{episode + 2}: task {task} again (line {episode + 1} has its episode): a run plays each task once"
    )


def test_an_episode_of_another_scenario_than_its_task_names_is_refused_whole(ledger_lines, tmp_path):
    """A task may name a curated scenario (the suite's curated tasks do): its episode must be of it."""
    records, run = ledger_lines
    path = tmp_path / "run.jsonl"
    episode = records[_index(records, "episode")]
    task = episode["task_index"]
    tasks = [dict(t) for t in records[0]["tasks"]]
    tasks[task]["scenario"] = "higgs_diphoton_125"
    write_lines(path, [{**records[0], "tasks": tasks}, *records[1:]], rechain=True, key=run._signing_key)
    assert refusal(path) == (
        f"{path}:{_index(records, 'episode') + 1}: task {task}: its scenario {episode['scenario']} is not task "
        f"{task}'s, higgs_diphoton_125"
    )
