"""EViT's fused token ``sum_i a_i x_i`` is weighed and summed in float32 and rounded once to the
tokens' dtype, as the squeeze's fusion is (docs/method.md: "Similarity and fusion run in float32
and cast back"): half-precision products would round every term before the sum."""

from __future__ import annotations

import pytest
import torch

from vitcompress.method import evit_fuse


def _donors(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    donors = 3 * torch.randn(4, 60, 96, generator=generator)
    scores = torch.rand(4, 60, generator=generator) / 60  # float32, as the attention gives them
    return donors.to(dtype), scores


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_token_is_the_float32_sum_rounded_once(dtype: torch.dtype) -> None:
    donors, scores = _donors(dtype)
    got = evit_fuse(donors, scores)
    assert got.dtype == dtype and got.shape == (4, 1, 96)
    assert torch.equal(got, evit_fuse(donors.float(), scores).to(dtype))


def test_float64_tokens_keep_their_precision() -> None:
    donors, scores = _donors(torch.float64)
    got = evit_fuse(donors, scores.double())
    assert got.dtype == torch.float64
    want = (donors * scores.double().unsqueeze(-1)).sum(dim=1, keepdim=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
