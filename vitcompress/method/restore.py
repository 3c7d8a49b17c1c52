"""Bringing the full token set back after reductions ("unmerge"), as pure tensor functions.

A model whose output is its token grid (segmentation, detection, features, video) must return
every token in the base's order. Each reduction records a :class:`Removal` (inference: tokens
leave the sequence) or a :class:`MaskedRemoval` (a predictor in training: nothing leaves, a mask
says who was removed); :func:`restore_tokens` and :func:`restore_masked` undo a stage's
reductions in reverse order, the way ToMe's unmerge undoes its merges, so that a token removed
into a host that was itself removed later follows its host's own restored value.

A removed token comes back by one of the rules (docs/dense.md measures them per method):

- ``host``: its host's current value (ToMe's unmerge; a drop has no host);
- ``value``: its own value when it was removed;
- ``delta``: its value when removed plus its host's change since then; the host itself sheds
  what was fused into it (its value now, less what the fuse added then), so a group of tokens
  fused together comes back as the group's value now plus each member's own offset;
- ``zero``: zeros (what grid ops of hybrid models were fed before restoring existed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

HOST = "host"
VALUE = "value"
DELTA = "delta"
ZERO = "zero"
RESTORE_RULES = (HOST, VALUE, DELTA, ZERO)
NEEDS_HOST = (HOST, DELTA)
# Rules whose result does not depend on where, along a chain of per-token ops (norms, linears on
# channels), the tokens are restored: they read only the tokens at that place. ``value`` and
# ``delta`` read values recorded on the residual stream, so they restore there.
RESTORES_ANYWHERE = (HOST, ZERO)


class Removal(NamedTuple):
    """One reduction at inference, over the non-prefix tokens of its input (``n`` of them).

    The output's first ``k`` non-prefix tokens stand at the input's ``keep_index`` (B, k), in that
    order; a fuse may append more (EViT's fused token), which are not on the grid. ``prune_index``
    (B, m) are the others; ``host_index`` (B, m) each one's host among the output's non-prefix
    tokens (``None``: no host, a drop); ``removed`` (B, m, C) their values when removed (``None``
    when no rule needs them); ``output`` (B, k', C) the output's non-prefix tokens then, for the
    ``delta`` rule (``None`` otherwise).
    """

    keep_index: Tensor
    prune_index: Tensor
    host_index: Tensor | None = None
    removed: Tensor | None = None
    output: Tensor | None = None
    kept: Tensor | None = None  # (B, k, C) the kept tokens before the fuse changed them


class MaskedRemoval(NamedTuple):
    """One reduction while a predictor trains (every token stays): ``removed`` (B, N) is 1 for
    the tokens removed here, ``host_index`` (B, N) each token's host among the N (``None``: no
    host), ``values`` (B, N, C) the tokens after the location (a removed token's is its value
    when removed, a host's includes what was squeezed into it)."""

    removed: Tensor
    host_index: Tensor | None = None
    values: Tensor | None = None
    before: Tensor | None = None  # (B, N, C) the tokens before the fuse, for ``delta``


def _gather(x: Tensor, index: Tensor) -> Tensor:
    return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def _filled(
    rule: str,
    current_hosts: Tensor | None,
    removed: Tensor | None,
    hosts_then: Tensor | None,
    like: Tensor,
) -> Tensor:
    """The values the removed tokens come back with (``like``: their shape and dtype)."""
    if rule == HOST and current_hosts is not None:
        return current_hosts
    if rule == VALUE and removed is not None:
        return removed.to(like.dtype)
    if rule == DELTA and removed is not None and current_hosts is not None:
        return (removed.to(like.dtype) - hosts_then.to(like.dtype)) + current_hosts
    if rule == ZERO:
        return torch.zeros_like(like)
    raise ValueError(f"restore rule {rule!r} needs what this reduction did not record")


def restore_tokens(patches: Tensor, removals: Sequence[Removal], rule: str) -> Tensor:
    """The non-prefix tokens ``(B, n, C)`` after ``removals`` (in the order they were made)
    brought back to the first removal's input: ``(B, N0, C)``, in its order."""
    x = patches
    for removal in reversed(removals):
        keep = removal.keep_index.shape[1]
        kept = x[:, :keep]
        if rule == DELTA and removal.kept is not None and removal.output is not None:
            # A host sheds what was fused into it: its change since, on its own value.
            kept = kept - (removal.output[:, :keep] - removal.kept).to(x.dtype)
        hosts = host_then = None
        if removal.host_index is not None and rule in NEEDS_HOST:
            hosts = _gather(x, removal.host_index)
            if rule == DELTA and removal.output is not None:
                host_then = _gather(removal.output, removal.host_index)
        shape = (x.shape[0], removal.prune_index.shape[1], x.shape[-1])
        filled = _filled(rule, hosts, removal.removed, host_then, x.new_empty(shape))
        # Every input token once: kept in output order, then the removed; undo that order.
        order = torch.cat([removal.keep_index, removal.prune_index], dim=1)
        x = _gather(torch.cat([kept, filled], dim=1), order.argsort(dim=1))
    return x


def restore_masked(patches: Tensor, removals: Sequence[MaskedRemoval], rule: str) -> Tensor:
    """Training's form of :func:`restore_tokens`: every token is present in ``patches`` (B, N, C);
    the ones each removal marked take the rule's value, latest removal first. Straight-through
    masks keep their gradient (a blend by the mask, not an index)."""
    x = patches
    for removal in reversed(removals):
        mask = removal.removed.unsqueeze(-1).to(x.dtype)
        hosts = host_then = None
        if removal.host_index is not None and rule in NEEDS_HOST:
            hosts = _gather(x, removal.host_index)
            if rule == DELTA and removal.values is not None:
                host_then = _gather(removal.values, removal.host_index)
        filled = _filled(rule, hosts, removal.values, host_then, x)
        if rule == DELTA and removal.values is not None and removal.before is not None:
            x = x - (removal.values - removal.before).to(x.dtype)  # hosts shed their donors
        x = x * (1 - mask) + filled * mask
    return x


def replay(
    x: Tensor, removal: Removal | MaskedRemoval, rule: str
) -> tuple[Tensor, Removal | MaskedRemoval]:
    """The same reduction on other tokens laid out alike, ``x`` (B, N, C): the kept ones
    gathered, nothing fused; with its record for ``rule``. A windowed block reduces its attention's
    input, then its MLP's input by the same choice (``modules/windows.py``)."""
    if isinstance(removal, MaskedRemoval):  # every token stays: only the record is new
        return x, MaskedRemoval(removal.removed, removal.host_index, x, x)
    kept = _gather(x, removal.keep_index)
    removed = _gather(x, removal.prune_index) if rule in (VALUE, DELTA) else None
    then = kept if rule == DELTA else None
    record = Removal(
        removal.keep_index, removal.prune_index, removal.host_index, removed, then, then
    )
    return kept, record
