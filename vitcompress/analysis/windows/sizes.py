"""How a window attention reads its windows' sizes (``B, H, W, C = x.shape``), which of those
reads see the full window, and GCViT's global query (made without the window tokens)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from vitcompress.analysis import ops
from vitcompress.analysis.cores import Ancestry
from vitcompress.analysis.model_map import AttentionCore


def spatial_reads(entering: fx.Node) -> list[fx.Node]:
    """The reads of the windows' spatial sizes off their shape (``B, H, W, C = x.shape``,
    SAM2-Hiera's and VOLO's attention) that something uses, in axis order."""
    shape = ops.shape(entering) or ()
    if len(shape) <= 3:
        return []
    reads: dict[int, fx.Node] = {}
    for user in entering.users:
        if user.op != "call_function" or user.target is not getattr or user.args[1:] != ("shape",):
            continue
        for read in user.users:
            index = read.args[1] if len(read.args) > 1 else None
            if read.users and isinstance(index, int) and 0 < index % len(shape) < len(shape) - 1:
                reads.setdefault(index % len(shape), read)
    return [reads[axis] for axis in sorted(reads)]


def size_reads(entering: fx.Node) -> list[fx.Node]:
    """The reads of the windows' spatial sizes, or of their token count where they enter as
    (B * windows, N, C)."""
    reads = spatial_reads(entering)
    if reads or len(ops.shape(entering) or ()) != 3:
        return reads
    return [
        read
        for shape in entering.users
        for read in shape.users
        if ops.shape_read(read, entering) in (1, -2)
    ]


def full_window_reads(
    reads: list[fx.Node], made: set[fx.Node], back: fx.Node, anc: Ancestry
) -> set[fx.Node]:
    """The uses of the windows' spatial sizes that read them at the full window when the
    windows enter the attention reduced: the ops making a term from the queries by window
    position (``made``), guards on the sizes (the capture's checks that the input is the size
    it was captured at), and anything after the attention's output ``back``, which sees every
    token again."""
    return {
        user
        for read in reads
        for user in read.users
        if user in made or _only_guards(user) or anc.is_ancestor(back, user)
    }


def _only_guards(node: fx.Node) -> bool:
    """Whether ``node`` leads to nothing but ``torch._assert`` calls, through no tensor."""
    return not any(
        current.meta.get("is_tensor")
        or (
            not current.users
            and not (current.op == "call_function" and current.target is torch._assert)
        )
        for current in ops.reachable(node, lambda n: n.users)
    )


def _product_factors(node: object, reads: list[fx.Node]) -> list[fx.Node] | None:
    """The spatial reads a product of them multiplies (``H * W``, ``T * H * W``), or ``None``
    when ``node`` is anything else."""
    if isinstance(node, fx.Node) and node in reads:
        return [node]
    if not (
        isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.mul
    ):
        return None
    left, right = (_product_factors(arg, reads) for arg in node.args)
    return None if left is None or right is None else left + right


def only_product_or_layout(
    read: fx.Node,
    reads: list[fx.Node],
    core: fx.Node,
    anc: Ancestry,
    full: set[fx.Node],
) -> bool:
    """Whether every use of one spatial read is the product of all of them, or a reshape after
    the attention core that lays a token axis out as the window's grid: the spatial sizes side
    by side in their order (``reshape(B, H, W, C)`` as the windows came in, HF SAM's
    ``view(B, heads, H, W, -1)``), so that K kept tokens are laid out K x 1; the uses in
    ``full`` aside."""
    for user in read.users:
        if user in full:
            continue
        if user.op == "call_method" and user.target in ("reshape", "view"):
            args = list(user.args[1:])
            if len(args) == 1 and isinstance(args[0], (list, tuple)):
                args = list(args[0])
            at = args.index(reads[0]) if reads[0] in args else -1
            side_by_side = at >= 0 and args[at : at + len(reads)] == reads
            others = [a for i, a in enumerate(args) if not at <= i < at + len(reads)]
            if not side_by_side or any(a in reads for a in others):
                return False
            if not anc.is_ancestor(core, user):
                return False
            continue
        product = user
        while True:
            factors = _product_factors(product, reads)
            if factors is None:
                return False
            if sorted(factors, key=reads.index) == reads and len(factors) == len(reads):
                break
            if len(product.users) != 1:
                return False
            product = next(iter(product.users))
    return True


def global_query(
    core: AttentionCore, by_name: dict[str, fx.Node], entering: fx.Node
) -> fx.Node | None:
    """GCViT's global query as its attention's logits take it, (B * windows, heads, N, D), or
    ``None`` where it is not one: made without the window tokens, its rows by window slot (the
    attention's output rows, which go back to the slots: ``check_return``). With fewer tokens
    per window its rows are gathered by the kept slots; the ops making it read the window's
    token count at the full window."""
    node = by_name[core.node]
    logits = by_name.get(core.logits_node or "") if not ops.is_sdpa(node) else node
    if logits is None or not logits.args or not isinstance(logits.args[0], fx.Node):
        return None
    query = logits.args[0]
    shape = ops.shape(query) or ()
    if _reads_values_of(query, entering) or len(shape) != 4:
        return None
    if shape[0] != core.batch or shape[2] != core.query_tokens:
        return None
    return query


def _reads_values_of(node: fx.Node, source: fx.Node) -> bool:
    """Whether ``node`` depends on ``source``'s values, not on its shape alone."""

    def values_read(current: fx.Node) -> list[fx.Node]:
        if current.op == "call_function" and current.target is getattr:
            return []  # x.shape: the sizes, not the values
        return current.all_input_nodes

    return any(current is source for current in ops.reachable(node, values_read))


def query_path(query: fx.Node, core: AttentionCore, by_name: dict[str, fx.Node]) -> set[fx.Node]:
    """The ops that make a global query and not the keys."""
    node = by_name[core.node]
    logits = node if ops.is_sdpa(node) else by_name[core.logits_node]
    keys = logits.args[1]
    return ops.ancestors(query) - (ops.ancestors(keys) if isinstance(keys, fx.Node) else set())
