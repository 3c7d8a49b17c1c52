"""Import a script of ``benchmarks/`` (not a package) as a module, once per test process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py``, registered as ``name`` (its own imports of sibling scripts and
    of classes defined in it, e.g. for pickling, then resolve)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
