"""The model map's record of a windowed block (``Windows``) and of what its attention reads by
window slot (``SlotInput``): plain data the window analysis (``windows/``) fills in and the
rewrite (``compilation/windows.py``) reads.

Node names are handles into one captured graph, written nowhere (``records.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from vitcompress.analysis.records import (
    graph_node,
    graph_nodes,
    record_from_json,
    record_to_json,
)


class WindowLayout(Enum):
    """How the windows enter their attention, which says how a predictor hands it each window's
    kept tokens."""

    BATCH = "batch"  # (B * count, tokens, C): handed (B * count, K, C)
    WINDOW_AXIS = "window_axis"  # (B, count, tokens, C) (NesT's): handed (B, count, K, C)
    # (B * count, h, w, C), read as ``B, H, W, C = x.shape`` and used only as H * W (SAM's,
    # VOLO's, MaxViT's): handed (B * count, K, 1, C).
    SPATIAL = "spatial"


class SlotKind(Enum):
    """What a window attention reads laid out by window slot: how the rewrite makes it follow
    each window's kept tokens (``compilation/windows.py`` keeps one handler per kind)."""

    TABLE = "table"  # a tensor added to the logits by slot: its rows and columns gathered
    QUERY_ROWS = "query_rows"  # queries made without the window tokens: their rows gathered
    QUERY_TERM = "query_term"  # a term made from the queries: made at the full window, gathered
    FULL_SIZE_READ = "full_size_read"  # an op reading the window's sizes: it reads the full ones


@dataclass(frozen=True)
class SlotInput:
    """One thing a window attention reads by window slot. ``gather_dims`` are the dims of
    ``source`` laid out by slot, counted from its first (none for a size read); ``reader`` is
    the op that reads ``source``. The subclass says the kind."""

    kind: ClassVar[SlotKind]
    what: str  # in words: the table's parameter, the term's tables, the op reading sizes
    gather_dims: tuple[int, ...]
    reader: str = graph_node()
    source: str = graph_node()

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, **record_to_json(self)}

    @staticmethod
    def from_json(data: dict[str, Any]) -> SlotInput:
        return record_from_json(SLOT_INPUT_TYPES[SlotKind(data["kind"])], data)


@dataclass(frozen=True)
class TableInput(SlotInput):
    """A tensor the attention adds to its logits by window slot (Swin's relative-position bias,
    its shifted windows' mask), ``source`` as ``reader`` (the add, or the core) takes it."""

    kind: ClassVar[SlotKind] = SlotKind.TABLE


@dataclass(frozen=True)
class QueryRowsInput(SlotInput):
    """Queries made without the window tokens (GCViT's global query), ``source`` as the logits
    (``reader``) take them, (B * windows, heads, N, D): their rows by window slot."""

    kind: ClassVar[SlotKind] = SlotKind.QUERY_ROWS


@dataclass(frozen=True)
class QueryTermInput(SlotInput):
    """A term the attention (``reader``, its core) adds to its logits, made row by row from the
    queries (``queries``) and tables by where each query and key sits in the window (SAM's
    decomposed relative position, MViTv2's): made at the full window from the kept queries put
    back in their slots (by the ops ``makers``), then ``source``, the term as it meets the core,
    gathered by the kept slots."""

    kind: ClassVar[SlotKind] = SlotKind.QUERY_TERM
    queries: str = graph_node()
    makers: tuple[str, ...] = graph_nodes()


@dataclass(frozen=True)
class FullSizeReadInput(SlotInput):
    """An op (``reader``) that reads the windows' sizes and must read them at the full window
    when the windows enter reduced: what makes a term from the queries, guards on the sizes, a
    layout of the restored output. ``source`` is the windows as they come."""

    kind: ClassVar[SlotKind] = SlotKind.FULL_SIZE_READ


SLOT_INPUT_TYPES: dict[SlotKind, type[SlotInput]] = {
    SlotKind.TABLE: TableInput,
    SlotKind.QUERY_ROWS: QueryRowsInput,
    SlotKind.QUERY_TERM: QueryTermInput,
    SlotKind.FULL_SIZE_READ: FullSizeReadInput,
}


@dataclass(frozen=True)
class ReducedAttention:
    """The window attention can run on each window's kept tokens: a predictor reduces the
    windows between ``input_node`` (the windows as the attention takes them, laid out as
    ``layout`` says) and ``output_node`` (its output there), and everything it reads by window
    slot (``slot_inputs``) follows the kept slots."""

    layout: WindowLayout
    slot_inputs: tuple[SlotInput, ...] = ()
    input_node: str = graph_node()
    output_node: str = graph_node()

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": self.layout.value,
            "slot_inputs": [slot.to_json() for slot in self.slot_inputs],
        }


@dataclass(frozen=True)
class WholeAttention:
    """The window attention cannot take fewer tokens per window (``reason``, the line the user
    sees): it runs on every token, and a predictor chooses on the MLP's input instead."""

    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"runs_whole": self.reason}


WindowAttention = ReducedAttention | WholeAttention


def window_attention_from_json(data: dict[str, Any]) -> WindowAttention:
    if "runs_whole" in data:
        return WholeAttention(data["runs_whole"])
    return ReducedAttention(
        layout=WindowLayout(data["layout"]),
        slot_inputs=tuple(SlotInput.from_json(slot) for slot in data["slot_inputs"]),
    )


@dataclass
class Windows:
    """A block whose attention runs within windows (``windows/``): a reduction keeps the same
    number of tokens in each window, and the block gives every token back before its output."""

    count: int  # windows per image
    tokens: int  # tokens per window
    # For each window slot (windows one after another), the index of the token it holds among
    # the block's MLP input tokens, -1 for a padded slot; a shifted window's order differs from
    # a plain partition's.
    order: tuple[int, ...]
    # Whether a predictor may hand the attention each window's kept tokens, and how; or why not.
    attention: WindowAttention
    mlp_input_node: str = graph_node()  # the (B, L, C) tokens entering the block's MLP residual
    # A factorised attention's block (TimeSformer's, one window over its tokens): its attention
    # scores the tokens in another order (frame by frame, a class token leading each frame).
    # For each of the window's tokens after its prefix, the slot of its score among the scoring
    # attention's, the windows' prefix slots left out, windows one after another.
    score_slots: tuple[int, ...] | None = None
    # Prefix tokens (a class token) leading the window, never reduced: only one window over all
    # of a block's tokens holds them (MViTv2 with a class token, TimeSformer).
    prefix_tokens: int = 0

    @property
    def padded(self) -> bool:
        """Whether the grid does not divide into the windows (some slots hold padding)."""
        return any(index < 0 for index in self.order)

    @property
    def attention_reducible(self) -> bool:
        """Whether a predictor may hand the attention each window's kept tokens."""
        return isinstance(self.attention, ReducedAttention)

    def groups(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """The windows grouped by how many tokens they hold: for each group (fullest first),
        ``(slots, tokens)``, its windows' real slots and the tokens they hold, windows one after
        another. Unpadded windows are one group: every slot, in :attr:`order`. A reduction after
        the attention reduces each group alike, so each keeps a static shape and no padding is
        touched."""
        by_count: dict[int, tuple[list[int], list[int]]] = {}
        for window in range(self.count):
            start = window * self.tokens
            slots = [start + s for s in range(self.tokens) if self.order[start + s] >= 0]
            group = by_count.setdefault(len(slots), ([], []))
            group[0].extend(slots)
            group[1].extend(self.order[slot] for slot in slots)
        return [
            (tuple(slots), tuple(tokens))
            for _, (slots, tokens) in sorted(by_count.items(), reverse=True)
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "tokens": self.tokens,
            "order": list(self.order),
            "attention": self.attention.to_json(),
            **({"score_slots": list(self.score_slots)} if self.score_slots is not None else {}),
            **({"prefix_tokens": self.prefix_tokens} if self.prefix_tokens else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Windows:
        return cls(
            count=data["count"],
            tokens=data["tokens"],
            order=tuple(data["order"]),
            attention=window_attention_from_json(data["attention"]),
            score_slots=tuple(data["score_slots"]) if "score_slots" in data else None,
            prefix_tokens=int(data.get("prefix_tokens", 0)),
        )
