"""The method's pure tensor functions against hand computation and the paper's equations."""

import math

import pytest
import torch

from vitcompress.method import (
    cls_attention_score,
    cosine_similarity,
    evit_fuse,
    gather_tokens,
    keep_count,
    masked_softmax,
    match_hosts,
    match_hosts_cosine,
    scatter_tokens,
    split_by_score,
    squeeze,
    squeeze_dense,
    squeeze_masked,
)


def test_squeeze_hand_computed():
    # Two hosts on the axes; donors (2, 1) and (3, 1) both lie closer to host 0, (0, 5) to host 1.
    hosts = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]])
    donors = torch.tensor([[[2.0, 1.0], [3.0, 1.0], [0.0, 5.0]]])
    c_a, c_b, c_c = 2 / math.sqrt(5), 3 / math.sqrt(10), 1.0
    w_a, w_b, w_c = math.exp(c_a), math.exp(c_b), math.exp(c_c)
    e = math.e
    host0 = [(e * 1 + w_a * 2 + w_b * 3) / (e + w_a + w_b), (w_a * 1 + w_b * 1) / (e + w_a + w_b)]
    host1 = [0.0, (e * 1 + w_c * 5) / (e + w_c)]
    expected = torch.tensor([[host0, host1, [-1.0, 0.0]]])  # host 2 has no donor: unchanged
    torch.testing.assert_close(squeeze(hosts, donors), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(squeeze_dense(hosts, donors), expected, atol=1e-5, rtol=1e-5)


def test_hosts_without_donors_are_unchanged_bitwise():
    torch.manual_seed(0)
    hosts = torch.randn(2, 10, 16)
    donors = hosts[:, :3] * 2.0  # every donor is parallel to one of the first three hosts
    out = squeeze(hosts, donors)
    assert torch.equal(out[:, 3:], hosts[:, 3:])
    assert not torch.allclose(out[:, :3], hosts[:, :3])


def test_scatter_and_dense_squeeze_agree_on_random_batches():
    torch.manual_seed(1)
    hosts, donors = torch.randn(4, 30, 24), torch.randn(4, 20, 24)
    torch.testing.assert_close(squeeze(hosts, donors), squeeze_dense(hosts, donors))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_squeeze_low_precision_matches_float32(dtype):
    torch.manual_seed(2)
    hosts, donors = torch.randn(2, 12, 32), torch.randn(2, 8, 32)
    low = squeeze(hosts.to(dtype), donors.to(dtype))
    assert low.dtype == dtype
    torch.testing.assert_close(low.float(), squeeze(hosts, donors), atol=3e-2, rtol=3e-2)


def test_host_matching_without_normalised_donors_equals_cosine_argmax():
    torch.manual_seed(3)
    hosts, donors = torch.randn(3, 25, 16) * 5, torch.randn(3, 11, 16) * 0.1
    index, similarity = match_hosts_cosine(donors, hosts)
    ref_index, ref_similarity = match_hosts(cosine_similarity(donors, hosts))
    assert torch.equal(index, ref_index)
    torch.testing.assert_close(similarity, ref_similarity)


@pytest.mark.parametrize("grad", [False, True])
def test_squeeze_with_prefix_is_the_concatenation_and_leaves_its_inputs(grad):
    torch.manual_seed(4)
    prefix, hosts, donors = torch.randn(2, 2, 8), torch.randn(2, 9, 8), torch.randn(2, 5, 8)
    copies = [t.clone() for t in (prefix, hosts, donors)]
    if grad:
        for t in (prefix, hosts, donors):
            t.requires_grad_(True)
    out = squeeze(hosts, donors, prefix)
    torch.testing.assert_close(out, torch.cat([prefix, squeeze_dense(hosts, donors)], 1))
    for given, copy in zip((prefix, hosts, donors), copies, strict=True):
        assert torch.equal(given.detach(), copy)
    if grad:
        out.square().sum().backward()
        assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (prefix, hosts, donors))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_squeeze_under_autocast_with_large_tokens_stays_finite(dtype):
    # Residual streams reach norms in the hundreds; raw dot products of such tokens overflow fp16.
    torch.manual_seed(5)
    hosts, donors = torch.randn(2, 12, 64) * 200, torch.randn(2, 6, 64) * 200
    with torch.autocast("cpu", dtype=dtype):
        out = squeeze(hosts, donors)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), squeeze_dense(hosts, donors), atol=2.0, rtol=2e-2)


def test_squeeze_masked_equals_physical_squeeze_and_leaves_others():
    torch.manual_seed(3)
    x = torch.randn(3, 16, 8)
    previous = torch.ones(3, 16)
    previous[:, 12:] = 0.0  # dropped at an earlier location: neither host nor donor
    kept = (torch.rand(3, 16) > 0.5).float() * previous
    kept[:, 0] = 1.0
    donors = (1.0 - kept) * previous
    out = squeeze_masked(x, kept, donors)
    for b in range(3):
        host_idx = kept[b].bool()
        donor_idx = donors[b].bool()
        expected = squeeze(x[b : b + 1, host_idx], x[b : b + 1, donor_idx])[0]
        torch.testing.assert_close(out[b, host_idx], expected)
        torch.testing.assert_close(out[b, ~host_idx], x[b, ~host_idx])


def test_squeeze_masked_gradient_reaches_masks():
    torch.manual_seed(4)
    x = torch.randn(2, 10, 8)
    logits = torch.randn(2, 10, requires_grad=True)
    hard = (logits > 0).float() + torch.sigmoid(logits) - torch.sigmoid(logits).detach()
    out = squeeze_masked(x, hard, 1.0 - hard)
    out.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_keep_counts_follow_the_reference_code():
    assert [keep_count(196, 0.7**s, "floor") for s in (1, 2, 3)] == [137, 96, 67]
    n, counts = 196, []
    for _ in range(3):
        n = keep_count(n, 0.7, "ceil")
        counts.append(n)
    assert counts == [138, 97, 68]
    assert keep_count(10, 0.01, "floor") == 1  # never zero tokens


def test_split_keeps_original_indices_in_score_order():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.7]])
    keep, prune = split_by_score(scores, 2)
    assert keep.tolist() == [[1, 3]] and prune.tolist() == [[2, 0]]


def test_scatter_then_gather_returns_kept_tokens_and_zero_elsewhere():
    torch.manual_seed(5)
    tokens = torch.randn(2, 5, 4)
    index = torch.stack([torch.randperm(9)[:5] for _ in range(2)])
    grid = scatter_tokens(tokens, index, 9)
    assert torch.equal(gather_tokens(grid, index), tokens)
    dropped = torch.ones(2, 9, dtype=torch.bool).scatter(1, index, False)
    assert torch.count_nonzero(grid[dropped]) == 0


def test_cls_attention_score_is_the_head_mean_cls_row():
    torch.manual_seed(6)
    q, k = torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4)
    probs = (q @ k.transpose(-2, -1) / 2.0).softmax(-1)
    expected = probs[:, :, 0, 2:].mean(1)
    torch.testing.assert_close(cls_attention_score(q, k, prefix_tokens=2), expected)


def test_masked_softmax_gives_dropped_keys_no_weight_but_keeps_diagonal():
    torch.manual_seed(7)
    logits = torch.randn(1, 2, 5, 5)
    keep = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0]])
    probs = masked_softmax(logits, keep)
    assert probs[0, :, [0, 1, 3], 2].max() < 1e-5  # nobody but itself attends to a dropped key
    assert probs[0, :, 2, 2].min() > 1e-3  # a dropped token still attends to itself
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 2, 5), atol=1e-5, rtol=0)
    full = masked_softmax(logits, torch.ones(1, 5))
    torch.testing.assert_close(full, logits.softmax(-1), atol=1e-5, rtol=1e-5)


def test_masked_softmax_ignores_a_dropped_outlier_key():
    # A dropped key 200 above the rest (a high-norm outlier token): shifting by the max over all
    # keys would underflow every kept weight and leave a uniform row over all keys.
    torch.manual_seed(8)
    logits = torch.randn(1, 2, 5, 5)
    logits[..., 4] += 200.0
    keep = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    probs = masked_softmax(logits, keep)
    kept_rows = logits[:, :, :4, :4].softmax(-1)
    torch.testing.assert_close(probs[:, :, :4, :4], kept_rows, atol=1e-5, rtol=1e-5)
    assert probs[:, :, :4, 4].max() < 1e-6
    assert probs[0, :, 4, 4].min() > 0.999  # the dropped token still attends to itself
    half = masked_softmax(logits.to(torch.bfloat16), keep)
    assert half.dtype == torch.bfloat16
    # The mask still gets a finite gradient (the predictor learns through it).
    soft_keep = keep.clone().requires_grad_(True)
    masked_softmax(logits, soft_keep)[..., :4, :].pow(2).sum().backward()
    assert soft_keep.grad is not None and torch.isfinite(soft_keep.grad).all()
    assert soft_keep.grad[0, 4] != 0


def test_masked_softmax_keeps_the_masks_gradient_finite_under_a_large_upstream_gradient():
    """A dropped key ~100 above the kept ones (a sharpened query-made position term, transformers'
    SAM) under an upstream gradient of 1e5: the mask's gradient is the key's capped weight times
    it, which overflowed float32 at a cap of e^80 (inf, then inf x 0 = NaN off the diagonal).
    """
    torch.manual_seed(8)
    logits = torch.randn(1, 2, 5, 5)
    logits[..., 4] += 100.0
    soft_keep = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], requires_grad=True)
    upstream = 1e5 * torch.randn(1, 2, 5, 5, generator=torch.Generator().manual_seed(0))
    (masked_softmax(logits, soft_keep) * upstream).sum().backward()
    assert torch.isfinite(soft_keep.grad).all() and soft_keep.grad[0, 4] != 0


def test_evit_fuse_is_the_attention_weighted_sum():
    donors = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    scores = torch.tensor([[0.25, 0.5]])
    torch.testing.assert_close(evit_fuse(donors, scores), torch.tensor([[[1.75, 2.5]]]))


def test_attention_with_probs_is_the_attention_and_its_received_score():
    from vitcompress.method import attention_with_probs, received_attention_score, score_from_probs

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 10, 8, generator=generator, dtype=torch.float64) for _ in "qkv")
    bias = torch.randn(10, 10, generator=generator, dtype=torch.float64)
    out, probs = attention_with_probs(q, k, v, 0.3, bias)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.3)
    assert out.dtype == torch.float64 and torch.allclose(out, reference, atol=1e-12)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 3, 10, dtype=torch.float64))
    scores = score_from_probs(probs, 1, has_cls=False)
    assert torch.allclose(scores, received_attention_score(q, k, 1, 0.3, bias), atol=1e-12)
    # Half precision: the probabilities in float32, the output in the values' dtype.
    out_half, probs_half = attention_with_probs(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out_half.dtype == torch.bfloat16 and probs_half.dtype == torch.float32


def _spread_by_hand(scores, grid, kernel, stride, padding):
    """Each token's score: the mean over the keys whose window (kernel at stride, padded) reads
    it; a token no key reads: the score of the key whose cell holds it, scaled by half the least
    read score over the greatest key score."""
    (height, width), (h, w) = grid, (int(math.isqrt(scores.shape[1])),) * 2
    out = torch.zeros(scores.shape[0], height * width, dtype=scores.dtype)
    unread = []
    for row in range(height):
        for col in range(width):
            readers = [
                i * w + j
                for i in range(h)
                for j in range(w)
                if 0 <= row - (i * stride - padding) < kernel
                and 0 <= col - (j * stride - padding) < kernel
            ]
            if readers:
                out[:, row * width + col] = scores[:, readers].mean(dim=1)
            else:
                unread.append((row, col))
    if unread:
        read = torch.ones(height * width, dtype=torch.bool)
        for row, col in unread:
            read[row * width + col] = False
        least = out[:, read].amin(dim=1)
        most = scores.amax(dim=1)
        for row, col in unread:
            cell = (row * h // height) * w + col * w // width
            out[:, row * width + col] = scores[:, cell] * least / most * 0.5
    return out


@pytest.mark.parametrize(
    "grid, kernel, stride, padding",
    [
        ((16, 16), 3, 4, 1),  # MViTv2's stage 0: a row in four read by no key, two at the end
        ((8, 8), 3, 2, 1),  # CvT's keys: windows overlap, a token read by two keys
        ((16, 16), 4, 4, 0),  # PVT's: every key reads its own cell
    ],
)
def test_pooled_key_scores_spread_to_the_tokens_each_key_reads(grid, kernel, stride, padding):
    from vitcompress.method import key_scores_to_tokens

    keys = (grid[0] + 2 * padding - kernel) // stride + 1
    scores = torch.rand(2, keys * keys, generator=torch.Generator().manual_seed(0))
    pool = ((kernel, kernel), (stride, stride), (padding, padding))
    spread = key_scores_to_tokens(scores, grid, pool=pool)
    torch.testing.assert_close(spread, _spread_by_hand(scores, grid, kernel, stride, padding))
    positions = torch.tensor([[5, 0, 17], [2, 3, 4]])
    torch.testing.assert_close(
        key_scores_to_tokens(scores, grid, positions, pool), spread.gather(1, positions)
    )
    nearest = key_scores_to_tokens(scores, grid)  # no pool known: each key its cell
    assert torch.equal(spread, nearest) is (kernel == stride and padding == 0)
    if (kernel, stride, padding) == (3, 4, 1):  # read tokens all rank above the unread ones
        unread = torch.tensor(
            [r % 4 == 2 or c % 4 == 2 or r > 13 or c > 13 for r in range(16) for c in range(16)]
        )
        assert (spread[:, unread].amax(dim=1) < spread[:, ~unread].amin(dim=1)).all()


def test_pvt_scores_are_its_cells_where_the_grid_does_not_divide_by_its_stride():
    """A kernel equal to its stride skips the last rows where the grid does not divide; each key
    still stands for its cell there (nearest upsampling), as before the pool was known."""
    from vitcompress.method import key_scores_to_tokens

    scores = torch.rand(2, 36, generator=torch.Generator().manual_seed(0))
    spread = key_scores_to_tokens(scores, (50, 50), pool=((8, 8), (8, 8), (0, 0)))
    assert torch.equal(spread, key_scores_to_tokens(scores, (50, 50)))


def test_pooled_key_scores_fall_back_to_cells_where_the_pool_does_not_fit_the_grid():
    from vitcompress.method import key_scores_to_tokens

    scores = torch.rand(1, 16, generator=torch.Generator().manual_seed(0))
    # 3 x 3 at stride 4 cannot make 4 x 4 keys of a 32 x 32 grid (it would need 8 x 8).
    odd = key_scores_to_tokens(scores, (32, 32), pool=((3, 3), (4, 4), (1, 1)))
    assert torch.equal(odd, key_scores_to_tokens(scores, (32, 32)))
