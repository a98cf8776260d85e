"""A scored run's scorecard, from the run's ledger, checked as anyone sent it can check it.

    python -m lib.measure.scorecard LEDGER --reveal REVEAL --receipts RECEIPTS --commitment HEX
        [--commitment-in-git PATH] [--agent MODULE:CLASS] [--run RUN_ID] [--expect SCORECARD]
        [--accept-unattested] [--json PATH] [--markdown PATH]

LEDGER is the run's own ledger (`runs/RUN_ID.jsonl` in the server's state directory, or its
`--results-ledger`); REVEAL the document the server wrote beside it when the run ended
(`RUN_ID.reveal.json`); RECEIPTS the signed heads the entrant's client kept while it played
(`lib.measure.score_agent` writes them); HEX the commitment published before play. The ledger is
checked first (`cernenv.server.audit.read_run`: one run, its lines chained and signed by the run's
key, every episode one of its tasks, its end's counts the lines'); with the receipts, the ledger
holds the lines the server signed for the entrant (`check_receipts`); with the reveal, the
commitment the run published before play is checked, the run must have ended, and every episode
is replayed in its world (`cernenv.server.audit.verify_run`): "verified: N of N episodes replayed
identically". A ledger, reveal or receipts file that fails is refused with one line naming the
file, the line and the reason. Without the entrant's receipts the run is `unattested` (only the
operator's word says who played it and where it ends): refused, exit 2, unless
`--accept-unattested`. The commitment is pinned from outside the run's folder: `--commitment HEX`,
or `--commitment-in-git PATH`, the file PATH as committed in the git commit the run's entrant's
nonce names (that commit must be in this checkout's history and the child of the commit the run
was played from). `--agent` names what played: a run whose nonce line names another agent is
refused.

The metrics are those `evaluate_agents` gives in process, with their 95% bootstrap intervals,
for the whole run and each group of `lib.measure.evaluation.GROUPS`, over every task the run
assigned: coverage says how many were played to their end, and a task abandoned (reset,
disconnect, idle timeout, shutdown, the agent raising) or never played is a failure in every metric
(`lib.measure.metrics.UNFINISHED_VALUES`) with the reward of an honest give-up at most: the
shaping it earned plus the grade of ending without a claim (`cernenv.rewards.NO_CLAIM`); but the
false-discovery rate, over the null tasks played to their end, leaves it out
(`lib.measure.metrics.UNFINISHED_LEFT_OUT`: it claimed nothing, and the counts say how many there
were). A task never played counts in its part and the whole run, and, its truth drawn in its
committed world from the reveal (`unplayed_truths`), in its particle split (a null task not played
is never a correct "nothing there"); without the reveal its truth is unknown and it is in neither
split. So walking away from a task never scores better than giving up on it.
The two metrics that need an episode's prompts (`parse_rate`, `claims_quote_own_fit`) are
in-process only. The counts per part say how many tasks ended without a claim and how many of
the agent's actions the environment refused.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from cernenv.rewards import NO_CLAIM
from cernenv.server.audit import AuditError, RunLedger, check_receipts, read_run, verify_run
from cernenv.server.ledger import EpisodeEnded
from cernenv.suite import is_development, part_of
from lib.episodes.records import NO_CLAIM_ENDINGS, ending_of_end
from lib.files import atomic_write, json_text
from lib.measure.evaluation import GROUP_WORDS, PARTS, group_metrics, split_comparison_table
from lib.measure.metrics import CONFIDENCE, N_BOOTSTRAP, estimates_to_json
from lib.progress import Progress

UNPLAYED = "not played: the run ended first"


def _episode_dict(episode: EpisodeEnded) -> Dict[str, Any]:
    """A ledger episode as the metrics read an episode record; an abandoned one is `unfinished`,
    worth the shaping it earned plus the grade of ending without a claim."""
    grade = episode.grade
    reward = episode.episode_reward
    if episode.abandoned:
        reward = (reward or 0.0) + NO_CLAIM
    return {
        "seed": episode.seed,
        "scenario": episode.scenario,
        "difficulty": episode.difficulty,
        "truth": episode.truth,
        "cumulative_reward": reward,
        "correct_outcome": bool(grade and grade.correct_outcome),
        "discovered": bool(grade and grade.discovered),
        "correct_mass": bool(grade and grade.correct_mass),
        "correct_channel": bool(grade and grade.correct_channel),
        "correct_spin": bool(grade and grade.correct_spin),
        "n_steps": episode.steps,
        "resources": dict(episode.resources or {}),
        "steps": [],
        "ended": episode.ended,
        "unfinished": episode.abandoned,
        "ending": ending_of_end(episode.ended, episode.claim, episode.abandoned),
        "refused_actions": episode.refused_actions or 0,
    }


def _unplayed_dict(task: Mapping[str, Any], truth: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A task the run never played: `unfinished`, worth the grade of ending without a claim, no step
    taken; its `truth` drawn from the reveal (None without it: then it is in neither particle split)."""
    return {
        "seed": task.get("seed"),
        "scenario": task.get("scenario"),
        "difficulty": task.get("difficulty"),
        "truth": truth,
        "cumulative_reward": NO_CLAIM,
        "correct_outcome": False,
        "n_steps": 0,
        "steps": [],
        "ended": UNPLAYED,
        "unfinished": True,
        "ending": "not played",
        "refused_actions": 0,
    }


def _counts(rows: Sequence[Mapping[str, Any]], episodes: Mapping[int, EpisodeEnded]) -> Dict[str, Dict[str, int]]:
    """Per part (and "all"): tasks, played to their end, abandoned, not played, ended without a
    claim (by the campaign's rules: steps, budget, time, refusals in a row), ended claiming that
    nothing is there, refused actions."""
    counts: Dict[str, Dict[str, int]] = {}
    for part in ("all", *PARTS):
        chosen = [i for i, row in enumerate(rows) if part == "all" or part_of(row.get("scenario")) == part]
        played = [episodes[i] for i in chosen if i in episodes]
        counts[part] = {
            "tasks": len(chosen),
            "played": sum(1 for e in played if not e.abandoned),
            "abandoned": sum(1 for e in played if e.abandoned),
            "unplayed": len(chosen) - len(played),
            "ended_without_claim": sum(1 for i in chosen if rows[i]["ending"] in NO_CLAIM_ENDINGS),
            "claimed_nothing_there": sum(1 for i in chosen if rows[i]["ending"] == "claimed nothing there"),
            "refused_actions": sum(rows[i]["refused_actions"] for i in chosen),
        }
    return counts


def unplayed_truths(run: RunLedger, world_secret: str) -> Dict[int, Dict[str, Any]]:
    """The hidden truth of each task `run` never played, drawn in its committed world (the reveal's
    worlds' secret): which of the particle splits an unplayed task belongs to."""
    from cernenv.environment import CERNCollisionEnvironment
    from cernenv.server.runs import world_nonce

    played = {episode.task_index for _, episode in run.episodes}
    truths: Dict[int, Dict[str, Any]] = {}
    for index, task in enumerate(run.opened.tasks):
        if index in played:
            continue
        env = CERNCollisionEnvironment(secret_salt=world_secret)
        env.reset(
            seed=int(task["seed"]),
            scenario=task.get("scenario"),
            difficulty=None if task.get("scenario") else task.get("difficulty"),
            world_nonce=world_nonce(world_secret, index),
        )
        truths[index] = json.loads(json.dumps(env.hidden_truth()))
    return truths


def scorecard(
    run: RunLedger,
    verified: Optional[int] = None,
    receipts: Optional[int] = None,
    truths: Optional[Mapping[int, Dict[str, Any]]] = None,
) -> Dict[str, Any]:
    """The scorecard of `run` (`cernenv.server.audit.read_run`'s): what the run was and what played
    it, how many of its tasks ended graded, abandoned or unplayed, counts per part, and every metric
    per group over every assigned task (strict JSON but for `_estimates`). `verified`: how many
    episodes `verify_run` replayed identically (None: not verified); `receipts`: how many of the
    entrant's receipts the ledger holds (None: none given, the run unattested); `truths`: the
    unplayed tasks' truths (`unplayed_truths`), which place them in the particle splits. `_episodes`
    (not in its JSON): one record per task, in the run's task order, as the metrics read it, with
    the `task` the run committed to (what pairs two runs of the same tasks)."""
    opened, end = run.opened, run.ended
    by_task = {episode.task_index: episode for _, episode in run.episodes}
    rows = [
        _episode_dict(by_task[index]) if index in by_task else _unplayed_dict(task, (truths or {}).get(index))
        for index, task in enumerate(opened.tasks)
    ]
    groups = group_metrics(rows)
    counts = _counts(rows, by_task)
    return {
        "run_id": opened.run_id,
        "selection": opened.selection,
        "opened_at": opened.opened_at,
        "ended_at": end.ended_at if end else None,
        "end_reason": end.reason if end else None,
        "secret_fingerprint": opened.secret_fingerprint,
        "commitment": opened.commitment,
        "public_key": opened.public_key,
        "entrant_nonce": run.seeded.entrant_nonce if run.seeded is not None else None,
        "agent": run.seeded.agent if run.seeded is not None else None,
        "agent_sha256": run.seeded.agent_sha256 if run.seeded is not None else None,
        "entrant_public_key": run.seeded.entrant_public_key if run.seeded is not None else None,
        "last_line_sha256": run.last_sha256,
        "cernenv_version": opened.cernenv_version,
        "commit": opened.commit,
        "n_tasks": opened.n_tasks,
        "graded": counts["all"]["played"],
        "abandoned": counts["all"]["abandoned"],
        "unplayed": counts["all"]["unplayed"],
        "coverage": counts["all"]["played"] / opened.n_tasks if opened.n_tasks else None,
        "counts": counts,
        "verified": verified,
        "receipts_checked": receipts,
        "confidence": CONFIDENCE,
        "bootstrap_resamples": N_BOOTSTRAP,
        "groups": {name: estimates_to_json({"agent": metrics})["agent"] for name, metrics in groups.items()},
        "_estimates": groups,
        "_episodes": [{**row, "task": dict(task)} for row, task in zip(rows, opened.tasks)],
    }


def verified_line(card: Mapping[str, Any]) -> str:
    """What the scorecard says of its verification: incomplete, not verified, unattested (verified,
    but no entrant's receipts), or verified."""
    if card["end_reason"] is None:
        return (
            "incomplete: the ledger has no end (RunEnded): the run is still being played, or its tail was cut off; "
            "not verified"
        )
    if card["verified"] is None:
        return (
            "not verified: the ledger's chain and its run were checked; give the run's reveal (--reveal "
            "RUN_ID.reveal.json) to check its commitment and replay every episode"
        )
    recorded = card["graded"] + card["abandoned"]
    receipts = card.get("receipts_checked")
    worlds = (
        "the public development worlds of the tasks" if is_development(str(card.get("selection"))) else "the worlds"
    )
    replayed = (
        f"{card['verified']} of {recorded} episodes replayed identically, in {worlds} run {card['run_id']} "
        f"committed to before play ({card['commitment']})"
        + ("" if is_development(str(card.get("selection"))) else " and its entrant's nonce")
        + f", played by {card.get('agent')}"
    )
    if receipts is None:
        return (
            f"unattested: {replayed}; but no entrant's receipts were given (--receipts): only the operator's word "
            "says who played the run and that it ends where its ledger does"
        )
    return f"verified: {replayed}; the ledger holds all {receipts} of the entrant's receipts, the last its end"


def counts_table(card: Mapping[str, Any]) -> str:
    """The counts per part as a Markdown table."""
    columns = (
        "tasks",
        "played",
        "abandoned",
        "unplayed",
        "ended_without_claim",
        "claimed_nothing_there",
        "refused_actions",
    )
    header = "| part | " + " | ".join(name.replace("_", " ") for name in columns) + " |"
    rows = [
        f"| {'whole run' if part == 'all' else GROUP_WORDS[part]} | "
        + " | ".join(str(counts[name]) for name in columns)
        + " |"
        for part, counts in card["counts"].items()
    ]
    return "\n".join([header, "|---|" + "---|" * len(columns), *rows])


def scorecard_markdown(card: Mapping[str, Any], agent: str = "agent") -> str:
    """The scorecard for a reader: what was run, its verification, the counts, then one row per group."""
    state = f"ended ({card['end_reason']})" if card["end_reason"] else "not ended (the server may still be running it)"
    coverage = "—" if card["coverage"] is None else f"{card['coverage']:.3f}"
    lines = [
        f"# Scorecard of run {card['run_id']} ({card['selection']})",
        "",
        f"{card['n_tasks']} tasks: {card['graded']} played to their end (coverage {coverage}), "
        f"{card['abandoned']} abandoned, {card['unplayed']} not played; run {state}. Cernenv "
        f"{card['cernenv_version']}, commit {card['commit'] or 'unknown'}; worlds' secret "
        f"{card['secret_fingerprint']}, commitment {card['commitment']}; ledger's last line "
        f"{card['last_line_sha256']}.",
        "",
        verified_line(card) + ".",
        "",
        counts_table(card),
        "",
        f"Every metric is over every task the run assigned: an abandoned or unplayed task is a failure in each, "
        f"with at most the reward of ending without a claim ({NO_CLAIM:+g} plus the shaping earned), but for the "
        f"false-discovery rate, which is over the null tasks played to their end (an abandoned or unplayed task "
        f"claimed nothing; the counts above say how many there were). Each cell: mean "
        f"[{CONFIDENCE:.0%} bootstrap interval].",
        "",
        split_comparison_table({group: {agent: metrics} for group, metrics in card["_estimates"].items()}),
        "",
        "Parts: " + "; ".join(f"{GROUP_WORDS[part]}: {meaning}" for part, meaning in PARTS.items()) + ".",
    ]
    return "\n".join(lines) + "\n"


def scorecard_json(card: Mapping[str, Any]) -> str:
    """The scorecard as strict JSON (an undefined statistic null)."""
    return json_text({k: v for k, v in card.items() if not k.startswith("_")}) + "\n"


def scorecard_difference(sent: Any, card: Any, where: str = "") -> Optional[str]:
    """Where the scorecard someone `sent` (its JSON) differs from `card` (`scorecard_json`'s JSON, made
    from the ledger here), or None: every field the ledger gives must be there and equal (numbers to
    1e-9); fields it does not give (`agent_run`, what the player said) are not compared."""
    if isinstance(card, dict):
        if not isinstance(sent, dict):
            return f"{where or 'the scorecard'} is not an object"
        for key, value in card.items():
            if key not in sent:
                return f"{where or 'the scorecard'} has no {key}"
            found = scorecard_difference(sent[key], value, f"{where}.{key}" if where else key)
            if found:
                return found
        return None
    if isinstance(card, list):
        if not isinstance(sent, list) or len(sent) != len(card):
            return f"{where} is not the ledger's list"
        found = (scorecard_difference(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(sent, card)))
        return next(filter(None, found), None)
    if _is_number(card) and _is_number(sent):
        if math.isclose(sent, card, rel_tol=1e-9, abs_tol=1e-12):
            return None
    elif sent == card:
        return None
    return f"{where} is {json.dumps(sent)[:60]}; the ledger gives {json.dumps(card)[:60]}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def score_run(
    ledger: Path,
    reveal: Optional[Path] = None,
    run_id: Optional[str] = None,
    *,
    receipts: Optional[Path] = None,
    commitment: Optional[str] = None,
    agent: Optional[str] = None,
    commitment_in_git: Optional[str] = None,
) -> Dict[str, Any]:
    """The scorecard of the run in `ledger`, checked against the entrant's `receipts` and verified
    against `reveal` (and the `commitment` published before play, or the one `commitment_in_git`
    holds at the run's nonce's commit) when given; `agent`: the agent that must have played it. An
    AuditError (one line: file, line, reason) when any is not what the server wrote."""
    run = read_run(ledger, run_id)
    if agent is not None and run.seeded is not None and run.seeded.agent != agent:
        raise AuditError(
            f"{ledger}:2: run {run.opened.run_id} was played by {run.seeded.agent} (its nonce line, signed by the "
            f"entrant), not by {agent}"
        )
    if commitment_in_git is not None:
        pinned = committed_commitment(run, commitment_in_git)
        if commitment is not None and commitment != pinned:
            raise AuditError(f"--commitment {commitment} is not the one {commitment_in_git} holds in git ({pinned})")
        commitment = pinned
    checked = check_receipts(run, receipts) if receipts is not None else None
    if commitment is not None and run.opened.commitment != commitment:
        raise AuditError(
            f"{ledger}:1: run {run.opened.run_id} opened with the commitment {run.opened.commitment}, not the one "
            f"published before play ({commitment})"
        )
    verified, truths = None, None
    if reveal is not None:
        with Progress("verifying the run: its episodes replayed", len(run.episodes), unit="episode") as replayed:
            verified, document = verify_run(
                run, reveal, lambda done, total: replayed.update(done), commitment=commitment
            )
        if document.get("world_secret"):
            truths = unplayed_truths(run, document["world_secret"])
    return scorecard(run, verified, checked, truths)


GIT_COMMIT = re.compile(r"[0-9a-f]{40}")


def committed_commitment(run: RunLedger, path: str, repository: Optional[Path] = None) -> str:
    """The commitment the file `path` (a published `commitment.json`) holds in the git commit the run's
    entrant's nonce names, once that commit is checked: in this checkout's history, and the child of
    the commit the run was played from (so the nonce, chosen by committing, came after the code and
    the commitment, and one run can be replayed into another only by a whole new run and commit). An
    AuditError naming what fails."""
    repository = repository or Path(__file__).resolve().parents[2]
    where = f"{run.path}:2"
    nonce = run.seeded.entrant_nonce if run.seeded is not None else None
    if nonce is None or not GIT_COMMIT.fullmatch(nonce):
        raise AuditError(f"{where}: the run's entrant's nonce {nonce!r} names no git commit: give --commitment HEX")

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(repository), *args], capture_output=True, text=True)

    if git("cat-file", "-e", f"{nonce}^{{commit}}").returncode != 0:
        raise AuditError(
            f"{where}: the run's entrant's nonce names commit {nonce}, which this clone lacks (a shallow clone? "
            "git fetch --unshallow), or no commit: its commitment cannot be read"
        )
    if git("merge-base", "--is-ancestor", nonce, "HEAD").returncode != 0:
        raise AuditError(f"{where}: commit {nonce} (the run's entrant's nonce) is not in this checkout's history")
    parent = git("rev-parse", f"{nonce}^").stdout.strip()
    if parent != run.opened.commit:
        raise AuditError(
            f"{where}: commit {nonce} (the run's entrant's nonce) is not the child of the commit the run was played "
            f"from ({run.opened.commit}; its parent is {parent or 'none'})"
        )
    shown = git("show", f"{nonce}:{path}")
    if shown.returncode != 0:
        raise AuditError(f"{where}: commit {nonce} (the run's entrant's nonce) holds no {path}")
    try:
        value = json.loads(shown.stdout).get("commitment")
    except (ValueError, AttributeError) as error:
        raise AuditError(f"{path} in commit {nonce}: not a published commitment's JSON ({error})") from None
    if not isinstance(value, str):
        raise AuditError(f"{path} in commit {nonce}: names no commitment")
    return value


def _commitment_in(path: Path) -> str:
    """The commitment a published `commitment.json` names (its `commitment`)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("commitment")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError) as error:
        raise AuditError(f"{path}: not a published commitment's JSON ({error})") from None
    if not isinstance(value, str):
        raise AuditError(f"{path}: names no commitment")
    return value


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lib.measure.scorecard",
        description="The scorecard of a scored run, from its ledger; with its reveal, every episode replayed.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "ledger", type=Path, help="the run's ledger (RUN_ID.jsonl; the server's start-up line names it)"
    )
    parser.add_argument(
        "--reveal",
        type=Path,
        metavar="REVEAL",
        help="the run's reveal (RUN_ID.reveal.json, written when the run ended): check the commitment and replay "
        "every episode",
    )
    parser.add_argument(
        "--receipts",
        type=Path,
        metavar="RECEIPTS",
        help="the receipts the entrant's client kept (the signed ledger heads served while it played): the ledger "
        "must hold every line they name, as signed",
    )
    parser.add_argument(
        "--commitment", metavar="HEX", help="the commitment published before play: the run's must be this one"
    )
    parser.add_argument(
        "--commitment-in-git",
        metavar="PATH",
        help="read the commitment from PATH as committed in the git commit the run's entrant's nonce names (in this "
        "checkout's history, the child of the commit the run was played from)",
    )
    parser.add_argument(
        "--accept-unattested",
        action="store_true",
        help="score a run without the entrant's receipts (its verdict then says unattested) instead of refusing it",
    )
    parser.add_argument("--run", metavar="RUN_ID", help="the run the ledger must hold")
    parser.add_argument(
        "--expect",
        type=Path,
        metavar="SCORECARD",
        help="a scorecard you were sent (its .json): it must be the one the ledger gives, field by field",
    )
    parser.add_argument(
        "--agent", metavar="MODULE:CLASS", help="the agent that played the run: a run played by another is refused"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the scorecard as JSON here")
    parser.add_argument("--markdown", type=Path, metavar="PATH", help="also write the markdown table here")
    args = parser.parse_args(argv)
    try:
        commitment = args.commitment
        if commitment is not None and Path(commitment).is_file():  # a published commitment.json
            commitment = _commitment_in(Path(commitment))
        card = score_run(
            args.ledger, args.reveal, args.run, receipts=args.receipts, commitment=commitment, agent=args.agent,
            commitment_in_git=args.commitment_in_git,
        )  # fmt: skip
        if card["receipts_checked"] is None and card["verified"] is not None and not args.accept_unattested:
            raise AuditError(
                f"{args.ledger}: unattested: no entrant's receipts (--receipts): only the operator's word says who "
                "played the run and where it ends; give the entrant's receipts, or --accept-unattested"
            )
        difference = None
        if args.expect is not None:
            try:
                sent = json.loads(args.expect.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as error:
                raise AuditError(f"{args.expect}: not a scorecard's JSON ({error})") from None
            made = json.loads(scorecard_json(card))
            if made["verified"] is None:  # without the reveal, what the sender verified and attested is not checked
                del made["verified"], made["receipts_checked"]
            difference = scorecard_difference(sent, made)
        if difference:
            raise AuditError(f"{args.expect}: not the scorecard this ledger gives: {difference}")
    except AuditError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    text = scorecard_markdown(card, card.get("agent") or "agent")
    if args.json:
        atomic_write(args.json, scorecard_json(card))
    if args.markdown:
        atomic_write(args.markdown, text)
    print(text, end="")
    print(verified_line(card))
    if args.expect is not None:
        print(f"{args.expect}: the scorecard this ledger gives, field by field")
    return 0


if __name__ == "__main__":
    sys.exit(main())
