"""What a reducer asks of its method's fuse, what becomes of the tokens it reduces: the base
class, whose defaults drop them. ``vitcompress.variants.fuses`` derives each method's fuse from
it, with what the method says of it besides (its label, legend, cost and restore rules)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenFuse:
    """The reducers' side of a fuse. By default reduced tokens are dropped and no fused op
    exists."""

    # Appends one token that stands on no grid position whenever it prunes (EViT's fused token).
    adds_token: bool = False
    takes_pruned: bool = True  # :meth:`fuse` reads the pruned tokens (else it gets them empty)
    weighs_pruned: bool = False  # :meth:`fuse` reads the pruned tokens' scores (else empty)

    @property
    def fused_kernel(self) -> bool:
        """Whether the reduction runs as one fused op at inference (select -> gather -> fuse,
        or ToMe's matching and merge; ``vitcompress.kernels``)."""
        kind = type(self)
        return (
            kind.kernel is not TokenFuse.kernel or kind.merge_kernel is not TokenFuse.merge_kernel
        )

    def fuse(
        self, prefix: Tensor, kept: Tensor, pruned: Tensor, pruned_scores: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """``(tokens, host_index)``: the tokens after the location (prefix first) and, where each
        pruned token went into one kept token, its index among ``kept`` (B, pruned)."""
        return torch.cat([prefix, kept], dim=1), None

    def fuse_masked(self, patches: Tensor, host_mask: Tensor, donor_mask: Tensor) -> Tensor:
        """Training with a keep mask (nothing dropped): the patch tokens after the location."""
        return patches

    def kernel(
        self, x: Tensor, scores: Tensor, prefix_tokens: int, keep: int, setting: bool | None
    ) -> tuple[Tensor, Tensor] | None:
        """The fused op's ``(tokens, keep_index)``, or ``None`` where it does not run for the
        reducer's switch ``setting`` (``vitcompress.kernels.kernel_runs``) or does not exist."""
        return None

    def merge_kernel(
        self,
        x: Tensor,
        metric: Tensor,
        sizes: Tensor | None,
        r: int,
        protected: int,
        setting: bool | None,
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """ToMe's fused op's ``(tokens, sizes, index)``, or ``None``, as :meth:`kernel`."""
        return None

    def masked_hosts(self, patches: Tensor, host_mask: Tensor) -> Tensor | None:
        """While a predictor trains: each token's host among the N (B, N), for a restore by the
        host; ``None`` when this fuse gives tokens no host."""
        return None
