"""What the search's cost model reads off the captured graph of the base (``cost.py``): each
block's MACs by kind of work (node by node, not by module), the attention's key-side work and its
q k^T width, what the rewrite's restores of a reduced stage's tokens run (``Restore``,
``ExitRestore``, read as ``compilation/rewrite.py`` restores), and the MACs per token of what
runs after the last block that can reduce."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from vitcompress.analysis import ops
from vitcompress.analysis.capture import capture
from vitcompress.analysis.model_map import ModelMap
from vitcompress.compilation.placement import reduces_tokens
from vitcompress.measure.macs import count_call_macs, count_call_ops

# Kinds of a block's work, as the cost model scales them (cost.py's docstring).
PRODUCTS = "products"  # on the (queries x keys) map: q k^T, attn @ v, what acts between them
ATTENTION = "attention"  # the attention branch, per token it is entered with
KEYS = "keys"  # the keys' and values' own side, per key
MLP = "mlp"  # the rest of the block, per token its MLP sees
GRID = "grid"  # on the (restored) grid: constant
KINDS = (PRODUCTS, ATTENTION, KEYS, MLP, GRID)
# aten ops whose work is the attention products (counted by FlopCounterMode as 2 FLOPs per MAC),
# and those that run on a spatial grid.
PRODUCT_OPS = ("bmm", "baddbmm", "scaled_dot_product", "_flash_attention", "_efficient")
GRID_OPS = ("convolution", "pool")


def is_op(op: Any, names: tuple[str, ...]) -> bool:
    text = str(op)
    return any(name in text for name in names)


@dataclass(frozen=True)
class Restore:
    """A grid op of a block reading tokens made from the residual stream. Once its stage is
    reduced, the rewrite gives it the full tokens back: where the method's rule restores the
    stream (``value``, ``delta``), the ops between the stream and the grid op's tokens (a norm)
    run again on the full tokens, and the originals nothing reads any more are erased
    (``compilation/rewrite.py``'s ``_restore_for``); a rule that restores the tokens in place
    (``host``, ``zero``) changes no MACs."""

    branch: str  # "attention" or "mlp": the residual stream it restores
    multiplies: bool  # a layer between the stream and the tokens: the method's local rule
    in_place: bool  # the tokens are the stream itself
    copied: float  # MACs of the ops run again, on the full tokens
    erased: dict[str, float] = field(default_factory=dict)  # the originals erased, by kind


@dataclass(frozen=True)
class ExitRestore:
    """Where tokens leave a block to be read by position (a stage's exit grid, the model's
    output, a head reading patch tokens: ``Block.readers``), and what runs between the block's
    output and there (a final or stage norm), on the ``tokens`` of the base. Once the stage is
    reduced the rewrite restores every token for the reader: a rule that restores in place
    (``host``, ``zero``) restores after what runs between, which so runs on the tokens left; one
    that restores the stream runs it again on the full tokens, and its originals that something
    else still reads (``kept``) on the tokens left."""

    tokens: int
    prefix_tokens: int
    in_place: bool  # the reader reads the block's output itself
    # MACs of what runs between, at ``tokens``: on every token, and on the patch tokens alone
    # (after the prefix tokens are split off: Segmenter's head on its grid)
    between: tuple[float, float]
    kept: tuple[float, float]  # of those, what still runs on the tokens left after a stream restore


@dataclass(frozen=True)
class BlockSplit:
    """One block's base MACs by kind (``KINDS``) and its grid ops' restores."""

    macs: dict[str, float]
    restores: tuple[Restore, ...] = ()


@dataclass(frozen=True)
class _Sides:
    """Which nodes of a block do which kind of work."""

    attention: set[str]  # the attention branch
    attention_map: set[str]  # from the logits to attn @ v
    grid: set[str]  # between a reshape to the grid and its flatten at the same resolution
    keys: set[str]  # only the keys' and values' side

    def kind(self, name: str, op: Any) -> str:
        """The kind of work of op ``op`` run by node ``name``."""
        if name in self.attention and (is_op(op, PRODUCT_OPS) or name in self.attention_map):
            return PRODUCTS
        if is_op(op, GRID_OPS) or name in self.grid:
            return GRID
        if name in self.keys:
            return KEYS
        return ATTENTION if name in self.attention else MLP


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

    def branch_ops(self, model_map: ModelMap) -> dict[int, BlockSplit] | None:
        """Per block, its MACs by kind of work (``KINDS``) and the restores of its grid ops;
        :meth:`exits` after it gives those of the tokens leaving blocks. Read off the graph: the block is what runs on the tokens between its input and its
        output, the attention branch what of that feeds the residual add closing the attention,
        its keys' side what feeds only the keys and values (``_key_side``). Work that does not
        depend on the image (a position table built by an MLP from coordinates) belongs to no
        block: it is constant. ``None`` where the graph cannot be run."""
        if self.module is None:
            return None
        counting = _CountByNode(self.module)
        try:
            counting.run(self.example)
        except Exception:  # noqa: BLE001 - the split by module path, as before
            return None
        self.counted = counting.ops
        order = list(self.module.graph.nodes)
        result = {}
        for block in model_map.blocks:
            after = _descendants(order, block.input_node)
            block_nodes = after & _ancestors(order, block.output_node)
            attention = block_nodes & _ancestors(order, block.attn_add_node)

            sides = _Sides(
                attention,
                self._attention_map(order, block, counting.ops),
                self._on_grid(order, block),
                attention & self._key_side(order, block),
            )
            macs: dict[str, float] = dict.fromkeys(KINDS, 0.0)
            for name in block_nodes:
                for op, n in counting.ops.get(name, {}).items():
                    macs[sides.kind(name, op)] += n
            result[block.index] = BlockSplit(
                macs, tuple(self._restores(order, block, counting.ops, sides))
            )
        return result

    def exits(self, model_map: ModelMap) -> list[tuple[int, ExitRestore]]:
        """Each restore of tokens leaving a block for a reader (``ExitRestore``), with the block
        it follows, in the rewrite's order: a block's readers, then its stage's exit grid after
        the stage's last block. Empty where :meth:`branch_ops` did not run."""
        counted = getattr(self, "counted", None)
        if self.module is None or counted is None:
            return []
        order = list(self.module.graph.nodes)
        users = {node.name: {u.name for u in node.users} for node in order}
        found = []
        for block in model_map.blocks:
            if block.windows is not None:  # restored within the block
                continue
            reads = [(reader.node, reader.tokens_node) for reader in block.readers]
            stage = model_map.stages[block.stage]
            if stage.blocks and stage.blocks[-1] == block.index and stage.exit_grid_node:
                reads.append((stage.exit_grid_node, stage.exit_tokens_node or ""))
            for reader_name, tokens_name in reads:
                reader, tokens = self.nodes.get(reader_name), self.nodes.get(tokens_name)
                if reader is None or tokens is None or tokens not in reader.all_input_nodes:
                    continue
                stream = block.output_node
                in_place = tokens.name == stream
                between = _descendants(order, stream) & _ancestors(order, tokens.name)
                # A stream restore takes the reader off the tokens (every restore here is one,
                # or none is: they all follow the method's rule).
                seen = users if not in_place else {k: set(v) for k, v in users.items()}
                seen[tokens.name].discard(reader.name)
                erased = set(_erase_unused(self.nodes, seen, tokens.name))

                exit_ = ExitRestore(
                    tokens=block.tokens,
                    prefix_tokens=block.prefix_tokens,
                    in_place=in_place,
                    between=self._by_tokens(between, block),
                    kept=self._by_tokens(between - erased, block),
                )
                found.append((block.index, exit_))
        return found

    def _by_tokens(self, names: set[str], block: Any) -> tuple[float, float]:
        """The MACs of nodes ``names`` after ``block``: of those on all its tokens, and of those
        on its patch tokens alone (their input's token axis has the prefix tokens split off)."""
        found = [0.0, 0.0]
        for name in names:
            macs = sum(self.counted.get(name, {}).values())
            if not macs:
                continue
            inputs = self.nodes[name].all_input_nodes
            shape = ops.shape(inputs[0]) if inputs else None
            patches = block.tokens - block.prefix_tokens
            alone = block.prefix_tokens > 0 and shape is not None and len(shape) == 3
            found[1 if alone and shape[1] == patches else 0] += macs
        return found[0], found[1]

    def _attention_map(
        self, order: list[fx.Node], block: Any, counted: dict[str, dict[Any, int]]
    ) -> set[str]:
        """The nodes from the attention logits to ``attn @ v``: they act on the (queries x keys)
        map (CaiT's talking heads mix its heads there), so they grow with queries x keys; and
        those on a table of (query, key) pairs (``_on_pair_tables``)."""
        found = self._on_pair_tables(order, block, counted)
        for core in [block.attention, *block.parallel_cores]:
            logits = self.nodes.get(core.logits_node or "")
            found_product = self._attention_value_product(core)
            if logits is None or found_product is None:
                continue
            product = found_product[0].name
            found |= (_descendants(order, logits.name) | {logits.name}) & _ancestors(order, product)
        return found

    def _on_pair_tables(
        self, order: list[fx.Node], block: Any, counted: dict[str, dict[Any, int]]
    ) -> set[str]:
        """The nodes computed from a position table of (query, key) pairs the block reads, up to
        the attention products they feed (ConViT's positional scores: a linear over each pair's
        relative position, before their softmax). A reduction gathers the table's rows and
        columns by the kept tokens (``compilation/rewrite.py``'s ``_gather_position_tables``,
        where the table meets the block), so they run on the kept tokens' pairs: they grow with
        queries x keys, not with the tokens."""
        found: set[str] = set()
        for use in block.position_uses:
            meeting = self.nodes.get(use.node)
            shape = ops.shape(meeting) if meeting is not None else None
            if meeting is None or shape is None:
                continue
            layout = use.gather_layout(len(shape), block.tokens, block.prefix_tokens)
            if isinstance(layout, str) or len(layout[0]) != 2:
                continue  # a table with one token axis follows the tokens: per token
            found.add(meeting.name)
            # The products (``attn @ v``, SDPA, which may be where the table meets the block)
            # read the map and give back tokens: what follows them is not on the pairs.
            reached = set() if _is_product(counted, meeting.name) else {meeting.name}
            for node in order:
                if node.name in reached or not any(n.name in reached for n in node.all_input_nodes):
                    continue
                found.add(node.name)
                if not _is_product(counted, node.name):
                    reached.add(node.name)
        return found

    def _on_grid(self, order: list[fx.Node], block: Any) -> set[str]:
        """The nodes between a grid op's reshape to the grid and its flatten back at the same
        resolution (CvT's BatchNorm after its query's conv): they run on the full grid, which a
        reduced stage gets back."""
        found: set[str] = set()
        for op in block.grid_ops:
            if op.from_grid_node is None or op.from_grid_node not in self.nodes:
                continue
            found |= _descendants(order, op.to_grid_node) & _ancestors(order, op.from_grid_node)
        return found

    def _restores(
        self, order: list[fx.Node], block: Any, counted: dict[str, dict[Any, int]], sides: _Sides
    ) -> list[Restore]:
        """What the rewrite does for each grid op of ``block`` once its stage is reduced
        (``compilation/rewrite.py``'s ``_restore_for``, in its order): where the method's rule
        restores the residual stream, the ops between the stream and the grid op's tokens run
        again on the full tokens (their copy), and those of the originals nothing reads any more
        are erased."""
        found = []
        for branch in ("attention", "mlp"):  # the rewrite's order
            stream = block.input_node if branch == "attention" else block.attn_add_node
            upstream = ops.ancestors(self.nodes[stream])
            users = {node.name: {u.name for u in node.users} for node in order}
            done: set[tuple[str, str]] = set()
            for op in block.grid_ops:
                reader, tokens = self.nodes.get(op.to_grid_node), self.nodes.get(op.tokens_node)
                if op.branch != branch or reader is None or tokens is None:
                    continue
                if (reader.name, tokens.name) in done or tokens not in reader.all_input_nodes:
                    continue  # restored already (CvT's q, k and v read one grid)
                done.add((reader.name, tokens.name))
                between = ops.ancestors(tokens) - upstream
                multiplies = any(ops.multiplies(self.module, node) for node in between)
                in_place = tokens.name == stream
                # A restore of the stream (no layer between) takes the reader off the tokens;
                # one in place leaves the reader on them.
                seen = (
                    users if not (multiplies or in_place) else {k: set(v) for k, v in users.items()}
                )
                seen[tokens.name].discard(reader.name)
                erased: dict[str, float] = dict.fromkeys(KINDS, 0.0)
                for name in _erase_unused(self.nodes, seen, tokens.name):
                    for aten_op, n in counted.get(name, {}).items():
                        erased[sides.kind(name, aten_op)] += n
                copied = _descendants(order, stream) & _ancestors(order, tokens.name)
                found.append(
                    Restore(
                        branch=branch,
                        multiplies=multiplies,
                        in_place=in_place,
                        copied=float(sum(sum(counted.get(n, {}).values()) for n in copied)),
                        erased=erased,
                    )
                )
        return found

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
        found = self._attention_value_product(core)
        if logits is None or found is None:
            return None
        operands = [a for a in logits.args if isinstance(a, fx.Node)]
        product, weights = found
        inputs = [a for a in product.args if isinstance(a, fx.Node)]
        value = next((a for a in inputs if a is not weights), None)
        if len(operands) != 2 or value is None:
            return None
        return operands[0], operands[1], value

    def _attention_value_product(self, core: Any) -> tuple[fx.Node, fx.Node] | None:
        """``attn @ v`` of a softmax core (the first product its softmax's output reaches,
        through dropout and the like) and its attention operand; ``None`` for SDPA."""
        node = self.nodes.get(core.node)
        if node is None or core.kind not in ("matmul_softmax", "einsum_softmax"):
            return None
        previous, current = None, node
        for _ in range(8):
            users = list(current.users)
            if len(users) != 1:
                return None
            previous, current = current, users[0]
            if any(name in str(current.target) for name in ("matmul", "bmm", "einsum")):
                return current, previous
        return None

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


def _is_product(counted: dict[str, dict[Any, int]], name: str) -> bool:
    """Whether node ``name`` runs an attention product (``PRODUCT_OPS``)."""
    return any(is_op(op, PRODUCT_OPS) for op in counted.get(name, {}))


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


def _erase_unused(nodes: dict[str, fx.Node], users: dict[str, set[str]], name: str) -> list[str]:
    """The nodes ``compilation/graph_edits.py``'s ``erase_unused`` erases from ``name`` up, on a
    record of each node's users (updated)."""
    erased: list[str] = []
    frontier = [name]
    while frontier:
        current = nodes[frontier.pop()]
        if current.name in erased or users[current.name]:
            continue
        if current.op in ("placeholder", "output", "get_attr") or current.is_impure():
            continue
        erased.append(current.name)
        for parent in current.all_input_nodes:
            users[parent.name].discard(current.name)
            frontier.append(parent.name)
    return erased


def tail_cost(model_map: ModelMap, graph: GraphProfile) -> tuple[int, float]:
    """The last block attending over its own tokens, and the MACs per token of what runs after
    it (cost.py's docstring); 0 where that does not depend on the tokens left."""
    own = [
        b.index
        for b in model_map.blocks
        if b.windows is None
        and b.attention.query_tokens in (None, b.tokens)
        and reduces_tokens(b)  # its keys its own or pooled from its grid (PVT's, CvT's)
    ]
    if not own:
        return -1, 0.0
    last = model_map.blocks[own[-1]]
    if last.readers or model_map.stages[last.stage].exit_grid_node is not None:
        # The compressed model gives every token back to what reads them (its output, a grid);
        # what runs before that is an ``ExitRestore``.
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
