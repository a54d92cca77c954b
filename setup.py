"""Packaging hook: wheels carry ops/ (the native sources) as ort_optim/_ops, where ort_optim.backends.native finds them
when it is not running from a checkout; sdists carry ops/ (MANIFEST.in), so a wheel built from one does too. A build
without the sources fails. Everything else is in pyproject.toml."""

import ast
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


ROOT = Path(__file__).resolve().parent
OPS = ROOT / "ops"


def native_sources() -> tuple:
    """What ort_optim.backends.native builds the library from (its SOURCES), which a wheel must carry; read from the
    module's text, as a build environment need not have torch."""
    module = ast.parse((ROOT / "ort_optim" / "backends" / "native.py").read_text())
    for node in module.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SOURCES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("ort_optim/backends/native.py defines no SOURCES")


REQUIRED = native_sources()


class BuildPyWithOps(build_py):
    def run(self):
        missing = [name for name in REQUIRED if not (OPS / name).is_file()]
        if missing:  # a wheel without them would silently run the pure-PyTorch fallback wherever it is installed
            raise RuntimeError(f"ort_optim's native sources {', '.join(missing)} are not in {OPS}: build from a "
                               "checkout, or from an sdist that carries ops/*.cpp and ops/*.h (MANIFEST.in)")
        super().run()
        target = Path(self.build_lib) / "ort_optim" / "_ops"
        target.mkdir(parents=True, exist_ok=True)
        for pattern in ("*.cpp", "*.h"):
            for source in OPS.glob(pattern):
                shutil.copy2(source, target / source.name)


setup(cmdclass={"build_py": BuildPyWithOps})
