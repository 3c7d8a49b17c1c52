"""DynamicViT: a learned predictor before the block; pruned tokens are dropped."""

from vitcompress.variants.base import Variant
from vitcompress.variants.fuses import Drop
from vitcompress.variants.kinds import PredictorVariant
from vitcompress.variants.registry import register_variant

SUMMARY = "learned predictor before the block; pruned tokens dropped"


@register_variant
def dynamicvit() -> Variant:
    return PredictorVariant(name="dynamicvit", summary=SUMMARY, fuse=Drop(), report_order=2)
