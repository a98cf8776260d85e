"""Which optional part of the install (pyproject.toml's extras) a module of `lib` needs.

`pip install .` installs the environment (`cernenv`) and its dependencies only; `lib`'s learning
side needs more, in named extras: `plot` (matplotlib, mplhep), `notebooks` (papermill, nbconvert,
ipykernel, ipywidgets, and plot), `train` (torch, transformers, TRL, PEFT, accelerate, datasets,
TensorBoard, llguidance for replies held to the action grammar), `lab` (JupyterLab),
`all`. `make setup` installs them all (requirements.txt).
`require` turns a missing one into an error that names the extra to install.
"""

from __future__ import annotations

import importlib.util
from typing import Sequence

EXTRAS = {
    "plot": ("matplotlib", "mplhep"),
    "notebooks": ("papermill", "nbconvert", "nbclient", "nbformat", "ipykernel", "ipywidgets", "matplotlib"),
    "train": ("torch", "transformers", "trl", "peft", "accelerate", "datasets"),
}
"""The modules each extra brings that `lib` imports."""


def missing_modules(modules: Sequence[str]) -> list:
    """Those of `modules` that cannot be imported here (found without importing them)."""
    return [name for name in modules if importlib.util.find_spec(name) is None]


def require(extra: str, what: str) -> None:
    """Raise ModuleNotFoundError naming `extra` when one of its modules is missing; `what` is the
    part of the project that needs it ("training", "the notebooks' headless runs", ...)."""
    missing = missing_modules(EXTRAS[extra])
    if missing:
        raise ModuleNotFoundError(
            f"{what} needs {', '.join(missing)}, which the {extra!r} extra installs: "
            f"pip install -e '.[{extra}]' in a checkout (pip install 'cernenv[{extra}]'), or `make setup`",
            name=missing[0],
        )
