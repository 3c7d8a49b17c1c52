"""eTPS: scored by the block's cls attention after its attention residual; pruned tokens squeezed
into the kept."""

from vitcompress.variants.base import Variant
from vitcompress.variants.fuses import Squeeze
from vitcompress.variants.kinds import AttentionScoredVariant
from vitcompress.variants.registry import register_variant

SUMMARY = "cls attention inside the block; pruned tokens squeezed into kept hosts"


@register_variant
def etps(restore: str = Squeeze.restore_default) -> Variant:
    """``restore``: how a removed token comes back where the model reads tokens by position
    (dense outputs, grid ops): delta, host, value or zero; default delta."""
    return AttentionScoredVariant(
        name="etps", summary=SUMMARY, fuse=Squeeze(), report_order=1, restore=restore
    )
