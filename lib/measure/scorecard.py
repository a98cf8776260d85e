"""A scored run's scorecard, from the evaluation server's results ledger.

    python -m lib.measure.scorecard LEDGER [--run RUN_ID] [--json PATH] [--markdown PATH]

Reads the run's lines (`cernenv.server.ledger`; by default the last run the ledger opened) and
gives the metrics `evaluate_agents` gives in process, with their 95% bootstrap intervals, for the
whole run and each group of `lib.measure.evaluation.GROUPS` (unseen particles, unseen null tasks,
known physics, ...). Every task of the run counts: an abandoned episode (reset, disconnect, idle
timeout, shutdown) and a task never played are failures, so dropping the tasks one is unsure of
gains nothing. The two metrics that need an episode's steps (`parse_rate`, `claims_quote_own_fit`)
are in-process only: the ledger keeps the grade, not the steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from cernenv.server.ledger import EpisodeEnded, LedgerError, RunEnded, RunOpened, read_ledger
from lib.files import atomic_write, json_text
from lib.measure.evaluation import GROUP_WORDS, PARTS, group_metrics, split_comparison_table
from lib.measure.metrics import CONFIDENCE, N_BOOTSTRAP, estimates_to_json

UNPLAYED = "not played: the run ended first"


class ScorecardError(ValueError):
    """A ledger that holds no such run, or a run whose lines contradict each other."""


def run_lines(
    records: Sequence[Any], run_id: Optional[str] = None
) -> Tuple[RunOpened, List[EpisodeEnded], Optional[RunEnded]]:
    """The opening line, episode lines and end line (None: not ended) of run `run_id` (default:
    the last run opened in `records`). Two episodes of one task are an error."""
    opened = [r for r in records if isinstance(r, RunOpened) and (run_id is None or r.run_id == run_id)]
    if not opened:
        runs = [r.run_id for r in records if isinstance(r, RunOpened)]
        raise ScorecardError(
            f"the ledger opens no run {run_id}; it opens: {', '.join(runs)}"
            if run_id and runs
            else "the ledger opens no scored run: start the server with --scored-run (e.g. v3) and play it"
        )
    run = opened[-1]
    episodes = [r for r in records if isinstance(r, EpisodeEnded) and r.run_id == run.run_id]
    ends = [r for r in records if isinstance(r, RunEnded) and r.run_id == run.run_id]
    seen: Dict[int, EpisodeEnded] = {}
    for episode in episodes:
        if episode.task_index is None or not 0 <= episode.task_index < run.n_tasks:
            raise ScorecardError(f"run {run.run_id}: an episode names task {episode.task_index} of {run.n_tasks}")
        if episode.task_index in seen:
            raise ScorecardError(
                f"run {run.run_id}: task {episode.task_index} was recorded twice (sessions "
                f"{seen[episode.task_index].session_id} and {episode.session_id}): a run plays each task once"
            )
        seen[episode.task_index] = episode
        task = run.tasks[episode.task_index]
        if episode.seed != task.get("seed"):
            raise ScorecardError(
                f"run {run.run_id}: task {episode.task_index} is seed {task.get('seed')}, not {episode.seed}"
            )
    return run, episodes, (ends[-1] if ends else None)


def _episode_dict(episode: EpisodeEnded) -> Dict[str, Any]:
    """A ledger episode as the metrics read an episode record; abandoned: every check failed."""
    grade = episode.grade
    return {
        "seed": episode.seed,
        "scenario": episode.scenario,
        "difficulty": episode.difficulty,
        "truth": episode.truth,
        "cumulative_reward": episode.episode_reward,
        "correct_outcome": bool(grade and grade.correct_outcome),
        "discovered": bool(grade and grade.discovered),
        "correct_mass": bool(grade and grade.correct_mass),
        "correct_channel": bool(grade and grade.correct_channel),
        "correct_spin": bool(grade and grade.correct_spin),
        "n_steps": episode.steps,
        "resources": dict(episode.resources or {}),
        "steps": [],
        "ended": episode.ended,
    }


def _unplayed_dict(task: Mapping[str, Any]) -> Dict[str, Any]:
    """A task the run never played: a failure, in its part but in neither particle split (its
    world was never drawn), with no reward or steps to average."""
    return {
        "seed": task.get("seed"),
        "scenario": task.get("scenario"),
        "difficulty": task.get("difficulty"),
        "truth": None,
        "correct_outcome": False,
        "n_steps": None,
        "steps": [],
        "ended": UNPLAYED,
    }


def scorecard(records: Sequence[Any], run_id: Optional[str] = None) -> Dict[str, Any]:
    """The scorecard of run `run_id` of `records` (`read_ledger`'s): what the run was, how many of
    its tasks ended graded, abandoned or unplayed, and every metric per group (strict JSON)."""
    run, episodes, end = run_lines(records, run_id)
    by_task = {episode.task_index: episode for episode in episodes}
    rows = [
        _episode_dict(by_task[index]) if index in by_task else _unplayed_dict(task)
        for index, task in enumerate(run.tasks)
    ]
    groups = group_metrics(rows)
    return {
        "run_id": run.run_id,
        "selection": run.selection,
        "opened_at": run.opened_at,
        "ended_at": end.ended_at if end else None,
        "end_reason": end.reason if end else None,
        "secret_fingerprint": run.secret_fingerprint,
        "cernenv_version": run.cernenv_version,
        "commit": run.commit,
        "n_tasks": run.n_tasks,
        "graded": sum(1 for e in episodes if not e.abandoned),
        "abandoned": sum(1 for e in episodes if e.abandoned),
        "unplayed": run.n_tasks - len(episodes),
        "confidence": CONFIDENCE,
        "bootstrap_resamples": N_BOOTSTRAP,
        "groups": {name: estimates_to_json({"agent": metrics})["agent"] for name, metrics in groups.items()},
        "_estimates": groups,
    }


def scorecard_markdown(card: Mapping[str, Any], agent: str = "agent") -> str:
    """The scorecard for a reader: what was run, then one row per group."""
    state = f"ended ({card['end_reason']})" if card["end_reason"] else "not ended (the server may still be running it)"
    lines = [
        f"# Scorecard of run {card['run_id']} ({card['selection']})",
        "",
        f"{card['n_tasks']} tasks: {card['graded']} graded, {card['abandoned']} abandoned, "
        f"{card['unplayed']} not played "
        f"(abandoned and unplayed tasks count as failures); run {state}. Secret {card['secret_fingerprint']}, "
        f"cernenv {card['cernenv_version']}, commit {card['commit'] or 'unknown'}. "
        f"Each cell: mean [{CONFIDENCE:.0%} bootstrap interval].",
        "",
        split_comparison_table({group: {agent: metrics} for group, metrics in card["_estimates"].items()}),
        "",
        "Parts: " + "; ".join(f"{GROUP_WORDS[part]}: {meaning}" for part, meaning in PARTS.items()) + ".",
    ]
    return "\n".join(lines) + "\n"


def scorecard_json(card: Mapping[str, Any]) -> str:
    """The scorecard as strict JSON (an undefined statistic null)."""
    return json_text({k: v for k, v in card.items() if not k.startswith("_")}) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lib.measure.scorecard",
        description="The scorecard of a scored run, from the evaluation server's results ledger.",
        allow_abbrev=False,
    )
    parser.add_argument("ledger", type=Path, help="the server's results ledger (results.jsonl)")
    parser.add_argument("--run", metavar="RUN_ID", help="which run (default: the last one the ledger opened)")
    parser.add_argument("--agent", default="agent", help="the agent's name in the table")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the scorecard as JSON here")
    parser.add_argument("--markdown", type=Path, metavar="PATH", help="also write the markdown table here")
    parser.add_argument(
        "--skip-damaged", action="store_true", help="read past ledger lines that are not valid records (each reported)"
    )
    args = parser.parse_args(argv)
    if not args.ledger.is_file():
        parser.error(f"{args.ledger} is not a file: give the server's results ledger (its start-up line names it)")
    try:
        if args.skip_damaged:
            records, problems = read_ledger(args.ledger, skip_damaged=True)
            for problem in problems:
                print(f"skipped {problem}", file=sys.stderr)
        else:
            records = read_ledger(args.ledger)
        card = scorecard(records, args.run)
    except (LedgerError, ScorecardError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    text = scorecard_markdown(card, args.agent)
    if args.json:
        atomic_write(args.json, scorecard_json(card))
    if args.markdown:
        atomic_write(args.markdown, text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
