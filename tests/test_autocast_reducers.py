"""The reducers under autocast compute as without it: their similarity and score sums stay in
float32 (no cast of float32 tokens to bfloat16 for a product, no bfloat16 score cast back), the
fused kernels run, and autocast adds no op to a location beyond the casts it makes for the
method's own layers.

Under ``torch.autocast`` a timm ViT's residual stream stays float32 (a bfloat16 branch added to
a float32 stream is float32), so that is what the reducers receive; the attention's q, k and
ToMe's metric arrive in bfloat16 from autocast's linear layers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitcompress
from tests.models import timm_small
from tests.op_count import deit_small_ops_per_location
from tests.test_positions import sharpen
from vitcompress.kernels import (
    enable_fused_kernels,
    fused_kernels_available,
    select_squeeze,
    tome_merge,
)
from vitcompress.method import (
    bipartite_soft_matching,
    cls_attention_score,
    received_attention_score,
    squeeze,
)

SIZE = (3, 32, 32)


def _autocast() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _clustered(batch: int, tokens: int, channels: int) -> torch.Tensor:
    """Tokens around a few centres: each pruned token has a clear host, which a bfloat16
    similarity (8 bits of mantissa) would still blur between two near ones."""
    generator = torch.Generator().manual_seed(2)
    centres = 10 * torch.randn(batch, 6, channels, generator=generator)
    which = torch.randint(0, 6, (batch, tokens), generator=generator)
    noise = torch.randn(batch, tokens, channels, generator=generator)
    return centres.gather(1, which.unsqueeze(-1).expand(-1, -1, channels)) + noise


def test_squeeze_under_autocast_is_the_float32_squeeze() -> None:
    x = _clustered(2, 1 + 40, 32)
    prefix, hosts, donors = x[:, :1], x[:, 1:29], x[:, 29:]
    want, want_hosts = squeeze(hosts, donors, prefix, return_hosts=True)
    with _autocast():
        got, got_hosts = squeeze(hosts, donors, prefix, return_hosts=True)
    assert got.dtype == torch.float32
    assert torch.equal(got_hosts, want_hosts) and torch.equal(got, want)


def test_tome_matching_under_autocast_is_the_float32_matching() -> None:
    metric = torch.randn(2, 41, 16).bfloat16()  # autocast's linear layers give bfloat16 keys
    want = bipartite_soft_matching(metric, 12, protected=1)
    with _autocast():
        got = bipartite_soft_matching(metric, 12, protected=1)
    assert torch.equal(got.src, want.src) and torch.equal(got.dst, want.dst)


@pytest.mark.parametrize("score", [cls_attention_score, received_attention_score])
def test_attention_scores_stay_float32_under_autocast(score) -> None:  # noqa: ANN001
    q = (3 * torch.randn(2, 4, 17, 8)).bfloat16()
    k = (3 * torch.randn(2, 4, 17, 8)).bfloat16()
    want = score(q, k, 1)
    with _autocast():
        got = score(q, k, 1)
    assert want.dtype == got.dtype == torch.float32  # the softmax's dtype, not cast back
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.unique(got).numel() == got.numel()  # float32 ties no tokens bfloat16 would


@pytest.mark.skipif(not fused_kernels_available(), reason="the fused kernels cannot be built here")
def test_fused_kernels_run_under_autocast_as_without() -> None:
    """Autocast cast the kernels' own batched product to bfloat16, which they read as float32
    (an error): they run their ATen calls outside it."""
    x = _clustered(2, 1 + 40, 32)
    scores = torch.randn(2, 40)
    metric = torch.randn(2, 41, 16).bfloat16()
    with torch.inference_mode():
        want = select_squeeze(x, scores, 1, 28)
        want_merge = tome_merge(x, metric, None, 12, 1)
        with _autocast():
            got = select_squeeze(x, scores, 1, 28)
            got_merge = tome_merge(x, metric, None, 12, 1)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(torch.equal(g, w) for g, w in zip(got_merge, want_merge, strict=True))


def _deviation(model: nn.Module, x: torch.Tensor) -> float:
    """How far autocast moves ``model``'s logits, relative to their largest."""
    with torch.inference_mode():
        want = model(x)
        with _autocast():
            got = model(x)
    return ((got.float() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("name", ["vit_small_patch16_224", "deit3_small_patch16_224"])
@pytest.mark.parametrize("variant", ["etps", "evit", "tome"])
def test_a_compressed_model_under_autocast_stays_as_near_as_its_base(
    name: str, variant: str
) -> None:
    """Sharpened weights, keep 0.7 at blocks 1 and 2 (ToMe from block 1), batch 8. Autocast moves
    the bases' logits by 7.9e-3 and 1.0e-2 of their largest; the compressed models', measured:
    eTPS 1.2e-2 and 8.9e-3, EViT 1.3e-2 and 1.4e-2, ToMe 8.4e-3 and 1.0e-2 (with the similarity
    and the scores in bfloat16, as autocast made them before: 2.0e-2 and 2.1e-2, 1.8e-2 and
    1.6e-2, 6.7e-3 and 1.9e-2). The bound: twice the base's. (dTPS and DynamicViT score with
    the predictor's layers, which autocast runs in bfloat16 like every layer of the model: a
    token near the cut changes sides, a difference in kind the bound does not describe.)"""
    torch.manual_seed(0)
    base = sharpen(timm_small(name))
    x = torch.randn(8, *SIZE)
    allowed = 2 * _deviation(base, x)
    torch.manual_seed(0)
    model = vitcompress.compress(
        sharpen(timm_small(name)), variant, keep=0.7, locs=[1, 2], input_size=SIZE
    ).eval()
    enable_fused_kernels(model, False)
    assert _deviation(model, x) <= allowed


# Per location, the ops autocast may add to a method's: the casts it makes for the method's own
# layers, as for every layer of the base. dTPS and DynamicViT: the predictor's Linear layers (its
# inputs and weights to bfloat16); eTPS and EViT: the attention's cls row to float32 for the
# softmax; ToMe: its keys to float32 for the similarity and the size bias to the attention's
# bfloat16 (every block after the first). Before the products ran outside autocast: dTPS 12,
# eTPS 4, EViT 3, ToMe 3.9.
AUTOCAST_CASTS = {"dtps": 10, "dynamicvit": 10, "etps": 1, "evit": 1, "tome": 2}


@pytest.mark.parametrize("method", sorted(AUTOCAST_CASTS))
def test_autocast_adds_only_its_own_casts_to_a_location(method: str) -> None:
    """deit_small, blocks 3, 6, 9, keep 0.7 (ToMe r = 13 per block), the method's ops."""
    plain = deit_small_ops_per_location(method, fused=False)
    under_autocast = deit_small_ops_per_location(method, fused=False, autocast=True)
    added = under_autocast - plain  # a mean over the locations: float rounding aside
    assert -1e-9 <= added <= AUTOCAST_CASTS[method] + 1e-9
