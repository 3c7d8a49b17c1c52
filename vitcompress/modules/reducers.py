"""Token reducers inserted on the residual stream.

They return ``(tokens, keep_mask, positions, trace)`` (ToMe's ``sizes`` before the trace):

- ``keep_mask`` (B, P + N0), float, prefix tokens 1: which tokens are still kept while TRAINING a
  predictor-based variant (nothing is dropped then); ``None`` whenever tokens are dropped.
- ``positions`` (B, n) long: the original grid index of every non-prefix token present, -1 for a
  token that is not on the grid (EViT's fused token); ``None`` means "all of them, in grid order".
  Position tables and visualisation read it.
- ``trace``: the stage's reductions so far, a tuple of :class:`~vitcompress.method.Removal` (or
  :class:`~vitcompress.method.MaskedRemoval` while a predictor trains), each reducer appending its
  own while its ``restore_rule`` is set (the rewrite sets it where something after it reads the
  tokens by position); a restore (``modules/restore.py``) undoes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitcompress.method import (
    SELECTION_POLICIES,
    MaskedRemoval,
    Matching,
    Removal,
    bipartite_soft_matching,
    gather_tokens,
    keep_count,
    merge_tokens,
    merged_hosts,
    split_by_score,
)
from vitcompress.method.restore import DELTA, NEEDS_HOST, VALUE
from vitcompress.modules.fuse import TokenFuse
from vitcompress.modules.predictor import ScorePredictor

POLICIES = SELECTION_POLICIES  # the name other modules import


@dataclass
class Assignment:
    """What a reducer did in its last forward, recorded while its ``record`` is set (``visualize``
    reads it; nothing is recomputed). Indices are into the non-prefix tokens it was given, except
    ToMe's ``matching``, which is over the whole sequence (prefix included)."""

    prefix_tokens: int
    tokens: int  # the sequence length the reducer was given
    keep_index: Tensor | None = None  # (B, kept)
    prune_index: Tensor | None = None  # (B, pruned)
    host_index: Tensor | None = None  # (B, pruned): each pruned token's host, among the kept
    matching: Matching | None = None


class RecordsAssignment:
    """``record = True`` makes a reducer keep an :class:`Assignment` of its next forwards
    (``visualize`` sets it); a new method's reducer mixes it in and calls :meth:`_recorded`.

    ``restore_rule`` (set by the rewrite, not state: a saved model is rewritten again on load)
    makes it append what it removed to the trace, as much as that rule needs (``method/restore``).
    """

    record: bool = False
    assignment: Assignment | None = None
    restore_rule: str | None = None
    # A second rule the same record serves (a windowed block's attention restores by its
    # method's local rule, its MLP by ``restore_rule``): the record holds what either reads.
    also_restores: str | None = None

    def _needs(self, rules: tuple[str, ...] | frozenset[str]) -> bool:
        return self.restore_rule in rules or self.also_restores in rules

    def _recorded(self, x: Tensor, **fields) -> None:
        if self.record:
            self.assignment = Assignment(self.prefix_tokens, x.shape[1], **fields)

    def _traced(self, trace: tuple, removal: Removal | MaskedRemoval | None) -> tuple:
        if self.restore_rule is None or removal is None:
            return trace
        return (*trace, removal)

    def _removal(
        self,
        keep_index: Tensor,
        prune_index: Tensor,
        host_index: Tensor | None,
        removed: Tensor | None,
        output: Tensor,
        kept: Tensor | None = None,
    ) -> Removal | None:
        """The record of an inference reduction, holding only what the rule reads."""
        rule = self.restore_rule
        if rule is None:
            return None
        delta = self._needs((DELTA,))
        return Removal(
            keep_index,
            prune_index,
            host_index if self._needs(NEEDS_HOST) else None,
            removed if self._needs((VALUE, DELTA)) else None,
            output if delta else None,
            kept if delta else None,
        )


def _kernel_may_run(reducer: RecordsAssignment) -> bool:
    """Whether a reducer may hand its step to a fused op (which decides whether it runs): at
    inference, with its switch not off, neither recording nor tracing for a restore (the
    kernels keep no record of what they remove)."""
    return (
        reducer.fused_kernel is not False
        and not reducer.training
        and not reducer.record
        and reducer.restore_rule is None
    )


def _kept_positions(positions: Tensor | None, keep_index: Tensor) -> Tensor:
    """Grid positions of the kept tokens. Without ``positions`` the tokens are still in grid
    order, so the kept tokens' indices are their positions."""
    return keep_index if positions is None else torch.gather(positions, 1, keep_index)


class FusingReducer(RecordsAssignment, nn.Module):
    """What the reducers that select by a score and hand the rest to a fuse share: the policy,
    the fuse, the fused-kernel switch, and the select -> gather -> fuse step itself."""

    def __init__(
        self, prefix_tokens: int, keep_ratio: float, fuse: TokenFuse, policy: str = "score"
    ) -> None:
        super().__init__()
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.prefix_tokens = prefix_tokens
        self.keep_ratio = keep_ratio
        self.fuse = fuse
        self.policy = policy
        # select -> gather -> fuse as one op at inference: None (the default) where the fuse's
        # kernel serves (vitcompress.kernels.kernel_runs), True or False as
        # vitcompress.kernels.enable_fused_kernels sets it. Not state: a saved model loads with
        # the default. A fuse without a kernel (EViT's) keeps the method's path.
        self.fused_kernel: bool | None = None
        self.supports_fused_kernel = fuse.fused_kernel

    def extra_repr(self) -> str:
        return (
            f"prefix_tokens={self.prefix_tokens}, keep_ratio={self.keep_ratio}, "
            f"fuse={self.fuse.label!r}, policy={self.policy!r}"
        )

    def _select_and_fuse(
        self,
        x: Tensor,
        order: Tensor,
        scores: Tensor,
        k: int,
        positions: Tensor | None,
        trace: tuple,
    ) -> tuple[Tensor, None, Tensor | None, tuple]:
        """Keep the ``k`` patch tokens first in ``order``; the fuse takes the rest (weighted by
        ``scores`` where it weighs them). Returns ``(tokens, None, positions, trace)``."""
        p = self.prefix_tokens
        if self.fuse.select_op is not None and _kernel_may_run(self):
            fused = self.fuse.select_op(x, order, p, k, self.fused_kernel)
            if fused is not None:
                tokens, keep_index = fused
                return tokens, None, _kept_positions(positions, keep_index), trace
        prefix, patches = x[:, :p], x[:, p:]
        keep_index, prune_index = split_by_score(order, k)
        kept = gather_tokens(patches, keep_index)
        # Gathered only for a fuse that reads them (a drop does not: no copy of what it drops,
        # unless a restore brings them back by their value).
        gather_pruned = self.fuse.takes_pruned or self._needs((VALUE, DELTA))
        pruned = gather_tokens(patches, prune_index) if gather_pruned else patches[:, :0]
        positions = _kept_positions(positions, keep_index)
        fuse_pruned = pruned if self.fuse.takes_pruned else patches[:, :0]
        # The pruned tokens' scores only where the fuse weighs them (EViT): one gather fewer.
        pruned_scores = scores.gather(1, prune_index) if self.fuse.weighs_pruned else scores[:, :0]
        tokens, host_index = self.fuse.fuse(prefix, kept, fuse_pruned, pruned_scores)
        self._recorded(x, keep_index=keep_index, prune_index=prune_index, host_index=host_index)
        if self.fuse.adds_token:  # a token on no grid position
            positions = torch.cat([positions, positions.new_full((x.shape[0], 1), -1)], dim=1)
        removal = self._removal(keep_index, prune_index, host_index, pruned, tokens[:, p:], kept)
        return tokens, None, positions, self._traced(trace, removal)


class PredictorReducer(FusingReducer):
    """dTPS (fuse: squeeze) and DynamicViT (fuse: drop), placed BEFORE a block.

    Inference keeps ``keep_tokens`` patch tokens (``int(N0 * rho**s)``, fixed, so shapes are
    constant) by the predictor's keep log-probability and, for dTPS, squeezes the rest into their
    hosts. Training samples a hard straight-through Gumbel mask over all N0 tokens instead.
    ``keep_ratio`` is the target fraction of N0 kept after this location (the ratio loss's).
    """

    def __init__(
        self,
        dim: int,
        prefix_tokens: int,
        keep_tokens: int,
        keep_ratio: float,
        fuse: TokenFuse,
        policy: str = "score",
        window_share: float | None = None,
    ) -> None:
        super().__init__(prefix_tokens, keep_ratio, fuse, policy)
        self.keep_tokens = keep_tokens
        self.predictor = ScorePredictor(dim)
        # Given, the windows of a group with fewer tokens (padded windows at the grid's edges,
        # reduced group by group) keep this share of theirs, floor(n * share), as the full
        # windows keep keep_tokens of theirs.
        self.window_share = window_share

    def extra_repr(self) -> str:
        share = f", window_share={self.window_share:g}" if self.window_share is not None else ""
        return f"keep_tokens={self.keep_tokens}{share}, {super().extra_repr()}"

    def kept(self, patches: int) -> int:
        """Patch tokens kept at inference out of ``patches`` arriving."""
        kept = min(self.keep_tokens, patches)
        if self.window_share is not None:
            # A group's token count is fixed by the model: read as the constant it is.
            kept = min(kept, keep_count(int(patches), self.window_share, "floor"))
        return kept

    def forward(
        self,
        x: Tensor,
        keep_mask: Tensor | None = None,
        positions: Tensor | None = None,
        trace: tuple = (),
    ) -> tuple[Tensor, Tensor | None, Tensor | None, tuple]:
        p = self.prefix_tokens
        prefix, patches = x[:, :p], x[:, p:]
        if self.training:
            return self._train(prefix, patches, keep_mask, positions, trace)
        if self.policy == "random":
            scores = torch.rand(patches.shape[:2], device=x.device)
        else:
            scores = self.predictor.keep_score(patches)
        return self._select_and_fuse(
            x, scores, scores, self.kept(patches.shape[1]), positions, trace
        )

    def _train(
        self,
        prefix: Tensor,
        patches: Tensor,
        keep_mask: Tensor | None,
        positions: Tensor | None,
        trace: tuple,
    ) -> tuple[Tensor, Tensor, Tensor | None, tuple]:
        b, n = patches.shape[:2]
        previous = (
            keep_mask[:, self.prefix_tokens :] if keep_mask is not None else patches.new_ones(b, n)
        )
        if self.policy == "random":
            # Exactly keep_tokens of the tokens still kept, chosen uniformly.
            noise = torch.rand(b, n, device=patches.device) + previous
            keep_index, _ = split_by_score(noise, self.kept(n))
            hard = torch.zeros_like(previous).scatter(1, keep_index, 1.0) * previous
        else:
            log_probs = self.predictor(patches, previous)
            hard = F.gumbel_softmax(log_probs, hard=True)[..., 0] * previous
        removed = (1.0 - hard) * previous
        fused = self.fuse.fuse_masked(patches, host_mask=hard, donor_mask=removed)
        mask = torch.cat([hard.new_ones(b, self.prefix_tokens), hard], dim=1)
        removal = None
        if self.restore_rule is not None:
            hosts = self.fuse.masked_hosts(patches, hard) if self._needs(NEEDS_HOST) else None
            before = patches if self._needs((DELTA,)) else None
            removal = MaskedRemoval(removed, hosts, fused, before)
        return torch.cat([prefix, fused], dim=1), mask, positions, self._traced(trace, removal)


class AttentionReducer(FusingReducer):
    """eTPS (fuse: squeeze) and EViT (fuse: one extra token), placed INSIDE a block after the
    attention residual add, scored by that block's attention. Drops tokens in training too.

    Keeps ``ceil(rho * n)`` of the ``n`` non-prefix tokens present (EViT's fused token counts).
    """

    def forward(
        self,
        x: Tensor,
        scores: Tensor,
        keep_mask: Tensor | None = None,
        positions: Tensor | None = None,
        trace: tuple = (),
    ) -> tuple[Tensor, None, Tensor | None, tuple]:
        n = x.shape[1] - self.prefix_tokens
        k = keep_count(n, self.keep_ratio, "ceil")
        if k >= n:  # nothing to prune: EViT adds no fused token either
            return x, None, positions, trace
        # A random policy only changes who is kept; EViT still weights its fused token by attention.
        order = torch.rand_like(scores) if self.policy == "random" else scores
        return self._select_and_fuse(x, order, scores, k, positions, trace)


class MergeReducer(RecordsAssignment, nn.Module):
    """ToMe, placed INSIDE a block after the attention residual add: merges ``r`` tokens by
    bipartite soft matching on the block's keys (``metric``, head-mean, (B, t, D)), weighted by the
    tokens' sizes; prefix tokens are protected. The same in training (gradients flow through the
    weighted average) and inference.

    Returns ``(tokens, None, positions, sizes, trace)``: a merged token keeps its destination's grid
    position; ``sizes`` (B, t - r) says how many patches each token stands for, for the
    proportional attention of the blocks after it. ``None`` sizes mean all 1 (nothing merged yet).
    """

    def __init__(
        self, prefix_tokens: int, r: int, keep: float | None = None, fuse: TokenFuse | None = None
    ) -> None:
        super().__init__()
        self.prefix_tokens = prefix_tokens
        self.r = r
        # The matching and merge as one op at inference, as FusingReducer's select and fuse.
        self.fuse = fuse
        self.fused_kernel: bool | None = None
        self.supports_fused_kernel = fuse is not None
        # Given, r is read off the tokens that arrive: round(n * (1 - keep)). A windowed block
        # with padded windows reduces its groups of windows (49, 35, 25 real tokens) with this
        # one module, and each group must keep its share, not lose a full window's r.
        self.keep = keep

    def extra_repr(self) -> str:
        share = f", keep={self.keep:g}" if self.keep is not None else ""
        return f"prefix_tokens={self.prefix_tokens}, r={self.r}{share}"

    def merged(self, tokens: int) -> int:
        """Tokens merged out of ``tokens`` arriving (prefix tokens included)."""
        if self.keep is None:
            return self.r
        # A window group's token count is fixed by the model (not by the batch): an exporter's
        # traced size is read as the constant it is.
        patches = int(tokens) - self.prefix_tokens
        return min(round(patches * (1.0 - self.keep)), patches // 2)

    def forward(
        self,
        x: Tensor,
        metric: Tensor,
        keep_mask: Tensor | None = None,
        positions: Tensor | None = None,
        sizes: Tensor | None = None,
        trace: tuple = (),
    ) -> tuple[Tensor, None, Tensor | None, Tensor | None, tuple]:
        p = self.prefix_tokens
        if self.fuse is not None and self.fuse.merge_op is not None and _kernel_may_run(self):
            merged = self.fuse.merge_op(
                x, metric, sizes, self.merged(metric.shape[1]), p, self.fused_kernel
            )
            if merged is not None:
                tokens, sizes, index = merged
                return tokens, None, _kept_positions(positions, index[:, p:] - p), sizes, trace
        matching = bipartite_soft_matching(metric, self.merged(metric.shape[1]), self.prefix_tokens)
        self._recorded(x, matching=matching)
        if matching.src.shape[1] == 0:  # r = 0 merges nothing: the tokens pass as they came
            return x, None, positions, sizes, trace
        if sizes is None:
            sizes = x.new_ones(x.shape[:2], dtype=torch.float32)
        tokens, sizes, index = merge_tokens(x, sizes, matching)
        patch_index = index[:, p:] - p
        positions = _kept_positions(positions, patch_index)
        removal = None
        if self.restore_rule is not None:
            prune_index, host_index = merged_hosts(matching)
            removed = gather_tokens(x[:, p:], prune_index) if self.restore_rule != "host" else None
            kept = gather_tokens(x[:, p:], patch_index) if self.restore_rule == DELTA else None
            removal = self._removal(
                patch_index, prune_index, host_index, removed, tokens[:, p:], kept
            )
        return tokens, None, positions, sizes, self._traced(trace, removal)
