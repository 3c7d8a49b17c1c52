"""Capture a model as a torch.fx graph.

``torch.fx.symbolic_trace`` first, with a tracer that keeps a submodule whole (a leaf) wherever
tracing into it fails, retrying until the rest traces; ``torch.export`` as the fallback for models
whose top-level ``forward`` cannot be traced symbolically (HuggingFace transformers' checks).
Every node gets ``meta["shape"]``: the concrete shape seen on an example input (or a tuple of
shapes for tuple outputs), which the analysis reads.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

MAX_LEAF_RETRIES = 16


class CaptureError(Exception):
    """The model could not be captured as a graph."""


class LeafFallbackTracer(fx.Tracer):
    """A tracer that remembers which submodule it was inside when tracing failed."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves
        self.failed_module: str | None = None
        self._stack: list[str] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(
            m, module_qualified_name
        )

    def call_module(self, m, forward, args, kwargs):  # type: ignore[override]
        name = self.path_of_module(m)
        self._stack.append(name)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            # The innermost module sees the exception first: it is the one to keep whole.
            if self.failed_module is None and not self.is_leaf_module(m, name):
                self.failed_module = name
            raise
        finally:
            self._stack.pop()


@dataclass
class CapturedGraph:
    module: fx.GraphModule
    method: str  # "symbolic_trace" or "export"
    leaves: list[str] = field(default_factory=list)
    example: torch.Tensor | None = None


def bound_defaults(model: nn.Module) -> dict[str, object]:
    """Optional forward arguments (a mask defaulting to ``None``, ``is_causal=False``): the image
    is the only input, so each is bound to its default at capture instead of traced as a
    tensor. Only done where one of them defaults to ``None``, which tracing cannot handle."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return {}
    optional = [
        p
        for p in parameters
        if p.default is not p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if all(p.default is not None for p in optional):
        return {}
    return {p.name: p.default for p in optional}


def _symbolic_trace(model: nn.Module) -> tuple[fx.GraphModule, list[str]]:
    leaves: set[str] = set()
    last_error: Exception | None = None
    concrete = bound_defaults(model)
    for _ in range(MAX_LEAF_RETRIES):
        tracer = LeafFallbackTracer(leaves)
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
        except Exception as e:  # noqa: BLE001 - any tracing failure leads to a retry
            last_error = e
            if tracer.failed_module is None or tracer.failed_module in leaves:
                break
            leaves.add(tracer.failed_module)
            continue
        name = model.__class__.__name__
        return fx.GraphModule(tracer.root, graph, name), sorted(leaves)
    raise CaptureError(f"symbolic tracing failed: {type(last_error).__name__}: {last_error}")


def _export(model: nn.Module, example: torch.Tensor) -> fx.GraphModule:
    program = torch.export.export(model, (example,), strict=False)
    return program.module()


def _carries_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_carries_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(_carries_tensor(v) for v in value.values())
    return False


def annotate_shapes(gm: fx.GraphModule, example: torch.Tensor) -> None:
    """Run ``gm`` once on ``example`` and record every node's output shape in ``meta["shape"]``."""

    def shape_of(value):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
        if isinstance(value, (tuple, list)):
            return tuple(shape_of(v) for v in value)
        return None

    class _Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node):
            result = super().run_node(n)
            n.meta["shape"] = shape_of(result)
            n.meta["is_tensor"] = isinstance(result, torch.Tensor)
            n.meta["carries_tensor"] = _carries_tensor(result)
            return result

    with torch.no_grad():
        _Recorder(gm).run(example)


def capture(model: nn.Module, example: torch.Tensor) -> CapturedGraph:
    """Capture ``model`` (left unchanged) as a graph with shapes from ``example``."""
    model = copy.deepcopy(model).eval()
    try:
        gm, leaves = _symbolic_trace(model)
        method = "symbolic_trace"
    except CaptureError as trace_error:
        try:
            gm, leaves, method = _export(model, example), [], "export"
        except Exception as e:  # noqa: BLE001
            raise CaptureError(
                f"could not capture the model: {trace_error}; torch.export also failed: "
                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            ) from e
    annotate_shapes(gm, example)
    return CapturedGraph(module=gm, method=method, leaves=leaves, example=example)
