"""Token squeezing (TPS): match each pruned token (donor) to its most similar kept token (host)
and fuse the donors into their hosts with exp-similarity weights.

Paper, Sec. 3.3: ``y_j = (e x_j + sum_i exp(c_ij) m_ij x_i) / (e + sum_i exp(c_ij) m_ij)``, where
``c`` is the cosine similarity, ``m_ij = 1`` iff host(i) = j, and ``e = exp(1)`` is the host's
weight on itself (its similarity to itself is 1). Hosts without donors are unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

SELF_WEIGHT = math.e  # exp(1): a token's similarity to itself is 1
_NORM_EPS = 1e-6

# How a sum of rows by index (the fuse's "sum of the donors of each host", ToMe's "sum of the
# tokens merged into each destination") is computed. SCATTER is ``scatter_add``: O(m * C), the
# fastest in PyTorch, but ONNX writes it as ``ScatterElements`` with ``reduction="add"``, which
# TensorRT's parser does not take. ONE_HOT multiplies by the (m x bins) one-hot of the index;
# SEGMENT sorts the rows by index and differences a cumulative sum at the segments' ends. Neither
# has a scatter; benchmarks/export_scatter_free.py times the three in onnxruntime.
SCATTER, ONE_HOT, SEGMENT = "scatter", "one-hot", "segment"
SUM_FORMS = (SCATTER, ONE_HOT, SEGMENT)
PORTABLE_FORM = ONE_HOT  # the form an ONNX export gets (faster of the two in onnxruntime)
_forced_form: list[str] = []  # set by :func:`index_sum_form`


def sum_form() -> str:
    """The form index sums take now: the one :func:`index_sum_form` set, else
    :data:`PORTABLE_FORM` while an ONNX exporter traces (``torch.onnx.export``, either exporter)
    and :data:`SCATTER` otherwise. A branch in Python, so a traced graph holds one form only."""
    if _forced_form:
        return _forced_form[-1]
    return PORTABLE_FORM if torch.onnx.is_in_onnx_export() else SCATTER


@contextlib.contextmanager
def index_sum_form(form: str) -> Iterator[None]:
    """Within the block every index sum takes ``form`` (one of :data:`SUM_FORMS`), eager or
    traced: for comparing the forms. An ONNX export needs no such block."""
    if form not in SUM_FORMS:
        raise ValueError(f"form must be one of {SUM_FORMS}, got {form!r}")
    _forced_form.append(form)
    try:
        yield
    finally:
        _forced_form.pop()


def product_outside_autocast(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` in the inputs' own dtype, under autocast too. The method's products are sums it
    keeps in float32 (similarities, index sums); autocast would cast float32 tokens to its
    half-precision dtype for each (two casts a call) and round the sum, so a reducer would
    choose other hosts than it does without autocast. Outside autocast, and on a device autocast
    does not know (``meta``: asking would raise), a plain product."""
    device = a.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        with torch.autocast(device, enabled=False):
            return a @ b
    return a @ b


def one_hot_index(index: Tensor, bins: int) -> Tensor:
    """``(B, m, bins)`` float32, 1 where ``index[b, i] == j``: a comparison with a range, which
    every runtime has (ONNX ``OneHot`` is not in every one)."""
    return (index.unsqueeze(-1) == torch.arange(bins, device=index.device)).float()


def index_sum(values: Tensor, index: Tensor, bins: int, form: str | None = None) -> Tensor:
    """``out[b, j] = sum of values[b, i] over the i with index[b, i] == j``, ``(B, bins, C)``
    float32 from ``values`` ``(B, m, C)`` and ``index`` ``(B, m)``: ``scatter_add`` into zeros in
    any of :data:`SUM_FORMS` (default :func:`sum_form`). A bin no row goes to is exactly 0."""
    form = form or sum_form()
    values = values.float()
    if form == SCATTER:
        out = values.new_zeros(values.shape[0], bins, values.shape[-1])
        return out.scatter_add_(1, index.unsqueeze(-1).expand_as(values), values)
    if form == ONE_HOT:
        return product_outside_autocast(one_hot_index(index, bins).transpose(1, 2), values)
    if form != SEGMENT:
        raise ValueError(f"form must be one of {SUM_FORMS}, got {form!r}")
    # Rows sorted by bin (stable: a bin's rows stay in their order); bin j's rows are the sorted
    # rows from ends[j - 1] to ends[j], so its sum is a difference of the running sum there.
    index, order = index.sort(dim=1, stable=True)
    values = values.gather(1, order.unsqueeze(-1).expand_as(values))
    running = torch.cat([values.new_zeros(values[:, :1].shape), values.cumsum(dim=1)], dim=1)
    bounds = torch.arange(-1, bins, device=index.device)  # ends[-1] = 0: no row below bin 0
    ends = (index.unsqueeze(-1) <= bounds).sum(dim=1)  # (B, bins + 1): rows in bins <= j
    at_ends = running.gather(1, ends.unsqueeze(-1).expand(-1, -1, values.shape[-1]))
    return at_ends[:, 1:] - at_ends[:, :-1]


def cosine_similarity(donors: Tensor, hosts: Tensor) -> Tensor:
    """Cosine similarity ``(B, Np, Nr)`` of raw token features, computed in float32.

    The ``+ eps`` on the norm (not a clamp) follows the reference code; an all-zero token gets
    similarity 0 to everything.
    """
    d = donors.float()
    h = hosts.float()
    d = d / (d.norm(dim=-1, keepdim=True) + _NORM_EPS)
    h = h / (h.norm(dim=-1, keepdim=True) + _NORM_EPS)
    return product_outside_autocast(d, h.transpose(-2, -1))


def match_hosts(similarity: Tensor) -> tuple[Tensor, Tensor]:
    """For each donor row of ``(B, Np, Nr)``: the index of its host and the similarity to it."""
    host_similarity, host_index = similarity.max(dim=-1)
    return host_index, host_similarity


def match_hosts_cosine(donors: Tensor, hosts: Tensor) -> tuple[Tensor, Tensor]:
    """``match_hosts(cosine_similarity(donors, hosts))`` without normalising the donors.

    The donor's norm is constant along its row of similarities, so it is divided out after the
    argmax instead of before: one pass over the tokens fewer. The hosts are normalised first so
    that the products stay within the donors' norms, which fp16 autocast can represent.
    """
    d = donors.float()
    h = hosts.float()
    h = h / (h.norm(dim=-1, keepdim=True) + _NORM_EPS)
    best, host_index = product_outside_autocast(d, h.transpose(-2, -1)).max(dim=-1)
    return host_index, best / (d.norm(dim=-1) + _NORM_EPS)


def fuse_into_hosts(
    hosts: Tensor,
    donors: Tensor,
    host_index: Tensor,
    host_similarity: Tensor,
    inplace: bool = False,
    form: str | None = None,
) -> Tensor:
    """Fuse donors into hosts by index scatter: O(Np * C) instead of the dense O(Np * Nr * C).

    Written as ``y_j = x_j + sum_i c_i (x_i - x_j)`` with ``c_i = w_i / (e + sum_{i->j} w_i)``,
    algebraically the paper's form: only donor-sized tensors are built, and a host without donors
    comes out bit-identical rather than ``e * x / e``. ``inplace=True`` writes into ``hosts``
    (a buffer the caller owns, float32) instead of a copy.

    ``form``: how the sums over each host's donors are taken (:func:`index_sum`; default
    :func:`sum_form`, which is the scatter except in an ONNX export).
    """
    form = form or sum_form()
    if form != SCATTER:
        return _fuse_without_scatter(hosts, donors, host_index, host_similarity, form)
    weight = host_similarity.float().exp()  # (B, Np)
    total = torch.zeros(hosts.shape[:2], dtype=torch.float32, device=hosts.device)
    total = total.scatter_add(1, host_index, weight)  # (B, Nr): sum of donor weights per host
    coefficient = weight / (total.gather(1, host_index) + SELF_WEIGHT)
    index = host_index.unsqueeze(-1).expand(-1, -1, hosts.shape[-1])
    x = hosts.float()
    contribution = (donors.float() - x.gather(1, index)).mul_(coefficient.unsqueeze(-1))
    # In place only outside autograd (the gather above saved ``x`` for its backward), and only
    # into a buffer this call may write: the caller's own (``inplace``) or the float32 copy.
    if not (torch.is_grad_enabled() and x.requires_grad) and (inplace or x is not hosts):
        return x.scatter_add_(1, index, contribution).to(hosts.dtype)
    return x.scatter_add(1, index, contribution).to(hosts.dtype)


def _fuse_without_scatter(
    hosts: Tensor, donors: Tensor, host_index: Tensor, host_similarity: Tensor, form: str
) -> Tensor:
    """:func:`fuse_into_hosts`'s arithmetic with its two scatters as :func:`index_sum` in
    ``form``; a host without donors gets exactly 0 added, so it is still unchanged bitwise."""
    weight = host_similarity.float().exp()  # (B, Np)
    bins = hosts.shape[1]
    total = index_sum(weight.unsqueeze(-1), host_index, bins, form).squeeze(-1)  # (B, Nr)
    coefficient = weight / (total.gather(1, host_index) + SELF_WEIGHT)
    x = hosts.float()
    index = host_index.unsqueeze(-1).expand(-1, -1, hosts.shape[-1])
    contribution = (donors.float() - x.gather(1, index)) * coefficient.unsqueeze(-1)
    return (x + index_sum(contribution, host_index, bins, form)).to(hosts.dtype)


def squeeze(
    hosts: Tensor,
    donors: Tensor,
    prefix: Tensor | None = None,
    return_hosts: bool = False,
    form: str | None = None,
) -> Any:
    """TPS at inference: squeeze ``(B, Np, C)`` donors into ``(B, Nr, C)`` hosts.

    With ``prefix`` ``(B, P, C)`` the result is ``cat([prefix, squeezed hosts])``, fused in place
    into the concatenation's fresh buffer rather than into a copy that is concatenated after.
    ``return_hosts``: also each donor's host, its index among ``hosts`` (B, Np). ``form``: how
    the donors are summed per host (:func:`fuse_into_hosts`).
    """
    offset = 0 if prefix is None else prefix.shape[1]
    out = hosts if prefix is None else torch.cat([prefix, hosts], dim=1)
    if donors.shape[1] == 0:
        empty = donors.new_zeros(donors.shape[:2], dtype=torch.long)
        return (out, empty) if return_hosts else out
    host_index, host_similarity = match_hosts_cosine(donors, hosts)
    out = fuse_into_hosts(
        out,
        donors,
        host_index + offset if offset else host_index,
        host_similarity,
        inplace=prefix is not None,
        form=form,
    )
    return (out, host_index) if return_hosts else out


def squeeze_dense(hosts: Tensor, donors: Tensor) -> Tensor:
    """The paper's dense form with the matching mask ``M`` (Np x Nr); equal to :func:`squeeze`."""
    similarity = cosine_similarity(donors, hosts)
    host_index, _ = match_hosts(similarity)
    match = torch.nn.functional.one_hot(host_index, hosts.shape[1]).float()  # (B, Np, Nr)
    weight = similarity.exp() * match
    numerator = SELF_WEIGHT * hosts.float() + product_outside_autocast(
        weight.transpose(1, 2), donors.float()
    )
    denominator = SELF_WEIGHT + weight.sum(dim=1)  # (B, Nr)
    return (numerator / denominator.unsqueeze(-1)).to(hosts.dtype)


_NO_MATCH = -100.0  # the official code's similarity for "cannot be this row's host"


def squeeze_masked(x: Tensor, host_mask: Tensor, donor_mask: Tensor) -> Tensor:
    """TPS in training: nothing is dropped; masks over all N tokens say who hosts and who donates.

    ``host_mask`` (B, N): tokens kept at this location; ``donor_mask`` (B, N): tokens pruned AT this
    location (earlier-dropped tokens are neither). Follows the training branch of the official
    ``TPSModule`` in its gradients as well as its forward, because a fine-tune's predictor learns
    from exactly these paths:

    - no token matches itself (the diagonal of ``c`` is -100), so a kept token, whose donor weight
      is 0 but whose straight-through gradient is not, is matched to another kept token;
    - the host mask enters only as a boolean (-100 in the columns of tokens not kept): no gradient
      reaches it here;
    - ``M_ij = [j = host(i)] * P_i`` carries the donor mask's gradient, and enters twice:
      ``W_ij = exp(M_ij c_ij) M_ij``;
    - every token ``j`` becomes ``x_j e / d_j + sum_i W_ij x_i / d_j`` with ``d_j = e + sum_i W_ij``
      (a token that hosts nobody has ``d_j = e``: unchanged), with no output gate.

    One host per donor (the first maximum), where the official ``c == max`` would split a donor
    between tied hosts. A donor with no kept token to go to is fused nowhere (the official code's
    weight there is exp(-100) * 1, i.e. 0 in float32). Computed in float32, returned in x's dtype.
    """
    n = x.shape[1]
    similarity, can_host = _masked_similarity(x, host_mask)
    host_index = similarity.argmax(dim=-1)  # (B, N)
    has_host = can_host.squeeze(1).gather(1, host_index)  # False only where nobody is kept
    match = torch.nn.functional.one_hot(host_index, n).float() * has_host.unsqueeze(-1)
    match = match * donor_mask.float().unsqueeze(-1)  # M_ij: gradient through the donor mask only
    weight = (match * similarity).exp() * match  # W_ij: donor i -> host j
    denominator = (SELF_WEIGHT + weight.sum(dim=1)).unsqueeze(-1)  # (B, N hosts, 1)
    tokens = x.float()
    fused = tokens * (SELF_WEIGHT / denominator) + product_outside_autocast(
        weight.transpose(1, 2) / denominator, tokens
    )
    return fused.to(x.dtype)


def _masked_similarity(x: Tensor, host_mask: Tensor) -> tuple[Tensor, Tensor]:
    """Cosine similarity of every token to every other that may host (-100 elsewhere: itself,
    tokens not kept), and the (B, 1, N) boolean of who may host."""
    similarity = cosine_similarity(x, x)  # (B, N donors, N hosts)
    can_host = host_mask.detach().unsqueeze(1) > 0.5  # (B, 1, N): boolean, no gradient
    itself = torch.eye(x.shape[1], dtype=torch.bool, device=x.device)
    similarity = similarity.masked_fill(itself, _NO_MATCH).masked_fill(~can_host, _NO_MATCH)
    return similarity, can_host


def masked_host_index(x: Tensor, host_mask: Tensor) -> Tensor:
    """Each token's host under :func:`squeeze_masked`'s matching (B, N): the most similar other
    token kept; what a restore after training-time squeezing reads. No gradient."""
    with torch.no_grad():
        return _masked_similarity(x, host_mask)[0].argmax(dim=-1)


def evit_fuse(donors: Tensor, donor_scores: Tensor) -> Tensor:
    """EViT: all pruned tokens become one token ``sum_i a_i x_i`` (``a`` not renormalised).
    Weighed and summed in float32 (float64 for float64 tokens) and rounded once to the tokens'
    dtype, as the squeeze's fusion is: half-precision products would round every term first."""
    wide = torch.promote_types(donors.dtype, torch.float32)  # half precision up, float64 kept
    weighted = donors.to(wide) * donor_scores.to(wide).unsqueeze(-1)
    return weighted.sum(dim=1, keepdim=True).to(donors.dtype)
