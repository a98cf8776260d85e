"""What `import cernenv` pulls in: no machine-learning library, not OpenEnv's server stack
(FastAPI, the MCP server) until a server or client is made, and OpenEnv's Gradio web UI only when
it is asked for (cernenv/_deferred_imports.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, os, sys
import cernenv
heavy = ("gradio", "torch", "transformers", "lib", "fastapi", "mcp", "fastmcp")
loaded = {name: name in sys.modules for name in heavy}
env = cernenv.CERNCollisionEnvironment()
env.reset(seed=1)
loaded_after_a_reset = {name: name in sys.modules for name in heavy}
from cernenv.server import ServerConfig, create_cernenv_app
os.environ["ENABLE_WEB_INTERFACE"] = "true"  # asked for after start-up: the UI still comes
routes = {getattr(route, "path", "") for route in create_cernenv_app(ServerConfig()).router.routes}
print(json.dumps({
    "loaded": loaded,
    "loaded_after_a_reset": loaded_after_a_reset,
    "gradio_with_the_app": "gradio" in sys.modules,
    "web_routes": sorted(r for r in routes if r.startswith("/web")),
}))
"""


def _probe(**env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if k != "ENABLE_WEB_INTERFACE"}
    environment.update(**env)
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_import_cernenv_loads_no_ml_library_no_server_stack_and_no_web_ui_until_asked():
    probe = _probe()
    assert not any(probe["loaded"].values()), probe["loaded"]
    assert not any(probe["loaded_after_a_reset"].values()), probe["loaded_after_a_reset"]
    assert "/web" in probe["web_routes"] and "/web/step" in probe["web_routes"]


@pytest.mark.slow
def test_the_web_ui_asked_for_at_start_up_comes_with_the_app():
    probe = _probe(ENABLE_WEB_INTERFACE="true")
    assert probe["gradio_with_the_app"] is True and "/web" in probe["web_routes"]


LAZY_PROBE = """
import json, sys
from cernenv import CERNCollisionEnvironment, ExperimentAction
def physics():
    return sorted(
        name for name in sys.modules
        if name.split(".")[0] in ("numba", "llvmlite", "iminuit")
        or name.startswith("scipy.optimize")
        or name in ("cernenv.analysis", "cernenv.physics.portable", "cernenv.physics.kernels")
    )
at_import = physics()
env = CERNCollisionEnvironment()
env.reset(seed=3, difficulty="easy")  # a procedural campaign: its mass bands take the portable logarithm
print(json.dumps({"at_import": at_import, "after_a_reset": physics()}))
"""


def test_import_cernenv_loads_neither_the_compiled_kernels_nor_scipys_optimiser():
    """`import cernenv` took 2.7-4.8 s, most of it numba's kernels (loaded from its cache) and
    scipy.optimize, which an OpenEnv user paid before the first reset: they load when a reset or a
    step first computes with them. The probe sees them once a procedural campaign is drawn."""
    result = subprocess.run([sys.executable, "-c", LAZY_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["at_import"] == [], probe["at_import"]
    assert "numba" in probe["after_a_reset"] and "cernenv.physics.portable" in probe["after_a_reset"]


def test_lib_is_reached_through_the_install_alone(tmp_path):
    """One way to reach lib/: the editable install (`make setup`, the Colab cell). From a folder
    outside the repository, with no PYTHONPATH, lib is this checkout's; and nothing in the
    Makefile, pyproject, notebooks, scripts or benchmarks puts the repository on the path."""
    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", "import lib, cernenv; print(lib.__file__); print(cernenv.__file__)"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert [Path(line).parent.parent for line in result.stdout.split()] == [ROOT, ROOT]
    workarounds = ("sys.path.insert", "sys.path.append", "PYTHONPATH=", "pythonpath =")
    files = [
        ROOT / "Makefile",
        ROOT / "pyproject.toml",
        *(ROOT / "notebooks").glob("*.ipynb"),
        *(ROOT / "bench").glob("*.py"),
        *(ROOT / "scripts").glob("*.py"),
        *(ROOT / "lib").rglob("*.py"),
    ]
    offenders = [
        f"{path.relative_to(ROOT)}: {marker}" for path in files for marker in workarounds if marker in path.read_text()
    ]
    assert not offenders, offenders


NOTICE_PROBE = """
import cernenv.physics.portable as portable
import numpy as np
portable.exp(np.zeros(3))
print(portable.COMPILING_NOTICE)
"""


@pytest.mark.slow
def test_the_first_compilation_of_the_physics_kernels_is_said_once_and_a_cached_load_is_not(tmp_path):
    """The first episode after `pip install .` took 75 s without a word while numba compiled the
    kernels: a process that compiles them says so once, on stderr; one that loads them from numba's
    cache says nothing."""
    environment = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}  # an empty cache: it compiles

    def run():
        result = subprocess.run(
            [sys.executable, "-c", NOTICE_PROBE], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout.strip().splitlines()[-1], result.stderr

    notice, first = run()
    assert "compiling the physics kernels once" in notice and first.count(notice) == 1, first
    _, cached = run()
    assert notice not in cached, cached
