"""DynamicViT: a learned predictor before the block; pruned tokens are dropped."""

from vitcompress.variants.base import Variant
from vitcompress.variants.fuses import Drop
from vitcompress.variants.kinds import PredictorVariant
from vitcompress.variants.registry import register_variant

SUMMARY = "learned predictor before the block; pruned tokens dropped"


@register_variant
def dynamicvit(restore: str = Drop.restore_default) -> Variant:
    """``restore``: how a removed token comes back where the model reads tokens by position
    (dense outputs, grid ops): value or zero; default value."""
    return PredictorVariant(
        name="dynamicvit", summary=SUMMARY, fuse=Drop(), report_order=2, restore=restore
    )
