"""Find the transformer structure of a captured ViT by analysing its graph.

No class or attribute names are consulted. The analysis reads only the dataflow and the shapes
recorded on an example input:

- attention cores: a fused SDPA call, a softmax whose logits come from a matmul/einsum, or a
  kept-whole ``nn.MultiheadAttention``;
- residual adds: ``add(skip, branch)`` of two (B, N, C) tensors where ``skip`` is an ancestor of
  ``branch``; a block is an attention residual followed by the MLP residual built on its output;
- stages: runs of blocks chained output-to-input; a stage's prefix tokens are the operands of the
  token ``cat`` that do not derive from the image, its grid the last (B, C, H, W) tensor upstream
  (or, where there is none, of higher rank: a video's (B, C, T, H, W), grid (T, H, W));
- grid ops: convs and pools inside a block whose input is tokens reshaped to a grid;
- position uses: tensors laid out by token position that meet the tokens inside a block
  (``positions.py``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import replace

import torch.fx as fx
from torch import nn

from vitcompress.analysis import ops
from vitcompress.analysis.capture import CapturedGraph
from vitcompress.analysis.cores import (
    Ancestry,
    Residual,
    find_attention_cores,
    find_residuals,
    find_window_axis_attention,
)
from vitcompress.analysis.factorised import find_factorised_blocks
from vitcompress.analysis.final_norm import find_final_norm
from vitcompress.analysis.model_map import (
    AttentionCore,
    Block,
    GridOp,
    ModelMap,
    Stage,
    TokenReader,
    Windows,
)
from vitcompress.analysis.parallel import Combination, block_end, combine_cores
from vitcompress.analysis.per_token import find_per_token_branches
from vitcompress.analysis.positions import find_position_uses, find_token_readers
from vitcompress.analysis.windows import (
    WindowError,
    attention_at,
    find_windowed_blocks,
    is_windowed,
    on_grid,
    pooling_blocker,
    through_grid,
    through_layout,
    window_tokens,
)
from vitcompress.errors import UserError


class MappingError(UserError):
    """The graph does not look like a ViT this tool can rewrite; says what was found and missing."""


def _placeholder(gm: fx.GraphModule) -> fx.Node:
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            return node
    raise MappingError("the graph has no input")


def _grid_from(
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


def _analyse_entry(
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
    prefix = 0
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
                from_params = [o for o in operands if o not in from_image]
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
                prefix += sum(ops.shape(o)[1] for o in from_params)
                node = patch
                patch_node = patch
                continue
        for dims in ranks:
            grid = _grid_from(node, tokens - prefix, dims)
            if grid is not None:
                return prefix, patch_node, (grid, node)
        candidates = [
            n
            for n in node.all_input_nodes
            if ops.shape(n) is not None and (n is image or anc.is_ancestor(image, n))
        ]
        if not candidates or node is image:
            break
        node = candidates[0]
    return prefix, patch_node, None


def _grid_ops(
    gm: fx.GraphModule,
    attn: Residual,
    mlp: Residual | None,
    anc: Ancestry,
    attention_whole: bool,
) -> list[GridOp]:
    """The ops of a block that read its token grid; an attention that runs on every token
    (``attention_whole``) needs no grid given back, so its ops are not among them."""
    found = []
    branches = (("mlp", mlp),) if attention_whole else (("attention", attn), ("mlp", mlp))
    for branch_name, residual in branches:
        for node, kind, in_shape in _grid_nodes(gm, residual) if residual is not None else []:
            grid = tuple(in_shape[2:])  # (H, W), or a video's (T, H, W)
            found_tokens = _tokens_before_grid(node.args[0], math.prod(grid))
            if found_tokens is None:
                reason = _per_head_grid(node, kind, in_shape, residual)
                if reason is not None:  # a pooling attention's block runs it whole: not here
                    raise MappingError(
                        f"{reason}, in the block's {branch_name} branch, where it cannot run "
                        "whole; the block's tokens cannot be reduced"
                    )
                continue
            tokens_node, to_grid = found_tokens
            from_grid = _flatten_back(node, math.prod(grid), len(in_shape))
            found.append(
                GridOp(
                    path=ops.module_path(node) if node.op == "call_module" else node.name,
                    kind=kind,
                    branch=branch_name,
                    grid=grid,
                    to_grid_node=to_grid.name,
                    tokens_node=tokens_node.name,
                    op_node=node.name,
                    from_grid_node=from_grid.name if from_grid is not None else None,
                )
            )
    return found


def _per_head_grid(node: fx.Node, kind: str, in_shape: tuple, residual: Residual) -> str | None:
    """Pooling attention (MViTv2): queries, keys or values split into heads, each head's laid
    out on the token grid ((images x heads, C/h, H, W)) and pooled by a conv there. No (B, N, C)
    tokens lead to that grid through layout ops alone, so the grid cannot be given back to
    reduced tokens before the op (as it is for PVT's spatial reduction, which pools the tokens
    themselves): the attention must run on every token. Returns why, or ``None`` where the op
    is not such a grid: one of more cells than the block has tokens is not of its tokens."""
    images, tokens = ops.shape(residual.skip)[0], ops.shape(residual.skip)[1]
    cells = math.prod(in_shape[2:])
    if in_shape[0] % images or cells > tokens:
        return None
    path = ops.module_path(node) if node.op == "call_module" else node.name
    heads = in_shape[0] // images
    return (
        f"pooling attention at {path}: the {kind} pools queries, keys or values split into "
        f"{heads} head{'s' if heads > 1 else ''} on the {'x'.join(map(str, in_shape[2:]))} "
        "token grid, a grid made per head inside the attention, not laid out from the block's "
        "(B, N, C) tokens"
    )


def _pooling_attention(gm: fx.GraphModule, attn: Residual) -> str | None:
    """Why an attention residual's attention must run on every token because it pools on a grid
    made per head (``_per_head_grid``), or ``None``."""
    for node, kind, in_shape in _grid_nodes(gm, attn):
        if _tokens_before_grid(node.args[0], math.prod(in_shape[2:])) is not None:
            continue
        reason = _per_head_grid(node, kind, in_shape, attn)
        if reason is not None:
            return f"{reason}, so the attention runs on every token"
    return None


def _grid_nodes(gm: fx.GraphModule, residual: Residual) -> list[tuple[fx.Node, str, tuple]]:
    """The residual's ops on a grid of 2 or more dims ((B, C, H, W) or a video's (B, C, T, H,
    W)): each with its kind and its input's shape."""
    found = []
    for node in residual.nodes:
        kind = ops.grid_op_kind(gm, node)
        if kind is None:
            continue
        in_shape = ops.shape(node.args[0])
        if in_shape is not None and len(in_shape) >= 4:
            found.append((node, kind, in_shape))
    return found


def _tokens_before_grid(grid_node: fx.Node, cells: int) -> tuple[fx.Node, fx.Node] | None:
    """Walk back from a (B, C, H, W) tensor through layout ops to the (B, H*W, C) tokens it was
    made from; return them and the node on the path that consumes them.

    Of the 3-D tensors on the way, the earliest with H*W in dim 1 wins, so (B, C, N) tensors
    whose C happens to equal H*W are passed over.
    """
    child, node = grid_node, grid_node
    found: tuple[fx.Node, fx.Node] | None = None
    for _ in range(16):
        shape = ops.shape(node)
        if shape is not None and len(shape) == 3:
            if shape[1] == cells:
                found = (node, child)
            if not ops.is_layout(node):
                return found
        elif found is not None:
            return found
        parents = [p for p in node.all_input_nodes if ops.shape(p) is not None]
        if not parents:
            return found
        child, node = node, parents[0]
    return found


def _flatten_back(op: fx.Node, cells: int, rank: int = 4) -> fx.Node | None:
    """Follow the single-user chain after a grid op through grid-shaped ops (of ``rank`` dims:
    4 for (B, C, H, W)) and layout ops to the (B, H*W, C) tokens it flattens back to: the last
    such tensor before real compute resumes."""
    out_shape = ops.shape(op)
    if out_shape is None or len(out_shape) != rank or math.prod(out_shape[2:]) != cells:
        return None  # a strided conv or a pool changes the resolution: nothing to gather
    node, found = op, None
    for _ in range(16):
        # Reading the grid's size (``b, c, h, w = x.shape``, HF CvT) does not use its data.
        users = [u for u in node.users if u.meta.get("carries_tensor", True)]
        if len(users) != 1:
            break
        node = users[0]
        shape = ops.shape(node)
        if shape is None:
            break
        if not ops.is_layout(node) and len(shape) == 3:
            break
        if len(shape) == 3 and shape[1] == cells:
            found = node
        elif len(shape) != rank and len(shape) != 3:
            break
    return found


def analyse(captured: CapturedGraph) -> ModelMap:
    """Build the model map of a captured graph, or raise :class:`MappingError`."""
    gm = captured.module
    anc = Ancestry(gm.graph)
    cores = find_attention_cores(gm)
    found_cores = list(cores)
    residuals = find_residuals(gm, anc)
    all_residuals = list(residuals)
    core_nodes = {c.node: c for c in cores}
    image_batch = ops.shape(_placeholder(gm))[0]
    windowed_3d = _windowed_batched_attention(gm, image_batch)
    if windowed_3d is not None:
        raise MappingError(windowed_3d)
    # Factorised attention (TimeSformer's): each block one window whose attention part runs
    # whole; its cores are no one's else.
    factorised, factorised_cores = find_factorised_blocks(
        gm, captured.example, cores, residuals, image_batch, anc
    )
    cores = [c for c in cores if c.node not in factorised_cores]
    # Windowed cores, and cores over a whole grid whose residual is the grid itself (Swin's
    # last stage, one window wide): both keep their windows whole.
    in_residuals = {n.name for r in residuals for n in r.nodes}
    windowed_cores = [
        c
        for c in cores
        if is_windowed(c, image_batch) or (c.node not in in_residuals and on_grid(gm, c, anc))
    ]
    # A windowed block that pools its queries (SAM2-Hiera's stage transitions) changes the token
    # count: it is left whole, neither a windowed nor a plain block, and its reason is kept.
    pooled_queries = {
        c.node: (c, reason)
        for c in windowed_cores
        if (reason := pooling_blocker(c, is_windowed(c, image_batch))) is not None
    }
    left_whole = {node: f"{c.path or c.node}: {why}" for node, (c, why) in pooled_queries.items()}
    windowed_cores = [c for c in windowed_cores if c.node not in left_whole]
    cores = [c for c in cores if c.node not in left_whole]
    try:
        windowed = (
            find_windowed_blocks(gm, captured.example, windowed_cores, residuals, image_batch, anc)
            if windowed_cores
            else []
        )
    except WindowError as e:
        raise MappingError(str(e)) from None
    # A core over its whole grid whose tokens pass through the grid's layout on the way in (HF
    # Swin's last stage): one window, where the window analysis confirms it; a core it cannot
    # confirm stays a plain block, as before.
    for core in cores:
        if core in windowed_cores or core.batch != image_batch or not through_grid(gm, core, anc):
            continue
        try:
            one = find_windowed_blocks(gm, captured.example, [core], residuals, image_batch, anc)
        except WindowError:
            continue
        windowed += one
        windowed_cores.append(core)
    windowed += factorised
    # A windowed block's residuals are its own: the plain pairing below leaves them alone.
    taken = {r.add for w in windowed for r in (w.attn, w.mlp)}
    residuals = [r for r in residuals if r.add not in taken]
    cores = [c for c in cores if c not in windowed_cores]
    core_nodes = {c.node: c for c in cores}
    windows_of = {w.attn.add: w for w in windowed}
    by_name = {n.name: n for n in gm.graph.nodes}

    def cores_in(residual: Residual) -> list[AttentionCore]:
        """Attention over the residual's tokens: a softmax over channels (XCiT's C x C
        cross-covariance attention) mixes no tokens and is not a token-attention core."""
        tokens = ops.shape(residual.skip)[1]
        return [
            core_nodes[n.name]
            for n in residual.nodes
            if n.name in core_nodes and core_nodes[n.name].query_tokens in (None, tokens)
        ]

    channel_attention = _channel_attention(gm, cores, residuals)
    # DaViT alternates channel attention with windowed token attention: its channel blocks
    # mix no tokens and are left whole; a model of channel attention only is refused.
    if channel_attention is not None and not windowed:
        raise MappingError(channel_attention)
    attn_residuals = [r for r in residuals if cores_in(r)]
    other_residuals = {r.skip: r for r in residuals if not cores_in(r)}
    blocks: list[Block] = []
    image = _placeholder(gm)
    pairs: list[tuple[Residual, Residual | None, Combination]] = []
    for attn in attn_residuals:
        mlp = other_residuals.get(attn.add)
        inner = cores_in(attn)
        if mlp is None:  # the MLP beside the attention: the block is all of it, up to its end
            attn = _parallel_block(attn, inner, anc, cores_in)
        combination = combine_cores(inner, attn.nodes, by_name, image, anc.is_ancestor, gm)
        pairs.append((attn, mlp, combination))

    for w in windowed:
        pairs.append(
            (
                w.attn,
                w.mlp,
                combine_cores([w.core], w.attn.nodes, by_name, image, anc.is_ancestor, gm),
            )
        )
    pairs.sort(key=lambda pair: anc.index[pair[0].add])
    if not pairs and pooled_queries:
        core, why = next(iter(pooled_queries.values()))
        raise MappingError(f"{attention_at(core, image_batch)}: {why}")
    if not pairs:
        window_axis = find_window_axis_attention(gm, image_batch)
        if window_axis:
            first = window_axis[0]
            raise MappingError(
                f"windowed attention: tokens cannot be dropped without breaking the windows "
                f"({first.path or first.node.name} attends within {first.windows} windows of "
                f"{first.tokens} tokens per image, the windows on an axis of their own: "
                "(images, heads, windows, tokens, tokens) attention)"
            )
        token_cores = {c.node for r in residuals for c in cores_in(r)}
        other = len([c for c in cores if c.node not in token_cores])
        raise MappingError(
            f"no transformer block found: {len(cores)} attention core(s) "
            f"({', '.join(sorted({c.kind for c in cores})) or 'none'}"
            + (f"; {other} not over the block's tokens" if other else "")
            + f"), {len(residuals)} residual "
            f"add(s) on (B, N, C) tokens ({len(attn_residuals)} around attention); a block needs "
            "an attention residual followed by an MLP residual on its output"
            + (
                f"; modules kept whole by the tracer: {', '.join(captured.leaves)}"
                if captured.leaves
                else ""
            )
        )

    stages: list[Stage] = []
    for attn, mlp, combination in pairs:
        core = combination.cores[0]
        last = mlp if mlp is not None else attn
        entry = attn.skip
        window = windows_of.get(attn.add)
        tokens, dim = ops.shape(entry)[1], ops.shape(entry)[-1]
        if window is not None:  # Swin's blocks take the (B, H, W, C) grid
            tokens = math.prod(ops.shape(entry)[1:-1])
        previous = by_name[blocks[-1].output_node] if blocks else None
        new_stage = previous is None or (
            _through_identities(gm, entry) is not previous
            and not (window is not None and through_layout(entry, previous))
        )
        if new_stage:
            if window is not None and len(ops.shape(entry)) == 4:
                prefix, grid = 0, tuple(ops.shape(entry)[1:3])
                patch_node, grid_node = entry, None
            else:
                prefix, grid, patch_node, grid_node = _analyse_entry(entry, image, anc)
            stages.append(
                Stage(
                    index=len(stages),
                    grid=grid,
                    prefix_tokens=prefix,
                    blocks=[],
                    entry_node=entry.name,
                    embed_node=patch_node.name,
                    patch_grid_node=grid_node.name if grid_node is not None else None,
                )
            )
        stage = stages[-1]
        # Pooling attention (MViTv2's) needs every token on the grid it makes per head: the
        # block is mapped as one window over its whole grid whose attention runs whole, so the
        # MLP runs on the kept tokens and the block gives every token back, as a windowed one.
        pooling = _pooling_attention(gm, attn) if window is None else None
        whole_grid = None
        if pooling is not None:
            if mlp is None:
                raise MappingError(f"{pooling}, and its block has no MLP residual after it")
            whole_grid = Windows(
                count=1,
                tokens=tokens,
                order=tuple(range(tokens)),
                mlp_input_node=mlp.skip.name,
                attention_blocker=pooling,
            )
        windows = window.windows if window is not None else whole_grid
        if windows is not None and stage.prefix_tokens:
            # A class token beside the grid (``mvitv2_*_cls``, TimeSformer's) leads the one
            # window over the block's tokens and is kept; windows that cut the grid hold none.
            if windows.count != 1:
                raise MappingError(
                    f"{attention_at(core, image_batch)}: {windows.count} windows beside "
                    f"{stage.prefix_tokens} prefix token(s), which no window holds"
                )
            windows = replace(windows, prefix_tokens=stage.prefix_tokens)
        mlp_nodes = mlp.nodes + [mlp.add] if mlp is not None else []
        paths = [ops.module_path(n) for n in attn.nodes + [attn.add] + mlp_nodes]
        path = ops.common_path([p for p in paths if p])
        index = len(blocks)
        stage.blocks.append(index)
        blocks.append(
            Block(
                index=index,
                path=path,
                tokens=tokens,
                dim=dim,
                heads=core.heads,
                attention=core,
                stage=stage.index,
                grid=stage.grid,
                prefix_tokens=stage.prefix_tokens,
                input_node=entry.name,
                attn_add_node=attn.add.name,
                output_node=last.add.name,
                grid_ops=_grid_ops(gm, attn, mlp, anc, attention_whole=pooling is not None),
                # A parallel block's MLP runs before any reduction, as its attention does: its
                # nodes count as the attention branch.
                position_uses=find_position_uses(
                    gm,
                    image,
                    # A windowed block's attention runs on every token: only its MLP counts.
                    {
                        "attention": attn.nodes + [attn.add]
                        if window is None and pooling is None
                        else [],
                        "mlp": mlp_nodes,
                    },
                    core,
                    tokens,
                    stage.prefix_tokens,
                    anc.is_ancestor,
                ),
                parallel_mlp=mlp is None,
                parallel_cores=combination.cores[1:],
                score_combination=combination.kind,
                score_coefficient=combination.coefficient,
                score_blocker=(window.score_blocker if window is not None else None)
                or combination.blocker,
                windows=windows,
            )
        )
        if windows is not None:
            _check_windowed_block(blocks[-1])
    # Every block's own nodes: what follows a block outside them is its readers' and exits'.
    inside = {n for attn, mlp, _ in pairs for n in _block_nodes(attn, mlp)}
    for stage, following in zip(stages, stages[1:] + [None], strict=True):
        end = by_name[following.entry_node] if following is not None else None
        out = by_name[blocks[stage.blocks[-1]].output_node]
        _find_stage_exit(stage, out, end, anc)
        if stage.exit_grid_node is None and end is not None:
            _find_prefix_join(gm, stage, out, end, image, anc)
        if end is not None:
            stage.exit_bypass = _exit_bypass(out, end, by_name.get(stage.exit_grid_node or ""), anc)
            if stage.exit_bypass is not None and blocks[stage.blocks[-1]].windows is None:
                # The tokens reach the next stage other than through a grid (Hiera's stage ends
                # in a block left whole, which pools them by their order): every op that takes
                # them there reads them whole, in order, restored; that is the stage's exit.
                readers = [user for user in out.users if anc.is_ancestor(user, end) or user is end]
                if readers and all(user not in inside for user in readers):
                    # The sizes read off the tokens on the way are the restored ones too (LeViT's
                    # ``B, N, C = x.shape`` before its downsampling attention views the restored
                    # keys by N).
                    readers += [
                        user
                        for user in out.users
                        if ops.reads_size(user) and user not in readers and user not in inside
                    ]
                    stage.exit_tokens_node = stage.exit_grid_node = None
                    blocks[stage.blocks[-1]].readers.extend(
                        TokenReader(
                            what="the way into the next stage, which reads the tokens in order",
                            path=ops.module_path(user) or user.name,
                            node=user.name,
                            tokens_node=out.name,
                            axis=1,
                            prefix_tokens=stage.prefix_tokens,
                        )
                        for user in readers
                    )
                    stage.exit_bypass = None
    input_shape = ops.shape(image)
    last = by_name[blocks[-1].output_node]
    # Every block's tokens, not only a stage's last's, may reach the output (intermediate
    # features, hidden states) or a head; the blocks after it and the way into the next stage
    # are theirs (exit grid, exit bypass).
    for stage, following in zip(stages, stages[1:] + [None], strict=True):
        end = by_name[following.entry_node] if following is not None else None

        def stop(node: fx.Node, end=end) -> bool:
            return node in inside or (
                end is not None and (node is end or anc.is_ancestor(node, end))
            )

        for index in stage.blocks:
            block = blocks[index]
            if block.windows is not None:  # it gives every token back itself
                continue
            for reader, tokens_node, axis, prefix, what in find_token_readers(
                gm,
                image,
                by_name[block.output_node],
                block.tokens,
                stage.prefix_tokens,
                by_name.get(stage.exit_grid_node or ""),
                anc.is_ancestor,
                stop=stop,
            ):
                block.readers.append(
                    TokenReader(
                        what=what,
                        path=ops.module_path(reader) or reader.name,
                        node=reader.name,
                        tokens_node=tokens_node.name,
                        axis=axis,
                        prefix_tokens=prefix,
                    )
                )
    if windowed:
        find_per_token_branches(
            gm,
            captured.example,
            blocks,
            all_residuals,
            {c.node for c in found_cores} | {c.logits_node for c in found_cores if c.logits_node},
            anc,
        )
    left_whole.update(
        (node, reason)
        for node, reason in _unmapped(gm, found_cores, blocks, all_residuals, image_batch).items()
        if node not in left_whole
    )
    cls_token = stages[-1].prefix_tokens > 0 and _reads_first_token(last, anc)
    return ModelMap(
        capture=captured.method,
        input_size=tuple(input_shape[1:]) if input_shape else (),
        stages=stages,
        blocks=blocks,
        leaves=list(captured.leaves),
        left_whole=[left_whole[n] for n in sorted(left_whole, key=lambda n: anc.index[by_name[n]])],
        cls_token=cls_token,
        final_norm=find_final_norm(gm, last),
    )


def _channel_attention(
    gm: fx.GraphModule, cores: list[AttentionCore], residuals: list[Residual]
) -> str | None:
    """The refusal for attention over channels (XCiT's cross-covariance attention): a core whose
    query and key vectors run along the token axis of the residual it lies in, so that its
    softmax weighs channels against channels (C/h x C/h per head) and no token attends to
    another. There is no token attention to score nor a token axis for it to reduce."""
    by_name = {n.name: n for n in gm.graph.nodes}
    for core in cores:
        reason = _over_channels(core, by_name, residuals)
        if reason is not None:
            return f"cross-covariance attention over channels at {core.path or core.node}: {reason}"
    return None


def _over_channels(
    core: AttentionCore, by_name: dict[str, fx.Node], residuals: list[Residual]
) -> str | None:
    """Why ``core`` attends over channels, not tokens, or ``None``."""
    node = by_name[core.node]
    if core.kind == "sdpa":
        query = node.args[0]
    elif core.kind == "matmul_softmax" and core.logits_node is not None:
        query = by_name[core.logits_node].args[0]
    else:
        return None
    q_shape = ops.shape(query) if isinstance(query, fx.Node) else None
    if q_shape is None or len(q_shape) < 3:
        return None
    for residual in residuals:
        tokens = ops.shape(residual.skip)[1]
        if node not in residual.nodes or core.query_tokens == tokens:
            continue
        # The product contracts the tokens: (.., C/h, N) @ (.., N, C/h).
        if q_shape[-1] == tokens and q_shape[-2] == core.query_tokens:
            return (
                f"its softmax weighs {core.query_tokens} x {core.key_tokens} channels per "
                f"head over all {tokens} tokens, so there is no token attention to score "
                "or reduce"
            )
    return None


def _unmapped(
    gm: fx.GraphModule,
    found: list[AttentionCore],
    blocks: list[Block],
    residuals: list[Residual],
    image_batch: int,
) -> dict[str, str]:
    """Every attention core no block maps, with why: each runs whole, and the model map says so
    (``left_whole``, printed by ``vitcompress inspect``) rather than leaving it out silently."""
    mapped = {b.attention.node for b in blocks} | {c.node for b in blocks for c in b.parallel_cores}
    by_name = {n.name: n for n in gm.graph.nodes}
    on_axis = {w.node.name: w for w in find_window_axis_attention(gm, image_batch)}
    reasons: dict[str, str] = {}
    for core in found:
        if core.node in mapped:
            continue
        reason = pooling_blocker(core, is_windowed(core, image_batch)) or _over_channels(
            core, by_name, residuals
        )
        if reason is None and core.node in on_axis:
            axis = on_axis[core.node]
            reason = (
                f"it attends within {axis.windows} windows of {axis.tokens} tokens per image "
                "laid out on an axis of their own, which no block is mapped from"
            )
        if reason is None:
            reason = _queries_fewer_than_tokens(gm, core, by_name, image_batch)
        if reason is None:
            reason = (
                "no block is mapped around it (no attention residual followed by an MLP "
                "residual on its tokens)"
            )
        reasons[core.node] = f"{core.path or core.node}: {reason}"
    for name, axis in on_axis.items():  # 5-D attention no core was found for
        if name in mapped or name in reasons:
            continue
        keys = ops.shape(axis.node.args[1]) if ops.is_sdpa(axis.node) else None
        if keys is not None and len(keys) == 5 and keys[3] != axis.tokens:  # Hiera's
            reason = (
                f"its queries are pooled ({axis.tokens} queries against {keys[3]} keys per "
                "window), so the block changes the token count and its windows cannot be "
                "reduced alike"
            )
        else:
            reason = (
                f"it attends within {axis.windows} windows of {axis.tokens} tokens per image "
                "laid out on an axis of their own, which no block is mapped from"
            )
        reasons[name] = f"{axis.path or name}: {reason}"
    return reasons


def _queries_fewer_than_tokens(
    gm: fx.GraphModule, core: AttentionCore, by_name: dict[str, fx.Node], image_batch: int
) -> str | None:
    """Why an attention over the whole grid that pools its queries and keys alike (MViTv2's
    stage-1 transition: 3136 tokens in, 784 queries against 784 keys) is left whole: it gives
    out fewer tokens than it takes; ``None`` where it does not."""
    taken = window_tokens(gm, by_name[core.node])
    shape = ops.shape(taken) if taken is not None else None
    if (
        shape is None
        or len(shape) != 3
        or shape[0] != image_batch
        or core.batch != image_batch
        or core.query_tokens is None
        or core.query_tokens >= shape[1]
    ):
        return None
    return (
        f"its queries are pooled ({shape[1]} tokens in, {core.query_tokens} queries), so the "
        "block changes the token count and no reduction keeps it"
    )


def _check_windowed_block(block: Block) -> None:
    """A windowed block runs its MLP on the kept tokens of every window: a conv or a position
    table there would need the grid, which it does not have."""
    mlp_ops = [op for op in block.grid_ops if op.branch == "mlp"]
    mlp_tables = [use for use in block.position_uses if use.branch == "mlp"]
    if mlp_ops or mlp_tables:
        what = f"the {mlp_ops[0].kind} {mlp_ops[0].path}" if mlp_ops else mlp_tables[0].table
        raise MappingError(
            f"windowed block {block.index} ({block.path}) reads the token grid in its MLP "
            f"({what}); reducing within its windows is not supported there"
        )


def _block_nodes(attn: Residual, mlp: Residual | None) -> list[fx.Node]:
    """The nodes of a block: its attention residual and its MLP residual, with their adds."""
    return attn.nodes + [attn.add] + (mlp.nodes + [mlp.add] if mlp is not None else [])


def _parallel_block(attn: Residual, cores: list[AttentionCore], anc: Ancestry, cores_in):
    """The whole of a block whose attention residual no MLP residual follows (attention and MLP
    side by side, ``x + attn(h) + mlp(h)``), as one residual from its input to where its branches
    rejoin; tokens are reduced there. Refused where they never rejoin, or where more attention
    than the block's own lies on the way."""
    end = block_end(attn.skip, attn.add, anc.nodes, anc.index, anc.is_ancestor)
    whole = None
    if end is not None:
        whole = Residual(end, attn.skip, attn.branch, anc.between(attn.skip, end))
    if whole is None or [c.node for c in cores_in(whole)] != [c.node for c in cores]:
        path = ops.common_path([c.path for c in cores if c.path])
        raise MappingError(
            f"parallel block at {path or attn.add.name} (residual add {attn.add.name}): its "
            "attention is not followed by an MLP residual on its output, and its branches do "
            "not rejoin into one token stream before other attention; token reduction needs a "
            "block boundary after the attention, so such blocks are not supported"
        )
    return whole


def _through_identities(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """The node whose value ``node`` passes on unchanged: an ``nn.Identity`` or dropout module
    between two blocks (HuggingFace CvT's drop path at rate 0) still chains them in one stage."""
    while node.op == "call_module" and node.args and isinstance(node.args[0], fx.Node):
        if not isinstance(gm.get_submodule(str(node.target)), (nn.Identity, nn.Dropout)):
            break
        node = node.args[0]
    return node


def _windowed_batched_attention(gm: fx.GraphModule, image_batch: int) -> str | None:
    """The windowed refusal for attention written on 3-D (batch x heads, N, D) tensors (SAM):
    such a core is not a token-attention core, but where the tokens entering its projection are
    batched as images x windows, the model attends within windows all the same."""
    for node in gm.graph.nodes:
        if ops.is_sdpa(node):
            query = node.args[0]
        elif ops.is_softmax(node, gm):
            query = ops.walk_back(node.args[0], lambda n: ops.is_matmul(n) or ops.is_einsum(n), 8)
        else:
            continue
        shape = ops.shape(query) if query is not None else None
        if shape is None or len(shape) != 3:
            continue
        projection = ops.projection_of(gm, query)
        tokens = ops.shape(projection.args[0]) if projection is not None else None
        if tokens is None or len(tokens) < 3:
            continue
        if tokens[0] > image_batch and tokens[0] % image_batch == 0:
            per_window = math.prod(tokens[1:-1])
            return (
                f"windowed attention: tokens cannot be dropped without breaking the windows "
                f"({ops.module_path(node)} attends within {tokens[0] // image_batch} windows "
                f"of {per_window} tokens per image)"
            )
    return None


def _exit_bypass(
    out: fx.Node, end: fx.Node, exit_grid: fx.Node | None, anc: Ancestry
) -> str | None:
    """Where a stage's output tokens reach the next stage other than through its exit grid
    (which gets the full grid back when tokens were reduced): the module path of the first op
    on such a path, else ``None``. Hiera pools its unrolled tokens by a view over their order
    there; reduced tokens would make that pooling wrong, or crash it."""
    reached: set[fx.Node] = set()
    frontier = [out]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user is exit_grid or user in reached or not user.meta.get("carries_tensor", True):
                continue
            reached.add(user)
            if user is not end:
                frontier.append(user)
    if end not in reached:
        return None
    to_exit = [n for n in reached if exit_grid is not None and anc.is_ancestor(n, exit_grid)]
    bypass = sorted(
        (n for n in reached if n not in to_exit and anc.is_ancestor(n, end)),
        key=anc.index.__getitem__,
    )
    first = bypass[0] if bypass else end
    return ops.module_path(first) or first.name


def _find_stage_exit(stage: Stage, out: fx.Node, end: fx.Node | None, anc: Ancestry) -> None:
    """The first place after a stage where its output tokens become a (B, C, H, W) grid (of
    the stage's grid rank: (B, C, T, H, W) for a video's)."""
    cells = math.prod(stage.grid)
    rank = len(stage.grid)
    stop = anc.index[end] if end is not None else len(anc.nodes)
    for node in anc.nodes[anc.index[out] + 1 : stop]:
        shape = ops.shape(node)
        if shape is None or len(shape) != rank + 2 or not anc.is_ancestor(out, node):
            continue
        if _grid_from(node, cells, rank, views=True) is not None:
            found = _tokens_before_grid(node, cells)
            if found is not None and (found[0] is out or anc.is_ancestor(out, found[0])):
                stage.exit_tokens_node, stage.exit_grid_node = found[0].name, found[1].name
        return


def _find_prefix_join(
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
    if _through_identities(gm, from_image[0]) is not out:
        return
    stage.exit_tokens_node, stage.exit_grid_node = from_image[0].name, end.name


def _reads_first_token(stream: fx.Node, anc: Ancestry) -> bool:
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
