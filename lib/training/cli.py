"""The typed command line of a training run: one `--field value` flag per `TrainConfig` field.

    python -m lib.training --max_steps 10 --learning_rate 1e-4
    python -m lib.training --config configs/train/my_run.yaml --max_steps 3   # flags override the file
    python -m lib.training --help                                              # every field, its type and meaning

The parser is TRL's `TrlParser` (transformers' `HfArgumentParser` with YAML config files):
flags are typed from the dataclass annotations, and the help of each is the field's
docstring in `lib/training/config.py` (`field_docs`). A config file holds `TrainConfig`
field names (JSON is YAML too); an unknown name or a value of the wrong type is an error
that names the field.

TrlParser imports transformers, which Unsloth must patch first: `parse_train_config` imports
unsloth before it when the run may use it (the backend, from the flags or the file, is read
first with a plain parser).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import textwrap
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from lib.training.config import BACKENDS, TrainConfig


@lru_cache(maxsize=None)
def field_docs(cls: type = TrainConfig) -> Dict[str, str]:
    """The docstring under each annotated attribute of the dataclass `cls`, by field name."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # the class statement's body
    docs: Dict[str, str] = {}
    for statement, following in zip(body, body[1:]):
        if (
            isinstance(statement, ast.AnnAssign)
            and isinstance(statement.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = inspect.cleandoc(following.value.value)
    return docs


def _backend_first(argv: Sequence[str]) -> str:
    """The backend a command line asks for (its flag, else its config file's, else the default)."""
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--backend")
    peek.add_argument("--config")
    known, _ = peek.parse_known_args(list(argv))
    if known.backend:
        return known.backend
    if known.config and Path(known.config).is_file():
        import yaml

        try:
            values = yaml.safe_load(Path(known.config).read_text())
        except yaml.YAMLError:
            values = None  # the real parser reports it
        if isinstance(values, dict) and isinstance(values.get("backend"), str):
            return values["backend"]
    return TrainConfig.backend


def import_unsloth_for(argv: Optional[Sequence[str]] = None) -> None:
    """`import_unsloth_first` for the backend a command line asks for (default: this process's)."""
    from lib.training.backends import import_unsloth_first

    backend = _backend_first(list(sys.argv[1:] if argv is None else argv))
    import_unsloth_first(TrainConfig(backend=backend if backend in BACKENDS else "auto"))


def train_config_parser(
    prog: str = "python -m lib.training", description: Optional[str] = None, argv: Optional[Sequence[str]] = None
) -> Any:
    """A `TrlParser` over `TrainConfig`, each flag's help its field's docstring (and default).
    Add a script's own flags to it with `add_argument`; `parse_train_config` returns them too.
    Unsloth is imported first when the command line (`argv`, default this process's) may use it."""
    import_unsloth_for(argv)
    from trl import TrlParser  # imports transformers: after unsloth

    parser = TrlParser(
        TrainConfig, prog=prog, description=description or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    docs = field_docs(TrainConfig)
    for action in parser._actions:
        name = action.dest
        if name in docs:
            shown = action.default is not None and not isinstance(action.default, list)
            default = f" (default: {action.default})" if shown else ""
            action.help = " ".join(docs[name].split()).replace("%", "%%") + default
    return parser


def parse_train_config(
    argv: Optional[Sequence[str]] = None, parser: Any = None, **fixed: Any
) -> Tuple[TrainConfig, argparse.Namespace]:
    """(TrainConfig, the script's other flags) from a command line; `fixed` fields override both
    the file and the flags. Exits with a message naming the field on a bad name or value."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = parser or train_config_parser(argv=argv)  # which imports unsloth first where it may be used
    try:
        outputs: List[Any] = list(parser.parse_args_and_config(args=argv))
    except ValueError as error:  # TrainConfig's own checks, or an unknown key in the config file
        parser.error(str(error))
    config = outputs[0]
    extra = outputs[1] if len(outputs) > 1 else argparse.Namespace()
    if fixed:
        try:
            config = TrainConfig.from_dict({**config.to_dict(), **fixed})
        except ValueError as error:
            parser.error(str(error))
    return config, extra
