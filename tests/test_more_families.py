"""ConViT, MViTv2, NesT and XCiT: what capture sees inside them, and what the analysis makes of it.

ConViT's gated positional self-attention is supported: its positional attention is computed from
a (1, N, N, 3) table of relative positions, which is gathered by the kept tokens, so keep 1 is
exact on sharpened weights (and not without the gather), keep 0.7 is cheaper, a training step is
finite and the ONNX export matches. MViTv2's blocks (pooling attention on per-head grids) map
as one window over their grid whose attention runs whole (its families' checks are in
tests/test_windowed_families.py); NesT's unfused attention (windows on an axis of their own) and
XCiT (attention over channels) are each refused in one line that names what blocks them.
"""

from __future__ import annotations

import math
import operator
import re

import pytest
import timm
import torch
from torch import nn

from vitcompress import compress, map_model
from vitcompress.analysis.analyse import MappingError
from vitcompress.analysis.capture import capture
from vitcompress.analysis.positions import gather_layout
from vitcompress.errors import UserError
from vitcompress.measure import count_macs
from vitcompress.measure.keep_fit import compress_within_gmacs
from vitcompress.modules.position_tables import PositionGather
from vitcompress.workflows.export import export_model

SIZE = (3, 32, 32)
# An 8 x 8 grid, 4 GPSA blocks of width 64 (ConViT multiplies its width by the heads).
CONVIT = dict(img_size=32, patch_size=4, depth=4, embed_dim=32, num_heads=2)
METHODS = ("dtps", "etps", "dynamicvit")


def sharpened_convit(**extra) -> nn.Module:
    """A ConViT under which positions matter: random init attends almost uniformly, which hides
    a token paired with another token's relative positions. Queries and keys x3, the positional
    projections and gates from N(0, 1) (a peaked positional attention, weighed in)."""
    torch.manual_seed(0)
    model = timm.create_model("convit_tiny", num_classes=10, **CONVIT, **extra)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("qk.weight"):
                param *= 3.0
            elif "pos_proj" in name or name.endswith("gating_param"):
                param.copy_(torch.randn(param.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module")
def convit() -> nn.Module:
    # Never run before it is captured: its relative indices are still the 1-token placeholder.
    return sharpened_convit()


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))


# --- ConViT ------------------------------------------------------------------------------------


def test_convit_maps_with_its_relative_indices_as_pair_tables(convit: nn.Module) -> None:
    model_map = map_model(convit, SIZE)
    assert model_map.capture == "guarded_trace" and model_map.leaves == []
    assert len(model_map.blocks) == 4
    for block in model_map.blocks:
        uses = [u for u in block.position_uses if u.branch == "attention"]
        assert [u.table for u in uses] == [f"blocks.{block.index}.attn.rel_indices"]
        assert uses[0].shape == (1, 64, 64, 3) and uses[0].blocker is None
        assert gather_layout(uses[0].shape, 4, uses[0].kind, 64, 0) == ((1, 2), (0, 0))


@pytest.mark.parametrize("method", METHODS)
def test_convit_keep_1_is_exact(convit: nn.Module, images: torch.Tensor, method: str) -> None:
    with torch.no_grad():
        base = convit(images)
        out = compress(convit, method, keep=1.0, input_size=SIZE).eval()(images)
    assert (out - base).abs().max() <= 1e-5 * base.abs().max()


def test_convit_keep_1_needs_the_gather(
    convit: nn.Module, images: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """dTPS re-sorts the tokens at keep 1: read ungathered, the relative positions pair each
    token with another's, and the logits move far beyond rounding."""
    monkeypatch.setattr(PositionGather, "forward", lambda self, table, positions: table)
    with torch.no_grad():
        base = convit(images)
        out = compress(convit, "dtps", keep=1.0, input_size=SIZE).eval()(images)
    assert (out - base).abs().max() > 1e-3 * base.abs().max()


def test_pair_table_is_gathered_on_both_token_dims() -> None:
    table = torch.randn(1, 5, 5, 3)
    positions = torch.tensor([[4, 0, 2], [1, 3, 0]])
    gathered = PositionGather((1, 2), (0, 0), 4)(table, positions)
    for image in range(2):
        pos = positions[image]
        assert torch.equal(gathered[image], table[0][pos][:, pos])


@pytest.mark.parametrize("method", ("etps", "dtps"))
def test_convit_keep_07_is_cheaper(convit: nn.Module, method: str) -> None:
    base = count_macs(convit, SIZE)
    reduced = count_macs(compress(convit, method, keep=0.7, input_size=SIZE), SIZE)
    assert reduced < 0.85 * base


def test_convit_training_step_is_finite(convit: nn.Module, images: torch.Tensor) -> None:
    model = compress(convit, "dtps", keep=0.7, input_size=SIZE).train()
    loss = nn.functional.cross_entropy(model(images), torch.tensor([1, 2]))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert math.isfinite(loss.item()) and grads
    assert all(torch.isfinite(g).all() for g in grads)


def test_convit_onnx_export_matches(convit: nn.Module, tmp_path) -> None:
    model = compress(convit, "etps", keep=0.7, input_size=SIZE)
    result = export_model(model, SIZE, "onnx", tmp_path / "convit.onnx")
    assert result["max_abs_diff"] < 1e-4


def test_convit_reduces_before_its_class_token_joins(images: torch.Tensor) -> None:
    """GPSA blocks, then the class token joins for plain attention blocks: two stages, the join
    being the first's exit. Tokens reduced in the GPSA blocks get their grid order back there."""
    model = sharpened_convit(local_up_to_layer=3)
    model_map = map_model(model, SIZE)
    assert [s.prefix_tokens for s in model_map.stages] == [0, 1]
    first = model_map.stages[0]
    assert first.exit_bypass is None and first.exit_grid_node is not None
    with torch.no_grad():
        base = model(images)
        out = compress(model, "dtps", keep=1.0, locs=[1], input_size=SIZE).eval()(images)
    assert (out - base).abs().max() <= 1e-5 * base.abs().max()
    reduced = compress(model, "dtps", keep=0.7, locs=[1], input_size=SIZE)
    assert count_macs(reduced, SIZE) < count_macs(model, SIZE)


# --- Capture: what let it see inside these models ---------------------------------------------


class _CachedTable(nn.Module):
    """A table cached on the first call for the token count it sees (ConViT's relative indices):
    the check on the cache and the expand over the batch both read the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(1, 1, 4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        if self.table.shape[1] != n:
            self.table = torch.arange(n * c, dtype=x.dtype).reshape(1, n, c)
        return x + self.table.expand(b, -1, -1)


class _Blocks(nn.Module):
    """NesT's ``int(math.sqrt(T))`` and MViTv2's write into a slice of a tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        side = int(math.sqrt(t))
        grid = x.reshape(b, side, side, c).clone()
        grid[:, 1:, 1:] = grid[:, 1:, 1:] * 2.0
        # A size read off the written tensor decides a branch (MViTv2's ``max(k_h / q_h, 1.0)``
        # on the sizes of what its relative positions were written into, a block on).
        grid = grid * max(grid.shape[1] / side, 1.0)
        return grid.reshape(b, t, c)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cached = _CachedTable()
        self.blocks = _Blocks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.cached(x))


def test_capture_traces_size_ints_item_writes_and_cached_buffers() -> None:
    model = _Model().eval()
    example = torch.randn(2, 9, 4)
    captured = capture(model, example)
    assert captured.method == "guarded_trace" and captured.leaves == []
    targets = [n.target for n in captured.module.graph.nodes]
    assert "contiguous" in targets  # the buffer is read through one node
    assert sum(t is torch._assert for t in targets) >= 2  # the cache check and the int
    assert not any(t is operator.setitem for t in targets)  # the write is a value
    fresh = torch.randn(2, 9, 4)
    assert torch.equal(captured.module(fresh), model(fresh))
    with pytest.raises(Exception, match="captured graph"):
        captured.module(torch.randn(2, 16, 4))


# --- Refused in one line -----------------------------------------------------------------------


def _refusal(name: str, size: tuple[int, int, int], fused: bool = True, **kwargs) -> str:
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, **kwargs).eval()
    if not fused:  # timm's unfused attention: q @ k^T and a softmax
        for module in model.modules():
            if hasattr(module, "fused_attn"):
                module.fused_attn = False
    with pytest.raises(MappingError) as refused:
        map_model(model, size)
    line = str(refused.value)
    assert "\n" not in line
    return line


def _mvitv2(name: str = "mvitv2_tiny") -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, img_size=64, num_classes=10).eval()


def test_mvitv2_blocks_map_as_one_window_over_their_grid_whose_attention_runs_whole() -> None:
    """MViTv2 pools queries, keys and values on a grid made per head inside its attention, so
    the attention needs every token: each block is one window over its grid, its attention run
    whole (the reason kept), its MLP reduced. The stage transitions, whose queries are pooled
    by stride 2, change the token count and are left whole."""
    model_map = map_model(_mvitv2(), (3, 64, 64))
    assert model_map.capture == "guarded_trace" and model_map.leaves == []
    assert [b.path for b in model_map.blocks] == [
        "stages.0.blocks.0",
        "stages.1.blocks.1",
        *(f"stages.2.blocks.{i}" for i in range(1, 5)),
        "stages.3.blocks.1",
    ]
    sides, heads_per_stage = (16, 8, 4, 4, 4, 4, 2), (1, 2, 4, 4, 4, 4, 8)
    for block, side, heads in zip(model_map.blocks, sides, heads_per_stage, strict=True):
        windows = block.windows
        assert block.tokens == side * side and block.grid == (side, side)
        assert (windows.count, windows.tokens) == (1, side * side)
        assert windows.order == tuple(range(side * side)) and not windows.padded
        assert windows.attention.reason.startswith(
            f"pooling attention at {block.path}.attn.pool_q: the conv pools queries, keys or "
            f"values split into {heads} head{'s' if heads > 1 else ''} on the {side}x{side}"
        )
        assert block.grid_ops == []  # the attention's pooling needs no grid given back
    transitions = sorted(reason.split(":")[0] for reason in model_map.left_whole)
    assert transitions == [f"stages.{stage}.blocks.0.attn" for stage in (1, 2, 3)]
    # Each says why, without windows: one attention over the grid gives out fewer tokens.
    for reason in model_map.left_whole:
        assert reason.endswith("so the block changes the token count and no reduction keeps it")
        assert "its queries are pooled (" in reason and "window" not in reason


def _mvitv2_cls() -> nn.Module:
    """An MViTv2 with a class token (``mvitv2_*_cls``'s design), small: width 32, blocks 1, 2, 2,
    2 on a 16 x 16 grid (a stage transition first in each of the last three), so that it runs
    in double precision in seconds."""
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    from tests.test_windowed_families import sharpen

    torch.manual_seed(0)
    cfg = MultiScaleVitCfg(depths=(1, 2, 2, 2), embed_dim=32, use_cls_token=True)
    return sharpen(MultiScaleVit(cfg, img_size=64, num_classes=10, global_pool="token"))


def test_mvitv2_with_a_class_token_keeps_it_leading_each_window_and_is_exact() -> None:
    """The class token joins the grid's tokens (it is split off and joined again around every
    pooling); each block's one window is led by it, never reduced. Keep 1 is exact in double
    precision on sharpened weights; keep 0.7 keeps the class token and int(0.7 x 256) = 179 of
    block 0's patch tokens (eTPS one fused token besides)."""
    model = _mvitv2_cls().double()
    size = (3, 64, 64)
    model_map = map_model(model, size)
    assert [b.tokens for b in model_map.blocks] == [257, 65, 17, 5]
    assert all(b.prefix_tokens == 1 and b.windows.count == 1 for b in model_map.blocks)
    images = torch.randn(2, *size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            base = model(images)
            for method in ("dtps", "etps"):
                out = compress(model, method, keep=[1.0], input_size=size)(images)
                assert (out - base).abs().max() <= 1e-9 * base.abs().max(), method
                compressed = compress(model, method, keep=[0.7], input_size=size)
                seen: list[tuple[int, ...]] = []
                reducer = dict(compressed.named_modules())["tps.0"]
                reducer.register_forward_hook(
                    lambda m, i, o, seen=seen: seen.append(tuple(o[0].shape))
                )
                assert compressed(images).shape == base.shape
                assert seen == [(2, 1 + 179 + (method == "etps"), 32)], method
    finally:
        torch.set_default_dtype(default)


def test_tome_is_refused_where_mvitv2s_keys_are_pooled_and_merges_where_they_are_not() -> None:
    """Stage 0 pools its keys by stride 4 (16 keys for 256 tokens): refused. Stage 2's keys pass
    a stride-1 conv, one per token: ToMe matches by them and merges the MLP's tokens."""
    model, size = _mvitv2(), (3, 64, 64)
    with pytest.raises(UserError, match=r"attends over 16 pooled keys for its 256 tokens"):
        compress(model, "tome", keep=[0.7], input_size=size)
    merged = compress(model, "tome", keep=[0.7], locs=[2], input_size=size).eval()
    images = torch.randn(2, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, base = merged(images), model(images)
    assert out.shape == base.shape and not torch.allclose(out, base)
    assert count_macs(merged, size) < count_macs(model, size)


def test_nest_unfused_is_refused_as_windowed() -> None:
    """NesT's attention written as a matmul and a softmax on (B, heads, windows, N, N) logits
    (timm's unfused path) keeps its windows on an axis of its own: refused in one line. (Its
    SDPA path has the windows folded into the batch at capture and compresses:
    tests/test_windowed_families.py.)"""
    line = _refusal("nest_tiny", (3, 64, 64), img_size=64, fused=False)
    assert line.startswith("windowed attention: tokens cannot be dropped")
    assert "levels.0.transformer_encoder.0.attn attends within 16 windows of 16 tokens" in line


def test_nest_is_captured_whole() -> None:
    torch.manual_seed(0)
    model = timm.create_model("nest_tiny", img_size=64, num_classes=10).eval()
    captured = capture(model, torch.randn(2, 3, 64, 64))
    assert captured.method == "guarded_trace" and captured.leaves == []


def test_xcit_is_refused_as_channel_attention() -> None:
    line = _refusal(
        "xcit_nano_12_p8_224", SIZE, img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=2
    )
    assert line.startswith("cross-covariance attention over channels at blocks.0.attn")
    assert "32 x 32 channels per head over all 16 tokens" in line


def test_a_keep_fit_says_why_no_keep_is_taken() -> None:
    """ToMe refuses MViTv2's block 0 at every keep: the keep fit's line carries that reason."""
    with pytest.raises(UserError) as refused:
        compress_within_gmacs(_mvitv2(), "tome", 0.85, input_size=(3, 64, 64))
    line = str(refused.value)
    assert line.startswith("keep_for_gmacs_ratio no keep tried is taken by this method here; ")
    assert re.search(
        r"; (\d+) of the \1 keeps tried were refused: block 0 \(stages\.0\.blocks\.0\.attn\) "
        r"attends over 16 pooled keys for its 256 tokens",
        line,
    )


def test_mvitv2s_pooled_keys_score_the_tokens_they_read() -> None:
    """Block 0's keys are pooled by a 3 x 3 conv at stride 4, padding 1 (16 keys on a 16 x 16
    grid): key i reads rows 4i-1..4i+1, so rows 2, 6, 10, 14 and 15 (and the same columns) are
    read by no key. EViT's score of a token is the attention its key receives, averaged over
    heads and queries; a token no key reads scores below every read one, by the key whose cell
    holds it."""
    model = _mvitv2()
    assert _key_pool_of(model) == ((3, 3), (4, 4), (1, 1))
    compressed = compress(model, "evit", keep=[0.7], locs=[0], input_size=(3, 64, 64)).eval()
    seen = {}

    def keep(module: nn.Module, args: tuple, out: tuple) -> None:  # None: the output unchanged
        seen["out"] = out

    dict(compressed.named_modules())["tps_hooks.attn0"].register_forward_hook(keep)
    with torch.no_grad():
        compressed(torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1)))
    probs, scores = seen["out"]  # (B, heads, 256 queries, 16 keys), (B, 256)
    received = probs.mean(dim=(1, 2))  # (B, 16)
    key_of = {4 * i + d: i for i in range(4) for d in (-1, 0, 1) if 0 <= 4 * i + d < 16}
    expected = torch.zeros(2, 16, 16)
    read = torch.zeros(16, 16, dtype=torch.bool)
    for row, i in key_of.items():
        for col, j in key_of.items():
            expected[:, row, col] = received[:, 4 * i + j]
            read[row, col] = True
    least = expected[:, read].amin(dim=1)
    scale = least / received.amax(dim=1) * 0.5
    for row in range(16):
        for col in range(16):
            if not read[row, col]:  # the key whose cell (4 x 4) holds it, scaled below
                expected[:, row, col] = received[:, 4 * (row // 4) + col // 4] * scale
    torch.testing.assert_close(scores.view(2, 16, 16), expected)
    assert (scores.view(2, 16, 16)[:, ~read].amax(dim=1) < least).all()


def _key_pool_of(model: nn.Module) -> tuple | None:
    return map_model(model, (3, 64, 64)).blocks[0].attention.key_pool


def _keep_1_and_07(
    model: nn.Module, method: str, side: int, watched: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, ...]]]:
    """The base's logits on two float64 images, the compressed model's at keep 1 and at keep
    0.7, and the shapes of the tokens module ``watched`` took at keep 0.7."""
    size = (3, side, side)
    images = torch.randn(2, *size, generator=torch.Generator().manual_seed(2)).double()
    seen: list[tuple[int, ...]] = []
    with torch.no_grad():
        base = model(images)
        exact = compress(model, method, keep=[1.0], input_size=size)(images)
        compressed = compress(model, method, keep=[0.7], input_size=size)
        compressed.get_submodule(watched).register_forward_hook(
            lambda module, inputs, output: seen.append(tuple(inputs[0].shape))
        )
        out = compressed(images)
    return base, exact, out, seen


def _sharpened_levit() -> nn.Module:
    """LeViT-128S at 128 pixels (an 8 x 8 grid, then 4 x 4 and 2 x 2 after its downsampling
    attentions), in float64, its attention biases (position tables) from N(0, 1) and its query,
    key and value projections x3 (LeViT lays q, k and v out head by head in one linear)."""
    torch.manual_seed(0)
    model = timm.create_model("levit_128s", num_classes=10, img_size=128).double().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("attention_biases"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
            elif name.endswith(("qkv.linear.weight", "kv.linear.weight", "q.linear.weight")):
                param *= 3.0
    return model


@pytest.mark.parametrize("method", ["dtps", "etps"])
def test_levit_gives_its_downsampling_attention_every_token_and_their_count(method: str) -> None:
    """A LeViT stage reaches the next through an attention that views its keys by the token
    count it reads off its input (``B, N, C = x.shape``): both the tokens and that count must be
    the restored ones, or the compressed model fails on its first image."""
    base, exact, out, seen = _keep_1_and_07(
        _sharpened_levit(), method, 128, "stages.2.downsample.attn_downsample.kv.linear"
    )
    assert torch.allclose(exact, base, rtol=0, atol=1e-10 * base.abs().max().item())
    assert out.shape == base.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, base, atol=1e-6)  # keep 0.7 removed tokens in stage 1
    assert seen == [(2, 16, 256)]  # stage 1's 4 x 4 tokens, all of them, restored


def _sharpened_twins_svt() -> nn.Module:
    """A small Twins-SVT at 64 pixels in float64: width 32 to 128, blocks alternating between
    locally-grouped (4 x 4 windows) and global (keys pooled by 2, or not in the last stage),
    two in each of the first two stages and four in the last; queries and keys x3."""
    torch.manual_seed(0)
    model = timm.create_model(
        "twins_svt_small",
        num_classes=10,
        img_size=64,
        embed_dims=(32, 64, 128),
        num_heads=(1, 2, 4),
        mlp_ratios=(2, 2, 2),
        depths=(2, 2, 4),
        sr_ratios=(2, 2, 1),
        wss=(4, 4, 4),
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("attn.q.weight", "attn.kv.weight")):
                param[: param.shape[1]] *= 3.0
            elif name.endswith("attn.qkv.weight"):
                param[: 2 * param.shape[1]] *= 3.0
    return model.double().eval()


@pytest.mark.parametrize("method", ["dtps", "etps"])
def test_twins_svt_gives_its_locally_grouped_blocks_every_token(method: str) -> None:
    """Twins-SVT's global blocks (keys pooled, PVT's reduction) are mapped and reduced; the
    locally-grouped block after each, which cuts the grid into windows, is left whole and reads
    the tokens restored. Exact at keep 1; at keep 0.7 the windowed block sees every token."""
    model = _sharpened_twins_svt()
    model_map = map_model(model, (3, 64, 64))
    global_blocks = ["blocks.0.1", "blocks.1.1", "blocks.2.1", "blocks.2.3"]
    assert [b.path for b in model_map.blocks] == global_blocks
    # Seen at the locally-grouped block after the reduced global block blocks.2.1.
    base, exact, out, seen = _keep_1_and_07(model, method, 64, "blocks.2.2.norm1")
    assert torch.allclose(exact, base, rtol=0, atol=1e-10 * base.abs().max().item())
    assert torch.isfinite(out).all() and not torch.allclose(out, base, atol=1e-6)
    assert seen == [(2, 16, 128)]  # stage 2's 4 x 4 tokens, all of them


def test_cvts_last_stage_scores_its_pooled_keys_over_the_windows_they_read() -> None:
    """CvT's last stage puts the cls token's key in front of the keys its 3 x 3 stride-2 conv
    pools (a ``cat``): its keys are pooled as the earlier stages' are, and EViT's score of a
    token there is the mean cls attention of the keys whose window reads it, as in those stages
    (not the key of the cell that holds it)."""
    from vitcompress.method import key_scores_to_tokens

    model = timm.create_model("cvt_13", num_classes=10, depths=(1, 1, 2)).eval()
    size = (3, 64, 64)
    pools = [block.attention.key_pool for block in map_model(model, size).blocks]
    assert pools == [((3, 3), (2, 2), (1, 1))] * 4
    compressed = compress(model, "evit", keep=[0.7], locs=[2], input_size=size).eval()
    seen = {}

    def keep(module: nn.Module, args: tuple, out: tuple) -> None:  # None: the output unchanged
        seen["out"] = out

    dict(compressed.named_modules())["tps_hooks.attn2"].register_forward_hook(keep)
    with torch.no_grad():
        compressed(torch.randn(2, *size, generator=torch.Generator().manual_seed(1)))
    probs, scores = seen["out"]  # (B, heads, 1 + 4 x 4 queries, 1 + 2 x 2 keys), (B, 16)
    assert probs.shape[-2:] == (17, 5)
    cls_row = probs[:, :, 0, 1:].mean(dim=1)  # (B, 4): the cls query's attention to each key
    torch.testing.assert_close(scores, key_scores_to_tokens(cls_row, (4, 4), None, pools[2]))
    # Not each cell's own key: token (0, 1) is read by keys (0, 0) and (0, 1), so its score is
    # their mean, which differs from key (0, 0)'s alone.
    torch.testing.assert_close(scores[:, 1], cls_row[:, :2].mean(dim=1))
    assert not torch.allclose(scores[:, 1], cls_row[:, 0])
