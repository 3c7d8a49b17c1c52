"""dTPS: DynamicViT's learned predictor before the block, pruned tokens squeezed into the kept."""

from vitcompress.variants.base import Variant
from vitcompress.variants.fuses import Squeeze
from vitcompress.variants.kinds import PredictorVariant
from vitcompress.variants.registry import register_variant

SUMMARY = "learned predictor before the block; pruned tokens squeezed into kept hosts"


@register_variant
def dtps(restore: str = Squeeze.restore_default) -> Variant:
    """``restore``: how a removed token comes back where the model reads tokens by position
    (dense outputs, grid ops): delta, host, value or zero; default delta."""
    return PredictorVariant(
        name="dtps", summary=SUMMARY, fuse=Squeeze(), report_order=0, restore=restore
    )
