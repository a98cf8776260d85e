"""The typed command line of a training run: one `--field value` flag per `TrainConfig` field.

    python -m lib.training --config configs/train/smoke.yaml          # a ready-made run (minutes)
    python -m lib.training --config configs/train/colab.yaml --max_steps 3   # flags override the file
    python -m lib.training --help                                     # every field, its type and meaning

Flags are typed from `TrainConfig`'s annotations and documented by its fields' docstrings
(`field_docs`); a config file (YAML, which JSON is too) holds field names. Precedence: the
field's default, then the file, then the flags. A name that is not a field, a value of the
wrong type or out of range, a file that is missing or not YAML, or a `make reproduce` profile
given as a training config, each stops the command with one line that names it and says
what to do.

The parser is plain `argparse` built from `lib/training/config.py`'s source (`config_fields`:
each field's name, annotation, default and docstring, read with `ast`), so building it and
`--help` import nothing of the project (not even the environment, which the configuration's
checks need): a fraction of a second. Once the flags are parsed, `parse_train_config` builds
the `TrainConfig` (whose checks run then) and imports Unsloth when the run may use it
(`lib.training.backends.import_unsloth_first`), before anything imports transformers.
`notebook_config` builds it the same way from notebook 03's parameters cell and a config file.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import sys
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

TRAIN_CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs" / "train"
"""The ready-made training configurations (`--config configs/train/NAME.yaml`)."""
CONFIG_SOURCE = Path(__file__).resolve().with_name("config.py")
NONE_WORDS = ("none", "null", "None")
NO_DEFAULT = object()
"""The default of a field whose factory is not a literal (shown by its docstring instead)."""


@dataclass(frozen=True)
class FieldInfo:
    """One `TrainConfig` field as its source declares it."""

    name: str
    kind: str
    """int, float, str, bool or list (of str)."""
    optional: bool
    """None allowed (`Optional[...]`)."""
    default: Any
    doc: str


def _class_body(source: str, name: str = "TrainConfig") -> List[ast.stmt]:
    tree = ast.parse(textwrap.dedent(source))
    return next(node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == name)


def _docs_of(body: Sequence[ast.stmt]) -> Dict[str, str]:
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


@lru_cache(maxsize=None)
def field_docs(cls: Optional[type] = None) -> Dict[str, str]:
    """The docstring under each annotated attribute of the dataclass `cls` (default: `TrainConfig`,
    read from its source file without importing it), by field name."""
    return _docs_of(_class_body(inspect.getsource(cls) if cls is not None else CONFIG_SOURCE.read_text()))


def _kind_of(annotation: ast.expr) -> Tuple[str, bool]:
    text = ast.unparse(annotation)
    optional = text.startswith("Optional[")
    inner = text[len("Optional[") : -1] if optional else text
    if inner.startswith(("List[", "list[")):
        return "list", optional
    if inner not in ("int", "float", "str", "bool"):
        raise TypeError(f"TrainConfig field annotated {text}: the command line knows int, float, str, bool, List[str]")
    return inner, optional


def _default_of(value: Optional[ast.expr]) -> Any:
    if value is None:
        return NO_DEFAULT
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "field":
        factory = next((k.value for k in value.keywords if k.arg == "default_factory"), None)
        if isinstance(factory, ast.Lambda):
            value = factory.body
        elif factory is not None:
            return NO_DEFAULT
        else:
            value = next((k.value for k in value.keywords if k.arg == "default"), None)
    try:
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError):
        return NO_DEFAULT


@lru_cache(maxsize=None)
def config_fields() -> Tuple[FieldInfo, ...]:
    """`TrainConfig`'s fields, in order, from `lib/training/config.py`'s source (no import)."""
    body = _class_body(CONFIG_SOURCE.read_text())
    docs = _docs_of(body)
    return tuple(
        FieldInfo(node.target.id, *_kind_of(node.annotation), _default_of(node.value), docs.get(node.target.id, ""))
        for node in body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    )


class ConfigError(ValueError):
    """A configuration that cannot be used; the message is one line that says what to do."""


def _bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"invalid bool value: {text!r} (true or false)")


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_or_none(text: str) -> Any:
        return None if text in NONE_WORDS else parse(text)

    parse_or_none.__name__ = getattr(parse, "__name__", "value")  # argparse names the type in its errors
    return parse_or_none


def field_kind(name: str) -> Tuple[str, bool]:
    """(the base type's name: int, float, str, bool or list, whether None is allowed) of a field."""
    info = next(f for f in config_fields() if f.name == name)
    return info.kind, info.optional


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (the usage of ~50 flags is left to --help)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (--help lists every flag)\n")


def train_config_parser(
    prog: str = "python -m lib.training", description: Optional[str] = None, argv: Optional[Sequence[str]] = None
) -> argparse.ArgumentParser:
    """An argparse parser with `--config` and one typed flag per `TrainConfig` field, each flag's
    help its field's docstring, type and default. Add a script's own flags to it with
    `add_argument`; `parse_train_config` returns them too. (`argv` is accepted for callers of
    the earlier parser, which read it; it is not used.)"""
    parser = _Parser(
        allow_abbrev=False,
        prog=prog,
        description=description or __doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # a flag not given is absent: the file's value stays
    )
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help=f"a YAML (or JSON) file of TrainConfig fields, e.g. {_ready_made()}; flags given beside it override it",
    )
    group = parser.add_argument_group("TrainConfig fields (lib/training/config.py)")
    for f in config_fields():
        kind, optional, default = f.kind, f.optional, f.default
        text = " ".join(f.doc.split()).replace("%", "%%")
        shown = "none" if default == [] else (" ".join(default) if isinstance(default, list) else default)
        kind_text = "list of str" if kind == "list" else kind
        help_text = f"[{kind_text}{' or None' if optional else ''}] {text}" + (
            "" if default is NO_DEFAULT else f" (default: {shown})"
        )
        flags = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])  # as TRL spells them
        if kind == "bool":
            group.add_argument(*flags, type=_bool, nargs="?", const=True, metavar="true|false", help=help_text)
            if default is True:
                negative = [f"--no_{f.name}"] + ([f"--no-{f.name.replace('_', '-')}"] if "_" in f.name else [])
                group.add_argument(*negative, dest=f.name, action="store_false", help=f"--{f.name} false")
        elif kind == "list":
            group.add_argument(*flags, nargs="+", metavar="NAME", help=help_text)
        else:
            parse = {"int": int, "float": float, "str": str}[kind]
            metavar = kind.upper() + ("|None" if optional else "")
            group.add_argument(*flags, type=_optional(parse) if optional else parse, metavar=metavar, help=help_text)
    return parser


def _ready_made() -> str:
    names = sorted(p.name for p in TRAIN_CONFIGS_DIR.glob("*.yaml")) if TRAIN_CONFIGS_DIR.is_dir() else []
    return ", ".join(f"configs/train/{name}" for name in names) or "configs/train/NAME.yaml"


def _coerce(name: str, value: Any) -> Any:
    """A file's value for field `name` as the field takes it: YAML reads `1e-4` (no dot) as a
    string and `nan` as a string; numbers written so are read as the floats they are."""
    kind, optional = field_kind(name)
    if optional and value in NONE_WORDS:
        return None
    if kind == "float" and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def read_config_file(path: Union[str, Path]) -> Dict[str, Any]:
    """The `TrainConfig` fields of a YAML (or JSON) file, coerced (`_coerce`); `ConfigError`, one
    line, for a file that is missing, a folder, unreadable, not YAML, not a mapping, a `make
    reproduce` profile, or that names fields `TrainConfig` does not have."""
    import yaml

    from lib.yaml_files import YAMLRefused, load_yaml

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give a YAML file, e.g. {_ready_made()}")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; ready-made ones: {_ready_made()}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"config file {path} cannot be read: {error}") from None
    try:
        values = load_yaml(text)
    except YAMLRefused as error:
        raise ConfigError(f"config file {path} is refused: {error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ConfigError(f"config file {path} is not valid YAML{where}: {problem}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(
            f"config file {path} holds a {type(values).__name__}, not a mapping of TrainConfig fields to values"
        )
    if "notebooks" in values:
        raise ConfigError(
            f"{path} is a `make reproduce` profile (it lists notebooks), not a training config; "
            f"give one of {_ready_made()} (`make reproduce PROFILE={path.stem}` runs the profile)"
        )
    known = [f.name for f in config_fields()]
    unknown = [str(key) for key in values if key not in known]
    if unknown:
        from lib.training.config import shown

        names = [key if len(key) <= 60 and key.isprintable() else shown(key, 60) for key in unknown[:8]]
        hints = [
            f"{name} (did you mean {match[0]}?)" if match else name
            for key, name in zip(unknown, names)
            for match in [difflib.get_close_matches(key[:200], known, n=1)]
        ]
        more = f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
        raise ConfigError(f"config file {path} names fields TrainConfig does not have: {', '.join(hints)}{more}")
    return {key: _coerce(key, value) for key, value in values.items()}


def load_config_file(path: Union[str, Path]) -> Any:
    """The `TrainConfig` a file sets over the defaults: a configs/train/*.yaml, or the
    train_config.json a run wrote (JSON reads as YAML); `ConfigError` (`read_config_file`'s) or
    TrainConfig's own ValueError for one it cannot be."""
    from lib.training.config import TrainConfig

    return TrainConfig.from_dict(read_config_file(path))


def _one_line(error: ValueError) -> str:
    """TrainConfig's problems (one per line after a heading) as one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} " + "; ".join(lines[1:])
    return "; ".join(lines)


def parse_train_config(
    argv: Optional[Sequence[str]] = None,
    parser: Optional[argparse.ArgumentParser] = None,
    *,
    check_model_source: bool = False,
    **fixed: Any,
) -> Tuple[Any, argparse.Namespace]:
    """(TrainConfig, the script's other flags) from a command line: the defaults, then `--config`'s
    file, then the flags, then `fixed`. Exits (status 2) with one line naming the field, or the
    file, on a bad name or value; with `check_model_source` (a run about to train), also (status 1)
    on a `model_name` that cannot be had here (`lib.training.model_source`), before torch is
    imported. Once the configuration is known, imports Unsloth when the run may use it (before
    anything imports transformers)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = parser or train_config_parser()
    namespace = parser.parse_args(argv)
    given = vars(namespace)
    names = {f.name for f in config_fields()}
    from lib.training.config import TrainConfig  # imports the environment: after --help has had its turn

    try:
        values = read_config_file(given["config"]) if given.get("config") else {}
        values.update({name: value for name, value in given.items() if name in names})
        values.update(fixed)
        config = TrainConfig.from_dict(values)
    except ValueError as error:  # ConfigError, or TrainConfig's own checks
        parser.error(_one_line(error))
    extra = argparse.Namespace(**{name: value for name, value in given.items() if name not in names})
    for action in parser._actions:  # the script's own flags not given: their defaults
        if action.dest not in names and action.dest not in ("help", "config") and not hasattr(extra, action.dest):
            setattr(extra, action.dest, None if action.default is argparse.SUPPRESS else action.default)
    from lib.training.model_source import model_source_problem

    problem = model_source_problem(config.model_name) if check_model_source and config.model_name else None
    if problem:  # said in seconds, before torch and transformers are imported
        parser.exit(1, f"{parser.prog}: error: {problem}\n")
    from lib.training.backends import import_unsloth_first

    import_unsloth_first(config)
    return config, extra


NOT_TYPED = ...
"""A notebook 03 parameter left as `...`: the value of the config file, else `TrainConfig`'s default."""


@dataclass(frozen=True)
class NotebookValues:
    """The fields notebook 03's run sets, each with where its value came from."""

    values: Dict[str, Any]
    """The fields the file and the parameters set (the rest keep `TrainConfig`'s defaults)."""
    sources: Dict[str, str]
    """Each field of `values`, and each parameter left as `...`: "typed" (the notebook's parameters
    or papermill's), the config file's path as given, or "default"."""


def _notebook_values(
    namespace: Dict[str, Any],
    train_config: Optional[str],
    *,
    root: Path,
    gpu: Optional[bool],
    folders: Optional[Path],
) -> NotebookValues:
    from lib.training.config import field_defaults

    if train_config is None:
        if gpu is None:
            from lib.runtime import visible_gpus

            gpu = bool(visible_gpus())
        train_config = "configs/train/colab.yaml" if gpu else None
    values: Dict[str, Any] = {}
    sources: Dict[str, str] = {}
    if train_config:
        path = Path(train_config)
        from_file = read_config_file(path if path.is_absolute() else root / path)
        values.update(from_file)
        sources.update(dict.fromkeys(from_file, str(train_config)))
    defaults = field_defaults()
    parameters = {name: namespace[name] for name in defaults if name in namespace}
    typed = {name: value for name, value in parameters.items() if value is not NOT_TYPED}
    values.update(typed)
    sources.update(dict.fromkeys(typed, "typed"))
    sources.update({name: "default" for name in parameters if name not in sources})
    merged = {**defaults, **values}
    base = Path(folders) if folders is not None else root
    for name in ("evidence_dir", "output_dir"):
        if isinstance(merged[name], str) and not Path(merged[name]).is_absolute():
            values[name] = str(base / merged[name])
    return NotebookValues(values, sources)


def notebook_config(
    namespace: Dict[str, Any],
    train_config: Optional[str] = None,
    *,
    root: Any,
    gpu: Optional[bool] = None,
    folders: Any = None,
    resume_latest: bool = False,
) -> Any:
    """The `TrainConfig` of notebook 03 (and of `make reproduce`'s check of its parameters).

    The file `train_config` (a configs/train/*.yaml; relative paths from `root`), or with None
    configs/train/colab.yaml on a machine with a GPU (`gpu`, default: asked of nvidia-smi) and
    no file on a CPU, sets the fields; then every field the namespace (the parameters cell, with
    what papermill injected) sets to a value, whatever it equals, replaces the file's; a field
    left as `...` (`NOT_TYPED`) keeps the file's value, else its default. Relative `evidence_dir`
    and `output_dir` are taken from `folders` (default: `root`; on Colab with Google Drive
    mounted, a folder on the Drive). With `resume_latest`, a run whose `output_dir` already holds
    a complete checkpoint resumes from it unless `resume_from_checkpoint` is typed or in the file: the notebook run
    again after a disconnect goes on where the last checkpoint left it."""
    from lib.training.config import TrainConfig

    root = Path(root)
    resolved = _notebook_values(
        namespace, train_config, root=root, gpu=gpu, folders=Path(folders) if folders is not None else None
    )
    values = dict(resolved.values)
    if resume_latest and "resume_from_checkpoint" not in resolved.sources:
        from lib.training.resume import latest_complete_checkpoint

        output_dir = Path(values.get("output_dir") or TrainConfig.output_dir)
        if output_dir.is_dir() and latest_complete_checkpoint(output_dir) is not None:
            values["resume_from_checkpoint"] = "latest"
    return TrainConfig.from_dict(values)


def notebook_config_markdown(
    config: Any,
    namespace: Dict[str, Any],
    train_config: Optional[str] = None,
    *,
    root: Any,
    gpu: Optional[bool] = None,
    folders: Any = None,
) -> str:
    """A table of the values `config` (`notebook_config`'s, from the same arguments) runs with: every
    parameter of the notebook and every field the config file sets, each with where its value came
    from (typed in the notebook, the file, or `TrainConfig`'s default)."""
    resolved = _notebook_values(
        namespace, train_config, root=Path(root), gpu=gpu, folders=Path(folders) if folders is not None else None
    )
    used = config.to_dict()
    lines = ["| field | value this run uses | from |", "|---|---|---|"]
    for name in [f.name for f in config_fields() if f.name in resolved.sources]:
        source = resolved.sources[name]
        where = {"typed": "typed here", "default": "TrainConfig's default"}.get(source, f"`{source}`")
        value = used.get(name)
        shown = "None" if value is None else str(value).replace("|", "\\|")
        lines.append(f"| `{name}` | `{shown}` | {where} |")
    if used.get("resume_from_checkpoint") and "resume_from_checkpoint" not in resolved.sources:
        lines.append(f"| `resume_from_checkpoint` | `{used['resume_from_checkpoint']}` | a checkpoint in output_dir |")
    return "\n".join(lines)
