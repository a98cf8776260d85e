"""What the leak tests look for: the hidden truth's numbers as they could be written in a frame.

Shared by tests/test_environment.py (in process) and tests/test_server.py (over the wire).
Random identifiers are blanked first: a UUID such as ``...-f120-...`` is not a leaked width.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List

# A number not inside a longer number: "120" matches in "width 120 GeV" but not in "1205" or "3.120".
NUMBER_BOUNDARY = r"(?<![\d.])%s(?!\.?\d)"
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.IGNORECASE)


def truth_patterns(truth: Dict[str, Any]) -> List[re.Pattern]:
    """The true mass, width and cross-section written the ways they could appear in JSON."""
    texts = set()
    for value in (truth["mass_gev"], truth["width_gev"], truth["cross_section_fb"]):
        if not value:
            continue
        value = float(value)
        texts.add(repr(value))
        for digits in (4, 5, 6):
            rounded = f"{value:.{digits}g}"
            texts.update({rounded, repr(float(rounded))})
    return [re.compile(NUMBER_BOUNDARY % re.escape(text)) for text in texts]


def blank_random_ids(text: str) -> str:
    """The text with every UUID (episode ids are random ones) replaced by a fixed placeholder."""
    return _UUID.sub("<uuid>", text)


def leaked_truth(text: str, truth: Dict[str, Any]) -> List[str]:
    """The truth patterns found in ``text`` once its random ids are blanked (empty: no leak)."""
    text = blank_random_ids(text)
    return [p.pattern for p in truth_patterns(truth) if p.search(text)]
