"""The variant registry: ``@register_variant`` on a factory, as timm's ``@register_model``.

A method is one module that defines a :class:`~vitcompress.variants.base.Variant` and registers
its factory; importing the module registers it. The built-in ones are imported by the package.
The factory's keyword parameters are the method's settings (ToMe's ``r``): they reach it from
``--variant-arg KEY=VALUE`` and ``compress(..., variant_args={...})`` through
:func:`get_variant`, with no other code knowing them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from vitcompress.errors import UserError
from vitcompress.variants.base import Variant, VariantRefusal, check_switch

_REGISTRY: dict[str, Variant] = {}  # name -> the variant with its default settings
_FACTORIES: dict[str, Callable[..., Variant]] = {}

Factory = TypeVar("Factory", bound=Callable[..., Variant])


# Settings every method takes, beside its factory's own: they concern where any method's
# reduction acts, not how it scores or fuses. ``carry_windows``: a windowed block after a
# location, in the same windows, reduces by the location's choice (docs/windowed.md);
# ``carry_branches``: the per-token residual branches after a windowed location or a block
# carrying its choice (the MLPs of DaViT's channel blocks, each the second half of a (spatial,
# channel) pair) reduce by it too; on by default (0.15-0.42 points for eTPS, EViT and ToMe on
# the one DaViT measured, for 8-10% fewer MACs: docs/windowed.md).
# ``kept_multiple``: the tokens present after each location (prefix tokens included) rounded to
# a multiple of it, 8 for tensor-core tiles (docs/serving.md); None: as the keep gives them.
COMMON_SETTINGS: dict[str, Any] = {
    "carry_windows": False,
    "carry_branches": True,
    "kept_multiple": None,
}


class UnknownVariantError(KeyError, UserError):
    """No variant of that name is registered."""

    def __str__(self) -> str:
        return str(self.args[0])


def register_variant(factory: Factory) -> Factory:
    """Register the variant ``factory()`` returns under its name; returns the factory unchanged.
    Its keyword parameters, each with a default, are the method's settings.

    A name registered twice is refused: a second method must not silently replace the first.
    """
    variant = factory()
    if not isinstance(variant, Variant):
        raise TypeError(f"{factory.__name__} must return a Variant, got {type(variant).__name__}")
    if variant.name in _REGISTRY:
        raise ValueError(f"variant {variant.name!r} is already registered")
    _REGISTRY[variant.name] = variant
    _FACTORIES[variant.name] = factory
    return factory


def unregister_variant(name: str) -> Variant:
    """Remove a registered variant (for tests and plugins that register temporarily)."""
    _FACTORIES.pop(name, None)
    return _REGISTRY.pop(name)


def get_variant(name: str, args: Mapping[str, Any] | None = None) -> Variant:
    """The registered variant called ``name``, made with the settings ``args`` (none: its
    defaults); :class:`UnknownVariantError` names the choices, and a setting the method does not
    declare or refuses is a :class:`VariantRefusal` on ``variant_args``."""
    try:
        variant = _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownVariantError(
            f"{name!r} is unknown; choose from {', '.join(variant_names())}"
        ) from None
    if not args:
        return variant
    declared = variant_settings(name)
    unknown = [key for key in args if key not in declared]
    if unknown:
        offered = f"it takes {', '.join(declared)}" if declared else "it takes none"
        raise VariantRefusal(
            f"{', '.join(map(str, unknown))}: {name} has no such setting; {offered}",
            "variant_args",
        )
    own = {key: value for key, value in args.items() if key not in COMMON_SETTINGS}
    common = {key: value for key, value in args.items() if key in COMMON_SETTINGS}
    for key, value in common.items():
        if key == "kept_multiple":
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise VariantRefusal(
                    f"{key}: must be a whole number of tokens >= 1, got {value!r}", "variant_args"
                )
        else:
            check_switch(key, value)
    made = _FACTORIES[name](**own)
    return dataclasses.replace(made, args=tuple(sorted(args.items())), **common)


def variant_settings(name: str) -> dict[str, Any]:
    """A registered method's settings and their defaults: its factory's keyword parameters,
    then :data:`COMMON_SETTINGS`."""
    get_variant(name)  # unknown names are refused with the choices
    parameters = inspect.signature(_FACTORIES[name]).parameters.values()
    own = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    return {**own, **COMMON_SETTINGS}


def variant_names() -> list[str]:
    """The registered variants' names, in registration order."""
    return list(_REGISTRY)


class VariantTable(Mapping[str, Variant]):
    """A read-only, live view of the registry: name -> Variant."""

    def __getitem__(self, name: str) -> Variant:
        return _REGISTRY[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(_REGISTRY))

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return f"VariantTable({variant_names()})"


VARIANTS: Mapping[str, Variant] = VariantTable()
