"""Packaging hook: wheels carry ops/ (the native sources) as ort_optim/_ops, where ort_optim.backends.native finds them
when it is not running from a checkout. Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithOps(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "ort_optim" / "_ops"
        target.mkdir(parents=True, exist_ok=True)
        for source in (Path(__file__).resolve().parent / "ops").glob("*.cpp"):
            shutil.copy2(source, target / source.name)


setup(cmdclass={"build_py": BuildPyWithOps})
