"""What a windowed attention is (a core batched as images x windows), how a refusal names it,
and the record of a windowed block as the analysis pairs it."""

from __future__ import annotations

from dataclasses import dataclass

from vitcompress.analysis.cores import Residual
from vitcompress.analysis.model_map import AttentionCore, Windows
from vitcompress.errors import UserError


class WindowError(UserError):
    """A windowed block whose windows cannot be kept whole under a reduction; one line."""


@dataclass
class WindowedBlock:
    """A windowed block as the analysis pairs it: its core, its attention residual (any rank:
    Swin's is on the (B, H, W, C) grid), its MLP residual on (B, L, C) tokens, and its windows."""

    core: AttentionCore
    attn: Residual
    mlp: Residual
    windows: Windows
    # Why no attention of the block scores its tokens (a factorised attention's, ``factorised.py``)
    score_blocker: str | None = None


def is_windowed(core: AttentionCore, image_batch: int) -> bool:
    """Whether ``core`` attends within windows: its batch is a multiple of the images'."""
    return core.batch is not None and core.batch > image_batch and core.batch % image_batch == 0


def attention_at(core: AttentionCore, image_batch: int) -> str:
    """How a refusal names ``core``: ``windowed attention at blocks.0.attn``, or, for one
    attention over a grid it was laid out from (NextViT's, MViTv2's), ``attention over its
    whole grid at ...``: the window analysis takes both."""
    kind = (
        "windowed attention" if is_windowed(core, image_batch) else "attention over its whole grid"
    )
    return f"{kind} at {core.path or core.node}"


def pooling_blocker(core: AttentionCore, windowed: bool = True) -> str | None:
    """Why a windowed core's block cannot be reduced, or ``None``: SAM2-Hiera's stage
    transitions pool the queries within each window (mask unit), so the block leaves fewer
    tokens than it takes and no window keeps its token count. Such a block is left whole: the
    blocks around it restore their tokens before their outputs, so it sees the full grid. Keys
    pooled in a window (or over a grid laid out from the tokens: NextViT's) are left whole too:
    reducing the tokens the window's keys are pooled from is not followed. ``windowed=False``:
    one attention over the whole grid (MViTv2's stage transitions), said without windows."""
    if core.key_tokens is None or core.query_tokens is None:
        return None
    if core.query_tokens == core.key_tokens:
        return None
    counts = f"{core.query_tokens} queries against {core.key_tokens} keys"
    if core.query_tokens > core.key_tokens:  # keys pooled, as PVT's reduction does
        where = "within each window" if windowed else "from its grid"
        return (
            f"its keys are pooled {where} ({counts}), and reducing the tokens they are "
            "pooled from is not supported there"
        )
    if not windowed:
        return (
            f"its queries are pooled ({counts}), so the block changes the token count and no "
            "reduction keeps it"
        )
    return (
        f"its queries are pooled ({counts} per window), so the block changes the token count "
        "and its windows cannot be reduced alike"
    )
