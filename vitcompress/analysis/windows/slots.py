"""What a window attention reads laid out by window slot: the finders, one per family's way of
reading, in order.

Each finder names the family whose model shaped it and why it is there, and turns what the window
analysis found (``WindowFacts``) into the map's slot inputs (``window_map.SlotInput``): a table on
the logits, a query's rows, a term made from the queries, an op that reads the window's sizes.
The rewrite makes each kind follow the kept slots (one handler per kind), so a new family's way
of reading something by window slot is one entry here. A slot input also explains the mask it
is built into (the ``unexplained mask`` check)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx

from vitcompress.analysis import ops
from vitcompress.analysis.query_bias import QueryBias
from vitcompress.analysis.window_map import (
    FullSizeReadInput,
    QueryRowsInput,
    QueryTermInput,
    SlotInput,
    TableInput,
)
from vitcompress.analysis.windows.checks import WindowFacts, term_makers


@dataclass(frozen=True)
class SlotFinder:
    """One way a window attention reads something by window slot: the family whose model shaped
    it, why it is there, and the finder itself (the slot inputs it finds, none where it does not
    apply)."""

    name: str
    family: str
    why: str
    find: Callable[[WindowFacts], list[SlotInput]]


def last_two_dims(node: fx.Node | None) -> tuple[int, ...]:
    """The (queries, keys) dims of logits, or of a term or table as logits take it: the last two
    of ``node``'s rank (none where its shape is not known)."""
    rank = len(ops.shape(node) or ()) if node is not None else 0
    return (rank - 2, rank - 1) if rank >= 2 else ()


def _position_tables(f: WindowFacts) -> list[SlotInput]:
    return [
        TableInput(
            what=use.table,
            gather_dims=last_two_dims(f.by_name.get(use.node)),
            reader=use.node,
            source=use.table_node,
        )
        for use in f.tables
    ]


def _query_term(f: WindowFacts) -> list[SlotInput]:
    if not isinstance(f.query_bias, QueryBias):
        return []
    bias = f.query_bias
    return [
        QueryTermInput(
            what=", ".join(bias.tables),
            gather_dims=last_two_dims(f.by_name.get(bias.mask_node)),
            reader=f.core_node.name,
            source=bias.mask_node,
            queries=bias.query_node,
            makers=bias.nodes,
        )
    ]


def _global_query(f: WindowFacts) -> list[SlotInput]:
    if f.global_query is None:
        return []
    rank = len(ops.shape(f.global_query) or ())
    return [
        QueryRowsInput(
            what="global query",
            gather_dims=(rank - 2,),  # (B * windows, heads, N, D): its rows
            reader=f.core_node.name if ops.is_sdpa(f.core_node) else str(f.core.logits_node),
            source=f.global_query.name,
        )
    ]


def _full_size_reads(f: WindowFacts) -> list[SlotInput]:
    return [
        FullSizeReadInput(
            what=describe(node), gather_dims=(), reader=node.name, source=f.entering.name
        )
        for node in sorted(f.full, key=lambda n: n.name)
    ]


def describe(node: fx.Node) -> str:
    """An op in words, without its node name: ``call_method reshape``."""
    target = getattr(node.target, "__name__", node.target)
    return f"{node.op} {target}"


# In the order the map lists what they find.
SLOT_FINDERS: tuple[SlotFinder, ...] = (
    SlotFinder(
        "position tables",
        "Swin (relative-position bias, shift mask)",
        "a table added to the logits by window position: its rows and columns follow the kept "
        "slots",
        _position_tables,
    ),
    SlotFinder(
        "query term",
        "SAM, MViTv2 (decomposed relative position)",
        "a term made row by row from the queries by window position: made at the full window "
        "from the kept queries in their slots",
        _query_term,
    ),
    SlotFinder(
        "global query",
        "GCViT",
        "queries made without the window tokens, their rows by window slot: the kept slots' rows",
        _global_query,
    ),
    SlotFinder(
        "full-window size reads",
        "SAM, GCViT, captures that guard on their input's size",
        "ops that read the window's sizes where they must see the full window (what makes a term "
        "from the queries, guards, a layout of the restored output)",
        _full_size_reads,
    ),
)


def find_slot_inputs(facts: WindowFacts) -> tuple[SlotInput, ...]:
    """Everything the attention reads by window slot, each finder's in ``SLOT_FINDERS``'
    order. A table read by an op that makes a term from the queries is that term's (made at the
    full window, it follows the kept slots as a whole), not a table of its own."""
    found = [slot for finder in SLOT_FINDERS for slot in finder.find(facts)]
    in_terms = term_makers(found)
    return tuple(
        slot for slot in found if not (isinstance(slot, TableInput) and slot.reader in in_terms)
    )
