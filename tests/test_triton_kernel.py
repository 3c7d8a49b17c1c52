"""The CUDA kernel of ``vitcompress::select_squeeze`` (``kernels/triton_select_squeeze.py``), run
on the CPU by Triton's interpreter (``TRITON_INTERPRET=1``) and compared with the method's path:
bit for bit where nothing is squeezed (keep 1, or DynamicViT's drop), to 1e-5 at keep 0.7, on
sharpened tokens and inside compressed models with sharpened weights. Skipped, with the reason,
where Triton is not installed or its interpreter cannot run a kernel here.

What this cannot test: the compiled kernel on a GPU (the interpreter runs the same kernel
functions with numpy semantics) and its speed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from torch import nn

import vitcompress
from tests.models import timm_small
from tests.test_positions import sharpen
from tests.triton_interpreted import KERNELS, interpreted_module
from vitcompress.kernels import enable_fused_kernels, select_squeeze_reference

SIZE = (3, 32, 32)
_MODULE = KERNELS / "triton_select_squeeze.py"


@pytest.fixture(scope="module")
def interpreted() -> Iterator[ModuleType]:
    """The kernel module under Triton's interpreter; the package's module is left as it is."""
    yield from interpreted_module(
        _MODULE,
        "_interpreted_select_squeeze",
        lambda module: module.select_squeeze_triton(
            torch.randn(1, 3, 4), torch.randn(1, 3), 0, 2, True
        ),
    )


def _sharpened_tokens(batch: int, prefix: int, patches: int, channels: int) -> torch.Tensor:
    """Tokens in a few tight clusters of large norm: each donor's host is clear-cut and its
    weight exp(similarity) near e, so a donor sent to a wrong host moves a token by ~10."""
    generator = torch.Generator().manual_seed(1)
    centres = 10 * torch.randn(batch, 5, channels, generator=generator)
    which = torch.randint(0, 5, (batch, prefix + patches), generator=generator)
    noise = torch.randn(batch, prefix + patches, channels, generator=generator)
    return centres.gather(1, which.unsqueeze(-1).expand(-1, -1, channels)) + noise


@pytest.mark.parametrize("prefix", [0, 1, 2])
@pytest.mark.parametrize("squeeze", [True, False])
def test_keep_1_is_the_methods_result_bit_for_bit(
    interpreted: ModuleType, prefix: int, squeeze: bool
) -> None:
    x = _sharpened_tokens(3, prefix, 20, 24)
    scores = torch.randn(3, 20)
    tokens, keep_index = interpreted.select_squeeze_triton(x, scores, prefix, 20, squeeze)
    want_tokens, want_index = select_squeeze_reference(x, scores, prefix, 20, squeeze)
    assert torch.equal(keep_index, want_index) and torch.equal(tokens, want_tokens)
    assert not torch.equal(keep_index, torch.arange(20).expand(3, -1))  # the sort re-ordered


@pytest.mark.parametrize("prefix", [0, 1, 2])
@pytest.mark.parametrize("keep", [1, 7, 14])  # 14 of 20: keep 0.7
@pytest.mark.parametrize("sharpened", [True, False])
def test_squeezed_tokens_match_the_method(
    interpreted: ModuleType, prefix: int, keep: int, sharpened: bool
) -> None:
    x = _sharpened_tokens(3, prefix, 20, 24) if sharpened else torch.randn(3, prefix + 20, 24)
    scores = torch.randn(3, 20)
    tokens, keep_index = interpreted.select_squeeze_triton(x, scores, prefix, keep, True)
    want_tokens, want_index = select_squeeze_reference(x, scores, prefix, keep, True)
    assert tokens.shape == (3, prefix + keep, 24) and tokens.dtype == x.dtype
    assert torch.equal(keep_index, want_index)
    torch.testing.assert_close(tokens, want_tokens, atol=1e-5, rtol=1e-5)
    dropped, _ = select_squeeze_reference(x, scores, prefix, keep, False)
    assert (tokens - dropped).abs().max() > 1e-2  # the donors did reach their hosts


def test_drop_keeps_the_best_tokens_in_score_order(interpreted: ModuleType) -> None:
    x = torch.randn(2, 1 + 9, 8)
    scores = torch.tensor([[0.0, 5, 1, 4, 2, 3, 8, 7, 6], [1.0, 1, 1, 1, 0, 0, 0, 0, 2]])
    tokens, keep_index = interpreted.select_squeeze_triton(x, scores, 1, 4, False)
    assert keep_index.tolist() == [[6, 7, 8, 1], [8, 0, 1, 2]]  # ties keep their order
    assert torch.equal(tokens[:, 0], x[:, 0])
    assert torch.equal(tokens[:, 1:], x[:, 1:].gather(1, keep_index[..., None].expand(-1, -1, 8)))


def nan_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (2, 1 + 12, 8) and scores where image 0's third host has a NaN channel (every
    donor's product with it is NaN: ``torch.max`` sends them all to it, its first NaN) and image
    1's first donor is NaN (its whole row is: it goes to host 0), at keep 5."""
    x = _sharpened_tokens(2, 1, 12, 8)
    scores = torch.arange(12.0).flip(0).repeat(2, 1)  # patch i ranks i-th
    x[0, 1 + 2, 3] = float("nan")
    x[1, 1 + 5] = float("nan")
    return x, scores


def test_a_nan_product_is_the_maximum_as_in_the_method(interpreted: ModuleType) -> None:
    x, scores = nan_tokens()
    tokens, keep_index = interpreted.select_squeeze_triton(x, scores, 1, 5, True)
    want_tokens, want_index = select_squeeze_reference(x, scores, 1, 5, True)
    assert torch.equal(keep_index, want_index)
    torch.testing.assert_close(tokens, want_tokens, atol=1e-5, rtol=1e-5, equal_nan=True)
    # Image 0: only the NaN host took donors; image 1: the NaN donor made host 0 NaN alone.
    assert tokens[0, 1 + 2].isnan().all() and not tokens[0, [0, 1, 2, 4, 5]].isnan().any()
    assert tokens[1, 1].isnan().all() and not tokens[1, 2:].isnan().any()


def test_half_precision_is_squeezed_in_float32_like_the_method(interpreted: ModuleType) -> None:
    x = _sharpened_tokens(2, 1, 30, 32).to(torch.bfloat16)
    scores = torch.randn(2, 30)
    tokens, _ = interpreted.select_squeeze_triton(x, scores, 1, 21, True)
    want, _ = select_squeeze_reference(x, scores, 1, 21, True)
    assert tokens.dtype == torch.bfloat16
    # Both add in float32 and round once to bf16: at most one bf16 step apart where the float32
    # sums differ in their last bits.
    step = want.float().abs().clamp(min=1e-3) * 2**-7
    assert ((tokens.float() - want.float()).abs() <= step).all()


def test_a_bad_keep_count_is_refused(interpreted: ModuleType) -> None:
    with pytest.raises(ValueError, match="keep_tokens"):
        interpreted.select_squeeze_triton(torch.randn(1, 5, 4), torch.randn(1, 4), 1, 5, True)


def _compressed(variant: str, keep: float) -> nn.Module:
    torch.manual_seed(0)
    base = sharpen(timm_small("vit_small_patch16_224"))
    return vitcompress.compress(base, variant, keep=keep, locs=[1, 2], input_size=SIZE).eval()


@pytest.mark.parametrize("variant", ["dtps", "etps", "dynamicvit"])
@pytest.mark.parametrize("keep", [1.0, 0.7])
def test_a_compressed_model_on_the_kernel_gives_the_methods_logits(
    interpreted: ModuleType, monkeypatch: pytest.MonkeyPatch, variant: str, keep: float
) -> None:
    """The reducers hand their step to the interpreted kernel (in place of the CPU op): the
    logits are the method path's, bit for bit at keep 1 (dTPS re-sorts every token there)."""
    import vitcompress.variants.fuses as fuses

    calls: list[int] = []

    def on_the_triton_kernel(x, scores, prefix_tokens, keep_tokens, squeeze=True):
        calls.append(keep_tokens)
        return interpreted.select_squeeze_triton(x, scores, prefix_tokens, keep_tokens, squeeze)

    model = _compressed(variant, keep)
    x = torch.randn(2, *SIZE)
    with torch.inference_mode():
        enable_fused_kernels(model, False)
        want = model(x)
        monkeypatch.setattr(fuses, "select_squeeze", on_the_triton_kernel)
        enable_fused_kernels(model)
        got = model(x)
    expected_calls = 2 if variant != "etps" or keep < 1 else 0  # eTPS at keep 1 prunes nothing
    assert len(calls) == expected_calls
    if keep == 1.0:
        assert torch.equal(got, want)
    else:
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_the_ops_have_cuda_kernels_and_importing_them_loads_no_triton_kernel_module() -> None:
    """The Triton modules are imported by the ops' CUDA implementations when they first run: a
    CPU-only process that uses the kernels never loads them."""
    import vitcompress.kernels  # noqa: F401 - registers the ops

    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has_kernel("vitcompress::select_squeeze", "CUDA")
    assert has_kernel("vitcompress::tome_merge", "CUDA")
    assert "vitcompress.kernels.triton_select_squeeze" not in sys.modules
    assert "vitcompress.kernels.triton_tome_merge" not in sys.modules
