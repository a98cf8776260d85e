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
    text = (EVIDENCE / "baselines.json").read_text().replace('"mean": 0.8594249201277955', '"mean": NaN', 1)
    (tmp_path / "baselines.json").write_text(text)
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
    with pytest.raises(ValueError, match=r"damaged.csv: data row 3, column reward: 'True' is not a finite number"):
        read_records(tmp_path / "damaged.csv")
