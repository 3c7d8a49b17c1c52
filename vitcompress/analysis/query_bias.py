"""A term an attention within windows adds to its logits, made row by row from its queries and
tables indexed by where each query and key sits in the window: SAM's (and MViTv2's) decomposed
relative position, ``q @ Rh[h_i - h_j] + q @ Rw[w_i - w_j]`` added through SDPA's mask.

No table laid out by token position explains such a term, so it cannot be gathered like Swin's
bias. It can be made at the full window instead: row ``i`` of the term depends on query ``i``
alone, so the kept queries put back in their slots (zeros elsewhere) give the kept rows exactly,
and the kept columns of those rows are gathered (``modules/windows.WindowQueryScatter``,
``WindowTableGather``). That row-by-row dependence is not assumed from the ops: the ops that
make the term are run once on random queries and again with about half the rows changed, and
every unchanged row must come out unchanged.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from vitcompress.analysis import ops

_FOLDS = ("unflatten", "view", "reshape")


@dataclass(frozen=True)
class QueryBias:
    """A term made from the queries that can be made at the full window: the map records it
    as a ``QueryTermInput`` (``window_map.py``)."""

    tables: tuple[str, ...]  # the parameters it is made from
    query_node: str  # the queries it is made from, (B * windows [* heads], N, D)
    mask_node: str  # the term as it meets the attention
    nodes: tuple[str, ...]  # the ops that make it


def sdpa_mask(core: fx.Node) -> fx.Node | None:
    """The mask an SDPA core adds to its logits, or ``None``."""
    if not ops.is_sdpa(core):
        return None
    mask = core.args[3] if len(core.args) > 3 else core.kwargs.get("attn_mask")
    return mask if isinstance(mask, fx.Node) else None


def _queries(core: fx.Node) -> set[fx.Node]:
    """The core's query operand and, where the capture unfolded its heads
    (``attention_layouts``: ``unflatten`` of (B * windows * heads, N, D)), the folded one."""
    query = core.args[0]
    found = {query}
    if query.op == "call_method" and query.target in _FOLDS and isinstance(query.args[0], fx.Node):
        found.add(query.args[0])
    return found


def find_query_bias(
    gm: fx.GraphModule, core: fx.Node, entering: fx.Node, tokens: int, image_batch: int
) -> QueryBias | str | None:
    """The query-made term the core adds to its logits, why it is not one that can be made at
    the full window (a string), or ``None`` when the core adds no term made from its queries.

    ``entering`` is the windows as the attention takes them, ``tokens`` the tokens per window,
    ``image_batch`` the example's images.
    The term's ops are the mask's ancestors that are not ancestors of the queries, keys or
    values; they may read the queries, parameters, and sizes off ``entering`` (read at the full
    window when the windows enter reduced), nothing else."""
    mask = sdpa_mask(core)
    if mask is None:
        return None
    upstream: set[fx.Node] = set()
    for operand in core.args[:3]:
        if isinstance(operand, fx.Node):
            upstream |= ops.ancestors(operand)
    made = ops.ancestors(mask) - upstream
    queries = _queries(core)
    inputs = {parent for node in made for parent in node.all_input_nodes} - made
    source = [node for node in inputs if node in queries]
    if not source:
        return None  # not made from the queries: a table, or nothing
    shape = ops.shape(entering) or ()
    sizes: dict[fx.Node, int] = {}
    for node in sorted(inputs - set(source), key=lambda n: n.name):  # one line, every run
        axis = ops.shape_read(node, entering)
        if axis is not None and -len(shape) <= axis < len(shape):
            sizes[node] = int(shape[axis])
        else:
            return f"its attention adds to its logits a term made from its queries and {node.name}"
    if len(source) > 1:
        return "its attention adds to its logits a term made from its queries in two layouts"
    query = source[0]
    mask_shape = ops.shape(mask) or ()
    if len(mask_shape) not in (4, 5):
        return (
            f"its attention adds to its logits a term made from its queries laid out "
            f"{tuple(mask_shape)}, not per window and head"
        )
    tables = tuple(sorted(str(n.target) for n in made if n.op == "get_attr"))
    order = [node for node in gm.graph.nodes if node in made]
    probe = ops.shape(query)
    reads_batch = any(ops.shape_read(node, entering) in (0, -len(shape)) for node in sizes)
    if probe and not reads_batch and probe[0] % image_batch == 0:
        probe = (probe[0] // image_batch, *probe[1:])  # one image's windows: less memory
    try:
        blocker = _row_by_row_blocker(gm, order, query, probe, sizes, mask, tokens)
    except Exception as error:  # noqa: BLE001 - any failure to run it apart is a refusal
        blocker = f"could not be run apart from the model ({type(error).__name__})"
    if blocker is not None:
        return f"its attention adds to its logits a term made from its queries that {blocker}"
    return QueryBias(
        tables=tables,
        query_node=query.name,
        mask_node=mask.name,
        nodes=tuple(node.name for node in order),
    )


def _row_by_row_blocker(
    gm: fx.GraphModule,
    order: list[fx.Node],
    query: fx.Node,
    shape: tuple | None,
    sizes: dict[fx.Node, int],
    mask: fx.Node,
    tokens: int,
) -> str | None:
    """Why the term is not made row by row from the queries, each row ``i`` from query ``i``
    alone, or ``None``: the term's ops run on random queries, then with a random half of every
    window's rows changed, then with the other half; each time the unchanged rows must give
    unchanged rows (so every row is checked), and the changed ones must not all do. ``shape`` is the queries' (their batch may be cut to one image's)."""
    if shape is None or len(shape) < 2 or shape[-2] != tokens:
        return f"are not laid out with the window's {tokens} tokens next to last"
    parameter = next(iter(gm.parameters()), None)
    dtype = parameter.dtype if parameter is not None else torch.float32
    device = parameter.device if parameter is not None else None
    generator = torch.Generator().manual_seed(0)

    def draw(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=generator, dtype=dtype).to(device)

    # The tables drawn at random too: SAM's start at zero, which would hide any dependence.
    graph = fx.Graph()
    env: dict[fx.Node, object] = {query: graph.placeholder("queries")}
    env.update(sizes)
    tables: list[torch.Tensor] = []
    for node in order:
        value = operator.attrgetter(str(node.target))(gm) if node.op == "get_attr" else None
        if torch.is_tensor(value) and value.is_floating_point():
            env[node] = graph.placeholder(f"table{len(tables)}")
            tables.append(draw(*value.shape))
        else:
            env[node] = graph.node_copy(node, lambda arg: env[arg])
    graph.output(env[mask])
    term = fx.GraphModule(gm, graph)
    first = draw(*shape)
    rows = first.reshape(-1, tokens, shape[-1])
    half = (torch.rand(rows.shape[:2], generator=generator) < 0.5).to(device)
    with torch.no_grad():
        before = term(first, *tables)
    if before.shape[-2:] != (tokens, tokens) or before.numel() != rows.shape[0] * tokens**2:
        return (
            f"is not one (N, N) term per window and head ({tuple(before.shape)} against "
            f"queries {tuple(shape)})"
        )
    scale = before.abs().amax().clamp_min(1e-30)
    follows = False
    # Each half changed in turn, so that every row is checked unchanged once.
    for changed in (half, ~half):
        second = rows.clone()
        second[changed] = draw(int(changed.sum()), shape[-1])
        with torch.no_grad():
            after = term(second.reshape(shape), *tables)
        moved = (before - after).reshape(rows.shape[0], tokens, tokens).abs().amax(-1)
        if bool((moved[~changed] > 1e-6 * scale).any()):
            return "mixes queries of different tokens (a row changes with another token's query)"
        follows = follows or bool((moved[changed] > 1e-6 * scale).any())
    return None if follows else "does not change with them"
