"""What torch's tracers and exporters print on their own, kept off the user's terminal and pipes.

A failure they report is raised as an exception, which the tool turns into its one line; the
graphs they print beside it (hundreds of lines for a ViT) only bury that line."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def native_stdout_dropped() -> Iterator[None]:
    """Drop what native code writes to the process's standard output while the block runs.

    torch's TorchScript-based ONNX exporter switches its C++ log on for every export (its
    ``setup_onnx_logging`` tests the function ``_jit_is_onnx_log_enabled`` itself, always true,
    instead of calling it), so an export that fails prints the whole TorchScript graph to stdout,
    where ``--json`` readers and pipes expect the result. That stream is C++'s ``std::cout``, not
    ``sys.stdout``: file descriptor 1 is pointed at the null device instead, and restored
    afterwards. Python's own prints are flushed before and buffered as usual during the block,
    so they still reach stdout."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 to protect
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def partial_graph_print_dropped() -> Iterator[None]:
    """Keep ``torch.export.export``'s print of the partial graph off stderr.

    When a trace stops on a data-dependent decision (a model's ``.item()`` or ``if x.sum() > 0``)
    torch prints the whole graph traced so far to ``sys.stderr`` before it raises (``print(...,
    file=sys.stderr)`` in ``torch/export/_trace.py``). The exception says what stopped it;
    the graph is dropped. ``sys.stderr`` is replaced for the block only."""
    with contextlib.redirect_stderr(io.StringIO()):
        yield
