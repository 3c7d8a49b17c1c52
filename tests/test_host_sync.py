"""The serving path asks nothing of the host: every registered variant's eval forward, on a plain
ViT, a windowed Swin and a dense-output ViT, traces with ``torch.export`` without ``.item()``,
``nonzero``, ``tolist`` or a data-dependent shape (a CUDA graph could not capture one); and the
check does find each of them in a model that has it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitcompress
from tests.models import timm_small
from tests.test_windowed import SIZE as SWIN_SIZE
from tests.test_windowed import swin
from vitcompress.compilation.plan import VARIANTS
from vitcompress.workflows.serving import host_sync_check

SIZE = (3, 32, 32)


def _vanilla() -> tuple[nn.Module, tuple[int, ...], list[int] | None]:
    torch.manual_seed(0)
    return timm_small("vit_small_patch16_224", depth=2), SIZE, [1]


def _dense() -> tuple[nn.Module, tuple[int, ...], list[int] | None]:
    torch.manual_seed(0)
    return timm_small("vit_small_patch16_224", depth=2, global_pool="", num_classes=0), SIZE, [1]


def _windowed() -> tuple[nn.Module, tuple[int, ...], list[int] | None]:
    return swin(), SWIN_SIZE, None


MODELS = {"vanilla": _vanilla, "dense": _dense, "windowed": _windowed}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", list(MODELS))
def test_every_variant_serves_without_host_synchronisation(kind: str, variant: str) -> None:
    base, size, locs = MODELS[kind]()
    model = vitcompress.compress(base, variant, keep=0.7, locs=locs, input_size=size)
    report = host_sync_check(model, size)
    assert report.passed, report.text()
    # Nor a tensor made from Python data: eager on a GPU a copy and a wait on every call.
    assert report.host_tensors == [], report.host_tensors


def test_tome_protecting_two_tokens_makes_no_tensor_from_python_data() -> None:
    """ToMe's order with two protected tokens (cls and distillation) is applied by slicing, not
    by an index made from a Python list in every merging block."""
    torch.manual_seed(0)
    base = timm_small("deit_tiny_distilled_patch16_224", depth=2)
    model = vitcompress.compress(base, "tome", variant_args={"r": 4}, input_size=SIZE)
    report = host_sync_check(model, SIZE)
    assert report.passed and report.host_tensors == [], report.text()


@pytest.mark.parametrize("variant", ["etps", "evit"])
def test_scores_spread_over_overlapping_key_windows_read_no_value(variant: str) -> None:
    """CvT's first stages pool their keys by 3 x 3 windows at stride 2, and the scores are
    spread back over the windows: with no branch on a value (a wait for the device on a GPU)."""
    import timm

    torch.manual_seed(0)
    base = timm.create_model("cvt_13", num_classes=10, depths=(1, 1, 2)).eval()
    size = (3, 64, 64)
    model = vitcompress.compress(base, variant, keep=0.7, locs=[0, 1], input_size=size)
    report = host_sync_check(model, size)
    assert report.passed and report.host_tensors == [], report.text()


class HostTensor(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor([2.0, 3.0, 4.0], device=x.device).view(1, 3, 1, 1)


def test_the_check_lists_tensors_made_from_python_data() -> None:
    report = host_sync_check(HostTensor(), (3, 4, 4))
    assert report.passed  # compiled, inductor folds it into a constant
    assert len(report.host_tensors) == 1 and "test_host_sync.py:" in report.host_tensors[0]
    assert "1 tensor(s) made from Python data" in report.text()
    assert report.to_json()["host_tensors"] == report.host_tensors


class Item(nn.Module):
    """Scales by a tensor's value read on the host: ``.item()``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.mean().item()


class ToList(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * sum(x.flatten(1)[0, :4].tolist())


class Branch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x


class Nonzero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten()[(x.flatten() > 0).nonzero().squeeze(1)].sum() + x


class Mask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0].sum() + x


@pytest.mark.parametrize(
    ("model", "found"),
    [
        (Item(), "aten._local_scalar_dense"),
        (ToList(), "aten._local_scalar_dense"),
        (Branch(), "a Python decision on a tensor's value"),
        (Nonzero(), "aten.nonzero"),
        (Mask(), "aten.index) depends on data-dependent"),
    ],
)
def test_the_check_finds_each_host_synchronisation(model: nn.Module, found: str) -> None:
    report = host_sync_check(model, (3, 4, 4))
    assert not report.passed
    assert found in report.text()


def test_a_compressed_model_that_reads_a_value_fails_the_check() -> None:
    base, size, locs = _vanilla()
    model = vitcompress.compress(base, "etps", keep=0.7, locs=locs, input_size=size)
    assert host_sync_check(model, size).passed
    model.register_forward_pre_hook(lambda module, args: (args[0] * args[0].std().item(),))
    report = host_sync_check(model, size)
    assert not report.passed and "aten._local_scalar_dense" in report.text()
