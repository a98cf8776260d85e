"""lib.files: a killed writer loses nothing and, once swept, leaves nothing; a full disk keeps the
old file and says so; JSON is strict; an empty result never replaces evidence; a folder is
checked before the work that fills it."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lib.episodes.records import load_episodes_jsonl, save_episodes_jsonl
from lib.files import (
    FILE_MODE,
    LOCK_NAME,
    DiskFullError,
    EmptyResultError,
    FolderLock,
    FolderLockedError,
    atomic_write,
    check_writable_dir,
    is_disk_full,
    sweep_stale_temporaries,
    write_json,
)
from lib.measure.evaluation import write_baseline_evidence
from lib.measure.metrics import estimates_from_json

ROOT = Path(__file__).resolve().parents[1]


def _killed_mid_write(target: Path) -> None:
    """A writer process SIGKILLed while its temporary file is open and half written."""
    code = (
        "import sys, time; from lib.files import atomic_write\n"
        "def write(tmp):\n"
        "    open(tmp, 'w').write('half a fi'); print('writing', flush=True); time.sleep(60)\n"
        f"atomic_write({str(target)!r}, write)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=str(ROOT), env=dict(os.environ)
    )
    assert child.stdout.readline().strip() == "writing"
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)


def _episode(seed):
    """The smallest record an episode file holds."""
    return {
        "seed": seed,
        "scenario": None,
        "difficulty": "easy",
        "total_reward": 0.0,
        "cumulative_reward": 0.0,
        "steps": [],
    }


def test_a_killed_writer_loses_nothing_and_its_temporary_file_is_swept(tmp_path):
    target = tmp_path / "episodes.jsonl"
    save_episodes_jsonl([_episode(1)], str(target))
    _killed_mid_write(target)
    leftovers = [p for p in tmp_path.iterdir() if p.name != target.name]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".episodes.jsonl.")
    assert load_episodes_jsonl(str(target)) == [_episode(1)]  # the old content, whole
    save_episodes_jsonl([_episode(2)], str(target))
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
    assert load_episodes_jsonl(str(target)) == [_episode(2)]


def test_a_live_writers_temporary_file_is_left_alone(tmp_path):
    target = tmp_path / "log.csv"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".log.csv.{sleeper.pid}.abc123.tmp"
        live.write_text("in progress")
        assert sweep_stale_temporaries(target) == 0 and live.exists()
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)
    assert sweep_stale_temporaries(target) == 1 and not live.exists()


def test_written_files_get_the_umasks_mode(tmp_path):
    path = atomic_write(tmp_path / "a.txt", "text")
    assert stat.S_IMODE(path.stat().st_mode) == FILE_MODE
    assert FILE_MODE == 0o666 & ~_current_umask()


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _no_nan_tokens(text: str):
    """json.loads that refuses NaN / Infinity, as strict JSON readers (JavaScript, jq) do."""

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_write_json_is_strict_json_and_readers_take_null_and_nan(tmp_path):
    payload = {"a": math.nan, "b": [1.5, math.inf, -math.inf], "c": {"d": np.float64("nan"), "e": np.int64(3)}}
    path = write_json(tmp_path / "x.json", payload)
    assert _no_nan_tokens(path.read_text()) == {"a": None, "b": [1.5, None, None], "c": {"d": None, "e": 3}}
    estimate = {"mean": None, "low": None, "high": None, "n": 0}
    old_style = {"mean": math.nan, "low": math.nan, "high": math.nan, "n": 0}
    for entry in (estimate, old_style):
        (parsed,) = estimates_from_json({"agent": {"mean_reward": entry}}).values()
        assert math.isnan(parsed["mean_reward"].mean) and parsed["mean_reward"].n == 0


def test_the_committed_baselines_are_strict_json():
    payload = _no_nan_tokens((ROOT / "evidence" / "baselines.json").read_text())
    assert payload["metrics"], "baselines.json holds metrics"


def test_a_full_disk_keeps_the_old_file_whole_and_says_the_disk_is_full(tmp_path, monkeypatch):
    target = tmp_path / "baselines.json"
    old = json.dumps({"old": list(range(5000))})
    target.write_text(old)

    def full_disk(tmp):  # 8,000 bytes out, then the disk is full
        with open(tmp, "w") as handle:
            handle.write("x" * 8000)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFullError, match=r"the disk is full: writing .*baselines.json failed .* MB free"):
        atomic_write(target, full_disk)
    assert target.read_text() == old and [p.name for p in tmp_path.iterdir()] == [target.name]
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(DiskFullError):
        write_json(target, {"new": 1})
    assert target.read_text() == old


def test_disk_full_is_recognised_in_an_error_chain_and_by_the_space_left(tmp_path, monkeypatch):
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("enforce fail at inline_container.cc:672] . unexpected pos 64") from inner
    except RuntimeError as error:
        assert is_disk_full(error)
    torch_style = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3200 vs 3096")
    assert not is_disk_full(torch_style, tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 4096))
    assert is_disk_full(torch_style, tmp_path / "not" / "made" / "yet")


@pytest.mark.parametrize("episodes", [{}, {"random": [], "heuristic": []}])
def test_baselines_of_no_episodes_never_replace_the_existing_ones(tmp_path, episodes):
    for name in ("baselines.json", "baselines.md"):
        (tmp_path / name).write_text(f"the committed {name}\n")
    with pytest.raises(EmptyResultError, match=r"refusing to write baselines of 0 episodes: .* left as it was"):
        write_baseline_evidence(episodes, tmp_path)
    assert [(tmp_path / n).read_text() for n in ("baselines.json", "baselines.md")] == [
        "the committed baselines.json\n",
        "the committed baselines.md\n",
    ]
    with pytest.raises(EmptyResultError):
        save_episodes_jsonl([], str(tmp_path / "baselines.json"))


def test_an_output_folder_that_is_a_file_or_not_writable_is_named_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "evidence").write_text("a file")
    with pytest.raises(NotADirectoryError, match=r"evidence is a file, not a folder"):
        check_writable_dir(tmp_path / "evidence" / "run", "evidence folder")
    assert check_writable_dir(tmp_path / "new" / "folder") == tmp_path / "new" / "folder"

    def read_only(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(PermissionError, match=r"the output folder .* is not writable \(Permission denied\)"):
        check_writable_dir(tmp_path / "new")


def _holder(folder: Path) -> subprocess.Popen:
    """Another process that takes the lock of `folder` and keeps it."""
    code = (
        "import sys, time; from lib.files import FolderLock\n"
        f"FolderLock({str(folder)!r}, 'evidence folder').acquire(); print('held', flush=True); time.sleep(120)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_folder_a_live_run_holds_is_refused_naming_it_and_a_dead_runs_lock_is_taken_over(tmp_path):
    folder = tmp_path / "evidence"
    child = _holder(folder)
    try:
        with pytest.raises(FolderLockedError) as refused:
            FolderLock(folder, "evidence folder").acquire()
        message = str(refused.value)
        assert (
            f"the evidence folder {folder} is in use by a live run: pid {child.pid} on {socket.gethostname()}"
            in message
        )
        assert re.search(r"started \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", message) and "delete" in message
    finally:
        child.send_signal(signal.SIGKILL)  # dies holding it: no cleanup runs
        child.wait(timeout=30)
    assert (folder / LOCK_NAME).exists(), "a killed run leaves its lock file"
    with FolderLock(folder) as lock:
        assert lock.taken_over is not None and lock.taken_over.pid == child.pid
        assert lock.owner().pid == os.getpid()
        with pytest.raises(FolderLockedError, match=f"pid {os.getpid()}"):
            FolderLock(folder).acquire()  # a second run in the same process too
    assert not (folder / LOCK_NAME).exists(), "released: the lock file is gone"
    with FolderLock(folder) as lock:
        assert lock.taken_over is None


def _race_without_flock(folder: str, start_at: float, results: Any) -> None:
    """One racer for the lock of `folder` where flock fails (as on some network file systems):
    wait for the common start, try, and report (pid, won, when it held it on the monotonic clock)."""
    import fcntl as fcntl_module

    def no_flock(*args: Any) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    fcntl_module.flock = no_flock
    while time.monotonic() < start_at:
        pass
    try:
        FolderLock(folder).acquire()
    except FolderLockedError:
        results.put((os.getpid(), False, 0.0, 0.0))
        return
    held_from = time.monotonic()
    time.sleep(0.5)
    results.put((os.getpid(), True, held_from, time.monotonic()))
    results.close()
    results.join_thread()  # the report is sent before the process goes
    os._exit(0)  # dies holding it, as a killed run does: no release


def test_without_flock_one_of_eight_racers_holds_the_lock_and_a_dead_owners_lock_goes_to_one(tmp_path):
    """Eight processes race for a folder on a file system without flock: one holds it, and never two
    at once. They race again for the lock it left when it died: one takes it over. (On a loaded
    machine a racer scheduled late can find the first holder already dead and take its lock over in
    turn, which is the takeover working; two holders whose times overlap would be the failure.) The
    start and the holding times are read from the monotonic clock, which on Linux is one clock for
    every process: the wall clock could be stepped (NTP) between two racers' readings and make two
    holders look as if they overlapped, or hide an overlap."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    for round_ in range(2):
        results = context.Queue()
        start_at = time.monotonic() + 0.5
        racers = [
            context.Process(target=_race_without_flock, args=(str(tmp_path), start_at, results)) for _ in range(8)
        ]
        for racer in racers:
            racer.start()
        outcomes = [results.get(timeout=60) for _ in racers]
        for racer in racers:
            racer.join(timeout=60)
        winners = sorted((outcome for outcome in outcomes if outcome[1]), key=lambda outcome: outcome[2])
        assert winners, (round_, outcomes)
        for before, after in zip(winners, winners[1:]):
            assert after[2] >= before[3], ("two holders at once", round_, winners)
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == winners[-1][0]


def test_a_lock_file_planted_as_a_link_is_never_followed(tmp_path):
    target = tmp_path / "somebody-elses-file"
    target.write_text("keep me\n")
    (tmp_path / LOCK_NAME).symlink_to(target)
    with pytest.raises(FolderLockedError, match="symbolic link"):
        FolderLock(tmp_path).acquire()
    assert target.read_text() == "keep me\n"


def test_a_shared_folder_is_readable_by_every_user(tmp_path):
    """What the project moves into place whole (a converted model, a warm start, an adapter) keeps
    neither mkdtemp's 0700 nor a writer's 0600 file: `make evaluate`'s agent, another user, reads it."""
    import stat

    from lib.files import share_folder, staging_folder

    staging = staging_folder(tmp_path / "model")
    (staging / "weights").mkdir()
    secret = staging / "weights" / "model.safetensors"
    secret.write_bytes(b"w")
    secret.chmod(0o600)
    assert stat.S_IMODE(staging.stat().st_mode) == 0o700  # mkdtemp's
    old = os.umask(0o022)
    try:
        share_folder(staging)
    finally:
        os.umask(old)
    assert stat.S_IMODE(staging.stat().st_mode) == 0o755
    assert stat.S_IMODE((staging / "weights").stat().st_mode) == 0o755
    assert stat.S_IMODE(secret.stat().st_mode) == 0o644
