"""The serving path's checks: what a compiled, CUDA-graph-captured model needs of its forward.

A CUDA graph replays a fixed sequence of kernels on fixed buffers. Anything in the forward that
asks the host for a tensor's value (``.item()``, ``.tolist()``, ``int(tensor)``, a Python branch on
a tensor) or makes a shape depend on the data (``nonzero``, boolean indexing, ``unique``) stops the
device, cannot be captured, and splits or refuses the graph. :func:`host_sync_check` traces the
eval forward with ``torch.export`` (non-strict: the model's own Python runs on fake tensors, so a
value asked for becomes an unbacked symbol or a data-dependent guard) and lists each such place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vitcompress.analysis.capture import fast_paths_off
from vitcompress.artifacts.fingerprint import eval_mode
from vitcompress.errors import one_line
from vitcompress.measure.models import TimingOptions
from vitcompress.status import warn
from vitcompress.torch_output import partial_graph_print_dropped

__all__ = [
    "CUDA_GRAPH_MODES",
    "HOST_SYNC_OPS",
    "HostSyncReport",
    "ServingCheck",
    "cuda_graphs_counted",
    "host_sync_check",
    "serving_check",
]

# ATen ops (after decomposition to core ATen) that read a tensor's value on the host or give a
# data-dependent shape, and what calls them in Python.
HOST_SYNC_OPS = {
    "aten._local_scalar_dense": ".item(), .tolist(), int()/float()/bool() of a tensor",
    "aten.item": ".item(), .tolist(), int()/float()/bool() of a tensor",
    "aten.nonzero": "nonzero(), boolean indexing, torch.where(mask) (a data-dependent shape)",
    "aten.masked_select": "masked_select() (a data-dependent shape)",
    "aten._unique2": "unique() (a data-dependent shape)",
    "aten.unique_dim": "unique(dim=...) (a data-dependent shape)",
    "aten.unique_consecutive": "unique_consecutive() (a data-dependent shape)",
}


@dataclass
class HostSyncReport:
    """Where the eval forward waits for the device: ``ops`` (each ``op: why, at file:line``),
    ``unbacked`` (nodes whose shape or value depends on the data), ``error`` (the trace stopped on
    a Python decision about a tensor's value), ``untraced`` (``torch.export`` could not trace the
    forward for another reason, so nothing was checked; :func:`serving_check` sets it).

    ``host_tensors``: tensors the forward makes from Python data (``torch.tensor(list)``). Run
    eagerly on a GPU each is a copy from the host that waits for the device, on every call, and
    cannot be captured by ``torch.cuda.graph``; compiled, inductor folds them into constants.
    So they are listed, and do not fail the compiled serving path's check."""

    ops: list[str] = field(default_factory=list)
    unbacked: list[str] = field(default_factory=list)
    error: str | None = None
    untraced: str | None = None
    host_tensors: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not (self.ops or self.unbacked or self.error or self.untraced)

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "ops": list(self.ops),
            "unbacked": list(self.unbacked),
            "error": self.error,
            "untraced": self.untraced,
            "host_tensors": list(self.host_tensors),
        }

    def text(self) -> str:
        """One line: ``no host synchronisation`` or the first few places found."""
        if self.untraced:
            return f"host synchronisation not checked: {self.untraced}"
        if self.passed:
            text = "no host synchronisation (no .item(), nonzero or data-dependent shape)"
            if self.host_tensors:
                text += (
                    f"; {len(self.host_tensors)} tensor(s) made from Python data in the forward "
                    f"(eager on a GPU, a copy and a wait per call): {self.host_tensors[0]}"
                )
            return text
        found = ([self.error] if self.error else []) + self.ops + self.unbacked
        more = f" (+{len(found) - 3} more)" if len(found) > 3 else ""
        return "host synchronisation: " + "; ".join(found[:3]) + more


def _data_dependent(error: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    if isinstance(error, GuardOnDataDependentSymNode):
        return True
    text = str(error).lower()
    return "data-dependent" in text or "data dependent" in text


def _where(node: torch.fx.Node) -> str:
    """``file.py:12`` of the model code that made ``node``, from its stack trace."""
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.splitlines() if line.strip().startswith("File ")]
    if not lines:
        return "?"
    # 'File "/a/b/c.py", line 12, in forward' -> 'c.py:12'
    parts = lines[-1].split('"')
    path = parts[1].rsplit("/", 1)[-1] if len(parts) > 1 else "?"
    line = lines[-1].split("line ", 1)[-1].split(",", 1)[0]
    return f"{path}:{line}"


def host_sync_check(
    model: nn.Module, input_size: tuple[int, ...], batch_size: int = 2
) -> HostSyncReport:
    """Trace ``model``'s eval forward on one batch of ``batch_size`` with ``torch.export``
    (non-strict, static shapes) and report every op that reads a tensor's value on the host or
    makes a data-dependent shape (:data:`HOST_SYNC_OPS`), every node with an unbacked symbol in
    its shape or value, or the data-dependent decision the trace stopped on. Errors of another
    kind (a model ``torch.export`` cannot trace at all) are raised."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    # Imported here: bench and apply import this module for the CUDA-graph count alone.
    from vitcompress.workflows.export import _Inference, _inputs

    example = _inputs(batch_size, tuple(input_size), seed=0)
    report = HostSyncReport()
    with eval_mode(model), torch.no_grad(), fast_paths_off():
        try:
            with partial_graph_print_dropped():
                program = torch.export.export(_Inference(model), (example,), strict=False)
            # torch.tensor(data) in the forward: a lifted constant, copied fresh on each call
            # (before decomposition, which folds the copy away).
            report.host_tensors = [
                f"{node.name} at {_where(node)}"
                for node in program.graph.nodes
                if node.op == "call_function"
                and str(node.target).startswith("aten.lift_fresh_copy")
            ]
            program = program.run_decompositions()
        except Exception as e:
            if not _data_dependent(e):
                raise

            report.error = f"a Python decision on a tensor's value: {one_line(e)}"
            return report
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target).rsplit(".", 1)[0] if "." in str(node.target) else str(node.target)
        if name in HOST_SYNC_OPS:
            report.ops.append(f"{name}: {HOST_SYNC_OPS[name]}, at {_where(node)}")
            continue
        value = node.meta.get("val")
        symbols = free_unbacked_symbols(value) if value is not None else set()
        # Tensor ops only: the Python arithmetic on an unbacked value follows from the op that
        # made it, already listed.
        if symbols and isinstance(node.target, torch._ops.OpOverload) and "sym_" not in name:
            report.unbacked.append(
                f"{node.name} ({name}) depends on data-dependent "
                f"{', '.join(sorted(map(str, symbols)))}, at {_where(node)}"
            )
    return report


# torch.compile's modes that capture CUDA graphs (on CUDA; on the CPU inductor compiles without).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass
class ServingCheck:
    """The serving path checked at one static batch size: ``torch.compile(fullgraph=True)`` in
    ``mode`` (:func:`~vitcompress.workflows.export.compile_check`'s result) and the eval forward's
    host synchronisation (:func:`host_sync_check`)."""

    batch_size: int
    mode: str | None
    compile: dict[str, Any]
    host_sync: HostSyncReport

    @property
    def passed(self) -> bool:
        return (
            not self.compile["graph_break"]
            and self.compile["frames"] == 1
            and self.compile["recompiles"] == 0
            and self.host_sync.passed
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "batch_size": self.batch_size,
            "mode": self.mode,
            # On the CPU inductor compiles a CUDA-graph mode as its default one.
            "cuda_graphs_on_cuda": self.mode in CUDA_GRAPH_MODES,
            "compile": dict(self.compile),
            "host_sync": self.host_sync.to_json(),
        }

    def text(self) -> str:
        """One line for a report."""
        compiled = self.compile
        mode = f"mode {self.mode}, " if self.mode else ""
        graph = (
            f"graph break: {compiled['reason']}"
            if compiled["graph_break"]
            else f"{compiled['frames']} graph, {compiled['recompiles']} recompiles, "
            f"max |diff| {compiled['max_abs_diff']:.1e}"
        )
        verdict = "serves as one static graph" if self.passed else "does NOT serve as one graph"
        return (
            f"torch.compile(fullgraph=True, {mode}backend {compiled['backend']}) at batch "
            f"{self.batch_size}: {verdict} ({graph}); {self.host_sync.text()}"
        )


def serving_check(
    model: nn.Module,
    input_size: tuple[int, ...],
    batch_size: int,
    mode: str | None = "reduce-overhead",
    backend: str = "inductor",
) -> ServingCheck:
    """Whether ``model`` serves compiled at ``batch_size``: one graph under ``fullgraph=True``
    (no break, no recompile on a second batch of the size), the same outputs as eager, and no
    host synchronisation in its eval forward. ``backend="eager"`` checks dynamo's capture only
    (seconds, where inductor's code generation on a CPU takes minutes).

    A model ``torch.export`` cannot trace at all (``x.data_ptr()``, an opaque kernel) is not
    an error here: the check fails, and ``host_sync.untraced`` says what stopped the trace."""
    from vitcompress.workflows.export import compile_check

    compiled = compile_check(model, input_size, batch_size=batch_size, backend=backend, mode=mode)
    try:
        host_sync = host_sync_check(model, input_size, batch_size=batch_size)
    except Exception as e:  # noqa: BLE001 - any failure to trace is the check's finding
        host_sync = HostSyncReport(untraced=f"torch.export cannot trace it ({one_line(e)})")
    return ServingCheck(
        batch_size=batch_size,
        mode=mode if backend == "inductor" else None,
        compile=compiled,
        host_sync=host_sync,
    )


def _cuda_graph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


@contextlib.contextmanager
def cuda_graphs_counted(timing: TimingOptions | None) -> Iterator[dict[str, Any]]:
    """Around timing compiled in a CUDA-graph mode: ``{"cuda_graph_skips": N}``, the graphs
    inductor compiled without CUDA graphs meanwhile (its ``cudagraph_skips`` counter; on a CPU
    every one, there being none), and on CUDA a warning when N > 0. Empty otherwise."""
    counted: dict[str, Any] = {}
    if timing is None or not timing.compile or timing.compile_mode not in CUDA_GRAPH_MODES:
        yield counted
        return
    device, compile_mode = timing.device, timing.compile_mode
    before = _cuda_graph_skips()
    yield counted
    skips = _cuda_graph_skips() - before
    counted["cuda_graph_skips"] = skips
    if skips and str(device).split(":", 1)[0] == "cuda":
        warn(
            f"inductor compiled {skips} graph{'s' if skips > 1 else ''} without CUDA graphs "
            f"(--compile-mode {compile_mode}): they run kernel by kernel; TORCH_LOGS=perf_hints "
            "says why"
        )
