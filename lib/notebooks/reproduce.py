"""Run the notebooks headlessly, in order, with papermill (`make reproduce`).

A profile is a YAML file in `configs/` that lists the notebooks to run, in order, each
with the values for its `parameters` cell:

    notebooks:
      02_baseline_rollouts:
        MAX_EPISODES: 4

`smoke` runs every notebook with small numbers in minutes; `full` (the default) is the run
that regenerates the evidence: baselines, GRPO training (its warm start is built once and
cached), the analysis; `evidence` runs notebook 04 alone on the committed `evidence/`. Every
profile writes under `build/` only: the full run's evidence goes to `build/full/evidence/`, and
`promote_evidence` (`make promote-evidence`) copies a complete full run's evidence over the
git-tracked `evidence/` in one explicit step, so a run that fails or is stopped halfway never
leaves `evidence/` half replaced, and the change can be looked at before it is made.

A profile is checked whole before anything runs (`load_profile`): notebook names, parameter
names and values (a parameter's type is its default's; counts `N_*` and `MAX_*` at least 1;
notebook 03's as the `TrainConfig` they make), the folders they write. Each error is one line
(`ReproduceError`) that says what to do.

Each profile's executed notebooks go to a folder of its own, `build/PROFILE/NAME.ipynb`, with
`build/PROFILE/run.json`: which commit (and whether the tree had uncommitted changes) ran each
notebook, and when. `make report` labels every page with it. The run prints one progress line
per notebook (a bar over its cells in a terminal) and the warnings that matter from its output
(`notable_warnings`); `--verbose` echoes everything the notebooks print. The kernels run with
`CERNENV_HEADLESS=1` (`lib.progress`: progress as log lines, not widgets nobody sees). A
notebook that fails stops the run: papermill has then written the executed copy with the
failing cell marked, and the message names the cell and the error, and the command that
reruns it.

    python -m lib.notebooks.reproduce [--profile full|smoke|evidence|PATH.yaml] [--only NAME ...]
                                      [--build-dir DIR] [--verbose]
    python -m lib.notebooks.reproduce --promote [--build-dir build/full]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import difflib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from lib.extras import require
from lib.files import atomic_write, check_writable_dir, read_json, write_json
from lib.progress import METER_LINE
from lib.yaml_files import YAMLRefused, load_yaml

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS_DIR = ROOT / "notebooks"
CONFIGS_DIR = ROOT / "configs"
BUILD_DIR = ROOT / "build"
EVIDENCE_DIR = ROOT / "evidence"
REPORTS_DIR = ROOT / "reports"
DEFAULT_KERNEL = "python3"
"""The notebooks' kernel: Colab's name, and the venv's kernel locally (`make setup` registers it
under this name inside the venv, where Jupyter looks first)."""
RUN_RECORD = "run.json"
"""In each profile's build folder: the profile, and per notebook the commit that ran it and when."""
TRAIN_NOTEBOOK = "03_train_grpo"
TRAIN_CONFIG_PARAMETER = "TRAIN_CONFIG"
"""Notebook 03's parameter naming a configs/train/*.yaml file (its other parameters are TrainConfig fields)."""
WRITTEN_FOLDERS = {"02_baseline_rollouts": ("EVIDENCE_DIR",)}
"""Parameters naming a folder a notebook writes (notebook 03's are its TrainConfig's evidence_dir and
output_dir): checked writable before any notebook runs."""
KERNEL_ENVIRONMENT = {
    "CERNENV_HEADLESS": "1",  # lib.progress: log lines, not widgets nobody watches
    "TRL_EXPERIMENTAL_SILENCE": "1",  # TRL's notice on importing trl.experimental, once per process
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' and the Hub's bars (loading weights, writing shards)
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",  # libraries' notices to developers
}
"""Set for the kernels `make reproduce` starts."""
KERNEL_ARGUMENTS = ["--IPKernelApp.log_level=ERROR"]
"""ipykernel's start-up warning ("Kernel is running over TCP without encryption", on a local socket) left out."""
NOISE = (
    re.compile(r"FutureWarning|DeprecationWarning|TRLExperimentalWarning|trl\.experimental"),
    re.compile(r"running over TCP without encryption"),
    re.compile(r"findfont: "),
    re.compile(r"^\s*warnings\.warn\("),
)
"""Output lines that are not worth a user's attention in a reproduce run's summary."""
PROMOTED_REQUIRED = (
    "baselines.json",
    "baselines.md",
    "pre_eval.jsonl.gz",
    "post_eval.jsonl.gz",
    "before_after_metrics.json",
    "training_log.csv",
)
"""What a full run's evidence must hold before `promote_evidence` copies it over evidence/."""


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
        close = difflib.get_close_matches(str(profile), known, n=1)
        guess = f"did you mean PROFILE={close[0]}? " if close else ""
        raise ReproduceError(
            f"no profile {str(profile)[:80]!r} ({str(path)[:120]} does not exist); {guess}choose one of {known} "
            "or give a path to a YAML file"
        )
    return path


def _literal(source: str) -> Any:
    """A parameters cell's default, as a value (None where it is an expression, not a literal)."""
    try:
        return ast.literal_eval(source)
    except (ValueError, SyntaxError):
        return None


def check_parameter(path: Path, notebook: str, name: str, value: Any, default_source: str) -> Optional[str]:
    """What is wrong with `value` for a notebook parameter whose default is `default_source` (None
    when it is fine): the default's type (an int where a float is; anything where the default is
    None, `...` or an expression), and counts (`N_*`, `MAX_*`) at least 1."""
    default = _literal(default_source)
    where = f"{path}: {notebook}'s {name}"
    if name.startswith(("N_", "MAX_")) and value is not None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{where} must be a whole number of at least 1 (or None where its default is), got {value!r}"
        return None
    if default is None or default is Ellipsis:  # None, an expression, or `...` (notebook 03: the file's value)
        return None
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        return f"{where} must be {type(default).__name__} like its default {default_source}, got {value!r}"
    return None


def _check_training(path: Path, parameters: Mapping[str, Any]) -> None:
    """Notebook 03's parameters as the `TrainConfig` the notebook will make (on a CPU)."""
    from lib.training.cli import ConfigError, _one_line, notebook_config

    train_config = parameters.get(TRAIN_CONFIG_PARAMETER)
    if train_config is not None and not isinstance(train_config, str):
        raise ReproduceError(
            f"{path}: {TRAIN_NOTEBOOK}'s {TRAIN_CONFIG_PARAMETER} must be a file path, got {train_config!r}"
        )
    try:
        notebook_config(dict(parameters), train_config, root=ROOT, gpu=False)
    except (ConfigError, ValueError) as error:
        raise ReproduceError(f"{path}: {TRAIN_NOTEBOOK}: {_one_line(error)}") from None


def load_profile(profile: str) -> Dict[str, Dict[str, Any]]:
    """The notebooks of `profile`, in order, each with its parameters, checked (see the module
    docstring); a `ReproduceError` of one line for the first problem."""
    try:
        require("notebooks", "running the notebooks headlessly")
    except ModuleNotFoundError as error:
        raise ReproduceError(str(error)) from None
    import papermill

    path = profile_path(profile)
    try:
        data = load_yaml(path.read_text()) or {}
    except YAMLRefused as error:
        raise ReproduceError(f"{path} is refused: {error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ReproduceError(f"{path} is not valid YAML{where}: {getattr(error, 'problem', None) or error}") from None
    except OSError as error:
        raise ReproduceError(f"{path} cannot be read: {error}") from None
    notebooks = data.get("notebooks") if isinstance(data, Mapping) else None
    if not isinstance(notebooks, Mapping) or not notebooks:
        raise ReproduceError(f"{path}: expected a mapping `notebooks:` of notebook name → parameters")
    unknown_keys = sorted(set(data) - {"notebooks"})
    if unknown_keys:
        raise ReproduceError(f"{path}: unknown top-level key(s) {unknown_keys}; a profile holds `notebooks:` only")
    plan: Dict[str, Dict[str, Any]] = {}
    for name, parameters in notebooks.items():
        notebook = NOTEBOOKS_DIR / f"{name}.ipynb"
        if not notebook.is_file():
            raise ReproduceError(f"{path}: notebook {name!r} not found ({notebook})")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise ReproduceError(f"{path}: {name}'s parameters must be a mapping of name → value, got {parameters!r}")
        parameters = dict(parameters or {})
        declared = papermill.inspect_notebook(str(notebook))
        unknown = sorted(set(parameters) - set(declared))
        if unknown:
            raise ReproduceError(
                f"{path}: {name} has no parameter(s) {unknown}; its parameters cell defines {sorted(declared)}"
            )
        for key, value in parameters.items():
            problem = check_parameter(path, str(name), key, value, declared[key]["default"])
            if problem:
                raise ReproduceError(problem)
        if name == TRAIN_NOTEBOOK:
            _check_training(path, parameters)
        plan[str(name)] = parameters
    return plan


def profile_name(profile: str) -> str:
    """The name a profile's folders use: `smoke` for configs/smoke.yaml or a path to smoke.yaml."""
    return Path(profile).stem if Path(profile).suffix in (".yaml", ".yml") else profile


def profile_build_dir(profile: str) -> Path:
    """Where `profile`'s executed notebooks go: build/PROFILE/."""
    return BUILD_DIR / profile_name(profile)


def training_config(parameters: Mapping[str, Any]) -> Any:
    """The `TrainConfig` notebook 03 makes of its profile `parameters` (on a CPU)."""
    from lib.training.cli import notebook_config

    return notebook_config(dict(parameters), parameters.get(TRAIN_CONFIG_PARAMETER), root=ROOT, gpu=False)


def written_folders(plan: Mapping[str, Mapping[str, Any]]) -> List[Tuple[str, Path]]:
    """The folders the notebooks of `plan` write (their evidence and output folders), each with the
    parameter that names it ("03_train_grpo's output_dir"), in the order of the plan."""
    written = []
    for name, parameters in plan.items():
        folders = {key: parameters.get(key) for key in WRITTEN_FOLDERS.get(name, ())}
        if name == TRAIN_NOTEBOOK:
            config = training_config(parameters)
            folders = {"evidence_dir": config.evidence_dir, "output_dir": config.output_dir}
        for key, value in folders.items():
            if isinstance(value, str) and value:
                written.append((f"{name}'s {key}", Path(value) if Path(value).is_absolute() else ROOT / value))
    return written


def check_written_folders(plan: Mapping[str, Mapping[str, Any]], build_dir: Path) -> None:
    """Every folder the run writes (its build folder, the notebooks' evidence and output folders),
    writable and not a file, before any notebook runs."""
    try:
        check_writable_dir(build_dir, "build folder")
        for what, folder in written_folders(plan):
            check_writable_dir(folder, what)
    except OSError as error:
        raise ReproduceError(str(error)) from None


def shown_path(path: Path) -> str:
    """`path` from the repository root where it lies under it (as the commands take it), else whole."""
    path = Path(path)
    return str(path.relative_to(ROOT)) if path.is_absolute() and path.is_relative_to(ROOT) else str(path)


def reports_dir(profile: str) -> Path:
    """Where `make report` writes a profile's pages: reports/ for the full run, reports/PROFILE/ for
    the others (the Makefile's `report` target; a test holds the two equal)."""
    name = profile_name(profile)
    return REPORTS_DIR if name == "full" else REPORTS_DIR / name


def reads_committed_evidence(profile: str) -> bool:
    """Whether `profile` runs on the committed evidence alone: none of its notebooks trains or plays
    (notebooks 02 and 03 are not in it) and every one that names an `EVIDENCE_DIR` names evidence/
    (configs/committed.yaml). False for a profile that cannot be loaded."""
    try:
        plan = load_profile(profile)
    except ReproduceError:
        return False
    if TRAIN_NOTEBOOK in plan or any(notebook in plan for notebook in WRITTEN_FOLDERS):
        return False
    folders = [parameters.get("EVIDENCE_DIR") for parameters in plan.values()]
    return bool(folders) and all(
        isinstance(folder, str) and (ROOT / folder).resolve() == EVIDENCE_DIR.resolve() for folder in folders
    )


def warm_start_note(plan: Mapping[str, Mapping[str, Any]]) -> Optional[str]:
    """What a run says before it starts when its notebook 03 builds the CPU stand-in's warm start:
    none in .cache/warm_start/ was built from as many campaigns with the same loss (a guess, from
    each cached warm start's report, that errs towards saying it), and about how long it takes on 2 idle
    cores for its number of campaigns (`lib.runtime.warm_start_estimate`); None otherwise."""
    if TRAIN_NOTEBOOK not in plan:
        return None
    from lib.runtime import warm_start_estimate
    from lib.training.config import TINY_MODEL
    from lib.training.tokenizer import WARM_START_CACHE

    parameters = plan[TRAIN_NOTEBOOK]
    config = training_config(parameters)
    if config.model_name not in (None, TINY_MODEL) or not config.warm_start_episodes or config.lora_r:
        return None
    for report in WARM_START_CACHE.glob(f"{TINY_MODEL}-*/warm_start.json"):
        try:
            built = read_json(report)
        except (OSError, ValueError):
            continue
        same_loss = (built.get("action_tokens") is None) == (config.warm_start_loss == "conversation")
        if built.get("episodes") == config.warm_start_episodes and same_loss:
            return None
    took = warm_start_estimate(config.warm_start_episodes, config.warm_start_epochs, config.warm_start_batch_size)
    return (
        f"first run: notebook 03 builds the CPU stand-in's warm start ({config.warm_start_episodes} campaigns, "
        f"{took}) and keeps it in {shown_path(WARM_START_CACHE)}/, which later runs load in seconds"
    )


def duration(seconds: float) -> str:
    """`2 min 41 s`, `9 s`, `1 h 3 min`."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def run_summary(
    profile: str, plan: Mapping[str, Mapping[str, Any]], build_dir: Path, seconds: Mapping[str, float]
) -> List[str]:
    """What a run says at its end: how long it took (each notebook's seconds), what it wrote where,
    the next command and the page to open."""
    name = profile_name(profile)
    each = ", ".join(f"{notebook[:2]} {duration(s)}" for notebook, s in seconds.items())
    lines = [f"done: {len(seconds)} notebook(s) of the {name} profile in {duration(sum(seconds.values()))} ({each})"]
    lines.append(f"  executed notebooks: {shown_path(build_dir)}/ (run.json: each one's commit and time)")
    folders: Dict[str, List[str]] = {}
    for what, folder in written_folders(plan):
        folders.setdefault(shown_path(folder), []).append(what)
    for folder, whats in folders.items():
        lines.append(f"  written: {folder}/ ({', '.join(whats)})")
    report = "make report" + ("" if name == "full" else f" PROFILE={name}")
    page = reports_dir(profile) / f"{list(plan)[-1]}.readers.html"  # the results, code hidden
    lines.append(f"next: {report}, then open {shown_path(page)} in a browser")
    if name == "full" and TRAIN_NOTEBOOK in plan:
        lines.append(
            "then: `make promote-evidence` copies build/full/evidence/ over the committed evidence/ "
            "(`git diff --stat evidence/` shows the change)"
        )
    return lines


def source_revision() -> Dict[str, Any]:
    """The checkout's commit and whether its source has uncommitted changes, outside evidence/ and
    reports/, which the notebooks write (`cernenv.provenance.source_revision`)."""
    from cernenv.provenance import source_revision as revision  # cernenv's import is ~1 s: here, not at start

    return revision(ROOT, ignore=("evidence", "reports"))


def record_run(build_dir: Path, profile: str, notebook: str, seconds: float) -> None:
    """Add `notebook`'s run (commit, time) to `build_dir/run.json`."""
    path = build_dir / RUN_RECORD
    try:
        record = read_json(path)
    except FileNotFoundError:
        record = {}
    except (OSError, ValueError) as error:  # kept aside, not overwritten: it holds the earlier notebooks' runs
        aside = path.with_name(f"{path.name}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}")
        path.replace(aside)
        print(f"warning: {error}; moved it to {aside} and started a new one", file=sys.stderr)
        record = {}
    if not isinstance(record, dict):
        record = {}
    record["profile"] = profile_name(profile)
    record.setdefault("notebooks", {})[notebook] = {
        **source_revision(),
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
    }
    write_json(path, record, indent=1)


def default_kernel_name() -> str:
    """The Jupyter kernel notebooks run on: `python3`, which in the venv is the venv's Python."""
    return DEFAULT_KERNEL


def notable_warnings(notebook_path: Path, limit: int = 8) -> List[str]:
    """The warnings and errors an executed notebook printed on stderr, once each, less `NOISE`."""
    import nbformat

    notebook = nbformat.read(str(notebook_path), as_version=4)
    found: List[str] = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") != "stream" or output.get("name") != "stderr":
                continue
            for line in str(output.get("text", "")).splitlines():
                line = line.strip()
                if re.search(r"warn|error", line, re.IGNORECASE) and not any(p.search(line) for p in NOISE):
                    if line not in found:
                        found.append(line)
    return found[:limit]


class ProgressEcho:
    """A file a notebook's stream output is written to (papermill's `stdout_file`/`stderr_file`):
    the lines that are progress meters go to `out`, indented; the rest stays in the notebook.
    `heartbeat` (a `Heartbeat`) is told of each line echoed."""

    def __init__(self, out: Any, heartbeat: Optional["Heartbeat"] = None) -> None:
        self.out, self._partial, self.heartbeat = out, "", heartbeat

    def write(self, text: str) -> None:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            if METER_LINE.search(line):
                meter = line.split("lib.progress: ", 1)[-1].strip()  # without the log line's time and name
                print(f"    {meter}", file=self.out, flush=True)
                if self.heartbeat is not None:
                    self.heartbeat.said()

    def flush(self) -> None:
        pass


HEARTBEAT_S = 10.0
"""The longest a run stays silent: a notebook that has echoed no line for this long gets one saying
it still runs (notebook 04 read and drew for 55 s, notebook 03 imported for 47 s, without a word)."""


class Heartbeat:
    """A line to `out` whenever `label`'s notebook has said nothing for `every_s` seconds (`said`
    restarts the wait): `    03_train_grpo: still running, 40 s so far`. A context manager around
    the notebook's execution; its thread ends with it."""

    def __init__(self, out: Any, label: str, every_s: float = HEARTBEAT_S) -> None:
        import threading

        self.out, self.label, self.every_s = out, label, every_s
        self.started = self.last = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {label}", daemon=True)

    def said(self) -> None:
        self.last = time.perf_counter()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s)):
            now = time.perf_counter()
            if now - self.last >= self.every_s:
                print(
                    f"    {self.label}: still running, {duration(now - self.started)} so far", file=self.out, flush=True
                )
                self.last = now

    def __enter__(self) -> "Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def run_notebook(
    name: str,
    parameters: Mapping[str, Any],
    *,
    build_dir: Optional[Path] = None,
    kernel_name: Optional[str] = None,
    profile: str = "full",
    show_progress: bool = False,
    progress_bar: Any = False,
    echo: Any = None,
) -> Path:
    """Execute `notebooks/NAME.ipynb` with `parameters` into `build_dir/NAME.ipynb` (default
    build/PROFILE/), its kernel headless (`KERNEL_ENVIRONMENT`). `show_progress`: every line the
    notebook prints echoed to this process's stderr; `echo`: a file its progress lines are
    echoed to otherwise (`ProgressEcho`); `progress_bar`: papermill's bar over the cells (True,
    or tqdm's arguments)."""
    import papermill
    from papermill.exceptions import PapermillExecutionError

    build_dir = Path(build_dir or profile_build_dir(profile))
    build_dir.mkdir(parents=True, exist_ok=True)
    output = build_dir / f"{name}.ipynb"
    saved = {key: os.environ.get(key) for key in KERNEL_ENVIRONMENT}
    os.environ.update(KERNEL_ENVIRONMENT)  # the kernel inherits this process's environment
    heartbeat = Heartbeat(echo, name) if echo is not None and not show_progress else contextlib.nullcontext()
    try:
        with heartbeat:
            beat = heartbeat if isinstance(heartbeat, Heartbeat) else None
            papermill.execute_notebook(
                str(NOTEBOOKS_DIR / f"{name}.ipynb"),
                str(output),
                parameters=dict(parameters),
                kernel_name=kernel_name or default_kernel_name(),
                cwd=str(NOTEBOOKS_DIR),
                progress_bar=progress_bar,
                log_output=show_progress,
                stdout_file=None if show_progress or echo is None else ProgressEcho(echo, beat),
                stderr_file=None if show_progress or echo is None else ProgressEcho(echo, beat),
                extra_arguments=KERNEL_ARGUMENTS,
            )
    except PapermillExecutionError as error:
        raise ReproduceError(
            f"{name} failed in cell {error.exec_count}: {error.ename}: {error.evalue}\n"
            f"The executed notebook, with the failing cell marked, is {output}; open it to see the traceback. "
            f"Rerun this notebook alone with `make reproduce PROFILE={profile_name(profile)} ONLY={name}`."
        ) from error
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return output


def reproduce(
    profile: str = "full",
    only: Sequence[str] = (),
    build_dir: Optional[Path] = None,
    show_progress: bool = False,
    out: Any = None,
) -> List[Path]:
    """Run the profile's notebooks in order (or just those in `only`); returns the executed copies.
    Prints a line as each notebook starts and ends to `out` (default stderr), and the progress
    lines the notebooks print between (the warm start's, the evaluations', the GRPO steps'); first,
    that notebook 03 builds the stand-in's warm start where none is cached (`warm_start_note`); at
    the end, the total time, what was written where, and the next command (`run_summary`)."""
    out = out or sys.stderr
    plan = load_profile(profile)
    missing = sorted(set(only) - set(plan))
    if missing:
        raise ReproduceError(f"{missing} not in profile {profile!r}, which runs {list(plan)}")
    chosen = {name: parameters for name, parameters in plan.items() if not only or name in only}
    target = Path(build_dir or profile_build_dir(profile))
    check_written_folders(chosen, target)
    if profile_name(profile) == "full" and TRAIN_NOTEBOOK in chosen:
        print(
            "the full run: it regenerates the evidence into build/full/evidence/ (how long: docs/benchmarks.md; "
            "Ctrl-C stops it, and evidence/ is never touched); `make promote-evidence` then "
            "copies it over evidence/. `make reproduce PROFILE=smoke` runs every notebook in minutes.",
            file=out,
            flush=True,
        )
    note = warm_start_note(chosen)
    if note:
        print(note, file=out, flush=True)
    outputs, seconds = [], {}
    for index, (name, parameters) in enumerate(chosen.items(), start=1):
        start = time.perf_counter()
        label = f"[{index}/{len(chosen)}] {name} ({profile_name(profile)})"
        print(f"{label} …", file=out, flush=True)
        outputs.append(
            run_notebook(
                name,
                parameters,
                build_dir=target,
                profile=profile,
                show_progress=show_progress,
                echo=out,
            )
        )
        seconds[name] = time.perf_counter() - start
        record_run(outputs[-1].parent, profile, name, seconds[name])
        print(f"{label}: done in {seconds[name]:.0f} s → {shown_path(outputs[-1])}", file=out, flush=True)
        for line in notable_warnings(outputs[-1]):
            print(f"    {line}", file=out, flush=True)
    for line in run_summary(profile, chosen, target, seconds):
        print(line, file=out, flush=True)
    return outputs


def check_heldout_episodes(evidence: Path) -> None:
    """Refuse evidence whose evaluation episodes are not the held-out suite's (a run evaluated on the
    validation split, `eval_split: validation`, chooses settings; it is never the evidence)."""
    from lib.episodes.records import episode_file_bytes
    from lib.measure.evaluation import heldout_suite

    suite = {spec.seed for spec in heldout_suite()}
    for name in ("pre_eval.jsonl.gz", "post_eval.jsonl.gz"):
        try:
            lines = episode_file_bytes(str(evidence / name)).splitlines()
            seeds = {json.loads(line).get("seed") for line in lines if line.strip()}
        except (OSError, ValueError, AttributeError) as error:
            raise ReproduceError(f"{evidence / name} cannot be read ({error}); nothing was promoted") from None
        foreign = sorted(seed for seed in seeds if seed not in suite)
        if foreign:
            raise ReproduceError(
                f"{evidence / name} holds episodes of seeds outside the held-out suite ({foreign[:3]}...): "
                "a run evaluated on the validation split chooses settings and is never promoted"
            )


def promote_evidence(build_dir: Path = BUILD_DIR / "full", target: Path = EVIDENCE_DIR, out: Any = None) -> List[str]:
    """Copy a complete full run's evidence (`build_dir/evidence/`) over `target` (the git-tracked
    evidence/), each file atomically; files of `target` the run did not make are removed (git has
    them). Refused unless run.json says the full profile ran notebooks 02 and 03 and the evidence
    holds every file of `PROMOTED_REQUIRED`. Returns the files written."""
    out = out or sys.stderr
    source = Path(build_dir) / "evidence"
    try:
        record = read_json(Path(build_dir) / RUN_RECORD, "run `make reproduce` (the full profile) again")
    except FileNotFoundError:
        raise ReproduceError(
            f"{build_dir}/{RUN_RECORD} is missing: run `make reproduce` (the full profile) first"
        ) from None
    except (OSError, ValueError) as error:
        raise ReproduceError(str(error)) from None
    if not isinstance(record, dict):
        raise ReproduceError(f"{build_dir}/{RUN_RECORD} is not a run record: run `make reproduce` (the full profile)")
    ran = set(record.get("notebooks", {}))
    if record.get("profile") != "full" or not {"02_baseline_rollouts", TRAIN_NOTEBOOK} <= ran:
        raise ReproduceError(
            f"{build_dir} holds no complete full run (profile {record.get('profile')!r}, notebooks {sorted(ran)}): "
            "only the full profile's notebooks 02 and 03 make the evidence; run `make reproduce`"
        )
    missing = [
        name for name in PROMOTED_REQUIRED if not (source / name).is_file() or not (source / name).stat().st_size
    ]
    if missing:
        raise ReproduceError(f"{source} lacks {missing}: the run did not finish; nothing was promoted")
    check_heldout_episodes(source)
    dirty = [name for name, run in record["notebooks"].items() if run.get("dirty")]
    if dirty:
        print(f"note: {dirty} ran on a checkout with uncommitted changes (build/full/run.json)", file=out)
    files = sorted(p for p in source.iterdir() if p.is_file() and not p.name.startswith("."))
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for path in files:
        atomic_write(target / path.name, path.read_bytes())
        written.append(path.name)
    removed = [p.name for p in target.iterdir() if p.is_file() and not p.name.startswith(".") and p.name not in written]
    for name in removed:
        (target / name).unlink()
    print(
        f"promoted {len(written)} files from {source} to {target}" + (f"; removed {removed}" if removed else ""),
        file=out,
    )
    print("review with `git diff --stat evidence/`, then commit them with the run's notebooks' commit", file=out)
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="full", help="configs/NAME.yaml, or a path to a YAML file")
    parser.add_argument("--only", nargs="*", default=(), help="run just these notebooks of the profile")
    parser.add_argument(
        "--build-dir", type=Path, default=None, help="where the executed notebooks go (default build/PROFILE/)"
    )
    parser.add_argument("--verbose", action="store_true", help="echo everything the notebooks print")
    parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # the default now
    parser.add_argument(
        "--promote", action="store_true", help="copy the full run's evidence (build/full/evidence) over evidence/"
    )
    args = parser.parse_args(argv)
    if args.verbose:  # papermill logs each line a notebook prints at INFO
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
        for noisy in ("traitlets", "asyncio"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if args.promote:
            promote_evidence(args.build_dir or BUILD_DIR / "full")
        else:
            reproduce(args.profile, args.only, build_dir=args.build_dir, show_progress=args.verbose)
    except ReproduceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
