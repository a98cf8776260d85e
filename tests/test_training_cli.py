"""The typed command line of a training run (lib/training/cli.py) and TrainConfig's type checks."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Union, get_args, get_origin

import pytest

from lib.training.cli import config_fields, field_docs, load_config_file, parse_train_config, train_config_parser
from lib.training.config import _TYPES, TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def test_every_field_has_a_documented_typed_flag():
    docs = field_docs(TrainConfig)
    assert set(docs) == {f.name for f in fields(TrainConfig)}  # a field without a docstring fails here
    assert field_docs() == docs, "the docstrings read from the source are the class's"
    declared = {f.name: (f.kind, f.optional) for f in config_fields()}
    assert list(declared) == [f.name for f in fields(TrainConfig)]
    for f in fields(TrainConfig):
        kind, optional = declared[f.name]
        annotation = _TYPES[f.name]
        assert optional == (get_origin(annotation) is Union), f.name
        base = next(a for a in get_args(annotation) if a is not type(None)) if optional else annotation
        assert kind == ("list" if get_origin(base) is list else base.__name__), f.name
    parser = train_config_parser()
    helps = {}
    for action in parser._actions:  # --no_curriculum shares --curriculum's dest: the first is the field's
        helps.setdefault(action.dest, action.help)
    assert "configs/train/smoke.yaml" in helps["config"]
    for f in fields(TrainConfig):
        assert helps.get(f.name), f"--{f.name} has no help"
        assert " ".join(docs[f.name].split())[:40] in helps[f.name]
    assert helps["max_steps"].startswith("[int] ") and "(default: 8)" in helps["max_steps"]
    assert helps["max_turns"].startswith("[int or None] ") and helps["report_to"].startswith("[list of str] ")


def test_help_imports_nothing_heavy_and_lists_types_and_the_config_flag():
    """--help used to import TRL (24-30 s on the 2-core machine): it now reads config.py's source."""
    probe = (
        "import sys\n"
        "from lib.training.__main__ import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = ('cernenv', 'torch', 'transformers', 'trl', 'unsloth', 'numba', 'yaml')\n"
        "print('LOADED', sorted(m for m in heavy if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "LOADED []"
    assert "--config FILE.yaml" in result.stdout and "--max_steps INT" in result.stdout
    assert "--max_turns INT|None" in result.stdout and "Optimisation steps" in result.stdout


@pytest.mark.parametrize("name", ["smoke", "default", "colab", "plateau"])
def test_the_ready_made_training_configs_load(name):
    config, _ = parse_train_config(["--config", str(ROOT / "configs" / "train" / f"{name}.yaml")])
    assert not config.evidence_dir.startswith("evidence"), "a ready-made run never writes the committed evidence"
    if name == "default":
        assert config == TrainConfig(output_dir=config.output_dir)
    if name == "smoke":  # minutes: two steps, a warm start smaller than the default's, on the replies alone
        default = TrainConfig()
        assert config.max_steps <= 2 and config.model_name == "cernenv-tiny" and config.warm_start_loss == "actions"
        assert (
            0
            < config.warm_start_episodes * config.warm_start_epochs
            < (default.warm_start_episodes * default.warm_start_epochs)
        )
    if name == "plateau":  # the seeds' recipe, pinned: the default's training, evaluated as they were
        assert config.warm_start_episodes == 600 and config.constrained_replies
        assert config.episodes_per_step == 64 and config.max_steps * config.episodes_per_step == 512
        assert (config.eval_every_steps, config.save_steps) == (20, 20)
        default = TrainConfig()
        cadence = ("evidence_dir", "output_dir", "eval_every_steps", "save_steps")  # where it may differ
        assert replace(config, **{f: getattr(default, f) for f in cadence}) == default, "the default trains so"
    if name == "colab":  # a real model: LoRA, a warm start on its actions with a pretrained model's schedule
        assert (config.lora_r, config.warm_start_episodes, config.warm_start_loss) == (16, 200, "actions")
        assert (config.warm_start_learning_rate, config.warm_start_epochs) == (2e-4, 1.0)
        assert config.save_steps <= config.max_steps and "tensorboard" in config.report_to


def test_a_benchmark_reads_a_ready_made_yaml_and_a_runs_train_config_json(tmp_path):
    plateau = ROOT / "configs" / "train" / "plateau.yaml"
    config = load_config_file(plateau)
    assert config == parse_train_config(["--config", str(plateau)])[0] and config != TrainConfig()
    assert load_config_file(config.save(tmp_path / "train_config.json")) == config
    (tmp_path / "bad.yaml").write_text("max_step: 3\n")
    with pytest.raises(ValueError, match="did you mean max_steps"):
        load_config_file(tmp_path / "bad.yaml")


def test_flags_and_a_yaml_file_make_the_config_flags_winning(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("max_steps: 3\nlearning_rate: 1.0e-4\nscenarios: [higgs_4l_125]\nlora_r: 0\n")
    config, _ = parse_train_config(["--config", str(config_file), "--max_steps", "5", "--temperature", "0.9"])
    assert (config.max_steps, config.learning_rate, config.scenarios, config.lora_r, config.temperature) == (
        5,
        1e-4,
        ["higgs_4l_125"],
        0,
        0.9,
    )
    assert config == TrainConfig(max_steps=5, learning_rate=1e-4, scenarios=["higgs_4l_125"], lora_r=0, temperature=0.9)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("python -m lib.training: error: ") and "--help" in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_steps", "three"], "argument --max_steps/--max-steps: invalid int value: 'three'"),
        (["--scenarios", "atlantis"], "unknown scenarios ['atlantis']"),
        (["--num_generations", "3"], "must be a multiple of num_generations"),
        (["--no_such_field", "1"], "unrecognized arguments: --no_such_field 1"),
        (["--temperature", "nan"], "temperature must be a finite number in (0, inf)"),
        (["--learning_rate=-1e-4"], "learning_rate must be a finite number in (0, inf)"),
        (["--learning_rate", "nan"], "learning_rate must be a finite number"),
        (["--top_p", "0"], "top_p must be a finite number in (0, 1]"),
        (["--top_p", "1.5"], "top_p must be a finite number in (0, 1]"),
        (["--eval_episodes", "0"], "eval_episodes must be at least 1, or None"),
        (["--report_to", "tensorbord"], "report_to names unknown trackers ['tensorbord']"),
        (["--use_vllm", "maybe"], "argument --use_vllm/--use-vllm: invalid bool value: 'maybe'"),
    ],
)
def test_bad_flags_exit_with_one_line_that_names_the_field(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_train_config(argv)
    assert exited.value.code == 2
    assert message in _one_line_error(capsys)


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_steps: three\n", "max_steps must be int, got 'three' (str)"),
        ("max_stepz: 3\n", "names fields TrainConfig does not have: max_stepz (did you mean max_steps?)"),
        ("temperature: [1, 2]\n", "temperature"),
        ("temperature: .nan\n", "temperature must be a finite number"),
        ("learning_rate: 1e-4\nmax_steps: [1,\n", "is not valid YAML at line 3, column 1"),
        ("- max_steps\n", "holds a list, not a mapping of TrainConfig fields"),
        ("notebooks:\n  03_train_grpo: {}\n", "is a `make reproduce` profile"),
    ],
)
def test_bad_config_files_exit_with_one_line_that_names_the_field(tmp_path, text, message, capsys):
    config_file = tmp_path / "run.yaml"
    config_file.write_text(text)
    with pytest.raises(SystemExit):
        parse_train_config(["--config", str(config_file)])
    assert message in _one_line_error(capsys)


def test_a_missing_config_file_a_folder_and_a_reproduce_profile_are_named(tmp_path, capsys):
    for path, message in (
        (tmp_path / "nope.yaml", "does not exist; ready-made ones: configs/train/colab.yaml"),
        (tmp_path, "is a folder"),
        (ROOT / "configs" / "smoke.yaml", "not a training config; give one of configs/train/colab.yaml"),
    ):
        with pytest.raises(SystemExit):
            parse_train_config(["--config", str(path)])
        assert message in _one_line_error(capsys)


def test_yaml_numbers_without_a_dot_are_read_as_numbers(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("learning_rate: 1e-4\nmax_turns: null\nreport_to: [none]\n")
    config, _ = parse_train_config(["--config", str(config_file), "--use-vllm", "false", "--no_curriculum"])
    assert config.learning_rate == 1e-4 and config.max_turns is None and config.report_to == ["none"]
    assert config.curriculum is False and config.use_vllm is False


@pytest.mark.parametrize(
    "values, message",
    [
        ({"max_steps": "three"}, "max_steps must be int, got 'three' (str)"),
        ({"use_vllm": "yes"}, "use_vllm must be bool, got 'yes' (str)"),
        ({"max_turns": 2.5}, "max_turns must be None or int, got 2.5 (float)"),
        ({"scenarios": "higgs_4l_125"}, "scenarios must be a list of strings"),
        ({"lora_r": True}, "lora_r must be int, got True (bool)"),
    ],
)
def test_train_config_names_the_field_of_a_value_of_the_wrong_type(values, message):
    with pytest.raises(ValueError) as error:
        TrainConfig.from_dict(values)
    assert message in str(error.value)


def test_train_config_accepts_ints_for_floats_and_tuples_for_lists():
    config = TrainConfig(learning_rate=1, scenarios=("z_mumu_91",), difficulties=("easy",))
    assert config.learning_rate == 1.0 and isinstance(config.learning_rate, float)
    assert config.scenarios == ["z_mumu_91"] and config.difficulties == ["easy"]
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_the_command_line_imports_unsloth_after_parsing_and_before_transformers():
    """Unsloth must patch transformers before it is imported: the command line asks for unsloth
    (where the run may use it) once it has the configuration, before anything imports
    transformers, trl or peft. Checked in a fresh interpreter."""
    probe = (
        "import sys\n"
        "import lib.training.backends as backends\n"
        "seen = []\n"
        "original = backends.import_unsloth_first\n"
        "def spy(config):\n"
        "    seen.append(sorted(m for m in ('transformers', 'trl', 'peft') if m in sys.modules))\n"
        "    return original(config)\n"
        "backends.import_unsloth_first = spy\n"
        "from lib.training.cli import parse_train_config\n"
        "parse_train_config(['--config', 'configs/train/smoke.yaml'])\n"
        "print('SEEN', seen)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    seen = result.stdout.strip().splitlines()[-1]
    assert seen == "SEEN [[]]", f"asked for unsloth once, before transformers, trl and peft: {seen}"


def test_a_configuration_is_checked_without_torch_with_the_engines_generation_knows():
    from lib.episodes.generation import GENERATION_ENGINES
    from lib.episodes.llm_rollouts import CONTEXTS
    from lib.training.config import GENERATION_ENGINES as CONFIG_ENGINES
    from lib.training.config import POLICY_CONTEXTS

    assert CONFIG_ENGINES == GENERATION_ENGINES and POLICY_CONTEXTS == CONTEXTS
    probe = "import sys\nfrom lib.training import TrainConfig\nTrainConfig()\nprint('torch' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr[-1500:]


@pytest.mark.slow
def test_an_output_folder_that_cannot_be_written_stops_the_command_in_one_line(tmp_path):
    """A read-only or misplaced evidence_dir used to fail only after the whole pre-evaluation, with
    a traceback: the command line now stops before loading anything, in one line."""
    (tmp_path / "file").write_text("not a folder")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lib.training",
            "--config",
            "configs/train/smoke.yaml",
            "--evidence_dir",
            str(tmp_path / "file" / "evidence"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m lib.training: error: the evidence folder") and "is a file, not a folder" in last


def test_the_command_ends_with_a_summary_that_says_the_result_and_where_things_went(tmp_path):
    """A run's end is a few lines (not the whole result as JSON): its times, the held-out result
    before and after with the paired interval, and where the policy, evidence, TensorBoard log and
    the whole result are."""
    from lib.training.__main__ import run_summary
    from lib.training.config import TrainConfig
    from lib.training.run import TrainResult

    config = TrainConfig(output_dir=str(tmp_path / "out"), evidence_dir=str(tmp_path / "evidence"))
    result = TrainResult(
        config={},
        backend="trl",
        model_name="cernenv-tiny",
        final_model_dir=str(tmp_path / "out" / "final"),
        evidence={"before_after_metrics": str(tmp_path / "evidence" / "before_after_metrics.json")},
        before_after={
            "pre": {"success_rate": 0.5, "mean_reward": 1.0, "n": 313},
            "post": {"success_rate": 0.56, "mean_reward": 1.4, "n": 313},
            "delta_ci95": {"success_rate": [0.01, 0.11], "mean_reward": [0.1, 0.7]},
        },
        seconds={"total": 185.0, "warm_start": 120.0, "grpo": 40.0, "post_eval": 25.0},
    )
    summary = run_summary(result, config, tmp_path / "out" / "train_result.json")
    lines = summary.splitlines()
    assert lines[0] == "done in 3 min 5 s (warm start 2 min 0 s, grpo 40 s, post eval 25 s)"
    assert "held-out success: 0.500 before GRPO -> 0.560 after (313 episodes, difference [+0.010, +0.110])" in lines
    assert f"TensorBoard: tensorboard --logdir {tmp_path / 'out' / 'runs'}" in lines
    assert lines[-1] == f"everything measured: {tmp_path / 'out' / 'train_result.json'}" and len(lines) <= 8
    validation = TrainConfig(**{**config.to_dict(), "eval_split": "validation", "eval_episodes": 120})
    lines = run_summary(result, validation, tmp_path / "out" / "train_result.json").splitlines()
    assert "validation success: 0.500 before GRPO -> 0.560 after (313 episodes, difference [+0.010, +0.110])" in lines


def test_a_model_that_cannot_be_had_offline_is_said_at_once(tmp_path, monkeypatch):
    """A model id that is neither the stand-in, a folder nor in the Hub cache, with the Hub out of
    reach, is one line before anything loads (it took ~75 s of the Hub client's retries)."""
    import socket

    from lib.training import backends

    def unreachable(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty Hub cache
    problem = backends.model_source_problem("some-org/a-model-nobody-has")
    assert problem and "cannot be reached" in problem and "cernenv-tiny" in problem
    assert backends.model_source_problem(backends.TINY_MODEL) is None
    (tmp_path / "saved").mkdir()
    assert backends.model_source_problem(str(tmp_path / "saved")) is None
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: socket.socket())  # the Hub answers
    assert backends.model_source_problem("some-org/a-model-nobody-has") is None


REFUSAL_PROBE = """
import json, sys
from lib.training.__main__ import main
try:
    main(["--model_name", "nonsense/xyz", "--output_dir", sys.argv[1], "--evidence_dir", sys.argv[2]])
    code = 0
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "loaded": [m for m in ("torch", "transformers", "trl", "peft") if m in sys.modules]}))
"""


def test_an_unknown_model_name_is_refused_before_torch_and_transformers_are_imported(tmp_path):
    """`python -m lib.training --model_name nonsense/xyz` offline was refused after 20 s, the heavy
    imports first: the check needs neither torch nor transformers, so it comes before them."""
    import os

    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = subprocess.run(
        [sys.executable, "-c", REFUSAL_PROBE, str(tmp_path / "out"), str(tmp_path / "evidence")],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    assert probe["code"] == 1 and "'nonsense/xyz'" in result.stderr and "cannot be reached" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # one line, no traceback
    assert probe["loaded"] == [], probe["loaded"]
    assert not (tmp_path / "out").exists(), "refused before anything was written"


def test_evaluations_play_the_validation_split_when_asked():
    """`--eval_split validation`: the pre/post and checkpoint evaluations play validation campaigns,
    none of the held-out suite, so settings can be chosen from the command line."""
    from lib.measure.evaluation import heldout_suite, validation_suite
    from lib.training.config import VALIDATION_EPISODES, TrainConfig
    from lib.training.grpo import checkpoint_suite, evaluation_suite

    config, _ = parse_train_config(["--eval_split", "validation", "--checkpoint_eval_episodes", "7"])
    assert config.eval_split == "validation"
    held_out = {spec.seed for spec in heldout_suite()}
    assert evaluation_suite(config) == list(validation_suite(VALIDATION_EPISODES))
    assert checkpoint_suite(config) == list(validation_suite(7))
    assert not held_out & {spec.seed for spec in evaluation_suite(config) + checkpoint_suite(config)}
    assert evaluation_suite(TrainConfig(eval_split="validation", eval_episodes=30)) == list(validation_suite(30))
    assert {spec.seed for spec in evaluation_suite(TrainConfig())} == held_out, "the default: the held-out suite"
    with pytest.raises(ValueError, match="eval_split must be one of"):
        TrainConfig(eval_split="test")
