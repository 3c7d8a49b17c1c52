"""Model zoo: PVT v1 and CvT in timm's registry, sized like the papers, fx-traceable, and
loading the authors' checkpoint layouts.

Kept CPU-cheap: large variants are built on the meta device (shapes only), forward passes use the
small variants at 64 px unless the test is about 224 px.
"""

from __future__ import annotations

import pytest
import timm
import torch
import torch.fx
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import vitcompress.zoo  # noqa: F401  (registers the models)

PVT = ("pvt_tiny", "pvt_small", "pvt_medium", "pvt_large")
CVT = ("cvt_13", "cvt_21", "cvt_w24")

# (params in millions, GMACs at 224 px, 1000 classes). The MAC references count LayerNorm and
# BatchNorm too (fvcore's convention, see docs/zoo.md), FlopCounterMode does not: hence the
# 0.5 % tolerance rather than an exact match.
REFERENCE = {
    "pvt_tiny": (13.23, 1.94),
    "pvt_small": (24.49, 3.83),
    "cvt_13": (20.00, 4.58),
    "cvt_21": (31.62, 7.21),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # These models are small at the sizes used here; one intra-op thread avoids the large
    # slow-downs of spinning OpenMP threads when the (2-core) machine is shared with other work.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _randomize_norms(model: nn.Module) -> nn.Module:
    # Non-trivial norm/BN statistics so that comparisons cannot pass by accident.
    gen = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, (nn.LayerNorm, nn.BatchNorm2d)):
            m.weight.data = torch.rand(m.weight.shape, generator=gen) + 0.5
            m.bias.data = torch.rand(m.bias.shape, generator=gen) - 0.5
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean = torch.rand(m.running_mean.shape, generator=gen) - 0.5
            m.running_var = torch.rand(m.running_var.shape, generator=gen) + 0.5
    return model


@pytest.mark.parametrize("name", PVT + CVT)
def test_registered_with_cfg(name: str) -> None:
    assert name in timm.list_models()
    cfg = timm.models.get_pretrained_cfg(name)
    assert cfg.num_classes == 1000
    assert cfg.input_size == ((3, 384, 384) if name == "cvt_w24" else (3, 224, 224))
    assert cfg.mean == timm.data.IMAGENET_DEFAULT_MEAN and cfg.std == timm.data.IMAGENET_DEFAULT_STD
    assert 0 < cfg.crop_pct <= 1
    assert cfg.classifier == "head"
    assert cfg.first_conv in ("patch_embed1.proj", "stage0.patch_embed.proj")
    # Nothing may be downloaded.
    assert not cfg.has_weights


@pytest.mark.parametrize("name", PVT + CVT)
def test_factory_builds_with_reference_size(name: str) -> None:
    # The meta device builds the real module tree without allocating or initialising weights.
    with torch.device("meta"):
        model = timm.create_model(name)
    cfg = model.pretrained_cfg
    assert isinstance(model.get_submodule(cfg["first_conv"]), nn.Conv2d)
    assert isinstance(model.get_submodule(cfg["classifier"]), nn.Linear)
    if name in REFERENCE:
        assert _params(model) / 1e6 == pytest.approx(REFERENCE[name][0], rel=5e-3)


@pytest.fixture(scope="module")
def full() -> dict[str, nn.Module]:
    """The two cheapest variants at their defaults (224 px, 1000 classes), built once."""
    return {
        name: _randomize_norms(timm.create_model(name)).eval() for name in ("pvt_tiny", "cvt_13")
    }


@pytest.fixture(scope="module")
def small() -> dict[str, nn.Module]:
    """The same variants built for 64 px inputs and 10 classes."""
    return {
        name: _randomize_norms(timm.create_model(name, num_classes=10, img_size=64)).eval()
        for name in ("pvt_tiny", "cvt_13")
    }


@pytest.fixture(scope="module")
def run_224(full: dict[str, nn.Module]) -> dict[str, tuple[torch.Tensor, float]]:
    """One counted 224 px forward per model: (logits, GMACs). Cold CPU forwards are the expensive
    part of this file (kernel set-up per new shape), so shapes are shared between tests."""
    out = {}
    for name, model in full.items():
        # FlopCounterMode counts 2 flops per multiply-accumulate.
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            logits = model(torch.randn(1, 3, 224, 224))
        out[name] = (logits, counter.get_total_flops() / 2e9)
    return out


@pytest.mark.parametrize("name", ["pvt_tiny", "cvt_13"])
def test_macs_at_224(name: str, run_224: dict[str, tuple[torch.Tensor, float]]) -> None:
    assert run_224[name][1] == pytest.approx(REFERENCE[name][1], rel=5e-3)


@pytest.mark.parametrize("name", ["pvt_tiny", "cvt_13"])
def test_forward_224(name: str, run_224: dict[str, tuple[torch.Tensor, float]]) -> None:
    logits = run_224[name][0]
    assert logits.shape == (1, 1000)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["pvt_tiny", "cvt_13"])
def test_forward_small_inputs(name: str, small: dict[str, nn.Module]) -> None:
    model = small[name]
    with torch.no_grad():
        assert model(torch.randn(1, 3, 64, 64)).shape == (1, 10)
        # The grid is read at run time, so other resolutions (down to 32 px, where every original
        # patch and reduction size still fits) work without rebuilding.
        assert model(torch.randn(2, 3, 96, 128)).shape == (2, 10)
        assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)


@pytest.mark.parametrize("name", PVT + CVT)
def test_model_kwargs(name: str) -> None:
    with torch.device("meta"):
        model = timm.create_model(name, num_classes=7, in_chans=1, img_size=64)
    assert model.get_submodule(model.pretrained_cfg["first_conv"]).in_channels == 1
    assert model.get_classifier().out_features == 7


@pytest.mark.parametrize("name", ["pvt_tiny", "cvt_13"])
def test_fx_trace_matches_eager(name: str, small: dict[str, nn.Module]) -> None:
    model = small[name]
    traced = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        for batch in (1, 2):
            x = torch.randn(batch, 3, 64, 64)
            torch.testing.assert_close(traced(x), model(x), atol=1e-5, rtol=0)
        # Grid sizes are graph values, not constants baked in at trace time.
        x = torch.randn(2, 3, 96, 128)
        torch.testing.assert_close(traced(x), model(x), atol=1e-5, rtol=0)
    # The attention is an explicit matmul -> softmax -> matmul, visible to graph analysis.
    softmaxes = [n for n in traced.graph.nodes if n.op == "call_method" and n.target == "softmax"]
    attentions = [n for n, _ in model.named_modules() if n.endswith(".attn")]
    assert len(softmaxes) == len(attentions) > 0


def _expected_pvt_keys(depths: tuple[int, ...], sr_ratios: tuple[int, ...]) -> set[str]:
    # Layout of whai362/PVT classification/pvt.py, written out independently of the model code.
    keys = {"cls_token", "norm.weight", "norm.bias", "head.weight", "head.bias"}
    for s, (depth, sr) in enumerate(zip(depths, sr_ratios, strict=True), start=1):
        keys |= {f"pos_embed{s}"}
        keys |= {f"patch_embed{s}.{m}.{p}" for m in ("proj", "norm") for p in ("weight", "bias")}
        for b in range(depth):
            mods = ["norm1", "attn.q", "attn.kv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"]
            mods += ["attn.sr", "attn.norm"] if sr > 1 else []
            keys |= {f"block{s}.{b}.{m}.{p}" for m in mods for p in ("weight", "bias")}
    return keys


def _expected_cvt_keys(depths: tuple[int, ...]) -> set[str]:
    # Layout of microsoft/CvT lib/models/cls_cvt.py, written out independently of the model code.
    bn = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    keys = {"stage2.cls_token", "norm.weight", "norm.bias", "head.weight", "head.bias"}
    for s, depth in enumerate(depths):
        keys |= {
            f"stage{s}.patch_embed.{m}.{p}" for m in ("proj", "norm") for p in ("weight", "bias")
        }
        for b in range(depth):
            pre = f"stage{s}.blocks.{b}"
            mods = ["norm1", "attn.proj_q", "attn.proj_k", "attn.proj_v", "attn.proj", "norm2"]
            mods += ["mlp.fc1", "mlp.fc2"]
            keys |= {f"{pre}.{m}.{p}" for m in mods for p in ("weight", "bias")}
            for qkv in "qkv":
                keys |= {f"{pre}.attn.conv_proj_{qkv}.conv.weight"}
                keys |= {f"{pre}.attn.conv_proj_{qkv}.bn.{p}" for p in bn}
    return keys


def test_official_state_dict_layout() -> None:
    with torch.device("meta"):
        pvt = timm.create_model("pvt_small")
        cvt = timm.create_model("cvt_21")
    pvt_sd, cvt_sd = pvt.state_dict(), cvt.state_dict()
    for key in ("block1.0.attn.sr.weight", "block3.5.attn.kv.weight", "pos_embed4", "cls_token"):
        assert key in pvt_sd
    assert "block4.0.attn.sr.weight" not in pvt_sd  # sr_ratio 1: no reduction in the last stage
    assert pvt_sd["pos_embed4"].shape == (1, 7 * 7 + 1, 512)  # the class token's entry included
    assert pvt_sd["pos_embed1"].shape == (1, 56 * 56, 64)
    for key in (
        "stage2.cls_token",
        "stage2.blocks.0.attn.conv_proj_q.conv.weight",
        "stage0.blocks.0.attn.conv_proj_k.bn.running_var",
        "stage1.blocks.3.attn.proj_v.weight",
    ):
        assert key in cvt_sd
    assert cvt_sd["stage2.blocks.0.attn.conv_proj_q.conv.weight"].shape == (384, 1, 3, 3)
    assert set(pvt_sd) == _expected_pvt_keys((3, 4, 6, 3), (8, 4, 2, 1))
    assert set(cvt_sd) == _expected_cvt_keys((1, 4, 16))


def test_pretrained_needs_a_local_source() -> None:
    with pytest.raises(RuntimeError, match="pretrained_cfg_overlay"):
        timm.create_model("pvt_tiny", pretrained=True)


@pytest.mark.parametrize("name", ["pvt_tiny", "cvt_13"])
def test_load_checkpoint_file_strict(name: str, full: dict[str, nn.Module], tmp_path) -> None:
    # A checkpoint in the official layout, loaded through timm's local-file route (strict load).
    source = full[name]
    path = tmp_path / f"{name}.pth"
    torch.save(source.state_dict(), path)
    x = torch.randn(2, 3, 64, 64)
    # Built for 64 px, so PVT's position embeddings go through the load-time resampling, which
    # must give what the 224 px model computes by resampling at run time.
    loaded = timm.create_model(
        name, img_size=64, pretrained=True, pretrained_cfg_overlay={"file": str(path)}
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), source(x), atol=1e-6, rtol=0)
