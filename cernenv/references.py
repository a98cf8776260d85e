"""References: an action parameter may quote a value the observation shows by its name.

A parameter written `"@fit.mass_gev"` stands for the number the observation's `references`
field holds under `fit.mass_gev`; the environment replaces it before the action is validated,
so `{"mass_gev": "@fit.mass_gev"}` and `{"mass_gev": 125.31}` are the same action when the fit
found 125.31 GeV. A numeric reference may be scaled by a plain factor, `"@luminosity.affordable_fb*0.4"`
(40% of it). A reference to a value the observation does not show yet (no fit made, no scan
candidate of that index) refuses the action with what to do. Literal values work as before.

Every value is the one the observation showed before the action, rounded as the observation
rounds it; `REFERENCES` names and describes them all (the action schema, the system prompt and
docs/environment.md read it).
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Dict, Iterable, Mapping, Optional

REFERENCE_PREFIX = "@"

REFERENCES: Dict[str, str] = {
    "scan.best_mass_gev": "best mass of the selected channel's latest bump scan [GeV] (the fit's natural hint)",
    "scan.candidates[i]": "the i-th candidate mass of the last bump scan, from 0 [GeV]",
    "fit.mass_gev": "the latest resonance fit's mass [GeV]",
    "fit.mass_uncertainty_gev": "its total mass uncertainty: the fit's statistical error, combined in quadrature "
    "with the channel's energy-scale uncertainty once systematics are evaluated [GeV]",
    "fit.channel": "the channel the latest fit was made in",
    "significance.mass_gev": "the mass of the latest significance estimate [GeV]",
    "significance.significance_sigma": "its global significance, look-elsewhere effect included [σ]",
    "significance.z_local": "its local significance [σ]",
    "angular.spin": "the best spin of the latest angular measurement",
    "luminosity.booked_fb": "luminosity booked and not yet collected [fb^-1]",
    "luminosity.affordable_fb": "luminosity that can still be booked and collected at the configured beam, "
    "within the cap, keeping back the analysis reserve of budget and time [fb^-1]",
}
"""Every name an action may quote, with what it holds: the observation's `references` field
holds those it can show now (`scan.candidates[0]`, `scan.candidates[1]`, ... one per candidate)."""

_NAME, _INDEX, _FACTOR = r"[a-z_]+\.[a-z_]+", r"[0-9]{1,3}", r"[0-9]{1,3}(?:\.[0-9]{1,6})?"
_PATTERN = re.compile(rf"@(?P<name>{_NAME})(?:\[(?P<index>{_INDEX})\])?(?:\*(?P<factor>{_FACTOR}))?")
_KNOWN = "|".join(
    re.escape(name[: -len("[i]")]) + rf"\[{_INDEX}\]" if name.endswith("[i]") else re.escape(name)
    for name in REFERENCES
)
SCHEMA_PATTERN = rf"^@(?:{_KNOWN})(?:\*{_FACTOR})?$(?!\n)"
"""A reference as the JSON schema publishes it (`reference_json_schema`): one of the names of
`REFERENCES` (an indexed one with its index), in the parser's syntax (`_PATTERN`, whole string), so a
reply held to the schema cannot quote a name that does not exist (a random model held to a pattern of
any name wrote `@colleccollec...` to its token limit). Written as ECMA-262 regular expressions read
it too: no group names, ASCII digits only (`[0-9]`, never `\\d`, which Python's `re` matches in every
script), and `$(?!\\n)` the end of the string for Python's `re` too (its `$` also matches before a
final newline). An index is a number: `[00]` and `[0]` both name the first candidate."""
MAX_FACTOR = 100.0
_ALLOWED_FACTOR = r"(?:0\.[0-9]{0,5}[1-9]|[1-9][0-9]?(?:\.[0-9]{1,6})?|100(?:\.0{1,6})?)"
"""A factor as `_FACTOR` writes it, in (0, `MAX_FACTOR`]: what `resolve_reference` accepts."""
"""The largest scale factor a reference accepts: a request is a share of a shown value, or a few times it."""


def reference_json_schema() -> Dict[str, Any]:
    """JSON schema of a reference, the alternative every parameter accepts to a literal value."""
    return {
        "type": "string",
        "pattern": SCHEMA_PATTERN,
        "description": "A value the observation shows, by name (its `references`): "
        + "; ".join(f"@{name}: {text}" for name, text in REFERENCES.items()),
    }


def shown_reference_pattern(
    shown: Mapping[str, Any], accepts: Optional[Callable[[Any], bool]] = None, scaled: bool = True
) -> Optional[str]:
    """The schema pattern of a reference to one of the values an observation shows now (`shown`, its
    `references` field): each shown name exactly (`@scan.candidates[2]`, not any index), a numeric one
    optionally scaled (`*factor`, which `resolve_reference` refuses on a text value); None when it
    shows none. What `SCHEMA_PATTERN` admits and the environment would refuse anyway ("refers to
    nothing the observation shows now", "cannot be scaled") it leaves out. `accepts`: which values the
    parameter takes (None: any), the names of the others left out too; `scaled` False: no factor
    (a parameter that takes whole numbers only). Same dialect as `SCHEMA_PATTERN`."""
    shown = {name: value for name, value in shown.items() if accepts is None or accepts(value)}
    numeric = [name for name, value in shown.items() if _number(value) and scaled]
    other = [name for name in shown if name not in numeric]
    branches = []
    if numeric:
        branches.append(f"(?:{'|'.join(re.escape(name) for name in numeric)})(?:\\*{_ALLOWED_FACTOR})?")
    if other:
        branches.append(f"(?:{'|'.join(re.escape(name) for name in other)})")
    return rf"^@(?:{'|'.join(branches)})$(?!\n)" if branches else None


def is_reference(value: Any) -> bool:
    """Whether `value` is written as a reference (a string starting with `@`)."""
    return isinstance(value, str) and value.startswith(REFERENCE_PREFIX)


def _known_name(name: str, index: Optional[str]) -> bool:
    return (f"{name}[i]" if index is not None else name) in REFERENCES


def resolve_reference(text: str, values: Mapping[str, Any]) -> Any:
    """The value `text` (`"@name"`, `"@name[i]"`, `"@name*factor"`) stands for in `values`
    (an observation's `references`); ValueError saying what to write where it names nothing."""
    match = _PATTERN.fullmatch(text)
    if match is None or not _known_name(match["name"], match["index"]):
        raise ValueError(
            f"{text[:60]!r} is not a reference; write one of "
            + ", ".join(f"@{name}" for name in REFERENCES)
            + " (optionally *factor, e.g. @luminosity.affordable_fb*0.5)"
        )
    key = match["name"] + (f"[{int(match['index'])}]" if match["index"] is not None else "")
    if key not in values:
        shown = ", ".join(f"@{name}" for name in values) or "none yet"
        raise ValueError(f"@{key} refers to nothing the observation shows now (references shown: {shown})")
    value = values[key]
    if match["factor"] is None:
        return value
    factor = float(match["factor"])
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"@{key} is {value!r}, not a number: it cannot be scaled")
    if not 0.0 < factor <= MAX_FACTOR:
        raise ValueError(f"the factor of {text!r} must be in (0, {MAX_FACTOR:g}]")
    return float(value) * factor


def resolve_parameters(parameters: Mapping[str, Any], values: Mapping[str, Any]) -> Dict[str, Any]:
    """`parameters` with every reference (a value, or an element of a list value) replaced by what
    it stands for; ValueError naming the parameter where a reference names nothing."""
    resolved: Dict[str, Any] = {}
    for name, value in parameters.items():
        try:
            if is_reference(value):
                resolved[name] = resolve_reference(value, values)
            elif isinstance(value, list) and any(is_reference(item) for item in value):
                resolved[name] = [resolve_reference(item, values) if is_reference(item) else item for item in value]
            else:
                resolved[name] = value
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    return resolved


def has_references(parameters: Mapping[str, Any]) -> bool:
    """Whether any parameter (or an element of a list parameter) is written as a reference."""
    return any(
        is_reference(value) or (isinstance(value, list) and any(is_reference(item) for item in value))
        for value in parameters.values()
    )


def observation_references(
    logbook: Mapping[str, Mapping[str, Any]],
    selected_channel: Optional[str],
    candidates_gev: Iterable[float],
    *,
    booked_fb: float,
    affordable_fb: Optional[float],
) -> Dict[str, Any]:
    """The values an action may quote now, by name, from what the observation shows: the logbook's
    latest results, the last scan's candidates and the luminosity left to book (`booked_fb` and
    `affordable_fb` exactly, so that collecting all that is booked leaves nothing booked)."""
    values: Dict[str, Any] = {}
    scan = logbook.get(f"scan_bump/{selected_channel}") if selected_channel else None
    if scan and _finite(scan.get("best_mass_gev")):
        values["scan.best_mass_gev"] = scan["best_mass_gev"]
    for index, mass in enumerate(candidates_gev):
        values[f"scan.candidates[{index}]"] = mass
    fit = logbook.get("fit_resonance")
    if fit and _finite(fit.get("mass_gev")):
        values["fit.mass_gev"] = fit["mass_gev"]
        uncertainty = total_mass_uncertainty(fit, logbook.get("request_systematics"))
        if uncertainty is not None:
            values["fit.mass_uncertainty_gev"] = uncertainty
        values["fit.channel"] = fit.get("channel")
    significance = logbook.get("estimate_significance")
    if significance:
        values["significance.mass_gev"] = significance.get("mass_gev")
        values["significance.significance_sigma"] = max(0.0, float(significance.get("z_global") or 0.0))
        values["significance.z_local"] = significance.get("z_local")
    angular = logbook.get("measure_angular")
    if angular and angular.get("best_spin") is not None:
        values["angular.spin"] = angular["best_spin"]
    if booked_fb > 0:
        values["luminosity.booked_fb"] = booked_fb
    if affordable_fb is not None:
        values["luminosity.affordable_fb"] = affordable_fb
    return {name: value for name, value in values.items() if value is not None}


def total_mass_uncertainty(
    fit: Mapping[str, Any], systematics: Optional[Mapping[str, Any]], digits: int = 3
) -> Optional[float]:
    """The fit's mass error [GeV] combined in quadrature with the energy-scale uncertainty of its
    channel (fractional × mass) when systematics were evaluated for that channel; None without an error."""
    error, mass = fit.get("mass_err_gev"), fit.get("mass_gev")
    if not _finite(error) or not _finite(mass) or error <= 0:
        return None
    scale = 0.0
    if systematics and systematics.get("channel") == fit.get("channel"):
        scale = float(systematics.get("energy_scale_frac") or 0.0) * float(mass)
    total = math.hypot(float(error), scale)
    return round(total, digits - 1 - math.floor(math.log10(total)))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
