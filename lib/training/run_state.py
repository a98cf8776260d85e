"""A training run's state, kept in its output folder (`run_state.json`, `RunState`): running (its
pid, host and phase), finished, failed (with the error), or stopped (SIGTERM, SIGHUP or Ctrl-C,
with the phase and the step it was in). A run killed outright (SIGKILL, the machine going down)
leaves "running" with a pid that is gone. The next run in that folder and `make report` name a
run that did not finish (`unfinished_run`), with the checkpoint it can resume from.

    with RunState(output_dir) as state:   # in `lib.training.run.train`
        state.phase("warm start")
        ...
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

from lib.files import process_alive, read_json, write_json

logger = logging.getLogger(__name__)

RUN_STATE = "run_state.json"
"""In a run's output folder: what that run is doing, or how it ended."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
"""The signals a batch system or a closed terminal stops a run with; each is recorded, then does what it did."""


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class RunState:
    """The state of the run writing to `output_dir`, kept in `output_dir/run_state.json` from its
    first `phase` (when it starts to write; a run refused before that leaves nothing, and the last
    run's state stays): "running", then "finished", "failed" (an exception) or "stopped" (a stop
    signal or Ctrl-C, whenever it comes). While it runs, SIGTERM and SIGHUP (in the main thread)
    first record where the run stopped and then do what they did before (end the process). `step`
    (set by the caller) says the optimisation step a stop came in."""

    def __init__(self, output_dir: Union[str, Path]) -> None:
        self.path = Path(output_dir) / RUN_STATE
        self.record: Dict[str, Any] = {}
        self.step: Optional[Callable[[], str]] = None
        self.started = False
        self._previous: Dict[int, Any] = {}

    def _write(self, **changes: Any) -> None:
        self.record.update(changes, updated=_now())
        write_json(self.path, self.record)

    def phase(self, text: str) -> None:
        """The run now does `text` ("warm start", "GRPO", ...); the first call writes the state."""
        self.step, self.started = None, True
        self._write(phase=text)

    def _where(self) -> str:
        where = str(self.record.get("phase", "?"))
        return f"{where}, {self.step()}" if self.step is not None else where

    def stopped(self, how: str) -> None:
        """Record that the run was stopped by `how` (a signal's name, "Ctrl-C")."""
        self._write(state="stopped", by=how, at=_now(), phase=self._where())

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stopped(signal.Signals(signum).name)
        previous = self._previous.get(signum, signal.SIG_DFL)
        self._restore()
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)  # the default action: the process ends by this signal, as before

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def __enter__(self) -> "RunState":
        self.record = {"state": "running", "pid": os.getpid(), "host": socket.gethostname(), "started": _now()}
        self.record["phase"] = "starting"
        try:
            for signum in STOP_SIGNALS:
                previous = signal.getsignal(signum)
                if previous is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._on_signal)
        except ValueError:  # not the main thread: signals are not ours to handle
            self._restore()
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        self._restore()
        if kind is None:
            self._write(state="finished", at=_now())
        elif issubclass(kind, KeyboardInterrupt):
            self.stopped("Ctrl-C")
        elif self.started:  # refused before it wrote anything: the refusal says it all
            self._write(state="failed", at=_now(), phase=self._where(), error=f"{kind.__name__}: {str(error)[:300]}")


def _alive(pid: Any) -> bool:
    return isinstance(pid, int) and pid > 0 and process_alive(pid)


def unfinished_run(output_dir: Union[str, Path]) -> Optional[str]:
    """One line saying how the last run in `output_dir` ended where it did not finish (stopped,
    failed, or killed: "running" under a pid that is gone), and which checkpoint it can resume
    from; None where it finished, is still running, or left no state."""
    from lib.training.resume import latest_complete_checkpoint

    path = Path(output_dir) / RUN_STATE
    try:
        record = read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        return f"{path} cannot be read ({error})"
    if not isinstance(record, dict):
        return f"{path} is not a run's state"
    state, phase, started = record.get("state"), record.get("phase", "?"), record.get("started", "?")
    if state == "stopped":
        what = f"was stopped by {record.get('by', '?')} on {record.get('at', '?')}, in {phase}"
    elif state == "failed":
        what = f"failed on {record.get('at', '?')}, in {phase}: {record.get('error', '?')}"
    elif state == "running" and record.get("host") == socket.gethostname() and not _alive(record.get("pid")):
        what = f"ended without a word (killed, or the machine went down) after {record.get('updated', '?')}, in {phase}"
    else:
        return None
    checkpoint = latest_complete_checkpoint(Path(output_dir)) if Path(output_dir).is_dir() else None
    resume = (
        f"resume it from {checkpoint.name} (--resume_from_checkpoint latest)"
        if checkpoint is not None
        else "it saved no checkpoint: run it again"
    )
    return f"the training run in {output_dir} (started {started}) {what}; {resume}"
