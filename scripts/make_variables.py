"""Name the variables given to `make` on its command line that look like one of the Makefile's but
are not (`make reproduce PROFIL=smoke`, which would otherwise run the full profile without a word),
each with the one meant; print nothing for the Makefile's own and for names unlike any of them
(`CUDA_VISIBLE_DEVICES=0`, which reaches the commands' environment).

    python3 scripts/make_variables.py Makefile NAME...    # the Makefile stops with what it prints

The Makefile's variables are those it defines (`NAME ?= ...`, `NAME := ...`) or reads (`$(NAME)`).
Standard library only: it runs before `make setup` has made the venv.
"""

from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

DEFINED = re.compile(r"^\s*(?:export\s+|override\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*(?:\?|::|:|\+|!)?=", re.MULTILINE)
READ = re.compile(r"\$[({]([A-Za-z_][A-Za-z0-9_]*)[)}]")
CLOSE = 0.75
"""How alike (difflib's ratio, upper case) a name must be to a Makefile variable to be taken for a misspelling."""


def makefile_variables(text: str) -> set[str]:
    """The variables a Makefile defines or reads."""
    return set(DEFINED.findall(text)) | set(READ.findall(text))


def misspelt(given: list[str], known: set[str]) -> list[str]:
    """One message for each of `given` that is not in `known` but close to one of them."""
    messages = []
    for name in given:
        if name in known:
            continue
        close = difflib.get_close_matches(name.upper(), sorted(known), n=1, cutoff=CLOSE)
        if close:
            messages.append(f"{name} is not a variable of this Makefile: did you mean {close[0]}?")
    return messages


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: make_variables.py MAKEFILE [NAME...]", file=sys.stderr)
        return 2
    messages = misspelt(argv[1:], makefile_variables(Path(argv[0]).read_text()))
    if messages:
        print("; ".join(messages) + " (make's variables are case-sensitive; nothing was run)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
