"""The typed command line of a training run (lib/training/cli.py) and TrainConfig's type checks."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from lib.training.cli import field_docs, parse_train_config, train_config_parser
from lib.training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def test_every_field_has_a_documented_typed_flag():
    docs = field_docs(TrainConfig)
    assert set(docs) == {f.name for f in fields(TrainConfig)}  # a field without a docstring fails here
    parser = train_config_parser()
    helps = {action.dest: action.help for action in parser._actions}
    for f in fields(TrainConfig):
        assert helps.get(f.name), f"--{f.name} has no help"
        assert " ".join(docs[f.name].split())[:40] in helps[f.name]
    assert "(default: 14)" in helps["max_steps"]


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


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max_steps", "three"], "--max_steps/--max-steps: invalid int value: 'three'"),
        (["--scenarios", "atlantis"], "unknown scenarios ['atlantis']"),
        (["--num_generations", "3"], "must be a multiple of num_generations"),
        (["--no_such_field", "1"], "not used by the HfArgumentParser: ['--no_such_field'"),
    ],
)
def test_bad_flags_exit_with_a_message_that_names_the_field(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_train_config(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_steps: three\n", "invalid int value: 'three'"),
        ("max_stepz: 3\n", "--max_stepz"),
        ("temperature: [1, 2]\n", "temperature"),
    ],
)
def test_bad_config_files_exit_with_a_message_that_names_the_field(tmp_path, text, message, capsys):
    config_file = tmp_path / "run.yaml"
    config_file.write_text(text)
    with pytest.raises(SystemExit):
        parse_train_config(["--config", str(config_file)])
    assert message in capsys.readouterr().err


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


def test_help_runs_from_the_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "lib.training", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--max_steps MAX_STEPS" in result.stdout and "Optimisation steps" in result.stdout


def test_the_command_line_imports_unsloth_before_transformers():
    """TrlParser imports transformers, which Unsloth must patch first: the CLI asks for unsloth
    (where the run may use it) before it builds the parser. Checked in a fresh interpreter."""
    probe = (
        "import sys\n"
        "import lib.training.backends as backends\n"
        "seen = []\n"
        "original = backends.import_unsloth_first\n"
        "def spy(config):\n"
        "    seen.append(sorted(m for m in ('transformers', 'trl', 'peft') if m in sys.modules))\n"
        "    return original(config)\n"
        "backends.import_unsloth_first = spy\n"
        "from lib.training.__main__ import main\n"
        "try:\n"
        "    main(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
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
