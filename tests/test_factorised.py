"""Factorised space-time attention (transformers' TimeSformer): each block is one window over all
its tokens whose attention part (time within each patch position's frames, then space within
each frame, the class token copied into every frame) runs whole; a method reduces the MLP's
tokens, the class token kept, and the block gives every token back. eTPS and EViT score a token
by the attention it gets in its frame's space attention, read back into the block's order; ToMe
is refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.fixtures import hf_models
from vitcompress import compress, map_model
from vitcompress.analysis.window_map import WholeAttention
from vitcompress.compilation.metadata import compression_info
from vitcompress.errors import UserError
from vitcompress.workflows.export import export_model

pytest.importorskip("transformers")

PREDICTORS = ("dtps", "dynamicvit")
METHODS = (*PREDICTORS, "etps", "evit")


def _timesformer() -> tuple[nn.Module, tuple[int, ...]]:
    """4 frames of a 4 x 4 patch grid, width 64, 4 blocks; the last hidden state out (65 tokens:
    the class token, then patch position by patch position, its 4 frames each). Queries and
    keys x3, so that a token in the wrong place changes the output."""
    from tests.fixtures import dense_models, video_models

    torch.manual_seed(0)
    model = dense_models.LastHiddenState(hf_models.sharpen(video_models.timesformer()))
    return model.eval(), video_models.TIMESFORMER_INPUT


@pytest.fixture(scope="module")
def timesformer() -> tuple[nn.Module, tuple[int, ...]]:
    return _timesformer()


def _videos(size: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, *size, generator=torch.Generator().manual_seed(1)).to(dtype)


def test_each_block_is_one_window_whose_factorised_attention_runs_whole(timesformer):
    model, size = timesformer
    model_map = map_model(model, size)
    assert len(model_map.blocks) == 4
    for block in model_map.blocks:
        layer = f"model.encoder.layer.{block.index}"
        assert block.path == layer and block.tokens == 65 and block.prefix_tokens == 1
        windows = block.windows
        assert (windows.count, windows.tokens, windows.order) == (1, 65, tuple(range(65)))
        assert windows.attention == WholeAttention(
            f"factorised attention ({layer}.temporal_attention.attention, "
            f"{layer}.attention.attention: 16 windows of 4, 4 windows of 17 per image), added "
            "back by ops no residual add describes, so its attention part runs on every token"
        )
        assert block.score_blocker is None
        # Patch token j = position p, frame t (j = 4 p + t) is scored at frame t's slot p.
        assert windows.score_slots == tuple(16 * (j % 4) + j // 4 for j in range(64))


def test_keep_1_is_exact_in_double_precision():
    model, size = _timesformer()
    model = model.double()
    videos = _videos(size, torch.float64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            base = model(videos)
            for method in METHODS:
                out = compress(model, method, keep=[1.0], input_size=size)(videos)
                assert (out - base).abs().max() <= 1e-9 * base.abs().max(), method
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("method", METHODS)
def test_keep_07_reduces_each_mlp_keeping_the_class_token(timesformer, method):
    model, size = timesformer
    videos = _videos(size)
    torch.manual_seed(0)
    compressed = compress(model, method, keep=[0.7], input_size=size).eval()
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for name, module in compressed.named_modules():
        if name.startswith("tps.") and name.count(".") == 1:
            module.register_forward_hook(
                lambda m, i, o: seen.append((tuple(i[0].shape), tuple(o[0].shape)))
            )
    with torch.no_grad():
        out, base = compressed(videos), model(videos)
    assert out.shape == base.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, base)
    # Every block: 65 tokens in, the class token and int(0.7 x 64) = 44 patch tokens out (and
    # eTPS's and EViT's one fused token besides).
    # EViT keeps ceil(0.7 x 64) = 45.
    kept = {"dtps": 45, "dynamicvit": 45, "etps": 46, "evit": 47}[method]
    assert seen == [((2, 65, 64), (2, kept, 64))] * 4


def test_etps_scores_each_token_by_the_attention_it_gets_in_its_frame(timesformer):
    """The space attention's scores, (B x 4 frames, 16 positions), reach the reducer in the
    block's order: token j = 4 p + t takes frame t's score of position p."""
    model, size = timesformer
    compressed = compress(model, "etps", keep=[0.7], locs=[0], input_size=size).eval()
    hooks = dict(compressed.named_modules())
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str, out: torch.Tensor) -> None:  # a hook that returns None changes nothing
        seen[name] = out

    hooks["tps_hooks.attn0"].register_forward_hook(lambda m, i, o: keep("frames", o[1]))
    hooks["tps_hooks.scoreslots0"].register_forward_hook(lambda m, i, o: keep("tokens", o))
    with torch.no_grad():
        compressed(_videos(size))
    frames = seen["frames"].reshape(2, 4, 16)  # (B, frame, position)
    expected = frames.permute(0, 2, 1).reshape(2, 64)  # (B, position x frame)
    torch.testing.assert_close(seen["tokens"], expected)


def test_tome_is_refused_in_one_line(timesformer):
    model, size = timesformer
    with pytest.raises(UserError) as refused:
        compress(model, "tome", keep=[0.7], input_size=size)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(
        "block 0 (model.encoder.layer.0): its attention is factorised, and the attention that "
        "scores its tokens holds them frame by frame"
    )


@pytest.mark.parametrize("method", METHODS)
def test_one_training_step_is_finite(timesformer, method):
    model, size = timesformer
    torch.manual_seed(0)
    compressed = compress(model, method, keep=[0.7], input_size=size).train()
    loss = compressed(_videos(size)).square().mean()
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in compressed.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.slow  # about 20 s
def test_onnx_export_matches(timesformer, tmp_path):
    model, size = timesformer
    torch.manual_seed(0)
    for method in ("dtps", "etps"):
        compressed = compress(model, method, keep=[0.7], input_size=size)
        result = export_model(compressed, size, "onnx", tmp_path / f"timesformer_{method}.onnx")
        assert result["max_abs_diff"] < 1e-3, method


def test_carry_windows_does_not_carry_a_window_that_holds_the_class_token(timesformer):
    """A carried choice replays patch slots only: a window led by the class token is reduced by
    its own block, never by a choice carried from the block before."""
    model, size = timesformer
    compressed = compress(
        model, "etps", keep=[0.7], input_size=size, variant_args={"carry_windows": True}
    )
    locations = compression_info(compressed).plan.locations
    assert [(loc.block, loc.carried) for loc in locations] == [(b, ()) for b in range(4)]
    with torch.no_grad():
        assert compressed(_videos(size)).shape == model(_videos(size)).shape


def test_macs_are_the_hand_count_and_the_mlp_runs_on_the_kept_tokens(timesformer):
    """Per image: the time attention over 16 positions' 4 frames, the space attention over 4
    frames of 1 + 16 tokens (projections, then q k^T and attn v at width 64), counted as by
    hand; compressed at keep 0.7, the MLP's two linears run on the class token and 44 kept patch
    tokens of 65."""
    from vitcompress.measure.macs import macs_by_module

    model, size = timesformer
    width, frames, positions = 64, 4, 16
    base = macs_by_module(model, size)
    layer = "model.encoder.layer.0"
    space = frames * 17 * width * width * 4 + 2 * frames * 17 * 17 * width
    time = positions * frames * width * width * 4 + 2 * positions * frames * frames * width
    assert base[f"{layer}.attention"] == space
    assert base[f"{layer}.temporal_attention"] == time
    assert base[f"{layer}.temporal_dense"] == positions * frames * width * width
    assert base[f"{layer}.intermediate.dense"] == 65 * width * 4 * width
    torch.manual_seed(0)
    compressed = macs_by_module(compress(model, "dtps", keep=[0.7], input_size=size), size)
    for linear in ("intermediate.dense", "output.dense"):
        assert compressed[f"{layer}.{linear}"] == 45 * width * 4 * width, linear
    # The attention part runs whole: its projections on every token (the rewritten graph calls
    # the linears, not the attention modules around them).
    for linear in ("attention.attention.qkv", "attention.output.dense", "temporal_dense"):
        assert compressed[f"{layer}.{linear}"] == base[f"{layer}.{linear}"], linear
