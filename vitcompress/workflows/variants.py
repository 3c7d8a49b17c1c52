"""``variants``: what each registered method is, read from its object."""

from __future__ import annotations

from typing import Any

from vitcompress.variants import VARIANTS, variant_settings


def describe_variants() -> list[dict[str, Any]]:
    """One row per registered method, read from its object (so a method registered by importing
    its module is listed as the built-in ones are)."""
    return [
        {
            "name": name,
            "summary": method.summary,
            "scorer": method.scorer.label,
            "fuse": method.fuse.label,
            "learned": method.learned,
            "settings": variant_settings(name),
            "searchable": method.searchable,
            "fused_kernel": method.fused_kernel,
        }
        for name, method in VARIANTS.items()
    ]
