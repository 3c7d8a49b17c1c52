"""A compressed model's entry points besides ``forward``: the base's own methods.

``compress(model, entry="forward_features")`` compresses a named method of the base as the
forward (:func:`entry_view`). A compressed model also answers the base's methods
(:data:`IMAGE_METHODS`, :data:`TOKEN_METHODS`) where its base has them
(:class:`CompressedGraphModule`):

- a method that takes the image (``forward_features``, timm's ``forward_intermediates`` and
  ``get_intermediate_layers``, HF's ``get_image_features``) is compressed on its first call, with
  its arguments, as its own entry of the base under the model's plan, and then run with the
  compressed model's own tensors: the same weights, the reducers' predictors included, so a
  trained compressed model answers with what it learned. Its token outputs follow the dense-output
  rules (docs/dense.md): every token back, in the base's order;
- a method that takes tokens (timm's ``forward_head``) drops nothing: it runs the base's own code
  on the compressed model's tensors.

The base's structure is kept without its weights (a copy on the ``meta`` device), so the methods
cost no memory until one is called. What cannot be made to run is refused in one line that names
the method and what to do instead.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from vitcompress.compilation.metadata import attach
from vitcompress.errors import UserError

FORWARD = "forward"
# The base's methods a compressed model answers, by what they take: the image, or tokens.
IMAGE_METHODS = (
    "forward_features",
    "forward_intermediates",
    "get_intermediate_layers",
    "get_image_features",
)
TOKEN_METHODS = ("forward_head",)
BASE_METHODS_ATTRIBUTE = "vitcompress_base_methods"
ENTRY_ATTRIBUTE = "vitcompress_entry"
# The compiled entries of one compressed model: a plain attribute (no submodule, so neither its
# state dict nor its parameters list them twice), dropped by a deepcopy and compiled again there.
_COMPILED_ATTRIBUTE = "_vitcompress_compiled_entries"


class EntryError(UserError):
    """A named entry the base does not have, or a base method that cannot run compressed."""


def _method_of(model: nn.Module, name: str) -> Callable | None:
    if not name.isidentifier() or name.startswith("_"):
        return None
    try:
        method = getattr(model, name)
    except AttributeError:
        return None
    return method if callable(method) and not isinstance(method, nn.Module) else None


def entry_view(
    model: nn.Module, entry: str, args: tuple = (), kwargs: dict[str, Any] | None = None
) -> nn.Module:
    """``model`` with ``forward`` calling its method ``entry`` on the image (with ``args`` and
    ``kwargs`` after it). A shallow view: the same submodules and tensors, so parameter names stay
    the model's and the graph captured from it is named after the model's class. ``model`` is
    left as it was. A view's :func:`entry_of` is ``entry``: compressing it compresses that
    method (the command line's ``--entry``)."""
    if entry == FORWARD and not args and not kwargs:
        return model
    if not args and not kwargs and entry_of(model) == entry:
        return model  # already that view
    if _method_of(model, entry) is None:
        # Only the model's own methods as examples: naming one it lacks sends the user round.
        own = sorted(
            name
            for name in dir(type(model))
            if name.startswith("forward_") and _method_of(model, name) is not None
        )
        hint = (
            f", e.g. {', '.join(own[:4])}"
            if own
            else "; it has none named forward_*: a model file (path/to/file.py:factory) that "
            "wraps it can return what you need"
        )
        raise EntryError(
            f"entry '{entry}': {type(model).__name__} has no method {entry}; name one of its "
            f"methods that takes the image{hint}"
        )
    bound_kwargs = dict(kwargs or {})
    base_class = type(model)

    def forward(self: nn.Module, image: Tensor) -> Any:
        return getattr(self, entry)(image, *args, **bound_kwargs)

    view_class = type(
        base_class.__name__,
        (base_class,),
        {"forward": forward, "__module__": base_class.__module__, ENTRY_ATTRIBUTE: entry},
    )
    view_class.__qualname__ = base_class.__qualname__
    view = copy.copy(model)
    view.__class__ = view_class
    return view


def entry_of(model: nn.Module) -> str:
    """The method of its base a compressed model (or an :func:`entry_view`) runs as its
    forward."""
    return str(getattr(model, ENTRY_ATTRIBUTE, FORWARD))


# --- the base without its weights ---------------------------------------------------------------


def weightless_copy(model: nn.Module) -> nn.Module | None:
    """A copy of ``model`` whose parameters and buffers are on the ``meta`` device (no memory),
    or ``None`` where the model cannot be copied."""
    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = nn.Parameter(
            torch.empty_like(parameter, device="meta"), requires_grad=parameter.requires_grad
        )
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - a model deepcopy refuses: its methods are refused later
        return None


def named_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer of ``model`` by each of its names (shared ones under all)."""
    return {
        **dict(model.named_parameters(remove_duplicate=False)),
        **dict(model.named_buffers(remove_duplicate=False)),
    }


def tie_tensors(
    model: nn.Module, tensors: dict[str, Tensor], fill: torch.device | None = None
) -> list[str]:
    """Make ``model``'s parameters and buffers the tensors of ``tensors`` with the same names
    (the objects themselves: shared, not copied). Returns the names ``tensors`` lacks; with
    ``fill``, those become zeros on that device (a ``meta`` tensor cannot run)."""
    missing = []
    for prefix, module in model.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for leaf, tensor in store.items():
                if tensor is None:
                    continue
                name = f"{prefix}.{leaf}" if prefix else leaf
                if name in tensors:
                    store[leaf] = tensors[name]
                    continue
                missing.append(name)
                if fill is not None and tensor.device.type == "meta":
                    zeros = torch.zeros_like(tensor, device=fill)
                    is_parameter = isinstance(tensor, nn.Parameter)
                    store[leaf] = (
                        nn.Parameter(zeros, tensor.requires_grad) if is_parameter else zeros
                    )
    return missing


class BaseMethods:
    """What a compressed model keeps of its base to answer the base's methods: the base's
    structure without weights, the methods it has, and how to compile an entry
    (``compile_entry(base, name, args, kwargs, compressed model) -> module``, given by the
    compression)."""

    def __init__(
        self,
        skeleton: nn.Module | None,
        compile_entry: Callable[[nn.Module, str, tuple, dict[str, Any], nn.Module], nn.Module],
    ) -> None:
        self.skeleton = skeleton
        self.compile_entry = compile_entry
        present = (*IMAGE_METHODS, *TOKEN_METHODS)
        self.names = frozenset(
            name for name in present if skeleton is not None and _method_of(skeleton, name)
        )

    def base_on(self, tensors: dict[str, Tensor], device: torch.device) -> nn.Module:
        """The base's structure with ``tensors`` (shared); what they lack is zeros."""
        base = copy.deepcopy(self.skeleton)
        tie_tensors(base, tensors, fill=device)
        return base


class _Compiled:
    """A compressed model's compiled entries and its base on its own tensors, made on first use."""

    def __init__(self) -> None:
        self.entries: dict[str, nn.Module] = {}
        self.base: nn.Module | None = None


def _key(name: str, args: tuple, kwargs: dict[str, Any]) -> str:
    """The call's arguments as one key; only plain values (a flag, an index, a list of them) can
    be fixed in a compiled graph."""
    values = (*args, *kwargs.values())
    if not all(_plain(v) for v in values):
        raise EntryError(
            f"{name}: only plain arguments (numbers, strings, flags, lists of them) can be fixed "
            f"in a compressed graph; call {name} on the base model for tensor arguments"
        )
    return repr((name, args, sorted(kwargs.items())))


def _plain(value: object) -> bool:
    if isinstance(value, (bool, int, float, str, type(None))):
        return True
    return isinstance(value, (tuple, list)) and all(_plain(v) for v in value)


def _on_cpu(tensor: Tensor) -> Tensor:
    data = tensor.detach().to("cpu")
    return nn.Parameter(data, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data


def _device_of(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


# The names a base's method may give its image argument, when it is passed by name.
_IMAGE_KEYWORDS = ("x", "pixel_values", "images", "image")


def _image_argument(
    name: str, args: tuple, kwargs: dict[str, Any]
) -> tuple[Any, tuple, dict[str, Any]]:
    """The image, the other positional arguments and the keyword ones of a call."""
    if args:
        return args[0], tuple(args[1:]), kwargs
    for keyword in _IMAGE_KEYWORDS:
        if keyword in kwargs:
            rest = {key: value for key, value in kwargs.items() if key != keyword}
            return kwargs[keyword], (), rest
    raise EntryError(f"{name}: pass the image first, e.g. model.{name}(x)")


def _call_base_method(model: CompressedGraphModule, name: str, *args: Any, **kwargs: Any) -> Any:
    methods: BaseMethods | None = getattr(model, BASE_METHODS_ATTRIBUTE, None)
    if methods is None or methods.skeleton is None:
        raise EntryError(
            f"{name}: this compressed model does not keep its base's structure; compress the "
            f"base with compress(..., entry='{name}')"
        )
    compiled: _Compiled = model.__dict__.setdefault(_COMPILED_ATTRIBUTE, _Compiled())
    tensors = named_tensors(model)
    if name in TOKEN_METHODS:
        if compiled.base is None:
            compiled.base = methods.base_on(tensors, _device_of(model))
        tie_tensors(compiled.base, tensors)  # buffers are new tensors after a .to()
        compiled.base.train(model.training)
        return getattr(compiled.base, name)(*args, **kwargs)
    image, rest_args, kwargs = _image_argument(name, args, kwargs)
    if name == entry_of(model) and not rest_args and not kwargs:
        return model(image)
    key = _key(name, rest_args, kwargs)
    if key not in compiled.entries:
        # Captured on the CPU, as compress() does, with copies of the current weights.
        cpu = {path: _on_cpu(tensor) for path, tensor in tensors.items()}
        entry = methods.compile_entry(
            methods.base_on(cpu, torch.device("cpu")), name, rest_args, kwargs, model
        )
        unknown = sorted(set(named_tensors(entry)) - set(tensors))
        if unknown:
            raise EntryError(
                f"{name} reads tensors the compressed forward does not have ({', '.join(unknown[:3])}"
                f"); compress the base with compress(..., entry='{name}')"
            )
        compiled.entries[key] = entry
    entry = compiled.entries[key]
    tie_tensors(entry, tensors)
    entry.train(model.training)
    return entry(image)


def _base_method(name: str) -> property:
    def get(self: CompressedGraphModule) -> Callable:
        methods: BaseMethods | None = self.__dict__.get(BASE_METHODS_ATTRIBUTE)
        if methods is None or name not in methods.names:
            # hasattr() says False, and nn.Module's own message follows.
            raise AttributeError(name)
        return functools.partial(_call_base_method, self, name)

    get.__doc__ = f"The base's ``{name}``, on this compressed model (see compilation/entries.py)."
    return property(get)


class CompressedGraphModule(fx.GraphModule):
    """A rewritten graph module that also answers its base's methods (the module docstring)."""

    forward_features = _base_method("forward_features")
    forward_head = _base_method("forward_head")
    forward_intermediates = _base_method("forward_intermediates")
    get_intermediate_layers = _base_method("get_intermediate_layers")
    get_image_features = _base_method("get_image_features")


def with_base_methods(
    compressed: fx.GraphModule, base: nn.Module, compile_entry: Callable[..., nn.Module]
) -> fx.GraphModule:
    """``compressed`` (changed in place, and returned) as a :class:`CompressedGraphModule` that
    answers ``base``'s methods."""
    impl = type("GraphModuleImpl", (CompressedGraphModule,), {})  # fx's one class per instance
    impl.__name__ = type(compressed).__name__  # the base's class name, as fx gave it
    compressed.__class__ = impl
    compressed.recompile()  # installs the generated forward on the new class
    # Kept through a deepcopy (EMA copies): the copy compiles its own entries on first use.
    attach(
        compressed, **{BASE_METHODS_ATTRIBUTE: BaseMethods(weightless_copy(base), compile_entry)}
    )
    return compressed
