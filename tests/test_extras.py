"""Light installs: the environment alone needs no training, notebook or plotting stack, and a part of
lib/ whose extra is missing says which extra to install (lib/extras.py, pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from lib.extras import EXTRAS, require

ROOT = Path(__file__).resolve().parents[1]
BLOCK = (
    "import sys\n"
    "class Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in {blocked!r}:\n"
    "            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)\n"
    "sys.meta_path.insert(0, Block())\n"
    "import importlib.util\n"
    "real = importlib.util.find_spec\n"
    "importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] in {blocked!r} else real(name, *a)\n"
)


def _run(blocked, code):
    return subprocess.run(
        [sys.executable, "-c", BLOCK.format(blocked=set(blocked)) + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_extras_hold_what_lib_asks_for():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for extra, modules in EXTRAS.items():
        declared = " ".join(extras[extra]) + (
            " " + " ".join(extras["plot"]) if "cernenv[plot]" in extras[extra] else ""
        )
        assert all(module in declared for module in modules), (extra, modules, declared)
    heavy = ("torch", "transformers", "trl", "matplotlib", "papermill", "ipywidgets", "jupyterlab")
    assert not [d for d in dependencies if d.split(">")[0].split("=")[0] in heavy], "the environment alone"


@pytest.mark.parametrize(
    "blocked, code, extra",
    [
        (["matplotlib"], "import lib.report.plotting", "plot"),
        (["ipywidgets"], "import lib.report.browser", "notebooks"),
        (["torch"], "from lib.training import TrainConfig, train\ntrain(TrainConfig())", "train"),
    ],
)
def test_a_missing_extra_is_named(blocked, code, extra):
    result = _run(blocked, code)
    assert result.returncode != 0
    assert f"pip install -e '.[{extra}]'" in result.stderr.splitlines()[-1], result.stderr[-1500:]


def test_the_command_line_names_the_extra_in_one_line_and_its_help_needs_none():
    run = "from lib.training.__main__ import main\nmain({argv!r})\n"
    refused = _run(["torch", "transformers", "trl"], run.format(argv=["--config", "configs/train/smoke.yaml"]))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().endswith("or `make setup`") and "'train' extra" in refused.stderr
    helped = _run(["torch", "transformers", "trl"], run.format(argv=["--help"]))
    assert helped.returncode == 0 and "--max_steps INT" in helped.stdout


def test_require_passes_when_everything_is_there():
    require("train", "training")
    with pytest.raises(ModuleNotFoundError, match=r"the 'notebooks' extra installs"):
        EXTRAS["notebooks"] = EXTRAS["notebooks"] + ("no_such_module_here",)
        try:
            require("notebooks", "the notebooks")
        finally:
            EXTRAS["notebooks"] = EXTRAS["notebooks"][:-1]


def test_a_lib_command_under_a_python_without_the_project_says_so_in_one_line():
    """`python -m lib.<command>` under a Python that lacks the project's modules (a system python3
    beside the venv; here the venv's Python without its site-packages, `-S`) prints one line naming
    what is missing and what to run, not a traceback."""
    for command in ("lib.training", "lib.measure.scorecard", "lib.notebooks.reproduce"):
        run = subprocess.run(
            [sys.executable, "-S", "-m", command, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-1500:]
        assert run.stderr.strip().count("\n") == 0 and "lacks openenv" in run.stderr and "make setup" in run.stderr
