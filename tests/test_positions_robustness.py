"""Capture and analysis robustness (issue 10 section 4): what is taken for token attention, where
reductions go, what is bound at capture, and what is refused because token order matters."""

from __future__ import annotations

import subprocess
import sys

import pytest
import timm
import torch
from torch import nn

import vitcompress
from tests.fixtures import inhouse, position_tables
from tests.models import SMALL
from vitcompress import map_model
from vitcompress.analysis.analyse import MappingError
from vitcompress.compilation.placement import default_locs
from vitcompress.compilation.plan import PlanError
from vitcompress.loading import default_input_size
from vitcompress.measure import count_macs
from vitcompress.modules.restore import TokenRestore

VARIANTS = ["dtps", "etps", "dynamicvit", "evit"]
SIZE = (3, 32, 32)


def _assert_keep_one_exact_and_reduced_runs(
    model: nn.Module, size=SIZE, variants=VARIANTS, **options
) -> None:
    model.eval()
    x = torch.randn(2, *size, generator=torch.Generator().manual_seed(0))
    for variant in variants:
        same = vitcompress.compress(model, variant, keep=1.0, input_size=size, **options).eval()
        reduced = vitcompress.compress(model, variant, keep=0.5, input_size=size, **options)
        with torch.no_grad():
            torch.testing.assert_close(same(x), model(x), atol=1e-5, rtol=0)
            assert reduced.eval()(x).shape == model(x).shape


class SoftmaxModuleAttention(nn.Module):
    """Attention normalised by an ``nn.Softmax`` module, as Swin and many in-house models do."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.normalise = nn.Softmax(dim=-1)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        weights = self.normalise((q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5)
        return self.out((weights @ v).transpose(1, 2).reshape(b, n, c))


def _softmax_module_vit() -> nn.Module:
    model = inhouse.register_vit()
    for layer in model.body:
        layer.sa = SoftmaxModuleAttention(64, 4)
    return model


def test_an_nn_softmax_module_is_attention():
    torch.manual_seed(0)
    model = _softmax_module_vit()
    model_map = map_model(model, SIZE)
    assert [b.attention.kind for b in model_map.blocks] == ["matmul_softmax"] * 4
    assert model_map.blocks[1].attention.path == "body.1.sa.normalise"
    _assert_keep_one_exact_and_reduced_runs(model)


def test_channel_attention_is_not_token_attention():
    """XCiT's cross-covariance attention is a (C/h x C/h) softmax over channels: it mixes no
    tokens, so its blocks are no place to score or drop tokens."""
    xcit = timm.create_model("xcit_nano_12_p16_224", num_classes=10, depth=2, img_size=64)
    with pytest.raises(MappingError, match="cross-covariance attention over channels"):
        map_model(xcit, (3, 64, 64))


def _cait() -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model("cait_xxs24_224", **{**SMALL, "depth": 4})


def test_cait_reduces_among_its_self_attention_blocks_only():
    model = _cait()
    model_map = map_model(model, SIZE)
    class_attention = [b.index for b in model_map.blocks if b.attention.query_tokens == 1]
    assert class_attention == [4, 5]  # two class-attention blocks after four self-attention
    assert default_locs(model_map) == [1, 2, 3]
    with pytest.raises(
        PlanError,
        match=r"^locs 4 is a class-attention block .*choose among "
        r"blocks 0\.\.3",
    ):
        vitcompress.compress(model, "etps", keep=0.7, locs=[2, 4], input_size=SIZE)
    _assert_keep_one_exact_and_reduced_runs(model, variants=("etps", "evit"))
    # The predictor variants train with masks that the class-attention blocks' keys (the patch
    # tokens of the stage before) would not honour: refused, not fine-tuned into another model.
    for variant in ("dtps", "dynamicvit"):
        with pytest.raises(
            PlanError,
            match=rf"^block 4 \(blocks_token_only\.0\) attends over 65 keys from an "
            rf"earlier stage, which {variant}'s training path cannot mask",
        ):
            vitcompress.compress(model, variant, keep=0.7, input_size=SIZE)


class OptionalMaskViT(nn.Module):
    """A forward with optional arguments that default to None (Hiera's mask, NaFlexViT's patch
    coordinates): the image is the only input, so they are bound as None at capture."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = inhouse.einsum_vit()

    def forward(
        self, image: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0
    ) -> torch.Tensor:
        if mask is not None:
            image = image * mask.view(image.shape[0], 1, 8, 8).repeat_interleave(
                4, 2
            ).repeat_interleave(4, 3)
        return self.inner(image) * scale


def test_optional_none_arguments_are_bound_at_capture():
    torch.manual_seed(0)
    model = OptionalMaskViT()
    _assert_keep_one_exact_and_reduced_runs(model)
    compressed = vitcompress.compress(model, "etps", keep=0.7, input_size=SIZE)
    with pytest.raises(AssertionError, match="specialized to have value None"):
        compressed(torch.randn(2, *SIZE), torch.ones(2, 64))  # not silently ignored


class FeaturesFlagViT(nn.Module):
    """A forward flag with a bool default, read by control flow (``return_features``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = OptionalMaskViT().inner

    def forward(self, image: torch.Tensor, return_features: bool = False) -> torch.Tensor:
        logits = self.inner(image)
        if return_features:
            return logits.softmax(-1)
        return logits


def test_optional_flag_arguments_are_bound_and_guarded_at_capture():
    torch.manual_seed(0)
    model = FeaturesFlagViT()
    _assert_keep_one_exact_and_reduced_runs(model)
    compressed = vitcompress.compress(model, "etps", keep=0.7, input_size=SIZE)
    with pytest.raises(AssertionError, match="specialized to have value False"):
        compressed(torch.randn(2, *SIZE), True)  # not the default's branch, silently


def test_a_resnet_stem_s_input_size_has_the_image_channels():
    model = timm.create_model("vit_tiny_r_s16_p8_224", num_classes=10)
    assert default_input_size(model) == (3, 224, 224)  # not the stem's 64 feature channels


def test_importing_vitcompress_registers_the_zoo():
    code = "import timm, vitcompress; print(timm.is_model('pvt_tiny'), timm.is_model('cvt_13'))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == ["True", "True"]


def test_tokens_pooled_by_their_order_between_stages_are_restored_before_the_pooling():
    """Hiera pools its unrolled tokens with a view over their order where a stage ends, in a
    block left whole: reduced (or merely re-sorted: dTPS sorts by score even at keep 1) tokens
    would be pooled with the wrong neighbours. Every op taking them there reads them restored,
    in their order, so the stage can be reduced: exact at keep 1 (float64, sharpened weights),
    fewer MACs at keep 0.7."""
    from tests.test_windowed_families import sharpen

    torch.manual_seed(0)
    hiera = sharpen(timm.create_model("hiera_tiny_224", num_classes=10, img_size=(64, 64)))
    torch.nn.init.normal_(hiera.head.fc.weight, std=0.2)
    hiera = hiera.double()
    size = (3, 64, 64)
    images = torch.randn(2, *size, generator=torch.Generator().manual_seed(1)).double()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model_map = map_model(hiera, size)
        stage = next(s for s in model_map.stages if len(s.blocks) > 1)  # blocks 4-9
        last = model_map.blocks[stage.blocks[-1]]
        assert stage.exit_bypass is None and stage.exit_grid_node is None
        assert [reader.path for reader in last.readers] == ["blocks.10.norm1"]
        with torch.no_grad():
            base = hiera(images)
            for variant in ("dtps", "evit"):
                locs = [stage.blocks[0]]
                same = vitcompress.compress(hiera, variant, keep=1.0, locs=locs, input_size=size)
                assert (same(images) - base).abs().max() <= 1e-9 * base.abs().max(), variant
                reduced = vitcompress.compress(hiera, variant, keep=0.7, locs=locs, input_size=size)
                assert torch.isfinite(reduced(images)).all()
                assert count_macs(reduced, size) < count_macs(same, size)
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize(
    "name, options",
    [
        ("swin_tiny_patch4_window7_224", dict(depths=(1, 1, 1, 1), img_size=56, window_size=7)),
        ("maxvit_nano_rw_256", dict(img_size=64)),
    ],
)
def test_windowed_attention_is_mapped_with_its_windows(name, options):
    """Refused once, windowed attention now maps with its windows (docs/windowed.md): every
    windowed block holds each of its tokens in exactly one window slot."""
    model = timm.create_model(name, num_classes=10, **options)
    size = (3, options["img_size"], options["img_size"])
    windowed = [b for b in map_model(model, size).blocks if b.windows is not None]
    assert windowed
    for block in windowed:
        windows = block.windows
        assert len(windows.order) == windows.count * windows.tokens
        assert sorted(windows.order) == list(range(len(windows.order)))


# --- Heads: every stage's way out, and attention pooling -----------------------------------


@pytest.mark.parametrize("name", ["vit_base_patch16_siglip_224", "vit_pe_core_tiny_patch16_384"])
def test_an_attention_pooling_head_is_order_free(name):
    """SigLIP's and PE's MAP heads: a learned query attends over the tokens. The k/v are split
    by ``unbind(0)``, which removes a dim before the token axis; the axis was once followed one
    place too far, into the head dim, and a reshape there was taken for a token merge."""
    torch.manual_seed(0)
    model = timm.create_model(name, **SMALL)
    assert all(u.kind != "head" for b in map_model(model, SIZE).blocks for u in b.position_uses)
    _assert_keep_one_exact_and_reduced_runs(model)


def test_a_head_reading_an_earlier_stage_by_position_gets_that_stage_restored():
    torch.manual_seed(0)
    model = position_tables.two_stage_aux_head().eval()
    restored = vitcompress.compress(model, "dtps", keep=0.7, locs=[1], input_size=SIZE)
    # The stage's exit grid and the auxiliary head each get the stage's tokens back.
    places = sorted(m.where for m in restored.modules() if isinstance(m, TokenRestore))
    assert len(places) == 2 and places[0].startswith(
        "flatten (flatten_1) merges the token axis of (64, 32)"
    )
    assert places[1] == "stage 0's exit grid"
    _assert_keep_one_exact_and_reduced_runs(model, locs=[1])
    # Stage 1 reaches the head through a mean: reducing there is fine.
    _assert_keep_one_exact_and_reduced_runs(model, locs=[3])
