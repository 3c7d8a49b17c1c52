"""Position tables follow the kept tokens: the gather itself (PositionGather), and reduced BEiT and
EVA02 checked against references written by hand, where every later block's relative-position
bias (BEiT) or RoPE rows (EVA02) are indexed by the kept token ids explicitly, per image."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitcompress
from tests.models import timm_small
from tests.test_positions import SIZE, sharpen
from vitcompress.method import masked_softmax
from vitcompress.modules.attention import SDPAHook
from vitcompress.modules.position_tables import PositionGather

# --- The gather --------------------------------------------------------------------------------


def test_a_bias_over_prefix_and_patch_tokens_is_gathered_on_rows_and_columns_per_image():
    bias = torch.randn(1, 2, 1 + 6, 1 + 6)  # 1 prefix token, 6 patch tokens
    positions = torch.tensor([[4, 0, 5], [1, 2, 3]])
    gathered = PositionGather((2, 3), (1, 1), ndim=4)(bias, positions)
    assert gathered.shape == (2, 2, 4, 4)
    for image, kept in enumerate(positions.tolist()):
        ids = [0] + [1 + p for p in kept]  # the prefix row, then each kept token's row
        torch.testing.assert_close(gathered[image], bias[0][:, ids][:, :, ids], rtol=0, atol=0)


def test_a_rope_table_over_patch_tokens_gets_the_batch_first_and_a_head_dim_of_one():
    table = torch.randn(6, 8)  # (N0, D), applied to q (B, H, N0, D) after the prefix split
    positions = torch.tensor([[5, 1], [0, 3]])
    gathered = PositionGather((2,), (0,), ndim=4)(table, positions)
    assert gathered.shape == (2, 1, 2, 8)
    torch.testing.assert_close(gathered[:, 0], table[positions], rtol=0, atol=0)


def test_a_token_off_the_grid_takes_the_neutral_row_never_another_token_s():
    bias = torch.randn(1, 2, 1 + 6, 1 + 6) + 3.0  # no entry is 0
    positions = torch.tensor([[2, -1]])  # EViT's fused token last
    gathered = PositionGather((2, 3), (1, 1), ndim=4, neutral=0.0)(bias, positions)
    assert torch.all(gathered[0, :, 2, :] == 0) and torch.all(gathered[0, :, :, 2] == 0)
    # -1 used as an index would have read the last token's row (or, offset by the prefix, the
    # cls row): neither is what the fused token gets.
    torch.testing.assert_close(gathered[0, :, :2, :2], bias[0][:, [0, 3]][:, :, [0, 3]])
    cos = PositionGather((2,), (0,), ndim=4, neutral=1.0)(torch.rand(6, 4) - 2.0, positions)
    assert torch.all(cos[0, 0, 1] == 1.0) and torch.all(cos[0, 0, 0] != 1.0)
    unknown = PositionGather((2,), (0,), ndim=4)(torch.randn(6, 4), positions)
    assert torch.isnan(unknown[0, 0, 1]).all() and not torch.isnan(unknown[0, 0, 0]).any()


def test_without_positions_the_table_is_passed_through():
    table = torch.randn(1, 2, 7, 7)
    assert PositionGather((2, 3), (1, 1), ndim=4)(table, None) is table


def test_a_boolean_mask_lets_a_token_off_the_grid_attend_and_be_attended():
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    gathered = PositionGather((2, 3), (1, 1), ndim=4, neutral=0.0)(mask, torch.tensor([[1, -1]]))
    assert (
        gathered[0, 0, 2].all() and gathered[0, 0, :, 2].all() and not gathered[0, 0, :2, :2].any()
    )


# --- Training (dTPS/DynamicViT's mask path): the key mask applies to the biased logits ------------


def test_the_training_key_mask_applies_to_the_logits_with_their_bias():
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=generator) for _ in range(3))
    bias = 4.0 * torch.randn(1, 2, 5, 5, generator=generator)
    keep_mask = torch.tensor([[1.0, 1, 0, 1, 0], [1.0, 0, 1, 1, 1]])
    hook = SDPAHook(prefix_tokens=1, has_cls=True, score=False)
    out = hook(q, k, v, keep_mask, attn_mask=bias)
    expected = masked_softmax(q @ k.transpose(-2, -1) * 4**-0.5 + bias, keep_mask) @ v
    torch.testing.assert_close(out, expected)
    # The bias is not dropped: without it the output differs.
    unbiased = masked_softmax(q @ k.transpose(-2, -1) * 4**-0.5, keep_mask) @ v
    assert (out - unbiased).abs().max() > 0.1


def test_dtps_training_on_beit_with_every_token_kept_is_the_base_model():
    """With the random policy at keep 1 the training mask keeps every token, so the biased
    attention under the mask must be the model's own attention (train mode, no dropout)."""
    torch.manual_seed(0)
    model = sharpen(timm_small("beit_base_patch16_224"))
    compressed = vitcompress.compress(model, "dtps", keep=1.0, policy="random", input_size=SIZE)
    x = torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model.train()(x)
        trained = compressed.train()(x)
    torch.testing.assert_close(trained, base, atol=1e-4 * float(base.abs().max()), rtol=0)


# --- Reduced models against references by hand ------------------------------------------------


def _reduced(compressed: nn.Module, x: torch.Tensor):
    """(logits, the tokens the one reducer gives, their positions) from one forward."""
    seen: dict[str, tuple] = {}
    (reducer,) = compressed.tps.children()
    handle = reducer.register_forward_hook(lambda m, a, out: seen.__setitem__("out", out))
    with torch.no_grad():
        logits = compressed(x)
    handle.remove()
    tokens, _, positions, _ = seen["out"]  # (tokens, keep_mask, positions, trace)
    return logits, tokens, positions


def _mlp_half(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP residual of a timm BEiT/EVA block (an attention variant reduces before it)."""
    update = block.mlp(block.norm2(x))
    return x + (update if block.gamma_2 is None else block.gamma_2 * update)


def _model(name: str) -> nn.Module:
    """Sharpened, with a head of unit-scale weights: BEiT's head starts at 1e-3 of that, which
    would leave its logits too small for a tolerance to tell a wrong row from rounding."""
    torch.manual_seed(0)
    model = sharpen(timm_small(name))
    with torch.no_grad():
        model.head.weight.normal_(generator=torch.Generator().manual_seed(2))
    return model


def _rows(kept: list[int], prefix: int) -> list[int | None]:
    """The table rows of the tokens present: prefix rows, then 'prefix + position', and no row
    for a token off the grid (EViT's fused token, position -1)."""
    return list(range(prefix)) + [prefix + p if p >= 0 else None for p in kept]


def _bias_by_hand(full: torch.Tensor, rows: list[int | None]) -> torch.Tensor:
    """``full`` (1, H, N, N) at the given rows and columns; 0 where a token has no row."""
    out = torch.zeros(1, full.shape[1], len(rows), len(rows))
    for i, row in enumerate(rows):
        for j, column in enumerate(rows):
            if row is not None and column is not None:
                out[0, :, i, j] = full[0, :, row, column]
    return out


@pytest.mark.parametrize("variant", ["dtps", "dynamicvit", "etps", "evit"])
def test_reduced_beit_matches_attention_with_the_bias_indexed_by_kept_tokens(variant):
    """Reduce at block 1; every attention that sees the reduced tokens (blocks 1-3 for dTPS and
    DynamicViT, which reduce before block 1; blocks 2-3 for eTPS and EViT, which reduce after
    block 1's attention) is run by hand, image by image, with its relative-position bias taken
    at the kept tokens' rows and columns (for EViT's fused token: none, a zero bias)."""
    model = _model("beit_base_patch16_224")
    compressed = vitcompress.compress(model, variant, keep=0.7, locs=[1], input_size=SIZE).eval()
    x = torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))
    logits, tokens, positions = _reduced(compressed, x)
    assert tokens.shape[1] < 65  # reduced
    if variant == "evit":
        assert (positions[:, -1] == -1).all()  # the fused token is there
    for image in range(x.shape[0]):
        rows = _rows(positions[image].tolist(), prefix=1)
        stream = tokens[image : image + 1]
        with torch.no_grad():
            if variant in ("etps", "evit"):
                stream = _mlp_half(model.blocks[1], stream)
            for block in model.blocks[1 if variant in ("dtps", "dynamicvit") else 2 :]:
                bias = _bias_by_hand(block.attn._get_rel_pos_bias(), rows)
                block.attn._get_rel_pos_bias = lambda bias=bias: bias
                stream = block(stream)
                del block.attn._get_rel_pos_bias  # the class's method again
            expected = model.forward_head(model.norm(stream))
        torch.testing.assert_close(logits[image : image + 1], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["dtps", "etps", "evit"])
def test_reduced_eva02_matches_rope_rows_taken_at_the_kept_tokens(variant):
    """EVA02: every later block rotates q and k by the sin/cos rows of the kept tokens' grid
    positions (EViT's fused token: sin 0, cos 1, not rotated, as the cls token)."""
    model = _model("eva02_tiny_patch14_224")
    compressed = vitcompress.compress(model, variant, keep=0.7, locs=[1], input_size=SIZE).eval()
    x = torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))
    logits, tokens, positions = _reduced(compressed, x)
    with torch.no_grad():
        _, rope = model._pos_embed(model.patch_embed(x))  # (N0, 2D): sin then cos
    half = rope.shape[-1] // 2
    no_rotation = torch.cat([torch.zeros(half), torch.ones(half)])
    for image in range(x.shape[0]):
        kept = positions[image].tolist()
        rope_rows = torch.stack([rope[p] if p >= 0 else no_rotation for p in kept])
        stream = tokens[image : image + 1]
        with torch.no_grad():
            if variant in ("etps", "evit"):
                stream = _mlp_half(model.blocks[1], stream)
            for block in model.blocks[1 if variant == "dtps" else 2 :]:
                stream = block(stream, rope=rope_rows)
            expected = model.forward_head(model.norm(stream))
        torch.testing.assert_close(logits[image : image + 1], expected, atol=1e-5, rtol=1e-4)
