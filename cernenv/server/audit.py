"""A scored run's ledger checked as anyone sent it can check it (`python -m lib.measure.scorecard`).

Without the reveal (`read_run`): the file is a regular file of its own, with nothing rotated
beside it; its first line opens the run (`RunOpened`, with the commitment and the run's public
key), its second takes the entrant's nonce (`RunSeeded`), the lines after that are the run's
episodes, then its end (`RunEnded`), as the last line; each line carries the hash of the line
before it (`previous`: a line changed, inserted, removed or moved breaks the chain at the next
one) and the run's Ed25519 signature of itself (a line changed by anyone without the run's key
fails it); every episode is the run's (its id, the evaluation mode, the worlds' secret's
fingerprint), of one of its tasks (index, seed, scenario or difficulty), each task and each place
in the order once, its claim, end and timestamps consistent; the end's counts are the lines'.

With the reveal (`verify_run`), the document the run committed to before play: its hash is the
published commitment, it describes the run the ledger opens (its tasks, its key, the operator's
secret), the run ended and its last line is the one the server wrote last, each episode's task is
the one the committed order handed out at its place, its world nonce the one derived from the
worlds' secret (the operator's committed secret mixed with the entrant's nonce); and every episode
replays (`replay_episode`): its world drawn again, its recorded actions sent again, its grade,
reward, truth, steps, refusals, end, claim, final resources, scenario and difficulty come back as
recorded.

With the entrant's receipts (`check_receipts`: the signed heads the server served while the run
was played): every receipt is the run's signature, and the ledger holds, at each receipt's line,
the very line the server signed then. What each party can forge: docs/reports.md.

Every failure is an `AuditError` whose message is one line naming the file, the line and what is
wrong.
"""

from __future__ import annotations

import datetime
import gzip
import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from cernenv.environment import CERNCollisionEnvironment
from cernenv.rules import END_WITHOUT_CLAIM
from cernenv.scenarios import list_scenarios
from cernenv.server.evaluation import fingerprint
from cernenv.server.ledger import (
    EpisodeEnded,
    Record,
    RunEnded,
    RunOpened,
    RunSeeded,
    _problem,
    ledger_files,
    line_digest,
    line_sha256,
    parse_line,
    signature_holds,
)
from cernenv.server.runs import (
    COMMITMENT_FORMAT,
    RUN_END_REASONS,
    commitment_of,
    entrant_signature_holds,
    entrant_statement,
    receipts_statement,
    run_worlds_secret,
    world_nonce,
)

REPLAY_TOLERANCE = 1e-6
"""Largest difference between a recorded and a replayed number (a reward) that counts as equal."""


class AuditError(ValueError):
    """A run's ledger (or reveal) that does not hold what the server wrote: one line, naming the
    file, the line and the reason."""


@dataclass
class RunLedger:
    """A scored run's ledger as `read_run` checked it: its opening, the entrant's nonce (None: no
    task was handed out), its episodes with their line numbers, its end (None: not ended, an
    incomplete ledger), the hash of its last line, and each line's (`line_sha256`, `line_digest`,
    signature), line 1 first."""

    path: Path
    opened: RunOpened
    seeded: Optional[RunSeeded]
    episodes: List[Tuple[int, EpisodeEnded]]
    ended: Optional[RunEnded]
    last_sha256: str
    heads: List[Tuple[str, str, Optional[str]]]


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


def _when(text: str) -> Optional[datetime.datetime]:
    """The UTC time an ISO 8601 timestamp with its offset names (`cernenv.server.ledger.utc_now`), or None."""
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


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
    records: List[Record] = []
    texts: List[str] = []
    for number, raw in enumerate(lines, start=1):
        try:
            texts.append(raw.decode("utf-8"))
            records.append(parse_line(texts[-1]))
        except (UnicodeDecodeError, ValueError) as error:
            raise AuditError(f"{_where(path, number)}: not a results-ledger record: {_problem(error)}") from None
    opened = records[0]
    if not isinstance(opened, RunOpened):
        raise AuditError(f"{_where(path, 1)}: not the run's opening (RunOpened): a scored run's ledger starts with it")
    if opened.commitment is None or opened.public_key is None:
        raise AuditError(
            f"{_where(path, 1)}: run {opened.run_id} published no commitment or signing key (a ledger written before "
            "scored runs committed to their worlds and signed their lines): it cannot be checked"
        )
    if opened.previous is not None:
        raise AuditError(f"{_where(path, 1)}: the run's first line carries a previous line's hash")
    if run_id is not None and opened.run_id != run_id:
        raise AuditError(f"{_where(path, 1)}: this ledger holds run {opened.run_id}, not {run_id}")
    heads: List[Tuple[str, str, Optional[str]]] = []
    for number, (text, record) in enumerate(zip(texts, records), start=1):
        digest = line_digest(text)
        if not signature_holds(opened.public_key, digest, record.signature):
            raise AuditError(
                f"{_where(path, number)}: its signature does not verify under the run's key (line 1's public_key): "
                "the line was changed after the server signed it, or written without the run's key"
            )
        heads.append((line_sha256(text), digest, record.signature))
    opened_at = _when(opened.opened_at)
    if opened_at is None:
        raise AuditError(f"{_where(path, 1)}: opened_at {opened.opened_at!r} is not an ISO 8601 time with its offset")
    episodes: List[Tuple[int, EpisodeEnded]] = []
    seeded: Optional[RunSeeded] = None
    ended: Optional[RunEnded] = None
    tasks_seen: Dict[int, int] = {}
    places_seen: Dict[int, int] = {}
    for number, record in enumerate(records[1:], start=2):
        where = _where(path, number)
        if record.previous != heads[number - 2][0]:
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
        stamp = {RunSeeded: "seeded_at", RunEnded: "ended_at", EpisodeEnded: "ended_at"}[type(record)]
        when = _when(getattr(record, stamp))
        if when is None or when < opened_at:
            raise AuditError(
                f"{where}: {stamp} {getattr(record, stamp)!r} is not an ISO 8601 time with its offset at or after "
                f"the run's opening ({opened.opened_at})"
            )
        if isinstance(record, RunSeeded):
            if number != 2:
                raise AuditError(f"{where}: the entrant's nonce on line {number}: it is the run's second line, once")
            if record.agent is None or record.agent_sha256 is None or record.entrant_public_key is None:
                raise AuditError(
                    f"{where}: the run is bound to no agent: its nonce line does not carry the agent, its code's "
                    "SHA-256 and the entrant's key (a run played before runs were bound to their agent)"
                )
            statement = entrant_statement(
                opened.run_id, opened.commitment, record.entrant_nonce, record.agent, record.agent_sha256
            )
            if not entrant_signature_holds(record.entrant_public_key, statement, record.entrant_signature):
                raise AuditError(
                    f"{where}: the entrant's signature of its nonce and agent does not hold for this run and its "
                    "commitment (cernenv.server.runs.entrant_statement): not the nonce its entrant sent to this run"
                )
            seeded = record
            continue
        if isinstance(record, RunEnded):
            ended = record
            continue
        if seeded is None:
            raise AuditError(f"{where}: an episode before the entrant's nonce (RunSeeded, the run's second line)")
        problem = _episode_problem(record, opened, seeded, tasks_seen, places_seen, number)
        if problem:
            raise AuditError(f"{where}: {problem}")
        episodes.append((number, record))
    if ended is not None:
        graded = sum(1 for _, e in episodes if not e.abandoned)
        counts = {"recorded": len(episodes), "graded": graded, "abandoned": len(episodes) - graded}
        wrong = [f"{name} {getattr(ended, name)} (the ledger holds {value})" for name, value in counts.items()
                 if getattr(ended, name) != value]  # fmt: skip
        if ended.reason not in RUN_END_REASONS:
            wrong.append(f"the reason {ended.reason!r}, which the server never writes (it writes {RUN_END_REASONS})")
        if ended.reason == "every task played" and ended.ended != opened.n_tasks:
            wrong.append(f"ended {ended.ended} of {opened.n_tasks} tasks, yet 'every task played'")
        if not opened.n_tasks >= ended.assigned >= ended.ended >= len(episodes):
            wrong.append(
                f"tasks {opened.n_tasks} >= assigned {ended.assigned} >= ended {ended.ended} >= recorded "
                f"{len(episodes)} fails"
            )
        late = [n for n, e in episodes if _when(e.ended_at) > _when(ended.ended_at)]
        if late:
            wrong.append(f"it ended at {ended.ended_at}, before the episode of line {late[0]} ended")
        if wrong:
            raise AuditError(f"{_where(path, len(lines))}: the run's end says {'; '.join(wrong)}")
    return RunLedger(path, opened, seeded, episodes, ended, heads[-1][0], heads)


def _episode_problem(
    episode: EpisodeEnded,
    opened: RunOpened,
    seeded: RunSeeded,
    tasks_seen: Dict[int, int],
    places_seen: Dict[int, int],
    number: int,
) -> Optional[str]:
    """Why the episode line `number` is not one of the run `opened`'s, or None (and it is noted in
    `tasks_seen` and `places_seen`)."""
    if episode.mode != "evaluation":
        return f"an episode played in {episode.mode} mode: a scored run is played in evaluation mode"
    if episode.secret_fingerprint != seeded.secret_fingerprint:
        return f"an episode drawn with secret {episode.secret_fingerprint}, not the run's {seeded.secret_fingerprint}"
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
    problem = _graded_fields_problem(episode)
    if problem:
        return problem
    tasks_seen[index], places_seen[place] = number, number
    return None


def _graded_fields_problem(episode: EpisodeEnded) -> Optional[str]:
    """Why the fields of `episode` a scorecard grades by cannot be what the server wrote, or None."""
    if episode.resources is None:
        return "an episode without its final resources (resources: null): the budget and time metrics read them"
    if episode.episode_reward is None:
        return "an episode without its reward (episode_reward: null)"
    if episode.steps < 0 or episode.refused_actions < 0 or episode.refused_actions > len(episode.actions or []):
        return f"steps {episode.steps} and refused_actions {episode.refused_actions} of {len(episode.actions)} actions"
    if episode.abandoned:
        if episode.claim is not None:
            return "an abandoned episode with a claim: a claim ends an episode, graded"
        if not episode.ended.startswith("abandoned"):
            return f"an episode without a grade that ended {episode.ended!r}, not abandoned"
        return None
    if episode.ended == "claim" and episode.claim is None:
        return "claim: null, yet the episode ended by its claim (ended 'claim')"
    if episode.ended != "claim" and episode.claim is not None:
        return f"a claim, yet the episode ended {episode.ended!r}"
    if episode.ended != "claim" and episode.ended not in END_WITHOUT_CLAIM.values():
        ends = list(END_WITHOUT_CLAIM.values())
        return f"ended {episode.ended!r}: neither a claim nor one of the campaign's ends {ends}"
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


def check_reveal(
    run: RunLedger, reveal: Mapping[str, Any], reveal_file: Path, commitment: Optional[str] = None
) -> Dict[str, Any]:
    """The committed document of `reveal` once it is checked against `run` (its hash, its run, its
    key, the operator's secret, the entrant's nonce, the ledger's end and last line), with
    `world_secret`, the worlds' secret they give; `commitment`: the one published before play,
    which the run's must be. An AuditError naming what disagrees."""
    document = reveal["document"]
    opened, where = run.opened, _where(run.path, 1)
    if commitment is not None and opened.commitment != commitment:
        raise AuditError(
            f"{where}: run {opened.run_id} opened with the commitment {opened.commitment}, not the one published "
            f"before play ({commitment}): this is not the run that was committed to"
        )
    committed = commitment_of(document)
    if committed != opened.commitment:
        raise AuditError(
            f"{reveal_file}: its document hashes to {committed}, not to the commitment run {opened.run_id} "
            f"published ({where}: {opened.commitment})"
        )
    if reveal.get("commitment") != committed:
        raise AuditError(
            f"{reveal_file}: its commitment field ({reveal.get('commitment')!r}) is not its document's hash "
            f"({committed}): the reveal was edited; give the one the server wrote at the run's end"
        )
    secret = document.get("operator_secret")
    described = {
        "run_id": opened.run_id,
        "selection": opened.selection,
        "tasks": opened.tasks,
        "public_key": opened.public_key,
        "cernenv_version": opened.cernenv_version,
        "commit": opened.commit,
    }
    differ = [name for name, value in described.items() if document.get(name) != value]
    if not isinstance(secret, str) or fingerprint(secret) != opened.secret_fingerprint:
        differ.append("operator_secret (its fingerprint)")
    if sorted(document.get("order") or []) != list(range(opened.n_tasks)):
        differ.append("order (not an order of the run's tasks)")
    if differ:
        raise AuditError(f"{where}: the run's opening and the committed document differ in {', '.join(differ)}")
    if run.ended is None:
        raise AuditError(
            f"{_where(run.path, len(run.heads))}: incomplete: the ledger has no end (RunEnded) after its last line: "
            "its tail was cut off, or the server had not ended the run; a run is verified whole or not at all"
        )
    if reveal.get("last_line_sha256") != run.last_sha256:
        raise AuditError(
            f"{_where(run.path)}: its last line is not the one the server wrote last (the reveal names "
            f"{reveal.get('last_line_sha256')}): lines were removed from its end, or written after it"
        )
    result = dict(document)
    if run.seeded is not None:
        if reveal.get("entrant_nonce") != run.seeded.entrant_nonce:
            raise AuditError(
                f"{reveal_file}: its entrant_nonce is not the one the ledger's RunSeeded line took "
                f"({_where(run.path, 2)})"
            )
        mixed = run_worlds_secret(opened.selection, secret, opened.run_id, run.seeded.entrant_nonce)
        if fingerprint(mixed) != run.seeded.secret_fingerprint:
            raise AuditError(
                f"{_where(run.path, 2)}: the worlds' secret the committed secret and the entrant's nonce give is not "
                f"the one it names ({run.seeded.secret_fingerprint})"
            )
        result["world_secret"] = mixed
    return result


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
    last = env.reset(
        seed=int(task["seed"]),
        scenario=task.get("scenario"),
        difficulty=None if task.get("scenario") else task.get("difficulty"),
        world_nonce=episode.world_nonce,
    )
    obs = None
    for count, action in enumerate(episode.actions or []):
        if obs is not None and obs.done:
            return f"the replay ended after {count} actions; the record has {len(episode.actions)}"
        obs = last = env.step(action)
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
        "claim": env.episode_claim(),
        "resources": {
            k: v
            for k, v in last.resource_usage.model_dump().items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        },
        "scenario": state.scenario_name,
        "difficulty": state.difficulty,
    }
    recorded = {
        "grade": episode.grade.model_dump() if episode.grade is not None else None,
        "episode_reward": episode.episode_reward,
        "truth": episode.truth,
        "steps": episode.steps,
        "refused_actions": episode.refused_actions,
        "ended": episode.ended,
        "claim": episode.claim,
        "resources": episode.resources,
        "scenario": episode.scenario,
        "difficulty": episode.difficulty,
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
    run: RunLedger,
    reveal_file: Path,
    progress: Optional[Callable[[int, int], None]] = None,
    *,
    commitment: Optional[str] = None,
) -> Tuple[int, Dict[str, Any]]:
    """Check `run` against the reveal in `reveal_file` (`check_reveal`; `commitment`: the one
    published before play) and replay every episode (`replay_episode`): (the number of episodes
    replayed identically, the committed document); an AuditError naming the first line that does
    not. `progress(done, total)` after each episode."""
    reveal = load_reveal(reveal_file)
    document = check_reveal(run, reveal, Path(reveal_file), commitment)
    order = document["order"]
    secret = document.get("world_secret")
    for done, (number, episode) in enumerate(run.episodes, start=1):
        where = _where(run.path, number)
        if order[episode.assignment] != episode.task_index:
            raise AuditError(
                f"{where}: task {episode.task_index} at place {episode.assignment} of the order, where the committed "
                f"order has task {order[episode.assignment]}"
            )
        if episode.world_nonce != world_nonce(secret, episode.task_index):
            raise AuditError(
                f"{where}: task {episode.task_index}'s world nonce is not the one the worlds' secret gives"
            )
        problem = replay_episode(episode, run.opened.tasks[episode.task_index], secret)
        if problem:
            raise AuditError(f"{where}: task {episode.task_index} (seed {episode.seed}) {problem}")
        if progress is not None:
            progress(done, len(run.episodes))
    return len(run.episodes), document


RECEIPTS_FORMAT = "cernenv scored-run receipts 2"
"""The `format` of an entrant's receipts file (`check_receipts`)."""


def check_receipts(run: RunLedger, receipts_file: Path) -> int:
    """Check `run` against the entrant's receipts in `receipts_file` (JSON: `format`, `run_id`,
    `commitment`, `public_key`, `entrant_nonce`, `agent`, `agent_sha256`, `entrant_public_key`,
    `receipts`: the heads `GET /evaluation` served, each `line`, `line_sha256`, `digest`,
    `signature`; `entrant_signature`: the entrant's key's signature of the rest,
    `cernenv.server.runs.receipts_statement`). The file must be the entrant's (its signature under
    the key the run's nonce line names), of this run, its nonce and its agent; each receipt must
    carry the run's signature, name a later line than the one before (in order, each line once),
    and the ledger must hold at its line the line the server signed then; the last receipt must be
    the ledger's last line, the run's end (the receipts cover the whole run). The number of
    receipts; an AuditError (one line: file, line, receipt) at the first that does not hold."""
    receipts_file = Path(receipts_file)
    _regular_file(receipts_file, "entrant's receipts (receipts.json)")
    try:
        kept = json.loads(receipts_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise AuditError(f"{receipts_file}: not JSON ({error}): give the receipts your client kept") from None
    if (
        not isinstance(kept, dict)
        or kept.get("format") != RECEIPTS_FORMAT
        or not isinstance(kept.get("receipts"), list)
    ):
        raise AuditError(f"{receipts_file}: not an entrant's receipts (no format {RECEIPTS_FORMAT!r} with receipts)")
    opened, seeded = run.opened, run.seeded
    if seeded is None:
        raise AuditError(f"{_where(run.path, 2)}: the run took no entrant's nonce: it has no entrant to receipt it")
    for name, value in (
        ("run_id", opened.run_id),
        ("commitment", opened.commitment),
        ("public_key", opened.public_key),
        ("entrant_public_key", seeded.entrant_public_key),
    ):
        if kept.get(name) != value:
            raise AuditError(
                f"{receipts_file}: its {name} {kept.get(name)} is not the ledger's {value} ({_where(run.path, 1)}): "
                "the ledger is not the run the entrant played"
            )
    if not entrant_signature_holds(seeded.entrant_public_key, receipts_statement(kept), kept.get("entrant_signature")):
        raise AuditError(
            f"{receipts_file}: not signed by the entrant's key (the one the run's nonce line names): receipts the "
            "entrant did not keep, or changed after it signed them"
        )
    for name, value in (
        ("entrant_nonce", seeded.entrant_nonce),
        ("agent", seeded.agent),
        ("agent_sha256", seeded.agent_sha256),
    ):
        if kept.get(name) != value:
            raise AuditError(
                f"{_where(run.path, 2)}: the run's {name} {value!r} is not the one the entrant sent "
                f"({kept.get(name)!r}, {receipts_file})"
            )
    previous_line = 0
    for count, receipt in enumerate(kept["receipts"], start=1):
        fields = ("line", "line_sha256", "digest", "signature")
        if not isinstance(receipt, dict) or not all(isinstance(receipt.get(k), (str, int)) for k in fields):
            raise AuditError(f"{receipts_file}: receipt {count} is not a receipt ({', '.join(fields)})")
        line = receipt["line"]
        if not isinstance(line, int) or isinstance(line, bool) or line < 1:
            raise AuditError(f"{receipts_file}: receipt {count} names line {line!r}")
        if line <= previous_line:
            raise AuditError(
                f"{receipts_file}: receipt {count} names line {line}, not after receipt {count - 1}'s line "
                f"{previous_line}: an entrant keeps each head once, in the order it was served"
            )
        previous_line = line
        if not signature_holds(opened.public_key, str(receipt["digest"]), str(receipt["signature"])):
            raise AuditError(
                f"{receipts_file}: receipt {count} (line {line}) is not signed by the run's key: not a receipt the "
                "server gave"
            )
        if line > len(run.heads):
            raise AuditError(
                f"{_where(run.path, len(run.heads))}: the ledger ends before line {line}, which the server signed for "
                f"the entrant (receipt {count} of {receipts_file}): lines were removed after the fact"
            )
        sha, digest, _signature = run.heads[line - 1]
        if (sha, digest) != (receipt["line_sha256"], receipt["digest"]):
            raise AuditError(
                f"{_where(run.path, line)}: not the line the server signed for the entrant while the run was played "
                f"(receipt {count} of {receipts_file}): the ledger was changed after the fact"
            )
    if run.ended is None or previous_line != len(run.heads):
        raise AuditError(
            f"{_where(run.path, len(run.heads))}: the entrant's receipts end at line {previous_line}, not at the run's "
            f"end (line {len(run.heads)}{'' if run.ended else ', which is no end'}): the lines after it were written "
            f"where the entrant could not see them ({receipts_file})"
        )
    return len(kept["receipts"])
