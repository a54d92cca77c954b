"""Packaging hook: wheels carry ops/ (the native sources) as ort_optim/_ops, where ort_optim.backends.native finds them
when it is not running from a checkout; sdists carry ops/ (MANIFEST.in), so a wheel built from one does too. A build
without the sources fails. Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


OPS = Path(__file__).resolve().parent / "ops"
# What ort_optim.backends.native compiles (its SOURCES), which a wheel must carry.
REQUIRED = ("schema.cpp", "adam_cpu.cpp")


class BuildPyWithOps(build_py):
    def run(self):
        missing = [name for name in REQUIRED if not (OPS / name).is_file()]
        if missing:  # a wheel without them would silently run the pure-PyTorch fallback wherever it is installed
            raise RuntimeError(f"ort_optim's native sources {', '.join(missing)} are not in {OPS}: build from a "
                               "checkout, or from an sdist that carries ops/*.cpp (MANIFEST.in)")
        super().run()
        target = Path(self.build_lib) / "ort_optim" / "_ops"
        target.mkdir(parents=True, exist_ok=True)
        for source in OPS.glob("*.cpp"):
            shutil.copy2(source, target / source.name)


setup(cmdclass={"build_py": BuildPyWithOps})
