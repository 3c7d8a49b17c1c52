"""What the search's cost model reads off the captured graph of the base (``cost.py``): each
block's MACs by branch (node by node, not by module), the attention's key-side work and its q k^T
width, and the MACs per token of what runs after the last self-attending block."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn

from vitcompress.analysis import ops
from vitcompress.analysis.capture import capture
from vitcompress.analysis.model_map import ModelMap
from vitcompress.measure.macs import count_call_macs, count_call_ops


def add_ops(into: dict[Any, int], more: dict[Any, int]) -> None:
    """Add ``more``'s MACs by op into ``into``."""
    for op, n in more.items():
        into[op] = into.get(op, 0) + n


class _CountByNode(fx.Interpreter):
    """Runs a graph counting each node's MACs by op."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.ops: dict[str, dict[Any, int]] = {}

    def run_node(self, n: fx.Node) -> Any:
        result, counted = count_call_ops(lambda: super(_CountByNode, self).run_node(n))
        if counted:
            self.ops[n.name] = counted
        return result


class _DropTokens(fx.Interpreter):
    """Runs a graph with the last ``drop`` tokens of one node's (B, N, C) output dropped."""

    def __init__(self, gm: fx.GraphModule, node: str, tokens: int, drop: int) -> None:
        super().__init__(gm)
        self.node, self.tokens, self.drop = node, tokens, drop

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name == self.node and self.drop:
            if not (isinstance(result, torch.Tensor) and result.dim() == 3):
                raise ValueError("not a (B, N, C) token tensor")
            if result.shape[1] != self.tokens:
                raise ValueError("not the block's tokens")
            result = result[:, : self.tokens - self.drop]
        return result


class GraphProfile:
    """The base captured once, for what the per-module counts cannot tell: the shapes the
    attention multiplies, and what runs after the last block on fewer tokens. ``None`` where
    the model does not capture the way the analysis captured it."""

    def __init__(self, model: nn.Module, model_map: ModelMap) -> None:
        first = next(iter(model.parameters()), None)
        dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
        device = first.device if first is not None else torch.device("cpu")
        generator = torch.Generator().manual_seed(0)
        example = torch.randn((1, *model_map.input_size), generator=generator, dtype=dtype)
        self.example = example.to(device)
        try:
            self.module: fx.GraphModule | None = capture(model, self.example).module.eval()
        except Exception:  # noqa: BLE001 - the split by op kind alone, as before
            self.module = None
            return
        # The counter hooks the backward of inputs that need grad; a parameter fed to a module
        # as it is (an attention-pool's latent query) has no grad_fn. This copy is not trained.
        self.module.requires_grad_(False)
        self.nodes = {node.name: node for node in self.module.graph.nodes}

    def branch_ops(self, model_map: ModelMap) -> dict[int, tuple[dict[Any, int], ...]] | None:
        """Per block, its MACs by op, its attention branch's and its keys' side's (what feeds
        only the keys and values, ``_key_side``), read off the graph: the block
        is what runs on the tokens between its input and its output, the attention branch what
        of that feeds the residual add closing the attention. Work that does not depend on the
        image (a position table built by an MLP from coordinates) belongs to no block: it is
        constant. ``None`` where the graph cannot be run."""
        if self.module is None:
            return None
        counting = _CountByNode(self.module)
        try:
            counting.run(self.example)
        except Exception:  # noqa: BLE001 - the split by module path, as before
            return None
        order = list(self.module.graph.nodes)
        result = {}
        for block in model_map.blocks:
            after = _descendants(order, block.input_node)
            block_nodes = after & _ancestors(order, block.output_node)
            attention = block_nodes & _ancestors(order, block.attn_add_node)
            keys = attention & self._key_side(order, block)
            parts: tuple[dict[Any, int], ...] = ({}, {}, {})
            for name in block_nodes:
                counted = counting.ops.get(name, {})
                add_ops(parts[0], counted)
                if name in attention:
                    add_ops(parts[1], counted)
                if name in keys:
                    add_ops(parts[2], counted)
            result[block.index] = parts
        return result

    def _key_side(self, order: list[fx.Node], block: Any) -> set[str]:
        """The nodes that make the attention's keys and values and not its queries (they run on
        the keys: on a pooled grid (CvT's strided projections), whatever tokens the block
        keeps); empty where the cores' q, k and v are not found."""
        found: set[str] = set()
        for core in [block.attention, *block.parallel_cores]:
            sides = self._query_key_value(core)
            if sides is None:
                return set()
            query, *others = sides
            query_side = _ancestors(order, query.name)
            for other in others:
                found |= _ancestors(order, other.name) - query_side
        return found

    def _query_key_value(self, core: Any) -> tuple[fx.Node, fx.Node, fx.Node] | None:
        node = self.nodes.get(core.node)
        if node is None:
            return None
        if core.kind == "sdpa":
            args = [a for a in node.args[:3] if isinstance(a, fx.Node)]
            return (args[0], args[1], args[2]) if len(args) == 3 else None
        logits = self.nodes.get(core.logits_node or "")
        if logits is None or core.kind not in ("matmul_softmax", "einsum_softmax"):
            return None
        operands = [a for a in logits.args if isinstance(a, fx.Node)]
        # attn @ v: the first product the softmax's output reaches; v is its other operand.
        previous, current, value = None, node, None
        for _ in range(8):  # through dropout and the like
            users = list(current.users)
            if len(users) != 1:
                return None
            previous, current = current, users[0]
            if any(name in str(current.target) for name in ("matmul", "bmm", "einsum")):
                inputs = [a for a in current.args if isinstance(a, fx.Node)]
                value = next((a for a in inputs if a is not previous), None)
                break
        if len(operands) != 2 or value is None:
            return None
        return operands[0], operands[1], value

    def query_key_width(self, block: Any) -> float | None:
        """heads x the width of q k^T over the block's attention cores, read off q's shape (B,
        heads, N, d) at each core; ``None`` where a shape is not there to read. Differential
        attention's q and k are narrower than its v."""
        if self.module is None:
            return None
        width = 0
        for core in [block.attention, *block.parallel_cores]:
            node = self.nodes.get(core.logits_node or core.node)
            query = node.args[0] if node is not None and node.args else None
            shape = ops.shape(query) if isinstance(query, fx.Node) else None
            if shape is None or len(shape) != 4:
                return None
            width += shape[1] * shape[3]
        return float(width)


def _descendants(order: list[fx.Node], name: str) -> set[str]:
    """The nodes computed from node ``name`` (itself excluded), ``order`` being topological."""
    found: set[str] = set()
    reached = {name}
    for node in order:
        if any(n.name in reached for n in node.all_input_nodes):
            reached.add(node.name)
            found.add(node.name)
    return found


def _ancestors(order: list[fx.Node], name: str) -> set[str]:
    """The nodes node ``name`` is computed from, itself included."""
    nodes = {node.name: node for node in order}
    found = {name}
    stack = [nodes[name]]
    while stack:
        for n in stack.pop().all_input_nodes:
            if n.name not in found:
                found.add(n.name)
                stack.append(n)
    return found


def tail_cost(model_map: ModelMap, graph: GraphProfile) -> tuple[int, float]:
    """The last block attending over its own tokens, and the MACs per token of what runs after
    it (cost.py's docstring); 0 where that does not depend on the tokens left."""
    own = [
        b.index
        for b in model_map.blocks
        if b.windows is None
        and b.attention.query_tokens in (None, b.tokens)
        and b.attention.key_tokens in (None, b.tokens)
    ]
    if not own:
        return -1, 0.0
    last = model_map.blocks[own[-1]]
    if last.readers:  # the compressed model restores every token for what reads them
        return last.index, 0.0
    drop = (last.tokens - last.prefix_tokens) // 4
    if drop < 1:
        return last.index, 0.0
    gm, example = graph.module, graph.example
    if gm is None:
        return last.index, 0.0
    try:
        counts = [
            count_call_macs(
                lambda d=d: _DropTokens(gm, last.output_node, last.tokens, d).run(example)
            )
            for d in (0, drop)
        ]
    except Exception:  # noqa: BLE001 - a tail that needs every token: it never sees fewer
        return last.index, 0.0
    return last.index, max(0.0, (counts[0] - counts[1]) / drop)
