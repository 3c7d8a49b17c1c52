"""dTPS: DynamicViT's learned predictor before the block, pruned tokens squeezed into the kept."""

from vitcompress.variants.base import Variant
from vitcompress.variants.fuses import Squeeze
from vitcompress.variants.kinds import PredictorVariant
from vitcompress.variants.registry import register_variant

SUMMARY = "learned predictor before the block; pruned tokens squeezed into kept hosts"


@register_variant
def dtps() -> Variant:
    return PredictorVariant(name="dtps", summary=SUMMARY, fuse=Squeeze(), report_order=0)
