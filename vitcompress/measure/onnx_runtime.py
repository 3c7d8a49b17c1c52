"""An exported ONNX file as a runner for :func:`~.throughput.measure_callables`: one batch through
an onnxruntime session on the CPU, with the same threads torch times with."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vitcompress.errors import UserError

__all__ = [
    "EXPORT_EXTRA",
    "MissingExtraError",
    "onnx_runner",
    "onnx_session",
    "onnxruntime_version",
    "require_export_extra",
]

# The install line for the optional packages ONNX needs (pyproject's ``export`` extra), from a
# checkout of this project.
EXPORT_EXTRA = 'pip install -e ".[export]"'


class MissingExtraError(UserError):
    """An optional package a command needs is not installed; the message names the extra."""


def require_export_extra(*packages: str) -> None:
    """:class:`MissingExtraError` naming the ``export`` extra when any of ``packages`` (``onnx``,
    ``onnxruntime``) cannot be imported; nothing when all are there."""
    missing = [name for name in packages if not _importable(name)]
    if missing:
        raise MissingExtraError(
            f"ONNX needs {' and '.join(missing)}, not installed here: install the export extra, "
            f"{EXPORT_EXTRA}"
        )


def _importable(name: str) -> bool:
    # Imported, not just found: a package whose import fails (a missing dependency of its own, a
    # broken wheel) is as missing to the exporter, which imports it.
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def onnxruntime_version() -> str:
    require_export_extra("onnxruntime")
    import onnxruntime

    return onnxruntime.__version__


def onnx_session(path: str | Path, threads: int | None = None) -> Any:
    """An onnxruntime CPU session for the file at ``path``: full graph optimisation, ``threads``
    intra-op threads (default: ``torch.get_num_threads()``), one inter-op thread, and only
    onnxruntime's errors logged (severity 3), not its warnings."""
    require_export_extra("onnxruntime")
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or max(1, torch.get_num_threads())
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Errors only: onnxruntime's warnings (a float16 node it cannot constant-fold on the CPU, an
    # unused initializer) are about its own optimisation, not the file, and a run whose output
    # is checked has nothing to learn from them.
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def onnx_runner(
    path: str | Path, batch: torch.Tensor, threads: int | None = None
) -> Callable[[], Any]:
    """A call that runs ``batch`` (a CPU tensor) through the ONNX file at ``path``.

    The session is made once, here, with ORT's full graph optimisation, ``threads`` intra-op
    threads (default: ``torch.get_num_threads()``, so a comparison with eager PyTorch is between
    runtimes, not thread counts) and one inter-op thread; the input is converted to NumPy once.
    """
    session = onnx_session(path, threads)
    name = session.get_inputs()[0].name
    feed = {name: batch.detach().cpu().float().numpy()}

    def run() -> Any:
        return session.run(None, feed)

    return run
