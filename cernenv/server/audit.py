"""A scored run's ledger checked as anyone sent it can check it (`python -m lib.measure.scorecard`).

Without the reveal (`read_run`): the file is a regular file of its own, with nothing rotated
beside it; its first line opens the run (`RunOpened`, with the commitment) and its lines after
that are the run's episodes, then at most its end (`RunEnded`), as the last line; each line
carries the hash of the line before it (`previous`: a line changed, inserted, removed or moved
breaks the chain at the next one); every episode is the run's (its id, the evaluation mode, the
secret's fingerprint), of one of its tasks (index, seed, scenario or difficulty), each task and
each place in the order once; the end's counts are the lines'.

With the reveal (`verify_run`), the document the run committed to before play: its hash is the
published commitment, it describes the run the ledger opens, the ledger's last line is the one
the server wrote last, each episode's task is the one the committed order handed out at its
place, its world nonce the one derived from the committed secret; and every episode replays
(`replay_episode`): its world drawn again, its recorded actions sent again, its grade, reward,
truth, steps and refusals come back as recorded.

Every failure is an `AuditError` whose message is one line naming the file, the line and what is
wrong. The operator may still lie about everything; once the commitment was published before play,
not without being caught.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from cernenv.environment import CERNCollisionEnvironment
from cernenv.scenarios import list_scenarios
from cernenv.server.evaluation import fingerprint
from cernenv.server.ledger import EpisodeEnded, RunEnded, RunOpened, _problem, ledger_files, line_sha256, parse_line
from cernenv.server.runs import COMMITMENT_FORMAT, commitment_of, world_nonce

REPLAY_TOLERANCE = 1e-6
"""Largest difference between a recorded and a replayed number (a reward) that counts as equal."""


class AuditError(ValueError):
    """A run's ledger (or reveal) that does not hold what the server wrote: one line, naming the
    file, the line and the reason."""


@dataclass
class RunLedger:
    """A scored run's ledger as `read_run` checked it: its opening, its episodes with their line
    numbers, its end (None: not ended), and the hash of its last line."""

    path: Path
    opened: RunOpened
    episodes: List[Tuple[int, EpisodeEnded]]
    ended: Optional[RunEnded]
    last_sha256: str


def _where(path: Path, line: Optional[int] = None) -> str:
    return f"{path}:{line}" if line is not None else f"{path}"


def _regular_file(path: Path, what: str) -> None:
    """An AuditError unless `path` is a regular file itself (not a link, which can point anywhere)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise AuditError(f"{path}: no such file: give the {what}") from None
    if stat.S_ISLNK(info.st_mode):
        raise AuditError(f"{path}: a symbolic link, not a {what}: give the file itself (a link can point at any file)")
    if not stat.S_ISREG(info.st_mode):
        raise AuditError(f"{path}: not a regular file: give the {what}")


def _task_problem(episode: EpisodeEnded, task: Mapping[str, Any]) -> Optional[str]:
    """How `episode` disagrees with the run's task it names, or None."""
    if episode.seed != task.get("seed"):
        return f"its seed {episode.seed} is not task {episode.task_index}'s, {task.get('seed')}"
    if task.get("scenario") is not None and episode.scenario != task["scenario"]:
        return f"its scenario {episode.scenario} is not task {episode.task_index}'s, {task['scenario']}"
    if task.get("scenario") is None and (
        episode.difficulty != task.get("difficulty") or episode.scenario in list_scenarios()
    ):
        return (
            f"it is {episode.scenario} ({episode.difficulty}), not task {episode.task_index}'s procedural "
            f"{task.get('difficulty')} campaign"
        )
    return None


def read_run(path: Path, run_id: Optional[str] = None) -> RunLedger:
    """The scored run in the ledger file `path`, checked line by line (see the module docstring);
    `run_id`: the run it must be. An AuditError naming file, line and reason at the first problem."""
    path = Path(path)
    _regular_file(path, "scored run's ledger (RUN_ID.jsonl, or .jsonl.gz)")
    rotated = ledger_files(path)[:-1]
    if rotated:
        raise AuditError(
            f"{rotated[0]}: a rotated file beside the scored run's ledger {path.name}, which is never rotated: "
            "the run's server did not write it; remove it, or score the ledger alone"
        )
    data = path.read_bytes()
    if path.name.endswith(".gz"):  # a published ledger, compressed as it is (the chain is over its lines)
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as error:
            raise AuditError(f"{path}: not a whole gzip file ({error})") from None
    lines = data.split(b"\n")
    if lines[-1]:
        raise AuditError(f"{_where(path, len(lines))}: cut short (no newline at its end)")
    lines = lines[:-1]
    if not lines:
        raise AuditError(f"{path}: empty: a scored run's ledger starts with the line that opens the run")
    records: List[Union[EpisodeEnded, RunOpened, RunEnded]] = []
    for number, raw in enumerate(lines, start=1):
        try:
            records.append(parse_line(raw.decode("utf-8")))
        except (UnicodeDecodeError, ValueError) as error:
            raise AuditError(f"{_where(path, number)}: not a results-ledger record: {_problem(error)}") from None
    opened = records[0]
    if not isinstance(opened, RunOpened):
        raise AuditError(f"{_where(path, 1)}: not the run's opening (RunOpened): a scored run's ledger starts with it")
    if opened.commitment is None:
        raise AuditError(
            f"{_where(path, 1)}: run {opened.run_id} published no commitment (a ledger written before scored runs "
            "committed to their worlds and chained their lines): it cannot be checked"
        )
    if opened.previous is not None:
        raise AuditError(f"{_where(path, 1)}: the run's first line carries a previous line's hash")
    if run_id is not None and opened.run_id != run_id:
        raise AuditError(f"{_where(path, 1)}: this ledger holds run {opened.run_id}, not {run_id}")
    episodes: List[Tuple[int, EpisodeEnded]] = []
    ended: Optional[RunEnded] = None
    tasks_seen: Dict[int, int] = {}
    places_seen: Dict[int, int] = {}
    for number, record in enumerate(records[1:], start=2):
        where = _where(path, number)
        if record.previous != line_sha256(lines[number - 2].decode("utf-8")):
            raise AuditError(
                f"{where}: the hash it carries is not line {number - 1}'s: line {number - 1} was changed, or lines "
                "were inserted, removed or moved there"
            )
        if ended is not None:
            raise AuditError(f"{where}: a line after the run's end (RunEnded, line {number - 1})")
        if record.run_id != opened.run_id:
            raise AuditError(f"{where}: a line of run {record.run_id} in the ledger of run {opened.run_id}")
        if isinstance(record, RunOpened):
            raise AuditError(f"{where}: the run opened a second time: a scored run's ledger holds one run")
        if isinstance(record, RunEnded):
            ended = record
            continue
        problem = _episode_problem(record, opened, tasks_seen, places_seen, number)
        if problem:
            raise AuditError(f"{where}: {problem}")
        episodes.append((number, record))
    if ended is not None:
        graded = sum(1 for _, e in episodes if not e.abandoned)
        counts = {"recorded": len(episodes), "graded": graded, "abandoned": len(episodes) - graded}
        wrong = [f"{name} {getattr(ended, name)} (the ledger holds {value})" for name, value in counts.items()
                 if getattr(ended, name) != value]  # fmt: skip
        if ended.reason == "every task played" and ended.ended != opened.n_tasks:
            wrong.append(f"ended {ended.ended} of {opened.n_tasks} tasks, yet 'every task played'")
        if not ended.assigned >= ended.ended >= len(episodes):
            wrong.append(f"assigned {ended.assigned} >= ended {ended.ended} >= recorded {len(episodes)} fails")
        if wrong:
            raise AuditError(f"{_where(path, len(lines))}: the run's end says {'; '.join(wrong)}")
    return RunLedger(path, opened, episodes, ended, line_sha256(lines[-1].decode("utf-8")))


def _episode_problem(
    episode: EpisodeEnded, opened: RunOpened, tasks_seen: Dict[int, int], places_seen: Dict[int, int], number: int
) -> Optional[str]:
    """Why the episode line `number` is not one of the run `opened`'s, or None (and it is noted in
    `tasks_seen` and `places_seen`)."""
    if episode.mode != "evaluation":
        return f"an episode played in {episode.mode} mode: a scored run is played in evaluation mode"
    if episode.secret_fingerprint != opened.secret_fingerprint:
        return f"an episode drawn with secret {episode.secret_fingerprint}, not the run's {opened.secret_fingerprint}"
    index, place = episode.task_index, episode.assignment
    if index is None or not 0 <= index < opened.n_tasks:
        return f"an episode of task {index}: the run has tasks 0 to {opened.n_tasks - 1}"
    if index in tasks_seen:
        return f"task {index} again (line {tasks_seen[index]} has its episode): a run plays each task once"
    problem = _task_problem(episode, opened.tasks[index])
    if problem:
        return f"task {index}: {problem}"
    if place is None or not 0 <= place < opened.n_tasks:
        return f"task {index} handed out at place {place} of the run's order, which has {opened.n_tasks}"
    if place in places_seen:
        return f"place {place} of the run's order again (line {places_seen[place]})"
    if episode.actions is None or episode.refused_actions is None:
        return "an episode without its actions: it cannot be replayed"
    tasks_seen[index], places_seen[place] = number, number
    return None


def load_reveal(path: Path) -> Dict[str, Any]:
    """The reveal a server wrote at a run's end (`cernenv.server.runs.ScoredRun.reveal`); an AuditError
    naming the file when it is not one."""
    path = Path(path)
    _regular_file(path, "run's reveal (RUN_ID.reveal.json)")
    try:
        reveal = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise AuditError(f"{path}: not JSON ({error}): give the reveal the server wrote at the run's end") from None
    document = reveal.get("document") if isinstance(reveal, dict) else None
    if not isinstance(document, dict) or document.get("format") != COMMITMENT_FORMAT:
        raise AuditError(f"{path}: not a scored run's reveal (no document of format {COMMITMENT_FORMAT!r})")
    return reveal


def check_reveal(run: RunLedger, reveal: Mapping[str, Any], reveal_file: Path) -> Dict[str, Any]:
    """The committed document of `reveal` once it is checked against `run` (its hash, its run, the
    ledger's last line); an AuditError naming what disagrees."""
    document = reveal["document"]
    opened, where = run.opened, _where(run.path, 1)
    committed = commitment_of(document)
    if committed != opened.commitment:
        raise AuditError(
            f"{reveal_file}: its document hashes to {committed}, not to the commitment run {opened.run_id} "
            f"published ({where}: {opened.commitment})"
        )
    secret = document.get("world_secret")
    described = {
        "run_id": opened.run_id,
        "selection": opened.selection,
        "tasks": opened.tasks,
        "cernenv_version": opened.cernenv_version,
        "commit": opened.commit,
    }
    differ = [name for name, value in described.items() if document.get(name) != value]
    if not isinstance(secret, str) or fingerprint(secret) != opened.secret_fingerprint:
        differ.append("world_secret (its fingerprint)")
    if sorted(document.get("order") or []) != list(range(opened.n_tasks)):
        differ.append("order (not an order of the run's tasks)")
    if differ:
        raise AuditError(f"{where}: the run's opening and the committed document differ in {', '.join(differ)}")
    if run.ended is not None and reveal.get("last_line_sha256") != run.last_sha256:
        raise AuditError(
            f"{_where(run.path)}: its last line is not the one the server wrote last (the reveal names "
            f"{reveal.get('last_line_sha256')}): lines were removed from its end, or written after it"
        )
    return dict(document)


def _differs(recorded: Any, replayed: Any) -> bool:
    """Whether two JSON values differ, numbers beyond `REPLAY_TOLERANCE`."""
    if isinstance(recorded, bool) or isinstance(replayed, bool):
        return recorded is not replayed
    if isinstance(recorded, (int, float)) and isinstance(replayed, (int, float)):
        return not math.isclose(recorded, replayed, rel_tol=0.0, abs_tol=REPLAY_TOLERANCE)
    if isinstance(recorded, dict) and isinstance(replayed, dict):
        return recorded.keys() != replayed.keys() or any(_differs(recorded[k], replayed[k]) for k in recorded)
    if isinstance(recorded, list) and isinstance(replayed, list):
        return len(recorded) != len(replayed) or any(_differs(a, b) for a, b in zip(recorded, replayed))
    return recorded != replayed


def replay_episode(episode: EpisodeEnded, task: Mapping[str, Any], world_secret: str) -> Optional[str]:
    """Replay `episode` of `task`: its world drawn with `world_secret` and its `world_nonce`, its
    recorded actions sent again; what does not come back as recorded, or None."""
    env = CERNCollisionEnvironment(secret_salt=world_secret)
    env.reset(
        seed=int(task["seed"]),
        scenario=task.get("scenario"),
        difficulty=None if task.get("scenario") else task.get("difficulty"),
        world_nonce=episode.world_nonce,
    )
    obs = None
    for count, action in enumerate(episode.actions or []):
        if obs is not None and obs.done:
            return f"the replay ended after {count} actions; the record has {len(episode.actions)}"
        obs = env.step(action)
    done = obs is not None and obs.done
    if done and episode.abandoned:
        return (
            f"ends ({obs.latest_result.get('episode_end') or 'claim'}) in the replay; the record says {episode.ended!r}"
        )
    if not done and not episode.abandoned:
        return (
            f"does not end in the replay of its {len(episode.actions or [])} actions; the record says {episode.ended!r}"
        )
    state, grade = env.state, env.episode_grade()
    replayed = {
        "grade": grade,
        "episode_reward": state.cumulative_reward,
        "truth": json.loads(json.dumps(env.hidden_truth())),
        "steps": state.step_count,
        "refused_actions": env.refused_actions(),
        "ended": (obs.latest_result.get("episode_end") or "claim") if done else episode.ended,
    }
    recorded = {
        "grade": episode.grade.model_dump() if episode.grade is not None else None,
        "episode_reward": episode.episode_reward,
        "truth": episode.truth,
        "steps": episode.steps,
        "refused_actions": episode.refused_actions,
        "ended": episode.ended,
    }
    differ = [name for name in recorded if _differs(recorded[name], replayed[name])]
    if not differ:
        return None
    shown = "; ".join(f"{name} recorded {_short(recorded[name])}, replayed {_short(replayed[name])}" for name in differ)
    return f"does not replay as recorded: {shown}"


def _short(value: Any, limit: int = 120) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def verify_run(
    run: RunLedger, reveal_file: Path, progress: Optional[Callable[[int, int], None]] = None
) -> Tuple[int, Dict[str, Any]]:
    """Check `run` against the reveal in `reveal_file` (`check_reveal`) and replay every episode
    (`replay_episode`): (the number of episodes replayed identically, the committed document); an
    AuditError naming the first line that does not. `progress(done, total)` after each episode."""
    reveal = load_reveal(reveal_file)
    document = check_reveal(run, reveal, Path(reveal_file))
    secret, order = document["world_secret"], document["order"]
    for done, (number, episode) in enumerate(run.episodes, start=1):
        where = _where(run.path, number)
        if order[episode.assignment] != episode.task_index:
            raise AuditError(
                f"{where}: task {episode.task_index} at place {episode.assignment} of the order, where the committed "
                f"order has task {order[episode.assignment]}"
            )
        if episode.world_nonce != world_nonce(secret, episode.task_index):
            raise AuditError(
                f"{where}: task {episode.task_index}'s world nonce is not the one the committed secret gives"
            )
        problem = replay_episode(episode, run.opened.tasks[episode.task_index], secret)
        if problem:
            raise AuditError(f"{where}: task {episode.task_index} (seed {episode.seed}) {problem}")
        if progress is not None:
            progress(done, len(run.episodes))
    return len(run.episodes), document
