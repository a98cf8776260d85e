"""Progress lines (lib/progress.py): how far, how fast, how long is left; at most one per interval."""

from __future__ import annotations

import logging

from lib.progress import Progress


def test_progress_logs_rate_and_time_left_and_always_the_end(caplog):
    with caplog.at_level(logging.INFO, logger="lib.progress"):
        quiet = Progress("SFT", total=100, unit="step", every_s=3600.0)
        assert [quiet.update(done) for done in range(1, 100)] == [None] * 99  # within the interval: nothing
        final = quiet.update(100)
        assert final.startswith("SFT: 100/100 steps (100%), ") and "s/step" in final and "left" not in final
        chatty = Progress("evaluation", total=4, unit="episode", every_s=0.0)
        line = chatty.update(1)
        assert line.startswith("evaluation: 1/4 episodes (25%), ") and line.endswith(" left")
    assert [r.getMessage() for r in caplog.records] == [final, line]
