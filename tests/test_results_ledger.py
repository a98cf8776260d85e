"""The results ledger's writer and reader, line by line (`cernenv.server.ledger`): what a damaged line
is reported as, a ledger read across blank and undecodable lines, the lock a closed ledger gives back,
a run file's receipts, the bounded log of lines that could not be written, which files are a scored
run's, and the plain values a record may hold. The server's use of them is in test_scored_runs.py."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from pydantic import ValidationError
from test_scored_runs import episode_line

from cernenv.server import ledger as ledger_module
from cernenv.server.ledger import (
    REPORT_EVERY_S,
    LedgerError,
    ResultsLedger,
    _plain_scalar,
    _problem,
    line_digest,
    line_sha256,
    parse_line,
    read_ledger,
)


def validation_error(record: dict) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        parse_line(json.dumps(record))
    return caught.value


def test_a_problem_names_the_first_field_wrong_and_counts_the_others():
    """One wrong field: its dotted place and pydantic's message, nothing more; three wrong: the first,
    then "(and 2 more)"; a record that is not an object at all: "the line"; not JSON: JSON's message."""
    one = validation_error({**episode_line(), "steps": "four"})
    assert one.error_count() == 1 and one.errors()[0]["loc"] == ("episode", "steps")
    assert _problem(one) == f"episode.steps: {one.errors()[0]['msg']}"
    grade = {**episode_line()["grade"], "correct_outcome": "no"}
    three = validation_error({**episode_line(), "steps": "four", "seed": "x", "grade": grade})
    assert three.error_count() == 3
    first = three.errors()[0]
    assert _problem(three) == f"{'.'.join(map(str, first['loc']))}: {first['msg']} (and 2 more)"
    assert _problem(validation_error([1, 2])).startswith("the line: ")
    with pytest.raises(json.JSONDecodeError) as not_json:
        parse_line("{not json")
    assert _problem(not_json.value) == str(not_json.value)


def test_read_ledger_counts_blank_lines_reads_past_them_and_replaces_undecodable_bytes(tmp_path):
    """A blank line is skipped, not an end: the records after it are read, and a damaged line's number
    counts it. Bytes that are not UTF-8 inside a string are read as U+FFFD (the record stays whole),
    not an error that loses the file."""
    path = tmp_path / "results.jsonl"
    good = [json.dumps(episode_line(index)) for index in range(3)]
    undecodable = json.dumps(episode_line(3, session_id="s-XX")).encode().replace(b"XX", b"\xff\xfe")
    path.write_bytes(
        (good[0] + "\n\n" + good[1] + "\n   \n").encode() + undecodable + b"\n" + (good[2] + "\n{}\n").encode()
    )
    with pytest.raises(LedgerError, match=r"results\.jsonl:7: .*read past it with skip_damaged=True") as error:
        read_ledger(path)
    assert "ended_at" in str(error.value)
    records, problems = read_ledger(path, skip_damaged=True)
    assert [r.task_index for r in records] == [0, 1, 3, 2]
    assert records[2].session_id == "s-\ufffd\ufffd"
    assert len(problems) == 1 and problems[0].startswith(f"{path}:7: ")
    assert not (tmp_path / "absent.jsonl").exists()
    with pytest.raises(FileNotFoundError, match="no results ledger at .*absent.jsonl"):
        read_ledger(tmp_path / "absent.jsonl")


def test_a_closed_ledger_gives_its_lock_back_and_closes_once(tmp_path):
    """While a ledger is open a second writer is refused; `close` (twice is harmless) frees the file
    for the next, which appends after what the first wrote."""
    path = tmp_path / "results.jsonl"
    first = ResultsLedger(path)
    first.append(episode_line(0))
    with pytest.raises(OSError, match="being written by another process"):
        ResultsLedger(path)
    first.close()
    first.close()
    second = ResultsLedger(path)
    second.append(episode_line(1))
    second.close()
    assert [r.task_index for r in read_ledger(path)] == [0, 1]
    with pytest.raises(OSError):  # its descriptor is gone, not another file's
        first.append(episode_line(2))


def test_a_run_files_head_is_the_receipt_of_its_last_line(tmp_path):
    """None before the first line; then the line's number, `line_sha256` and `line_digest` of the
    line as written, and a copy: changing what `head` returned changes no later receipt. A plain
    ledger has no receipts."""
    run = ResultsLedger(tmp_path / "run.jsonl", run_file=True)
    assert run.head() is None
    for index in range(2):
        run.append(episode_line(index))
        head = run.head()
        lines = (tmp_path / "run.jsonl").read_text().splitlines()
        assert head == {
            "line": index + 1,
            "line_sha256": line_sha256(lines[-1]),
            "digest": line_digest(lines[-1]),
            "signature": None,
        }
        head["line"] = 99
    assert run.head()["line"] == 2
    assert json.loads(lines[1])["previous"] == line_sha256(lines[0]) and json.loads(lines[0])["previous"] is None
    run.close()
    plain = ResultsLedger(tmp_path / "results.jsonl")
    plain.append(episode_line(0))
    assert plain.head() is None
    plain.close()


def test_lines_that_cannot_be_written_are_logged_once_a_period_with_their_count(tmp_path, monkeypatch, caplog):
    """`append_or_report`: True for a line written; an invalid record is False and logged; further
    failures within `REPORT_EVERY_S` are counted silently, and the next report after the period gives
    the count since the last one."""
    clock = {"now": 1000.0}
    monkeypatch.setattr(ledger_module.time, "monotonic", lambda: clock["now"])
    ledger = ResultsLedger(tmp_path / "results.jsonl")
    bad = episode_line(1, steps="many")
    with caplog.at_level(logging.ERROR, logger="cernenv.server"):
        assert ledger.append_or_report(episode_line(0)) is True
        assert ledger.append_or_report(bad) is False
        for _ in range(3):
            clock["now"] += REPORT_EVERY_S / 4
            assert ledger.append_or_report(bad) is False
        clock["now"] += REPORT_EVERY_S / 4  # exactly a period since the first report
        assert ledger.append_or_report(bad) is False
    reports = [r.getMessage() for r in caplog.records if "could not record" in r.getMessage()]
    assert len(reports) == 2
    assert reports[0].startswith("could not record 1 ended episode(s) in the results ledger: not a valid")
    assert reports[1].startswith("could not record 4 ended episode(s)")
    ledger.close()


@pytest.mark.parametrize(
    "first_line, refused",
    [
        ('{"record": "run_opened", "run_id": "r"}', True),
        ('{"record": "episode"}', False),
        ('["record", "run_opened"]', False),
        ("not json at all", False),
        ("", False),
    ],
)
def test_only_a_file_that_opens_with_a_run_is_a_scored_runs_ledger(tmp_path, first_line, refused):
    """A plain server refuses a file whose first line opens a scored run, and only that: a run opened on
    a later line, a JSON list, a line that is not JSON and an empty file are a results ledger to append to."""
    path = tmp_path / "results.jsonl"
    path.write_text(first_line + "\n" + '{"record": "run_opened", "run_id": "later"}\n')
    if refused:
        with pytest.raises(OSError, match="is a scored run's ledger"):
            ResultsLedger(path)
    else:
        ResultsLedger(path).close()


def test_numpy_scalars_become_plain_values_and_nothing_else_is_accepted():
    """numpy's bool, integer and float become Python's (JSON true/false and numbers); an object that is
    not numpy's is refused by its type's name, even one with an `item` method, as is a numpy object
    without one."""
    assert _plain_scalar(np.bool_(True)) is True
    assert _plain_scalar(np.int64(7)) == 7 and type(_plain_scalar(np.int64(7))) is int
    assert type(_plain_scalar(np.float32(0.5))) is float

    class LooksNumeric:
        def item(self):
            return 1

    with pytest.raises(TypeError, match="plain JSON values, not LooksNumeric"):
        _plain_scalar(LooksNumeric())
    with pytest.raises(TypeError, match="plain JSON values, not Float32DType"):
        _plain_scalar(np.dtype("float32"))
    assert json.loads(json.dumps(_plain_scalar(np.bool_(False)))) is False
