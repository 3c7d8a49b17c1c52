"""vitcompress: compress any Vision Transformer by joint Token Pruning & Squeezing (TPS).

``import vitcompress`` itself imports neither torch nor timm, so that the command line has its
Ctrl-C handling in place before those seconds of imports (``vitcompress/cli/main.py``): the
public names (``compress``, ``load``, ``map_model``, ``save``) and the subpackages
(``vitcompress.measure``, ...) are imported on first use (PEP 562). The zoo's models (``pvt_*``,
``cvt_*``, ``segmenter_*``) are still in timm's registry wherever timm is used after
``import vitcompress``: they are registered as soon as timm is imported, or at once where it
already is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from vitcompress.version import __version__

if TYPE_CHECKING:
    from vitcompress.api import compress, load, map_model, save

__all__ = ["__version__", "compress", "load", "map_model", "save"]

_API = ("compress", "load", "map_model", "save")
_ZOO = f"{__name__}.zoo"


def __getattr__(name: str) -> Any:
    """A public name of ``vitcompress.api``, or a subpackage, imported the first time it is asked
    for (then kept, so later reads do not come here)."""
    if name in _API:
        value = getattr(importlib.import_module(f"{__name__}.api"), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # also sets it on the package
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_API})


class _ZooAfterTimm(importlib.abc.MetaPathFinder):
    """Registers the zoo right after timm's first import: finds timm as the other finders do and
    imports ``vitcompress.zoo`` once timm's module has run. Used once, then removed."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "timm":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_timm = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_timm(module)
            importlib.import_module(_ZOO)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if "timm" in sys.modules:
    importlib.import_module(_ZOO)
elif not any(isinstance(finder, _ZooAfterTimm) for finder in sys.meta_path):
    sys.meta_path.insert(0, _ZooAfterTimm())
