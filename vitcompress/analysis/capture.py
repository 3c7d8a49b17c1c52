"""Capture a model as a torch.fx graph.

``torch.fx.symbolic_trace`` first, with a tracer that keeps a submodule whole (a leaf) wherever
tracing into it fails, retrying until the rest traces; ``torch.export`` as the fallback for models
whose top-level ``forward`` cannot be traced symbolically (HuggingFace transformers' checks).
Every node gets ``meta["shape"]``: the concrete shape seen on an example input (or a tuple of
shapes for tuple outputs), which the analysis reads.

torch's own ``nn.TransformerEncoder`` and ``nn.TransformerEncoderLayer`` are traced into (fx keeps
every ``torch.nn`` module whole by default), with their fused fast paths off, so that a ViT built
from them shows its attention (a kept-whole ``nn.MultiheadAttention``) and residual adds.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from vitcompress.analysis.attention_layouts import (
    heads_apart,
    mask_units_before_projection,
    windows_into_batch,
)
from vitcompress.analysis.tracers import GuardedTracer, LeafFallbackTracer
from vitcompress.errors import UserError
from vitcompress.model_copy import copy_model
from vitcompress.torch_output import partial_graph_print_dropped

MAX_LEAF_RETRIES = 16


class CaptureError(UserError):
    """The model could not be captured as a graph."""


@contextlib.contextmanager
def fast_paths_off() -> Iterator[None]:
    """Run ``nn.MultiheadAttention`` and ``nn.TransformerEncoder(Layer)`` on their decomposed
    path (projections, SDPA or matmul+softmax, norms as separate ops) instead of the fused
    ``_native_multi_head_attention`` / ``_transformer_encoder_layer_fwd`` kernels that eval mode
    picks: a tracer or a MAC counter only sees inside the decomposed one. The same numbers come
    out either way. The previous setting is restored on exit."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


@dataclass
class CapturedGraph:
    module: fx.GraphModule
    method: str  # "symbolic_trace", "guarded_trace" (GuardedTracer) or "export"
    leaves: list[str] = field(default_factory=list)
    example: torch.Tensor | None = None
    trace_error: str | None = None  # why symbolic tracing failed, for a graph from torch.export


def check_rewritable(captured: CapturedGraph) -> None:
    """Refuse, in one line naming the blocker, to compress a graph only ``torch.export`` took.

    An exported graph fixes every shape to the example's (its reshapes hold the token count as
    a constant) and its module cannot be put in training mode, so dropping tokens in it would
    crash at run time, or train nothing; the blocker is what stopped symbolic tracing."""
    if captured.method != "export":
        return
    raise CaptureError(
        "tokens cannot be reduced in this model: only torch.export could capture it, and an "
        "exported graph fixes every tensor shape to the example's token count (and cannot "
        f"train), so tokens cannot be dropped in it; symbolic tracing stopped at: "
        f"{captured.trace_error}"
    )


def bound_defaults(model: nn.Module) -> dict[str, object]:
    """Optional forward arguments (a mask defaulting to ``None``, ``is_causal=False``,
    ``return_features=False``): the image is the only input, so each is bound to its default at
    capture instead of traced as a value that control flow cannot read. torch.fx keeps a guard
    for each (an assertion that the argument is still its default), so a call with another
    value fails rather than running the default's branch. Defaults of other types than None,
    bool, int, float and str are left to the trace."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return {}
    return {
        p.name: p.default
        for p in parameters
        if p.default is not p.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        and isinstance(p.default, _BOUND_DEFAULTS)
    }


# The types of the defaults bound at capture: those torch.fx can guard by equality.
_BOUND_DEFAULTS = (type(None), bool, int, float, str)


def _symbolic_trace(
    model: nn.Module, example: torch.Tensor | None = None
) -> tuple[fx.GraphModule, list[str]]:
    """Trace ``model``, keeping failing submodules whole; given an ``example``, with the
    :class:`GuardedTracer` (control flow on metadata decided on it, under guards)."""
    leaves: set[str] = set()
    retried_modules: set[str] = set()
    last_error: Exception | None = None
    concrete = bound_defaults(model)
    # A guarded trace first retries a failing module with its buffers as graph values and
    # ``int`` of sizes guarded (``GuardedTracer.retried_modules``), then keeps it whole: each
    # module may take two tries.
    for _ in range(MAX_LEAF_RETRIES * (1 if example is None else 2)):
        tracer = (
            LeafFallbackTracer(leaves)
            if example is None
            else GuardedTracer(leaves, (example,), retried_modules)
        )
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
        except Exception as e:  # noqa: BLE001 - any tracing failure leads to a retry
            last_error = e
            failed = tracer.failed_module
            if failed is None or failed in leaves:
                break
            if example is not None and failed not in retried_modules:
                retried_modules.add(failed)
            else:
                leaves.add(failed)
            continue
        name = model.__class__.__name__
        return fx.GraphModule(tracer.root, graph, name), sorted(leaves)
    raise CaptureError(f"symbolic tracing failed: {type(last_error).__name__}: {last_error}")


def _best_trace(model: nn.Module, example: torch.Tensor) -> tuple[fx.GraphModule, list[str], str]:
    """A plain symbolic trace where it takes the whole model; else the guarded trace where it
    keeps fewer submodules whole (HuggingFace models check a dtype or a channel count first)."""
    try:
        gm, leaves = _symbolic_trace(model)
    except CaptureError as plain_error:
        try:
            gm, leaves = _symbolic_trace(model, example)
        except CaptureError:
            raise plain_error from None
        if leaves:
            # torch.export sees inside every module; a guarded trace that keeps some whole (SAM's
            # attention) would hide what the analysis needs, so export takes over as before.
            raise plain_error from None
        return gm, leaves, "guarded_trace"
    if not leaves:
        return gm, leaves, "symbolic_trace"
    # One eager run first: a module that builds a cache on its first call (ConViT's relative
    # indices, sized to the token count) is then traced on the branch that reads the cache.
    try:
        with torch.no_grad():
            model(example)
    except Exception:  # noqa: BLE001 - the guarded trace then meets the same failure
        pass
    try:
        guarded, guarded_leaves = _symbolic_trace(model, example)
    except CaptureError:
        return gm, leaves, "symbolic_trace"
    if len(guarded_leaves) < len(leaves):
        return guarded, guarded_leaves, "guarded_trace"
    return gm, leaves, "symbolic_trace"


def _export(model: nn.Module, example: torch.Tensor) -> fx.GraphModule:
    with partial_graph_print_dropped():
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


def _token_split(node: fx.Node) -> tuple[fx.Node, object] | None:
    """``(x, first)`` for ``torch.split(x, [first, rest], 1)`` on (B, N, C) tokens: the prefix
    tokens split from the patch tokens (HuggingFace CvT), by sizes fixed at the full count."""
    if node.op == "call_function" and node.target is torch.split:
        args = list(node.args) + [node.kwargs.get("split_size_or_sections")] * (len(node.args) < 2)
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    elif node.op == "call_method" and node.target == "split":
        args = list(node.args) + [node.kwargs.get("split_size")] * (len(node.args) < 2)
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    else:
        return None
    tokens, sizes = args[0], args[1]
    shape = tokens.meta.get("shape") if isinstance(tokens, fx.Node) else None
    if not isinstance(sizes, (list, tuple)) or len(sizes) != 2 or dim not in (1, -2):
        return None
    if not isinstance(shape, tuple) or len(shape) != 3 or not tokens.meta.get("is_tensor"):
        return None
    if not all(
        user.op == "call_function" and user.target is operator.getitem for user in node.users
    ):
        return None
    return tokens, sizes[0]


def split_tokens_by_slices(gm: fx.GraphModule) -> int:
    """Write a split of the token axis into two pieces as two slices, ``x[:, :first]`` and
    ``x[:, first:]``: the same views of the same tensor, but the second piece then takes
    whatever tokens a reduction left, where the split's sizes would fail on them. Returns how
    many splits were rewritten."""
    rewritten = 0
    for node in list(gm.graph.nodes):
        found = _token_split(node)
        if found is None:
            continue
        tokens, first = found
        pieces = {
            0: (slice(None), slice(None, first)),
            1: (slice(None), slice(first, None)),
        }
        for user in list(node.users):
            with gm.graph.inserting_before(user):
                piece = gm.graph.call_function(operator.getitem, (tokens, pieces[user.args[1]]))
            piece.meta.update(user.meta)
            user.replace_all_uses_with(piece)
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def capture(model: nn.Module, example: torch.Tensor) -> CapturedGraph:
    """Capture ``model`` (left unchanged) as a graph with shapes from ``example``."""
    model = copy_model(model).eval()
    blocker: str | None = None  # why symbolic tracing failed, where export takes over
    with fast_paths_off():
        try:
            gm, leaves, method = _best_trace(model, example)
        except CaptureError as trace_error:
            try:
                gm, leaves, method = _export(model, example), [], "export"
                blocker = str(trace_error)
            except Exception as e:  # noqa: BLE001
                raise CaptureError(
                    f"could not capture the model: {trace_error}; torch.export also failed: "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                ) from e
        annotate_shapes(gm, example)
    if method != "export":  # an exported graph is never rewritten
        split_tokens_by_slices(gm)
        if mask_units_before_projection(gm):
            annotate_shapes(gm, example)
        if heads_apart(gm, example) + windows_into_batch(gm):
            annotate_shapes(gm, example)
    return CapturedGraph(
        module=gm,
        method=method,
        leaves=leaves,
        example=example,
        trace_error=blocker,
    )
