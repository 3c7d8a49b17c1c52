"""What the index run reads off a windowed block: the token each window slot holds, that the
attention's output goes back where its tokens came from, and that an MLP after ops over the grid
reads the tokens in their order."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor

from vitcompress.analysis import ops
from vitcompress.analysis.cores import Ancestry, Residual
from vitcompress.analysis.index_run import (
    IndexRun,
    grid_index,
    holds_seed_tokens,
    in_place_candidates,
    run_indices,
)
from vitcompress.analysis.model_map import AttentionCore
from vitcompress.analysis.windows.attention import WindowError, attention_at
from vitcompress.analysis.windows.paths import through_layout


def check_mlp_order(
    gm: fx.GraphModule,
    example: Tensor,
    found: list[tuple[AttentionCore, Residual, Residual]],
    anc: Ancestry,
    dtype: torch.dtype,
    image_batch: int,
) -> None:
    """A block whose MLP input is not its attention's output through layout ops (a conv over
    the grid between them) reduces that input in the attention's windows: it must hold the
    same tokens in the same order. Run on indices, the ops in between passing a token's index
    on where they keep it at its place. ``found``: each block's core, attention residual and MLP
    residual."""
    checks = [
        (core, attn, mlp)
        for core, attn, mlp in found
        if not through_layout(mlp.skip, attn.add) and mlp.skip is not attn.add
    ]
    if not checks:
        return
    seeds = {attn.add: grid_index(ops.shape(attn.add), dtype=dtype) for _, attn, _ in checks}
    in_place = in_place_candidates(
        n for _, attn, mlp in checks for n in anc.between(attn.add, mlp.skip) + [mlp.skip]
    )
    run = run_indices(gm, example, seeds, [mlp.skip for _, _, mlp in checks], in_place)
    for core, attn, mlp in checks:
        where = attention_at(core, image_batch)
        mixing = [p for n, p in run.mixing.items() if n in in_place]
        if mixing or not holds_seed_tokens(run.found.get(mlp.skip), seeds[attn.add]):
            blocker = f" ({mixing[0]} moves them)" if mixing else ""
            raise WindowError(
                f"{where}: the MLP after it does not read its tokens in their order{blocker}"
            )


def window_order(
    run: IndexRun,
    windows_in: fx.Node,
    between: set[fx.Node],
    core: AttentionCore,
    image_batch: int,
    total: int,
    where: str,
) -> Tensor:
    """The token index each window slot holds, windows one after another (one image's)."""
    if windows_in not in run.found:
        raise WindowError(f"{where}: its windows could not be traced")
    mixing = [p for n, p in run.mixing.items() if n in between or n is windows_in]
    values = run.found[windows_in]
    count, tokens = core.batch // image_batch, core.query_tokens
    values = values.reshape(image_batch, count * tokens, -1)
    if mixing or not torch.equal(values, values[..., :1].expand_as(values)):
        blocker = f" ({mixing[0]} mixes tokens)" if mixing else ""
        raise WindowError(
            f"{where}: the way from the block's tokens into its windows "
            f"is not a rearrangement{blocker}"
        )
    # A padded slot (the grid does not divide into windows) holds the padding's 0: index -1.
    index = values[..., 0].round().long() - 1
    order = index[0]
    real = order >= 0
    for b in range(image_batch):
        expected = torch.where(real, order + b * total, order)
        if not torch.equal(index[b], expected):
            raise WindowError(f"{where}: its windows mix tokens of different images")
    held = order[real].sort().values
    outside = total - held.numel()
    if 0 < outside < total and torch.equal(held, torch.arange(outside, total)):
        # A class token beside windows that cut the grid (ViTDet-like with a cls): each window
        # would need the prefix's count of its own, and a prefix token its own reduction.
        raise WindowError(
            f"{where}: {count} windows beside {outside} prefix token(s), which no window holds"
        )
    if not torch.equal(held, torch.arange(total)):
        raise WindowError(f"{where}: its windows do not hold each token exactly once")
    return order


def check_return(
    run: IndexRun,
    branch: fx.Node,
    order: Tensor,
    core: AttentionCore,
    image_batch: int,
    where: str,
) -> None:
    """The attention's output must go back where its tokens came from: slot ``s`` to token
    ``order[s]``."""
    values = run.found.get(branch)
    if values is None:
        raise WindowError(f"{where}: its output could not be traced")
    real = order >= 0
    slots_in_all = order.numel()
    tokens = int(real.sum())
    values = values.reshape(image_batch, tokens, -1)
    slots = values[..., 0].round().long() - 1
    expected = torch.empty_like(order[real])
    expected[order[real]] = torch.arange(slots_in_all)[real]
    for b in range(image_batch):
        if not torch.equal(slots[b], expected + b * slots_in_all):
            raise WindowError(
                f"{where}: its output does not return to the tokens its windows were made from"
            )
