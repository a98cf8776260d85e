"""Scored runs: the evaluation server, not the client, decides what is played.

An operator opens a run when starting the server (`python -m cernenv.server --scored-run v3`):
the run holds a list of tasks (`cernenv.suite.selected_tasks`), in an order the server draws and
keeps to itself. Each client reset gets the run's next task — a reset names no seed, scenario or
difficulty — and each task is assigned once. Every assigned episode ends in the results ledger,
abandoned ones too (a reset, a disconnect, an idle timeout, the server's shutdown), and a run's
scorecard (`python -m lib.measure.scorecard`) counts an abandoned or unplayed task as a failure:
nobody can choose their tasks or drop the ones they are unsure of.

The run's first ledger line (`RunOpened`) names its id, its tasks, the secret's fingerprint and
the code (cernenv's version and git commit); its last (`RunEnded`) says why it ended: every task
played, or the server stopped.
"""

from __future__ import annotations

import secrets
import threading
from typing import Any, Dict, List, Optional, Tuple

from cernenv._version import __version__
from cernenv.provenance import source_revision
from cernenv.server.ledger import ResultsLedger, utc_now
from cernenv.server.wire import RequestError
from cernenv.suite import SuiteTask, selected_tasks


def source_commit() -> Optional[str]:
    """The git commit of the code the server runs, "+modified" when its tracked files changed
    (None when it is not a git checkout)."""
    revision = source_revision()
    if revision["commit"] is None:
        return None
    return revision["commit"] + ("+modified" if revision["dirty"] else "")


class ScoredRun:
    """One scored run over `tasks` (see the module docstring), recorded in `ledger`."""

    def __init__(self, selection: str, ledger: ResultsLedger, secret_fingerprint: Optional[str]) -> None:
        self.selection = selection
        self.tasks: Tuple[SuiteTask, ...] = selected_tasks(selection)
        self.run_id = secrets.token_hex(8)
        self._ledger = ledger
        self._order = list(range(len(self.tasks)))
        secrets.SystemRandom().shuffle(self._order)
        self._lock = threading.Lock()
        self._assigned = 0
        self._ended: set = set()
        self.end_reason: Optional[str] = None
        ledger.append(
            {
                "record": "run_opened",
                "opened_at": utc_now(),
                "run_id": self.run_id,
                "selection": selection,
                "n_tasks": len(self.tasks),
                "tasks": [task.to_dict() for task in self.tasks],
                "secret_fingerprint": secret_fingerprint,
                "cernenv_version": __version__,
                "commit": source_commit(),
            }
        )

    def next_task(self) -> Tuple[int, SuiteTask]:
        """The next task to play and its index in `tasks`; a RequestError once none is left."""
        with self._lock:
            if self.end_reason is not None or self._assigned >= len(self.tasks):
                raise RequestError(
                    f"scored run {self.run_id} has assigned all {len(self.tasks)} of its tasks"
                    + (f" and ended ({self.end_reason})" if self.end_reason else "")
                    + ": there is nothing more to play on this server"
                )
            index = self._order[self._assigned]
            self._assigned += 1
            return index, self.tasks[index]

    def episode_ended(self, task_index: int) -> None:
        """Task `task_index`'s episode is in the ledger; the run ends once every task's is."""
        with self._lock:
            self._ended.add(task_index)
            finished = len(self._ended) == len(self.tasks)
        if finished:
            self.end("every task played")

    def end(self, reason: str) -> None:
        """End the run (once): its last ledger line."""
        with self._lock:
            if self.end_reason is not None:
                return
            self.end_reason = reason
            assigned, ended = self._assigned, len(self._ended)
        self._ledger.append(
            {
                "record": "run_ended",
                "ended_at": utc_now(),
                "run_id": self.run_id,
                "reason": reason,
                "assigned": assigned,
                "ended": ended,
            }
        )

    def describe(self) -> Dict[str, Any]:
        """What `/evaluation` says of the run: its id, selection, size and progress (not the order)."""
        with self._lock:
            return {
                "run_id": self.run_id,
                "selection": self.selection,
                "n_tasks": len(self.tasks),
                "assigned": self._assigned,
                "ended": len(self._ended),
                "open": self.end_reason is None,
            }


def unscored_reset_problem(arguments: Dict[str, Any], run: ScoredRun) -> Optional[str]:
    """Why a reset that chooses its task is refused in scored run `run` (None: it chooses nothing)."""
    chosen: List[str] = [name for name in ("seed", "scenario", "difficulty") if arguments.get(name) is not None]
    if not chosen:
        return None
    return (
        f"this server is playing scored run {run.run_id}: the server assigns every task, so a reset "
        f"takes no {', '.join(chosen)}; send reset with no parameters to get the next task"
    )
