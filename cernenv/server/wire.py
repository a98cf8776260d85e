"""Checks on what clients send, made before anything else reads it, and without recursion.

Everything a client sends is JSON text (a WebSocket message, an HTTP body). Its nesting is
measured on the text itself, before it is parsed (`nesting_depth`), and refused beyond
`MAX_JSON_DEPTH`: so no parser, validator, encoder or error message further on ever meets a
structure deep enough to exhaust Python's recursion limit. The checks here walk parsed values
with an explicit stack.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterator, Mapping, Optional

MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects accepted (a step message is 4 deep)."""

RESET_PARAMETERS = ("seed", "episode_id", "scenario", "difficulty", "secret_salt")
MAX_RESET_STRING = 255

# A JSON string (its escapes included; unterminated, to the end of the text), or a bracket: one
# pass over the text, without backtracking.
_TOKEN = re.compile(r'"(?:[^"\\]++|\\.?)*+(?:"|\Z)|[\[\]{}]', re.S)


def nesting_depth(text: str) -> int:
    """How deep the arrays and objects of the JSON `text` nest (0 for a scalar), counted on the
    text, outside strings; for text that is not JSON, a number that is at least as large as any
    parser would reach before it failed."""
    depth = deepest = 0
    for token in _TOKEN.findall(text):
        if token[0] == '"':
            continue
        if token in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth = max(0, depth - 1)
    return deepest


def too_deep(text: str) -> Optional[str]:
    """Why `text` is refused for its nesting, or None."""
    depth = nesting_depth(text)
    if depth > MAX_JSON_DEPTH:
        return f"JSON nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted"
    return None


def walk(value: Any) -> Iterator[Any]:
    """Every value inside `value` (itself, its keys, items and members), with an explicit stack."""
    stack = [value]
    while stack:
        item = stack.pop()
        yield item
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def encodable(text: str) -> bool:
    """False for a str that cannot be sent back as JSON text (a lone surrogate from "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def all_encodable(value: Any) -> bool:
    """True if every string in `value` (keys included) is valid UTF-8."""
    return all(encodable(item) for item in walk(value) if isinstance(item, str))


def printable(value: Any, limit: int = 60) -> str:
    """A short, always-encodable rendering of client input for an error message (nested values
    are named by their type: their repr could be as deep as the input)."""
    if isinstance(value, (dict, list, tuple)):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'} of {len(value)} items"
    return ascii(value)[:limit]


def reset_problem(arguments: Mapping[str, Any]) -> Optional[str]:
    """Why these reset arguments (as JSON values, before any coercion) are refused, or None.
    The same rule for the WebSocket, HTTP `POST /reset` and the MCP tool: `seed` a JSON integer
    (not a boolean, not a float such as 7.0 or -0.0, not a string such as "7") in [0, 2**63), the
    others strings of at most 255 characters, nothing else."""
    unknown = sorted(set(arguments) - set(RESET_PARAMETERS))
    if unknown:
        names = ", ".join(printable(name, 40) for name in unknown[:8])
        return f"unknown reset parameter(s) {names}; accepted: {', '.join(RESET_PARAMETERS)}"
    seed = arguments.get("seed")
    if seed is not None and not (type(seed) is int and 0 <= seed < 2**63):
        return f"seed must be a non-negative integer below 2**63 (or null), got {printable(seed)}"
    for name in RESET_PARAMETERS[1:]:
        value = arguments.get(name)
        if value is not None and not (isinstance(value, str) and len(value) <= MAX_RESET_STRING and encodable(value)):
            return f"{name} must be a UTF-8 string of at most {MAX_RESET_STRING} characters, got {printable(value)}"
    return None


class RequestError(ValueError):
    """A request the environment cannot serve as asked; the message says what to send instead."""

    status_code = 400


class NoEpisodeError(RequestError):
    status_code = 409


def error_frame(code: str, message: str) -> Dict[str, Any]:
    """An OpenEnv WebSocket error frame."""
    return {"type": "error", "data": {"code": code, "message": message}}
