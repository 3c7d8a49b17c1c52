"""What becomes of the tokens a method reduces, as an object: the tensor operation the reducers
call, its cost, whether it adds a token without a grid position, whether a fused kernel runs it,
and how its assignment (which kept token took which reduced one) is explained to ``visualize``.

Reducers (``modules/reducers.py``) call a fuse's :meth:`Fuse.fuse` at inference and
:meth:`Fuse.fuse_masked` while a predictor trains, and record what they did in an
:class:`~vitcompress.modules.reducers.Assignment` when asked; :meth:`Fuse.explain` reads that
record. Nothing outside ``vitcompress/variants/`` compares a fuse's label.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vitcompress.kernels.ops import kernel_runs, select_squeeze, tome_merge
from vitcompress.method import (
    evit_fuse,
    masked_host_index,
    merge_sources,
    squeeze,
    squeeze_masked,
)
from vitcompress.method.restore import DELTA, HOST, VALUE, ZERO
from vitcompress.modules.fuse import MergeOp, SelectOp, TokenFuse
from vitcompress.modules.reducers import Assignment


@dataclass(frozen=True)
class FusedSelect:
    """``vitcompress::select_squeeze`` where the reducer's switch lets it run (a fuse's
    ``select_op``): the pruned tokens squeezed into their hosts, or dropped."""

    squeeze_pruned: bool

    @property
    def cuda_default(self) -> bool:
        """Whether the op is the default on CUDA: where it squeezes (1.44-1.53x faster than the
        method's ops on an H200), not where it only selects (0.68-0.91x: a sort and a gather
        are already what the method runs)."""
        return self.squeeze_pruned

    def __call__(
        self, x: Tensor, scores: Tensor, prefix_tokens: int, keep: int, setting: bool | None
    ) -> tuple[Tensor, Tensor] | None:
        if not kernel_runs(setting, x, cuda_default=self.cuda_default):
            return None
        return select_squeeze(x, scores, prefix_tokens, keep, self.squeeze_pruned)


@dataclass(frozen=True)
class FusedMerge:
    """``vitcompress::tome_merge`` where the reducer's switch lets it run (a fuse's
    ``merge_op``)."""

    def __call__(
        self,
        x: Tensor,
        metric: Tensor,
        sizes: Tensor | None,
        r: int,
        protected: int,
        setting: bool | None,
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        # The default on CUDA too: 1.52-1.59x faster than the method's ops on an H200.
        if not kernel_runs(setting, x, cuda_default=True):
            return None
        return tome_merge(x, metric, sizes, r, protected)


# position -> the positions taken into it (squeezed or merged), as ``visualize`` draws them.
Hosts = dict[int, list[int]]


@dataclass(frozen=True)
class Fuse(TokenFuse):
    """The base: reduced tokens are dropped (what a reducer asks of it, with those defaults, is
    :class:`~vitcompress.modules.fuse.TokenFuse`). ``label`` is for help texts and docs only."""

    label: str = "dropped"
    # How ``visualize``'s legend names the cells of a panel where tokens went into kept ones:
    # the kept token taken into (outlined), a token taken into it, a kept token that took none.
    legend: tuple[str, str, str] = (
        "host: a kept token that pruned tokens are squeezed into (outlined)",
        "pruned here, squeezed into the host of its colour",
        "kept, no tokens squeezed into it (grey image)",
    )
    # A token taken in at one location stays in its host's group at the next (ToMe's merges).
    groups_grow: bool = False
    added_token_legend: str = ""  # the legend's line for the token it adds, where it adds one
    # How a token it removed comes back where the model reads tokens by position (dense outputs,
    # grid ops; method/restore.py): the rules that apply, and the default (docs/dense.md has the
    # measurements that chose it). A drop has no host, so only its own value or zeros.
    restore_rules: tuple[str, ...] = (VALUE, ZERO)
    restore_default: str = VALUE

    def macs(self, removed: int, kept: int, dim: int) -> float:
        """The MACs of fusing ``removed`` tokens into ``kept`` ones of width ``dim``."""
        return 0.0

    def explain(self, assignment: Assignment, present: list[int], groups: Hosts) -> Hosts | None:
        """From a reducer's record of the first image: each kept position -> the positions taken
        into it so far (``groups`` carries earlier locations' merges); ``None`` when this fuse
        takes no token into another."""
        return None


@dataclass(frozen=True)
class Drop(Fuse):
    """DynamicViT: pruned tokens are dropped."""

    takes_pruned: bool = False  # the reducer need not gather them
    select_op: SelectOp | None = FusedSelect(squeeze_pruned=False)


@dataclass(frozen=True)
class Squeeze(Fuse):
    """TPS: each pruned token is squeezed into its most similar kept token (its host), weighted
    by their similarity (dTPS, eTPS)."""

    label: str = "squeezed into kept hosts"
    restore_rules: tuple[str, ...] = (DELTA, HOST, VALUE, ZERO)
    restore_default: str = DELTA
    select_op: SelectOp | None = FusedSelect(squeeze_pruned=True)

    def fuse(
        self, prefix: Tensor, kept: Tensor, pruned: Tensor, pruned_scores: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        return squeeze(kept, pruned, prefix, return_hosts=True)

    def fuse_masked(self, patches: Tensor, host_mask: Tensor, donor_mask: Tensor) -> Tensor:
        return squeeze_masked(patches, host_mask=host_mask, donor_mask=donor_mask)

    def masked_hosts(self, patches: Tensor, host_mask: Tensor) -> Tensor | None:
        return masked_host_index(patches, host_mask)

    def macs(self, removed: int, kept: int, dim: int) -> float:
        """The similarity of each pruned token to each kept one."""
        return removed * kept * dim

    def explain(self, assignment: Assignment, present: list[int], groups: Hosts) -> Hosts:
        return _hosts_of(assignment, present)


@dataclass(frozen=True)
class FuseOne(Fuse):
    """EViT: the pruned tokens become one extra token, their attention-weighted sum."""

    label: str = "fused into one extra token"
    adds_token: bool = True
    weighs_pruned: bool = True  # its token is the pruned ones' sum weighted by their scores
    added_token_legend: str = "+1: EViT's fused token of the pruned ones (no cell)"

    def fuse(
        self, prefix: Tensor, kept: Tensor, pruned: Tensor, pruned_scores: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        extra = evit_fuse(pruned, pruned_scores)
        return torch.cat([prefix, kept, extra], dim=1), None

    def fuse_masked(self, patches: Tensor, host_mask: Tensor, donor_mask: Tensor) -> Tensor:
        raise NotImplementedError("a fused extra token cannot be trained under a keep mask")


@dataclass(frozen=True)
class Merge(Fuse):
    """ToMe: the matched tokens are averaged, weighted by their sizes, into their destinations
    (the reducer does it with the matching; this object explains and counts it)."""

    label: str = "merged, size-weighted"
    legend: tuple[str, str, str] = (
        "a merged token, at the position it keeps (outlined)",
        "merged into the outlined token of its colour (here or earlier)",
        "a token nothing was merged into (grey image)",
    )
    groups_grow: bool = True
    restore_rules: tuple[str, ...] = (DELTA, HOST, VALUE, ZERO)
    restore_default: str = DELTA  # ToMe's unmerge (host), with each token's own offset
    merge_op: MergeOp | None = FusedMerge()

    def explain(self, assignment: Assignment, present: list[int], groups: Hosts) -> Hosts:
        """Folds this block's merges into ``groups`` (position -> positions merged into it so
        far), in place; returns the groups of the tokens still here."""
        prefix = assignment.prefix_tokens
        for dst, sources in merge_sources(assignment.matching, assignment.tokens).items():
            host = present[dst - prefix]
            for src in sources:
                donor = present[src - prefix]
                groups.setdefault(host, []).extend([donor, *groups.pop(donor, [])])
        return {pos: sorted(members) for pos, members in groups.items()}


def _hosts_of(assignment: Assignment, present: list[int]) -> Hosts:
    """Each kept position -> the pruned positions squeezed into it, for the first image."""
    kept = [present[i] for i in assignment.keep_index[0].tolist()]
    hosts: Hosts = {pos: [] for pos in kept}
    if assignment.host_index is None or assignment.prune_index is None:
        return hosts
    pruned = [present[i] for i in assignment.prune_index[0].tolist()]
    for donor, host in zip(pruned, assignment.host_index[0].tolist(), strict=True):
        hosts[kept[host]].append(donor)
    return hosts
