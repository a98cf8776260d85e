"""The one record of an episode, and the key that pairs it across runs.

`EpisodeSpec` says which episode to play (seed, and a curated scenario or a difficulty);
`StepRecord` and `EpisodeRecord` say what happened (rollouts, evaluation, training and
replay all write and read these); `PAIR_KEY` / `pair_key` identify the same task in two
runs (before and after training); `save_episodes_jsonl` stores one episode per line (gzip-compressed
when the name ends `.gz`, as every evaluation's evidence is) and `read_episodes_jsonl` (the one reader
of such files; `load_episodes_jsonl` warns of what it skipped) reads them back; `as_episode_dict`
turns a record (or a line read back) into a dict.
"""

from __future__ import annotations

import gzip
import json
import warnings
import zlib
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Annotated, Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from cernenv.rules import END_WITHOUT_CLAIM, MAX_CONSECUTIVE_REFUSALS
from cernenv.suite import SuiteTask
from lib.files import JsonError, atomic_write, json_text, parse_json, refuse_empty

PAIR_KEY = ("seed", "scenario", "difficulty")
"""The fields that identify a task: two records with the same values played the same world."""


def pair_key(episode: Mapping[str, Any]) -> Tuple:
    """`episode`'s values of `PAIR_KEY` (an episode dict or spec mapping)."""
    return tuple(episode.get(k) for k in PAIR_KEY)


EpisodeSpec = SuiteTask
"""One episode of a suite: the seed and either a curated scenario or a difficulty (`cernenv.suite.SuiteTask`)."""


def spec_fields(item: Any) -> Dict[str, Any]:
    """seed, scenario and difficulty of a spec: an object with those attributes (such as
    `EpisodeSpec`), a mapping, or a (seed, scenario, difficulty) tuple."""
    if isinstance(item, Mapping):
        spec = dict(item)
    elif hasattr(item, "seed"):
        spec = {
            "seed": item.seed,
            "scenario": getattr(item, "scenario", None),
            "difficulty": getattr(item, "difficulty", None),
        }
    else:
        spec = dict(zip(PAIR_KEY, item))
    return {"scenario": None, "difficulty": None, **spec}


@dataclass
class StepRecord:
    """One step: what the agent saw and said, what was sent, and what it earned."""

    step: int
    prompt: str
    completion: str
    action: Any
    """What was sent to `env.step`, as JSON: the action, or the unparsed object or text."""
    parsed_ok: bool
    reward: float
    done: bool
    rule_violations: List[str]
    observation_summary: Dict[str, Any] = field(default_factory=dict)
    parse_error: Optional[str] = None
    reward_breakdown: Dict[str, float] = field(default_factory=dict)


@dataclass
class EpisodeRecord:
    """One episode and its grade. `truth` is for evaluation only: no prompt ever contains it."""

    seed: int
    scenario: Optional[str]
    difficulty: Optional[str]
    truth: Optional[Dict[str, Any]]
    total_reward: float
    cumulative_reward: float
    terminal_reward: Optional[float]
    discovered: Optional[bool]
    correct_mass: Optional[bool]
    correct_channel: Optional[bool]
    correct_spin: Optional[bool]
    steps: List[StepRecord]
    agent: str = ""
    correct_outcome: Optional[bool] = None
    reward_components: Dict[str, float] = field(default_factory=dict)
    resources: Dict[str, float] = field(default_factory=dict)
    """Final `resource_usage`: budget [M$], luminosity [fb^-1], time [days], used and left."""
    n_steps: int = 0
    evaluation_key: Optional[Dict[str, str]] = None
    """The `lib.measure.evaluation.EvaluationKey` the episode's world was drawn with (its name,
    fingerprint and run nonce, never the secret); None: the seed's public world."""

    def to_dict(self) -> Dict[str, Any]:
        """The record as plain data, as a JSONL line holds it."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "EpisodeRecord":
        """The record of a dict written by `to_dict` (a JSONL line); unknown keys are an error."""
        data = dict(data)
        data["steps"] = [StepRecord(**step) for step in data.get("steps") or []]
        return cls(**data)


Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
"""A finite JSON number (an integer is one; a boolean, a string, NaN and infinity are not)."""


class StepLine(BaseModel):
    """The schema of a `StepRecord` as an episode file holds it: plain JSON types, strictly."""

    model_config = ConfigDict(extra="forbid")

    step: StrictInt
    prompt: StrictStr
    completion: StrictStr
    action: Any
    parsed_ok: StrictBool
    reward: Number
    done: StrictBool
    rule_violations: List[StrictStr]
    observation_summary: Dict[str, Any] = {}
    parse_error: Optional[StrictStr] = None
    reward_breakdown: Dict[str, Number] = {}


class EpisodeLine(BaseModel):
    """The schema of one line of an episode file (`EpisodeRecord.to_dict`): every boolean a JSON
    boolean, every reward a finite number, nothing unknown. Written and read through it, so a file
    whose booleans are strings ("False" is truthy) or whose rewards are NaN is an error, not a number."""

    model_config = ConfigDict(extra="forbid")

    seed: StrictInt = Field(ge=0)
    scenario: Optional[StrictStr]
    difficulty: Optional[StrictStr]
    truth: Optional[Dict[str, Any]] = None
    total_reward: Number
    cumulative_reward: Number
    terminal_reward: Optional[Number] = None
    discovered: Optional[StrictBool] = None
    correct_mass: Optional[StrictBool] = None
    correct_channel: Optional[StrictBool] = None
    correct_spin: Optional[StrictBool] = None
    steps: List[StepLine]
    agent: StrictStr = ""
    correct_outcome: Optional[StrictBool] = None
    reward_components: Dict[str, Number] = {}
    resources: Dict[str, Number] = {}
    n_steps: StrictInt = 0
    evaluation_key: Optional[Dict[str, StrictStr]] = None


def episode_line_error(episode: Any) -> Optional[str]:
    """Why `episode` (a JSON object read back) is not an episode line (`EpisodeLine`): its first few
    schema errors, each with where it is; None when it is one."""
    try:
        EpisodeLine.model_validate(episode)
    except ValidationError as error:
        parts = []
        for item in error.errors()[:3]:
            where = ".".join(str(p) for p in item["loc"]) or "the line"
            parts.append(f"{where}: {item['msg']} (got {str(item.get('input'))[:40]!r})")
        more = len(error.errors()) - 3
        return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")
    return None


def as_episode_dict(episode: Any) -> Dict[str, Any]:
    """An `EpisodeRecord` (or any record dataclass) or a JSONL row, as a dict."""
    if is_dataclass(episode):
        return asdict(episode)
    if isinstance(episode, Mapping):
        return dict(episode)
    raise TypeError(f"an episode is an EpisodeRecord or a dict read from a JSONL file, got {type(episode).__name__}")


ENDINGS = (
    "claimed a discovery",
    "claimed nothing there",
    "no claim: refusals in a row",
    "no claim: budget or time spent",
    "no claim: step limit",
    "no claim: stopped before the end",
    "not played",
)
"""How an episode ended (`episode_ending`): with one of the two claims, or without a claim for
one of the campaign's reasons (`MAX_CONSECUTIVE_REFUSALS` refused actions in a row, the budget or
the time spent, the step limit), stopped by the rollout before the environment ended it (a turn
or context limit), or never played to its end (a scored run's abandoned or unplayed task)."""
NO_CLAIM_ENDINGS = tuple(ending for ending in ENDINGS if ending.startswith("no claim"))


_NO_CLAIM_BY_CAUSE = {
    "step limit": "no claim: step limit",
    "refusals": "no claim: refusals in a row",
    "budget": "no claim: budget or time spent",
    "time": "no claim: budget or time spent",
}


def ending_of_end(ended: str, claim: Optional[Mapping[str, Any]], abandoned: bool) -> str:
    """Which of `ENDINGS` an episode a server recorded had: its `ended` (the campaign's end reason,
    `cernenv.rules.END_WITHOUT_CLAIM`, or "claim"), the claim it sent, whether it was abandoned."""
    if abandoned:
        return "not played"
    if claim is not None:
        return "claimed a discovery" if claim.get("discovered") else "claimed nothing there"
    for cause, reason in END_WITHOUT_CLAIM.items():
        if ended == reason:
            return _NO_CLAIM_BY_CAUSE[cause]
    raise ValueError(f"an episode without a claim ended {ended!r}, none of {list(END_WITHOUT_CLAIM.values())}")


def episode_ending(episode: Any) -> str:
    """Which of `ENDINGS` `episode` (a record or its dict) had: its `ending` when it says (a scored
    run's row, `ending_of_end`), else read from its steps. A claim is a last step that submitted
    one and was not refused. An episode without a claim ended on refusals when its last
    `MAX_CONSECUTIVE_REFUSALS` steps were refused, else on its budget or time when one is spent,
    else on the step limit; its last step not `done`: stopped before the end."""
    episode = as_episode_dict(episode)
    if episode.get("ending") in ENDINGS:
        return episode["ending"]
    steps = episode.get("steps") or []
    if episode.get("unfinished") or not steps:
        return "not played"
    last = steps[-1]
    if not last.get("done"):
        return "no claim: stopped before the end"
    action = last.get("action")
    if isinstance(action, Mapping) and action.get("action_type") == "submit_discovery_claim" and not step_refused(last):
        return "claimed a discovery" if episode.get("discovered") else "claimed nothing there"
    recent = steps[-MAX_CONSECUTIVE_REFUSALS:]
    if len(recent) == MAX_CONSECUTIVE_REFUSALS and all(step_refused(step) for step in recent):
        return "no claim: refusals in a row"
    resources = episode.get("resources") or {}
    if any(resources.get(name, 1.0) <= 1e-9 for name in ("budget_remaining_musd", "time_remaining_days")):
        return "no claim: budget or time spent"
    return "no claim: step limit"


def step_refused(step: Mapping[str, Any]) -> bool:
    """Whether the environment refused the step's action (a rule it breaks: the `violations` penalty)."""
    return float((step.get("reward_breakdown") or {}).get("violations", 0.0)) < 0


COMPRESSED_SUFFIX = ".gz"
"""An episode file whose name ends so (`pre_eval.jsonl.gz`) is gzip-compressed JSONL: the prompts every
step repeats make an evaluation's 12 MB of JSONL 0.8 MB of gzip (`zcat FILE` shows the lines)."""


def _compressed(path: Any) -> bool:
    return str(path).endswith(COMPRESSED_SUFFIX)


def save_episodes_jsonl(episodes: Sequence[Union[EpisodeRecord, Dict[str, Any]]], path: str) -> None:
    """Write one episode per line, atomically: a reader never sees a half-written file
    (`lib.files.atomic_write`); strict JSON (a NaN or an infinity is written null); gzip-compressed
    when `path` ends `.gz` (`COMPRESSED_SUFFIX`), with no time stamp, so the same episodes make the
    same bytes. Refuses an empty list (`lib.files.EmptyResultError`): a file of episodes is never
    replaced by none."""
    refuse_empty(path, len(episodes), "an episode file")
    lines = [json_text(as_episode_dict(episode), indent=None) for episode in episodes]
    for number, line in enumerate(lines, start=1):
        error = episode_line_error(json.loads(line))
        if error:
            raise ValueError(f"episode {number} of {len(lines)} for {path} is not an episode record: {error}")
    check_distinct(path, [json.loads(line) for line in lines])
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    atomic_write(path, gzip.compress(data, compresslevel=9, mtime=0) if _compressed(path) else data)


def episode_file_bytes(path: Any) -> bytes:
    """The JSONL bytes of an episode file, decompressed where its name ends `.gz`; a compressed file
    that is cut or damaged is a ValueError that says so (plain files are read as they are)."""
    with open(path, "rb") as f:
        data = f.read()
    if not _compressed(path):
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as error:  # BadGzipFile is an OSError
        raise ValueError(
            f"{path} is not a whole gzip file ({error or 'it ends early'}); restore it from where it was "
            "copied (for the committed evidence: git checkout -- FILE)"
        ) from None


def check_distinct(path: str, episodes: Sequence[Mapping[str, Any]]) -> None:
    """Raise where two episodes of one agent in an episode file are the same task (`PAIR_KEY`): a
    file appended to itself would count each task twice and narrow every interval."""
    seen: Dict[Tuple, int] = {}
    for number, episode in enumerate(episodes, start=1):
        key = (episode.get("agent"), *pair_key(episode))
        if key in seen:
            raise ValueError(
                f"{path}:{number} repeats the episode of line {seen[key]} (agent {key[0]!r}, seed {key[1]}, "
                f"{key[2] or key[3]}): an evaluation holds each task once; remove the repeated lines"
            )
        seen[key] = number


RENAMED_SUMMARY_KEYS = {"selected_beam_energy": "selected_beam_energy_tev"}
"""Step `observation_summary` keys renamed since records were first written: old name → new."""


def _upgrade(episode: Dict[str, Any]) -> Dict[str, Any]:
    """`episode` with the renamed summary keys of an older record under their current names."""
    for step in episode.get("steps") or []:
        summary = step.get("observation_summary") if isinstance(step, dict) else None
        if summary:
            step["observation_summary"] = {RENAMED_SUMMARY_KEYS.get(k, k): v for k, v in summary.items()}
    return episode


def read_episodes_jsonl(path: str) -> Tuple[List[Dict[str, Any]], int]:
    """The episodes of a JSONL file written by `save_episodes_jsonl` (or appended line by line;
    gzip-compressed where its name ends `.gz`), and how many unfinished last lines were skipped (0 or 1).
    The one reader of episode files: a last line that is not a whole JSON object (a writer
    interrupted mid-line, NULs a crash left) is skipped; any other line that is not an episode
    (bytes that are not UTF-8, invalid JSON, a value that is not an object, an object that is not an
    `EpisodeLine`: a boolean written as a string, a NaN reward, an empty object) is an error that
    names the line, because skipping it would lose an episode and reading it would count a wrong
    one; so are a line nested too deep for Python's parser (anywhere: it is whole, not cut short) and
    two lines of one agent on the same task. Summary keys renamed since the file was written are read
    under their current names."""
    lines = [line for line in episode_file_bytes(path).split(b"\n") if line.strip()]
    episodes, skipped = [], 0
    for number, raw in enumerate(lines, start=1):
        try:
            episode = parse_json(raw.decode("utf-8"))
            if not isinstance(episode, dict):
                raise ValueError(f"a JSON {type(episode).__name__}, not an episode object")
        except ValueError as error:  # UnicodeDecodeError and JsonError are ValueErrors
            what = f"column {error.column}: {error.problem}" if isinstance(error, JsonError) else str(error)
            if isinstance(error, JsonError) and error.too_deep:  # whole, not cut short: wherever it is
                raise ValueError(
                    f"{path}:{number} is not an episode ({what}): restore the file from where it was copied, "
                    "or delete the line to drop it"
                ) from None
            if number < len(lines):
                raise ValueError(
                    f"{path}:{number} is not an episode ({what}); only the last line may be unfinished: "
                    "restore the file from where it was copied, or delete the line to drop that episode"
                ) from None
            skipped += 1
            continue
        episode = _upgrade(episode)
        error = episode_line_error(episode)
        if error:
            raise ValueError(
                f"{path}:{number} is not an episode record: {error}; an evaluation file holds "
                "EpisodeRecord.to_dict() lines (plain JSON booleans and finite numbers)"
            )
        episodes.append(episode)
    check_distinct(path, episodes)
    return episodes, skipped


def load_episodes_jsonl(path: str) -> List[Dict[str, Any]]:
    """`read_episodes_jsonl`'s episodes; a skipped unfinished last line is said with a warning."""
    episodes, skipped = read_episodes_jsonl(path)
    if skipped:
        warnings.warn(f"{path}:{len(episodes) + 1}: skipped a truncated last line", stacklevel=2)
    return episodes
