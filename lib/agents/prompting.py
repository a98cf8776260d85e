"""The LLM agent's side of the text: its prompt (`SYSTEM_PROMPT`, `render_observation`,
`build_chat`), the action schema and formatting (`action_json_schema`, `action_to_json`), the
parser of its replies (`parse_reply`), and `LLMAgent`, which plays with a `generate_fn`.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from types import UnionType
from typing import Any, Callable, Dict, Iterable, List, Literal, Mapping, Optional, Union, get_args, get_origin

import numpy as np

from cernenv.actions import ACTION_TABLE, Prerequisite
from cernenv.models import CollisionObservation, ExperimentAction
from cernenv.references import reference_json_schema, shown_reference_pattern
from cernenv.rewards import EVIDENCE_Z_GLOBAL, NULL_EVIDENCE_LUMINOSITY_FRACTION, REDUNDANCY_PENALTY, VIOLATION_PENALTY
from cernenv.rules import RuleViolation
from cernenv.rules import parse_action as validate_action

# LLM agent: prompt, parse, act ---------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How each action is decoded: the one sampling setting of evaluation, rollouts and training
    (`TrainConfig.sampling` builds one from its command-line fields)."""

    temperature: float = 1.0
    """Softmax temperature [dimensionless]; 0 means greedy (evaluation)."""
    top_p: float = 1.0
    """Nucleus mass [0, 1]; 1.0 samples from the whole distribution (what GRPO's ratios assume)."""
    max_new_tokens: int = 96
    """Longest action [tokens]; a turn that reaches it is cut and sent to the environment as it is.
    With `lib.training.tokenizer`'s tokenizer the baselines' actions take 25-90."""
    constrained: bool = False
    """Hold each reply to the action grammar as it is generated (`lib.episodes.grammar`): a token that
    would make the reply anything but one schema-valid action gets probability 0, so every reply that
    ends within `max_new_tokens` parses. The log-probabilities returned stay the model's own."""


@dataclass(frozen=True)
class LLMAgentConfig:
    """How an LLM policy is prompted and sampled (`generate_fn` reads `sampling`)."""

    max_history_steps: int = 6
    """Entries of `pipeline_history` shown in the prompt [steps]."""
    sampling: Sampling = Sampling()
    """How each action is decoded."""
    system_prompt: bool = True
    """Open each chat with `SYSTEM_PROMPT` (the rules, verbs and costs). A real model reads it; the
    CPU stand-in, which learns the environment from demonstrations and cannot read prose, plays
    without it (`TrainConfig.system_prompt`): ~320 of its ~550 tokens a decision."""
    compact_followups: bool = False
    """In a conversation's later messages, leave out the logbook and references lines where they say
    what the conversation last said (`compact_followup`): a real tokenizer spends most of a later
    message on them, repeated while no analysis changes them. Off: every later message carries them,
    so the numbers a claim quotes are always in its last message."""
    style: str = "full"
    """How observations are written (`OBSERVATION_STYLES`): "full", every field the policy may read
    (`render_observation`; the stand-in's and the committed evidence's); "brief", a campaign a
    small model can afford (`render_brief`, `BRIEF_SYSTEM_PROMPT`): the task once, then per turn
    the last result's deciding numbers to 3 significant digits, a refusal's reason and the logbook's
    state when it changes, for replies held to the grammar of the references shown (which tells
    the policy what it may quote, so no references line is written)."""

    def __post_init__(self) -> None:
        if self.style not in OBSERVATION_STYLES:
            raise ValueError(f"style must be one of {OBSERVATION_STYLES}, got {self.style!r}")


OBSERVATION_STYLES = ("full", "brief")
"""`LLMAgentConfig.style`'s values."""


def _type_label(annotation: Any) -> str:
    """The values of a parameter with a fixed set of them (`a|b`, `[lo,hi]`); else "" (a number,
    a name or a boolean, which its name makes clear)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (Union, UnionType):
        return "|".join(filter(None, (_type_label(a) for a in args if a is not type(None))))
    if origin is tuple:
        return "[lo,hi]"
    return ""


def _parameter_label(name: str, field: Any) -> str:
    """`name`, or `name?` when it may be left out; `:values` when they are a fixed set."""
    label = _type_label(field.annotation)
    return f"{name}{'' if field.is_required() else '?'}{':' + label if label else ''}"


def _prerequisite_label(prerequisite: Prerequisite) -> str:
    """`beam` for beam_configured, `spectrum` for spectrum_built: the thing that must exist."""
    return re.sub(r"_(configured|set|allocated|built|done)$", "", prerequisite.value)


def _action_reference() -> str:
    """`ACTION_TABLE` grouped by prerequisites, one line per group: `[needs] verb(params)M$/days ...`."""
    groups: Dict[tuple, List[str]] = {}
    for spec in ACTION_TABLE.values():
        params = ",".join(_parameter_label(n, f) for n, f in spec.params.model_fields.items())
        cost = f"{spec.cost_musd:g}/{spec.time_days:g}" + ("+" if spec.cost_note else "")
        groups.setdefault(spec.prerequisites, []).append(f"{spec.action_type.value}({params}){cost}")
    lines = []
    for needs, verbs in groups.items():
        label = f"[{','.join(_prerequisite_label(p) for p in needs)}] " if needs else ""
        lines.append(label + " ".join(verbs))
    return "\n".join(lines)


def render_system_prompt() -> str:
    """The system prompt, assembled from `ACTION_TABLE` and the reward constants.

    Terse by design (the whole prompt should stay under ~2,000 characters): parameter types
    and defaults are left to `action_json_schema()`; the reference lists names, which are
    optional (`p?`), the fixed sets of values, costs and prerequisites.
    """
    return (
        "You are an experimental particle physicist running a resonance search.\n"
        'Reply with exactly one JSON object {"action_type":..,"parameters":{..},"justification":".."}\n'
        "Actions: [needs] name(params)M$/days (+: variable part; p?: optional)\n"
        f"{_action_reference()}\n"
        'A parameter may quote a value on the References line: "@fit.mass_gev"; "@luminosity.affordable_fb*0.4" '
        "scales it.\n"
        f"A refused action costs {-VIOLATION_PENALTY:g}, a repeat on unchanged data {-REDUNDANCY_PENALTY:g}. "
        "The claim ends the campaign and is graded: a discovery needs the right mass and "
        f"≥{EVIDENCE_Z_GLOBAL:g}σ global in your data, a null claim "
        f"≥{NULL_EVIDENCE_LUMINOSITY_FRACTION:.0%} of the luminosity cap analysed; "
        "misstated significance or confidence costs."
    )


SYSTEM_PROMPT = render_system_prompt()


def round_significant(value: Any, digits: int = 4) -> Any:
    """`value` with every float in it (also inside lists and dicts) rounded to `digits` significant digits."""
    if isinstance(value, float) and math.isfinite(value) and value != 0.0:
        return round(value, digits - 1 - math.floor(math.log10(abs(value))))
    if isinstance(value, dict):
        return {key: round_significant(item, digits) for key, item in value.items()}
    if isinstance(value, list):
        return [round_significant(item, digits) for item in value]
    return value


def _short(value: Any) -> str:
    """A value as the prompt shows it: exactly as an action's JSON writes it (numbers to 4
    significant digits, `2090.0`, `0.2111`; names unquoted), so that the tokens a reply copies
    are the tokens the prompt holds. Containers compact, their strings quoted as in JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_short(v)}" for k, v in value.items()) + "}"
    return json.dumps(round_significant(value), separators=(",", ":"))


UNSHOWN_RESULT_KEYS = ("q0", "p_local", "p_global", "local_p_method", "upcrossings_source", "upcrossings_z1")
"""Result fields the prompt leaves out: q0 and the p-values say what the Z values say, and the
methods behind them are for people (the observation has them all)."""

EVIDENCE_WORDS = ((5.0, "observation"), (EVIDENCE_Z_GLOBAL, "evidence"), (float("-inf"), "no evidence"))
"""What a global significance is called (a physicist's words for 5σ and 3σ), as the logbook says it."""


def evidence_word(z_global: Any) -> str:
    """What the logbook calls a global significance (`EVIDENCE_WORDS`): observation, evidence, no evidence."""
    z = float(z_global) if isinstance(z_global, (int, float)) else 0.0
    return next(word for level, word in EVIDENCE_WORDS if z >= level)


def _logbook_line(obs: CollisionObservation) -> str:
    """The logbook's state for the next decision. Before a fit: each channel's scan, the largest
    excess first. Once a fit exists: its channel, whether systematics are evaluated for it, what the
    latest significance is called (evidence at 3σ, observation at 5σ) and the spin measured, each
    marked `(outdated)` where the data changed after it (its numbers are on the references line)."""
    logbook, outdated = obs.logbook, set(obs.outdated_logbook_entries)

    def mark(key: str) -> str:
        return "(outdated)" if key in outdated else ""

    fit = logbook.get("fit_resonance")
    if not fit:
        scans = sorted(
            ((key.split("/", 1)[1], entry) for key, entry in logbook.items() if key.startswith("scan_bump/")),
            key=lambda item: -float(item[1].get("best_z_local") or 0.0),
        )
        notes = [
            f"scan[{channel}] best_mass_gev={_short(entry.get('best_mass_gev'))} "
            f"best_z_local={_short(entry.get('best_z_local'))}"
            for channel, entry in scans
        ]
        return "Logbook: " + "; ".join(notes) if notes else ""
    systematics = logbook.get("request_systematics") or {}
    notes = [
        f"fit[{fit.get('channel')}]{mark('fit_resonance')}",
        f"systematics={'yes' if systematics.get('channel') == fit.get('channel') else 'no'}",
    ]
    significance = logbook.get("estimate_significance")
    if significance:
        notes.append(f"significance{mark('estimate_significance')}={evidence_word(significance.get('z_global'))}")
    angular = logbook.get("measure_angular")
    if angular:
        notes.append(f"spin{mark('measure_angular')}={angular.get('best_spin')}")
    return "Logbook: " + " ".join(notes)


def _references_line(obs: CollisionObservation) -> str:
    """`References: @name=value ...`: each value an action may quote by name (`cernenv.references`),
    but the scan's candidates, which the candidates list shows in order (`@scan.candidates[0]` is its first)."""
    shown = [
        f"@{name}={_short(value)}" for name, value in obs.references.items() if not name.startswith("scan.candidates[")
    ]
    return "References: " + " ".join(shown) if shown else ""


def render_observation(
    obs: CollisionObservation, config: LLMAgentConfig = LLMAgentConfig(), *, include_task: bool = True
) -> str:
    """The user message: a compact text rendering of what the observation shows, every value
    written as an action's JSON writes it, after `=` or a bracket (`mass=2090.0`,
    `channels=["dielectron","dimuon"]`): a reply that quotes a number or a name copies the
    prompt's tokens as they are.

    `include_task` (a single decision, or the first message of a conversation): the task
    (window, channels, triggers, beams, totals), the state (beam, trigger, channel, data) and
    the recent history. Without it (a later message of a conversation, which holds all that
    already): the step and the resources left, the last action's result, any violation, and
    the logbook's state and the values an action may quote by reference (`_logbook_line`,
    `_references_line`), so a conversation grows by a few dozen tokens a turn. The task's
    problem statement is left out: it restates the window and channels, and the system prompt
    says the window may hold nothing.
    """
    task, usage = obs.task, obs.resource_usage
    left = (
        f"budget={_short(usage.budget_remaining_musd)} time={_short(usage.time_remaining_days)} "
        f"luminosity={_short(usage.luminosity_remaining_fb)}"
        + (f" booked={_short(usage.luminosity_allocated_fb)}" if usage.luminosity_allocated_fb else "")
        + f" bookings={usage.luminosity_bookings}"
    )
    result = {k: v for k, v in obs.latest_result.items() if k not in UNSHOWN_RESULT_KEYS}
    action = result.pop("action", None)
    if result.get("error") in obs.rule_violations:
        del result["error"]  # shown once, under Violations
    last = f"Last ({action or 'none'}): " + " ".join(f"{k}={_short(v)}" for k, v in result.items())
    violations = ["Violations: " + " | ".join(obs.rule_violations)] if obs.rule_violations else []
    logbook = [line for line in (_logbook_line(obs), _references_line(obs)) if line]
    if not include_task:
        return "\n".join([f"Step {obs.step_index}/{task.max_steps} left: {left}", last, *violations, *logbook])
    lines = [
        f"Window={_short(list(task.search_window_gev))} GeV difficulty={task.difficulty} "
        f"channels={_short(task.available_channels)} triggers={_short(task.available_triggers)} "
        f"beams={_short(task.available_beam_energies_tev)} TeV",
        f"Step {obs.step_index}/{task.max_steps} left: {left} of budget={_short(task.budget_total_musd)} M$ "
        f"time={_short(task.time_total_days)} d luminosity={_short(task.luminosity_total_fb)} fb^-1",
    ]
    if obs.selected_beam_energy_tev is not None:
        lines.append(
            f"Beam={_short(obs.selected_beam_energy_tev)} pileup={obs.selected_pileup} "
            f"trigger={obs.selected_trigger} channel={obs.selected_channel}"
        )
    for name, data in obs.data_collected.items():
        lines.append(
            f"Data[{name}] luminosity={_short(data.luminosity_fb)} events={data.recorded_events} "
            f"calibration={data.calibration_level} reco={data.reconstruction}"
        )
    history = obs.pipeline_history[-config.max_history_steps :] if config.max_history_steps > 0 else []
    if history:
        lines.append("History: " + ",".join(entry.removesuffix(": ok") for entry in history))
    lines.append(last)
    candidates = f"candidates={_short(obs.candidate_masses_gev)} " if obs.candidate_masses_gev else ""
    lines.append(f"{candidates}best_global_z={_short(obs.cumulative_significance)}")
    return "\n".join([*lines, *violations, *logbook])


REPEATABLE_LINES = ("Logbook: ", "References: ", "State: ")
"""Lines of an observation's rendering that a compact later message leaves out while unchanged."""


def compact_followup(text: str, earlier: Iterable[str]) -> str:
    """`text`, a later message of a conversation, without each line that opens as one of
    `REPEATABLE_LINES` and equals the last line so opened in the `earlier` messages (oldest first)."""
    last: Dict[str, str] = {}
    for message in earlier:
        for line in message.split("\n"):
            head = next((head for head in REPEATABLE_LINES if line.startswith(head)), None)
            if head:
                last[head] = line
    kept = [line for line in text.split("\n") if not any(line.startswith(h) and last.get(h) == line for h in last)]
    return "\n".join(kept)


BRIEF_SYSTEM_PROMPT = (
    "You run an LHC resonance search, then claim a discovery or that nothing is there. Reply with one JSON action."
)
"""The system prompt of the `brief` style: the campaign in a sentence. The verbs, their parameters and the
references a reply may quote are the grammar's (`action_json_schema`), the rest the demonstrations'."""

BRIEF_RESULT_KEYS: Dict[str, Dict[str, str]] = {
    "configure_beam": {},
    "allocate_luminosity": {"booked_fb": "booked"},
    "set_trigger": {},
    "collect_collisions": {"luminosity_fb": "collected"},
    "calibrate_detector": {"calibration_level": "level"},
    "reconstruct_tracks": {},
    "select_channel": {"recorded_events": "events"},
    "build_invariant_mass": {"events": "events"},
    "subtract_background": {"signal_like_events": "signal_like"},
    "fit_resonance": {"mass_gev": "mass", "mass_err_gev": "error", "converged": "converged"},
    "scan_bump": {"best_mass_gev": "mass", "best_z_local": "z_local"},
    "measure_angular": {"best_spin": "spin"},
    "estimate_significance": {"z_local": "z_local", "z_global": "z_global"},
    "request_systematics": {},
    "request_theory_review": {"compatible": "compatible"},
    "submit_discovery_claim": {},
}
"""Per verb, the fields of its result a `brief` observation writes, and the short name it writes each
under: those a next decision turns on (a scan's excess picks the channel to fit; the global
significance, the claim). A verb not listed writes every field under its own name, so a new verb is
never silently mute."""


def render_brief(obs: CollisionObservation, *, include_task: bool = True) -> str:
    """The `brief` style's user message (`LLMAgentConfig.style`). With `include_task`: the window, the
    channels, triggers and beams a reply names (written as its JSON writes them), the totals. Then
    the last result's deciding fields (`BRIEF_RESULT_KEYS`; "ok" where none), numbers to 3
    significant digits; a refusal's reason; and the logbook's state once a fit exists (its channel,
    systematics, the significance's word, the spin, each marked `(outdated)` when new data
    superseded it)."""
    lines = []
    if include_task:
        task = obs.task
        lines.append(
            f"Window=[{','.join(_brief(edge) for edge in task.search_window_gev)}] GeV "
            f"channels={_short(task.available_channels)} "
            f"triggers={_short(task.available_triggers)} beams={_short(task.available_beam_energies_tev)} "
            f"budget={_brief(task.budget_total_musd)} time={_brief(task.time_total_days)} "
            f"luminosity={_brief(task.luminosity_total_fb)}"
        )
    result = dict(obs.latest_result)
    action = result.get("action")
    if obs.rule_violations:
        lines.append("Refused: " + " | ".join(obs.rule_violations))
    elif action and "error" not in result:
        names = BRIEF_RESULT_KEYS.get(action)
        if names is None:
            names = {key: key for key in result if key not in ("action", "message")}
        lines.append(" ".join(f"{name}={_brief(result[key])}" for key, name in names.items() if key in result) or "ok")
    elif "error" in result:
        lines.append(f"Error: {result['error']}")
    if obs.logbook.get("fit_resonance"):
        lines.append(_logbook_line(obs).replace("Logbook: ", "State: ", 1).replace("systematics=", "syst="))
    return "\n".join(lines)


def _brief(value: Any) -> str:
    """`_short` at 3 significant digits, a whole number without its `.0`."""
    value = round_significant(value, 3)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return _short(value)


def build_chat(obs: CollisionObservation, config: LLMAgentConfig = LLMAgentConfig()) -> List[Dict[str, str]]:
    """[system, user] messages for one decision ([user] without `config.system_prompt`); deterministic
    in `obs` and `config`."""
    brief = config.style == "brief"
    system = (
        [{"role": "system", "content": BRIEF_SYSTEM_PROMPT if brief else SYSTEM_PROMPT}] if config.system_prompt else []
    )
    content = render_brief(obs) if brief else render_observation(obs, config)
    return [*system, {"role": "user", "content": content}]


def chat_text(chat: List[Dict[str, str]]) -> str:
    """The plain text of a chat (contents joined by newlines): what the prompt budget counts."""
    return "\n".join(message["content"] for message in chat)


LITERAL_TEXT_PATTERN = "^(?:[^@][\\s\\S]*)?$"
"""A literal text parameter's pattern in the action schema: it does not start with `@`, which the
parser reads as a reference (a free string branch let a model held to the schema write
`"@70BLast..."` as a channel, which the parser then refused as no reference)."""


def _literal_text(field: Dict[str, Any]) -> Dict[str, Any]:
    """`field`'s schema with every free string in it (no enum, const or pattern) held to
    `LITERAL_TEXT_PATTERN`."""
    if field.get("type") == "string" and not {"enum", "const", "pattern"} & set(field):
        return {**field, "pattern": LITERAL_TEXT_PATTERN}
    if "anyOf" in field:
        return {**field, "anyOf": [_literal_text(option) for option in field["anyOf"]]}
    return field


class ReplyScope(dict):
    """What a reply to one observation may name: the references the observation shows (the scope is
    that mapping, name → value, as `CollisionObservation.references`) and the values its task offers
    for the parameters the environment holds to them (`offered`, `TaskInfo.offered_options`). A plain
    mapping of references is a scope that offers nothing in particular (any option may be written)."""

    def __init__(self, references: Mapping[str, Any], offered: Optional[Mapping[str, Iterable[Any]]] = None):
        super().__init__(references)
        self.offered: Dict[str, tuple] = {name: tuple(values) for name, values in (offered or {}).items()}

    @classmethod
    def of(cls, observation: CollisionObservation) -> "ReplyScope":
        """The scope of a reply to `observation`: its references and its task's options."""
        return cls(observation.references, observation.task.offered_options())


def offered_text(shown: Optional[Mapping[str, Any]]) -> Dict[str, tuple]:
    """The options `shown` (a `ReplyScope`) holds a reply's text parameters to, sorted (a channel, a
    trigger); nothing for a plain mapping or None. Numeric options (the beam energies) are not held: a
    JSON schema cannot say how a number is written, and the grammar engine writes its own shortest
    form (13 for 13.0), not the `13.0` the demonstrations write, so holding them would forbid what the
    policy learned; the environment still refuses an energy the task does not offer."""
    offered = getattr(shown, "offered", None) or {}
    return {
        name: tuple(sorted(values))
        for name, values in offered.items()
        if values and all(isinstance(value, str) for value in values)
    }


def _reference_schema(shown: Optional[Mapping[str, Any]], field: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The reference branch of a parameter of schema `field` in a reply to an observation that shows
    `shown` (None: any known name, `reference_json_schema`); None where it can quote nothing shown."""
    if shown is None:
        return reference_json_schema()
    types, listed = _schema_values(field)
    pattern = shown_reference_pattern(shown, _quotable(types, listed), scaled="number" in types)
    return {"type": "string", "pattern": pattern} if pattern else None


def _one_of(field: Dict[str, Any], values: tuple) -> Dict[str, Any]:
    """`field`'s schema with its text branch replaced by one of `values` (a null branch kept)."""
    if field.get("type") == "string":
        return {"enum": list(values)}
    if "anyOf" in field:
        return {**field, "anyOf": [_one_of(option, values) for option in field["anyOf"]]}
    return field


def _schema_values(field: Dict[str, Any]) -> tuple:
    """The JSON types `field` (a parameter's schema) admits and the values its enums and consts
    list, through its `anyOf` branches."""
    types = set(field["type"] if isinstance(field.get("type"), list) else [field["type"]] if "type" in field else [])
    listed = list(field.get("enum", [])) + ([field["const"]] if "const" in field else [])
    for option in field.get("anyOf", []):
        more_types, more_listed = _schema_values(option)
        types |= more_types
        listed += more_listed
    return types, listed


def _quotable(types: set, listed: list) -> Callable[[Any], bool]:
    """Which shown values a parameter can take by reference, from what its schema admits
    (`_schema_values`: its JSON `types` and the values its enums and consts have `listed`): one of
    those values, or one of a type it admits (a number for `number`, an integer for `integer`, text
    for `string`, true or false for `boolean`); a list or an object is never a shown value."""
    free = types - {"null"} if not listed else types - {"null", "string"}

    def quotable(value: Any) -> bool:
        if any(value == item and type(value) is type(item) for item in listed):
            return True
        if isinstance(value, bool):
            return "boolean" in free
        if isinstance(value, (int, float)):
            return "number" in free or ("integer" in free and isinstance(value, int))
        return isinstance(value, str) and "string" in free

    return quotable


def action_json_schema(shown: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """JSON schema of a valid action: one branch per verb of `ACTION_TABLE`, its `parameters`
    being that verb's parameter model (what `cernenv.rules.parse_action` validates), each parameter
    a literal value (a text one not starting with `@`) or a reference to a shown value
    (`cernenv.references`). `shown` (an observation's `references`): a reference may name only the
    values it shows, a numeric one alone scaled (`cernenv.references.shown_reference_pattern`), and
    none where it shows none, each parameter quoting only the values it can take (`_quotable`: no
    number as a channel, no text as a mass): the schema of a reply to that observation. Without it,
    any known name. Where `shown` is a `ReplyScope`, a channel or trigger written as text is also one
    its task offers (`offered_text`)."""
    branches = []
    offered = offered_text(shown)
    for spec in ACTION_TABLE.values():
        parameters = spec.params.model_json_schema()
        literals = {
            name: _one_of(field, offered[name]) if name in offered else _literal_text(field)
            for name, field in parameters.get("properties", {}).items()
        }
        parameters["properties"] = {}
        for name, literal in literals.items():
            reference = _reference_schema(shown, literal)
            parameters["properties"][name] = {"anyOf": [literal, reference]} if reference else literal
        branches.append(
            {
                "title": spec.action_type.value,
                "description": spec.summary,
                "type": "object",
                "properties": {
                    "action_type": {"const": spec.action_type.value},
                    "parameters": parameters,
                    "justification": {"type": "string", "maxLength": 2000},
                    "metadata": {"type": "object"},
                },
                "required": ["action_type", "parameters"] if parameters.get("required") else ["action_type"],
                "additionalProperties": False,
            }
        )
    return {"title": "ExperimentAction", "oneOf": branches}


def action_to_json(action: ExperimentAction, *, justification: bool = True) -> str:
    """An action as the reply the system prompt asks for (the target text of a completion), in
    compact JSON (no space after `:` or `,`, as the prompt writes values); without its
    justification (optional in the schema) when `justification` is False."""
    reply = {"action_type": action.action_type.value, "parameters": action.parameters}
    if justification:
        reply["justification"] = action.justification
    return json.dumps(reply, separators=(",", ":"))


@dataclass(frozen=True)
class ParseResult:
    """What `parse_reply` made of a completion."""

    action: Optional[ExperimentAction]
    """The validated action, or None."""
    payload: Any
    """What to send to `env.step`: the action; else the one JSON object found; else the raw text."""
    error: Optional[str] = None
    """Why there is no action."""

    @property
    def ok(self) -> bool:
        return self.action is not None


def _json_objects(text: str) -> List[Dict[str, Any]]:
    """Every top-level JSON object in `text`, decoded left to right (braces inside strings and
    nested objects belong to the object that contains them)."""
    decoder, objects, index = json.JSONDecoder(), [], 0
    while (start := text.find("{", index)) >= 0:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            index = start + 1
            continue
        objects.append(value)
        index = end
    return objects


def parse_reply(text: str, references: Optional[Mapping[str, Any]] = None) -> ParseResult:
    """Read one action from a completion: exactly one JSON object, around which prose and
    ```json fences are tolerated, validated as the environment validates it: `references` are the
    values the observation showed by name (its `references` field), which a parameter written
    `"@name"` quotes. The action keeps its references as written; the environment resolves them.

    Nothing is repaired or guessed: a reply with no object, with two or more, or with one
    that the environment would refuse yields `ok == False` and the reason.
    """
    if not isinstance(text, str):
        return ParseResult(None, text, f"a completion is text, got {type(text).__name__}")
    objects = _json_objects(text)
    if not objects:
        return ParseResult(
            None,
            text,
            "no JSON object in the reply: answer with one "
            '{"action_type": ..., "parameters": {...}, "justification": "..."}',
        )
    if len(objects) > 1:
        return ParseResult(None, text, f"{len(objects)} JSON objects in the reply; send exactly one action")
    try:
        action, _ = validate_action(objects[0], references or {})
    except RuleViolation as violation:
        return ParseResult(None, objects[0], str(violation))
    return ParseResult(action, action, None)


class LLMAgent:
    """A language-model policy: observation → chat → prompt → completion → action.

    `act` returns `ParseResult.payload`, so a reply that is not a valid action reaches the
    environment as it is, which refuses it (`INVALID_ACTION` / `INVALID_PARAMETERS`) and
    charges the violation penalty. There is deliberately no `safe_default_action`: replacing
    garbage with a sensible move would let a policy farm valid steps (and their milestones)
    from output that means nothing, and hide parse failures from the reward and the logs.
    """

    def __init__(
        self,
        generate_fn: Callable[[str], str],
        prompt_fn: Callable[[List[Dict[str, str]]], str] = chat_text,
        config: LLMAgentConfig = LLMAgentConfig(),
    ) -> None:
        self.generate_fn = generate_fn
        self.prompt_fn = prompt_fn
        self.config = config
        self.reset()

    def reset(self) -> None:
        self.last_prompt = ""
        self.last_completion = ""
        self.last_parse: Optional[ParseResult] = None

    def act(self, observation: CollisionObservation) -> Any:
        self.last_prompt = self.prompt_fn(build_chat(observation, self.config))
        self.last_completion = self.generate_fn(self.last_prompt)
        self.last_parse = parse_reply(self.last_completion, observation.references)
        return self.last_parse.payload


def prompt_budget(
    observations: Iterable[CollisionObservation], tokenizer: Any = None, config: LLMAgentConfig = LLMAgentConfig()
) -> Dict[str, float]:
    """Size of the prompts for `observations`: characters of the chat's plain text
    (`chat_text`) and, with a tokenizer, tokens of the prompt the model reads (its chat
    template with the generation prompt, else the plain text); median and 95th percentile."""
    chats = [build_chat(obs, config) for obs in observations]
    if not chats:
        raise ValueError("prompt_budget needs at least one observation")
    chars = np.array([len(chat_text(chat)) for chat in chats])
    budget = {
        "n_prompts": len(chats),
        "system_chars": len(SYSTEM_PROMPT),
        "chars_median": float(np.median(chars)),
        "chars_p95": float(np.percentile(chars, 95)),
    }
    if tokenizer is not None:
        if getattr(tokenizer, "chat_template", None):
            prompts = [
                tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats
            ]
        else:
            prompts = [chat_text(chat) for chat in chats]
        tokens = np.array([len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts])
        budget.update(tokens_median=float(np.median(tokens)), tokens_p95=float(np.percentile(tokens, 95)))
    return budget
