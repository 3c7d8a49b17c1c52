"""Tokens into their attention's windows and back, for a reduction within windows
(``analysis/windows.py`` finds each block's window order)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vitcompress.errors import UserError
from vitcompress.method import replay
from vitcompress.method.restore import MaskedRemoval, Removal


class WindowLayoutError(UserError):
    """Tokens of another count than the windows were laid out for: the input is not of the
    size the model was compressed at (one line)."""


class WindowPartition(nn.Module):
    """(B, L, C) tokens -> (B * windows, tokens per window, C), window slot ``s`` of an image
    holding its token ``order[s]``: the windows the block's attention used."""

    def __init__(self, order: tuple[int, ...], windows: int, grid: int | None = None) -> None:
        super().__init__()
        self.windows = windows
        # The tokens per image it is given: all of them in ``order``, unless the windows are
        # padded and this partition takes one group of them.
        self.grid = len(order) if grid is None else grid
        # Not state: a saved model is rewritten again on load, which recomputes the order.
        self.register_buffer("order", torch.tensor(order, dtype=torch.long), persistent=False)

    def extra_repr(self) -> str:
        return f"windows={self.windows}, tokens={self.order.numel()} of {self.grid}"

    def forward(self, x: Tensor) -> Tensor:
        batch, channels = x.shape[0], x.shape[-1]
        # The order is the captured grid's: another grid would have some of its tokens picked
        # into the wrong windows (more tokens) or fail to index (fewer), so it is refused.
        if (tokens := x.shape[1:-1].numel()) != self.grid:
            raise WindowLayoutError(
                f"the windows were laid out for {self.grid} tokens per image, the size "
                f"the model was compressed at, and this input gives {tokens}: compress the "
                "model at this input size (input_size=(C, H, W), --input-size)"
            )
        windows = x.reshape(batch, -1, channels).index_select(1, self.order)
        return windows.reshape(batch * self.windows, -1, channels)


class WindowMerge(nn.Module):
    """The inverse of :class:`WindowPartition`: (B * windows, tokens per window, C) -> (B, L, C),
    every token back at its index."""

    def __init__(self, order: tuple[int, ...], windows: int) -> None:
        super().__init__()
        self.windows = windows
        order_t = torch.tensor(order, dtype=torch.long)
        inverse = torch.empty_like(order_t)
        inverse[order_t] = torch.arange(order_t.numel())
        self.register_buffer("inverse", inverse, persistent=False)

    def extra_repr(self) -> str:
        return f"windows={self.windows}, tokens={self.inverse.numel()}"

    def forward(self, windows: Tensor, like: Tensor | None = None) -> Tensor:
        """``like``: the block's tokens as they entered (a (B, H, W, C) grid): their layout."""
        channels = windows.shape[-1]
        tokens = windows.reshape(-1, self.inverse.numel(), channels)
        tokens = tokens.index_select(1, self.inverse)
        return tokens if like is None else tokens.reshape(like.shape)


class WindowScoreSlots(nn.Module):
    """A factorised attention's scores, (B * windows, patch slots per window), to its block's
    order, (B, patch tokens): token ``j``'s score is slot ``slots[j]`` of its image's windows one
    after another (``Windows.score_slots``)."""

    def __init__(self, slots: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("slots", torch.tensor(slots, dtype=torch.long), persistent=False)

    def extra_repr(self) -> str:
        return f"tokens={self.slots.numel()}"

    def forward(self, scores: Tensor) -> Tensor:
        per_image = scores.reshape(-1, self.slots.numel(), *scores.shape[2:])
        return per_image.index_select(1, self.slots)


class WindowSlots(nn.Module):
    """What the attention gives per window slot, (B * windows, N, ...) (a score, a key), for
    the slots of one group of windows (``Windows.groups``: padded windows regrouped by their
    token counts): (B * group windows, tokens per group window, ...), as ``WindowPartition``
    lays out the group's tokens."""

    def __init__(self, slots: tuple[int, ...], total: int, windows: int) -> None:
        super().__init__()
        self.total = total  # slots per image: windows x tokens per window, padding included
        self.windows = windows  # windows in the group
        self.register_buffer("slots", torch.tensor(slots, dtype=torch.long), persistent=False)

    def extra_repr(self) -> str:
        return f"windows={self.windows}, slots={self.slots.numel()} of {self.total}"

    def forward(self, x: Tensor) -> Tensor:
        rest = x.shape[2:]
        picked = x.reshape(-1, self.total, *rest).index_select(1, self.slots)
        return picked.reshape(-1, self.slots.numel() // self.windows, *rest)


class WindowSizes(nn.Module):
    """How many of its window's tokens each token entering a reduced window attention stands
    for: itself and the pruned tokens squeezed into it, read off the reduction's record (the
    last of ``trace``). (B * windows, K) at inference, (B * windows, N) while a predictor trains
    (a pruned token counts 1 there: its key is masked anyway). ``None`` where the record holds
    no hosts (nothing was reduced, or the pruned tokens were dropped)."""

    def forward(self, trace: tuple) -> Tensor | None:
        if not trace or trace[-1].host_index is None:
            return None
        record = trace[-1]
        hosts = record.host_index
        if isinstance(record, Removal):  # each pruned token's host among the K kept
            sizes = hosts.new_ones(hosts.shape[0], record.keep_index.shape[1], dtype=torch.float32)
            return sizes.scatter_add(1, hosts, torch.ones_like(hosts, dtype=torch.float32))
        # Training: every token's host among the N (a kept token's is itself); the removed
        # ones add to their hosts. No gradient: a size is a count.
        removed = record.removed.detach().float()
        return torch.ones_like(removed).scatter_add(1, hosts, removed)


class WindowReplay(nn.Module):
    """A windowed block's MLP input, in windows, reduced as its attention's input was (the last
    record of ``trace``): ``(tokens, trace)`` with the record for ``rule``."""

    def __init__(self, rule: str) -> None:
        super().__init__()
        self.rule = rule

    def extra_repr(self) -> str:
        return f"rule={self.rule!r}"

    def forward(self, windows: Tensor, trace: tuple) -> tuple[Tensor, tuple]:
        if not trace:
            return windows, trace
        tokens, record = replay(windows, trace[-1], self.rule)
        return tokens, (record,)


class WindowCarry(nn.Module):
    """A windowed block after a location, in the same windows (a method's ``carry_windows``):
    the windows entering its attention, (B * windows, N, C), reduced by the location's choice
    (the last record of ``trace``), the kept tokens gathered and nothing fused. Returns
    ``(tokens, keep_mask, positions, trace)`` as a reducer does: while a predictor trains,
    every token stays and ``keep_mask`` (B * windows, N) masks the removed keys; at inference,
    ``positions`` are the kept slots, for the position tables."""

    def __init__(self, rule: str) -> None:
        super().__init__()
        self.rule = rule

    def extra_repr(self) -> str:
        return f"rule={self.rule!r}"

    def forward(
        self, windows: Tensor, trace: tuple
    ) -> tuple[Tensor, Tensor | None, Tensor | None, tuple]:
        if not trace:
            return windows, None, None, trace
        record = trace[-1]
        tokens, carried = replay(windows, record, self.rule)
        if isinstance(record, MaskedRemoval):
            return tokens, 1.0 - record.removed, None, (carried,)
        return tokens, None, record.keep_index, (carried,)


class _AtKeptPositions(nn.Module):
    """An op on a tensor laid out by window slot, given the slots each window kept, (B * windows,
    K). Given no slots (nothing reduced: a predictor trains with masks), the tensor as it is."""

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        return x if positions is None else self.at_kept(x, positions)

    def at_kept(self, x: Tensor, positions: Tensor) -> Tensor:
        raise NotImplementedError


class WindowTableGather(_AtKeptPositions):
    """A table an attention within windows adds to its logits by window position (Swin's
    relative-position bias, its shifted windows' mask), laid out for logits batched as
    (B * windows, heads, N, N) or viewed as (B, windows, heads, N, N) (``rank`` 4 or 5): its
    rows and columns gathered by each window's kept positions (B * windows, K)."""

    def __init__(self, windows: int, rank: int) -> None:
        super().__init__()
        self.windows = windows
        self.rank = rank

    def extra_repr(self) -> str:
        return f"windows={self.windows}, rank={self.rank}"

    def at_kept(self, table: Tensor, positions: Tensor) -> Tensor:
        rows, kept = positions.shape
        lead = (rows,) if self.rank == 4 else (rows // self.windows, self.windows)
        table = table.reshape((1,) * (self.rank - table.dim()) + tuple(table.shape))
        n = table.shape[-1]
        table = table.expand(*lead, table.shape[-3], n, n)
        heads = table.shape[-3]
        index = positions.reshape(*lead, 1, kept)
        picked = table.gather(-2, index.unsqueeze(-1).expand(*lead, heads, kept, n))
        return picked.gather(-1, index.unsqueeze(-2).expand(*lead, heads, kept, kept))


class WindowQueryScatter(_AtKeptPositions):
    """The kept queries of each window, (B * windows [* heads], K, D), put back in their slots
    of a full window of ``tokens`` (zeros elsewhere), for a term made row by row from the
    queries by window position (SAM's decomposed relative position; ``analysis/query_bias.py``):
    its kept rows come out as at the full window, and ``WindowTableGather`` then takes the kept
    rows' kept columns."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens

    def extra_repr(self) -> str:
        return f"tokens={self.tokens}"

    def at_kept(self, queries: Tensor, positions: Tensor) -> Tensor:
        rows, kept = positions.shape
        *lead, _, dim = queries.shape
        grouped = queries.reshape(rows, -1, kept, dim)  # windows first, then heads
        index = positions[:, None, :, None].expand_as(grouped)
        full = grouped.new_zeros(rows, grouped.shape[1], self.tokens, dim)
        return full.scatter(2, index, grouped).reshape(*lead, self.tokens, dim)


class WindowQueryGather(_AtKeptPositions):
    """Queries made without the window tokens (GCViT's global query), (B * windows, heads, N,
    D) with their rows by window slot: the rows of each window's kept slots, (B * windows,
    heads, K, D)."""

    def at_kept(self, queries: Tensor, positions: Tensor) -> Tensor:
        rows, kept = positions.shape
        *lead, tokens, dim = queries.shape
        grouped = queries.reshape(rows, -1, tokens, dim)
        index = positions[:, None, :, None].expand(rows, grouped.shape[1], kept, dim)
        return grouped.gather(2, index).reshape(*lead, kept, dim)
