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

``analyse`` runs named phases in order (``PHASES``) over one record of what is found so far
(``_Analysis``); each phase reads what the ones before it found and adds its own, or refuses.
Stages and grids are ``stages.py``'s, grid ops ``grid_ops.py``'s, refusals and what is left
whole ``refusals.py``'s, windowed blocks ``windows.py``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch.fx as fx

from vitcompress.analysis import ops
from vitcompress.analysis.capture import CapturedGraph
from vitcompress.analysis.cores import (
    Ancestry,
    GraphFacts,
    Residual,
    find_attention_cores,
    find_residuals,
    find_window_axis_attention,
)
from vitcompress.analysis.factorised import find_factorised_blocks
from vitcompress.analysis.final_norm import find_final_norm
from vitcompress.analysis.grid_ops import find_grid_ops, pooling_attention
from vitcompress.analysis.model_map import (
    AttentionCore,
    Block,
    ModelMap,
    Stage,
    TokenReader,
)
from vitcompress.analysis.parallel import Combination, block_end, combine_cores
from vitcompress.analysis.per_token import find_per_token_branches
from vitcompress.analysis.positions import find_position_uses
from vitcompress.analysis.refusals import (
    MappingError,
    attention_maps_out,
    channel_attention,
    check_windowed_block,
    placeholder,
    unmapped,
    windowed_batched_attention,
)
from vitcompress.analysis.stages import (
    analyse_entry,
    exit_bypass,
    find_prefix_join,
    find_stage_exit,
    reads_first_token,
    through_identities,
)
from vitcompress.analysis.token_readers import find_token_readers
from vitcompress.analysis.window_map import WholeAttention, Windows
from vitcompress.analysis.windows import (
    WindowedBlock,
    WindowError,
    attention_at,
    find_windowed_blocks,
    is_windowed,
    on_grid,
    pooling_blocker,
    through_grid,
    through_layout,
)

__all__ = ["PHASES", "MappingError", "analyse"]

# A block as paired: its attention residual, its MLP residual (``None`` for a parallel block)
# and how its cores' scores combine.
Pair = tuple[Residual, Residual | None, Combination]


@dataclass
class _Analysis:
    """What the phases have found so far: one record, written phase by phase."""

    captured: CapturedGraph
    gm: fx.GraphModule
    anc: Ancestry
    image: fx.Node
    image_batch: int
    found_cores: list[AttentionCore]  # every attention core in the graph
    all_residuals: list[Residual]  # every residual add on (B, N, C) tokens
    cores: list[AttentionCore]  # the cores still to be paired into plain blocks
    residuals: list[Residual]  # the residuals still to be paired into plain blocks
    factorised: list[WindowedBlock] = field(default_factory=list)
    windowed: list[WindowedBlock] = field(default_factory=list)
    windowed_cores: list[AttentionCore] = field(default_factory=list)
    # Windowed cores that pool their queries, each with why it is left whole.
    pooled_queries: dict[str, tuple[AttentionCore, str]] = field(default_factory=dict)
    left_whole: dict[str, str] = field(default_factory=dict)  # core node -> "path: why"
    attn_residuals: list[Residual] = field(default_factory=list)
    pairs: list[Pair] = field(default_factory=list)
    inside: set[fx.Node] = field(default_factory=set)  # every block's own nodes
    stages: list[Stage] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)

    @classmethod
    def of(cls, captured: CapturedGraph) -> _Analysis:
        gm = captured.module
        anc = Ancestry(gm.graph)
        cores = find_attention_cores(gm)
        residuals = find_residuals(gm, anc)
        image = placeholder(gm)
        return cls(
            captured=captured,
            gm=gm,
            anc=anc,
            image=image,
            image_batch=ops.shape(image)[0],
            found_cores=list(cores),
            all_residuals=list(residuals),
            cores=cores,
            residuals=residuals,
        )

    @property
    def by_name(self) -> dict[str, fx.Node]:
        return self.anc.by_name

    @property
    def facts(self) -> GraphFacts:
        return GraphFacts(self.gm, self.captured.example, self.image_batch, self.anc)

    def cores_in(self, residual: Residual) -> list[AttentionCore]:
        """Attention over the residual's tokens: a softmax over channels (XCiT's C x C
        cross-covariance attention) mixes no tokens and is not a token-attention core."""
        core_nodes = {c.node: c for c in self.cores}
        tokens = ops.shape(residual.skip)[1]
        return [
            core_nodes[n.name]
            for n in residual.nodes
            if n.name in core_nodes and core_nodes[n.name].query_tokens in (None, tokens)
        ]


def _refuse_batched_windows(s: _Analysis) -> None:
    """Attention on 3-D (images x windows x heads, N, D) tensors (SAM's) is refused first."""
    reason = windowed_batched_attention(s.gm, s.image_batch)
    if reason is not None:
        raise MappingError(reason)


def _take_factorised_blocks(s: _Analysis) -> None:
    """Factorised attention (TimeSformer's): each block one window whose attention part runs
    whole; its cores are no one's else."""
    s.factorised, factorised_cores = find_factorised_blocks(s.facts, s.cores, s.residuals)
    s.cores = [c for c in s.cores if c.node not in factorised_cores]


def _leave_pooled_queries_whole(s: _Analysis) -> None:
    """Windowed cores, and cores over a whole grid whose residual is the grid itself (Swin's
    last stage, one window wide): both keep their windows whole. A windowed block that pools its
    queries (SAM2-Hiera's stage transitions) changes the token count: it is left whole, neither
    a windowed nor a plain block, and its reason is kept."""
    in_residuals = {n.name for r in s.residuals for n in r.nodes}
    windowed_cores = [
        c
        for c in s.cores
        if is_windowed(c, s.image_batch) or (c.node not in in_residuals and on_grid(s.gm, c, s.anc))
    ]
    s.pooled_queries = {
        c.node: (c, reason)
        for c in windowed_cores
        if (reason := pooling_blocker(c, is_windowed(c, s.image_batch))) is not None
    }
    s.left_whole = {
        node: f"{c.path or c.node}: {why}" for node, (c, why) in s.pooled_queries.items()
    }
    s.windowed_cores = [c for c in windowed_cores if c.node not in s.left_whole]
    s.cores = [c for c in s.cores if c.node not in s.left_whole]


def _find_windowed(s: _Analysis) -> None:
    """The windowed blocks around the windowed cores (``windows.py``); then a core over its
    whole grid whose tokens pass through the grid's layout on the way in (HF Swin's last stage):
    one window, where the window analysis confirms it; a core it cannot confirm stays a plain
    block, as before."""
    try:
        if s.windowed_cores:
            s.windowed = find_windowed_blocks(s.facts, s.windowed_cores, s.residuals)
    except WindowError as e:
        raise MappingError(str(e)) from None
    for core in s.cores:
        if (
            core in s.windowed_cores
            or core.batch != s.image_batch
            or not through_grid(s.gm, core, s.anc)
        ):
            continue
        try:
            one = find_windowed_blocks(s.facts, [core], s.residuals)
        except WindowError:
            continue
        s.windowed += one
        s.windowed_cores.append(core)
    s.windowed += s.factorised
    # A windowed block's residuals are its own: the plain pairing leaves them alone.
    taken = {r.add for w in s.windowed for r in (w.attn, w.mlp)}
    s.residuals = [r for r in s.residuals if r.add not in taken]
    s.cores = [c for c in s.cores if c not in s.windowed_cores]


def _pair_blocks(s: _Analysis) -> None:
    """Each attention residual with the MLP residual on its output (or, where none follows, the
    parallel block up to where its branches rejoin), and each windowed block, in graph order.
    DaViT alternates channel attention with windowed token attention: its channel blocks mix no
    tokens and are left whole; a model of channel attention only is refused."""
    channel = channel_attention(s.by_name, s.cores, s.residuals)
    if channel is not None and not s.windowed:
        raise MappingError(channel)
    s.attn_residuals = [r for r in s.residuals if s.cores_in(r)]
    other_residuals = {r.skip: r for r in s.residuals if not s.cores_in(r)}
    for attn in s.attn_residuals:
        mlp = other_residuals.get(attn.add)
        inner = s.cores_in(attn)
        if mlp is None:  # the MLP beside the attention: the block is all of it, up to its end
            attn = _parallel_block(attn, inner, s.anc, s.cores_in)
        s.pairs.append((attn, mlp, _combine(s, inner, attn)))
    for w in s.windowed:
        s.pairs.append((w.attn, w.mlp, _combine(s, [w.core], w.attn)))
    s.pairs.sort(key=lambda pair: s.anc.index[pair[0].add])
    s.inside = {n for attn, mlp, _ in s.pairs for n in _block_nodes(attn, mlp)}


def _combine(s: _Analysis, cores: list[AttentionCore], attn: Residual) -> Combination:
    return combine_cores(cores, attn.nodes, s.by_name, s.image, s.anc.is_ancestor, s.gm)


def _refuse_without_blocks(s: _Analysis) -> None:
    """No block paired: the refusal says what was found instead, most specific first."""
    if s.pairs:
        return
    if s.pooled_queries:
        core, why = next(iter(s.pooled_queries.values()))
        raise MappingError(f"{attention_at(core, s.image_batch)}: {why}")
    window_axis = find_window_axis_attention(s.gm, s.image_batch)
    if window_axis:
        first = window_axis[0]
        raise MappingError(
            f"windowed attention: tokens cannot be dropped without breaking the windows "
            f"({first.path or first.node.name} attends within {first.windows} windows of "
            f"{first.tokens} tokens per image, the windows on an axis of their own: "
            "(images, heads, windows, tokens, tokens) attention)"
        )
    token_cores = {c.node for r in s.residuals for c in s.cores_in(r)}
    other = len([c for c in s.cores if c.node not in token_cores])
    leaves = s.captured.leaves
    raise MappingError(
        f"no transformer block found: {len(s.cores)} attention core(s) "
        f"({', '.join(sorted({c.kind for c in s.cores})) or 'none'}"
        + (f"; {other} not over the block's tokens" if other else "")
        + f"), {len(s.residuals)} residual "
        f"add(s) on (B, N, C) tokens ({len(s.attn_residuals)} around attention); a block needs "
        "an attention residual followed by an MLP residual on its output"
        + (f"; modules kept whole by the tracer: {', '.join(leaves)}" if leaves else "")
    )


def _refuse_attention_maps_out(s: _Analysis) -> None:
    """A mapped block's attention probabilities that reach the output are refused."""
    reason = attention_maps_out(s.gm, s.by_name, s.blocks)
    if reason is not None:
        raise MappingError(reason)


def _build_blocks(s: _Analysis) -> None:
    """A block for every pair, in graph order, each in its stage (a new one where the block's
    input is not the previous block's output)."""
    windows_of = {w.attn.add: w for w in s.windowed}
    for attn, mlp, combination in s.pairs:
        window = windows_of.get(attn.add)
        stage = _stage_of(s, attn.skip, window)
        s.blocks.append(_block(s, stage, attn, mlp, combination, window))
        stage.blocks.append(s.blocks[-1].index)
        if s.blocks[-1].windows is not None:
            check_windowed_block(s.blocks[-1])


def _stage_of(s: _Analysis, entry: fx.Node, window: WindowedBlock | None) -> Stage:
    """The stage a block entered at ``entry`` belongs to: the last one, or a new one where the
    block does not take the previous block's output (through identities or, for a windowed
    block, through the grid's layout)."""
    previous = s.by_name[s.blocks[-1].output_node] if s.blocks else None
    new_stage = previous is None or (
        through_identities(s.gm, entry) is not previous
        and not (window is not None and through_layout(entry, previous))
    )
    if not new_stage:
        return s.stages[-1]
    if window is not None and len(ops.shape(entry)) == 4:  # Swin's blocks take (B, H, W, C)
        prefix, grid = 0, tuple(ops.shape(entry)[1:3])
        patch_node, grid_node = entry, None
    else:
        prefix, grid, patch_node, grid_node = analyse_entry(entry, s.image, s.anc)
    s.stages.append(
        Stage(
            index=len(s.stages),
            grid=grid,
            prefix_tokens=prefix,
            blocks=[],
            entry_node=entry.name,
            embed_node=patch_node.name,
            patch_grid_node=grid_node.name if grid_node is not None else None,
        )
    )
    return s.stages[-1]


def _block_windows(
    s: _Analysis,
    stage: Stage,
    core: AttentionCore,
    attn: Residual,
    mlp: Residual | None,
    window: WindowedBlock | None,
    tokens: int,
) -> tuple[Windows | None, str | None]:
    """The block's windows and, for pooling attention, why its attention runs whole.

    Pooling attention (MViTv2's) needs every token on the grid it makes per head: the block is
    mapped as one window over its whole grid whose attention runs whole, so the MLP runs on the
    kept tokens and the block gives every token back, as a windowed one."""
    pooling = pooling_attention(s.gm, attn) if window is None else None
    windows = window.windows if window is not None else None
    if pooling is not None:
        if mlp is None:
            raise MappingError(f"{pooling}, and its block has no MLP residual after it")
        windows = Windows(
            count=1,
            tokens=tokens,
            order=tuple(range(tokens)),
            mlp_input_node=mlp.skip.name,
            attention=WholeAttention(pooling),
        )
    if windows is not None and stage.prefix_tokens:
        # A class token beside the grid (``mvitv2_*_cls``, TimeSformer's) leads the one window
        # over the block's tokens and is kept; windows that cut the grid hold none.
        if windows.count != 1:
            raise MappingError(
                f"{attention_at(core, s.image_batch)}: {windows.count} windows beside "
                f"{stage.prefix_tokens} prefix token(s), which no window holds"
            )
        windows = replace(windows, prefix_tokens=stage.prefix_tokens)
    return windows, pooling


def _block(
    s: _Analysis,
    stage: Stage,
    attn: Residual,
    mlp: Residual | None,
    combination: Combination,
    window: WindowedBlock | None,
) -> Block:
    """The block of one pair: its tokens, windows, grid ops and position uses."""
    core = combination.cores[0]
    entry = attn.skip
    tokens, dim = ops.shape(entry)[1], ops.shape(entry)[-1]
    if window is not None:  # Swin's blocks take the (B, H, W, C) grid
        tokens = math.prod(ops.shape(entry)[1:-1])
    windows, pooling = _block_windows(s, stage, core, attn, mlp, window, tokens)
    mlp_nodes = mlp.nodes + [mlp.add] if mlp is not None else []
    paths = [ops.module_path(n) for n in attn.nodes + [attn.add] + mlp_nodes]
    runs_whole = window is not None or pooling is not None
    return Block(
        index=len(s.blocks),
        path=ops.common_path([p for p in paths if p]),
        tokens=tokens,
        dim=dim,
        heads=core.heads,
        attention=core,
        stage=stage.index,
        grid=stage.grid,
        prefix_tokens=stage.prefix_tokens,
        input_node=entry.name,
        attn_add_node=attn.add.name,
        output_node=(mlp if mlp is not None else attn).add.name,
        grid_ops=find_grid_ops(s.gm, attn, mlp, s.anc, attention_whole=pooling is not None),
        # A parallel block's MLP runs before any reduction, as its attention does: its nodes
        # count as the attention branch. A windowed block's attention runs on every token: only
        # its MLP counts.
        position_uses=find_position_uses(
            s.gm,
            s.image,
            {"attention": [] if runs_whole else attn.nodes + [attn.add], "mlp": mlp_nodes},
            core,
            tokens,
            stage.prefix_tokens,
            s.anc.is_ancestor,
        ),
        parallel_mlp=mlp is None,
        parallel_cores=combination.cores[1:],
        score_combination=combination.kind,
        score_coefficient=combination.coefficient,
        score_blocker=(window.score_blocker if window is not None else None) or combination.blocker,
        windows=windows,
    )


def _following(s: _Analysis) -> list[tuple[Stage, fx.Node | None]]:
    """Each stage with the entry of the stage after it (``None`` for the last)."""
    ends = [s.by_name[stage.entry_node] for stage in s.stages[1:]] + [None]
    return list(zip(s.stages, ends, strict=True))


def _find_stage_exits(s: _Analysis) -> None:
    """Where each stage's tokens leave it: an exit grid, a join of prefix tokens, or (where the
    tokens reach the next stage some other way) the ops that read them in order."""
    for stage, end in _following(s):
        out = s.by_name[s.blocks[stage.blocks[-1]].output_node]
        find_stage_exit(stage, out, end, s.anc)
        if stage.exit_grid_node is None and end is not None:
            find_prefix_join(s.gm, stage, out, end, s.image, s.anc)
        if end is None:
            continue
        exit_grid = s.by_name.get(stage.exit_grid_node or "")
        stage.exit_bypass = exit_bypass(out, end, exit_grid, s.anc)
        if stage.exit_bypass is not None and s.blocks[stage.blocks[-1]].windows is None:
            _exit_in_order(s, stage, out, end)


def _exit_in_order(s: _Analysis, stage: Stage, out: fx.Node, end: fx.Node) -> None:
    """The tokens reach the next stage other than through a grid (Hiera's stage ends in a block
    left whole, which pools them by their order): every op that takes them there reads them
    whole, in order, restored; that is the stage's exit."""
    readers = [user for user in out.users if s.anc.is_ancestor(user, end) or user is end]
    if not readers or any(user in s.inside for user in readers):
        return
    # The sizes read off the tokens on the way are the restored ones too (LeViT's
    # ``B, N, C = x.shape`` before its downsampling attention views the restored keys by N).
    readers += [
        user
        for user in out.users
        if ops.reads_size(user) and user not in readers and user not in s.inside
    ]
    stage.exit_tokens_node = stage.exit_grid_node = None
    s.blocks[stage.blocks[-1]].readers.extend(
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


def _find_readers(s: _Analysis) -> None:
    """Every block's tokens, not only a stage's last's, may reach the output (intermediate
    features, hidden states) or a head; the blocks after it and the way into the next stage
    are theirs (exit grid, exit bypass). A windowed block gives every token back itself."""
    for stage, end in _following(s):

        def stop(node: fx.Node, end: fx.Node | None = end) -> bool:
            return node in s.inside or (
                end is not None and (node is end or s.anc.is_ancestor(node, end))
            )

        for index in stage.blocks:
            block = s.blocks[index]
            if block.windows is not None:
                continue
            for reader, tokens_node, axis, prefix, what in find_token_readers(
                s.gm,
                s.image,
                s.by_name[block.output_node],
                block.tokens,
                stage.prefix_tokens,
                s.by_name.get(stage.exit_grid_node or ""),
                s.anc.is_ancestor,
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


def _find_per_token_branches(s: _Analysis) -> None:
    """Per-token branches after windowed blocks (``per_token.py``)."""
    if not s.windowed:
        return
    core_nodes = {c.node for c in s.found_cores}
    logits = {c.logits_node for c in s.found_cores if c.logits_node}
    find_per_token_branches(
        s.gm, s.captured.example, s.blocks, s.all_residuals, core_nodes | logits, s.anc
    )


def _collect_left_whole(s: _Analysis) -> None:
    """Every core no block maps, with why it runs whole (``refusals.unmapped``)."""
    reasons = unmapped(s.gm, s.found_cores, s.blocks, s.all_residuals, s.image_batch, s.by_name)
    s.left_whole.update(
        (node, reason) for node, reason in reasons.items() if node not in s.left_whole
    )


# The phases, in order: each reads what the ones before it found.
PHASES: tuple[Callable[[_Analysis], None], ...] = (
    _refuse_batched_windows,
    _take_factorised_blocks,
    _leave_pooled_queries_whole,
    _find_windowed,
    _pair_blocks,
    _refuse_without_blocks,
    _build_blocks,
    _refuse_attention_maps_out,
    _find_stage_exits,
    _find_readers,
    _find_per_token_branches,
    _collect_left_whole,
)


def analyse(captured: CapturedGraph) -> ModelMap:
    """Build the model map of a captured graph, or raise :class:`MappingError`."""
    s = _Analysis.of(captured)
    for phase in PHASES:
        phase(s)
    return _model_map(s)


def _model_map(s: _Analysis) -> ModelMap:
    input_shape = ops.shape(s.image)
    last = s.by_name[s.blocks[-1].output_node]
    left_whole = sorted(s.left_whole, key=lambda n: s.anc.index[s.by_name[n]])
    return ModelMap(
        capture=s.captured.method,
        input_size=tuple(input_shape[1:]) if input_shape else (),
        stages=s.stages,
        blocks=s.blocks,
        leaves=list(s.captured.leaves),
        left_whole=[s.left_whole[n] for n in left_whole],
        cls_token=s.stages[-1].prefix_tokens > 0 and reads_first_token(last, s.anc),
        final_norm=find_final_norm(s.gm, last),
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
