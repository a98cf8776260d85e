"""The learning side of CERNenv Lab, in floors that import only downwards (docs/layout.md):
plumbing here (files, progress, extras, runtime, gpu_set), then agents, episodes, measure,
report, training and notebooks.

Importing it checks that this Python has the project installed (`BASE_MODULES`): under another
Python (a system `python3` beside the project's `.venv`), `python -m lib.<command>` says so in one
line instead of a traceback about the first module it lacks."""

import importlib.util as _importlib_util
import sys as _sys

BASE_MODULES = ("openenv", "pydantic", "numpy", "scipy", "iminuit", "numba", "yaml", "tqdm")
"""What every part of `lib` needs (the environment's dependencies, and tqdm for progress)."""

_missing = [name for name in BASE_MODULES if _importlib_util.find_spec(name) is None]
if _missing:
    _message = (
        f"this Python ({_sys.executable}) lacks {', '.join(_missing)}: it is not the project's. Run "
        "`make setup`, then use .venv/bin/python (or `source .venv/bin/activate` once), or "
        "pip install -e '.[all]' into this one"
    )
    if _sys.argv[:1] == ["-m"]:  # `python -m lib.X`, before X runs: one line, no traceback
        print(f"error: {_message}", file=_sys.stderr)
        raise SystemExit(1)
    raise ModuleNotFoundError(_message, name=_missing[0])
