"""The serving path across the families of the compatibility matrix: a compressed model's eval
forward reads no tensor's value on the host, makes no data-dependent shape and no tensor from
Python data (``host_sync_check``), on families whose reductions take other paths than a plain
ViT's (pooled keys, pooled queries, two protected tokens, a transformers ViT, a video grid,
rotary position embeddings); and a compressed model moved to another device computes there
wholly, as its base does."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import timm
import torch
from torch import nn

import vitcompress
from tests.models import timm_small
from vitcompress.workflows.serving import host_sync_check

Built = tuple[nn.Module, tuple[int, ...]]


def _pvt_v2() -> Built:
    return timm.create_model("pvt_v2_b0", num_classes=10, depths=(1, 1, 1, 1)), (3, 64, 64)


def _mvitv2() -> Built:
    return timm.create_model("mvitv2_tiny", img_size=64, num_classes=10), (3, 64, 64)


def _deit_distilled() -> Built:
    return timm_small("deit_tiny_distilled_patch16_224"), (3, 32, 32)


def _dinov3() -> Built:
    return timm_small("vit_tiny_patch16_dinov3_qkvb"), (3, 32, 32)


def _qwen3_vit() -> Built:
    return timm_small("qwen3_vit_88m"), (3, 32, 32)


def _hf_vit() -> Built:
    pytest.importorskip("transformers")
    from tests.fixtures import hf_models

    model, size = hf_models.build("hf_vit")
    return hf_models.Logits(model), size


def _video() -> Built:
    from tests.fixtures import dense_models

    return dense_models.build("video_conv3d")


FAMILIES: dict[str, Callable[[], Built]] = {
    "pvt_v2": _pvt_v2,  # spatial-reduction attention: scores of pooled keys spread to tokens
    "mvitv2": _mvitv2,  # pooled queries and keys: windows over the grid, attention run whole
    "deit_distilled": _deit_distilled,  # two protected tokens (cls and distillation)
    "dinov3": _dinov3,  # rotary embeddings built from the grid's size
    "hf_vit": _hf_vit,
    "video_conv3d": _video,  # a (T, H, W) token grid, dense output restored
}
# One method each, a different one where the family takes it, so that every method is served
# on a family besides the plain ViT, Swin and CvT of test_host_sync.py.
CASES = [
    ("pvt_v2", "etps"),
    ("mvitv2", "dtps"),
    ("deit_distilled", "dynamicvit"),
    ("dinov3", "tome"),
    ("hf_vit", "evit"),
    ("video_conv3d", "etps"),
]


def _built(family: str) -> Built:
    torch.manual_seed(0)
    model, size = FAMILIES[family]()
    return model.eval(), size


@pytest.mark.parametrize(("family", "variant"), CASES)
def test_compressed_families_serve_without_host_synchronisation(family: str, variant: str) -> None:
    base, size = _built(family)
    model = vitcompress.compress(base, variant, keep=0.7, input_size=size)
    report = host_sync_check(model, size)
    assert report.passed, report.text()
    assert report.host_tensors == [], report.host_tensors


class _GridOnTheCpu(nn.Module):
    """A grid made on the CPU whatever the input's device: what a compressed graph runs where
    the capture kept the device it read as a constant."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.arange(x.shape[-1], dtype=x.dtype, device="cpu")


def _runs_on_meta(model: nn.Module, size: tuple[int, ...]) -> None:
    """``model`` moved to the ``meta`` device runs there: any tensor its forward makes or keeps
    on the CPU meets a ``meta`` one and raises (on a GPU: a device mismatch, or a host copy and
    a wait on every call)."""
    model = model.to("meta").eval()
    with torch.no_grad():
        model(torch.empty(2, *size, device="meta"))


def test_the_meta_check_finds_a_tensor_left_on_the_cpu() -> None:
    with pytest.raises(RuntimeError, match="device"):
        _runs_on_meta(_GridOnTheCpu(), (3, 4, 4))


@pytest.mark.parametrize("variant", ["etps", "tome"])
def test_a_compressed_vit_runs_on_the_meta_device(variant: str) -> None:
    """The reducers' similarity products ask autocast about the tokens' device only where
    autocast knows it: asked about ``meta``, it raises."""
    base, size = _built("deit_distilled")
    model = vitcompress.compress(base, variant, keep=0.7, input_size=size)
    _runs_on_meta(model, size)


@pytest.mark.parametrize("family", ["dinov3", "qwen3_vit"])
def test_a_compressed_model_moved_to_another_device_computes_there(family: str) -> None:
    build = {"dinov3": _dinov3, "qwen3_vit": _qwen3_vit}[family]
    torch.manual_seed(0)
    base, size = build()
    model = vitcompress.compress(base.eval(), "etps", keep=0.7, input_size=size)
    # The capture kept the device it read from a buffer as a constant (the CPU): the compressed
    # graph reads it from its input instead, and computes as before on the CPU (keep 1: exact).
    whole = vitcompress.compress(base.eval(), "etps", keep=1.0, input_size=size)
    image = torch.randn(2, *size)
    with torch.no_grad():
        torch.testing.assert_close(whole(image), base(image), atol=1e-5, rtol=1e-5)
    _runs_on_meta(base, size)  # the base itself computes wholly on the device it is moved to
    _runs_on_meta(model, size)
