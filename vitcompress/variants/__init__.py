"""Token-reduction methods, each one registered :class:`Variant` (see ``base.py``).

Importing this package registers the built-in variants, one module each; a new method is one more
module that registers itself with ``@register_variant`` (docs/method.md, "Adding a method").
"""

from vitcompress.variants.base import Variant, VariantRefusal
from vitcompress.variants.fuses import Drop, Fuse, FuseOne, Merge, Squeeze
from vitcompress.variants.placement import AFTER_ATTENTION, BEFORE_BLOCK
from vitcompress.variants.registry import (
    VARIANTS,
    UnknownVariantError,
    get_variant,
    register_variant,
    unregister_variant,
    variant_names,
    variant_settings,
)
from vitcompress.variants.scorers import (
    AttentionScorer,
    MatchingScorer,
    PredictorScorer,
    Scorer,
    ScoringCost,
)

# Registration happens on import, in this order (the order of the command line's choices).
from vitcompress.variants import dtps, dynamicvit, etps, evit, tome  # noqa: E402, F401  isort: skip

__all__ = [
    "AFTER_ATTENTION",
    "BEFORE_BLOCK",
    "VARIANTS",
    "AttentionScorer",
    "Drop",
    "Fuse",
    "FuseOne",
    "MatchingScorer",
    "Merge",
    "PredictorScorer",
    "Scorer",
    "ScoringCost",
    "Squeeze",
    "UnknownVariantError",
    "Variant",
    "VariantRefusal",
    "get_variant",
    "register_variant",
    "unregister_variant",
    "variant_names",
    "variant_settings",
]
