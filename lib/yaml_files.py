"""Reading the project's YAML files (training configurations, `make reproduce` profiles) safely.

`load_yaml` is PyYAML's safe loader with three refusals, each a one-line `YAMLRefused` that
quotes nothing of unbounded length:

- aliases (`*name`): a few lines of nested aliases expand to gigabytes (a "billion laughs"), and
  no configuration here needs one;
- nesting deeper than `MAX_DEPTH`: a deeply nested file would otherwise end in a RecursionError
  traceback;
- a key given twice in one mapping: PyYAML keeps the later value without a word, so a setting
  changed at the top of a file could be silently undone at its bottom.

Files larger than `MAX_BYTES` are refused before they are parsed.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode

MAX_DEPTH = 32
"""The deepest nesting of mappings and lists a file may have (the project's files use 3)."""
MAX_BYTES = 1_000_000
"""The largest file read [bytes]."""


class YAMLRefused(ValueError):
    """A YAML text this reader will not load: why, in one line."""


class _StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` without aliases, nesting past `MAX_DEPTH` or duplicate keys."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(AliasEvent):
            mark = self.peek_event().start_mark
            raise YAMLRefused(
                f"an alias (*name) at line {mark.line + 1}: aliases are not accepted; write the value out"
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise YAMLRefused(f"nesting deeper than {MAX_DEPTH} levels at line {mark.line + 1}")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, MappingNode):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise YAMLRefused(f"the key {str(key)[:60]!r} appears twice (lines {seen[key]} and {line})")
                    seen[key] = line
                except TypeError:
                    continue  # an unhashable key: the base loader says so
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """The value of the YAML `text`, read with `yaml.safe_load`'s types; `YAMLRefused` for an alias,
    nesting past `MAX_DEPTH`, a duplicate key or a text past `MAX_BYTES`; `yaml.YAMLError` for
    text that is not YAML."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise YAMLRefused(f"the file is larger than {MAX_BYTES:,} bytes")
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
