"""ort_optim's modules import one another in one direction: the import graph, read from the source (every import
statement, those inside functions and under ``if TYPE_CHECKING`` included), has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "ort_optim"


def _module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of a relative import `from {'.' * level}{name} import ...` made in module."""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the ort_optim modules it imports anywhere in its source. `from . import x` counts as an import of
    the submodule x when there is one, else of the package."""
    files = {_module_name(path, package): path for path in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module) if node.level else node.module or ""
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import ort_optim.x.y` names x.y: the deepest module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_import_graph_of_ort_optim_has_no_cycle():
    graph = import_graph()
    assert "ort_optim.fused_adam" in graph and "ort_optim.backends.native" in graph  # (the graph was read)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("sources,cycle", [
    ({"a.py": "from . import b\n", "b.py": "def f():\n    from .a import x\n"}, True),
    ({"a.py": "from . import b\n", "b.py": "import os\n"}, False),
    ({"a.py": "from .sub import c\n", "sub/__init__.py": "", "sub/c.py": "from .. import a\n"}, True),
    ({"a.py": "import pkg.b\n", "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n"},
     True),
])
def test_the_cycle_check_finds_imports_inside_functions_and_packages(tmp_path, sources, cycle):
    package = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **sources}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    assert (find_cycle(import_graph(package)) is not None) == cycle


# The stored moment formats (ort_optim/formats.py) sit below everything that reads or writes states: checkpoints
# decode and encode them without importing a backend, and a backend uses them without the formats knowing of it.
def test_checkpoints_import_no_backend():
    assert not {name for name in import_graph()["ort_optim._checkpoint"] if name.startswith("ort_optim.backends")}


def test_the_formats_module_imports_only_the_numeric_spec():
    assert import_graph()["ort_optim.formats"] == {"ort_optim._spec"}


# The reference backend checks the op's arguments through the module the Python backends share for it
# (backends/_validation.py), and imports no other backend.
def test_the_reference_backend_reads_and_writes_states_through_the_formats_module():
    imported = import_graph()["ort_optim.backends.reference"]
    assert "ort_optim.formats" in imported
    assert {name for name in imported if name.startswith("ort_optim.backends.")} == {"ort_optim.backends._validation"}
