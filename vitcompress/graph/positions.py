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
  (..., N, N) and a RoPE table (N, D) still carry N in a dimension before the last;
- it is a direct input of an op inside the block's attention or MLP residual branch that does
  derive from the image: where it meets the token stream.

What the table is built from is named by the parameters and buffers it is computed from; a tensor
the tracer folded into a constant is named by its shape.
"""

from __future__ import annotations

import torch.fx as fx

from vitcompress.graph import ops
from vitcompress.graph.model_map import AttentionCore, PositionUse

CONSTANT_PREFIX = "_tensor_constant"  # how torch.fx names tensors it folds into the graph


def _token_dims(shape: tuple, counts: set[int]) -> bool:
    return len(shape) >= 2 and any(size in counts for size in shape[:-1])


def _sources(node: fx.Node, parameters: set[str]) -> list[str]:
    """What ``node`` is computed from: parameters, then modules (a bias MLP on coordinates),
    then buffers, each sorted."""
    seen: set[fx.Node] = set()
    stack = [node]
    found: dict[str, set[str]] = {"parameter": set(), "module": set(), "buffer": set()}
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op == "get_attr" and not str(current.target).startswith(CONSTANT_PREFIX):
            target = str(current.target)
            found["parameter" if target in parameters else "buffer"].add(target)
        elif current.op == "call_module":
            found["module"].add(str(current.target))
        # Edges that only read a size (``x.shape``) do not build the table from their source.
        stack.extend(n for n in current.all_input_nodes if n.meta.get("carries_tensor", True))
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


def _kind(meeting: fx.Node, core: AttentionCore | None, nodes: dict[str, fx.Node],
          is_ancestor) -> str:
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
    if meeting is attention or (product is not None and is_ancestor(product, meeting)
                                and is_ancestor(meeting, attention)):
        return "attention bias"
    if product is not None and is_ancestor(meeting, product):
        return "query/key table"
    return "token table"


def find_position_uses(gm: fx.GraphModule, image: fx.Node, branches: dict[str, list[fx.Node]],
                       core: AttentionCore | None, tokens: int, prefix_tokens: int,
                       is_ancestor) -> list[PositionUse]:
    """Position-dependent tensors that meet the token stream in one block.

    ``branches`` maps "attention"/"mlp" to the nodes of that residual branch (its closing add
    included); ``is_ancestor(a, b)`` says whether ``b`` reads data of ``a``.
    """
    # A count of 1 is no position (a class-attention block's single query token).
    counts = {c for c in (tokens, tokens - prefix_tokens) if c > 1}
    nodes = {n.name: n for n in gm.graph.nodes}
    parameters = {name for name, _ in gm.named_parameters()}
    found: list[PositionUse] = []
    seen: set[tuple[str, str]] = set()
    for branch, branch_nodes in branches.items():
        for meeting in branch_nodes:
            for operand in meeting.all_input_nodes:
                shape = ops.shape(operand)
                if shape is None or operand is image or is_ancestor(image, operand):
                    continue
                if not _token_dims(shape, counts) or (branch, operand.name) in seen:
                    continue
                seen.add((branch, operand.name))
                found.append(PositionUse(
                    table=describe(operand, parameters),
                    kind=_kind(meeting, core, nodes, is_ancestor),
                    branch=branch,
                    path=ops.module_path(meeting),
                    node=meeting.name,
                    table_node=operand.name,
                    shape=tuple(shape),
                ))
    return found
