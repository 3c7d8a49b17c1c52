"""Without a cls token, eTPS and EViT score a token by the mean attention it receives. The
attention hooks compute that score from the probabilities they also take the output from; it
must stay in their float32, as the cls row's score does: a half-precision score ties tokens that
the float32 one orders, and the tokens kept then depend on the grid order of the ties."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vitcompress.method import received_attention_score, split_by_score
from vitcompress.modules.attention import MHAHook, SDPAHook

HALF = [torch.bfloat16, torch.float16]


def _qk(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 65, 16, generator=generator) for _ in range(3))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _kept(scores: torch.Tensor, k: int = 45) -> list[set[int]]:
    return [set(row.tolist()) for row in split_by_score(scores, k)[0]]


@pytest.mark.parametrize("dtype", HALF)
def test_the_sdpa_hook_scores_every_query_in_float32(dtype: torch.dtype) -> None:
    q, k, v = _qk(dtype)
    out, scores = SDPAHook(prefix_tokens=1, has_cls=False, score=True)(q, k, v)
    want = received_attention_score(q, k, 1)
    assert out.dtype == dtype
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, want, atol=1e-6, rtol=1e-4)
    assert _kept(scores) == _kept(want)
    # The scores of the 64 tokens are all different, as the float32 ones are.
    assert all(row.unique().numel() == row.numel() for row in scores)


@pytest.mark.parametrize("dtype", HALF)
def test_the_multihead_attention_hook_scores_every_query_in_float32(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 2, batch_first=True).eval().to(dtype)
    x = torch.randn(2, 65, 32).to(dtype)
    out, _, scores = MHAHook(prefix_tokens=1, has_cls=False, score=True)(mha, x, x, x)
    assert out.dtype == dtype and scores.dtype == torch.float32
    # The same score from the module's own q and k.
    w_q, w_k, _ = mha.in_proj_weight.chunk(3)
    b_q, b_k, _ = mha.in_proj_bias.chunk(3)
    q = nn.functional.linear(x, w_q, b_q).reshape(2, 65, 2, 16).transpose(1, 2)
    k = nn.functional.linear(x, w_k, b_k).reshape(2, 65, 2, 16).transpose(1, 2)
    want = received_attention_score(q, k, 1)
    torch.testing.assert_close(scores, want, atol=1e-6, rtol=1e-4)
    assert _kept(scores) == _kept(want)
