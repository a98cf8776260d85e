"""Progress of long work as log lines: how far, how fast, how long is left.

Log lines rather than progress bars: they read the same in a terminal, in a notebook, in
`make reproduce`'s output (which echoes what the notebooks print) and in CI logs, where a
bar redrawn ten times a second becomes thousands of lines.

    progress = Progress("SFT warm start", total=2400, unit="step")
    progress.update(done)            # logs at most once per `every_s`, and at the end

`lib.training.callbacks.ProgressLog` does the same for a transformers `Trainer` (SFT, GRPO).
This module imports no transformers (`lib.multiturn` uses it, and Unsloth must be imported
before transformers).
"""

from __future__ import annotations

import logging
import time
from typing import Optional

logger = logging.getLogger("lib.progress")


def _duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """Counts `done` of `total` units of work and logs at most every `every_s` seconds (and when
    the work is done): the fraction done, seconds per unit, elapsed and estimated time left."""

    def __init__(
        self, label: str, total: int, *, unit: str = "item", every_s: float = 30.0, log: Optional[logging.Logger] = None
    ) -> None:
        self.label, self.total, self.unit, self.every_s = label, max(int(total), 0), unit, every_s
        self.log = log or logger
        self.started = time.perf_counter()
        self._last_logged = self.started
        self.done = 0

    def update(self, done: int) -> Optional[str]:
        """Record that `done` units are finished; the line logged now, if one was."""
        self.done = done
        now = time.perf_counter()
        if done < self.total and now - self._last_logged < self.every_s:
            return None
        self._last_logged = now
        elapsed = now - self.started
        per_unit = elapsed / done if done else float("nan")
        line = f"{self.label}: {done}/{self.total} {self.unit}s"
        if self.total:
            line += f" ({done / self.total:.0%})"
        if done:
            line += f", {per_unit:.2f} s/{self.unit}, {_duration(elapsed)} elapsed"
            if done < self.total:
                line += f", ~{_duration(per_unit * (self.total - done))} left"
        self.log.info(line)
        return line
