"""Blocks beyond "one attention residual, then one MLP residual": parallel branches.

Two shapes are handled here, both found from the dataflow alone:

- **attention and MLP side by side on one residual** (``x + attn(h) + mlp(h)``, timm's
  ``ParallelScalingBlock``): no MLP residual follows the attention's. The block ends where its
  branches rejoin (:func:`block_end`); tokens can be reduced there, after the whole block ran on
  all of them.
- **several attention cores in one residual**: parallel attentions summed on the stream
  (``vit_small_patch16_18x2``) or differential attention's two softmaxes (``vit_dwee``,
  ``attn1 - lambda * attn2``). Every core is masked alike; their token scores combine as the
  block's attention map does (:func:`combine_cores`): the mean of the scores where the outputs
  are summed or concatenated (all heads of all cores), ``s1 - lambda * s2`` for the difference
  (exact: a head-mean of a cls row, or of the attention a key receives, is linear in the map).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from vitcompress.analysis import ops
from vitcompress.analysis.model_map import DIFFERENCE, MEAN, AttentionCore

_SUB = ({operator.sub, operator.isub, torch.sub, torch.subtract}, {"sub", "sub_", "subtract"})
_MUL = ({operator.mul, operator.imul, torch.mul, torch.multiply}, {"mul", "mul_", "multiply"})
# Ops that join the cores' outputs without weighing one against another: summed heads.
_JOIN = (
    {operator.add, operator.iadd, torch.add, torch.stack, torch.cat, torch.concat},
    {"add", "add_"},
)
_CASTS = {"type_as", "to", "float", "half", "bfloat16", "type"}
_PRODUCT_LIMIT = 12  # ops between a softmax and the product with the values


def _is(node: fx.Node, calls: tuple[set, set[str]]) -> bool:
    functions, methods = calls
    if node.op == "call_function":
        return node.target in functions
    if node.op == "call_method":
        return node.target in methods
    return False


def block_end(
    skip: fx.Node, add: fx.Node, nodes: Sequence[fx.Node], index: dict[fx.Node, int], is_ancestor
) -> fx.Node | None:
    """The node where a block whose attention residual (``skip`` + branch = ``add``) is not
    followed by an MLP residual ends: the first node from ``add`` on, of the stream's shape, that
    no other value of the block outlives (``x + attn(h) + mlp(h)`` adds its MLP after the
    attention's add). ``None`` when the block's values never all meet before the end."""
    shape = ops.shape(add)

    def of_block(value: fx.Node) -> bool:
        return value is skip or is_ancestor(skip, value)

    for candidate in nodes[index[add] :]:
        if candidate is not add and not is_ancestor(add, candidate):
            continue
        if ops.shape(candidate) != shape:
            continue
        position = index[candidate]
        outlived = any(
            index[parent] < position and of_block(parent)
            for later in nodes[position + 1 :]
            for parent in later.all_input_nodes
            if parent is not candidate and parent.meta.get("carries_tensor", True)
        )
        if not outlived:
            return candidate
    return None


@dataclass
class Combination:
    """How a block's attention cores make one attention map, for scoring its tokens."""

    cores: list[AttentionCore]  # the positive core first (differential attention)
    kind: str | None  # None (one core), MEAN or DIFFERENCE
    coefficient: str | float | None = None  # DIFFERENCE: lambda, a graph node's name or a number
    blocker: str | None = None  # why the cores cannot be scored as one map


def combine_cores(
    cores: list[AttentionCore],
    branch: Sequence[fx.Node],
    by_name: dict[str, fx.Node],
    image: fx.Node,
    is_ancestor: Callable[[fx.Node, fx.Node], bool],
    gm: fx.GraphModule,
) -> Combination:
    """How ``cores`` (in graph order, inside one residual ``branch``) combine into the map that
    eTPS/EViT score with."""
    if len(cores) == 1:
        return Combination(list(cores), None, blocker=_difference_after_softmax(cores[0], gm))
    outputs = [by_name[c.node] for c in cores]
    meet = next((n for n in branch if all(is_ancestor(o, n) for o in outputs)), None)
    paths = ", ".join(dict.fromkeys(c.path for c in cores))
    if meet is not None and _is(meet, _SUB):
        found = _difference(meet, cores, outputs, image, is_ancestor)
        if found is not None:
            return found
        return Combination(
            list(cores),
            None,
            blocker=(
                f"{len(cores)} attention cores ({paths}) are subtracted at {meet.name} in a way "
                "that is not one map (expected attn1 - lambda * attn2 with one lambda), so their "
                "tokens cannot be scored"
            ),
        )
    if meet is not None and _is(meet, _JOIN):
        return Combination(list(cores), MEAN)
    what = f"{meet.name} ({meet.target})" if meet is not None else "no op of the block"
    return Combination(
        list(cores),
        None,
        blocker=(
            f"{len(cores)} attention cores ({paths}) are combined at {what}, neither a sum nor "
            "a difference of their outputs, so their tokens cannot be scored as one map"
        ),
    )


def _difference(
    meet: fx.Node,
    cores: list[AttentionCore],
    outputs: list[fx.Node],
    image: fx.Node,
    is_ancestor,
) -> Combination | None:
    """``attn1 - c * attn2`` (or ``attn1 - attn2 * c``) with a scalar ``c`` that does not derive
    from the image: the differential map ``A1 - c A2``."""
    if len(cores) != 2 or len(meet.args) < 2:
        return None
    positive, scaled = meet.args[0], meet.args[1]
    if positive not in outputs or not isinstance(scaled, fx.Node) or not _is(scaled, _MUL):
        return None
    left, right = scaled.args[0], scaled.args[1]
    negative, coefficient = (right, left) if right in outputs else (left, right)
    if negative not in outputs or negative is positive:
        return None
    if isinstance(coefficient, fx.Node):
        shape = ops.shape(coefficient)
        if shape is None or any(d != 1 for d in shape) or is_ancestor(image, _cast_of(coefficient)):
            return None  # lambda per head or per token: the head-mean would not be linear in it
        value: str | float = coefficient.name
    elif isinstance(coefficient, int | float):
        value = float(coefficient)
    else:
        return None
    first, second = cores[outputs.index(positive)], cores[outputs.index(negative)]
    return Combination([first, second], DIFFERENCE, coefficient=value)


def _cast_of(node: fx.Node) -> fx.Node:
    """The value a dtype cast reads (``lambda.type_as(q)`` reads only q's dtype, not its data)."""
    while node.op == "call_method" and node.target in _CASTS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _difference_after_softmax(core: AttentionCore, gm: fx.GraphModule) -> str | None:
    """A softmax whose probabilities are subtracted from one another before they weigh the values
    (differential attention written out: ``p[:, :, 0] - lambda * p[:, :, 1]``): its heads are
    halves of differential maps, and their mean is not the block's attention."""
    if core.kind not in ("matmul_softmax", "einsum_softmax"):
        return None
    start = next((n for n in gm.graph.nodes if n.name == core.node), None)
    frontier, seen = [start] if start is not None else [], set()
    while frontier and len(seen) < _PRODUCT_LIMIT:
        node = frontier.pop()
        for user in node.users:
            if user in seen or ops.is_matmul(user) or ops.is_einsum(user):
                continue
            seen.add(user)
            if _is(user, _SUB):
                return (
                    f"differential attention at {core.path}: its softmax's probabilities are "
                    f"subtracted from one another ({user.name}) before they weigh the values, so "
                    "the block's map is not a softmax and its tokens cannot be scored"
                )
            frontier.append(user)
    return None
