"""`make evaluate` as a development loop: development runs (`dev:N`) play the validation split's
tasks in public worlds, the same in every run, so two agents are compared task by task
(`--baseline`); an agent whose every action is refused is told why and fails; an agent that
crashes is counted as crashed, and its episodes are left out of the false-discovery rate."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from cernenv.environment import CERNCollisionEnvironment
from cernenv.server.audit import read_run, verify_run
from cernenv.server.runs import DEVELOPMENT_WORLDS_SECRET, ScoredRun, reveal_path
from cernenv.server.scheduler import FairScheduler
from cernenv.server.served import EnvironmentCount, ServedEnvironment
from cernenv.suite import DRAW_SEED_START, SUITES, development_tasks, selected_tasks, suite_tasks
from lib.agents.baselines import HeuristicAgent
from lib.agents.remote_player import Entrant, refusal_reason
from lib.measure.evaluation import validation_suite
from lib.measure.metrics import agent_metrics
from lib.measure.score_agent import _ledger_report, comparison_markdown
from lib.measure.score_agent import main as score_agent_main
from lib.measure.scorecard import score_run, verified_line
from lib.seeds import VALIDATION_SEED


def test_development_tasks_are_the_validation_splits_and_no_suites():
    """dev:N is `validation_suite(N)`'s tasks: evaluation-split seeds no held-out suite and no fresh
    draw holds, the same in every call; a malformed dev selection says what to give."""
    assert development_tasks(40) == selected_tasks("dev:40") == validation_suite(40)
    assert development_tasks(3)[0].seed == VALIDATION_SEED
    seeds = {task.seed for task in development_tasks(10_000)}
    assert not seeds & {task.seed for version in SUITES for task in suite_tasks(version)}
    assert max(seeds) < DRAW_SEED_START
    for bad in ("dev:x", "dev:", "dev:0", "dev:10001"):
        with pytest.raises(ValueError, match="dev"):
            selected_tasks(bad)


def seeded(selection: str, directory: Path, nonce: str) -> ScoredRun:
    run = ScoredRun(selection, directory)
    entrant = Entrant("lib.agents.baselines:HeuristicAgent", "0" * 64, nonce)
    run.seed(nonce, entrant.nonce_body(run.run_id, run.commitment))
    return run


def truths(run: ScoredRun) -> list:
    out = []
    for index, task in enumerate(run.tasks):
        env = CERNCollisionEnvironment(secret_salt=run.world_secret)
        env.reset(seed=task.seed, difficulty=task.difficulty, world_nonce=run.world_nonce(index))
        out.append(env.hidden_truth())
    return out


def test_two_development_runs_draw_the_same_worlds_and_two_scored_runs_do_not(tmp_path):
    """Whatever the operator's secret and the entrant's nonce, every dev:N run draws each task's world
    with the public development secret: the same hidden truths; two draw runs of the same seeds would not."""
    first = seeded("dev:6", tmp_path / "a.jsonl", "first-entrant-nonce-0001")
    second = seeded("dev:6", tmp_path / "b.jsonl", "second-entrant-nonce-002")
    assert first.operator_secret != second.operator_secret
    assert first.world_secret == second.world_secret == DEVELOPMENT_WORLDS_SECRET
    assert truths(first) == truths(second)
    drawn = [seeded("v3:known_physics", tmp_path / f"{name}.jsonl", f"{name}-entrant-nonce-00") for name in "cd"]
    assert drawn[0].world_secret != drawn[1].world_secret != DEVELOPMENT_WORLDS_SECRET


def play_heuristic(run: ScoredRun) -> None:
    """Every task of `run` played in process, as a server session plays it, by the heuristic."""
    scheduler, count = FairScheduler(), EnvironmentCount()
    env = ServedEnvironment(count, scheduler, run.world_secret, evaluation=True, ledger=run.ledger, run=run)
    env.adopt_session("session-1", "127.0.0.1")
    for _ in run.tasks:
        observation, agent = env.reset(), HeuristicAgent()
        while not observation.done:
            observation = env.step(agent.act(observation))
    env.close()
    scheduler.shutdown()


def test_a_development_run_is_verified_and_its_scorecard_says_its_worlds_are_public(tmp_path):
    run = seeded("dev:3", tmp_path, "entrant-nonce-of-a-dev-run")
    play_heuristic(run)
    verified, document = verify_run(read_run(run.ledger_path), reveal_path(run.ledger_path))
    assert verified == 3 and document["world_secret"] == DEVELOPMENT_WORLDS_SECRET
    card = score_run(run.ledger_path, reveal_path(run.ledger_path))
    assert "the public development worlds" in verified_line(card) and "entrant's nonce" not in verified_line(card)
    assert [e["task"]["seed"] for e in card["_episodes"]] == [t.seed for t in run.tasks]


def record(seed: int, exists: bool, *, discovered: bool = False, correct: bool = False, unfinished: bool = False):
    return {
        "seed": seed,
        "scenario": None,
        "difficulty": "easy",
        "truth": {"exists": exists},
        "cumulative_reward": -1.0 if unfinished else 1.0,
        "correct_outcome": correct,
        "discovered": discovered,
        "unfinished": unfinished,
        "steps": [],
    }


def test_a_crashed_episode_is_a_failure_but_no_false_discovery_and_walking_away_never_beats_giving_up():
    """An agent that raised in every episode claimed nothing: its false-discovery rate is undefined
    (n 0), not 1 [1, 1]; its success rate 0. One false discovery among 4 null tasks reads 1 of 1
    when the other 3 are walked away from, 1 of 4 when they are given up on: never better."""
    crashed = [record(i, exists=i % 2 == 0, unfinished=True) for i in range(6)]
    metrics = agent_metrics(crashed)
    assert metrics["false_discovery_rate"].n == 0 and metrics["success_rate"].mean == 0.0
    assert metrics["success_rate"].n == 6 and metrics["mass_accuracy"].n == 3
    reckless = record(0, exists=False, discovered=True)
    walked = agent_metrics([reckless, *[record(i, exists=False, unfinished=True) for i in (1, 2, 3)]])
    gave_up = agent_metrics([reckless, *[record(i, exists=False, correct=True) for i in (1, 2, 3)]])
    assert walked["false_discovery_rate"].mean == 1.0 and walked["false_discovery_rate"].n == 1
    assert gave_up["false_discovery_rate"].mean == 0.25
    assert walked["success_rate"].mean < gave_up["success_rate"].mean


def observation(error):
    return types.SimpleNamespace(latest_result={"action": "invalid", **({"error": error} if error else {})})


def test_the_first_refusal_says_what_act_returned_and_what_to_return():
    refused = "INVALID_ACTION: an action is a JSON object ..., got str"
    reason = refusal_reason('{"action_type": "configure_beam"}', observation(refused))
    assert reason.startswith("act() returned a str; return an ExperimentAction or a dict") and refused in reason
    assert refusal_reason(3, observation(refused)).startswith("act() returned an int;")
    assert refusal_reason({"hello": "world"}, observation("INVALID_ACTION: unknown")).startswith(
        "act() returned a dict the environment refused: INVALID_ACTION"
    )
    assert refusal_reason({"action_type": "scan_bump"}, observation(None)) is None


def card_of(episodes, refused=0):
    """A scorecard's fields `_ledger_report` and `comparison_markdown` read, for `episodes`."""
    abandoned = sum(bool(e.get("unfinished")) for e in episodes)
    return {
        "selection": f"dev:{len(episodes)}",
        "n_tasks": len(episodes),
        "graded": len(episodes) - abandoned,
        "abandoned": abandoned,
        "unplayed": 0,
        "counts": {"all": {"refused_actions": refused}},
        "_episodes": [{**e, "task": {"seed": e["seed"], "scenario": None, "difficulty": "easy"}} for e in episodes],
        "agent_run": {"refused": refused},
    }


def test_a_run_whose_every_action_was_refused_fails_with_the_first_refusals_reason():
    episodes = [{**record(i, exists=True), "n_steps": 5} for i in range(3)]
    why = "episode 1, step 1: act() returned a str; return an ExperimentAction or a dict"
    report = _ledger_report("m:Texter", card_of(episodes, refused=15), {"first_refusal": why}, None, None)
    assert report["error"] == f"the environment refused every one of the agent m:Texter's 15 actions (first: {why})"
    assert _ledger_report("m:A", card_of(episodes, refused=14), {}, None, None)["error"] is None


def test_a_crash_is_reported_once_with_its_count_and_its_first_line():
    episodes = [{**record(i, exists=True, unfinished=True), "n_steps": 0} for i in range(313)]
    said = {"first_error": "episode 1: ValueError: the agent's own bug", "failed": 313}
    report = _ledger_report("m:Crasher", card_of(episodes), said, None, None)
    assert report["error"].startswith(
        "the agent m:Crasher crashed in 313 of 313 episodes (it raised; first: episode 1: ValueError: the agent's own"
    )


def test_the_comparison_pairs_the_two_runs_by_task_and_gives_agent_minus_baseline():
    """The agent wins tasks 0-9, the baseline 0-4: +0.5 success, paired by task (every pair differs
    by 0 or +1, so the interval lies in [0, 1]), both sides' counts and the false discoveries."""
    baseline = [record(i, exists=i >= 2, correct=i < 5, discovered=i < 2) for i in range(10)]
    agent = [record(i, exists=i >= 2, correct=True) for i in range(10)]
    text = comparison_markdown(card_of(baseline), card_of(agent), "b:B", "a:A")
    row = next(line for line in text.splitlines() if line.startswith("| success |"))
    assert "5 of 10: 0.500" in row and "10 of 10: 1.000" in row and "| +0.500 [+0.200, +0.800] |" in row
    assert "False discoveries on the 2 null tasks: baseline 2, agent 0" in text
    with pytest.raises(ValueError, match="same tasks"):
        comparison_markdown(card_of(baseline[:9]), card_of(agent), "b:B", "a:A")


def test_a_baseline_needs_development_worlds(capsys):
    with pytest.raises(SystemExit) as stopped:
        score_agent_main(["--agent", "a.b:C", "--baseline", "a.b:D", "--suite", "v3"])
    assert stopped.value.code == 2 and "only development tasks give (--suite dev:N" in capsys.readouterr().err
