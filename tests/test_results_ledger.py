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
    with pytest.raises(OSError) as closed:  # its descriptor is gone, not another file's
        first.append(episode_line(2))
    assert str(closed.value) == f"the results ledger {path} is closed: nothing more is written to it"


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


def test_the_ledger_says_why_no_episode_may_be_played_and_logs_it_once_while_it_lasts(tmp_path, monkeypatch, caplog):
    """`room_problem`: None while the file system has `LEDGER_MIN_FREE_BYTES` free (exactly that is
    enough) or cannot be asked; below it, the free bytes and the threshold, with the last line's
    failure when there was one; a full ledger says so whatever the disk. Logged once while a problem
    lasts, and again once it returns after room came back."""
    ledger = ResultsLedger(tmp_path / "results.jsonl", max_bytes=1000, rotated_files=3)
    free = {"bytes": 10 * ledger_module.LEDGER_MIN_FREE_BYTES}

    class Statvfs:
        f_frsize = 512

        @property
        def f_bavail(self):
            return free["bytes"] // 512

    def statvfs(path):
        assert str(path) == str(tmp_path), "the ledger's own file system"
        if free["bytes"] is None:
            raise OSError("not supported here")
        return Statvfs()

    monkeypatch.setattr(ledger_module.os, "statvfs", statvfs)
    reports = lambda: [r.getMessage() for r in caplog.records if "plays no new episode" in r.getMessage()]  # noqa: E731
    low = ledger_module.LEDGER_MIN_FREE_BYTES - 512
    with caplog.at_level(logging.ERROR, logger="cernenv.server"):
        assert ledger.room_problem() is None
        free["bytes"] = ledger_module.LEDGER_MIN_FREE_BYTES
        assert ledger.room_problem() is None
        free["bytes"] = low
        expected = (
            f"the results ledger {ledger.path} cannot be written: its file system has {low} bytes free, "
            f"under the {ledger_module.LEDGER_MIN_FREE_BYTES} an episode's line needs"
        )
        assert ledger.room_problem() == expected
        assert ledger.room_problem() == expected
        assert reports() == [f"{expected}: the server plays no new episode until it has room again"]
        ledger.unwritable = "the line could not be written whole"
        assert ledger.room_problem() == f"{expected} (the line could not be written whole)"
        free["bytes"] = None
        assert ledger.room_problem() is None, "a file system that cannot say is not refused for it"
        free["bytes"] = low
        assert ledger.room_problem().startswith("the results ledger")
        assert len(reports()) == 2, "said again once the problem came back"
        free["bytes"] = 10 * ledger_module.LEDGER_MIN_FREE_BYTES
        ledger.full = True
        assert ledger.room_problem() == (
            f"the results ledger {ledger.path} is full (4 files of up to 1000 bytes): nothing more is recorded; "
            "move its files away (or raise --ledger-max-mib) and restart the server"
        )
        assert len(reports()) == 2, "a problem that lasts, whatever its reason now, is said once"
        ledger.full = False
        assert ledger.room_problem() is None
        ledger.full = True
        assert ledger.room_problem().endswith("restart the server") and len(reports()) == 3
        ledger.close()
        free["bytes"] = low
        fresh = ResultsLedger(tmp_path / "results.jsonl")
        assert fresh.room_problem() == expected and len(reports()) == 4, "a ledger's first refusal is said too"
        fresh.close()


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


def line_bytes(record: dict) -> int:
    """The bytes `record` takes in a plain ledger: its text and newline."""
    from cernenv.server.ledger import record_text

    return len(record_text(record).encode()) + 1


def test_a_client_s_share_is_its_bytes_exactly_and_a_client_less_episode_counts_as_unknown(tmp_path):
    """A share of exactly one line's bytes takes that line and refuses the next (the refusal says
    whose share, how much was written and the share), an address-less episode spends the share of
    "unknown", and `stepless_lines=1` writes one episode abandoned without a step, then counts."""
    first, second = episode_line(0), episode_line(1)
    ledger = ResultsLedger(tmp_path / "results.jsonl", client_max_bytes=line_bytes(first), stepless_lines=1)
    ledger.append(first)
    with pytest.raises(ledger_module.LedgerShareSpent) as spent:
        ledger.append(second)
    assert str(spent.value) == (
        f"client 127.0.0.1 has written {line_bytes(first)} bytes of episode lines, its share of "
        f"{line_bytes(first)}: its further episodes are not recorded (--ledger-max-mib sets both)"
    )
    anonymous = episode_line(2, client=None)
    ledger.append(anonymous)
    with pytest.raises(ledger_module.LedgerShareSpent, match="^client unknown has written"):
        ledger.append(episode_line(3, client=None))
    stepless = dict(abandoned=True, steps=0, client="10.0.0.9")
    ledger.append(episode_line(4, **stepless))
    with pytest.raises(ledger_module.LedgerShareSpent) as counted:
        ledger.append(episode_line(5, **stepless))
    assert str(counted.value) == (
        "client 10.0.0.9 has written 1 lines of episodes abandoned without a step: its further ones are "
        "counted, not written (1 so far)"
    )
    ledger.close()
    assert [r.task_index for r in read_ledger(tmp_path / "results.jsonl")] == [0, 2, 4]


def test_a_file_is_rotated_only_when_a_line_would_pass_its_size_and_only_if_it_holds_one(tmp_path):
    """A line larger than `max_bytes` goes into an empty file (rotating an empty file would only make
    files); a file of exactly `max_bytes` is not rotated; the line that would pass it is written
    into a new file, the old one numbered .1."""
    path = tmp_path / "results.jsonl"
    size = line_bytes(episode_line(0))
    small = ResultsLedger(path, max_bytes=size - 1, client_max_bytes=10**9)
    small.append(episode_line(0))
    assert path.stat().st_size == size and not ledger_module.rotated_path(path, 1).exists()
    small.close()
    path.unlink()
    exact = ResultsLedger(path, max_bytes=2 * size, client_max_bytes=10**9)
    exact.append(episode_line(0))
    exact.append(episode_line(1))
    assert path.stat().st_size == 2 * size and not ledger_module.rotated_path(path, 1).exists()
    exact.append(episode_line(2))
    assert ledger_module.rotated_path(path, 1).stat().st_size == 2 * size and path.stat().st_size == size
    exact.close()


def test_a_line_the_disk_refuses_leaves_its_file_as_it_was_and_the_next_written_clears_the_reason(
    tmp_path, monkeypatch
):
    """A write that raises (a full disk) or writes part of the line: OSError, the file cut back to
    what it held (an empty new file after a rotation stays empty), `unwritable` says why; the next
    line written sets it back to None."""
    path = tmp_path / "results.jsonl"
    size = line_bytes(episode_line(0))
    ledger = ResultsLedger(path, max_bytes=size, client_max_bytes=10**9)
    assert ledger.unwritable is None and ledger.full is False
    ledger.append(episode_line(0))
    real = ledger_module.os.write

    def refused(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ledger_module.os, "write", refused)
    with pytest.raises(OSError, match=r"results\.jsonl: the line could not be written whole \(is the disk full\?\)"):
        ledger.append(episode_line(1))  # rotates first: the new file is empty
    assert path.stat().st_size == 0 and ledger_module.rotated_path(path, 1).stat().st_size == size
    assert ledger.unwritable == f"results ledger {path}: the line could not be written whole (is the disk full?)"
    monkeypatch.setattr(ledger_module.os, "write", lambda fd, data: real(fd, data[:7]))
    with pytest.raises(OSError, match="could not be written whole"):
        ledger.append(episode_line(1))
    assert path.stat().st_size == 0, "no partial line"
    monkeypatch.setattr(ledger_module.os, "write", real)
    ledger.append(episode_line(1))
    assert ledger.unwritable is None and path.stat().st_size == size
    ledger.close()


def test_a_ledger_closes_each_of_its_descriptors_once(tmp_path, monkeypatch):
    """`close` closes the ledger's file and its lock, once each however often it is called, and
    nothing else."""
    ledger = ResultsLedger(tmp_path / "results.jsonl")
    mine = [ledger._fd, ledger._lock_fd]
    closed = []
    real = ledger_module.os.close
    monkeypatch.setattr(ledger_module.os, "close", lambda fd: (closed.append(fd), real(fd)))
    ledger.close()
    ledger.close()
    assert closed == mine


def test_a_new_ledger_makes_its_folder_private_and_a_run_file_has_no_shares(tmp_path):
    """The ledger's folder is made with its parents, readable by its owner alone; a plain ledger's
    client share defaults to one file's size, a scored run's file has no share and no stepless
    limit (every line of the run is written)."""
    import stat

    folder = tmp_path / "state" / "ledgers"
    plain = ResultsLedger(folder / "results.jsonl", max_bytes=5000)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert plain.client_max_bytes == 5000 and plain.stepless_lines == ledger_module.STEPLESS_LINES_PER_CLIENT
    plain.close()
    run = ResultsLedger(folder / "run.jsonl", run_file=True, client_max_bytes=10, stepless_lines=1)
    assert run.client_max_bytes is None and run.stepless_lines is None
    for index in range(3):
        run.append(episode_line(index, abandoned=True, steps=0))
    run.close()
    assert len(read_ledger(folder / "run.jsonl")) == 3


def test_the_ledger_s_refusals_say_what_to_do_word_for_word(tmp_path):
    """A second writer, a run file that exists, a plain ledger opened on a run's file, and a damaged
    line: each message whole, naming the file."""
    path = tmp_path / "results.jsonl"
    first = ResultsLedger(path)
    with pytest.raises(OSError) as second:
        ResultsLedger(path)
    assert str(second.value) == (
        f"the results ledger {path} is being written by another process (another server with the same "
        "state directory or --results-ledger?): two writers would rotate each other's lines away; give "
        "this server a ledger of its own with --results-ledger PATH or CERNENV_STATE_DIR"
    )
    first.close()
    run_path = tmp_path / "run.jsonl"
    ResultsLedger(run_path, run_file=True).close()
    with pytest.raises(OSError) as exists:
        ResultsLedger(run_path, run_file=True)
    assert str(exists.value) == (
        f"{run_path} exists: a scored run's ledger is a file of its own, made when the run opens; "
        "give a new path (or none: runs/RUN_ID.jsonl in the state directory)"
    )
    run_path.write_text(json.dumps({"record": "run_opened", "run_id": "r"}) + "\n")
    with pytest.raises(OSError) as opened:
        ResultsLedger(run_path)
    assert str(opened.value) == (
        f"{run_path} is a scored run's ledger, which no other server writes or rotates: give this "
        "server a results ledger of its own with --results-ledger PATH or CERNENV_STATE_DIR"
    )
    path.write_text(json.dumps(episode_line(0)) + "\nnot json\n")
    with pytest.raises(LedgerError) as damaged:
        read_ledger(path)
    assert str(damaged.value).endswith(
        "; the line is not a valid results-ledger record (a line cut by a full disk, or written by hand): "
        "read past it with skip_damaged=True, which reports each line it skips (a scored run's ledger is "
        "never read past: cernenv.server.audit)"
    )
    assert str(damaged.value).startswith(f"{path}:2: ")


def test_a_run_opening_line_is_recognised_after_its_first_line_only(tmp_path):
    """`_opens_a_run` reads the first line alone: a run's opening line first is a run's file; one
    after another line is not, and neither is a first line cut off past `FIRST_LINE_MAX_BYTES`."""
    path = tmp_path / "file.jsonl"
    opening = json.dumps({"record": "run_opened", "run_id": "r"})
    path.write_text(opening + "\n" + json.dumps(episode_line(0)) + "\n")
    assert ledger_module._opens_a_run(path)
    path.write_text(json.dumps(episode_line(0)) + "\n" + opening + "\n")
    assert not ledger_module._opens_a_run(path)
    padded = opening[:-1] + ", " + " " * ledger_module.FIRST_LINE_MAX_BYTES + "}"
    path.write_text(padded + "\n")
    assert not ledger_module._opens_a_run(path), "only FIRST_LINE_MAX_BYTES are read: a cut line is no JSON"


def test_a_number_json_cannot_write_is_refused_wherever_it_is():
    """NaN and the infinities, which Python's JSON reader accepts: refused when writing a record, and
    when reading a line, at any depth of a free-form object, the error naming the place."""
    from cernenv.server.ledger import record_text

    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
            record_text({"x": [1.0, bad]})
    line = json.dumps(episode_line(0, truth={"exists": True, "mass_gev": 125.0, "widths": [1.0, 2.0]}))
    assert parse_line(line).truth["widths"] == [1.0, 2.0]
    for damaged, where, value in (
        (line.replace('"mass_gev": 125.0', '"mass_gev": NaN'), "the line.truth.mass_gev", "nan"),
        (line.replace("[1.0, 2.0]", "[1.0, -Infinity]"), "the line.truth.widths[1]", "-inf"),
        (line.replace('"episode_reward": 2.5', '"episode_reward": Infinity'), "the line.episode_reward", "inf"),
    ):
        with pytest.raises(ValueError) as refused:
            parse_line(damaged)
        assert str(refused.value) == f"{where} is {value}: a ledger holds finite numbers only"


def test_two_wrong_fields_are_one_and_one_more():
    two = validation_error({**episode_line(), "steps": "four", "seed": "x"})
    assert two.error_count() == 2
    assert _problem(two).endswith(" (and 1 more)")


def test_a_line_s_digest_does_not_depend_on_the_order_of_its_fields():
    """The signed digest is of the record's canonical text (sorted keys): a verifier that re-encodes a
    line, in any order, computes the digest the server signed."""
    record = episode_line(0)
    reordered = dict(reversed(list(record.items())))
    assert json.dumps(record) != json.dumps(reordered)
    assert line_digest(json.dumps(record)) == line_digest(json.dumps(reordered))
    import hashlib

    assert line_digest(json.dumps(record)) == hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def test_a_record_s_stale_signature_is_replaced_by_the_run_s_own(tmp_path):
    """A record handed to a run's file with a `signature` already in it is signed afresh (the stale one
    is not part of what is signed), and without a key it is written without one."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from cernenv.server.ledger import public_key_hex, signature_holds

    key = Ed25519PrivateKey.generate()
    signed = ResultsLedger(tmp_path / "signed.jsonl", run_file=True, signing_key=key)
    signed.append({**episode_line(0), "signature": "ab" * 64})
    signed.close()
    line = (tmp_path / "signed.jsonl").read_text().splitlines()[0]
    assert json.loads(line)["signature"] != "ab" * 64
    assert signature_holds(public_key_hex(key), line_digest(line), json.loads(line)["signature"])
    unsigned = ResultsLedger(tmp_path / "unsigned.jsonl", run_file=True)
    unsigned.append({**episode_line(0), "signature": "ab" * 64})
    unsigned.close()
    assert "signature" not in json.loads((tmp_path / "unsigned.jsonl").read_text())


def test_the_first_line_that_cannot_be_written_is_reported_at_once(tmp_path, monkeypatch, caplog):
    """However soon after the clock's zero the first failure comes, it is reported, not held back."""
    monkeypatch.setattr(ledger_module.time, "monotonic", lambda: 0.0)
    ledger = ResultsLedger(tmp_path / "results.jsonl")
    with caplog.at_level(logging.ERROR, logger="cernenv.server"):
        assert ledger.append_or_report(episode_line(1, steps="many")) is False
    assert sum("could not record 1 ended episode(s)" in r.getMessage() for r in caplog.records) == 1
    ledger.close()
