"""Stages and their grids: where a run of blocks starts (its prefix tokens, its patch grid), where
it ends (the first grid its tokens become, a join of prefix tokens, a way around that grid) and
whether a head reads the first token alone. Read from the dataflow and the recorded shapes."""

from __future__ import annotations

import math
import operator

import torch.fx as fx
from torch import nn

from vitcompress.analysis import ops
from vitcompress.analysis.cores import Ancestry
from vitcompress.analysis.grid_ops import tokens_before_grid
from vitcompress.analysis.model_map import Stage
from vitcompress.analysis.refusals import MappingError


def grid_from(
    node: fx.Node, patch_tokens: int, rank: int = 2, views: bool = False
) -> tuple[int, ...] | None:
    """The grid of ``rank`` dims that ``node`` lays ``patch_tokens`` out on: channels first
    (B, C, *grid) or channels last (B, *grid, C). Upstream of the blocks (``views`` false) a
    grid of more than 2 dims (a video's (T, H, W)) is taken only from a tensor something
    computed, not from a view of one: a view that splits a grid into blocks (Hiera's unroll)
    has the same cells."""
    shape = ops.shape(node)
    if shape is None or len(shape) != rank + 2:
        return None
    if rank > 2 and not views and ops.is_layout(node):
        return None
    if math.prod(shape[2:]) == patch_tokens:  # channels first (B, C, H, W)
        return tuple(shape[2:])
    if math.prod(shape[1:-1]) == patch_tokens:  # channels last (B, H, W, C)
        return tuple(shape[1:-1])
    return None


def analyse_entry(
    entry: fx.Node, image: fx.Node, anc: Ancestry
) -> tuple[int, tuple[int, ...], fx.Node, fx.Node | None]:
    """Prefix-token count, patch grid, patch-token node and grid node of a stage's entry.

    A 2-D grid upstream wins; only where there is none is one of higher rank looked for (a
    video's (B, C, T, H, W) patch embedding), from the entry up again."""
    prefix, patch_node, found = _walk_to_grid(entry, image, anc, rank=2)
    if found is None:
        prefix, patch_node, found = _walk_to_grid(entry, image, anc, rank=None)
    if found is not None:
        grid, grid_node = found
        return prefix, grid, patch_node, grid_node
    tokens = ops.shape(entry)[1]
    patch_tokens = tokens - prefix
    side = math.isqrt(patch_tokens)
    if side * side != patch_tokens:
        raise MappingError(
            f"found {tokens} tokens entering the blocks ({prefix} prefix) but no 2-D patch grid "
            "(nor one of higher rank, such as a video's T x H x W) upstream and the patch count "
            "is not square"
        )
    return prefix, (side, side), patch_node, None


_MAX_GRID_RANK = 6  # grid dims looked for above 2 (a video's T, H, W is 3)


def _rejoined_prefix(operand: fx.Node, patch: fx.Node, anc: Ancestry) -> bool:
    """Whether ``operand``, joined before the patch tokens ``patch``, is the leading token(s) of a
    tensor the patches were also cut from (TimeSformer's class token: ``x[:B, 0]`` split off
    the frames' tokens, joined again in front of the patches regrouped): a prefix, though the
    image's ancestry reaches it through that tensor."""
    node = operand
    for _ in range(4):
        if node.op == "call_function" and node.target is operator.getitem:
            break
        shaping = ops.is_layout(node) or (
            node.op == "call_method" and node.target in ("unsqueeze", "expand")
        )
        if not shaping or not node.all_input_nodes:
            return False
        node = node.all_input_nodes[0]
    else:
        return False
    source, index = node.args[0], node.args[1]
    if not isinstance(source, fx.Node) or not isinstance(index, tuple) or len(index) < 2:
        return False
    leading = index[1] == 0 or (
        isinstance(index[1], slice) and index[1].start in (None, 0) and index[1].stop is not None
    )
    fewer = (ops.shape(operand) or (0, 0))[1] < (ops.shape(patch) or (0, 0))[1]
    return operand is not patch and leading and fewer and anc.is_ancestor(source, patch)


def _walk_to_grid(
    entry: fx.Node, image: fx.Node, anc: Ancestry, rank: int | None
) -> tuple[int, fx.Node, tuple[tuple[int, ...], fx.Node] | None]:
    """Walk up from a stage's entry to its patch grid: (prefix-token count, patch-token node,
    (grid, grid node) or ``None``). ``rank``: the grid's dims, or ``None`` for any above 2."""
    ranks = (rank,) if rank is not None else tuple(range(3, _MAX_GRID_RANK + 1))
    tokens = ops.shape(entry)[1]
    patches = tokens  # the patch tokens the grid must hold: the last patch operand's count
    node = entry
    patch_node = entry
    for _ in range(256):
        if ops.is_cat(node):
            operands = node.args[0] if node.args else node.kwargs.get("tensors")
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            out_shape = ops.shape(node)
            if out_shape is not None and len(out_shape) == 3 and dim in (1, -2):
                from_image = [
                    o
                    for o in operands
                    if anc.is_ancestor(image, o) and not _rejoined_prefix(o, operands[-1], anc)
                ]
                if len(from_image) != 1:
                    raise MappingError(
                        f"token concatenation {node.name} joins {len(from_image)} image-derived "
                        "token sets; expected one patch-token set plus prefix tokens"
                    )
                patch = from_image[0]
                if operands.index(patch) != len(operands) - 1:
                    raise MappingError(
                        f"tokens made from parameters are appended after the patch tokens at "
                        f"{node.name}; only prefix tokens (before the patches) are supported"
                    )
                # Counted from the patch operand, not by adding up the prefix operands: a prefix
                # split off and joined again (DINOv2-with-registers' ``x[:, :1]``, registers,
                # ``x[:, 1:]``) is met a second time further up, where it first joined.
                patches = ops.shape(patch)[1]
                node = patch
                patch_node = patch
                continue
        for dims in ranks:
            grid = grid_from(node, patches, dims)
            if grid is not None:
                return tokens - patches, patch_node, (grid, node)
        candidates = [
            n
            for n in node.all_input_nodes
            if ops.shape(n) is not None and (n is image or anc.is_ancestor(image, n))
        ]
        if not candidates or node is image:
            break
        node = candidates[0]
    return tokens - patches, patch_node, None


def find_stage_exit(stage: Stage, out: fx.Node, end: fx.Node | None, anc: Ancestry) -> None:
    """The first place after a stage where its output tokens become a (B, C, H, W) grid (of
    the stage's grid rank: (B, C, T, H, W) for a video's)."""
    cells = math.prod(stage.grid)
    rank = len(stage.grid)
    stop = anc.index[end] if end is not None else len(anc.nodes)
    for node in anc.nodes[anc.index[out] + 1 : stop]:
        shape = ops.shape(node)
        if shape is None or len(shape) != rank + 2 or not anc.is_ancestor(out, node):
            continue
        if grid_from(node, cells, rank, views=True) is not None:
            found = tokens_before_grid(node, cells)
            if found is not None and (found[0] is out or anc.is_ancestor(out, found[0])):
                stage.exit_tokens_node, stage.exit_grid_node = found[0].name, found[1].name
        return


def find_prefix_join(
    gm: fx.GraphModule, stage: Stage, out: fx.Node, end: fx.Node, image: fx.Node, anc: Ancestry
) -> None:
    """A stage that ends where prefix tokens join its output (ConViT's class token, joined after
    its gated positional blocks: ``cat((cls, x), 1)`` is the next stage's entry). The join is
    the stage's exit: reduced tokens get their full grid back, in grid order, before it, as
    before an exit grid, so that the next stage starts from every patch token in order."""
    if not ops.is_cat(end):
        return
    operands = end.args[0] if end.args else end.kwargs.get("tensors")
    dim = end.args[1] if len(end.args) > 1 else end.kwargs.get("dim", 0)
    if dim not in (1, -2) or not isinstance(operands, (list, tuple)):
        return
    from_image = [o for o in operands if o is image or anc.is_ancestor(image, o)]
    if len(from_image) != 1 or from_image[0] is not operands[-1]:
        return
    if through_identities(gm, from_image[0]) is not out:
        return
    stage.exit_tokens_node, stage.exit_grid_node = from_image[0].name, end.name


def exit_bypass(out: fx.Node, end: fx.Node, exit_grid: fx.Node | None, anc: Ancestry) -> str | None:
    """Where a stage's output tokens reach the next stage other than through its exit grid
    (which gets the full grid back when tokens were reduced): the module path of the first op
    on such a path, else ``None``. Hiera pools its unrolled tokens by a view over their order
    there; reduced tokens would make that pooling wrong, or crash it."""

    def onward(node: fx.Node) -> list[fx.Node]:
        if node is end:
            return []
        return [u for u in node.users if u is not exit_grid and u.meta.get("carries_tensor", True)]

    reached = set(ops.reachable(out, onward)) - {out}
    if end not in reached:
        return None
    to_exit = [n for n in reached if exit_grid is not None and anc.is_ancestor(n, exit_grid)]
    bypass = sorted(
        (n for n in reached if n not in to_exit and anc.is_ancestor(n, end)),
        key=anc.index.__getitem__,
    )
    first = bypass[0] if bypass else end
    return ops.module_path(first) or first.name


def through_identities(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """The node whose value ``node`` passes on unchanged: an ``nn.Identity`` or dropout module
    between two blocks (HuggingFace CvT's drop path at rate 0) still chains them in one stage."""
    while node.op == "call_module" and node.args and isinstance(node.args[0], fx.Node):
        if not isinstance(gm.get_submodule(str(node.target)), (nn.Identity, nn.Dropout)):
            break
        node = node.args[0]
    return node


def reads_first_token(stream: fx.Node, anc: Ancestry) -> bool:
    """Whether something after the last block takes token 0 alone (``x[:, 0]``): a cls head."""
    for node in anc.nodes[anc.index[stream] :]:
        if node is not stream and not anc.is_ancestor(stream, node):
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            index = node.args[1]
            if (
                isinstance(index, tuple)
                and len(index) >= 2
                and index[1] == 0
                and index[0] == slice(None)
            ):
                return True
        if ops.is_select_first_token(node):
            return True
    return False
