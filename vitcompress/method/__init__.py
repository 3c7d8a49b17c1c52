"""The method: small pure tensor functions (score, select, match, fuse, mask).

Nothing here knows about graphs, modules or the command line. Shapes follow one convention:
tokens are ``(B, N, C)``, per-token scores and masks are ``(B, N)``, indices are ``(B, k)`` and
refer to positions along ``N``.
"""

from vitcompress.method.attention import attention_with_probs, masked_attention, masked_softmax
from vitcompress.method.keep import (
    CumulativeKeep,
    KeepListError,
    per_location_keep,
)
from vitcompress.method.merge import (
    Matching,
    bipartite_soft_matching,
    merge_count,
    merge_sources,
    merge_tokens,
    merged_hosts,
)
from vitcompress.method.restore import (
    RESTORE_RULES,
    MaskedRemoval,
    Removal,
    replay,
    restore_masked,
    restore_tokens,
)
from vitcompress.method.score import (
    KeyPool,
    cls_attention_score,
    key_scores_to_tokens,
    received_attention_score,
    score_from_probs,
)
from vitcompress.method.select import (
    SELECTION_POLICIES,
    gather_tokens,
    keep_count,
    scatter_tokens,
    split_by_score,
)
from vitcompress.method.squeeze import (
    cosine_similarity,
    evit_fuse,
    fuse_into_hosts,
    masked_host_index,
    match_hosts,
    match_hosts_cosine,
    squeeze,
    squeeze_dense,
    squeeze_masked,
)

__all__ = [
    "CumulativeKeep",
    "KeepListError",
    "Matching",
    "MaskedRemoval",
    "RESTORE_RULES",
    "Removal",
    "SELECTION_POLICIES",
    "attention_with_probs",
    "bipartite_soft_matching",
    "cls_attention_score",
    "cosine_similarity",
    "evit_fuse",
    "fuse_into_hosts",
    "gather_tokens",
    "keep_count",
    "KeyPool",
    "key_scores_to_tokens",
    "masked_attention",
    "masked_host_index",
    "masked_softmax",
    "match_hosts",
    "match_hosts_cosine",
    "merge_count",
    "merge_sources",
    "merge_tokens",
    "merged_hosts",
    "per_location_keep",
    "received_attention_score",
    "replay",
    "restore_masked",
    "restore_tokens",
    "scatter_tokens",
    "score_from_probs",
    "split_by_score",
    "squeeze",
    "squeeze_dense",
    "squeeze_masked",
]
