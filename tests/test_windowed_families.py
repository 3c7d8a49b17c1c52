"""Windowed families beyond timm's Swin: MaxViT (block and grid attention), TinyViT and DaViT
(a conv between the attention and the MLP; DaViT's channel attention left whole), GCViT (a
global query: reduced after its attention only), HuggingFace Swin and Swinv2, the SAM ViT
encoder (a predictor refused in one line), NesT (windows on an axis of their own) and
SAM2-Hiera (its query-pooling blocks left whole), MViTv2 (one window over each block's grid,
its pooling attention run whole). Each working family: windows found as its
config lays them out, keep 1 exact on sharpened weights, keep 0.7 reduces every window alike,
a training step is finite, the ONNX export matches."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import timm
import torch
from torch import nn

from tests.fixtures import dense_models, hf_models
from vitcompress import compress, map_model
from vitcompress.analysis.analyse import MappingError
from vitcompress.analysis.window_map import (
    SlotInput,
    SlotKind,
    WholeAttention,
    WindowLayout,
    Windows,
)
from vitcompress.compilation.metadata import compression_info
from vitcompress.measure import count_macs
from vitcompress.workflows.export import export_model


def _slots(windows: Windows, kind: SlotKind) -> list[SlotInput]:
    """What the window attention reads by slot, of one kind (none where it runs whole)."""
    return [s for s in getattr(windows.attention, "slot_inputs", ()) if s.kind is kind]


METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")
PREDICTORS = ("dtps", "dynamicvit")


def sharpen(model: nn.Module) -> nn.Module:
    """Weights under which positions matter (random init attends almost uniformly, which hides
    a token put in the wrong window or slot): relative-position tables from N(0, 1), queries
    and keys x3 (timm's fused qkv, HF's q_proj/k_proj)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # SAM's decomposed relative position tables start at zero.
            if name.endswith(("relative_position_bias_table", "rel_pos_h", "rel_pos_w")):
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name.endswith("qkv.weight"):
                param[: 2 * (param.shape[0] // 3)] *= 3.0
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param *= 3.0
    return model.eval()


def _maxvit() -> nn.Module:
    # 64 x 64: grids 16, 8, 4, 2; block and grid partitions of 2 x 2.
    return timm.create_model("maxvit_pico_rw_256", img_size=64, num_classes=10)


def _tiny_vit() -> nn.Module:
    # tiny_vit_5m_224 takes no img_size; at 64 x 64 its stages' grids are 16 (convs), 8, 4, 2:
    # windows of 4 x 4 divide them (its own 7 would pad the 8 x 8 grid).
    return timm.create_model("tiny_vit_5m_224", num_classes=10, window_sizes=(4, 4, 4, 2))


def _davit() -> nn.Module:
    # 128 x 128: grids 32, 16, 8, 4 in windows of 4 x 4, none padded.
    return timm.create_model(
        "davit_tiny",
        num_classes=10,
        embed_dims=(32, 64, 128, 256),
        num_heads=(1, 2, 4, 8),
        depths=(1, 1, 2, 1),
        window_size=4,
    )


def _sam_vit(img_size: int = 64) -> nn.Module:
    """64 x 64 in 8 x 8 patches: an 8 x 8 grid, blocks 0 and 1 in 4 windows of 4 x 4 (the same
    windows: block 1 can carry block 0's choice), block 2 global."""
    return timm.create_model(
        "samvit_base_patch16",
        img_size=img_size,
        patch_size=8,
        window_size=4,
        depth=3,
        embed_dim=64,
        num_heads=2,
        global_attn_indexes=(2,),
        num_classes=10,
    )


def _nest() -> nn.Module:
    # 64 x 64: level grids 16, 8, 4 in windows (NesT's blocks) of 4 x 4: 16, 4 and 1 windows.
    return timm.create_model("nest_tiny", img_size=64, num_classes=10)


def _sam2_hiera() -> nn.Module:
    """64 x 64: stage grids 16, 8, 4, 2. Block 0 in 16 windows of 4 x 4; blocks 1, 3 and 5 pool
    their queries (stage transitions); block 2 in 4 windows of 4 x 4, block 4 global (one
    window of the 4 x 4 grid), block 6 one window of 2 x 2. timm starts its head at zero: it is
    drawn here, so that the logits carry the features' errors."""
    model = timm.create_model(
        "sam2_hiera_tiny",
        num_classes=10,
        embed_dim=32,
        stages=(1, 2, 2, 2),
        window_spec=(4, 4, 4, 2),
        global_att_blocks=(4,),
    )
    nn.init.normal_(model.head.fc.weight, std=0.2)
    return model


def _hiera() -> nn.Module:
    """64 x 64: a 16 x 16 grid unrolled into 4 mask units; blocks 0 (4 units of 64 tokens) and 2
    (4 of 16) attend within them, blocks 1, 3 and 10 pool their queries (left whole), blocks
    4-9 and 11 attend globally. The head drawn, as for SAM2-Hiera."""
    model = timm.create_model("hiera_tiny_224", num_classes=10, img_size=64)
    nn.init.normal_(model.head.fc.weight, std=0.2)
    return model


def _gcvit() -> nn.Module:
    return timm.create_model("gcvit_xxtiny", img_size=64, num_classes=10)


def _mvitv2() -> nn.Module:
    """64 x 64: stage grids 16, 8, 4, 2; every block pools its keys and values (and its
    queries, by stride 1) on a per-head grid, so its attention runs whole and its MLP is
    reduced; the stage transitions are left whole."""
    return timm.create_model("mvitv2_tiny", img_size=64, num_classes=10)


def _hf(name: str) -> Callable[[], nn.Module]:
    """A transformers classifier of ``tests/fixtures/hf_models.py``, images in, logits out."""
    return lambda: hf_models.sharpen(hf_models.Logits(hf_models.build(name)[0]))


# name: (builder, input side, methods that reduce it)
FAMILIES: dict[str, tuple[Callable[[], nn.Module], int, tuple[str, ...]]] = {
    "maxvit": (_maxvit, 64, METHODS),
    "tiny_vit": (_tiny_vit, 64, METHODS),
    "davit": (_davit, 128, METHODS),
    "gcvit": (_gcvit, 64, METHODS),
    "sam_vit": (_sam_vit, 64, METHODS),
    "nest": (_nest, 64, METHODS),
    "sam2_hiera": (_sam2_hiera, 64, METHODS),  # its query-pooling blocks left whole
    "hiera": (_hiera, 64, METHODS),  # likewise
    "mvitv2": (_mvitv2, 64, PREDICTORS + ("etps", "evit")),  # ToMe: its keys are pooled
    "hf_swin": (_hf("hf_swin"), 56, METHODS),
    "hf_swinv2": (_hf("hf_swinv2"), 56, METHODS),
    # transformers' SAM vision encoder
    "hf_sam": (dense_models.hf_sam_encoder, 64, METHODS),
}


def _build(name: str) -> tuple[nn.Module, tuple[int, int, int]]:
    builder, side, _ = FAMILIES[name]
    torch.manual_seed(0)
    return sharpen(builder()), (3, side, side)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    model, size = _build(request.param)
    return request.param, model, size


def _images(size: tuple[int, int, int], dtype=torch.float32) -> torch.Tensor:
    return torch.randn(2, *size, generator=torch.Generator().manual_seed(1)).to(dtype)


def one_choice_both_ways(
    compressed: nn.Module,
    images: torch.Tensor,
    monkeypatch: pytest.MonkeyPatch,
    kept_for: Callable[[int], int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The logits at inference; in training with the Gumbel draw replaced by inference's own
    top-k (``kept_for(tokens)`` of each row's tokens), which must equal them; and in training
    with the opposite choice, which tells the two apart."""
    from vitcompress.modules import reducers

    def choice(largest: bool):
        def draw(log_probs: torch.Tensor, hard: bool = True) -> torch.Tensor:
            keep = log_probs[..., 0]
            top = keep.topk(kept_for(keep.shape[1]), dim=1, largest=largest).indices
            chosen = torch.zeros_like(keep).scatter(1, top, 1.0)
            return torch.stack([chosen, 1.0 - chosen], dim=-1)

        return draw

    with torch.no_grad():
        inferred = compressed(images)
        compressed.train()
        monkeypatch.setattr(reducers.F, "gumbel_softmax", choice(largest=True))
        trained = compressed(images)
        monkeypatch.setattr(reducers.F, "gumbel_softmax", choice(largest=False))
        other = compressed(images)
    return inferred, trained, other


# --- Window orders written out by hand from each config ------------------------------------
def window_order(height: int, width: int, window: int, shift: int = 0) -> list[int]:
    """Roll the grid by ``-shift``, cut it into ``window`` x ``window`` tiles, row-major within
    and across tiles: slot s of the windows holds token ``order[s]`` (row-major on the grid)."""
    order = []
    for tile_row in range(height // window):
        for tile_col in range(width // window):
            for i in range(window):
                for j in range(window):
                    row = (tile_row * window + i + shift) % height
                    col = (tile_col * window + j + shift) % width
                    order.append(row * width + col)
    return order


def grid_order(height: int, width: int, grid: int) -> list[int]:
    """MaxViT's grid partition: window (a, b) holds the ``grid`` x ``grid`` tokens strided by
    (height / grid, width / grid) from (a, b)."""
    step_h, step_w = height // grid, width // grid
    return [
        (i * step_h + a) * width + j * step_w + b
        for a in range(step_h)
        for b in range(step_w)
        for i in range(grid)
        for j in range(grid)
    ]


def test_maxvit_block_and_grid_partitions_are_found():
    model, size = _build("maxvit")
    blocks = map_model(model, size).blocks
    # A block and a grid attention in every MaxViT block.
    assert len(blocks) == 2 * sum(len(stage.blocks) for stage in model.stages)
    assert [b.windows.count for b in blocks[:4]] == [64, 64, 64, 64]
    assert list(blocks[0].windows.order) == window_order(16, 16, 2)
    assert list(blocks[1].windows.order) == grid_order(16, 16, 2)
    assert list(blocks[4].windows.order) == window_order(8, 8, 2)
    assert list(blocks[5].windows.order) == grid_order(8, 8, 2)
    assert window_order(16, 16, 2) != grid_order(16, 16, 2)


def test_tiny_vit_windows_are_found():
    model, size = _build("tiny_vit")
    blocks = map_model(model, size).blocks
    # Stage 1 (8 x 8) in 4 windows; stage 2's 4 x 4 grid is one window, attended whole.
    assert [b.windows.count for b in blocks[:3]] == [4, 4, 1]
    assert list(blocks[0].windows.order) == window_order(8, 8, 4)
    assert list(blocks[2].windows.order) == list(range(16))


def test_davit_windows_are_found_and_its_channel_attention_is_left_whole():
    model, size = _build("davit")
    model_map = map_model(model, size)
    # One spatial block per (spatial, channel) pair; the 4 x 4 last grid is one window, which
    # its block views as the grid to partition (found by ``through_grid``).
    spatial = [b for b in model_map.blocks if b.windows is not None]
    assert [b.windows.count for b in spatial] == [64, 16, 4, 4, 1]
    assert list(spatial[4].windows.order) == list(range(16))
    assert list(spatial[0].windows.order) == window_order(32, 32, 4)
    assert list(spatial[1].windows.order) == window_order(16, 16, 4)
    # Blocks (spatial, channel) pair up as stages.i.blocks.j.0 and .1: no channel block maps,
    # and each is listed as left whole, with why.
    assert all(b.path.endswith(".0") for b in model_map.blocks)
    channel = [f"stages.{i}.blocks.{j}.1.attn" for i, j in ((0, 0), (1, 0), (2, 0), (2, 1), (3, 0))]
    assert [line.split(":")[0] for line in model_map.left_whole] == channel
    assert all("channels per head" in line for line in model_map.left_whole)


def test_hiera_mask_units_map_and_the_blocks_left_whole_are_listed_with_why():
    """timm's Hiera cuts its mask units from the (B, L, C) tokens after the projection,
    interleaved (token i * windows + w in window w). The capture cuts them before the projection
    instead (the same numbers), so those blocks map as windowed blocks whose windows are on an
    axis of their own, in the order written out here by hand. The blocks that pool their queries
    run whole and the model map lists each with why, rather than leaving them out silently."""
    model, size = _build("hiera")
    model_map = map_model(model, size)
    mapped = [b.path for b in model_map.blocks]
    assert mapped == [f"blocks.{i}" for i in (0, 2, 4, 5, 6, 7, 8, 9, 11)]
    first, second = model_map.blocks[0].windows, model_map.blocks[1].windows
    assert (first.count, first.tokens, second.count, second.tokens) == (4, 64, 4, 16)
    assert first.attention.layout is second.attention.layout is WindowLayout.WINDOW_AXIS
    assert list(first.order) == [i * 4 + w for w in range(4) for i in range(64)]
    assert list(second.order) == [i * 4 + w for w in range(4) for i in range(16)]
    listed = {line.split(":")[0]: line for line in model_map.left_whole}
    assert sorted(listed) == ["blocks.1.attn", "blocks.10.attn", "blocks.3.attn"]
    assert all("its queries are pooled" in line for line in listed.values())


def test_hiera_with_as_many_mask_units_as_tokens_in_each_maps_and_is_exact():
    """At 128 pixels Hiera's second stage has 16 mask units of 16 tokens: its output laid out
    (B, units, N, C) and put back as (B, N, units, C) have one shape, and only the first is the
    windows' (a transpose between them is not the windows' layout). Exact at keep 1 in float64
    on sharpened weights, dTPS (which re-sorts) and eTPS."""
    torch.manual_seed(0)
    model = sharpen(timm.create_model("hiera_tiny_224", num_classes=10, img_size=128))
    nn.init.normal_(model.head.fc.weight, std=0.2)
    model = model.double()
    size = (3, 128, 128)
    images = _images(size, torch.float64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        windows = map_model(model, size).blocks[1].windows
        assert (windows.count, windows.tokens) == (16, 16)
        assert list(windows.order) == [i * 16 + w for w in range(16) for i in range(16)]
        with torch.no_grad():
            base = model(images)
            for method in ("dtps", "etps"):
                same = compress(model, method, keep=[1.0], input_size=size)(images)
                assert (same - base).abs().max() <= 1e-9 * base.abs().max(), method
    finally:
        torch.set_default_dtype(default)


def test_gcvit_windows_are_found_and_its_global_query_follows_the_kept_slots():
    """GCViT's every other block takes its queries from a global token generator, the keys and
    values from the window tokens: the windows are read from the key input, and the global
    query, made without the window tokens and laid out by window slot, is gathered by each
    window's kept slots when a predictor reduces the windows."""
    model, size = _build("gcvit")
    model_map = map_model(model, size)
    blocks = model_map.blocks
    assert list(blocks[0].windows.order) == window_order(16, 16, 2)
    # At 64 pixels stages 2 and 3 are one window each: their global query blocks map too.
    assert [b.windows.count for b in blocks] == [64, 64, 16, 16] + [1] * 8
    assert [bool(_slots(b.windows, SlotKind.QUERY_ROWS)) for b in blocks] == [False, True] * 6
    assert model_map.left_whole == []
    assert all(b.windows.attention_reducible for b in blocks)
    compressed = compress(model, "dtps", keep=[0.7], input_size=size)
    seen = []
    gathers = [m for n, m in compressed.named_modules() if type(m).__name__ == "WindowQueryGather"]
    assert len(gathers) == 6
    gathers[0].register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    with torch.no_grad():
        compressed(_images(size))
    kept = dict(compressed.named_modules())["tps.1"].keep_tokens
    assert kept < 4 and seen == [(2 * 64, 2, kept, 32)]


@pytest.mark.parametrize("name", ["hf_swin", "hf_swinv2"])
def test_hf_swin_windows_and_shift_are_found(name):
    model, size = _build(name)
    blocks = map_model(model, size).blocks
    assert [b.windows.count for b in blocks[:2]] == [4, 4]
    assert list(blocks[0].windows.order) == window_order(14, 14, 7)
    assert list(blocks[1].windows.order) == window_order(14, 14, 7, shift=3)
    # The last stage is one window wide: HF views it as its 7 x 7 grid (sizes from the stage,
    # not the tokens) to partition it, so it maps as one window, never as a plain block.
    assert [(b.windows.count, list(b.windows.order)) for b in blocks[2:]] == [
        (1, list(range(49)))
    ] * 2


@pytest.mark.parametrize("name", ["hf_swin", "hf_swinv2"])
@pytest.mark.parametrize("method", ["dtps", "etps", "tome"])
def test_hf_swins_one_window_stage_reduces_when_chosen(name, method):
    """Chosen alone, the one-window blocks reduce and give their grid back (a plain block's
    reduction used to reach HF's view to the 7 x 7 grid and fail)."""
    model, size = _build(name)
    images = _images(size)
    compressed = compress(model, method, keep=[0.7, 0.7], locs=[2, 3], input_size=size)
    with torch.no_grad():
        assert compressed(images).shape == model(images).shape
    assert count_macs(compressed, size) < count_macs(model, size)


# --- What every working family passes -------------------------------------------------------
def test_keep_one_is_exact_on_sharpened_weights(family):
    """In double precision, where float rounding cannot hide a token in the wrong slot."""
    name, model, size = family
    double = _build(name)[0].double()
    images = _images(size, torch.float64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the capture's example and the reducers' too
    try:
        with torch.no_grad():
            base = double(images)
            for method in FAMILIES[name][2]:
                out = compress(double, method, keep=[1.0], input_size=size)(images)
                assert (out - base).abs().max() <= 1e-9 * base.abs().max(), method
    finally:
        torch.set_default_dtype(default)


def test_keep_07_reduces_every_window_alike(family):
    name, model, size = family
    images = _images(size)
    with torch.no_grad():
        base = model(images)
    for method in ("dtps", "etps") if "dtps" in FAMILIES[name][2] else ("etps",):
        torch.manual_seed(0)
        compressed = compress(model, method, keep=[0.7], input_size=size)
        seen = []
        for module_name, module in compressed.named_modules():
            if module_name.startswith("tps.") and module_name.count(".") == 1:
                module.register_forward_hook(
                    lambda m, i, o, seen=seen: seen.append((tuple(i[0].shape), tuple(o[0].shape)))
                )
        with torch.no_grad():
            out = compressed(images)
        assert out.shape == base.shape and torch.isfinite(out).all()
        assert not torch.allclose(out, base), method  # something was reduced
        assert seen, method
        kept = {after[1] for _, after in seen}
        for before, after in seen:  # every window keeps fewer tokens, the windows whole
            assert after[0] == before[0] and after[1] < before[1]
            # int(0.7 N) kept, and eTPS's one fused token besides.
            assert after[1] - int(before[1] * 0.7) in ((0,) if method == "dtps" else (1,))
        assert kept


def test_one_training_step_is_finite(family):
    name, model, size = family
    for method in ("dtps", "etps") if "dtps" in FAMILIES[name][2] else ("etps",):
        torch.manual_seed(0)
        compressed = compress(model, method, keep=[0.7], input_size=size).train()
        out = compressed(_images(size))
        # A classifier's logits, or a feature map (HF SAM's encoder) regressed to zero.
        if out.dim() == 2:
            loss = nn.functional.cross_entropy(out, torch.tensor([1, 2]))
        else:
            loss = out.square().mean()
        loss.backward()
        assert torch.isfinite(loss), method
        grads = [p.grad for p in compressed.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), method


@pytest.mark.slow  # 10 to 75 s a family
def test_onnx_export_matches(family, tmp_path):
    name, model, size = family
    for method in ("dtps", "etps") if "dtps" in FAMILIES[name][2] else ("etps",):
        torch.manual_seed(0)
        compressed = compress(model, method, keep=[0.7], input_size=size)
        result = export_model(compressed, size, "onnx", tmp_path / f"{name}_{method}.onnx")
        assert result["max_abs_diff"] < 1e-3, method


# --- Refused in one line ----------------------------------------------------------------------
def test_sam2_hiera_pooled_query_blocks_are_left_whole_and_the_rest_map():
    """SAM2-Hiera's stage transitions pool their queries within each window: those blocks are
    left whole, each named with why, and the windowed and global blocks around them map, their
    attention reading ``B, H, W, C = x.shape`` as a product only (a predictor hands it K x 1)."""
    model, size = _build("sam2_hiera")
    model_map = map_model(model, size)
    assert [b.path for b in model_map.blocks] == ["blocks.0", "blocks.2", "blocks.4", "blocks.6"]
    assert [(b.windows.count, b.windows.tokens) for b in model_map.blocks] == [
        (16, 16),
        (4, 16),
        (1, 16),
        (1, 4),
    ]
    assert list(model_map.blocks[0].windows.order) == window_order(16, 16, 4)
    assert list(model_map.blocks[1].windows.order) == window_order(8, 8, 4)
    assert all(b.windows.attention.layout is WindowLayout.SPATIAL for b in model_map.blocks)
    assert all(b.windows.attention_reducible for b in model_map.blocks)
    assert model_map.left_whole == [
        *(
            f"blocks.{i}.attn: its queries are pooled (4 queries against 16 keys per window), "
            "so the block changes the token count and its windows cannot be reduced alike"
            for i in (1, 3)
        ),
        # One window over the whole 4 x 4 grid: said without windows.
        "blocks.5.attn: its queries are pooled (4 queries against 16 keys), so the block "
        "changes the token count and no reduction keeps it",
    ]
    assert model_map.to_json()["left_whole"] == model_map.left_whole


def test_a_model_of_query_pooling_blocks_only_is_refused_in_one_line():
    """With every windowed block pooling its queries there is nothing to reduce: the model is
    refused with the first such block's reason."""
    model = timm.create_model(
        "sam2_hiera_tiny",
        num_classes=10,
        embed_dim=32,
        stages=(1, 1),
        q_pool=1,
        window_spec=(4, 4),
        global_att_blocks=(),
    ).eval()
    # The stage transition alone (a slice keeps its name, blocks.1): its input is stage 0's width.
    model.blocks = model.blocks[1:]
    with pytest.raises(MappingError) as refused:
        map_model(model, (3, 64, 64))
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("windowed attention at blocks.1.attn: its queries are pooled")


def test_sam_vit_windows_are_found_and_a_predictor_hands_its_attention_the_kept_tokens():
    """SAM's attention folds its heads into the batch, (B * windows * heads, N, D); the capture
    gives it its heads axis back, so the windowed blocks (4 windows of 4 x 4) and the global
    block (one window of the 8 x 8 grid) map. Its decomposed relative position is a term made
    row by row from the queries and tables indexed by row and column offsets: it is found as
    such (a ``QueryTermInput``), and a predictor hands the attention each window's kept
    tokens as K x 1 "windows", the term made at the full window."""
    model, size = _build("sam_vit")
    blocks = map_model(model, size).blocks
    assert [(b.windows.count, b.windows.tokens) for b in blocks] == [(4, 16), (4, 16), (1, 64)]
    assert list(blocks[0].windows.order) == window_order(8, 8, 4)
    assert [b.attention.heads for b in blocks] == [2, 2, 2]
    assert [[s.what for s in _slots(b.windows, SlotKind.QUERY_TERM)] for b in blocks] == [
        [f"blocks.{i}.attn.rel_pos_h, blocks.{i}.attn.rel_pos_w"] for i in range(3)
    ]
    assert all(b.windows.attention.layout is WindowLayout.SPATIAL for b in blocks)
    assert all(b.windows.attention_reducible for b in blocks)
    for method in PREDICTORS:
        compressed = compress(model, method, keep=[0.7], input_size=size)
        kept = dict(compressed.named_modules())["tps.0"].keep_tokens
        seen = []
        qkv = dict(compressed.named_modules())["blocks.0.attn.qkv"]
        qkv.register_forward_hook(lambda m, i, o, seen=seen: seen.append(tuple(i[0].shape)))
        with torch.no_grad():
            assert torch.isfinite(compressed(_images(size))).all()
        assert seen == [(2 * 4, kept, 64)]


@pytest.mark.parametrize("carry", (False, True))
@pytest.mark.parametrize("method", PREDICTORS)
@pytest.mark.parametrize("name", ("sam_vit", "gcvit", "hf_sam", "davit"))
def test_a_predictor_trains_on_the_attention_it_infers_with(name, method, carry, monkeypatch):
    """SAM's term made from the queries (timm's and HF's), GCViT's global query: while a
    predictor trains, every
    query makes the term (every global query row is used) and the removed keys are masked; at
    inference, SAM's kept queries are put back in their slots, the term made at the full window
    and its kept rows' kept columns gathered, and GCViT's global query rows gathered by the kept
    slots; DaViT's channel blocks' MLPs take the spatial location's choice (by its keep mask
    while training, its kept tokens gathered at inference). With the Gumbel draw replaced by
    inference's own top-k, both give the same logits
    (with a block carrying another's choice too); a row put in a wrong slot would not, the
    tables being drawn from N(0, 1)."""
    model, size = _build(name)
    blocks = map_model(model, size).blocks
    settings = {"carry_windows": True} if carry else None
    torch.manual_seed(0)
    compressed = compress(model, method, keep=[0.7], input_size=size, variant_args=settings)
    compressed.eval()
    locations = compression_info(compressed).plan.locations
    kept = {
        blocks[locations[int(path.split(".")[-1])].block].windows.tokens: module.keep_tokens
        for path, module in compressed.named_modules()
        if getattr(module, "keep_tokens", None)
    }

    # The masked softmax's eps (DynamicViT's, a 1e-6 share spread over every key) is the one
    # term in which training's attention differs from inference's by design: off here, so that
    # the two must agree to rounding (HF SAM's sharpened logits show it at 3e-5).
    from vitcompress.method import attention

    monkeypatch.setattr(attention.masked_softmax, "__defaults__", (0.0,))
    inferred, trained, other = one_choice_both_ways(
        compressed, _images(size), monkeypatch, kept.__getitem__
    )
    # HF SAM's encoder (its neck normalises the feature map) carries the masked softmax's
    # float32 rounding further: 2e-5 here; in float64 with eps off, 4e-6 (that softmax still
    # runs in float32), against more than 1 for the opposite choice.
    tolerance = 1e-4 if name == "hf_sam" else 1e-5
    torch.testing.assert_close(trained, inferred, atol=tolerance, rtol=tolerance)
    assert (other - inferred).abs().max() > 1e-3


def _previous_token(q: torch.Tensor) -> torch.Tensor:
    return q.roll(1, dims=1)


def _first_row_from_the_mean(q: torch.Tensor) -> torch.Tensor:
    return torch.cat((q.mean(1, keepdim=True), q[:, 1:]), 1)


@pytest.mark.parametrize("mix", (_previous_token, _first_row_from_the_mean))
def test_a_query_made_term_that_mixes_tokens_keeps_the_attention_whole(mix, monkeypatch):
    """A term made from the queries where a row reads another token's query (each row from the
    previous token's; or only the first row, from the mean of the window's queries) cannot be
    made from the kept queries alone: the probe, which changes each half of the rows in turn,
    catches it, and the model map says why in one line. A predictor then runs that attention
    on every token (its projection gets the full windows) and chooses on the MLP's input; keep
    1 is exact."""
    from timm.models import vision_transformer_sam as sam

    made = sam.get_decomposed_rel_pos_bias
    monkeypatch.setattr(sam, "get_decomposed_rel_pos_bias", lambda q, *args: made(mix(q), *args))
    model, size = _build("sam_vit")
    windows = map_model(model, size).blocks[0].windows
    assert isinstance(windows.attention, WholeAttention)
    assert "\n" not in windows.attention.reason
    assert "a term made from its queries that mixes queries of different tokens" in (
        windows.attention.reason
    )
    images = _images(size)
    compressed = compress(model, "dtps", keep=[0.7], input_size=size)
    seen: list[tuple[int, ...]] = []
    qkv = dict(compressed.named_modules())["blocks.0.attn.qkv"]
    qkv.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    with torch.no_grad():
        compressed(images)
        assert seen[0][:-1] == (2 * 4, 16)  # every token of its 4 windows of 4 x 4
        same = compress(model, "dtps", keep=[1.0], input_size=size)(images)
        assert torch.allclose(same, model(images), atol=1e-5)
    compress(model, "etps", keep=[0.7], input_size=size)


def test_nest_windows_on_their_own_axis_are_found_and_a_predictor_keeps_that_axis():
    """NesT attends within windows laid on an axis of their own, (B, heads, windows, N, D); the
    capture folds the windows into the batch, so its blocks map as windowed blocks (16, 4 and 1
    windows of 4 x 4 at 64 pixels). Its attention reads its input as (B, windows, N, C)
    (``B, T, N, C = x.shape``): a predictor hands it (B, windows, K, C), never (B x windows, K,
    C) nor K x 1 windows, and its attention attends over the K kept tokens of each window."""
    model, size = _build("nest")
    blocks = map_model(model, size).blocks
    assert [(b.windows.count, b.windows.tokens) for b in blocks] == [(16, 16)] * 2 + [
        (4, 16)
    ] * 2 + [(1, 16)] * 8
    # Its tokens stay in their windows between blocks, (B, windows, N, C): slot s holds the
    # block's token s.
    assert list(blocks[0].windows.order) == list(range(256))
    assert list(blocks[2].windows.order) == list(range(64))
    assert all(b.windows.attention.layout is WindowLayout.WINDOW_AXIS for b in blocks)
    compressed = compress(model, "dtps", keep=[0.7], input_size=size)
    seen = {}
    modules = dict(compressed.named_modules())
    for index in (0, 2, 4):  # each level's first block: its qkv projection's input
        path = blocks[index].path + ".attn.qkv"
        modules[path].register_forward_hook(
            lambda m, i, o, path=path: seen.__setitem__(path, tuple(i[0].shape))
        )
    with torch.no_grad():
        compressed(_images(size))
    kept = int(0.7 * 16)
    assert list(seen.values()) == [(2, 16, kept, 96), (2, 4, kept, 192), (2, 1, kept, 384)]


# --- Cost at the real widths -----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "name, side, extra, limits",
    [
        # MaxViT's MBConv blocks run on the full grid: eTPS, which saves in the MLP only, stays
        # above 0.85 (0.888 measured); a predictor saves in the whole attention block.
        ("maxvit_pico_rw_256", 256, {}, {"dtps": 0.85, "etps": 0.90}),
        # TinyViT's first stage is convolutions, and a conv sits in every block (0.853, 0.888).
        ("tiny_vit_5m_224", 224, {}, {"dtps": 0.86, "etps": 0.90}),
        # SAM's encoder at 448 (2 x 2 windows of 14, 4 global blocks): eTPS saves in the MLP
        # only (0.829 measured; 0.867 while the score cost a second q k^T), ToMe likewise (0.820).
        ("samvit_base_patch16", 448, {"img_size": 448}, {"etps": 0.85, "tome": 0.83}),
        # NesT: a predictor hands its attention (B, windows, K, C) (0.827 measured).
        ("nest_tiny", 224, {}, {"dtps": 0.85}),
        # SAM2-Hiera: its three query-pooling blocks run whole (0.862, 0.882). Carrying the
        # choice through its one-window stage (carry_windows) takes eTPS under 0.85 (0.829).
        ("sam2_hiera_tiny", 224, {}, {"dtps": 0.87, "etps": 0.89, "etps carried": 0.85}),
        # Hiera: its mask-unit blocks, and its third stage restored before the block that pools
        # it (0.821, 0.829 measured; 0.959 and 0.962 while neither was reduced).
        ("hiera_tiny_224", 224, {}, {"dtps": 0.85, "etps": 0.85}),
        # SAM's encoder takes a predictor, its query-made term made at the full window (0.801).
        ("samvit_base_patch16", 448, {"img_size": 448}, {"dtps": 0.82}),
        # GCViT: every block maps, its global query gathered by the kept slots (0.858, 0.882;
        # carrying, 0.800).
        ("gcvit_xxtiny", 224, {}, {"dtps": 0.87, "etps": 0.89, "etps carried": 0.82}),
        # DaViT: its channel blocks' MLPs take the spatial block's choice (by default: 0.827 and
        # 0.813 measured, 0.914 and 0.907 while they ran whole; carrying, 0.810 and 0.795,
        # 0.898 and 0.889 while they ran whole, above its 0.853 floor).
        (
            "davit_tiny",
            224,
            {},
            {"etps": 0.835, "dtps": 0.82, "etps carried": 0.82, "dtps carried": 0.81},
        ),
    ],
)
def test_keep_07_costs_less_at_the_real_width(name, side, extra, limits):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, **extra).eval()
    size = (3, side, side)
    base = count_macs(model, size)
    for setting, limit in limits.items():
        method, *carried = setting.split()
        compressed = compress(
            model,
            method,
            keep=[0.7],
            input_size=size,
            variant_args={"carry_windows": True} if carried else None,
        )
        ratio = count_macs(compressed, size) / base
        assert ratio < limit, (setting, ratio)


def test_an_attention_that_reads_its_windows_size_as_a_product_takes_a_predictor():
    """VOLO's one-window blocks norm the (B, H, W, C) stream and read ``B, H, W, C = x.shape``
    inside the attention, using H and W only as H * W and to lay its output back out: a
    predictor hands it the kept tokens as (B, K, 1, C), exact at keep 1 in float64 on sharpened
    weights, and keeps int(0.7 N) of them at keep 0.7."""
    torch.manual_seed(0)
    volo = sharpen(timm.create_model("volo_d1_224", img_size=64, num_classes=10)).double()
    size = (3, 64, 64)
    images = _images(size, torch.float64)
    blocks = map_model(volo, size).blocks
    windowed = [b for b in blocks if b.windows is not None]
    assert windowed and all(b.windows.attention.layout is WindowLayout.SPATIAL for b in windowed)
    with torch.no_grad():
        base = volo(images)
        for method in PREDICTORS:
            out = compress(volo, method, keep=[1.0], input_size=size).double()(images)
            assert (out - base).abs().max() <= 1e-9 * base.abs().max(), method
        compressed = compress(volo, "dtps", keep=[0.7], input_size=size).double()
        seen = []
        for name, module in compressed.named_modules():
            if name.startswith("tps.") and name.count(".") == 1:
                module.register_forward_hook(lambda m, i, o: seen.append(tuple(o[0].shape)))
        assert compressed(images).shape == base.shape
    assert seen and all(shape[1] == 11 for shape in seen)  # int(0.7 * 16) of a 4 x 4 grid


class _RowScaledAttention(nn.Module):
    """VOLO's attention, then each row of the window scaled by its row number: it reads H
    alone (``torch.arange(H)``), which a K x 1 stand-in for the window would get wrong."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, H, W, C = x.shape
        rows = torch.arange(H, dtype=x.dtype, device=x.device).view(1, H, 1, 1)
        return self.attention(x) * (1 + rows)


def test_an_attention_that_reads_a_windows_row_alone_runs_whole_under_a_predictor():
    """An attention that reads its window's rows alone cannot take a K x 1 stand-in: the model
    map says so in one line, and a predictor runs it on every token, choosing on the MLP's
    input instead; keep 1 is exact."""
    torch.manual_seed(0)
    volo = timm.create_model("volo_d1_224", img_size=64, num_classes=10).eval()
    for block in volo.network[2]:
        block.attn = _RowScaledAttention(block.attn)
    size = (3, 64, 64)
    blocks = map_model(volo, size).blocks
    blockers = [b.windows.attention.reason for b in blocks if b.path.startswith("network.2.")]
    assert len(blockers) == len(volo.network[2])
    assert all(blocker and "\n" not in blocker for blocker in blockers)
    assert all(
        "reads the windows' spatial size off" in blocker
        and "other than as their product" in blocker
        for blocker in blockers
    )
    images = torch.randn(2, *size)
    with torch.no_grad():
        for method in ("dtps", "etps"):
            same = compress(volo, method, keep=[1.0], input_size=size)(images)
            assert torch.allclose(same, volo(images), atol=1e-5), method
        reduced = compress(volo, "dtps", keep=[0.7], input_size=size)(images)
    assert torch.isfinite(reduced).all() and not torch.allclose(reduced, volo(images), atol=1e-5)


@pytest.mark.parametrize("restore", ("delta", "value"))
def test_a_carried_block_after_a_whole_attention_location_reduces_its_own(restore):
    """VOLO's first attention block reads its window's rows alone (its attention runs whole
    under a predictor, which chooses on its MLP's input); the 13 blocks after it in the same
    window carry that choice and run their attention on the kept tokens, restored by the host
    rule whatever the method's own rule: the location records the hosts for them. Keep 1 is
    exact."""
    torch.manual_seed(0)
    volo = timm.create_model("volo_d1_224", img_size=64, num_classes=10).eval()
    volo.network[2][0].attn = _RowScaledAttention(volo.network[2][0].attn)
    size = (3, 64, 64)
    args = {"carry_windows": True, "restore": restore}
    compressed = compress(volo, "dtps", keep=[0.7], input_size=size, variant_args=args)
    location = compression_info(compressed).plan.locations[0]
    assert (location.block, location.carried) == (0, tuple(range(1, 14)))
    seen: list[tuple[int, ...]] = []
    modules = dict(compressed.named_modules())
    for path in ("network.2.0.attn.attention.qkv", "network.2.1.attn.qkv"):
        modules[path].register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    images = torch.randn(2, *size)
    with torch.no_grad():
        compressed(images)
        same = compress(volo, "dtps", keep=[1.0], input_size=size, variant_args=args)(images)
        assert torch.allclose(same, volo(images), atol=1e-5)
    # Block 0's attention on the whole 4 x 4 window, block 1's on int(0.7 x 16) = 11 tokens.
    assert seen[0][1:3] == (4, 4) and seen[1][1:-1] in ((11,), (11, 1)), seen


def test_a_model_that_cached_tensors_with_gradients_still_compresses():
    """TinyViT caches its attention bias in eval mode once it has run; run with gradients on,
    the cache is a tensor made by an op, which ``copy.deepcopy`` refuses. The tool copies the
    model without it (a cache is recomputed), and the caller's model keeps its cache."""
    model, size = _build("tiny_vit")
    model(_images(size))  # gradients on: the cached bias is not a leaf
    cached = [m for m in model.modules() if getattr(m, "attention_bias_cache", None)]
    assert cached  # the case this test is about
    compressed = compress(model, "etps", keep=[0.7], input_size=size)
    with torch.no_grad():
        assert torch.isfinite(compressed(_images(size))).all()
    assert all(m.attention_bias_cache for m in cached)


@pytest.mark.parametrize("method", ("etps", "evit", "tome", "dtps", "dynamicvit"))
def test_sam_vit_padded_windows_are_exact_at_keep_one(method):
    """SAM pads its grid after its first norm, inside the window partition (a 10 x 10 grid in
    windows of 4: 4 full windows, 4 of 8 tokens, 1 of 4): the padded slots are read off, and the
    windows reduced by groups after the attention; float64, tables from N(0, 1)."""
    torch.manual_seed(0)
    model = sharpen(_sam_vit(img_size=80)).double()
    size = (3, 80, 80)
    images = _images(size, torch.float64)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the capture's example too
    try:
        windows = map_model(model, size).blocks[0].windows
        assert windows.padded and [len(tokens) for _, tokens in windows.groups()] == [64, 32, 4]
        with torch.no_grad():
            base = model(images)
            same = compress(model, method, keep=[1.0], input_size=size)(images)
            reduced = compress(model, method, keep=[0.7], input_size=size)(images)
    finally:
        torch.set_default_dtype(default)
    assert (same - base).abs().max() <= 1e-9 * base.abs().max()
    assert torch.isfinite(reduced).all() and not torch.allclose(reduced, base)


@pytest.mark.parametrize("name", ("sam_vit", "gcvit", "hiera", "davit"))
def test_a_windowed_model_map_reads_back_what_it_wrote(name):
    """The windows' JSON (a query-made term's tables, a global query, the blocks left whole)
    reads back to the same JSON."""
    from vitcompress.analysis.model_map import ModelMap

    model, size = _build(name)
    written = map_model(model, size).to_json()
    assert ModelMap.from_json(written).to_json() == written


def test_hf_sam_encoder_makes_its_query_term_at_the_full_window():
    """HF's SAM encoder adds its decomposed relative position through SDPA's mask, made from its
    folded queries (B x windows x heads, N, D), read back as (B, H, W, D) with the window's
    height and width, and lays the output out as (B, heads, H, W, D): the term is found on every
    block (windowed and global), made at the full window, and the attention runs on the kept
    tokens under a predictor (its projection gets (B x 4, K, 1, C) in the windowed blocks)."""
    model, size = _build("hf_sam")
    blocks = map_model(model, size).blocks
    assert [b.windows.count for b in blocks] == [4, 1, 4, 1]
    assert all(_slots(b.windows, SlotKind.QUERY_TERM) for b in blocks)
    assert all(b.windows.attention_reducible for b in blocks)
    compressed = compress(model, "dtps", keep=[0.7], input_size=size)
    seen: list[tuple[int, ...]] = []
    qkv = dict(compressed.named_modules())["encoder.layers.0.attn.qkv"]
    qkv.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    with torch.no_grad():
        compressed(_images(size))
    assert seen == [(2 * 4, int(0.7 * 16), 1, 64)], seen
