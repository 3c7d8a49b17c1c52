"""Factorised attention (TimeSformer's divided space-time attention): a block whose attention part
is several attentions over different windows (each patch position's frames, then each frame with
the class token copied into it), added back to the residual stream by ops that no one residual
add describes (a slice ``x[:, 1:]`` of the tokens, class-token outputs averaged over frames),
then an MLP residual on every token.

No reduction can follow the tokens through windows that cut them two ways, so such a block is
mapped as one window over all its tokens whose attention part runs whole: a method reduces its
MLP and the block gives every token back before its output, as a windowed block whose attention
cannot take fewer tokens does (``Windows.attention_blocker``). No single attention scores the
block's tokens, so the methods scored by attention are refused there (``score_blocker``); a
learned predictor chooses on the MLP's input.
"""

from __future__ import annotations

import torch.fx as fx

from vitcompress.analysis import ops
from vitcompress.analysis.cores import Ancestry, Residual
from vitcompress.analysis.model_map import AttentionCore, Windows
from vitcompress.analysis.windows import WindowedBlock, closes_no_residual


def find_factorised_blocks(
    gm: fx.GraphModule,
    cores: list[AttentionCore],
    residuals: list[Residual],
    image_batch: int,
    anc: Ancestry,
) -> tuple[list[WindowedBlock], set[str]]:
    """Every MLP residual on (B, N, C) tokens whose attention part (the cores after the previous
    MLP residual that reach its input) is two or more attentions over differently batched
    windows, none closed by a residual add of its own; each as a block of one window. Returns
    the blocks and the nodes of the attention cores they hold."""
    by_name = {n.name: n for n in gm.graph.nodes}
    inside = {n.name for r in residuals for n in r.nodes}
    free = [c for c in cores if c.node not in inside]
    blocks: list[WindowedBlock] = []
    taken: set[str] = set()
    boundary: fx.Node | None = None  # the previous MLP residual's add
    for mlp in sorted(residuals, key=lambda r: anc.index[r.add]):
        shape = ops.shape(mlp.skip)
        if shape is None or len(shape) != 3 or shape[0] != image_batch:
            continue
        if any(n.name in {c.node for c in cores} for n in mlp.nodes):
            boundary = mlp.add  # an attention residual, not an MLP's
            continue
        group = [
            c
            for c in free
            if anc.is_ancestor(by_name[c.node], mlp.skip)
            and (boundary is None or anc.is_ancestor(boundary, by_name[c.node]))
        ]
        previous, boundary = boundary, mlp.add
        batches = {c.batch for c in group}
        if len(group) < 2 or len(batches) < 2 or None in batches:
            continue
        if not all(closes_no_residual(gm, c, anc) for c in group):
            continue
        entry = previous if previous is not None else _entry(group, mlp, by_name, anc)
        if entry is None:
            continue
        taken.update(c.node for c in group)
        paths = ", ".join(c.path or c.node for c in group)
        windows = ", ".join(f"{c.batch // image_batch} windows of {c.query_tokens}" for c in group)
        tokens = shape[1]
        blocks.append(
            WindowedBlock(
                core=group[-1],
                attn=Residual(mlp.skip, entry, mlp.skip, anc.between(entry, mlp.skip)),
                mlp=mlp,
                windows=Windows(
                    count=1,
                    tokens=tokens,
                    order=tuple(range(tokens)),
                    mlp_input_node=mlp.skip.name,
                    attention_blocker=(
                        f"factorised attention ({paths}: {windows} per image), added back by "
                        "ops no residual add describes, so its attention part runs on every "
                        "token"
                    ),
                ),
                score_blocker=(
                    f"its attention is factorised ({paths}, over different windows), so no one "
                    "attention scores all of the block's tokens"
                ),
            )
        )
    return blocks, taken


def _entry(
    group: list[AttentionCore], mlp: Residual, by_name: dict[str, fx.Node], anc: Ancestry
) -> fx.Node | None:
    """The first block's input: the last node before its first attention, of the shape of the
    tokens entering its MLP, that every attention of the block reads."""
    first = min(anc.index[by_name[c.node]] for c in group)
    shape = ops.shape(mlp.skip)
    for node in reversed(anc.nodes[:first]):
        if ops.shape(node) == shape and all(anc.is_ancestor(node, by_name[c.node]) for c in group):
            return node
    return None
