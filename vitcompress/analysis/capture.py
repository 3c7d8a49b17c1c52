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
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from vitcompress.analysis.attention_layouts import (
    heads_apart,
    mask_units_before_projection,
    windows_into_batch,
)
from vitcompress.errors import UserError
from vitcompress.model_copy import copy_model

MAX_LEAF_RETRIES = 16


class CaptureError(UserError):
    """The model could not be captured as a graph."""


INSERTED_MODULES = "vitcompress.modules."


def _inserted(module: nn.Module) -> bool:
    """A module a plan inserted (reducer, attention hook, grid pad): captured whole, so that a
    compressed model maps to the model's own structure, not to the reducers' insides."""
    return type(module).__module__.startswith(INSERTED_MODULES)


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


# torch's own encoder modules: fx keeps every torch.nn module whole, which would hide the blocks of
# a ViT written with them. nn.MultiheadAttention stays whole: the analysis reads it as a core.
TRACED_TORCH_MODULES = (nn.TransformerEncoder, nn.TransformerEncoderLayer)


def _encoder_forward(encoder: nn.TransformerEncoder, forward: Callable) -> Callable:
    """``nn.TransformerEncoder.forward`` as it runs with fast paths off and no masks: its layers in
    turn, then its norm. torch's forward also checks the input's metadata (``is_nested``, its
    size) for the nested-tensor path, which symbolic tracing cannot branch on; with a mask it is
    left to torch's forward (and tracing keeps the encoder whole if that fails)."""

    def plain_forward(
        src: torch.Tensor,
        mask: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        is_causal: bool | None = None,
    ) -> torch.Tensor:
        if mask is not None or src_key_padding_mask is not None:
            return forward(src, mask, src_key_padding_mask, is_causal)
        output = src
        for layer in encoder.layers:
            # Without a mask torch's causal-mask detection reduces to the flag itself.
            output = layer(output, src_mask=None, is_causal=is_causal is True)
        if encoder.norm is not None:
            output = encoder.norm(output)
        return output

    return plain_forward


class LeafFallbackTracer(fx.Tracer):
    """A tracer that remembers which submodule it was inside when tracing failed."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves
        self.failed_module: str | None = None
        self._stack: list[str] = []

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, TRACED_TORCH_MODULES) and module_qualified_name not in self.leaves:
            return False
        return (
            module_qualified_name in self.leaves
            or _inserted(m)
            or super().is_leaf_module(m, module_qualified_name)
        )

    def call_module(self, m, forward, args, kwargs):  # type: ignore[override]
        name = self.path_of_module(m)
        if isinstance(m, nn.TransformerEncoder) and not self.is_leaf_module(m, name):
            forward = _encoder_forward(m, forward)
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


_NO_VALUE = object()


def _plain_value(value: object) -> bool:
    """A value control flow may be decided on once: metadata (a dtype, a size, a flag), never
    tensor data, whose branch would change from image to image."""
    if isinstance(value, (bool, int, float, str, torch.dtype, torch.device, type(None))):
        return True
    if isinstance(value, (tuple, list)):
        return all(_plain_value(v) for v in value)
    return False


class GuardedTracer(LeafFallbackTracer):
    """A tracer that runs the example alongside the trace, so that control flow on metadata
    (HuggingFace's ``if pixel_values.dtype != expected_dtype``, ``if num_channels !=
    self.num_channels``, a position-table size check) takes the branch the example takes.

    Every such decision is kept in the graph as a guard (``torch._assert``) on the same
    condition, recomputed at run time: an input, or a token count after a reduction, that
    would take the other branch fails the guard instead of silently running the recorded one.
    Branches on tensor data are refused as before. The values flowing through the graph stay
    symbolic (``x.shape`` is still read at run time), so rewriting works as on a plain trace.
    """

    def __init__(
        self,
        leaves: set[str],
        example: tuple[torch.Tensor, ...],
        retried_modules: set[str] | None = None,
    ) -> None:
        super().__init__(leaves)
        self._examples = list(example)
        self._values: dict[fx.Node, object] = {}
        self.guards = 0
        # Modules traced again, after tracing failed inside them, with two more rules: their
        # buffers are read as graph values, not as constants (a buffer that takes part in a
        # shape, ``self.rel_indices.expand(B, -1, -1, -1)`` in ConViT, cannot be a plain tensor
        # with a traced size), and ``int`` of a size is decided under a guard (NesT). Elsewhere a
        # buffer stays the constant it always was, and ``int`` of a size fails as before (the
        # leaf fallback, or torch.export at the top level).
        self.retried_modules = retried_modules if retried_modules is not None else set()
        self._buffer_reads: dict[fx.Node, fx.Proxy] = {}

    def _value(self, arg: object) -> object:
        if isinstance(arg, fx.proxy.Attribute):
            root = self._value(arg.root)
            return _NO_VALUE if root is _NO_VALUE else getattr(root, arg.attr, _NO_VALUE)
        if isinstance(arg, fx.Proxy):
            return self._values.get(arg.node, _NO_VALUE)
        return arg

    def _concrete(self, args: object) -> object:
        missing = False

        def one(a: object) -> object:
            nonlocal missing
            value = self._value(a)
            missing = missing or value is _NO_VALUE
            return value

        def walk(a: object) -> object:
            if isinstance(a, (tuple, list)):
                return type(a)(walk(v) for v in a) if not hasattr(a, "_fields") else a
            if isinstance(a, dict):
                return {k: walk(v) for k, v in a.items()}
            if isinstance(a, slice):
                return slice(walk(a.start), walk(a.stop), walk(a.step))
            return one(a)

        result = walk(args)
        return _NO_VALUE if missing else result

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, *rest, **kw):  # type: ignore[override]
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, *rest, **kw)
        self._computing = True  # the example runs through the modules as plain eager code
        try:
            value = self._run(kind, target, args, kwargs)
        finally:
            self._computing = False
        if value is not _NO_VALUE:
            self._values[proxy.node] = value
            # A node is only ever read again through its proxy: once the traced code drops the
            # proxy, its value goes too. Keeping every value held the whole model's activations
            # (SAM-B at 1024 px ran out of 24 GB here); now the trace holds what eager code would.
            weakref.finalize(proxy, self._values.pop, proxy.node, None)
        return proxy

    # While the example runs, module calls and attribute reads are the patched ones of the trace:
    # they must run the real code instead of recording nodes.
    _computing = False

    def call_module(self, m, forward, args, kwargs):  # type: ignore[override]
        if self._computing:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):  # type: ignore[override]
        if self._computing:
            return attr_val
        inside = self._stack[-1] if self._stack else ""
        self.proxy_buffer_attributes = inside in self.retried_modules
        try:
            value = super().getattr(attr, attr_val, parameter_proxy_cache)
        finally:
            self.proxy_buffer_attributes = False
        if isinstance(value, fx.Proxy) and not isinstance(attr_val, nn.Parameter):
            # Every read of such a buffer (its size checked against the token count, its data)
            # goes through one no-op node: a position table gathered there is read gathered by
            # both, so a cache check (ConViT's ``rel_indices.shape[1] != N``) holds again on the
            # kept tokens. ``contiguous`` of a contiguous buffer returns the buffer itself.
            if value.node not in self._buffer_reads:
                self._buffer_reads[value.node] = value.contiguous()
            return self._buffer_reads[value.node]
        return value

    def _run(self, kind: str, target, args, kwargs) -> object:
        if kind == "placeholder":
            return self._examples.pop(0) if self._examples else _NO_VALUE
        if kind == "get_attr":
            value: object = self.root
            for part in str(target).split("."):
                value = getattr(value, part, _NO_VALUE)
                if value is _NO_VALUE:
                    break
            return value
        concrete_args = self._concrete(args)
        concrete_kwargs = self._concrete(kwargs)
        if concrete_args is _NO_VALUE or concrete_kwargs is _NO_VALUE:
            return _NO_VALUE
        try:
            with torch.no_grad():
                if kind == "call_function":
                    return target(*concrete_args, **concrete_kwargs)
                if kind == "call_method":
                    receiver, *rest = concrete_args
                    return getattr(receiver, target)(*rest, **concrete_kwargs)
                if kind == "call_module":
                    return self.root.get_submodule(target)(*concrete_args, **concrete_kwargs)
        except Exception:  # noqa: BLE001 - no value: control flow on it is refused as before
            return _NO_VALUE
        return _NO_VALUE

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = self._value(obj)
        if value is _NO_VALUE or not _plain_value(value):
            return super().to_bool(obj)  # data-dependent: no single branch to record
        decided = bool(value)
        condition = (
            obj if decided else self.create_proxy("call_function", operator.not_, (obj,), {})
        )
        where = self._stack[-1] if self._stack and self._stack[-1] else "the top level"
        self.create_proxy(
            "call_function",
            torch._assert,
            (
                condition,
                f"this input takes another branch than the captured graph at {where}: a "
                f"check on shapes or dtypes there was {decided} on the example input",
            ),
            {},
        )
        self.guards += 1
        return decided

    def to_int(self, obj: fx.Proxy) -> int:
        """``int`` of a traced size (NesT's ``int(math.sqrt(T))``, its block grid's side): the
        example's value, kept in the graph as a guard, as a branch on metadata is."""
        value = self._value(obj)
        inside = self._stack[-1] if self._stack else ""
        if (
            inside not in self.retried_modules
            or isinstance(value, torch.Tensor)
            or not isinstance(value, (int, float, bool))
        ):
            raise TypeError("int() of a traced value is not supported in symbolic tracing")
        decided = int(value)
        as_int = self.create_proxy("call_function", int, (obj,), {})
        same = self.create_proxy("call_function", operator.eq, (as_int, decided), {})
        where = self._stack[-1] if self._stack and self._stack[-1] else "the top level"
        self.create_proxy(
            "call_function",
            torch._assert,
            (
                same,
                f"this input gives another size than the captured graph at {where}: a size "
                f"there was {decided} on the example input",
            ),
            {},
        )
        self.guards += 1
        return decided

    def item_write(self, obj: fx.Proxy, index: object, value: object) -> fx.Proxy:
        """``obj[index] = value`` as the value :func:`put` computes, inside a retried module
        (MViTv2's attention); elsewhere refused, as fx refuses it."""
        inside = self._stack[-1] if self._stack else ""
        if inside not in self.retried_modules:
            raise TypeError(f"'{type(obj).__name__}' object does not support item assignment")
        return self.create_proxy("call_function", put, (obj, index, value), {})

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _SizedProxy(node, self)

    def length(self, obj: fx.Proxy) -> int:
        """``len`` of a tuple (a shape's prefix, unpacked with ``*``): its rank is fixed by the
        structure. A tensor's length (the batch) is not, and stays refused."""
        value = self._value(obj)
        if isinstance(value, (tuple, list)) and not isinstance(value, torch.Tensor):
            return len(value)
        raise RuntimeError("'len' of a traced tensor is not supported in symbolic tracing")

    def iter(self, obj: fx.Proxy):  # type: ignore[override]
        value = self._value(obj)
        if isinstance(value, (tuple, list)) and not isinstance(value, torch.Tensor):
            # A tuple's length (a shape's rank, a list of stages) is fixed by the structure.
            return iter([obj[i] for i in range(len(value))])
        return super().iter(obj)


def put(tensor: torch.Tensor, index: object, value: object) -> torch.Tensor:
    """``tensor[index] = value`` as a new tensor: an in-place write as a graph value, so that
    what reads the tensor afterwards reads the write (MViTv2 adds its relative positions to a
    slice of the attention logits this way)."""
    out = tensor.clone()
    out[index] = value
    return out


class _SizedProxy(fx.Proxy):
    """A proxy whose ``len`` and ``int`` the :class:`GuardedTracer` answers where they are
    structural, and that takes item assignment."""

    # The proxy of the last write into it, kept alive with it (``__setitem__``). Declared here:
    # ``fx.Proxy.__getattr__`` would record a read of a missing attribute as a graph node.
    _written: fx.Proxy | None = None

    def __len__(self) -> int:
        return self.tracer.length(self)  # type: ignore[attr-defined]

    def __int__(self) -> int:
        return self.tracer.to_int(self)  # type: ignore[attr-defined]

    def __setitem__(self, index: object, value: object) -> None:
        # fx records no in-place writes. The write becomes a new value, and this proxy (the
        # Python variable the code goes on reading: ``attn`` after ``attn[...] = ...``) now
        # stands for it. Views taken of the tensor before the write do not see it; eager code
        # reading such a view after the write is not supported.
        written = self.tracer.item_write(self, index, value)  # type: ignore[attr-defined]
        self.node = written.node
        # The guarded trace holds a node's example value only while a proxy of it lives; this
        # proxy now stands for the write, so it keeps the write's proxy (and value) alive.
        self._written = written


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
