"""A cheating agent for the tests: it plays like `HeuristicAgent` but first searches its own process
for the hidden truth — the callers' stack frames, every object the garbage collector tracks, the
environment variables and the files an evaluator keeps — and, when it finds the truth, claims it.
What it found goes, one JSON line per episode, to the file $INTROSPECTION_REPORT."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from cernenv.server.evaluation import state_dir
from lib.agents.baselines import HeuristicAgent
from lib.measure.evaluation import DEFAULT_KEY_FILE


def _truth_in(value: Any) -> Optional[Dict[str, Any]]:
    """`value` if it looks like a hidden truth (a dict with "exists" and "mass_gev"), else an
    environment's truth if `value` holds an episode with a scenario."""
    if isinstance(value, dict) and "exists" in value and "mass_gev" in value:
        return value
    scenario = getattr(getattr(value, "_episode", None), "scenario", None)
    if scenario is not None and callable(getattr(scenario, "hidden_truth", None)):
        return scenario.hidden_truth()
    return None


def search_process() -> Dict[str, Any]:
    """Everything this process can find: truths (frames, gc), secrets (variables, files)."""
    found: Dict[str, Any] = {"frames": None, "gc": None, "variables": [], "files": []}
    frame = sys._getframe(1)
    while frame is not None and found["frames"] is None:
        for value in frame.f_locals.values():
            found["frames"] = found["frames"] or _truth_in(value)
        frame = frame.f_back
    for value in gc.get_objects():
        try:
            truth = _truth_in(value) if isinstance(value, dict) or hasattr(value, "_episode") else None
        except Exception:  # a weak proxy whose object is gone, a lazy module that fails to load, ...
            continue
        if truth is not None:
            found["gc"] = truth
            break
    found["variables"] = sorted(name for name in os.environ if "SECRET" in name or name.startswith("CERNENV_"))
    candidates: List[Path] = [DEFAULT_KEY_FILE, state_dir() / "evaluation.secret", state_dir() / "results.jsonl"]
    found["files"] = [str(path) for path in candidates if path.is_file()]
    return found


class IntrospectingAgent(HeuristicAgent):
    """See the module docstring."""

    def reset(self) -> None:
        super().reset()
        self._searched = False

    def act(self, observation: Any) -> Any:
        if not self._searched:
            self._searched = True
            found = search_process()
            with open(os.environ["INTROSPECTION_REPORT"], "a") as report:
                report.write(json.dumps(found, default=str) + "\n")
            truth = found["frames"] or found["gc"]
            if truth is not None:
                self.cheat_with = truth
        truth = getattr(self, "cheat_with", None)
        if truth is not None:
            from cernenv.models import ExperimentAction

            self.cheat_with = None
            parameters = {"discovered": bool(truth["exists"]), "confidence": 0.99}
            if truth["exists"]:
                parameters.update(mass_gev=truth["mass_gev"], channel=truth["channels"][0], spin=truth["spin"])
            return ExperimentAction(action_type="submit_discovery_claim", parameters=parameters)
        return super().act(observation)
