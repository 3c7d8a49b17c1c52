"""What a reducer asks of its method's fuse, what becomes of the tokens it reduces: the base
class, whose defaults drop them. ``vitcompress.variants.fuses`` derives each method's fuse from
it, with what the method says of it besides (its label, legend, cost and restore rules)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

# ``(x, scores, prefix_tokens, keep, setting) -> (tokens, keep_index)``, or ``None`` where the op
# does not run for the reducer's switch ``setting`` (``vitcompress.kernels.kernel_runs``).
SelectOp = Callable[[Tensor, Tensor, int, int, bool | None], tuple[Tensor, Tensor] | None]
# ``(x, metric, sizes, r, protected, setting) -> (tokens, sizes, index)``, or ``None`` as above.
MergeOp = Callable[
    [Tensor, Tensor, Tensor | None, int, int, bool | None], tuple[Tensor, Tensor, Tensor] | None
]


@dataclass(frozen=True)
class TokenFuse:
    """The reducers' side of a fuse. By default reduced tokens are dropped and no fused op
    exists."""

    # Appends one token that stands on no grid position whenever it prunes (EViT's fused token).
    adds_token: bool = False
    takes_pruned: bool = True  # :meth:`fuse` reads the pruned tokens (else it gets them empty)
    weighs_pruned: bool = False  # :meth:`fuse` reads the pruned tokens' scores (else empty)

    # The fused ops that run the reduction at inference where the reducer's switch lets them
    # (``vitcompress.kernels``): select -> gather -> fuse, or ToMe's matching and merge. The method
    # sets them (``vitcompress.variants.fuses``, which may import the kernels); None: none exists.
    select_op: SelectOp | None = None
    merge_op: MergeOp | None = None

    @property
    def fused_kernel(self) -> bool:
        """Whether the reduction runs as one fused op at inference."""
        return self.select_op is not None or self.merge_op is not None

    def fuse(
        self, prefix: Tensor, kept: Tensor, pruned: Tensor, pruned_scores: Tensor
    ) -> tuple[Tensor, Tensor | None]:
        """``(tokens, host_index)``: the tokens after the location (prefix first) and, where each
        pruned token went into one kept token, its index among ``kept`` (B, pruned)."""
        return torch.cat([prefix, kept], dim=1), None

    def fuse_masked(self, patches: Tensor, host_mask: Tensor, donor_mask: Tensor) -> Tensor:
        """Training with a keep mask (nothing dropped): the patch tokens after the location."""
        return patches

    def masked_hosts(self, patches: Tensor, host_mask: Tensor) -> Tensor | None:
        """While a predictor trains: each token's host among the N (B, N), for a restore by the
        host; ``None`` when this fuse gives tokens no host."""
        return None
