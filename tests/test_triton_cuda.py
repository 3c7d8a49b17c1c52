"""The Triton kernels compiled and run on a GPU (``vitcompress::select_squeeze`` and
``vitcompress::tome_merge`` on CUDA tensors) against the method's ops on the same device: what
the interpreter tests (tests/test_triton_kernel.py, tests/test_triton_tome.py) cannot check, the
compiled code. Skipped, with the reason, where there is no CUDA device or no Triton: CI never
has one; ``PARTS=kernels bash benchmarks/gpu_checks.sh`` runs it where a GPU is lent.

On a GPU the atomic adds sum a host's (a destination's) contributions in no fixed order, so
squeezed and merged tokens equal the method's to float32 rounding; the indices, the sizes and
every token nothing was added into are exact."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import vitcompress
from tests.models import timm_small
from tests.test_positions import sharpen
from tests.test_triton_kernel import _sharpened_tokens, nan_tokens
from tests.test_triton_tome import _clustered
from vitcompress.kernels import (
    enable_fused_kernels,
    select_squeeze,
    select_squeeze_reference,
    tome_merge,
    tome_merge_reference,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="needs a CUDA device and Triton: the compiled kernels run on a GPU only",
)

SIZE = (3, 32, 32)
CUDA = "cuda"


@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("keep", [20, 14, 5])  # of 20: keep 1, 0.7 and 0.25
@pytest.mark.parametrize("squeeze", [True, False])
def test_select_squeeze_on_cuda_is_the_methods(prefix: int, keep: int, squeeze: bool) -> None:
    x = _sharpened_tokens(4, prefix, 20, 64).to(CUDA)
    scores = torch.randn(4, 20, generator=torch.Generator().manual_seed(2)).to(CUDA)
    tokens, keep_index = select_squeeze(x, scores, prefix, keep, squeeze)
    want_tokens, want_index = select_squeeze_reference(x, scores, prefix, keep, squeeze)
    assert tokens.device.type == CUDA
    assert torch.equal(keep_index, want_index)
    if keep == 20 or not squeeze:  # nothing added: a gather, exact
        assert torch.equal(tokens, want_tokens)
    else:
        torch.testing.assert_close(tokens, want_tokens, atol=1e-5, rtol=1e-5)


def test_a_nan_product_on_cuda_is_the_maximum_as_in_the_method() -> None:
    """The compiled reduction's NaN handling (``kernels/triton_rows.first_max``): the
    interpreter's numpy argmax finds a first NaN by itself, a GPU's reduction tree need not."""
    x, scores = (t.to(CUDA) for t in nan_tokens())
    tokens, keep_index = select_squeeze(x, scores, 1, 5, True)
    want_tokens, want_index = select_squeeze_reference(x, scores, 1, 5, True)
    assert torch.equal(keep_index, want_index)
    torch.testing.assert_close(tokens, want_tokens, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sizes", [False, True])
@pytest.mark.parametrize("tokens,r,protected", [(23, 5, 1), (24, 10**6, 0), (197, 13, 1)])
def test_tome_merge_on_cuda_is_the_methods(
    dtype: torch.dtype, sizes: bool, tokens: int, r: int, protected: int
) -> None:
    x, metric = _clustered(3, tokens, 32)
    token_sizes = torch.randint(1, 4, (3, tokens)).float() if sizes else None
    x, metric = x.to(CUDA, dtype), metric.to(CUDA)
    token_sizes = None if token_sizes is None else token_sizes.to(CUDA)
    got = tome_merge(x, metric, token_sizes, r, protected)
    want = tome_merge_reference(x, metric, token_sizes, r, protected)
    assert got is not None and want is not None
    assert torch.equal(got[2], want[2])  # the index: which token went where
    torch.testing.assert_close(got[1], want[1].float(), atol=0, rtol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    else:  # both merge in float32 and round once: at most one bf16 step apart
        step = want[0].float().abs().clamp(min=1e-3) * 2**-7
        assert ((got[0].float() - want[0].float()).abs() <= step).all()


def _compressed(variant: str, keep: float) -> nn.Module:
    torch.manual_seed(0)
    base = sharpen(timm_small("vit_small_patch16_224"))
    model = vitcompress.compress(base, variant, keep=keep, locs=[1, 2], input_size=SIZE)
    return model.eval().to(CUDA)


@pytest.mark.parametrize("variant", ["dtps", "etps", "dynamicvit", "tome"])
@pytest.mark.parametrize("keep", [1.0, 0.7])
def test_a_compressed_model_on_the_cuda_kernels_gives_the_methods_logits(
    variant: str, keep: float
) -> None:
    """The fused-kernel switch on (``--fused-kernels``) against the method's ops, on sharpened
    weights: at keep 1 the selection fuses nothing (bit for bit, ToMe merging nothing); at 0.7
    within 1e-5 of the logits' scale."""
    model = _compressed(variant, keep)
    x = torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(3)).to(CUDA)
    with torch.inference_mode():
        enable_fused_kernels(model, False)
        want = model(x)
        assert enable_fused_kernels(model) > 0
        got = model(x)
    if keep == 1.0:
        assert torch.equal(got, want)
    else:
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize(
    ("variant", "fused_op"),
    [
        ("dtps", "vitcompress.select_squeeze"),
        ("etps", "vitcompress.select_squeeze"),
        ("tome", "vitcompress.tome_merge"),
        ("dynamicvit", None),
    ],
)
def test_the_cuda_default_runs_the_kernel_where_it_squeezes_or_merges(
    variant: str, fused_op: str | None
) -> None:
    """With the switch left at its default, a compressed model on CUDA runs the Triton kernel
    for dTPS, eTPS and ToMe (faster than the method's ops there) and the method's ops for
    DynamicViT (its selection alone is not)."""
    from tests.op_count import count_ops

    counts = count_ops(_compressed(variant, 0.7), torch.randn(2, *SIZE, device=CUDA))
    fused = {name: n for name, n in counts.items() if name.startswith("vitcompress.")}
    assert fused == ({fused_op: fused[fused_op]} if fused_op else {})
    assert not fused_op or fused[fused_op] > 0
