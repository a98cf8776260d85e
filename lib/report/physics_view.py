"""One episode's physics as the agent saw it (notebook 04): its spectrum with the fit it made and
its bump scan, replayed from the evidence record, with the significance it was told and the claim
it wrote."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional, Sequence

from lib.report import plotting
from lib.report.replay import ReplayMismatch, replay


def episodes_with_a_fit(episodes: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    """The episodes that reached a resonance fit, the correct ones first, then by reward."""

    def fitted(step: Mapping[str, Any]) -> bool:
        return isinstance(step.get("action"), dict) and step["action"].get("action_type") == "fit_resonance"

    with_fit = [e for e in episodes if any(fitted(step) for step in e["steps"])]
    return sorted(with_fit, key=lambda e: (bool(e.get("correct_outcome")), e["cumulative_reward"]), reverse=True)


def significance_line(logbook: Mapping[str, Any]) -> str:
    """The agent's last significance estimate as its logbook held it at the end of the episode."""
    result = logbook.get("estimate_significance")
    if not result:
        return "(the agent did not estimate a significance)"
    shown = ("mass_gev", "z_local", "z_global", "trials_factor", "systematics_included")
    return "estimate_significance: " + " ".join(f"{k}={result[k]}" for k in shown if k in result)


def show_physics(episodes: Sequence[Mapping[str, Any]], seed: Optional[int] = None) -> Optional[Dict[str, Any]]:
    """Print and draw the physics of one episode of `episodes`: the one with `seed`, else the best
    that reached a resonance fit (`episodes_with_a_fit`). Returns what was shown (None: no such
    episode); an episode from another version of the environment is named, not drawn."""
    chosen = [e for e in episodes if e["seed"] == seed] if seed is not None else episodes_with_a_fit(episodes)
    if not chosen:
        print("no episode reached a resonance fit: nothing to show" if seed is None else f"seed {seed} is not there")
        return None
    episode = chosen[0]
    try:
        snapshot = replay(episode)[-1]
    except ReplayMismatch as error:  # evidence of another version of the environment: its spectra are gone
        print(f"not shown: {error}")
        snapshot = {"spectrum": None, "scan": None, "resonance_fit": None, "background_fit": None, "logbook": {}}
    print(
        f"seed {episode['seed']}, {episode['scenario']} ({episode['difficulty']}): "
        f"{'correct' if episode['correct_outcome'] else 'wrong'} outcome, "
        f"reward {episode['cumulative_reward']:+.2f}; truth {json.dumps(episode['truth'])}"
    )
    panels = [name for name in ("spectrum", "scan") if snapshot[name] is not None]
    if panels:
        fig, axes = plotting.subplots(1, len(panels), figsize=(10 * len(panels), 8), squeeze=False)
        if snapshot["spectrum"] is not None:
            fit = snapshot["resonance_fit"] or snapshot["background_fit"]
            plotting.plot_spectrum(snapshot["spectrum"], fit, ax=axes[0][0])
        if snapshot["scan"] is not None:
            plotting.plot_scan(snapshot["scan"], ax=axes[0][-1])
        plotting.show(fig)
    print(significance_line(snapshot["logbook"]))
    print(f"claim: {episode['steps'][-1]['completion']}")
    return {"episode": episode, "snapshot": snapshot}
