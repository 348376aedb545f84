"""The ``bench`` extra: packages that only ``dataio bench`` and ``tools/bench_*`` import (peer loaders,
plots, process sampling), imported when first needed so the runtime installs without them."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL = "pip install 'headrace[bench]'"


def bench_import(module: str, needed_by: str) -> ModuleType:
    """``module``, or an ImportError in one line naming who needs it and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{needed_by} needs {module.split('.')[0]}: {INSTALL}") from e


__all__ = ["INSTALL", "bench_import"]
