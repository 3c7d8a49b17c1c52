"""Token grids of a few tokens: two families at their smallest configurations, random weights.

- ``vit_tiny_r_s16_p8_224`` (ResNet-stem hybrid, 2x2 patch tokens at 32 px): dTPS training gave a
  NaN loss. With 4 tokens a Gumbel draw can keep none of them at a location, and the next
  predictor's masked mean over the tokens kept divided 0 by 0.
- The same model and Hiera (a 2x2 last stage at 64 px): EViT at keep 0.7 cut no MACs. With 4
  tokens it keeps ceil(2.8) = 3 and adds its fused token: 4 again, at every location. Such a plan
  is refused in one line; where the tokens are enough, EViT cuts.
- Hiera's zero-initialised head made every output 0, so exactness was never seen: here the head
  gets non-zero weights, keep 1 is exact for every variant, and at keep 0.7 the model equals
  the base run on the reducer's tokens.
"""

from __future__ import annotations

import math

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from tests.models import timm_small
from vitcompress import compress, map_model
from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.plan import PlanError
from vitcompress.measure import count_macs
from vitcompress.modules import AttentionReducer, PredictorReducer
from vitcompress.modules.predictor import ScorePredictor

HYBRID_SIZE = (3, 32, 32)
HIERA_SIZE = (3, 64, 64)
VARIANTS = ("dtps", "etps", "dynamicvit", "evit")


def _hybrid() -> nn.Module:
    torch.manual_seed(0)
    return timm_small("vit_tiny_r_s16_p8_224").eval()


def _hiera(side: int = 64) -> nn.Module:
    """Hiera with a 2x2 last stage at 64 px, its zero-initialised head given non-zero weights."""
    torch.manual_seed(0)
    model = timm.create_model(
        "hiera_tiny_224", img_size=side, embed_dim=16, stages=(1, 1, 2, 2), num_classes=10
    ).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and not module.weight.any():
                module.weight.normal_(0.0, 0.5)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.5)
    return model


def _last_stage(model: nn.Module, size: tuple[int, int, int]) -> list[int]:
    """Hiera's last stage (its 2x2 one at 64 px), as ``locs``: the default locations also take
    its mask-unit block and its third stage."""
    (last,) = [b.index for b in map_model(model, size).blocks if b.path == "blocks.5"]
    return [last]


def _image(size: tuple[int, int, int]) -> torch.Tensor:
    return torch.randn(2, *size, generator=torch.Generator().manual_seed(1))


def test_predictor_is_finite_where_the_previous_mask_kept_no_token():
    torch.manual_seed(0)
    predictor = ScorePredictor(16)
    tokens = torch.randn(2, 4, 16, requires_grad=True)
    mask = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]], requires_grad=True)
    log_probs = predictor(tokens, mask)
    log_probs.sum().backward()
    assert torch.isfinite(log_probs).all()
    assert torch.isfinite(tokens.grad).all() and torch.isfinite(mask.grad).all()
    # Where tokens are kept, the global feature is still their mean (nothing changed there).
    rest = predictor.in_conv(tokens)[1:, :, 8:]
    expected = rest[:, [0, 2]].mean(dim=1, keepdim=True) @ predictor.out_conv[0].weight[:, 8:].T
    local = predictor.in_conv(tokens)[1:, :, :8] @ predictor.out_conv[0].weight[:, :8].T
    hidden = local + predictor.out_conv[0].bias + expected
    for layer in list(predictor.out_conv)[1:]:
        hidden = layer(hidden)
    torch.testing.assert_close(log_probs[1:], hidden)


def test_hybrid_dtps_training_steps_are_finite():
    torch.manual_seed(0)
    compressed = compress(_hybrid(), "dtps", keep=0.7, input_size=HYBRID_SIZE).train()
    x = _image(HYBRID_SIZE)
    for seed in range(8):  # several Gumbel draws keep no token at some location (NaN before)
        torch.manual_seed(seed)
        compressed.zero_grad()
        loss = F.cross_entropy(compressed(x), torch.tensor([0, 1]))
        loss.backward()
        grads = [p.grad for p in compressed.parameters() if p.grad is not None]
        assert math.isfinite(loss.item()), seed
        assert grads and all(torch.isfinite(g).all() for g in grads), seed


def test_evit_that_would_remove_no_token_is_refused_in_one_line():
    with pytest.raises(PlanError) as refused:
        compress(_hybrid(), "evit", keep=0.7, input_size=HYBRID_SIZE)
    assert str(refused.value) == (
        "keep 0.7, 0.7, 0.7 removes no token: evit's patch tokens go 4 -> 4 at block 1; "
        "4 -> 4 at block 2; 4 -> 4 at block 3 (its fused token replaces the pruned ones); "
        "choose a lower keep or blocks with more tokens"
    )
    # Keep 1 asks for no reduction (the exactness check), and a lower keep does reduce.
    compress(_hybrid(), "evit", keep=1.0, input_size=HYBRID_SIZE)
    cut = compress(_hybrid(), "evit", keep=0.5, input_size=HYBRID_SIZE)
    assert count_macs(cut, HYBRID_SIZE) < count_macs(_hybrid(), HYBRID_SIZE)


def test_hybrid_etps_at_keep_07_cuts_macs():
    model = _hybrid()
    reduced = compress(model, "etps", keep=0.7, input_size=HYBRID_SIZE)
    assert count_macs(reduced, HYBRID_SIZE) < count_macs(model, HYBRID_SIZE)


def test_hiera_is_exact_at_keep_1_with_a_non_zero_head():
    model = _hiera()
    x = _image(HIERA_SIZE)
    with torch.no_grad():
        base = model(x)
    assert base.abs().max() > 1e-2  # the head no longer hides the tokens
    for variant in VARIANTS:
        with torch.no_grad():
            same = compress(model, variant, keep=1.0, input_size=HIERA_SIZE).eval()(x)
        assert (same - base).abs().max() <= 1e-5 * base.abs().max(), variant


@pytest.mark.parametrize("variant", ["dtps", "dynamicvit"])
def test_hiera_at_keep_07_is_the_base_run_on_the_reducers_tokens(variant):
    """Reference: the base model, whose reduced block is fed the reducer's tokens by hand. The
    reducer's input must be the base's own tokens there, and DynamicViT's output those tokens at
    the kept positions."""
    model = _hiera()
    x = _image(HIERA_SIZE)
    locs = _last_stage(model, HIERA_SIZE)
    compressed = compress(model, variant, keep=0.7, locs=locs, input_size=HIERA_SIZE).eval()
    (reducer,) = [m for m in compressed.modules() if isinstance(m, PredictorReducer)]
    seen = {}
    handle = reducer.register_forward_hook(
        lambda _m, args, out: seen.update(tokens_in=args[0], out=out[0], positions=out[2])
    )
    with torch.no_grad():
        logits = compressed(x)
    handle.remove()
    assert seen["out"].shape[1] < seen["tokens_in"].shape[1]
    info = compression_info(compressed)
    target = model.get_submodule(info.model_map.blocks[info.plan.locations[0].block].path)
    base_in = {}
    handles = [
        target.register_forward_pre_hook(lambda _m, args: base_in.update(tokens=args[0])),
        target.register_forward_pre_hook(lambda _m, args: (seen["out"], *args[1:])),
    ]
    with torch.no_grad():
        expected = model(x)
    for h in handles:
        h.remove()
    torch.testing.assert_close(seen["tokens_in"], base_in["tokens"])
    if variant == "dynamicvit":
        gathered = torch.gather(
            seen["tokens_in"],
            1,
            seen["positions"].unsqueeze(-1).expand(-1, -1, seen["tokens_in"].shape[-1]),
        )
        torch.testing.assert_close(seen["out"], gathered)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    assert (logits - model(x)).abs().max() > 1e-4  # the reduction is visible in the logits


def test_hiera_etps_at_keep_07_is_the_base_block_with_the_reducer_after_its_attention():
    """Reference: the base model, whose reduced block runs its attention residual, then the
    compressed model's reducer (with the score it was given), then its MLP residual."""
    model = _hiera()
    x = _image(HIERA_SIZE)
    locs = _last_stage(model, HIERA_SIZE)
    compressed = compress(model, "etps", keep=0.7, locs=locs, input_size=HIERA_SIZE).eval()
    (reducer,) = [m for m in compressed.modules() if isinstance(m, AttentionReducer)]
    seen = {}
    handle = reducer.register_forward_pre_hook(lambda _m, args: seen.update(score=args[1]))
    with torch.no_grad():
        logits = compressed(x)
    handle.remove()
    info = compression_info(compressed)
    block = model.get_submodule(info.model_map.blocks[info.plan.locations[0].block].path)

    def reduced_block(tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens + block.drop_path1(block.ls1(block.attn(block.norm1(tokens))))
        tokens = reducer(tokens, seen["score"])[0]
        return tokens + block.drop_path2(block.ls2(block.mlp(block.norm2(tokens))))

    block.forward = reduced_block
    with torch.no_grad():
        expected = model(x)
    del block.forward
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert (logits - model(x)).abs().max() > 1e-4


def test_hiera_evit_is_refused_on_a_2x2_stage_and_cuts_macs_on_a_4x4_one():
    model = _hiera()
    locs = _last_stage(model, HIERA_SIZE)
    with pytest.raises(PlanError) as refused:
        compress(model, "evit", keep=0.7, locs=locs, input_size=HIERA_SIZE)
    expected = f"removes no token: evit's patch tokens go 4 -> 4 at block {locs[0]}"
    assert expected in str(refused.value)
    larger = _hiera(128)
    size = (3, 128, 128)
    reduced = compress(larger, "evit", keep=0.7, locs=_last_stage(larger, size), input_size=size)
    assert count_macs(reduced, size) < count_macs(larger, size)
