"""lib.files.atomic_write: a killed writer loses nothing and, once swept, leaves nothing."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

from lib.files import FILE_MODE, atomic_write, sweep_stale_temporaries
from lib.records import load_episodes_jsonl, save_episodes_jsonl

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


def test_a_killed_writer_loses_nothing_and_its_temporary_file_is_swept(tmp_path):
    target = tmp_path / "episodes.jsonl"
    save_episodes_jsonl([{"seed": 1}], str(target))
    _killed_mid_write(target)
    leftovers = [p for p in tmp_path.iterdir() if p.name != target.name]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".episodes.jsonl.")
    assert load_episodes_jsonl(str(target)) == [{"seed": 1}]  # the old content, whole
    save_episodes_jsonl([{"seed": 2}], str(target))
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
    assert load_episodes_jsonl(str(target)) == [{"seed": 2}]


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
