"""Run the notebooks headlessly, in order, with papermill (`make reproduce`).

A profile is a YAML file in `configs/` that lists the notebooks to run, in order, each
with the values for its `parameters` cell:

    notebooks:
      02_baseline_rollouts:
        MAX_EPISODES: 4

`full` (the default) regenerates the committed evidence: baselines, GRPO training (its
warm start is built once and cached), the analysis. `smoke` runs every notebook with
small numbers and writes its artifacts under `build/smoke/`, never over `evidence/`.

Each profile's executed notebooks go to a folder of its own, `build/PROFILE/NAME.ipynb`, with
`build/PROFILE/run.json`: which commit (and whether the tree had uncommitted changes) ran each
notebook, and when. `make report` labels every page with it. A notebook that fails stops
the run: papermill has then written the executed copy with the failing cell marked, and the
message names the cell and the error, and the command that reruns it.

    python -m lib.reproduce [--profile full|smoke|PATH.yaml] [--only NAME ...] [--build-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import yaml

from lib.files import write_json

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS_DIR = ROOT / "notebooks"
CONFIGS_DIR = ROOT / "configs"
BUILD_DIR = ROOT / "build"
DEFAULT_KERNEL = "cernenv"
RUN_RECORD = "run.json"
"""In each profile's build folder: the profile, and per notebook the commit that ran it and when."""


class ReproduceError(RuntimeError):
    """A profile that cannot be run, or a notebook that failed; the message says what to do."""


def profile_path(profile: str) -> Path:
    """`configs/PROFILE.yaml`, or `profile` itself when it is a path to a YAML file."""
    candidate = Path(profile)
    if candidate.suffix in (".yaml", ".yml"):
        path = candidate if candidate.is_absolute() else Path.cwd() / candidate
    else:
        path = CONFIGS_DIR / f"{profile}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
        raise ReproduceError(
            f"no profile {profile!r} ({path} does not exist); choose one of {known} or give a path to a YAML file"
        )
    return path


def load_profile(profile: str) -> Dict[str, Dict[str, Any]]:
    """The notebooks of `profile`, in order, each with its parameters (checked against the notebook)."""
    import papermill

    path = profile_path(profile)
    data = yaml.safe_load(path.read_text()) or {}
    notebooks = data.get("notebooks") if isinstance(data, Mapping) else None
    if not isinstance(notebooks, Mapping) or not notebooks:
        raise ReproduceError(f"{path}: expected a mapping `notebooks:` of notebook name → parameters")
    plan: Dict[str, Dict[str, Any]] = {}
    for name, parameters in notebooks.items():
        notebook = NOTEBOOKS_DIR / f"{name}.ipynb"
        if not notebook.is_file():
            raise ReproduceError(f"{path}: notebook {name!r} not found ({notebook})")
        parameters = dict(parameters or {})
        known = set(papermill.inspect_notebook(str(notebook)))
        unknown = sorted(set(parameters) - known)
        if unknown:
            raise ReproduceError(
                f"{path}: {name} has no parameter(s) {unknown}; its parameters cell defines {sorted(known)}"
            )
        plan[str(name)] = parameters
    return plan


def profile_name(profile: str) -> str:
    """The name a profile's folders use: `smoke` for configs/smoke.yaml or a path to smoke.yaml."""
    return Path(profile).stem if Path(profile).suffix in (".yaml", ".yml") else profile


def profile_build_dir(profile: str) -> Path:
    """Where `profile`'s executed notebooks go: build/PROFILE/."""
    return BUILD_DIR / profile_name(profile)


def source_revision() -> Dict[str, Any]:
    """The checkout's commit and whether its source has uncommitted changes (outside evidence/ and
    reports/, which the notebooks write; None when git cannot tell)."""

    def git(*args: str) -> Optional[str]:
        try:
            return subprocess.run(
                ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True, timeout=30
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    # what the notebooks write (evidence/, reports/) is their product, not a change to the source
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!evidence", ":!reports")
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def record_run(build_dir: Path, profile: str, notebook: str, seconds: float) -> None:
    """Add `notebook`'s run (commit, time) to `build_dir/run.json`."""
    path = build_dir / RUN_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        record = {}
    record["profile"] = profile_name(profile)
    record.setdefault("notebooks", {})[notebook] = {
        **source_revision(),
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
    }
    write_json(path, record, indent=1)


def default_kernel_name() -> str:
    """The Jupyter kernel notebooks run on: the venv's `cernenv` (`make setup` installs it), else `python3`."""
    from jupyter_client.kernelspec import KernelSpecManager

    return DEFAULT_KERNEL if DEFAULT_KERNEL in KernelSpecManager().find_kernel_specs() else "python3"


def run_notebook(
    name: str,
    parameters: Mapping[str, Any],
    *,
    build_dir: Optional[Path] = None,
    kernel_name: Optional[str] = None,
    profile: str = "full",
    show_progress: bool = False,
) -> Path:
    """Execute `notebooks/NAME.ipynb` with `parameters` into `build_dir/NAME.ipynb` (default
    build/PROFILE/). `show_progress`: a bar over the notebook's cells, and every line the
    notebook prints (training logs and progress bars included) echoed to this process's stderr."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    build_dir = Path(build_dir or profile_build_dir(profile))
    build_dir.mkdir(parents=True, exist_ok=True)
    output = build_dir / f"{name}.ipynb"
    try:
        papermill.execute_notebook(
            str(NOTEBOOKS_DIR / f"{name}.ipynb"),
            str(output),
            parameters=dict(parameters),
            kernel_name=kernel_name or default_kernel_name(),
            cwd=str(NOTEBOOKS_DIR),
            progress_bar=show_progress,
            log_output=show_progress,
        )
    except PapermillExecutionError as error:
        raise ReproduceError(
            f"{name} failed in cell {error.exec_count}: {error.ename}: {error.evalue}\n"
            f"The executed notebook, with the failing cell marked, is {output}; open it to see the traceback. "
            f"Rerun this notebook alone with `make reproduce PROFILE={profile_name(profile)} ONLY={name}`."
        ) from error
    return output


def reproduce(
    profile: str = "full", only: Sequence[str] = (), build_dir: Optional[Path] = None, show_progress: bool = False
) -> List[Path]:
    """Run the profile's notebooks in order (or just those in `only`); returns the executed copies."""
    plan = load_profile(profile)
    missing = sorted(set(only) - set(plan))
    if missing:
        raise ReproduceError(f"{missing} not in profile {profile!r}, which runs {list(plan)}")
    outputs = []
    for name, parameters in plan.items():
        if only and name not in only:
            continue
        start = time.perf_counter()
        print(f"== {name} ({profile}) …", flush=True)
        outputs.append(
            run_notebook(name, parameters, build_dir=build_dir, profile=profile, show_progress=show_progress)
        )
        record_run(outputs[-1].parent, profile, name, time.perf_counter() - start)
        print(f"== {name}: done in {time.perf_counter() - start:.0f} s → {outputs[-1]}", flush=True)
    return outputs


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="full", help="configs/NAME.yaml, or a path to a YAML file")
    parser.add_argument("--only", nargs="*", default=(), help="run just these notebooks of the profile")
    parser.add_argument(
        "--build-dir", type=Path, default=None, help="where the executed notebooks go (default build/PROFILE/)"
    )
    parser.add_argument("--quiet", action="store_true", help="print only a line per notebook, not its output")
    args = parser.parse_args(argv)
    if not args.quiet:  # papermill logs each line a notebook prints at INFO
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
        for noisy in ("traitlets", "asyncio"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        reproduce(args.profile, args.only, build_dir=args.build_dir, show_progress=not args.quiet)
    except ReproduceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
