"""`make lab`: JupyterLab starts on the notebooks with the project's kernel and the widget manager."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "cernenv-lab-test"


def _get(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}?token={TOKEN}", timeout=10) as response:
        return json.loads(response.read().decode())


@pytest.mark.slow
def test_jupyterlab_serves_the_notebooks_with_the_venvs_python3_kernel_and_widgets(tmp_path):
    pytest.importorskip("jupyterlab", reason="requirements.txt installs JupyterLab (make setup)")
    port = free_port()
    env = {
        **os.environ,
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
    }
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={TOKEN}",
            "--notebook-dir",
            str(ROOT / "notebooks"),
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],  # as `make lab` does
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                specs = _get(port, "/api/kernelspecs")
                break
            except (urllib.error.URLError, ConnectionError):
                assert process.poll() is None, process.stderr.read().decode()[-3000:]
                assert time.monotonic() < deadline, "JupyterLab did not answer within 120 s"
                time.sleep(0.5)
        # the notebooks' kernel, python3 (Colab's name too), is the venv's own Python
        spec = specs["kernelspecs"]["python3"]["spec"]
        assert Path(spec["argv"][0]).resolve() == Path(sys.executable).resolve(), spec["argv"]
        assert specs["default"] == "python3"
        contents = {item["name"] for item in _get(port, "/api/contents")["content"]}
        assert {"01_explore_environment.ipynb", "03_train_grpo.ipynb"} <= contents
        extensions = {item["name"] for item in _get(port, "/lab/api/extensions")}
        assert any("jupyterlab-manager" in name for name in extensions), sorted(extensions)  # ipywidgets
    finally:
        process.terminate()
        process.wait(timeout=30)
