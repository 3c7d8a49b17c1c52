"""Why a windowed block's attention cannot take fewer tokens per window: the checks, in order.

The first check that finds a reason gives the refusal the user sees (``attention_blocker``):
the order is part of the behaviour. A check that finds none passes to the next; a block no check
stops may have its windows reduced before the attention (a predictor). Each check names the
family that shaped it and why it is there."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch.fx as fx
from torch import Tensor

from vitcompress.analysis import ops
from vitcompress.analysis.cores import Ancestry
from vitcompress.analysis.model_map import AttentionCore, PositionUse
from vitcompress.analysis.positions import gather_layout
from vitcompress.analysis.query_bias import QueryBias
from vitcompress.analysis.window_map import QueryTermInput, SlotInput, SlotKind
from vitcompress.analysis.windows.sizes import (
    only_product_or_layout,
    spatial_reads,
)


def padded_blocker(order: Tensor) -> str | None:
    """Why the windows entering a padded block's attention cannot be reduced, or ``None``: the
    windows at the grid's edges hold fewer tokens than the others, so no one count kept per
    window leaves the windows' batch whole and the padding untouched (after the attention, the
    windows are regrouped by their token counts: ``Windows.groups``)."""
    if bool((order >= 0).all()):
        return None
    return (
        "its windows are padded (the grid does not divide into its windows), so they enter the "
        "attention with different numbers of tokens"
    )


def window_axis_blocker(windows_in: fx.Node, batch: int) -> str | None:
    """Why a predictor cannot hand the attention fewer tokens per window, or ``None``: windows
    laid out on an axis of their own, (B, windows, N, C), are read by the attention as such (its
    reshapes name the window count and size), not as a batch of windows."""
    shape = ops.shape(windows_in) or ()
    if not shape or shape[0] == batch:
        return None
    return (
        f"its windows enter it on an axis of their own, {tuple(shape)}, not as a batch of "
        f"{batch} windows"
    )


def spatial_shape_blocker(
    entering: fx.Node, core: fx.Node, anc: Ancestry, full: set[fx.Node]
) -> str | None:
    """Why the windows entering the attention cannot be handed over with fewer tokens, or
    ``None``. An attention that reads their spatial sizes (``B, H, W, C = x.shape``) takes the
    kept tokens as (B * windows, K, 1, C) instead. That is exact where it uses the sizes only as
    their product (``reshape(B, H * W, ...)``), and, after its softmax, to lay its output back
    out as its input was (``reshape(B, H, W, C)``). Any other use would treat K kept tokens as
    a K x 1 grid and is refused: a row read alone, or NesT's (B, T, N, C) read as windows T and
    tokens N, which a reshape before its softmax keeps apart. The uses in ``full`` read the
    sizes at the full window (``full_window_reads``)."""
    shape = ops.shape(entering) or ()
    reads = spatial_reads(entering)
    if not reads:
        return None
    axes = set(range(1, len(shape) - 1))
    if len(reads) == len(axes) and all(
        only_product_or_layout(read, reads, core, anc, full) for read in reads
    ):
        return None
    return (
        f"its attention reads the windows' spatial size off {entering.name} "
        f"({tuple(shape[1:-1])}) other than as their product, and fewer tokens per window have "
        "no such size"
    )


def term_makers(slot_inputs: tuple[SlotInput, ...]) -> set[str]:
    """The ops that make a term from the queries, of every such slot input."""
    return {
        name for slot in slot_inputs if isinstance(slot, QueryTermInput) for name in slot.makers
    }


def unexplained_mask_blocker(
    core: fx.Node,
    slot_inputs: tuple[SlotInput, ...],
    by_name: dict[str, fx.Node],
    made: set[fx.Node],
) -> str | None:
    """Why the attention cannot run on fewer or reordered tokens per window because of a term it
    adds to its logits that nothing found by window slot explains, or ``None``. SAM's decomposed
    relative position is such a term: a bias made from the queries and two tables indexed by
    row and column offsets, laid out by where each query and key sits in its window, which a
    reduction would silently shuffle. Any parameter or buffer the mask is built from, other than
    through the queries, keys and values, must be one a slot input (``slots.py``) is built from,
    or make a term from the queries by window position (``made``: see ``query_bias.py``)."""
    if not ops.is_sdpa(core):
        return None
    mask = core.args[3] if len(core.args) > 3 else core.kwargs.get("attn_mask")
    if not isinstance(mask, fx.Node):
        return None
    explained = set(made)
    for slot in slot_inputs:
        source = by_name.get(slot.source) if slot.kind is not SlotKind.FULL_SIZE_READ else None
        if source is not None:
            explained |= ops.ancestors(source)
    # Not what reaches the mask through the queries, keys or values: that is everything
    # upstream (a position embedding, earlier blocks' tables).
    for operand in core.args[:3]:
        if isinstance(operand, fx.Node):
            explained |= ops.ancestors(operand)
    unexplained = sorted(
        str(n.target) for n in ops.ancestors(mask) if n.op == "get_attr" and n not in explained
    )
    if not unexplained:
        return None
    return (
        f"its attention adds to its logits a term made from {unexplained[0]} that no table laid "
        "out by token position explains (it may depend on where each token sits in its window)"
    )


def tables_blocker(
    tables: list[PositionUse],
    by_name: dict[str, fx.Node],
    batch: int,
    count: int,
    in_terms: Collection[str] = frozenset(),
) -> str | None:
    """Why a window's attention cannot run on its kept tokens, or ``None``: every table it reads
    by position must be an attention bias on the logits, batched as the windows are, either
    (B * windows, heads, N, N) or viewed (B, windows, heads, N, N), so that each window's rows
    and columns can be gathered by its own kept positions (``modules/windows.py``). A table read
    by an op in ``in_terms`` (one making a term from the queries, made at the full window) is
    that term's."""
    for use in tables:
        if use.node in in_terms:
            continue
        shape = ops.shape(by_name[use.node]) or ()
        if use.kind != "attention bias":
            return f"the {use.kind} {use.table} meets its {use.path} elsewhere than the logits"
        blocker = use.blocker
        if blocker is not None and len(use.shape) == 4 and use.shape[0] == batch:
            # Batched as the windows are (HF Swin adds its shift mask to the table first): it
            # is gathered per window, not per image.
            layout = gather_layout((1, *use.shape[1:]), 4, use.kind, use.shape[-1], 0)
            blocker = layout if isinstance(layout, str) else None
        if blocker is not None:
            return f"the table {use.table} at {use.path}: {blocker}"
        if len(shape) == 4 and shape[0] in (1, batch):
            continue
        if len(shape) == 5 and shape[1] == count and shape[0] * count == batch:
            continue
        return (
            f"the table {use.table} at {use.path} meets logits of shape {tuple(shape)}, not "
            f"batched as {count} windows per image"
        )
    return None


@dataclass(frozen=True)
class WindowFacts:
    """What the window analysis found about one windowed block's attention, as the checks read
    it."""

    core: AttentionCore
    core_node: fx.Node
    windows_in: fx.Node  # the tokens entering the query projection, laid out as windows
    entering: fx.Node  # where a predictor would reduce them
    order: Tensor  # the token each window slot holds (-1: padding)
    count: int  # windows per image
    window_axis: bool  # the windows on an axis of their own all the way (NesT's)
    query_bias: QueryBias | str | None  # a term from the queries by window position, or why not
    query_blocker: str | None  # why the queries cannot be reduced (GCViT's global query)
    tables: list[PositionUse]
    made: set[fx.Node]  # the ops that make a term from the queries by window position
    full: set[fx.Node]  # the size reads that see the full window
    anc: Ancestry
    global_query: fx.Node | None = None  # GCViT's, as its logits take it
    # What the attention reads by window slot, as the finders (``slots.SLOT_FINDERS``) found it.
    slot_inputs: tuple[SlotInput, ...] = ()

    @property
    def by_name(self) -> dict[str, fx.Node]:
        return self.anc.by_name


@dataclass(frozen=True)
class AttentionCheck:
    """One reason a window attention cannot take fewer tokens per window: the family whose
    model shaped it, why it holds, and the check itself (a reason, or ``None``)."""

    name: str
    family: str
    why: str
    check: Callable[[WindowFacts], str | None]


def _spatial_shape(f: WindowFacts) -> str | None:
    if f.window_axis:
        return None
    return spatial_shape_blocker(f.entering, f.core_node, f.anc, f.full)


# In order: the first reason found is the one the user sees.
ATTENTION_CHECKS: tuple[AttentionCheck, ...] = (
    AttentionCheck(
        "global query",
        "GCViT",
        "the queries come from a global token generator, not from the window tokens",
        lambda f: f.query_blocker,
    ),
    AttentionCheck(
        "padded windows",
        "Swin, DaViT, TinyViT at a size their windows do not divide",
        "windows at the grid's edges hold fewer tokens: no one count per window fits them all",
        lambda f: padded_blocker(f.order),
    ),
    AttentionCheck(
        "windows on their own axis",
        "NesT",
        "(B, windows, N, C) windows that the attention does not read as a batch of windows",
        lambda f: None if f.window_axis else window_axis_blocker(f.windows_in, f.core.batch),
    ),
    AttentionCheck(
        "query term",
        "SAM, MViTv2",
        "a term made from the queries by window position that cannot follow the kept tokens",
        lambda f: f.query_bias if isinstance(f.query_bias, str) else None,
    ),
    AttentionCheck(
        "spatial sizes",
        "SAM2-Hiera, VOLO, NesT",
        "the attention reads the windows' spatial sizes other than as their product",
        _spatial_shape,
    ),
    AttentionCheck(
        "position tables",
        "Swin (relative-position bias, shift mask)",
        "a table read by position that is not an attention bias batched as the windows are",
        lambda f: tables_blocker(
            f.tables, f.by_name, f.core.batch, f.count, term_makers(f.slot_inputs)
        ),
    ),
    AttentionCheck(
        "unexplained mask",
        "SAM (decomposed relative position)",
        "a term added to the logits that no table laid out by token position explains",
        lambda f: unexplained_mask_blocker(f.core_node, f.slot_inputs, f.by_name, f.made),
    ),
)


def attention_blocker(facts: WindowFacts) -> str | None:
    """The first reason (``ATTENTION_CHECKS``, in order) why the windows entering the attention
    cannot be reduced, or ``None``: then a predictor may reduce them before it."""
    for check in ATTENTION_CHECKS:
        reason = check.check(facts)
        if reason is not None:
            return reason
    return None
