"""An exported ONNX file as a runner for :func:`~.throughput.measure_callables`: one batch through
an onnxruntime session on the CPU, with the same threads torch times with."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["onnx_runner", "onnx_session", "onnxruntime_version"]


def onnxruntime_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def onnx_session(path: str | Path, threads: int | None = None) -> Any:
    """An onnxruntime CPU session for the file at ``path``: full graph optimisation, ``threads``
    intra-op threads (default: ``torch.get_num_threads()``) and one inter-op thread."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or max(1, torch.get_num_threads())
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
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
