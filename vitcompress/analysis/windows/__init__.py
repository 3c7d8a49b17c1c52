"""Windowed attention (Swin, SAM's windowed blocks, ...): which window slot each token takes.

A block attends within windows when its attention core's batch is the images' batch times a
window count. Its tokens reach the core through ops that only move them (a shift, a partition
into windows, reshapes) and per-token ops (a norm), and its output goes back to the grid the same
way. Where that holds, the block is mapped with its window order: for every window slot, the index
of the token (in the order of the block's MLP input) it holds. A reduction then keeps the same
number of tokens in every window, which keeps the windows' batch a static shape.

The order is not derived from the ops' names or arguments: the graph is run once on the example
with token indices in place of the tokens (``IndexRun``), ops that work per token passing them
through, and what arrives at the core is read off. The same run checks that the attention's
output goes back to where its tokens came from. Padding (a grid that does not divide into its
windows) is read as slots that hold no token (-1). Anything else (a token in two windows, an op
that mixes tokens on the way) is refused in one line naming it.

The package, by what each module does: ``attention`` (what a windowed attention is, how a refusal
names it), ``paths`` (where its tokens enter and leave it, its residuals), ``order`` (what the
index run reads off: the window order, the way back), ``sizes`` (how the attention reads its
windows' sizes), ``checks`` (why its windows cannot be reduced before it, in order), ``slots``
(what it reads by window slot: one finder per family's way, in order) and ``blocks``
(``find_windowed_blocks``, which ties them together).
"""

from vitcompress.analysis.windows.attention import (
    WindowedBlock,
    WindowError,
    attention_at,
    is_windowed,
    pooling_blocker,
)
from vitcompress.analysis.windows.blocks import find_windowed_blocks
from vitcompress.analysis.windows.checks import ATTENTION_CHECKS, AttentionCheck, attention_blocker
from vitcompress.analysis.windows.paths import (
    closes_no_residual,
    on_grid,
    through_grid,
    through_layout,
    window_axis,
    window_tokens,
)
from vitcompress.analysis.windows.sizes import spatial_reads
from vitcompress.analysis.windows.slots import SLOT_FINDERS, SlotFinder, find_slot_inputs

__all__ = [
    "ATTENTION_CHECKS",
    "SLOT_FINDERS",
    "AttentionCheck",
    "SlotFinder",
    "WindowError",
    "WindowedBlock",
    "attention_at",
    "attention_blocker",
    "closes_no_residual",
    "find_slot_inputs",
    "find_windowed_blocks",
    "is_windowed",
    "on_grid",
    "pooling_blocker",
    "spatial_reads",
    "through_grid",
    "through_layout",
    "window_axis",
    "window_tokens",
]
