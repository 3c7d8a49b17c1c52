"""The variant registry: ``@register_variant`` on a factory, as timm's ``@register_model``.

A method is one module that defines a :class:`~vitcompress.variants.base.Variant` and registers
it; importing the module registers it. The built-in ones are imported by the package.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar

from vitcompress.errors import UserError
from vitcompress.variants.base import Variant

_REGISTRY: dict[str, Variant] = {}

Factory = TypeVar("Factory", bound=Callable[[], Variant])


class UnknownVariantError(KeyError, UserError):
    """No variant of that name is registered."""

    def __str__(self) -> str:
        return str(self.args[0])


def register_variant(factory: Factory) -> Factory:
    """Register the variant ``factory()`` returns under its name; returns the factory unchanged.

    A name registered twice is refused: a second method must not silently replace the first.
    """
    variant = factory()
    if not isinstance(variant, Variant):
        raise TypeError(f"{factory.__name__} must return a Variant, got {type(variant).__name__}")
    if variant.name in _REGISTRY:
        raise ValueError(f"variant {variant.name!r} is already registered")
    _REGISTRY[variant.name] = variant
    return factory


def unregister_variant(name: str) -> Variant:
    """Remove a registered variant (for tests and plugins that register temporarily)."""
    return _REGISTRY.pop(name)


def get_variant(name: str) -> Variant:
    """The registered variant called ``name``; :class:`UnknownVariantError` names the choices."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise UnknownVariantError(
            f"{name!r} is unknown; choose from {', '.join(variant_names())}"
        ) from None


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
