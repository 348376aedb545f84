"""The folder of each installed package, read from the one place it is written: ``pyproject.toml``'s
``[tool.setuptools.package-dir]`` (``headrace.config`` -> ``configtree/``, ...).

The checkout keeps the runtime's folders at its top level and installs them as ``headrace.*``; tests and
tools that walk the runtime's source (the bare-import guard, the dependency and torch-floor checks, the
namespace test) take the folder names from here instead of spelling them again. Cost: one TOML read.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIRS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
RUNTIME_FOLDERS: tuple[str, ...] = tuple(PACKAGE_DIRS.values())  # the folders of the runtime code
