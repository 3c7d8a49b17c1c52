"""EViT: scored by the block's cls attention after its attention residual; pruned tokens fused into
one extra token weighted by that attention."""

from vitcompress.variants.base import Variant
from vitcompress.variants.fuses import FuseOne
from vitcompress.variants.kinds import AttentionScoredVariant
from vitcompress.variants.registry import register_variant

SUMMARY = "cls attention inside the block; pruned tokens fused into one extra token"


@register_variant
def evit(restore: str = FuseOne.restore_default) -> Variant:
    """``restore``: how a removed token comes back where the model reads tokens by position
    (dense outputs, grid ops): value or zero; default value."""
    return AttentionScoredVariant(
        name="evit", summary=SUMMARY, fuse=FuseOne(), report_order=3, restore=restore
    )
