"""Episode files are typed: a damaged line is an error that names it, never a silent number."""

from __future__ import annotations

import gzip
import json

import pytest

from lib.episodes.records import load_episodes_jsonl, save_episodes_jsonl
from lib.measure.comparison import before_after_metrics

EVIDENCE = "evidence/pre_eval.jsonl.gz"


def lines(n=5):
    with gzip.open(EVIDENCE, "rt") as handle:
        return [json.loads(next(handle)) for _ in range(n)]


def write(path, episodes):
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return str(path)


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda e: e.update(correct_outcome=str(e["correct_outcome"])),
            "correct_outcome: Input should be a valid boolean",
        ),
        (lambda e: e.update(cumulative_reward=float("nan")), "cumulative_reward: Input should be a finite number"),
        (lambda e: e.clear(), "seed: Field required"),
        (lambda e: e["steps"][0].update(parsed_ok="True"), "steps.0.parsed_ok"),
        (lambda e: e.update(surprise=1), "surprise: Extra inputs are not permitted"),
    ],
)
def test_a_damaged_line_is_an_error_naming_the_file_line_and_field(tmp_path, damage, message):
    episodes = lines()
    damage(episodes[2])
    path = write(tmp_path / "pre_eval.jsonl", episodes)
    with pytest.raises(ValueError, match=r"pre_eval.jsonl:3 is not an episode record") as error:
        load_episodes_jsonl(path)
    assert message in str(error.value)
    with pytest.raises(ValueError, match="episode 3 of 5"):
        save_episodes_jsonl(episodes, str(tmp_path / "again.jsonl"))
    assert not (tmp_path / "again.jsonl").exists()


def test_a_file_appended_to_itself_is_refused_rather_than_counted_twice(tmp_path):
    episodes = lines()
    path = write(tmp_path / "post_eval.jsonl", episodes + episodes)
    with pytest.raises(ValueError, match=r"post_eval.jsonl:6 repeats the episode of line 1"):
        load_episodes_jsonl(path)
    assert before_after_metrics(episodes, episodes)["n"]["pairs"] == 5  # the whole file, read once


def test_the_file_schema_names_the_record_s_fields():
    """`EpisodeLine` and `StepLine` are the schema of `EpisodeRecord.to_dict()`: the same fields."""
    from dataclasses import fields

    from lib.episodes.records import EpisodeLine, EpisodeRecord, StepLine, StepRecord

    assert set(EpisodeLine.model_fields) == {f.name for f in fields(EpisodeRecord)}
    assert set(StepLine.model_fields) == {f.name for f in fields(StepRecord)}


@pytest.mark.parametrize("where", [2, 5], ids=["a middle line", "the last line"])
def test_a_line_nested_too_deep_for_python_s_parser_is_refused_in_one_line_wherever_it_is(tmp_path, where):
    """A line nested 100,000 deep raised RecursionError from json.loads; as the last line it must not
    pass for one a writer left unfinished (it is whole: nothing was cut)."""
    text = "".join(json.dumps(e) + "\n" for e in lines())
    rows = text.splitlines()
    rows[where - 1] = '{"seed": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path = tmp_path / "pre_eval.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError) as refused:
        load_episodes_jsonl(str(path))
    message = str(refused.value)
    assert f"pre_eval.jsonl:{where} is not an episode (column " in message and "nested too deep" in message
    assert "\n" not in message
