"""The CUDA kernel of ``vitcompress::tome_merge`` (``kernels/triton_tome_merge.py``), run on the
CPU by Triton's interpreter (``TRITON_INTERPRET=1``) and compared with the method's path
(``tome_merge_reference``): the index and the sizes exactly, the tokens to 1e-5 (float32) or one
bfloat16 step where tokens merge, bit for bit where nothing merges (r = 0); on clustered tokens
(each source's destination clear-cut, so that a wrong one moves a token by ~1), on exact and
last-bit ties, and inside a compressed ToMe model with sharpened weights. Skipped, with the
reason, where Triton is not installed or its interpreter cannot run a kernel here.

What this cannot test: the compiled kernel on a GPU (the interpreter runs the same kernel
functions with numpy semantics, one program after another, so its atomic adds come in the
sort's order and it is bit for bit the method's; on a GPU the order of the adds into one
destination is not fixed) and its speed.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from torch import Tensor, nn

import vitcompress
from tests.models import timm_small
from tests.test_positions import sharpen
from tests.triton_interpreted import KERNELS, interpreted_module
from vitcompress.kernels import FusedKernelError, enable_fused_kernels, tome_merge
from vitcompress.kernels import tome_merge_reference as reference
from vitcompress.method import Matching, bipartite_soft_matching, merge_count, merge_tokens

SIZE = (3, 32, 32)
_MODULE = KERNELS / "triton_tome_merge.py"
_MOST = 10**6  # an r above every bound: merge_count clamps it to half the unprotected tokens


@pytest.fixture(scope="module")
def interpreted() -> Iterator[ModuleType]:
    """The kernel module under Triton's interpreter; the package's module is left as it is."""
    yield from interpreted_module(
        _MODULE,
        "_interpreted_tome_merge",
        lambda module: module.tome_merge_triton(
            torch.randn(1, 5, 4), torch.randn(1, 5, 3), None, 1, 1
        ),
    )


def _clustered(batch: int, tokens: int, channels: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """``(x, metric)``: tokens in a few clusters (centres of norm ~10, noise 0.3) and a metric
    that is a fixed projection of them: cosines within a cluster near 1, across near 0, so each
    source's destination is decisive, and a source sent to a wrong destination, or a wrong
    source merged, moves a token by ~1 (random tokens would hide an index error in the merge's
    averaging)."""
    generator = torch.Generator().manual_seed(seed)
    centres = 10 * torch.randn(batch, 4, channels, generator=generator) / channels**0.5
    which = torch.randint(0, 4, (batch, tokens), generator=generator)
    noise = 0.3 * torch.randn(batch, tokens, channels, generator=generator)
    x = centres.gather(1, which.unsqueeze(-1).expand(-1, -1, channels)) + noise
    projection = torch.randn(channels, 8, generator=generator)
    return x, x @ projection


def _sizes(batch: int, tokens: int) -> Tensor:
    """Whole sizes, as ToMe's (each token stands for 1..4 patches)."""
    generator = torch.Generator().manual_seed(2)
    return torch.randint(1, 5, (batch, tokens), generator=generator).float()


def _assert_matches(
    got: tuple[Tensor, Tensor, Tensor], want: tuple[Tensor, Tensor, Tensor]
) -> None:
    tokens, sizes, index = got
    want_tokens, want_sizes, want_index = want
    assert tokens.shape == want_tokens.shape and tokens.dtype == want_tokens.dtype
    assert torch.equal(index, want_index)
    assert sizes.dtype == torch.float32 and torch.equal(sizes, want_sizes)
    if tokens.dtype == torch.float32:
        torch.testing.assert_close(tokens, want_tokens, atol=1e-5, rtol=1e-5)
    else:
        # Both merge in float32 and round once to bf16: at most one bf16 step apart where the
        # float32 sums differ in their last bits.
        step = want_tokens.float().abs().clamp(min=1e-3) * 2**-7
        assert ((tokens.float() - want_tokens.float()).abs() <= step).all()


@pytest.mark.parametrize("shape", [(2, 23, 16), (3, 24, 32), (1, 197, 24)])
@pytest.mark.parametrize("protected", [0, 1])
@pytest.mark.parametrize("r", [1, 5, _MOST])
@pytest.mark.parametrize("with_sizes", [False, True])
def test_merged_tokens_match_the_method(
    interpreted: ModuleType, shape: tuple[int, int, int], protected: int, r: int, with_sizes: bool
) -> None:
    batch, tokens, channels = shape
    x, metric = _clustered(batch, tokens, channels)
    sizes = _sizes(batch, tokens) if with_sizes else None
    got = interpreted.tome_merge_triton(x, metric, sizes, r, protected)
    want = reference(x, metric, sizes, r, protected)
    merged = merge_count(tokens, r, protected)
    assert got[0].shape == (batch, tokens - merged, channels)
    _assert_matches(got, want)
    assert torch.equal(got[2][:, :protected], torch.arange(protected).expand(batch, -1))
    total = tokens if sizes is None else sizes.sum(dim=1)
    assert (got[1].sum(dim=1) == total).all()  # every patch is counted once


@pytest.mark.parametrize("protected", [0, 1, 2])
@pytest.mark.parametrize("with_sizes", [False, True])
def test_bfloat16_tokens_are_merged_in_float32_like_the_method(
    interpreted: ModuleType, protected: int, with_sizes: bool
) -> None:
    x, metric = _clustered(2, 25, 32)
    x, metric = x.to(torch.bfloat16), metric.to(torch.bfloat16)
    sizes = _sizes(2, 25) if with_sizes else None
    got = interpreted.tome_merge_triton(x, metric, sizes, 8, protected)
    want = reference(x, metric, sizes, 8, protected)
    assert got[0].dtype == torch.bfloat16
    _assert_matches(got, want)


@pytest.mark.parametrize("protected", [0, 1, 2])
@pytest.mark.parametrize("with_sizes", [False, True])
def test_r_0_passes_the_tokens_as_they_came_bit_for_bit(
    interpreted: ModuleType, protected: int, with_sizes: bool
) -> None:
    """r = 0 (or a clamp to 0: two tokens, both protected) merges nothing: the method's
    ``merge_tokens`` on the empty matching, bit for bit (the reference and the op's wrapper
    say ``None`` there, before any kernel)."""
    x, metric = _clustered(2, 11, 16)
    sizes = _sizes(2, 11) if with_sizes else None
    tokens, new_sizes, index = interpreted.tome_merge_triton(x, metric, sizes, 0, protected)
    want = merge_tokens(
        x,
        torch.ones(2, 11) if sizes is None else sizes,
        bipartite_soft_matching(metric, 0, protected),
    )
    assert torch.equal(tokens, want[0]) and tokens.data_ptr() != x.data_ptr()
    assert torch.equal(new_sizes, want[1]) and torch.equal(index, want[2])
    assert reference(x, metric, sizes, 0, protected) is None
    clamped = interpreted.tome_merge_triton(x[:, :2], metric[:, :2], None, 3, 2)
    assert torch.equal(clamped[0], x[:, :2]) and clamped[2].tolist() == [[0, 1], [0, 1]]


def test_a_wrong_destination_or_source_would_fail_the_comparison(interpreted: ModuleType) -> None:
    """The comparison can fail: the method's merge with one source sent to another destination,
    or with the 5th best source kept and the 6th merged in its place, is far outside the
    tolerance (the swap changes the index too) on these tokens."""
    x, metric = _clustered(2, 23, 16)
    tokens, sizes, index = interpreted.tome_merge_triton(x, metric, None, 5, 1)
    ones = torch.ones(2, 23)
    matching = bipartite_soft_matching(metric, 5, 1)
    _assert_matches((tokens, sizes, index), merge_tokens(x, ones, matching))
    pairs = 23 // 2  # protected = 1 protects no b token: any destination may be taken
    wrong_dst = matching.dst.clone()
    wrong_dst[:, 0] = (wrong_dst[:, 0] + pairs // 2) % pairs
    wrong = merge_tokens(x, ones, matching._replace(dst=wrong_dst))[0]
    assert (tokens - wrong).abs().max() > 0.1
    six = bipartite_soft_matching(metric, 6, 1)  # its first five sources are the five above
    assert torch.equal(six.src[:, :5], matching.src)
    swapped = Matching(
        src=six.src[:, [0, 1, 2, 3, 5]],
        dst=six.dst[:, [0, 1, 2, 3, 5]],
        unmerged=torch.cat([six.unmerged, six.src[:, 4:5]], dim=1).sort(dim=1).values,
        protected=1,
    )
    other_tokens, _, other_index = merge_tokens(x, ones, swapped)
    assert not torch.equal(index, other_index)
    assert (tokens - other_tokens).abs().max() > 0.1


def test_exact_ties_go_to_the_earlier_token_as_in_the_method(interpreted: ModuleType) -> None:
    """One-hot metric rows (cosines exactly 0 or 1): a0, a1 and a2 each have two best
    destinations (b0 and b1 both equal them); each goes to the first (b0), and of three equal
    best scores r = 2 merges the earlier two (a0, a1); a3 matches nothing better than 0."""
    e = torch.eye(3)
    # tokens: a0 b0 a1 b1 a2 b2 a3
    metric = torch.stack([e[0], e[0], e[0], e[0], e[0], e[1], e[2]]).unsqueeze(0)
    x = torch.arange(7.0).view(1, 7, 1).expand(-1, -1, 2).contiguous()
    tokens, sizes, index = interpreted.tome_merge_triton(x, metric, None, 2, 0)
    assert index.tolist() == [[4, 6, 1, 3, 5]]  # a2 and a3 kept, then b0, b1, b2
    assert sizes.tolist() == [[1.0, 1.0, 3.0, 1.0, 1.0]]  # a0 and a1 into b0
    assert tokens[0, :, 0].tolist() == [4.0, 6.0, (0 + 1 + 2) / 3, 3.0, 5.0]
    _assert_matches((tokens, sizes, index), reference(x, metric, None, 2, 0))


@pytest.mark.parametrize("protected", [0, 1, 3])
def test_last_bit_ties_of_near_copies_match_the_method(
    interpreted: ModuleType, protected: int
) -> None:
    """Every metric row four times (near copies of tokens, as a flat region of an image gives):
    each best score is a row's cosine with its own copy, 1 up to its last bits, and the sort's
    order is those bits: the kernel takes the method's norm and product for that."""
    generator = torch.Generator().manual_seed(3)
    metric = torch.randn(2, 5, 8, generator=generator).repeat(1, 4, 1)
    x = torch.randn(2, 20, 16, generator=generator)
    got = interpreted.tome_merge_triton(x, metric, None, 7, protected)
    _assert_matches(got, reference(x, metric, None, 7, protected))


def test_a_nan_metric_row_merges_first_as_in_the_method(interpreted: ModuleType) -> None:
    """A NaN score is ``torch.max``'s maximum (its first NaN) and the sort's first: the token of
    a NaN metric row is merged first, into b 0; a zero row (norm clamped) scores 0."""
    x, metric = _clustered(2, 21, 16)
    metric[0, 6] = float("nan")
    metric[1, 9, 2] = float("nan")  # an odd token: every a token's score against it is NaN
    metric[1, 4] = 0.0
    got = interpreted.tome_merge_triton(x, metric, None, 4, 1)
    want = reference(x, metric, None, 4, 1)
    _assert_matches(got, want)
    assert 6 not in got[2][0].tolist()


def test_bad_shapes_are_refused(interpreted: ModuleType) -> None:
    with pytest.raises(ValueError, match="metric"):
        interpreted.tome_merge_triton(torch.randn(1, 5, 4), torch.randn(1, 4, 3), None, 1, 0)
    with pytest.raises(ValueError, match="sizes"):
        interpreted.tome_merge_triton(
            torch.randn(1, 5, 4), torch.randn(1, 5, 3), torch.ones(5), 1, 0
        )
    with pytest.raises(ValueError, match="protected"):
        interpreted.tome_merge_triton(torch.randn(1, 5, 4), torch.randn(1, 5, 3), None, 1, 6)


def test_off_the_cpu_and_cuda_the_op_is_refused_in_one_line() -> None:
    x = torch.empty(1, 5, 4, device="meta")
    with pytest.raises(FusedKernelError, match="CPU only, or on CUDA"):
        tome_merge(x, torch.empty(1, 5, 3, device="meta"), None, 1)


def _compressed_tome() -> nn.Module:
    torch.manual_seed(0)
    base = sharpen(timm_small("vit_small_patch16_224"))
    return vitcompress.compress(base, "tome", keep=0.7, locs=[1], input_size=SIZE).eval()


def test_a_compressed_tome_model_on_the_kernel_gives_the_methods_logits(
    interpreted: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ToMe's reducers (blocks 1 to 3, a class token protected, sizes from the second on) hand
    their step to the interpreted kernel in place of the CPU op: the logits are the method
    path's to 1e-5 of their scale."""
    import vitcompress.variants.fuses as fuses

    calls: list[int] = []

    def on_the_triton_kernel(x, metric, sizes, r, protected=0):
        r = merge_count(x.shape[1], r, protected)
        if r == 0:  # as the op's wrapper: nothing merges, the reducer keeps its tokens
            return None
        calls.append(r)
        return interpreted.tome_merge_triton(x, metric, sizes, r, protected)

    model = _compressed_tome()
    x = torch.randn(2, *SIZE)
    with torch.inference_mode():
        enable_fused_kernels(model, False)
        want = model(x)
        monkeypatch.setattr(fuses, "tome_merge", on_the_triton_kernel)
        enable_fused_kernels(model)
        got = model(x)
    assert len(calls) == 3  # blocks 1, 2 and 3 merged on the kernel
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
