"""Factorised attention (TimeSformer's divided space-time attention): a block whose attention part
is several attentions over different windows (each patch position's frames, then each frame with
the class token copied into it), added back to the residual stream by ops that no one residual
add describes (a slice ``x[:, 1:]`` of the tokens, class-token outputs averaged over frames),
then an MLP residual on every token.

No reduction can follow the tokens through windows that cut them two ways, so such a block is
mapped as one window over all its tokens whose attention part runs whole: a method reduces its
MLP and the block gives every token back before its output, as a windowed block whose attention
cannot take fewer tokens does (``WholeAttention``). The last attention before the MLP
(TimeSformer's space attention) scores the tokens where its windows hold each of them once after
one leading prefix slot: where each sits there is read by an index run (``Windows.score_slots``).
Elsewhere the methods scored by attention are refused (``score_blocker``); a learned predictor
chooses on the MLP's input either way.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from vitcompress.analysis import ops
from vitcompress.analysis.cores import Ancestry, GraphFacts, Residual
from vitcompress.analysis.index_run import IndexRun, grid_index, run_indices
from vitcompress.analysis.model_map import AttentionCore
from vitcompress.analysis.window_map import WholeAttention, Windows
from vitcompress.analysis.windows import WindowedBlock, closes_no_residual, window_tokens


def find_factorised_blocks(
    graph: GraphFacts, cores: list[AttentionCore], residuals: list[Residual]
) -> tuple[list[WindowedBlock], set[str]]:
    """Every MLP residual on (B, N, C) tokens whose attention part (the cores after the previous
    MLP residual that reach its input) is two or more attentions over differently batched
    windows, none closed by a residual add of its own; each as a block of one window. Returns
    the blocks and the nodes of the attention cores they hold."""
    gm, example, image_batch, anc = graph.gm, graph.example, graph.image_batch, graph.anc
    found = _factorised_groups(gm, cores, residuals, image_batch, anc)
    # Where each block's scoring attention holds its tokens: one index run for all the blocks.
    # The last attention before each MLP (TimeSformer's space attention) scores.
    probes = {
        i: _slot_probe(gm, group[-1], ops.shape(mlp.skip)[1], image_batch, anc.by_name)
        for i, (mlp, group, _) in enumerate(found)
    }
    probes = {i: probe for i, probe in probes.items() if probe is not None}
    run = None
    if probes:
        seeds = {
            source: grid_index(ops.shape(source), dtype=example.dtype)
            for _, source in probes.values()
        }
        run = run_indices(gm, example, seeds, [windows_in for windows_in, _ in probes.values()])
    blocks: list[WindowedBlock] = []
    for i, (mlp, group, entry) in enumerate(found):
        slots = None
        if run is not None and i in probes:
            slots = _score_slots(run, probes[i], group[-1], image_batch, anc)
        blocks.append(_factorised_block(mlp, group, entry, slots, image_batch, anc))
    return blocks, {c.node for _, group, _ in found for c in group}


def _factorised_groups(
    gm: fx.GraphModule,
    cores: list[AttentionCore],
    residuals: list[Residual],
    image_batch: int,
    anc: Ancestry,
) -> list[tuple[Residual, list[AttentionCore], fx.Node]]:
    """Each MLP residual whose attention part is factorised, with its attentions and the
    block's entry, in graph order."""
    by_name = anc.by_name
    inside = {n.name for r in residuals for n in r.nodes}
    core_nodes = {c.node for c in cores}
    free = [c for c in cores if c.node not in inside]
    found: list[tuple[Residual, list[AttentionCore], fx.Node]] = []  # MLP, attentions, entry
    boundary: fx.Node | None = None  # the previous residual add: a block starts after it
    for mlp in sorted(residuals, key=lambda r: anc.index[r.add]):
        shape = ops.shape(mlp.skip)
        if (
            shape is None
            or len(shape) != 3
            or shape[0] != image_batch
            or any(n.name in core_nodes for n in mlp.nodes)  # an attention residual
        ):
            boundary = mlp.add
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
        if entry is None or ops.shape(entry) != shape:
            continue
        found.append((mlp, group, entry))
    return found


def _factorised_block(
    mlp: Residual,
    group: list[AttentionCore],
    entry: fx.Node,
    slots: tuple[int, ...] | None,
    image_batch: int,
    anc: Ancestry,
) -> WindowedBlock:
    """One window over the block's tokens whose attention part runs whole, scored by its last
    attention where that holds every token once (``slots``)."""
    paths = ", ".join(c.path or c.node for c in group)
    windows = ", ".join(f"{c.batch // image_batch} windows of {c.query_tokens}" for c in group)
    tokens = ops.shape(mlp.skip)[1]
    scorer = group[-1]
    return WindowedBlock(
        core=scorer,
        attn=Residual(mlp.skip, entry, mlp.skip, anc.between(entry, mlp.skip)),
        mlp=mlp,
        windows=Windows(
            count=1,
            tokens=tokens,
            order=tuple(range(tokens)),
            mlp_input_node=mlp.skip.name,
            attention=WholeAttention(
                f"factorised attention ({paths}: {windows} per image), added back by "
                "ops no residual add describes, so its attention part runs on every "
                "token"
            ),
            score_slots=slots,
        ),
        score_blocker=None
        if slots is not None
        else (
            f"its attention is factorised ({paths}, over different windows), and the "
            f"last ({scorer.path or scorer.node}) does not hold every token once after "
            "a leading prefix in each window, so no one attention scores all of the "
            "block's tokens"
        ),
    )


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


def _slot_probe(
    gm: fx.GraphModule,
    scorer: AttentionCore,
    tokens: int,
    image_batch: int,
    by_name: dict[str, fx.Node],
) -> tuple[fx.Node, fx.Node] | None:
    """Where to read where ``scorer`` holds a block's tokens: its windows, where they hold every
    patch token once after one leading prefix slot each (TimeSformer's space attention: each
    frame's patches after a copy of the class token), and the (B, tokens - 1, C) patch tokens
    they are laid out from, to be seeded with token indices; ``None`` where they cannot."""
    windows_in = window_tokens(gm, by_name[scorer.node])
    per_window, batch = scorer.query_tokens, scorer.batch
    if windows_in is None or per_window is None or batch is None:
        return None
    if batch // image_batch * (per_window - 1) != tokens - 1:
        return None
    source = _patch_source(windows_in, image_batch, tokens - 1)
    return (windows_in, source) if source is not None else None


def _score_slots(
    run: IndexRun,
    probe: tuple[fx.Node, fx.Node],
    scorer: AttentionCore,
    image_batch: int,
    anc: Ancestry,
) -> tuple[int, ...] | None:
    """For each patch token (in the block's order), the slot of its score among the scoring
    windows' patch slots, read off the index run; ``None`` where the windows are not a
    rearrangement of the tokens."""
    windows_in, source = probe
    per_window, batch = scorer.query_tokens, scorer.batch
    count = batch // image_batch
    patches = count * (per_window - 1)
    values = run.found.get(windows_in)
    between = set(anc.between(source, windows_in)) | {windows_in}
    if any(node in between for node in run.mixing):  # not a rearrangement of the tokens
        return None
    if values is None or values.numel() // values.shape[-1] != batch * per_window:
        return None
    # Each window's leading slot (the class token's copy) is left out: it is not a patch token.
    held = values.reshape(image_batch, count, per_window, -1)[:, :, 1:].reshape(
        image_batch, patches, -1
    )
    if not torch.equal(held, held[..., :1].expand_as(held)):
        return None
    index = held[..., 0].round().long() - 1
    order = index[0]
    shifted = order.unsqueeze(0) + torch.arange(image_batch).unsqueeze(1) * patches
    if not torch.equal(index, shifted) or not torch.equal(
        order.sort().values, torch.arange(patches)
    ):
        return None
    return tuple(order.argsort().tolist())


def _patch_source(windows_in: fx.Node, image_batch: int, patches: int) -> fx.Node | None:
    """The (B, patches, C) tokens the windows are laid out from: back from the windows through
    per-token and layout ops, and through a concatenation by its largest operand (the patches,
    not the prefix copies joined to them)."""
    node = windows_in
    for _ in range(16):
        shape = ops.shape(node)
        if shape is not None and len(shape) == 3 and shape[:2] == (image_batch, patches):
            return node
        if ops.is_cat(node):
            operands = [o for o in node.args[0] if isinstance(o, fx.Node) and ops.shape(o)]
            if not operands:
                return None
            node = max(operands, key=lambda o: ops.shape(o)[1])
            continue
        inputs = [i for i in node.all_input_nodes if i.meta.get("carries_tensor", True)]
        if not inputs:
            return None
        node = inputs[0]
    return None
