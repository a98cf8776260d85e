"""Notebook 04's physics view and evidence tables, from real records."""

from __future__ import annotations

import dataclasses

import matplotlib

matplotlib.use("Agg")

from lib.agents.baselines import HeuristicAgent  # noqa: E402
from lib.episodes.agent_rollouts import collect_episodes  # noqa: E402
from lib.report.evidence import checkpoint_table, reward_components_table  # noqa: E402
from lib.report.physics_view import episodes_with_a_fit, show_physics, significance_line  # noqa: E402


def _records():
    played = collect_episodes(
        [(3, "higgs_diphoton_125", None), (4, None, "easy")], agent=HeuristicAgent(), progress=False
    )
    return [dataclasses.asdict(r) for r in played]


def test_the_physics_view_shows_the_significance_the_agent_was_told(capsys):
    records = _records()
    best = episodes_with_a_fit(records)
    assert len(best) == 2, "the heuristic fits a resonance in both episodes"
    assert best[0]["correct_outcome"] or not best[1]["correct_outcome"], "a correct episode comes first"
    shown = show_physics(records, records[0]["seed"])
    told = shown["snapshot"]["logbook"]["estimate_significance"]
    out = capsys.readouterr().out
    assert f"z_global={told['z_global']}" in out and f"mass_gev={told['mass_gev']}" in out
    assert out.strip().endswith(records[0]["steps"][-1]["completion"])
    assert show_physics(records, seed=123456) is None and "seed 123456 is not there" in capsys.readouterr().out
    assert significance_line({}) == "(the agent did not estimate a significance)"


def test_evidence_tables_list_every_component_and_checkpoint():
    components = [
        {"step": "1", "n": "16", "outcome": "-1.0", "mass": ""},
        {"step": "9", "n": "16", "outcome": "0.5", "mass": "0.25"},
    ]
    table = reward_components_table(components).splitlines()
    assert table[0] == "| component | step 1 | step 9 |" and table[2:] == [
        "| outcome | -1.000 | +0.500 |",
        "| mass | — | +0.250 |",
    ]
    rows = [{"step": "0", "episodes": "21", "mean_reward": "-0.5", "success_rate": "0.25"}]
    assert checkpoint_table(rows).splitlines()[-1] == "| 0 | 21 | -0.500 | 0.250 |"
    assert reward_components_table([]) == checkpoint_table([]) == ""


def test_notebook_tables_show_each_episode_and_agent():
    """Notebook 01's reward breakdown and tour summary, notebook 03's policy-and-baselines table."""
    from lib.episodes.agent_rollouts import collect_agent_episode
    from lib.report.episode_markdown import episodes_summary_table, reward_breakdown_table
    from lib.report.evidence import policy_and_baselines_table

    played = collect_episodes(
        [(3, "higgs_diphoton_125", None), (4, None, "easy")], agent=HeuristicAgent(), progress=False
    )
    summary = episodes_summary_table(played).splitlines()
    assert len(summary) == 4 and summary[2].startswith("| `higgs_diphoton_125` | 3 | ")
    assert summary[3].endswith(f"| {played[1].cumulative_reward:+.2f} |")
    assert episodes_summary_table([dataclasses.asdict(r) for r in played]) == "\n".join(summary), "records or rows"
    from cernenv import CERNCollisionEnvironment

    env = CERNCollisionEnvironment()
    collect_agent_episode(env=env, seed=3, scenario="higgs_diphoton_125", agent=HeuristicAgent())
    state = env.state
    breakdown = reward_breakdown_table(state.reward_components, state.cumulative_reward).splitlines()
    assert len(breakdown) == len(state.reward_components) + 3 and breakdown[2].startswith("| `")
    assert breakdown[-1] == f"| **total** | **{state.cumulative_reward:+.3f}** |"
    baselines = {"random": {"mean_reward": {"mean": -1.25}, "success_rate": {"mean": 0.0}}}
    before_after = {"pre": {"mean_reward": 0.1, "success_rate": 0.2}, "post": {"mean_reward": 0.3, "success_rate": 0.4}}
    assert policy_and_baselines_table(baselines, before_after).splitlines()[2:] == [
        "| random | -1.250 | 0.000 |",
        "| policy before GRPO | 0.100 | 0.200 |",
        "| policy after GRPO | 0.300 | 0.400 |",
    ]
