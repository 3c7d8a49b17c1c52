"""The tracers capture uses: ``LeafFallbackTracer`` (torch.fx's, keeping the modules that fail
whole, tracing torch's own encoder modules and keeping a plan's inserted modules whole) and
``GuardedTracer`` (decides control flow on sizes and values from an example, under guards)."""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable

import torch
import torch.fx as fx
from torch import nn

INSERTED_MODULES = "vitcompress.modules."


def _inserted(module: nn.Module) -> bool:
    """A module a plan inserted (reducer, attention hook, grid pad): captured whole, so that a
    compressed model maps to the model's own structure, not to the reducers' insides."""
    return type(module).__module__.startswith(INSERTED_MODULES)


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
