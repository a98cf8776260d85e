"""The notebooks run headlessly (papermill) and are committed clean: parameters cell, no outputs."""

import json
import os
import re
from pathlib import Path

import nbformat
import pytest

from lib.notebooks.reproduce import default_kernel_name

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# Small values for the parameters cell of notebook 01 (one short tour episode).
SMALL_01 = {"SEED": 3, "N_TOUR_EPISODES": 1, "TOUR_SCENARIOS": ["higgs_4l_125"]}


def test_the_four_notebooks_are_there_in_order():
    """The four notebooks README.md and `make reproduce` name, numbered in the order they run."""
    assert [path.name for path in NOTEBOOKS] == [
        "01_explore_environment.ipynb",
        "02_baseline_rollouts.ipynb",
        "03_train_grpo.ipynb",
        "04_evidence_analysis.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1 and tagged[0].cell_type == "code", f"{path.name}: tag exactly one code cell `parameters`"
    dirty = [
        i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "colab.research.google.com" in first.source, "Open in Colab badge"
    assert nb.metadata["kernelspec"]["name"] == default_kernel_name() == "python3", "one kernel: Colab's and the venv's"


def test_the_makefile_registers_the_notebooks_kernel_under_the_same_name():
    makefile = (ROOT / "Makefile").read_text()
    assert f"KERNEL      ?= {default_kernel_name()}" in makefile


def _first_code_cell(path: Path) -> str:
    return next(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")


def test_every_notebook_opens_with_the_same_colab_bootstrap():
    """One bootstrap for the four notebooks: a fix to it cannot miss one of them."""
    sources = {path.name: _first_code_cell(path) for path in NOTEBOOKS}
    assert len(set(sources.values())) == 1, "the notebooks' first code cells differ"


def test_colab_bootstrap_runs_twice_and_takes_the_repository_url(tmp_path):
    """The bootstrap as Colab runs it (google.colab imported), cloning this repository from the
    URL it is given, then run again in the same kernel (re-running the cell used to fail on the
    existing clone). pip is recorded, not run."""
    import subprocess
    import sys
    import textwrap

    source = _first_code_cell(NOTEBOOKS[0])
    assert 'COLAB_ROOT = Path("/content/cernenv")' in source and "REPO_URL = " in source
    target = tmp_path / "content" / "cernenv"
    branch = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--abbrev-ref", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    for old, new in (
        ('COLAB_ROOT = Path("/content/cernenv")', f"COLAB_ROOT = Path({str(target)!r})"),
        ('REPO_URL = "https://github.com/cernenv-lab/cernenv.git"', f"REPO_URL = {str(ROOT)!r}"),
        ('REPO_REF = "main"', f"REPO_REF = {branch!r}"),
    ):
        assert old in source, old
        source = source.replace(old, new)
    driver = textwrap.dedent(f"""
        import subprocess, sys, types
        sys.modules["google"] = types.ModuleType("google")
        sys.modules["google.colab"] = types.ModuleType("google.colab")
        pip_calls, real_run = [], subprocess.run
        def run(command, *args, **kwargs):
            if "pip" in command:
                pip_calls.append(command)
                return subprocess.CompletedProcess(command, 0)
            return real_run(command, *args, **kwargs)
        subprocess.run = run
        source = {source!r}
        for _ in range(2):
            namespace = {{}}
            exec(source, namespace)
        print(namespace["ROOT"], len(pip_calls), sys.path.count(str(namespace["ROOT"])))
    """)
    result = subprocess.run(
        [sys.executable, "-c", driver], capture_output=True, text=True, timeout=300, cwd=str(tmp_path)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    root, pip_calls, on_path = result.stdout.split()
    assert Path(root) == target and (target / "cernenv" / "environment.py").is_file()
    assert int(pip_calls) == 2 and int(on_path) == 0, "the install makes lib importable, not a sys.path edit"


def test_the_setup_cell_stays_a_few_lines_and_finds_the_local_checkout():
    """The logic is `lib.notebooks.bootstrap`'s; the cell only clones on Colab and calls it."""
    from lib.notebooks.bootstrap import local_checkout

    lines = [line for line in _first_code_cell(NOTEBOOKS[0]).splitlines() if line.strip()]
    assert len(lines) <= 16, f"the setup cell grew to {len(lines)} lines: move logic to lib/notebooks/bootstrap.py"
    namespace = {}
    exec(_first_code_cell(NOTEBOOKS[0]), namespace)  # not on Colab: the local branch
    assert namespace["ROOT"] == local_checkout() == ROOT


@pytest.mark.slow
@pytest.mark.notebook
def test_notebook_01_runs(tmp_path, monkeypatch):
    papermill = pytest.importorskip("papermill")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("CERNENV_HEADLESS", "1")
    output = tmp_path / "01_explore_environment.ipynb"
    figures = tmp_path / "figures"
    papermill.execute_notebook(
        str(ROOT / "notebooks" / "01_explore_environment.ipynb"),
        str(output),
        parameters={**SMALL_01, "FIGURE_DIR": str(figures)},
        kernel_name=default_kernel_name(),
        cwd=str(ROOT / "notebooks"),
        progress_bar=False,
        execution_timeout=120,
    )
    nb = nbformat.read(output, as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2, "spectrum/scan and spin figures"
    markdown = "\n".join(o["data"]["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {}))
    assert "| scenario | seed | steps |" in markdown and "`higgs_4l_125`" in markdown, "episode summary table"
    assert (figures / "01_spectrum_scan.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.notebook
def test_the_chain_02_03_04_keeps_the_baselines_and_makes_a_promotable_run(tmp_path, monkeypatch):
    """Notebooks 02 -> 03 -> 04 as `make reproduce` runs them, into one evidence folder: 02 writes the
    baselines, 03 trains (two GRPO steps of a randomly initialised tiny model, no SFT, to stay fast)
    without moving them, 04 compares the policy with them, and `make promote-evidence` accepts the
    run. The profile is named `full` because only a full run is promoted."""
    pytest.importorskip("papermill")
    from lib.notebooks.reproduce import promote_evidence, reproduce
    from lib.training.policy_model import build_tiny_model
    from lib.training.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    model_dir = tmp_path / "tiny"
    build_tiny_model(tokenizer).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    build = tmp_path / "build"
    evidence = build / "evidence"  # where `make promote-evidence` takes it from
    train = {
        "model_name": str(model_dir),
        "backend": "trl",
        "max_steps": 2,
        "num_generations": 2,
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 2,
        "lora_r": 0,
        "max_turns": 3,
        "warm_start_episodes": 0,
        "eval_episodes": 3,
        "eval_every_steps": 1,
        "checkpoint_eval_episodes": 2,
        "evidence_dir": str(evidence),
        "output_dir": str(tmp_path / "out"),
        "TRAIN_CONFIG": str(tmp_path / "train.yaml"),
    }
    # TrainConfig fields the parameters cell does not list come from a configs/train-style file
    (tmp_path / "train.yaml").write_text("max_new_tokens: 16\ncurated_fraction: 1.0\n")
    profile = tmp_path / "full.yaml"
    profile.write_text(
        json.dumps(
            {
                "notebooks": {
                    "02_baseline_rollouts": {"MAX_EPISODES": 4, "EVIDENCE_DIR": str(evidence), "N_TRAJECTORIES": 2},
                    "03_train_grpo": train,
                    "04_evidence_analysis": {"EVIDENCE_DIR": str(evidence), "N_BROWSER_TASKS": 1},
                }
            }
        )
    )
    executed = {path.stem: path for path in reproduce(str(profile), build_dir=build, out=open(os.devnull, "w"))}

    def outputs(name):
        nb = nbformat.read(executed[name], as_version=4)
        found = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
        assert not [o for o in found if o.output_type == "error"], name
        return found

    def markdown(found):
        return "\n".join(o["data"]["text/markdown"] for o in found if "text/markdown" in o.get("data", {}))

    out_02, out_03, out_04 = (
        outputs(name) for name in ("02_baseline_rollouts", "03_train_grpo", "04_evidence_analysis")
    )
    baselines = json.loads((evidence / "baselines.json").read_text())
    agents = {"random", "always-null", "heuristic", "best family member", "oracle"}
    assert set(baselines["metrics"]) == agents
    assert baselines["n_episodes"] == dict.fromkeys(agents, 4)
    assert "| heuristic |" in (evidence / "baselines.md").read_text()
    assert "| best family member |" in (evidence / "baselines.md").read_text()
    assert sum("image/png" in o.get("data", {}) for o in out_02) >= 1, "reward distributions"

    assert "| mean_reward |" in markdown(out_03) and "3 paired episodes" in markdown(out_03)
    assert sum("image/png" in o.get("data", {}) for o in out_03) >= 3, "training curves and before/after plots"
    assert (evidence / "before_after_metrics.json").exists() and (evidence / "checkpoint_evals.csv").exists()
    saved = json.loads((tmp_path / "out" / "train_config.json").read_text())
    assert (saved["curated_fraction"], saved["max_new_tokens"]) == (1.0, 16), "the file's values"

    texts = "".join(o.get("text", "") for o in out_04 if o.output_type == "stream")
    assert "baselines.json not found" not in texts, "notebook 03 moved notebook 02's baselines away"
    for agent in ("heuristic", "oracle", "policy after GRPO"):
        assert f"| {agent} |" in markdown(out_04), agent
    promoted = promote_evidence(build, target=tmp_path / "promoted", out=open(os.devnull, "w"))
    assert {"baselines.json", "baselines.md", "training_log.csv"} <= set(promoted)


def test_notebook_03_parameters_are_train_config_fields_left_to_the_file():
    """Each parameter of notebook 03 but TRAIN_CONFIG (a configs/train/*.yaml file) is a TrainConfig
    field by its own name, left as `...` (the file's value, else TrainConfig's default; no default
    restated): the notebook and `make train` run the same configuration, and configs/*.yaml use the
    same names."""
    import ast
    from dataclasses import fields

    from lib.training import TrainConfig

    nb = nbformat.read(ROOT / "notebooks" / "03_train_grpo.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assigned = {node.targets[0].id: node.value for node in ast.parse(cell.source).body if isinstance(node, ast.Assign)}
    names = {f.name for f in fields(TrainConfig)}
    assert ast.unparse(assigned.pop("TRAIN_CONFIG")) == "None"
    assert assigned and set(assigned) <= names, f"not TrainConfig fields: {set(assigned) - names}"
    set_here = [name for name, value in assigned.items() if ast.unparse(value) != "..."]
    assert not set_here, f"parameters set in the cell instead of left to the file: {set_here}"
    from lib.notebooks.reproduce import load_profile

    for profile in ("full", "smoke", "untrained"):
        assert set(load_profile(profile)["03_train_grpo"]) <= names | {"TRAIN_CONFIG"}, profile


def _colab_like(root):
    (root / "configs" / "train").mkdir(parents=True)
    (root / "configs" / "train" / "colab.yaml").write_text(
        "lora_r: 16\nbeta: 0.0\nmax_steps: 30\nlearning_rate: 5.0e-6\nevidence_dir: build/colab\n"
    )


def test_notebook_03_takes_the_file_then_every_value_typed_whatever_it_equals(tmp_path):
    """A value typed in the parameters cell is the value the run uses, even where it equals
    TrainConfig's CPU default (max_steps 8 and learning_rate 1e-4 on a GPU used to train 30 steps
    at 5e-6, the file's); a parameter left as `...` takes the file's value, else the default."""
    from lib.training.cli import notebook_config
    from lib.training.config import TrainConfig

    root = tmp_path
    _colab_like(root)
    namespace = {
        "max_steps": TrainConfig.max_steps,
        "learning_rate": TrainConfig.learning_rate,
        "temperature": 0.9,
        "lora_r": ...,
        "seed": ...,
        "unrelated": 1,
    }
    on_gpu = notebook_config(namespace, None, root=root, gpu=True)
    assert (on_gpu.max_steps, on_gpu.learning_rate) == (TrainConfig.max_steps, TrainConfig.learning_rate)
    assert (on_gpu.lora_r, on_gpu.beta, on_gpu.temperature, on_gpu.seed) == (16, 0.0, 0.9, TrainConfig.seed)
    assert on_gpu.evidence_dir == str(root / "build" / "colab"), "relative folders from the repository root"
    on_cpu = notebook_config(namespace, None, root=root, gpu=False)
    assert (on_cpu.lora_r, on_cpu.max_steps, on_cpu.temperature) == (0, TrainConfig.max_steps, 0.9), "no file"


def test_notebook_03_shows_the_values_the_run_uses_and_where_each_came_from(tmp_path):
    from lib.training.cli import notebook_config, notebook_config_markdown

    root = tmp_path
    _colab_like(root)
    namespace = {"max_steps": 8, "temperature": ..., "seed": ...}
    config = notebook_config(namespace, None, root=root, gpu=True)
    table = notebook_config_markdown(config, namespace, None, root=root, gpu=True)
    assert "| `max_steps` | `8` | typed here |" in table
    assert "| `lora_r` | `16` | `configs/train/colab.yaml` |" in table
    assert "| `learning_rate` | `5e-06` | `configs/train/colab.yaml` |" in table
    assert "| `temperature` | `0.6` | TrainConfig's default |" in table


def test_notebook_03_on_drive_keeps_its_folders_there_and_resumes_from_its_last_checkpoint(tmp_path):
    """With MOUNT_DRIVE the run's relative folders lie on the Drive, and the notebook run again after
    a disconnect resumes from the newest complete checkpoint there (none yet: a fresh run)."""
    from lib.training.cli import notebook_config

    root, drive = tmp_path / "repo", tmp_path / "drive"
    _colab_like(root)
    fresh = notebook_config({}, None, root=root, gpu=True, folders=drive, resume_latest=True)
    assert fresh.evidence_dir == str(drive / "build" / "colab")
    assert fresh.output_dir.startswith(str(drive)) and fresh.resume_from_checkpoint is None
    checkpoint = Path(fresh.output_dir) / "checkpoint-5"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 5, "log_history": []}))
    (checkpoint / "model.safetensors").write_bytes(b"")
    (checkpoint / "optimizer.pt").write_bytes(b"")
    again = notebook_config({}, None, root=root, gpu=True, folders=drive, resume_latest=True)
    assert again.resume_from_checkpoint == "latest"
    typed = notebook_config(
        {"resume_from_checkpoint": None}, None, root=root, gpu=True, folders=drive, resume_latest=True
    )
    assert typed.resume_from_checkpoint is None, "a value typed is the value used"


def test_every_notebook_names_the_repository_pyproject_names():
    """The Colab badge and the clone URL of every notebook are the repository of pyproject.toml's
    [project.urls], the one place the project's address is written."""
    import tomllib

    repository = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
    colab = repository.replace("https://github.com/", "https://colab.research.google.com/github/")
    for path in NOTEBOOKS:
        text = path.read_text()
        assert f'REPO_URL = \\"{repository}.git\\"' in text, path
        assert f"({colab}/blob/main/notebooks/{path.name})" in text, path
        named = set(re.findall(r"github(?:\.com)?/([\w.-]+/[\w-]+)", text))
        assert named == {repository.removeprefix("https://github.com/")}, (path, named)  # no other address
