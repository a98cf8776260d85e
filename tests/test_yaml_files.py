"""Configuration files are read without aliases, deep nesting or duplicate keys, each refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lib.training.cli import ConfigError, read_config_file
from lib.yaml_files import MAX_DEPTH, YAMLRefused, load_yaml

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(9)
)


@pytest.mark.parametrize(
    "text, message",
    [
        (BOMB, "an alias (*name) at line 2"),
        ("[" * 100_000 + "]" * 100_000, f"nesting deeper than {MAX_DEPTH} levels"),
        ("".join("  " * i + f"k{i}:\n" for i in range(300)) + "  " * 300 + "v: 1\n", "nesting deeper than"),
        ("x" * 1_000_001, "larger than 1,000,000 bytes"),
        ("max_steps: 10\nlearning_rate: 1e-5\nmax_steps: 20\n", "the key 'max_steps' appears twice (lines 1 and 3)"),
        ("{a: 1, a: 2}", "the key 'a' appears twice"),
    ],
)
def test_a_hostile_file_is_refused_in_one_short_line(tmp_path, text, message):
    with pytest.raises(YAMLRefused, match="^.{0,200}$") as error:
        load_yaml(text)
    assert message in str(error.value)
    path = tmp_path / "train.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="is refused: "):
        read_config_file(path)


def test_the_project_s_own_files_load_as_before():
    import yaml

    for path in (
        "configs/train/default.yaml",
        "configs/train/smoke.yaml",
        "configs/train/colab.yaml",
        "configs/full.yaml",
    ):
        with open(path) as handle:
            text = handle.read()
        assert load_yaml(text) == yaml.safe_load(text)


def test_the_training_command_answers_a_duplicate_key_with_one_line(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("max_steps: 1\nmax_steps: 2\n")
    run = subprocess.run(
        [sys.executable, "-m", "lib.training", "--config", str(path)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "appears twice (lines 1 and 2)" in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_config_texts_are_bounded_and_printable_and_echoed_short(tmp_path):
    """A model id or path is a short printable text: a pasted file or a control character is
    refused naming the field, and no error echoes a value unbounded."""
    from lib.training.config import MAX_TEXT_CHARACTERS, TrainConfig

    for fields, problem in (
        ({"model_name": "m" * (MAX_TEXT_CHARACTERS + 1)}, "model_name is 1025 characters long"),
        ({"output_dir": "outputs/\x00grpo"}, "output_dir holds a control character"),
        ({"evidence_dir": "build/\nevidence"}, "evidence_dir holds a control character"),
        ({"scenarios": ["s" * 5000]}, "scenarios is 5000 characters long"),
    ):
        with pytest.raises(ValueError, match=problem) as error:
            TrainConfig(**fields)
        assert len(str(error.value)) < 300
    path = tmp_path / "many.yaml"
    path.write_text("".join(f"{'k' * 500}{i}: 1\n" for i in range(50)))
    with pytest.raises(ConfigError, match="and 42 more") as error:
        read_config_file(path)
    assert len(str(error.value)) < 1000


def test_a_path_s_names_are_bounded_by_what_the_file_system_takes_and_the_model_s_by_its_warm_start_folder(
    tmp_path,
):
    """A 1,000-character model_name passed the 1,024-character check and ended in `OSError: File name
    too long` (its cached warm start is the folder `<name>-<fingerprint>`); a folder's name longer
    than the file system takes is refused before anything is made."""
    from lib.files import check_writable_dir, name_max_bytes
    from lib.training.config import FINGERPRINT_CHARACTERS, TrainConfig

    most = name_max_bytes(tmp_path)
    assert most == os.pathconf(tmp_path, "PC_NAME_MAX")
    longest_model = most - FINGERPRINT_CHARACTERS - 1
    TrainConfig(model_name="org/" + "m" * longest_model)
    for fields, problem in (
        ({"model_name": "m" * 1000}, f"model_name holds a name of 1000 bytes .* at most {longest_model} "),
        ({"model_name": "org/" + "m" * (longest_model + 1)}, f"at most {longest_model} "),
        ({"output_dir": "outputs/" + "o" * (most + 1)}, f"output_dir holds a name of {most + 1} bytes"),
        ({"evidence_dir": "é" * (most // 2 + 1)}, f"evidence_dir holds a name of {2 * (most // 2 + 1)} bytes"),
    ):
        with pytest.raises(ValueError, match=problem) as error:
            TrainConfig(**fields)
        assert len(str(error.value)) < 300
    TrainConfig(output_dir="outputs/" + "o" * most)
    with pytest.raises(OSError, match=rf"holds a name of {most + 1} bytes .* choose a shorter path"):
        check_writable_dir(tmp_path / ("x" * (most + 1)) / "evidence")
    assert not any(tmp_path.iterdir()), "nothing made"
