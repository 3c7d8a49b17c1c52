"""Position-dependent tensors inside blocks: tables indexed by token position.

A token reduction drops and reorders tokens. Every later op that combines the tokens with a tensor
laid out by token position (a relative-position bias on the attention logits, RoPE's sin/cos rows
on q and k, a per-block position embedding) would then pair a token with another token's row, and
the logits change with no error. Such tensors are found from the graph alone:

- the tensor does not derive from the image (built from parameters, buffers or constants, possibly
  through index/gather/interpolate/view ops); edges that only read a size do not count;
- one of its dimensions other than the last equals the block's token count (prefix included) or
  its patch-token count; the last dimension is left out because it is the channel axis of a
  per-channel weight (LayerScale, a bias), which does not depend on position; an attention bias
  (..., N, N) and a RoPE table (N, D) still carry N in a dimension before the last. Added to the
  attention logits, the last dimension counts too: there it is the keys (a key-only bias
  (..., 1, N));
- it is a direct input of an op inside the block's attention or MLP residual branch that does
  derive from the image: where it meets the token stream.

What the table is built from is named by the parameters and buffers it is computed from; a tensor
the tracer folded into a constant is named by its shape.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from vitcompress.analysis import ops
from vitcompress.analysis.model_map import AttentionCore, PositionUse, gather_layout, pair_dims

CONSTANT_PREFIX = "_tensor_constant"  # how torch.fx names tensors it folds into the graph


def _token_dims(shape: tuple, counts: set[int], keys_last: bool = False) -> bool:
    """Whether ``shape`` has a token dim: one before the last (the last is a channel axis), or
    any dim with ``keys_last``, for a tensor added to attention logits, whose last dim is the
    keys (a key-only bias ``(..., 1, N)``)."""
    if keys_last:
        return any(size in counts for size in shape)
    return len(shape) >= 2 and any(size in counts for size in shape[:-1])


def _sources(node: fx.Node, parameters: set[str]) -> list[str]:
    """What ``node`` is computed from: parameters, then modules (a bias MLP on coordinates),
    then buffers, each sorted."""
    found: dict[str, set[str]] = {"parameter": set(), "module": set(), "buffer": set()}
    # Edges that only read a size (``x.shape``) do not build the table from their source.
    for current in ops.reachable(node, ops.tensor_inputs):
        if current.op == "get_attr" and not str(current.target).startswith(CONSTANT_PREFIX):
            target = str(current.target)
            found["parameter" if target in parameters else "buffer"].add(target)
        elif current.op == "call_module":
            found["module"].add(str(current.target))
    # Modules that compute a table together (an MLP over coordinates) are named by their parent.
    modules = [ops.common_path(sorted(found["module"]))] if found["module"] else []
    return sorted(found["parameter"]) + [m for m in modules if m] + sorted(found["buffer"])


def describe(node: fx.Node, parameters: set[str]) -> str:
    """The table a position tensor is built from, as the user can find it in the model; a tensor
    computed while tracing (folded into a constant) by its shape."""
    sources = _sources(node, parameters)
    if sources:
        return sources[0]
    return f"<constant {tuple(ops.shape(node) or ())}>"


def _kind(
    meeting: fx.Node, core: AttentionCore | None, nodes: dict[str, fx.Node], is_ancestor
) -> str:
    """Where the table meets the tokens: the attention logits, the queries/keys, or the tokens."""
    if core is None or core.kind == "multihead_attention":
        return "token table"
    attention = nodes[core.node]
    if core.kind == "sdpa":
        if meeting is attention:
            return "attention bias"
        qk = [a for a in attention.args[:2] if isinstance(a, fx.Node)]
        if any(meeting is a or is_ancestor(meeting, a) for a in qk):
            return "query/key table"
        return "token table"
    product = nodes[core.logits_node] if core.logits_node else None
    if meeting is attention or (
        product is not None and is_ancestor(product, meeting) and is_ancestor(meeting, attention)
    ):
        return "attention bias"
    if product is not None and is_ancestor(meeting, product):
        return "query/key table"
    return "token table"


def find_position_uses(
    gm: fx.GraphModule,
    image: fx.Node,
    branches: dict[str, list[fx.Node]],
    core: AttentionCore | None,
    tokens: int,
    prefix_tokens: int,
    is_ancestor,
    per_image: bool = True,
) -> list[PositionUse]:
    """Position-dependent tensors that meet the token stream in one block: one use per op and
    table it reads (the same table read twice is gathered at both places). ``per_image`` false:
    the tokens are batched as windows, and the tables are gathered per window.

    ``branches`` maps "attention"/"mlp" to the nodes of that residual branch (its closing add
    included); ``is_ancestor(a, b)`` says whether ``b`` reads data of ``a``.
    """
    # A count of 1 is no position (a class-attention block's single query token).
    counts = {c for c in (tokens, tokens - prefix_tokens) if c > 1}
    nodes = ops.nodes_by_name(gm.graph)
    parameters = {name for name, _ in gm.named_parameters()}
    batch = (ops.shape(image) or (None,))[0] if per_image else None
    found: list[PositionUse] = []
    seen: set[tuple[str, str]] = set()
    for branch, branch_nodes in branches.items():
        for meeting in branch_nodes:
            for operand in meeting.all_input_nodes:
                shape = ops.shape(operand)
                if shape is None or operand is image or is_ancestor(image, operand):
                    continue
                if (meeting.name, operand.name) in seen:
                    continue
                kind = _kind(meeting, core, nodes, is_ancestor)
                if not _token_dims(shape, counts, keys_last=kind == "attention bias"):
                    continue
                seen.add((meeting.name, operand.name))
                positional = _positional_attention(gm, operand)
                if positional is not None:
                    use = _positional_use(
                        positional, branch, meeting, operand, parameters, tokens, prefix_tokens
                    )
                    # One gather where the table is read, however many places its result meets.
                    if not any((u.node, u.table_node) == (use.node, use.table_node) for u in found):
                        found.append(use)
                    continue
                table = describe(operand, parameters)
                blocker = _blocker(gm, meeting, operand, kind, tokens, prefix_tokens, batch, image)
                found.append(
                    PositionUse(
                        table=table,
                        kind=kind,
                        branch=branch,
                        path=ops.module_path(meeting),
                        node=meeting.name,
                        table_node=operand.name,
                        shape=tuple(shape),
                        blocker=blocker,
                        neutral=_neutral(meeting, operand, image, is_ancestor),
                    )
                )
    return found


def _positional_attention(gm: fx.GraphModule, table: fx.Node) -> fx.Node | None:
    """The softmax a position tensor is computed through, if any: an attention over positions
    alone (ConViT's gated positional self-attention: a softmax over a projection of the
    relative positions, blended with the token attention), not a table the tokens' rows can be
    picked from. Only the table's own ancestors are searched: none of them reads the image."""
    return next((n for n in ops.reachable(table, ops.tensor_inputs) if ops.is_softmax(n, gm)), None)


def _pair_source(softmax: fx.Node, counts: set[int]) -> fx.Node | None:
    """The table a positional attention is computed from: the one tensor among its ancestors
    that has no tensor inputs (a parameter, a buffer, a constant), is not batched (first dim 1)
    and holds a (queries, keys) pair of token dims before its last (ConViT's relative indices
    (1, N, N, 3)). Gathered there, every op after it (the projection, the expand over the
    images, the softmax over the kept keys) computes the positional attention of the kept
    tokens, as it would for an image of those tokens alone."""
    sources = [
        node
        for node in ops.reachable(softmax, ops.tensor_inputs)
        if not ops.tensor_inputs(node)
        and (shape := ops.shape(node)) is not None
        and pair_dims(shape, counts) is not None
    ]
    return sources[0] if len(sources) == 1 else None


def _positional_use(
    softmax: fx.Node,
    branch: str,
    meeting: fx.Node,
    operand: fx.Node,
    parameters: set[str],
    tokens: int,
    prefix_tokens: int,
) -> PositionUse:
    """A positional attention (see ``_positional_attention``) as a position use: gathered at
    the pairwise table it is computed from, where its single reader reads it; refused in one
    line where there is no such table."""
    counts = {c for c in (tokens, tokens - prefix_tokens) if c > 1}
    source = _pair_source(softmax, counts)
    readers = list(source.users) if source is not None else []
    if source is not None and len(readers) == 1 and ops.shape(readers[0]) is not None:
        reader = readers[0]
        return PositionUse(
            table=describe(source, parameters),
            kind="query/key table",
            branch=branch,
            path=ops.module_path(reader) or ops.module_path(meeting),
            node=reader.name,
            table_node=source.name,
            shape=tuple(ops.shape(source)),
            # Where ``gather_layout`` reads the table at its reader's rank, it is gathered.
            blocker=_layout_blocker(
                tuple(ops.shape(source)), len(ops.shape(reader)), tokens, prefix_tokens
            ),
            # No row of a positional attention is known to leave the attention unchanged.
            neutral=None,
        )
    sources = _sources(softmax, parameters)
    named = ", ".join(s for s in sources if s not in parameters) or ", ".join(sources)
    return PositionUse(
        table=f"GPSA positional attention over {named or 'a constant'}",
        kind="token table",
        branch=branch,
        path=ops.module_path(meeting),
        node=meeting.name,
        table_node=operand.name,
        shape=tuple(ops.shape(operand) or ()),
        blocker=(
            "it is gated positional self-attention's positional attention (a softmax over the "
            "relative positions, blended with the token attention after the attention's own "
            "softmax), and no single unbatched (1, N, N, C) table of token pairs it is "
            "computed from was found to gather by the kept tokens"
        ),
        neutral=None,
    )


def _layout_blocker(shape: tuple, rank: int, tokens: int, prefix_tokens: int) -> str | None:
    layout = gather_layout(shape, rank, "query/key table", tokens, prefix_tokens)
    return layout if isinstance(layout, str) else None


# --- Following the kept tokens: where a table is gathered, and what a token off the grid gets --

_ADD_NAMES = {"add", "add_", "sub", "sub_"}
_MUL_NAMES = {"mul", "mul_"}


def _elementwise(node: fx.Node) -> str | None:
    """``"add"`` for an add/sub, ``"mul"`` for a multiplication, else ``None``."""
    if node.op == "call_function":
        target = node.target
        if target in (operator.add, operator.iadd, operator.sub, operator.isub):
            return "add"
        if target in (operator.mul, operator.imul):
            return "mul"
        name = getattr(target, "__name__", "").split(".")[0]
    elif node.op == "call_method":
        name = str(node.target)
    else:
        return None
    return "add" if name in _ADD_NAMES else "mul" if name in _MUL_NAMES else None


def _attn_mask(node: fx.Node) -> object:
    return node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)


def _blocker(
    gm: fx.GraphModule,
    meeting: fx.Node,
    operand: fx.Node,
    kind: str,
    tokens: int,
    prefix_tokens: int,
    batch: int | None,
    image: fx.Node,
) -> str | None:
    """Why the table ``operand`` cannot follow the kept tokens where ``meeting`` reads it, or
    ``None``: it must be added or multiplied to the tokens (or be an attention's additive mask),
    so that its rows line up with the tokens by broadcasting, per image."""
    if ops.is_sdpa(meeting):
        if _attn_mask(meeting) is not operand:
            return f"it is an input of {meeting.name} other than its additive mask"
    elif _elementwise(meeting) is None:
        return (
            f"it meets the tokens in {ops.op_name(gm, meeting)} ({meeting.name}), where its rows "
            "do not line up with the tokens by broadcasting"
        )
    out = ops.shape(meeting)
    if out is None:
        return f"{meeting.name} has no single tensor output"
    if batch is not None and out[0] != batch:
        return (
            f"the tokens it meets are batched as {out[0]} rows for {batch} images (heads or "
            "windows folded into the batch), so it cannot be gathered per image"
        )
    layout = gather_layout(tuple(ops.shape(operand)), len(out), kind, tokens, prefix_tokens)
    return layout if isinstance(layout, str) else None


def _neutral(meeting: fx.Node, operand: fx.Node, image: fx.Node, is_ancestor) -> float | None:
    """The value a token off the grid takes on the table's row: the one that leaves the op
    unchanged. Added (a bias, an attention mask): 0. Multiplied: 1, except for the second table
    of a rotation ``x * a + r(x) * b`` with ``r(x)`` computed from ``x`` (RoPE: ``a`` cos, ``b``
    sin), which takes 0, so that the token is not rotated, as the prefix tokens are not."""
    if ops.is_sdpa(meeting) or _elementwise(meeting) == "add":
        return 0.0
    if _elementwise(meeting) != "mul":
        return None

    def tokens_of(mul: fx.Node) -> fx.Node | None:
        data = [a for a in mul.all_input_nodes if a is image or is_ancestor(image, a)]
        return data[0] if len(data) == 1 else None

    mine = tokens_of(meeting)
    for total in meeting.users:
        if _elementwise(total) != "add":
            continue
        for other in total.all_input_nodes:
            if other is meeting or _elementwise(other) != "mul":
                continue
            theirs = tokens_of(other)
            if mine is None or theirs is None or len(other.all_input_nodes) != 2:
                continue
            if is_ancestor(theirs, mine):
                return 0.0  # this table multiplies the rotated tokens: sin
            if is_ancestor(mine, theirs):
                return 1.0  # this one multiplies the tokens themselves: cos
            return None  # two tables on unrelated parts (a complex product): no known identity
    return 1.0
