"""Imports point one way: the stored moment formats (ort_optim/formats.py) sit below everything that reads or writes
states, so checkpoints decode and encode them without importing a backend, and a backend uses them without the
formats knowing of it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ort_optim"


def _imported(path: Path) -> set[str]:
    """The ort_optim modules a source file imports (anywhere in it, functions included), as dotted names."""
    package = "ort_optim." + ".".join(path.relative_to(PACKAGE).parent.parts) if path.parent != PACKAGE else "ort_optim"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names}  # (a submodule, when it is one)
    return {name for name in names if name == "ort_optim" or name.startswith("ort_optim.")}


def test_checkpoints_import_no_backend():
    assert not {name for name in _imported(PACKAGE / "_checkpoint.py") if name.startswith("ort_optim.backends")}


def test_the_formats_module_imports_only_the_numeric_spec():
    assert {".".join(name.split(".")[:2]) for name in _imported(PACKAGE / "formats.py")} == {"ort_optim._spec"}


def test_the_reference_backend_reads_and_writes_states_through_the_formats_module():
    imported = _imported(PACKAGE / "backends" / "reference.py")
    assert "ort_optim.formats" in imported
    assert not {name for name in imported if name.startswith("ort_optim.backends.")}
