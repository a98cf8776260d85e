"""Every record the evidence is read from is typed: baselines.json (`BaselinesFile`) and the CSV
logs (numbers or nothing) are checked when written and when read, and a damaged one is an error
that names the file and the place, never a silent number. (Episode files: test_episode_files.py;
the results ledger: test_scored_runs.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lib.measure.evaluation import read_baselines
from lib.report.evidence_logs import TrainingLogWriter, read_records

EVIDENCE = Path(__file__).resolve().parents[1] / "evidence"


@pytest.mark.parametrize(
    "damage, where",
    [
        (
            lambda d: d["metrics"]["heuristic"]["success_rate"].update(mean="0.86"),
            "metrics.heuristic.success_rate.mean",
        ),
        (lambda d: d["metrics"]["heuristic"]["success_rate"].update(n=True), "metrics.heuristic.success_rate.n"),
        (lambda d: d["groups"]["null"]["n_episodes"].update(heuristic=79.5), "groups.null.n_episodes.heuristic"),
        (lambda d: d.update(surprise=1), "surprise"),
    ],
)
def test_a_damaged_baselines_file_is_an_error_naming_the_field(tmp_path, damage, where):
    payload = json.loads((EVIDENCE / "baselines.json").read_text())
    assert read_baselines(EVIDENCE / "baselines.json")["metrics"]["heuristic"]["success_rate"]["n"] == 313
    damage(payload)
    path = tmp_path / "baselines.json"
    path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=rf"baselines.json: {where}:"):
        read_baselines(path)


def test_a_nan_in_baselines_is_refused(tmp_path):
    baselines = json.loads((EVIDENCE / "baselines.json").read_text())
    baselines["metrics"]["heuristic"]["success_rate"]["mean"] = float("nan")
    (tmp_path / "baselines.json").write_text(json.dumps(baselines))  # NaN, as Python's json writes it
    assert "NaN" in (tmp_path / "baselines.json").read_text()
    with pytest.raises(ValueError, match="baselines.json: metrics.heuristic.success_rate.mean"):
        read_baselines(tmp_path / "baselines.json")


def test_a_log_cell_that_is_not_a_number_is_refused_on_write_and_on_read(tmp_path):
    log = TrainingLogWriter(tmp_path / "training_log.csv")
    log.append({"step": 1, "reward": 0.5, "kl": float("nan")})  # NaN is written empty, as before
    with pytest.raises(TypeError, match="number or nothing"):
        log.append({"step": 2, "reward": "0.5"})
    assert read_records(tmp_path / "training_log.csv").rows[0]["kl"] is None
    shutil.copy(EVIDENCE / "training_log.csv", tmp_path / "damaged.csv")
    lines = (tmp_path / "damaged.csv").read_text().splitlines()
    lines[3] = lines[3].replace(lines[3].split(",")[3], "True", 1)
    (tmp_path / "damaged.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"damaged.csv:4: column reward: 'True' is not a finite number"):
        read_records(tmp_path / "damaged.csv")


AFTER_THE_LOG = object()
"""The line number of the first line after the committed log's own (a damage that appends to it)."""


def _log_lines() -> list:
    return (EVIDENCE / "training_log.csv").read_text().splitlines()


@pytest.mark.parametrize(
    "damage, line, problem",
    [
        (lambda rows: rows[1:], 1, "has no header: its first line is a row of numbers"),
        (
            lambda rows: ["\ufeff" + rows[0], *rows[1:]],
            1,
            "starts with a byte-order mark and ends its lines CRLF: a spreadsheet program (Excel) saved it",
        ),
        (
            lambda rows: [row.replace(",", ";") for row in rows],
            1,
            "separates its fields with ';', not ','",
        ),
        (lambda rows: [*rows, *rows[1:]], AFTER_THE_LOG, "step 1 again (first on line 2)"),
        (lambda rows: ["a,b,c", *rows[1:]], 1, "starts with 'a,b,c', not a training_log.csv's header"),
    ],
    ids=["no header", "Excel: BOM and CRLF", "semicolons", "every step twice", "another header"],
)
def test_a_damaged_training_log_is_refused_in_one_line_naming_the_file_line_and_what_is_wrong(
    tmp_path, damage, line, problem
):
    """Each was read as rows without columns (then `KeyError: 'step'`) or, every step twice, as a
    trend of twice the steps."""
    log = _log_lines()
    assert len(read_records(EVIDENCE / "training_log.csv").rows) == len(log) - 1 > 1, "the committed log reads whole"
    rows = damage(log)
    line = len(log) + 1 if line is AFTER_THE_LOG else line
    path = tmp_path / "training_log.csv"
    ending = "\r\n" if "CRLF" in problem else "\n"
    path.write_bytes((ending.join(rows) + ending).encode("utf-8"))
    with pytest.raises(ValueError) as refused:
        read_records(path)
    message = str(refused.value)
    assert message.startswith(f"{path}:{line}: {problem}"), message
    assert "\n" not in message and "rerun what writes it" in message


def test_a_damaged_json_file_of_a_run_is_refused_naming_the_file_and_line(tmp_path):
    from lib.report.evidence_logs import read_evidence
    from lib.training.config import TrainConfig

    (tmp_path / "before_after_metrics.json").write_text('{"pre": {\n  "n": 3,\n  "mean": }\n}\n')
    with pytest.raises(ValueError, match=r"before_after_metrics.json:3:11: not JSON \(Expecting value\)"):
        read_evidence(tmp_path)
    (tmp_path / "train_config.json").write_text('{"max_steps":\n' + "[" * 50_000 + "]" * 50_000 + "}\n")
    with pytest.raises(ValueError, match=r"train_config.json:2:\d+: JSON nested too deep for Python's parser"):
        TrainConfig.load(tmp_path / "train_config.json")
