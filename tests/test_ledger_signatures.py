"""A scored run's ledger changed by someone without the run's key: a line with its signature
removed, emptied, garbled or borrowed from another line, and a change to any field of any line
(everything the line holds but its signature is signed, so nothing on it is taken on trust), is
refused at that line; a forger who signs with a key of its own is refused by the reveal, which
committed to the run's key before play. The run played is `test_run_audit.played`'s."""

from __future__ import annotations

import copy
import json
import re
from typing import Any, Dict, List

import pytest
import test_run_audit
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from test_run_audit import copy_of, lines_of, write_lines

from cernenv.server.audit import AuditError, read_run, verify_run
from cernenv.server.ledger import parse_line, public_key_hex, record_text
from lib.measure.scorecard import main as scorecard_main

played = test_run_audit.played  # the fixture: one scored run of 6 tasks, played once for this module

UNSIGNED = "its signature does not verify under the run's key"
# Lines: 1 the opening, 2 the entrant's nonce, 3 to 7 the five episodes, 8 the end.
LINES = {"the opening": 1, "the entrant's nonce": 2, "an episode": 3, "an abandoned episode": 5, "the end": 8}


def write_texts(path, records: List[Dict[str, Any]]) -> None:
    """Write `records` as they are: no chain recomputed, nothing signed."""
    path.write_text("".join(record_text(record) + "\n" for record in records))


def refused_at(files, records: List[Dict[str, Any]], line: int, reason: str, capsys, field: str = "") -> None:
    """The ledger of `records` is refused by the reader and the scorer, naming `line` and `reason`
    (`field`: the one changed, named if it is not)."""
    write_texts(files["ledger"], records)
    try:
        read_run(files["ledger"])
    except AuditError as error:
        assert re.search(rf"{files['ledger'].name}:{line}: {reason}", str(error)), (field, str(error))
    else:
        pytest.fail(f"line {line} reads whole with {field or 'its signature'} changed")
    assert scorecard_main([str(files["ledger"]), "--reveal", str(files["reveal"])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f":{line}: " in err and "Traceback" not in err


def test_the_ledger_played_reads_whole(played, tmp_path):
    """The baseline the cases below change: the ledger written again as it was reads whole."""
    files = copy_of(played, tmp_path)
    records = lines_of(files["ledger"])
    assert [r["record"] for r in records][:2] == ["run_opened", "run_seeded"] and len(records) == 8
    assert records[4]["grade"] is None, "line 5 is the abandoned episode"
    write_texts(files["ledger"], records)
    assert read_run(files["ledger"]).ended is not None


@pytest.mark.parametrize("which", list(LINES))
@pytest.mark.parametrize(
    "unsign",
    [
        pytest.param(lambda record, other: record.pop("signature"), id="field removed"),
        pytest.param(lambda record, other: record.update(signature=None), id="null"),
        pytest.param(lambda record, other: record.update(signature=""), id="empty"),
        pytest.param(lambda record, other: record.update(signature="zz" * 64), id="not hex"),
        pytest.param(lambda record, other: record.update(signature=record["signature"][:-2]), id="cut short"),
        pytest.param(lambda record, other: record.update(signature=other["signature"]), id="another line's"),
    ],
)
def test_a_line_without_its_own_signature_is_refused(played, tmp_path, which, unsign, capsys):
    """The line is otherwise exactly as the server wrote it (its chain intact): only the signature
    is missing or is not this line's."""
    files = copy_of(played, tmp_path)
    records = lines_of(files["ledger"])
    line = LINES[which]
    unsign(records[line - 1], records[line % len(records)])
    refused_at(files, records, line, UNSIGNED, capsys)


def test_lines_without_any_signature_are_refused_at_the_first(played, tmp_path, capsys):
    """Every signature stripped, as a ledger written by anything but the run's server would be."""
    files = copy_of(played, tmp_path)
    records = [{k: v for k, v in record.items() if k != "signature"} for record in lines_of(files["ledger"])]
    refused_at(files, records, 1, UNSIGNED, capsys)


def altered(value: Any) -> Any:
    """`value` changed, keeping its JSON type where it can: a flipped boolean, a number moved,
    a string lengthened, an object's first member changed, an array's last element dropped."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value + "0"
    if isinstance(value, dict):
        if not value:
            return {"added": 1}
        first = next(iter(value))
        return {**value, first: altered(value[first])}
    if isinstance(value, list):
        return value[:-1] if value else [0]
    return "0" * 16  # None


@pytest.mark.parametrize("which", list(LINES))
def test_any_field_changed_without_the_key_is_refused_at_its_line(played, tmp_path, which, capsys):
    """Each field of the line (every one it holds but its signature, read from the line itself), changed
    alone with the line's signature kept: refused at that line, by its signature wherever the line
    still reads as a ledger record (by its form otherwise; the opening's previous, which must be
    null, by that rule, checked first)."""
    files = copy_of(played, tmp_path)
    records = lines_of(files["ledger"])
    line = LINES[which]
    fields = sorted(set(records[line - 1]) - {"signature"})
    assert len(fields) >= 5, fields
    for field in fields:
        changed = copy.deepcopy(records)
        record = changed[line - 1]
        record[field] = altered(record.get(field))
        assert record != records[line - 1], field
        try:
            parse_line(record_text(record))
            reason = UNSIGNED
        except ValueError:
            reason = "not a results-ledger record"
        if line == 1 and field == "previous":
            reason = "the run's first line carries a previous line's hash"
        refused_at(files, changed, line, reason, capsys, field)


def test_a_forger_with_a_key_of_its_own_is_refused_by_the_reveal(played, tmp_path):
    """Every line signed again with the forger's key, its public half put on line 1 and an
    episode's grade flipped: the ledger alone holds together (its key is line 1's), but the reveal
    committed to the run's key before play, and the run's opening no longer describes it."""
    files = copy_of(played, tmp_path)
    records = lines_of(files["ledger"])
    forger = Ed25519PrivateKey.generate()
    records[0] = {**records[0], "public_key": public_key_hex(forger)}
    records[2]["grade"] = {**records[2]["grade"], "correct_outcome": not records[2]["grade"]["correct_outcome"]}
    write_lines(files["ledger"], records, rechain=True, key=forger)
    run = read_run(files["ledger"])
    assert run.opened.public_key == public_key_hex(forger)
    reveal = json.loads(files["reveal"].read_text())
    reveal["last_line_sha256"] = run.last_sha256  # the commitment does not cover it
    files["reveal"].write_text(json.dumps(reveal))
    with pytest.raises(AuditError, match=r"jsonl:1: the run's opening and the committed document differ in public_key"):
        verify_run(run, files["reveal"])
