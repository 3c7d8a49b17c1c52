"""dTPS: DynamicViT's learned predictor before the block, pruned tokens squeezed into the kept."""

from vitcompress.variants.base import Variant, check_switch
from vitcompress.variants.fuses import Squeeze
from vitcompress.variants.kinds import PredictorVariant
from vitcompress.variants.registry import register_variant

SUMMARY = "learned predictor before the block; pruned tokens squeezed into kept hosts"


@register_variant
def dtps(restore: str = Squeeze.restore_default, window_sizes: bool = False) -> Variant:
    """``restore``: how a removed token comes back where the model reads tokens by position
    (dense outputs, grid ops): delta, host, value or zero; default delta. ``window_sizes``: in a
    windowed block, the attention over each window's kept tokens weighs every key by how many
    tokens it stands for, ``log(1 + tokens squeezed into it)`` added to its logits (ToMe's
    proportional attention), so that a choice that prunes one kind of token more than another
    does not shift the softmax's shares (docs/windowed.md); off by default, as in the paper."""
    check_switch("window_sizes", window_sizes)
    return PredictorVariant(
        name="dtps",
        summary=SUMMARY,
        fuse=Squeeze(),
        report_order=0,
        restore=restore,
        window_sizes=window_sizes,
    )
