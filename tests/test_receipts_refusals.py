"""Each refusal of an entrant's receipts (`cernenv.server.audit.check_receipts`) and of a run's
reveal (`load_reveal`, `check_reveal`), its whole message: a receipts file that is missing, not
JSON, not receipts, for a run without an entrant, of another run, not signed by the entrant, a
receipt out of order or not the server's, a ledger cut or changed after a receipt, receipts that
stop before the run's end; a reveal that is missing, not one, or not its run's. The messages name
the file (and the ledger's line) and say what to do, so each is pinned whole rather than by a phrase."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from test_run_audit import ENTRANT, play

from cernenv.server.audit import RECEIPTS_FORMAT, AuditError, check_receipts, read_run
from cernenv.server.runs import receipts_statement
from lib.agents.remote_player import Receipts


@pytest.fixture(scope="module")
def run_and_receipts(tmp_path_factory):
    """A run of 2 drawn tasks, 1 played by the heuristic, then the server stopped; the ledger as
    `read_run` reads it and the entrant's signed receipts."""
    directory = tmp_path_factory.mktemp("run")
    plan = ["heuristic", None]
    run = play(directory, "draw:2", lambda k: plan[k], receipts=(receipts := Receipts({}, ENTRANT)))
    receipts.header.update(run_id=run.run_id, commitment=run.commitment, public_key=run.public_key)
    return read_run(run.ledger_path), receipts.signed()


def resigned(kept, **changes):
    """The entrant's receipts with `changes`, signed again by the entrant (what it could do itself)."""
    kept = {**kept, **changes}
    return {**kept, "entrant_signature": ENTRANT.sign(receipts_statement(kept))}


def refusal(run, path) -> str:
    with pytest.raises(AuditError) as refused:
        check_receipts(run, path)
    return str(refused.value)


def test_the_receipts_it_was_given_pass(run_and_receipts, tmp_path):
    run, kept = run_and_receipts
    path = tmp_path / "receipts.json"
    path.write_text(json.dumps(kept))
    assert check_receipts(run, path) == len(kept["receipts"]) >= 2


def test_a_missing_file_is_named_with_what_to_give(run_and_receipts, tmp_path):
    run, _ = run_and_receipts
    path = tmp_path / "receipts.json"
    assert refusal(run, path) == f"{path}: no such file: give the entrant's receipts (receipts.json)"


def test_a_file_that_is_not_json_is_refused_with_what_to_give(run_and_receipts, tmp_path):
    run, _ = run_and_receipts
    path = tmp_path / "receipts.json"
    for text in (b"{not json", b"\xff\xfe"):
        path.write_bytes(text)
        message = refusal(run, path)
        assert re.fullmatch(
            re.escape(f"{path}: not JSON (") + r".+" + re.escape("): give the receipts your client kept"), message
        )


@pytest.mark.parametrize(
    "kept",
    [[], {"receipts": []}, {"format": RECEIPTS_FORMAT}, {"format": RECEIPTS_FORMAT, "receipts": {}}],
    ids=["a list", "no format", "no receipts", "receipts not a list"],
)
def test_json_that_is_not_receipts_is_refused(run_and_receipts, tmp_path, kept):
    run, _ = run_and_receipts
    path = tmp_path / "receipts.json"
    path.write_text(json.dumps(kept))
    assert refusal(run, path) == (
        f"{path}: not an entrant's receipts (no format 'cernenv scored-run receipts 2' with receipts)"
    )


def test_a_run_that_took_no_entrant_s_nonce_has_no_receipts_to_check(run_and_receipts, tmp_path):
    run, kept = run_and_receipts
    path = tmp_path / "receipts.json"
    path.write_text(json.dumps(kept))
    unseeded = dataclasses.replace(run, seeded=None)
    assert refusal(unseeded, path) == (
        f"{run.path}:2: the run took no entrant's nonce: it has no entrant to receipt it"
    )


def test_receipts_of_another_run_name_the_field_and_the_ledger_s_opening(run_and_receipts, tmp_path):
    run, kept = run_and_receipts
    path = tmp_path / "receipts.json"
    path.write_text(json.dumps(resigned(kept, run_id="another-run")))
    assert refusal(run, path) == (
        f"{path}: its run_id another-run is not the ledger's {run.opened.run_id} ({run.path}:1): "
        "the ledger is not the run the entrant played"
    )


def test_receipts_the_entrant_did_not_sign_are_refused(run_and_receipts, tmp_path):
    run, kept = run_and_receipts
    path = tmp_path / "receipts.json"
    path.write_text(json.dumps({**kept, "receipts": kept["receipts"][:-1]}))  # not signed again
    assert refusal(run, path) == (
        f"{path}: not signed by the entrant's key (the one the run's nonce line names): receipts the "
        "entrant did not keep, or changed after it signed them"
    )


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda r: [5, *r[1:]], "receipt 1 is not a receipt (line, line_sha256, digest, signature)"),
        (
            lambda r: [{k: v for k, v in r[0].items() if k != "digest"}, *r[1:]],
            "receipt 1 is not a receipt (line, line_sha256, digest, signature)",
        ),
        (lambda r: [{**r[0], "line": "1"}, *r[1:]], "receipt 1 names line '1'"),
        (lambda r: [{**r[0], "line": True}, *r[1:]], "receipt 1 names line True"),
        (lambda r: [{**r[0], "line": 0}, *r[1:]], "receipt 1 names line 0"),
    ],
    ids=["not an object", "a field missing", "a line in text", "a line that is a bool", "line 0"],
)
def test_a_receipt_that_is_not_one_is_named_by_its_place(run_and_receipts, tmp_path, damage, message):
    run, kept = run_and_receipts
    path = tmp_path / "receipts.json"
    path.write_text(json.dumps(resigned(kept, receipts=damage(kept["receipts"]))))
    assert refusal(run, path) == f"{path}: {message}"


def test_receipts_out_of_order_name_both_lines(run_and_receipts, tmp_path):
    run, kept = run_and_receipts
    path = tmp_path / "receipts.json"
    first, second = kept["receipts"][:2]
    path.write_text(json.dumps(resigned(kept, receipts=[second, first, *kept["receipts"][2:]])))
    assert refusal(run, path) == (
        f"{path}: receipt 2 names line {first['line']}, not after receipt 1's line {second['line']}: an entrant "
        "keeps each head once, in the order it was served"
    )


def test_a_receipt_the_run_s_key_did_not_sign_is_refused(run_and_receipts, tmp_path):
    run, kept = run_and_receipts
    path = tmp_path / "receipts.json"
    first = kept["receipts"][0]
    forged = {**first, "signature": kept["receipts"][1]["signature"]}  # a signature of another head
    path.write_text(json.dumps(resigned(kept, receipts=[forged, *kept["receipts"][1:]])))
    assert refusal(run, path) == (
        f"{path}: receipt 1 (line {first['line']}) is not signed by the run's key: not a receipt the server gave"
    )


def test_a_ledger_cut_short_or_changed_after_a_receipt_is_refused_at_its_line(run_and_receipts, tmp_path):
    run, kept = run_and_receipts
    path = tmp_path / "receipts.json"
    path.write_text(json.dumps(kept))
    last = kept["receipts"][-1]["line"]
    short = dataclasses.replace(run, heads=run.heads[:-1])
    assert refusal(short, path) == (
        f"{run.path}:{last - 1}: the ledger ends before line {last}, which the server signed for the entrant "
        f"(receipt {len(kept['receipts'])} of {path}): lines were removed after the fact"
    )
    first = kept["receipts"][0]["line"]
    heads = list(run.heads)
    heads[first - 1] = ("0" * 64, *heads[first - 1][1:])
    changed = dataclasses.replace(run, heads=heads)
    assert refusal(changed, path) == (
        f"{run.path}:{first}: not the line the server signed for the entrant while the run was played "
        f"(receipt 1 of {path}): the ledger was changed after the fact"
    )


def test_receipts_that_stop_before_the_run_s_end_are_refused(run_and_receipts, tmp_path):
    run, kept = run_and_receipts
    path = tmp_path / "receipts.json"
    path.write_text(json.dumps(resigned(kept, receipts=kept["receipts"][:-1])))
    end, before = len(run.heads), kept["receipts"][-2]["line"]
    assert refusal(run, path) == (
        f"{run.path}:{end}: the entrant's receipts end at line {before}, not at the run's end (line {end}): the "
        f"lines after it were written where the entrant could not see them ({path})"
    )
    path.write_text(json.dumps(kept))
    unended = dataclasses.replace(run, ended=None)
    assert refusal(unended, path) == (
        f"{run.path}:{end}: the entrant's receipts end at line {end}, not at the run's end (line {end}, which is "
        f"no end): the lines after it were written where the entrant could not see them ({path})"
    )


@pytest.mark.parametrize("text", ["[]", '{"document": 5}', '{"document": {"format": "another"}}', "{}"])
def test_a_reveal_that_is_not_one_is_refused_whole(tmp_path, text):
    """The run's reveal, read before anything is checked against it: a file that is not a scored
    run's reveal is named with the format it lacks; a missing one with what to give."""
    from cernenv.server.audit import COMMITMENT_FORMAT, load_reveal

    path = tmp_path / "run.reveal.json"
    with pytest.raises(AuditError) as refused:
        load_reveal(path)
    assert str(refused.value) == f"{path}: no such file: give the run's reveal (RUN_ID.reveal.json)"
    path.write_text(text)
    with pytest.raises(AuditError) as refused:
        load_reveal(path)
    assert str(refused.value) == f"{path}: not a scored run's reveal (no document of format {COMMITMENT_FORMAT!r})"


def test_a_reveal_that_does_not_match_its_run_is_refused_whole(run_and_receipts, tmp_path):
    """`check_reveal`: the reveal's own hash field, the run's opening against the committed document
    (every field that differs named), the run's end and last line, the entrant's nonce and the
    worlds' secret it gives; each refusal whole."""
    from cernenv.server.audit import check_reveal
    from cernenv.server.runs import reveal_path

    run, _ = run_and_receipts
    reveal_file = reveal_path(run.path)
    reveal = json.loads(reveal_file.read_text())
    committed = reveal["commitment"]

    def refused(run_given, reveal_given) -> str:
        with pytest.raises(AuditError) as error:
            check_reveal(run_given, reveal_given, reveal_file)
        return str(error.value)

    assert check_reveal(run, reveal, reveal_file)["world_secret"]
    assert refused(run, {**reveal, "commitment": "edited"}) == (
        f"{reveal_file}: its commitment field ('edited') is not its document's hash ({committed}): the reveal was "
        "edited; give the one the server wrote at the run's end"
    )
    opened = run.opened.model_copy(update={"selection": "v3", "secret_fingerprint": "f" * 16, "n_tasks": 3})
    assert refused(dataclasses.replace(run, opened=opened), reveal) == (
        f"{run.path}:1: the run's opening and the committed document differ in selection, operator_secret (its "
        "fingerprint), order (not an order of the run's tasks)"
    )
    assert refused(dataclasses.replace(run, ended=None), reveal) == (
        f"{run.path}:{len(run.heads)}: incomplete: the ledger has no end (RunEnded) after its last line: its tail "
        "was cut off, or the server had not ended the run; a run is verified whole or not at all"
    )
    assert refused(run, {**reveal, "last_line_sha256": "0" * 64}) == (
        f"{run.path}: its last line is not the one the server wrote last (the reveal names {'0' * 64}): lines were "
        "removed from its end, or written after it"
    )
    assert refused(run, {**reveal, "entrant_nonce": "another"}) == (
        f"{reveal_file}: its entrant_nonce is not the one the ledger's RunSeeded line took ({run.path}:2)"
    )
    seeded = run.seeded.model_copy(update={"secret_fingerprint": "e" * 16})
    assert refused(dataclasses.replace(run, seeded=seeded), reveal) == (
        f"{run.path}:2: the worlds' secret the committed secret and the entrant's nonce give is not the one it "
        f"names ({'e' * 16})"
    )


def test_receipts_that_name_another_agent_are_refused_at_the_run_s_nonce_line(run_and_receipts, tmp_path):
    run, kept = run_and_receipts
    path = tmp_path / "receipts.json"
    path.write_text(json.dumps(resigned(kept, agent="examples.template_agent:TemplateAgent")))
    assert refusal(run, path) == (
        f"{run.path}:2: the run's agent {run.seeded.agent!r} is not the one the entrant sent "
        f"('examples.template_agent:TemplateAgent', {path})"
    )


def test_a_receipt_of_the_opening_line_counts_and_a_line_twice_does_not(run_and_receipts, tmp_path):
    """The server signs every line, the opening (line 1) too: an entrant that kept its head holds a
    valid receipt of line 1. A head kept twice is refused as out of order."""
    run, kept = run_and_receipts
    path = tmp_path / "receipts.json"
    sha, digest, signature = run.heads[0]
    opening = {"line": 1, "line_sha256": sha, "digest": digest, "signature": signature}
    path.write_text(json.dumps(resigned(kept, receipts=[opening, *kept["receipts"]])))
    assert check_receipts(run, path) == len(kept["receipts"]) + 1
    first = kept["receipts"][0]
    path.write_text(json.dumps(resigned(kept, receipts=[first, first, *kept["receipts"][1:]])))
    assert refusal(run, path) == (
        f"{path}: receipt 2 names line {first['line']}, not after receipt 1's line {first['line']}: an entrant "
        "keeps each head once, in the order it was served"
    )


def test_a_folder_given_for_the_receipts_is_refused_with_what_to_give(run_and_receipts, tmp_path):
    run, _ = run_and_receipts
    assert refusal(run, tmp_path) == f"{tmp_path}: not a regular file: give the entrant's receipts (receipts.json)"


def test_verify_run_names_the_reveal_file_it_was_given(run_and_receipts, tmp_path):
    from cernenv.server.audit import verify_run
    from cernenv.server.runs import reveal_path

    run, _ = run_and_receipts
    reveal = json.loads(reveal_path(run.path).read_text())
    edited = tmp_path / "edited.reveal.json"
    edited.write_text(json.dumps({**reveal, "commitment": "edited"}))
    with pytest.raises(AuditError) as refused:
        verify_run(run, edited)
    assert str(refused.value).startswith(f"{edited}: its commitment field ('edited') is not its document's hash")
