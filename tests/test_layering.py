"""The import graph, read from the source with `ast` (nothing is imported): arrows point down only.

    lib/notebooks/   running and exporting the notebooks
    lib/training/    the GRPO run, its config and CLI, backends, warm start, the CPU stand-in
    lib/report/      evidence files and figures, plots, episode Markdown, replay, the browser
    lib/measure/     metrics, the evaluation suite, the before/after comparison
    lib/episodes/    playing episodes and their records
    lib/agents/      scripted baselines, the LLM prompt and reply parser
    lib/*.py         plumbing: files, progress, extras, runtime, gpu_set
    cernenv/         the environment: imports no lib and no ML library

A module may import its own floor and the floors below; imports inside functions count too
(they run sooner or later), and no files form a cycle, whether on one floor or across floors.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]

LIB_FLOORS = ("lib", "lib.agents", "lib.episodes", "lib.measure", "lib.report", "lib.training", "lib.notebooks")
"""lib's floors, bottom first; `lib` itself is the plumbing (its top-level modules)."""

ML_LIBRARIES = ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "unsloth", "tensorboard")
"""What cernenv never imports: an OpenEnv user installs the environment alone."""


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules(package: str, root: Path = ROOT) -> Dict[str, Path]:
    """Every module of `package` (a folder under `root`): dotted name → file."""
    return {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}


def imports_of(path: Path, name: str, is_module=lambda target: True) -> Iterator[Tuple[str, int]]:
    """(imported module, line) for every import in the file, at any depth (functions, classes,
    `if TYPE_CHECKING:` blocks). `from a import b` is an import of `a.b` where `is_module("a.b")`,
    else of `a`. Relative imports are resolved against `name`."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield (submodule if is_module(submodule) else base), node.lineno


def import_graph(modules: Dict[str, Path]) -> Dict[str, Dict[str, int]]:
    """module → {module of `modules` it imports: first line}. An import of a package is an arrow
    to its `__init__`; the parent packages Python runs on the way to a submodule are left out
    (every submodule would otherwise import its own package, and a package that imports its
    submodules would form a cycle with each)."""
    graph: Dict[str, Dict[str, int]] = {}
    for name, path in modules.items():
        arrows: Dict[str, int] = {}
        for target, line in imports_of(path, name, modules.__contains__):
            if target in modules and target != name:
                arrows.setdefault(target, line)
        graph[name] = arrows
    return graph


def floor_of(name: str) -> str:
    """The floor of a module of lib: its subpackage, or `lib` for the plumbing."""
    parts = name.split(".")
    candidate = ".".join(parts[:2])
    return candidate if candidate in LIB_FLOORS else "lib"


def upward_imports(graph: Dict[str, Dict[str, int]], modules: Dict[str, Path], root: Path = ROOT) -> List[str]:
    level = {floor: i for i, floor in enumerate(LIB_FLOORS)}
    found = []
    for name, arrows in graph.items():
        for target, line in arrows.items():
            if level[floor_of(target)] > level[floor_of(name)]:
                where = modules[name].relative_to(root)
                found.append(f"{where}:{line}: {name} ({floor_of(name)}) imports {target} ({floor_of(target)})")
    return found


def cycles(graph: Dict[str, Dict[str, int]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def describe_cycle(component: List[str], graph: Dict[str, Dict[str, int]]) -> str:
    members = set(component)
    arrows = [f"{a} -> {b} (line {line})" for a in component for b, line in graph[a].items() if b in members]
    return "; ".join(arrows)


@pytest.fixture(scope="module")
def lib_modules() -> Dict[str, Path]:
    return source_modules("lib")


def test_every_subpackage_of_lib_is_a_floor():
    subpackages = {f"lib.{init.parent.name}" for init in (ROOT / "lib").glob("*/__init__.py")}
    assert subpackages <= set(LIB_FLOORS), f"add to LIB_FLOORS, in its place: {sorted(subpackages - set(LIB_FLOORS))}"


def test_no_module_of_lib_imports_upward(lib_modules):
    found = upward_imports(import_graph(lib_modules), lib_modules)
    assert not found, "imports that run up lib's floors (split the module, or move it up):\n" + "\n".join(found)


def test_no_modules_of_lib_form_an_import_cycle(lib_modules):
    graph = import_graph(lib_modules)
    found = [describe_cycle(component, graph) for component in cycles(graph)]
    assert not found, "import cycles in lib (imports inside functions count):\n" + "\n".join(found)


def test_cernenv_imports_no_lib_no_ml_library_and_no_cycle():
    modules = source_modules("cernenv")
    forbidden = ("lib", "bench", "tests", *ML_LIBRARIES)
    found = [
        f"{path.relative_to(ROOT)}:{line}: {target}"
        for name, path in modules.items()
        for target, line in imports_of(path, name)
        if target.split(".")[0] in forbidden
    ]
    assert not found, "cernenv imports what only the learning side may:\n" + "\n".join(found)
    graph = import_graph(modules)
    assert not cycles(graph), [describe_cycle(component, graph) for component in cycles(graph)]


def test_the_checks_catch_a_planted_cycle_and_an_upward_import(tmp_path):
    """The checks above on a small tree with a hidden cycle (an import inside a function, as
    `policy_model` once imported `lib.training.callbacks` while training imported `policy_model`)."""
    (tmp_path / "lib" / "agents").mkdir(parents=True)
    (tmp_path / "lib" / "training").mkdir()
    files = {
        "lib/__init__.py": "",
        "lib/files.py": "",
        "lib/agents/__init__.py": "",
        "lib/agents/baselines.py": "from lib.files import x\n\ndef later():\n    from lib.training import run\n",
        "lib/training/__init__.py": "",
        "lib/training/run.py": "from . import model\n",
        "lib/training/model.py": "def f():\n    import lib.training.run\n",
    }
    for relative, text in files.items():
        (tmp_path / relative).write_text(text)
    modules = source_modules("lib", tmp_path)
    graph = import_graph(modules)
    assert graph["lib.training.run"] == {"lib.training.model": 1}
    assert cycles(graph) == [["lib.training.model", "lib.training.run"]]
    assert upward_imports(graph, modules, tmp_path) == [
        "lib/agents/baselines.py:4: lib.agents.baselines (lib.agents) imports lib.training.run (lib.training)"
    ]


def test_the_layout_page_names_every_module_of_lib(lib_modules):
    page = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    layout = page[page.index("## `lib/`, floor by floor") :]
    missing = [
        str(path.relative_to(ROOT / "lib"))
        for path in lib_modules.values()
        if path.name != "__init__.py" and f"| `{path.relative_to(ROOT / 'lib')}` |" not in layout
    ]
    assert not missing, f"docs/layout.md's table of lib/ should give each module a line: {missing}"


def test_every_command_line_refuses_abbreviated_flags():
    """argparse accepts `--max-step` for `--max_steps` unless told not to: a typo would pass as
    another flag. Every parser of the repository says `allow_abbrev=False` (read from the source)."""
    import ast

    parsers, missing = 0, []
    for folder in ("cernenv", "lib", "bench", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "ArgumentParser",
                    "_Parser",
                ):
                    parsers += 1
                    flags = {k.arg: getattr(k.value, "value", None) for k in node.keywords}
                    if flags.get("allow_abbrev") is not False:
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert parsers >= 15 and not missing, missing
