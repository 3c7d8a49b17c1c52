"""The model map: what graph analysis found in a ViT, as plain data.

Everything here is derived from a captured graph (see ``analyse.py``); nothing is looked up by class
or attribute name. Node names refer to nodes of the captured ``torch.fx.GraphModule`` so that the
rewriter can find the places again without re-running the analysis.

``to_json`` writes what the map says about the model, without the node names (they mean nothing
outside the captured graph); ``ModelMap.from_json`` reads that back, and the map read back equals
the map written: node-name fields are left out of equality (``field(compare=False)``) and hold
``GRAPH_NODE_ABSENT`` in a map read back, which cannot rewrite a graph (``ModelMap.has_nodes``).
A windowed block's record (``Windows``, what its attention reads by window slot) is in
``window_map.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# A windowed block's record is part of the map, kept in its own module.
from vitcompress.analysis.records import GRAPH_NODE_ABSENT, JsonRecord
from vitcompress.analysis.window_map import Windows

# How a block's attentions' token scores combine (``Block.score_combination``; ``None``: one core).
MEAN = "mean"  # parallel attentions: their scores averaged
DIFFERENCE = (
    "difference"  # differential attention: the first's minus a coefficient times the second's
)

ATTENTION_KINDS = ("sdpa", "matmul_softmax", "einsum_softmax", "multihead_attention")


# (kernel, stride, padding), each per grid dim: the op that pools an attention's keys.
KeyPool = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass
class GridOp(JsonRecord):
    """An op inside a block that needs the full token grid (conv or pool on reshaped tokens)."""

    path: str  # module path of the conv/pool, or the node name for a functional op
    kind: str  # "conv" or "pool"
    branch: str  # "attention" or "mlp"
    grid: tuple[int, ...]  # (H, W) the tokens are reshaped to; a video's (T, H, W)
    # The node that turns (B, N, C) tokens into (B, C, H, W).
    to_grid_node: str = field(compare=False)
    tokens_node: str = field(compare=False)  # the 3-D token tensor that feeds ``to_grid_node``
    op_node: str = field(compare=False)  # the conv/pool node itself
    # A flatten back to tokens at the same resolution, if any.
    from_grid_node: str | None = field(default=None, compare=False)


@dataclass
class PositionUse(JsonRecord):
    """A tensor laid out by token position that meets the tokens inside a block (see
    ``positions.py``): after a token reduction it must follow the kept tokens."""

    table: str  # the parameter/buffer it is built from, or "a constant (N, D) tensor"
    kind: str  # "attention bias", "query/key table" or "token table"
    branch: str  # "attention" or "mlp"
    path: str  # module path of the op where it meets the tokens
    node: str = field(compare=False)  # that op
    table_node: str = field(compare=False)  # the position tensor as the op reads it
    shape: tuple[int, ...]
    # Why the table cannot be gathered by the kept tokens (``None``: it can, see positions.py).
    blocker: str | None = None
    # The value a token without a grid position (EViT's fused token) takes on the table's rows:
    # what leaves the op unchanged (0 added, 1 multiplied); ``None`` when no such value is known.
    neutral: float | None = None

    def gather_layout(
        self, rank: int, tokens: int, prefix_tokens: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
        """Where the table is gathered when read against a rank-``rank`` tensor of ``tokens``
        tokens (``prefix_tokens`` of them first): see :func:`gather_layout`."""
        return gather_layout(self.shape, rank, self.kind, tokens, prefix_tokens)


@dataclass
class TokenReader(JsonRecord):
    """Where something after a block reads the block's output tokens by their position (the
    model's output, a reshape to the patch grid, a head reading one patch token): a reduced model
    restores the full token set, in the base's order, for it (``modules/restore.py``)."""

    what: str  # what reads them, in words
    path: str  # module path of the reader, or its node's name
    node: str = field(compare=False)  # the reader
    tokens_node: str = field(compare=False)  # the tensor it reads
    axis: int  # the token axis in that tensor
    prefix_tokens: int  # prefix tokens in that tensor (0 after ``x[:, 1:]``)


@dataclass
class AttentionCore(JsonRecord):
    """An attention of a block: the block's own (said in the block's JSON under the block's
    names: ``attention``, ``attention_path``, ...) or a further one (``Block.parallel_cores``)."""

    kind: str  # one of ATTENTION_KINDS
    node: str = field(compare=False)  # sdpa / softmax / MultiheadAttention node
    heads: int
    path: str  # module path of the attention (e.g. ``blocks.3.attn``)
    # For "matmul_softmax"/"einsum_softmax": the query-key product node that feeds the softmax.
    logits_node: str | None = field(default=None, compare=False)
    query_tokens: int | None = None
    key_tokens: int | None = None
    batch: int | None = None  # leading dim of q / logits: the image batch times any windows
    # Keys pooled on the token grid (PVT's, MViTv2's): the pooling op's kernel, stride and
    # padding per grid dim, which say which tokens each key reads (``key_scores_to_tokens``).
    key_pool: KeyPool | None = None


@dataclass
class PerTokenBranch:
    """A residual branch after a windowed block, before the next mapped block, that works on
    each of its tokens alone, in the block's order (DaViT's channel blocks' MLPs;
    ``per_token.py``): the block's choice, made there or carried to it, reduces it too (a
    method's ``carry_branches`` setting, on by default)."""

    path: str
    input_node: str = field(compare=False)  # the (B, L, C) tokens entering the residual
    output_node: str = field(compare=False)  # the residual add

    def to_json(self) -> str:
        return self.path


@dataclass
class Block:
    index: int
    path: str
    tokens: int  # tokens (prefix included) the block sees in the base model
    dim: int
    heads: int
    attention: AttentionCore
    stage: int
    grid: tuple[int, ...]  # patch grid of the block's stage: (H, W), a video's (T, H, W)
    prefix_tokens: int
    input_node: str = field(compare=False)  # residual stream value entering the block
    # Where an attention variant reduces: the residual add closing the attention branch, or the
    # block's output where its MLP runs beside the attention (``parallel_mlp``).
    attn_add_node: str = field(compare=False)
    # The residual add closing the MLP branch (the block's last node).
    output_node: str = field(compare=False)
    grid_ops: list[GridOp] = field(default_factory=list)
    position_uses: list[PositionUse] = field(default_factory=list)
    # Attention and MLP side by side on one residual (``x + attn(h) + mlp(h)``): the whole block
    # runs before an attention variant's reduction (see ``parallel.py``).
    parallel_mlp: bool = False
    # Further attention cores in the attention residual (parallel attentions, the second softmax
    # of differential attention): hooked like ``attention``; their token scores combine by
    # ``score_combination`` (``MEAN``, or ``DIFFERENCE``: ``attention``'s minus
    # ``score_coefficient`` times this list's one).
    parallel_cores: list[AttentionCore] = field(default_factory=list)
    score_combination: str | None = None
    score_coefficient: str | float | None = None  # a graph node's name, or a number
    score_blocker: str | None = None  # why eTPS/EViT cannot score with this block's attention
    # What reads this block's output tokens by position outside the blocks (dense outputs).
    readers: list[TokenReader] = field(default_factory=list)
    windows: Windows | None = None  # where the block attends within windows
    per_token_after: list[PerTokenBranch] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        data = {
            "index": self.index,
            "path": self.path,
            "tokens": self.tokens,
            "dim": self.dim,
            "heads": self.heads,
            "attention": self.attention.kind,
            "attention_path": self.attention.path,
            "attention_batch": self.attention.batch,
            # Fewer query tokens than the block's own: class attention (CaiT), nothing to reduce.
            "query_tokens": self.attention.query_tokens,
            "key_tokens": self.attention.key_tokens,
            **(
                {"key_pool": [list(v) for v in self.attention.key_pool]}
                if self.attention.key_pool is not None
                else {}
            ),
            "stage": self.stage,
            "grid": list(self.grid),
            "prefix_tokens": self.prefix_tokens,
            "grid_ops": [op.to_json() for op in self.grid_ops],
            # Every place a table meets the tokens (RoPE's sin and cos rows meet q and k: one
            # entry each, alike but for the node), so that the map reads back whole.
            "position_uses": [use.to_json() for use in self.position_uses],
            "parallel_mlp": self.parallel_mlp,
            "attention_cores": 1 + len(self.parallel_cores),
            "parallel_cores": [core.to_json() for core in self.parallel_cores],
            "score_combination": self.score_combination,
            # A number, or the name of the graph node that holds it.
            "score_coefficient": self.score_coefficient,
            "score_blocker": self.score_blocker,
            "readers": [reader.to_json() for reader in self.readers],
            "windows": self.windows.to_json() if self.windows is not None else None,
        }
        if self.per_token_after:  # said only where there are any
            data["per_token_after"] = [branch.to_json() for branch in self.per_token_after]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Block:
        # The block's own core is said in the block's record, under the block's names.
        said = {"kind": "attention", "path": "attention_path", "batch": "attention_batch"}
        names = [(f.name, said.get(f.name, f.name)) for f in fields(AttentionCore) if f.compare]
        attention = AttentionCore.from_json({n: data[key] for n, key in names if key in data})
        return cls(
            index=data["index"],
            path=data["path"],
            tokens=data["tokens"],
            dim=data["dim"],
            heads=data["heads"],
            attention=attention,
            stage=data["stage"],
            grid=_grid(data["grid"]),
            prefix_tokens=data["prefix_tokens"],
            input_node=GRAPH_NODE_ABSENT,
            attn_add_node=GRAPH_NODE_ABSENT,
            output_node=GRAPH_NODE_ABSENT,
            grid_ops=[GridOp.from_json(op) for op in data.get("grid_ops", [])],
            position_uses=[PositionUse.from_json(use) for use in data.get("position_uses", [])],
            parallel_mlp=bool(data.get("parallel_mlp", False)),
            parallel_cores=[AttentionCore.from_json(core) for core in data["parallel_cores"]],
            score_combination=data.get("score_combination"),
            score_coefficient=data.get("score_coefficient"),
            score_blocker=data.get("score_blocker"),
            readers=[TokenReader.from_json(r) for r in data.get("readers", [])],
            windows=Windows.from_json(data["windows"]) if data.get("windows") else None,
            per_token_after=[
                PerTokenBranch(p, GRAPH_NODE_ABSENT, GRAPH_NODE_ABSENT)
                for p in data.get("per_token_after", [])
            ],
        )


@dataclass
class Stage(JsonRecord):
    index: int
    grid: tuple[int, ...]  # (H, W), or of any rank: a video's (T, H, W)
    prefix_tokens: int
    blocks: list[int]  # block indices
    # The token stream as it enters the stage's first block, and the (B, HW, C) patch tokens
    # before prefix tokens are concatenated.
    entry_node: str = field(compare=False)
    embed_node: str = field(compare=False)
    # Node that flattens the (B, C, H, W) patch grid into tokens; absent when the model starts
    # from tokens.
    patch_grid_node: str | None = field(default=None, compare=False)
    # Where the stage's output tokens are laid out as a grid again (a pyramid's next patch
    # embedding, or a pooled head): (3-D tokens node, first 4-D node). Reduced tokens are padded
    # back to the full grid here.
    exit_tokens_node: str | None = field(default=None, compare=False)
    exit_grid_node: str | None = field(default=None, compare=False)
    # Where the stage's tokens reach the next stage without passing the exit grid (a pooling
    # over the token order, say): reduced tokens cannot follow them there.
    exit_bypass: str | None = None


@dataclass
class ModelMap:
    capture: str  # "symbolic_trace" or "export"
    input_size: tuple[int, ...]  # without the batch: (C, H, W), a video's (C, T, H, W), ...
    stages: list[Stage]
    blocks: list[Block]
    leaves: list[str] = field(default_factory=list)  # modules kept whole by the tracer
    # Attention blocks no method can reduce, each with why (``path: reason``): SAM2-Hiera's
    # query-pooling stage transitions. The rest of the model compresses around them.
    left_whole: list[str] = field(default_factory=list)
    # The head reads token 0 of the last stage: its first prefix token is a cls token. Without
    # one (global pooling, registers only), eTPS/EViT score by the attention a token receives.
    cls_token: bool = False
    # Module path of the norm applied to the token stream after the last block (``final_norm.py``),
    # the place token distillation compares tokens; ``None`` when the head pools or takes the cls
    # token before any norm.
    final_norm: str | None = None

    @property
    def prefix_tokens(self) -> int:
        return self.stages[0].prefix_tokens

    @property
    def grid(self) -> tuple[int, ...]:
        return self.stages[0].grid

    @property
    def is_hybrid(self) -> bool:
        return len(self.stages) > 1 or any(b.grid_ops for b in self.blocks)

    @property
    def dense(self) -> bool:
        """Whether anything reads block outputs' tokens by position: a dense output."""
        return any(block.readers for block in self.blocks)

    @property
    def has_nodes(self) -> bool:
        """Whether the map names the nodes of a captured graph (a map read back from JSON
        does not, and cannot be used to rewrite one)."""
        return all(b.input_node for b in self.blocks)

    def to_json(self) -> dict[str, Any]:
        return {
            "capture": self.capture,
            "input_size": list(self.input_size),
            "prefix_tokens": self.prefix_tokens,
            "cls_token": self.cls_token,
            "grid": list(self.grid),
            "stages": [stage.to_json() for stage in self.stages],
            "blocks": [b.to_json() for b in self.blocks],
            "leaves": self.leaves,
            "left_whole": self.left_whole,
            "final_norm": self.final_norm,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelMap:
        """The map :meth:`to_json` wrote, without node names (see the module's docstring)."""
        return cls(
            capture=data["capture"],
            input_size=tuple(data["input_size"]),
            stages=[Stage.from_json(stage) for stage in data["stages"]],
            blocks=[Block.from_json(block) for block in data["blocks"]],
            leaves=list(data.get("leaves", [])),
            left_whole=list(data.get("left_whole", [])),
            cls_token=bool(data.get("cls_token")),
            final_norm=data.get("final_norm"),
        )


def _grid(values: list[int]) -> tuple[int, ...]:
    """A grid as JSON wrote it: (H, W), or of any rank (a video's (T, H, W))."""
    return tuple(int(v) for v in values)


# --- How a table laid out by token position is gathered by the kept tokens ------------------


def gather_layout(
    shape: tuple[int, ...], rank: int, kind: str, tokens: int, prefix_tokens: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    """Where a table of ``shape``, read against a rank-``rank`` tensor of ``tokens`` tokens
    (``prefix_tokens`` of them first), is gathered: (its token dims once right-aligned to that
    rank, the prefix rows each holds); or why it cannot be, as a phrase for the refusal.

    An attention bias lies on the logits' last two dims (queries, keys), either of which may be
    broadcast (1: a key-only or query-only bias); any other table has one token dim before its
    last (the last is its channel axis, as RoPE's D).
    """
    if len(shape) > rank:
        return f"its {len(shape)} dims do not line up with the {rank} of the tokens it meets"
    padded = (1,) * (rank - len(shape)) + tuple(shape)
    if padded[0] != 1:
        return f"its first dim ({padded[0]}) is not broadcast over the images"
    rows = {tokens - prefix_tokens: 0, tokens: prefix_tokens}  # rows before the patch tokens
    if kind == "attention bias":
        last_two = (rank - 2, rank - 1)
        dims = tuple(d for d in last_two if padded[d] in rows)
        if rank < 3 or not dims or any(padded[d] not in rows and padded[d] != 1 for d in last_two):
            return f"its last two dims {padded[-2:]} are not the queries and keys"
    else:
        dims = tuple(d for d in range(1, rank - 1) if padded[d] in rows and padded[d] > 1)
        pair = pair_dims(padded, set(rows)) if kind == "query/key table" else None
        if pair is not None:
            dims = pair  # a table of (query, key) pairs: both follow the kept tokens
        elif len(dims) != 1:
            return f"{len(dims)} of its dims {padded} could be the token axis"
    return dims, tuple(rows[padded[d]] for d in dims)


def pair_dims(shape: tuple, counts: set[int]) -> tuple[int, int] | None:
    """The (queries, keys) dims of an unbatched pairwise table: two adjacent token dims of one
    size before the last (its channel axis), the first dim 1, no other token dim."""
    if len(shape) < 4 or shape[0] != 1:
        return None
    dims = [d for d in range(1, len(shape) - 1) if shape[d] in counts]
    if len(dims) != 2 or dims[1] != dims[0] + 1 or shape[dims[0]] != shape[dims[1]]:
        return None
    return dims[0], dims[1]
