"""Loading a Triton kernel module of ``vitcompress/kernels`` under Triton's interpreter
(``TRITON_INTERPRET=1``), so that the CUDA kernels run on CPU tensors: shared by
tests/test_triton_kernel.py and tests/test_triton_tome.py."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

import vitcompress

KERNELS = Path(vitcompress.__file__).parent / "kernels"


def _is_triton_python(name: str) -> bool:
    """Triton's Python modules (its compiled ``triton._C`` cannot be imported twice) and the
    package's Triton helpers the kernel modules import (``kernels/triton_rows.py``), which must
    be decorated by the same interpreted copy as the kernels that call them."""
    if name.startswith("vitcompress.kernels.triton_"):
        return True
    return (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")


def load_interpreted(path: Path, name: str) -> ModuleType:
    """The kernel module at ``path`` loaded afresh as ``name``, with its own copy of Triton's
    Python modules, under ``TRITON_INTERPRET=1`` (set by the caller). Triton picks the
    interpreter when a function is decorated, its own library functions (``tl.max``,
    ``tl.sum``) included, and torch imports Triton at start-up (``torch.utils.flop_counter``): a
    copy made now interprets them all. The copy is taken out of ``sys.modules`` again, so
    everything else keeps the Triton it had."""
    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if _is_triton_python(name)}
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for name in [name for name in sys.modules if _is_triton_python(name)]:
            del sys.modules[name]
        sys.modules.update(saved)


def interpreted_module(path: Path, name: str, smoke: Callable[[ModuleType], object]) -> Iterator:
    """For a module-scoped fixture: yields the module at ``path`` under Triton's interpreter,
    after ``smoke(module)`` ran one small call; skips, with the reason, where Triton is not
    installed or its interpreter cannot run a kernel on CPU tensors here."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed: the CUDA kernel cannot be interpreted here")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        try:
            module = load_interpreted(path, name)
            smoke(module)
        except Exception as error:  # noqa: BLE001 - whatever stops the interpreter here
            pytest.skip(f"Triton's interpreter cannot run a kernel on CPU tensors here: {error}")
        yield module
