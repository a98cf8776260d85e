"""Progress of long work (the warm start, the evaluations, the GRPO steps, the baselines): how far,
how fast, how long is left. One mechanism for the whole project, tqdm's:

- watched (a terminal, or a notebook a person has open: Jupyter, Colab): a tqdm bar redrawn in
  place (`tqdm.auto`: a widget in a notebook), with the rate and the time left;
- headless (the notebooks run by `make reproduce`, which sets `CERNENV_HEADLESS=1` for their
  kernels; output to a file or a CI log): the same meter, formatted by tqdm, written as a log
  line at most every `every_s` seconds and at the end: a bar redrawn ten times a second would
  be thousands of lines there, and a widget nobody sees would be saved into the notebook.

    progress = Progress("SFT warm start", total=2400, unit="step")
    progress.update(done)            # the position, not an increment
    progress.write("step 10: loss 1.23")   # a line above the bar (a log line when headless)
    progress.note("step 11: loss 1.21")    # the same, at most one every every_s when headless
    progress.close()

`lib.training.callbacks.TrainingProgress` drives one for a transformers `Trainer` (SFT, GRPO).
This module imports no transformers (`lib.episodes.llm_rollouts` uses it, and Unsloth must be imported
before transformers).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
import weakref
from typing import Any, Optional

from tqdm import tqdm as text_tqdm

logger = logging.getLogger("lib.progress")

HEADLESS_VARIABLE = "CERNENV_HEADLESS"
"""Set (to anything but "" or "0") where nobody watches the output: progress is logged, not drawn."""
METER = "{desc}: {n_fmt}/{total_fmt} {unit}s ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
"""The meter of a headless progress line (tqdm's `bar_format` fields)."""
METER_LINE = re.compile(r": \d+/\d+ \w+ \(\d+%\) \[")
"""What marks a line as a `METER` line ("SFT warm start: 47/190 steps (25%) [..."), wherever it is
printed (`lib.notebooks.reproduce` picks the notebooks' out of their output)."""


def headless() -> bool:
    """True where nobody watches the output as it is drawn: `CERNENV_HEADLESS` set, or neither a
    notebook kernel nor a terminal on stderr."""
    flag = os.environ.get(HEADLESS_VARIABLE, "")
    if flag not in ("", "0"):
        return True
    if in_notebook():
        return False
    return not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())


def in_notebook() -> bool:
    """True inside a Jupyter kernel (JupyterLab, Notebook, Colab, VS Code)."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


HEARTBEAT_S = 10.0
"""Longest silence [s] while work is under way: a headless progress with nothing logged for this long
logs its meter again, marked still working (a GRPO step of a real model takes minutes); a drawn bar
is redrawn, so its elapsed time moves."""


class Progress:
    """`done` of `total` units of work, shown as a tqdm bar when watched and logged as tqdm's meter
    at most every `every_s` seconds (and at the end) when headless (see the module docstring); while
    a unit is under way, never silent for more than `heartbeat_s` (`HEARTBEAT_S`; 0: no heartbeat)."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "item",
        every_s: float = 30.0,
        initial: int = 0,
        log: Optional[logging.Logger] = None,
        draw: Optional[bool] = None,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.label, self.total, self.unit, self.every_s = label, max(int(total), 0), unit, every_s
        self.log = log or logger
        self.done = int(initial)
        self.started = time.perf_counter()
        self._last_logged = self.started
        self._last_noted = self.started - every_s  # the first note is written at once
        self._pending_note: Optional[str] = None
        self._initial = int(initial)
        self.postfix = ""
        self.bar: Any = None
        if draw if draw is not None else not headless():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=self.done, desc=label, unit=unit, dynamic_ncols=True, leave=True)
        self._last_line = time.monotonic()  # when a line was last logged or the bar last drawn
        self._stopped = threading.Event()
        if heartbeat_s > 0 and self.done < self.total:
            threading.Thread(
                target=_heartbeat, args=(weakref.ref(self), self._stopped, heartbeat_s), daemon=True
            ).start()

    def beat(self, heartbeat_s: float) -> None:
        """What the heartbeat does after `heartbeat_s` without a line: redraw the bar (its elapsed time
        moves), or log the meter marked still working."""
        if time.monotonic() - self._last_line < heartbeat_s:
            return
        self._last_line = time.monotonic()
        if self.bar is not None:
            self.bar.refresh()
        else:
            self.log.info("%s (still working on %s %d)", self.meter(), self.unit, self.done + 1)

    def meter(self) -> str:
        """The headless line: tqdm's meter of the work so far (rate over the units done here)."""
        elapsed = time.perf_counter() - self.started
        done_here = self.done - self._initial
        return text_tqdm.format_meter(
            self.done,
            self.total or None,
            elapsed,
            prefix=self.label,
            unit=self.unit,
            rate=done_here / elapsed if done_here and elapsed > 0 else None,
            initial=self._initial,
            bar_format=METER,
            postfix=self.postfix or None,
        )

    def update(self, done: int) -> Optional[str]:
        """Record that `done` units are finished (a position); returns the line logged now, if one was."""
        done = int(done)
        if self.bar is not None:
            self.bar.update(done - self.done)
            self.done, self._last_line = done, time.monotonic()
            if self.total and done >= self.total:
                self.close()  # finished: the bar stays as it ended
            return None
        self.done = done
        now = time.perf_counter()
        if done < self.total and now - self._last_logged < self.every_s:
            return None
        self._last_logged, self._last_line = now, time.monotonic()
        line = self.meter()
        self.log.info(line)
        if done >= self.total:
            self._stopped.set()
        return line

    def set_postfix(self, text: str) -> None:
        """A short status shown after the meter (the latest metrics, say)."""
        self.postfix = text
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=True)

    def write(self, line: str) -> None:
        """A line of its own: above the bar when drawn, else a log line."""
        self._last_line = time.monotonic()
        if self.bar is not None:
            self.bar.write(line)
        else:
            self.log.info(line)

    def note(self, line: str) -> None:
        """A line about the latest unit (a step's metrics): above the bar when drawn; headless, at
        most one every `every_s` and the last at `close`, so a log (a notebook's page, a CI log)
        gets tens of lines for a warm start of hundreds of steps, not one per step."""
        if self.bar is not None:
            self.bar.write(line)
            return
        now = time.perf_counter()
        if now - self._last_noted < self.every_s:
            self._pending_note = line
            return
        self._last_noted, self._pending_note = now, None
        self._last_line = time.monotonic()
        self.log.info(line)

    def close(self) -> None:
        self._stopped.set()
        if self._pending_note is not None:
            self.log.info(self._pending_note)
            self._pending_note = None
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _heartbeat(progress: "weakref.ref[Progress]", stopped: threading.Event, heartbeat_s: float) -> None:
    """Beat `progress` every `heartbeat_s / 2` until it is closed, finished or collected."""
    while not stopped.wait(heartbeat_s / 2):
        current = progress()
        if current is None:
            return
        current.beat(heartbeat_s)
        del current


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


def notebook_logging(format: str = "%(asctime)s %(name)s: %(message)s") -> None:
    """A notebook's logging: the project's messages (`lib`: progress, evidence) at INFO on stdout, where
    they read as the cell's output rather than on the pink of Jupyter's stderr, which is left to
    warnings and errors (the libraries' too; their INFO, matplotlib's font substitutions among them,
    is noise there). Running it again replaces what it set."""
    logging.basicConfig(level=logging.WARNING, format=format, force=True)
    for handler in logging.getLogger().handlers:
        handler.setLevel(logging.WARNING)
    project = logging.getLogger("lib")
    project.setLevel(logging.INFO)
    for handler in [h for h in project.handlers if getattr(h, "notebook_logging", False)]:
        project.removeHandler(handler)
    out = logging.StreamHandler(sys.stdout)
    out.setFormatter(logging.Formatter(format))
    out.addFilter(_BelowWarning())
    out.notebook_logging = True  # type: ignore[attr-defined]
    project.addHandler(out)
