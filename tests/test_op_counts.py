"""Ops dispatched per reduction location (tests/op_count.py's rule), and the default eval path
that keeps them few: the fused kernels where they serve, with the method's results.

The figures are docs/results-speed-cpu.md's "Ops per location (CPU)"; at small batches on a GPU
every op is a kernel launch, so the limit is what a location may cost in launches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitcompress
from tests.models import timm_small
from tests.op_count import OpCounter, compiled_targets, count_ops, deit_small_ops_per_location
from tests.test_positions import sharpen
from vitcompress.kernels import enable_fused_kernels, fused_kernels_available, method_path
from vitcompress.measure import count_macs

MOST_OPS_PER_LOCATION = 16
SIZE = (3, 32, 32)
# The methods whose default path is a fused kernel; DynamicViT and EViT stay within the limit on
# the method's ops too.
NEED_KERNEL = ("dtps", "etps", "tome")

needs_kernels = pytest.mark.skipif(
    not fused_kernels_available(), reason="the fused kernels cannot be built here"
)


pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_counter_counts_kernels_and_leaves_views_out() -> None:
    x = torch.randn(2, 3, 4)
    with torch.inference_mode(), OpCounter() as counter:
        y = x.reshape(2, 12).transpose(0, 1)[:5].unsqueeze(0)  # views only
        z = (y + 1).sum()  # two kernels
        x.float()  # already float32: the same tensor, no kernel
    assert counter.counts == {"aten.add": 1, "aten.sum": 1}
    assert z.shape == ()


def test_the_counter_counts_a_view_schema_op_that_copies() -> None:
    """``aten.to`` and ``aten.reshape`` may return an alias; where they cannot (another dtype, a
    transposed tensor's new shape) they copy, a kernel each, and count; autocast's casts too."""
    x = torch.randn(2, 3, 4)
    with torch.inference_mode(), OpCounter() as counter:
        x.bfloat16()
        x.transpose(1, 2).reshape(2, 12)
    assert counter.counts == {"aten.to": 1, "aten.reshape": 1}
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), OpCounter() as amp:
        x @ x.transpose(1, 2)
    assert amp.counts == {"aten.to": 2, "aten.matmul": 1}


@pytest.mark.parametrize("method", ["dtps", "etps", "dynamicvit", "evit", "tome"])
def test_a_location_adds_at_most_16_ops(method: str) -> None:
    """deit_small, blocks 3, 6, 9, keep 0.7 (ToMe r = 13, per block), one eval forward."""
    if method in NEED_KERNEL and not fused_kernels_available():
        pytest.skip("the fused kernels cannot be built here")
    assert deit_small_ops_per_location(method) <= MOST_OPS_PER_LOCATION


@pytest.mark.parametrize("method", ["dynamicvit", "evit"])
def test_the_methods_ops_alone_stay_within_the_limit(method: str) -> None:
    """Where the kernels cannot be built DynamicViT and EViT still keep to it (no gather of
    scores a fuse does not weigh)."""
    assert deit_small_ops_per_location(method, fused=False) <= MOST_OPS_PER_LOCATION


def _compressed(method: str, keep: float) -> nn.Module:
    torch.manual_seed(0)
    base = sharpen(timm_small("vit_small_patch16_224"))
    return vitcompress.compress(base, method, keep=keep, locs=[1, 2], input_size=SIZE).eval()


def _default_and_method(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode():
        default = model(x)
        with method_path(model):
            method = model(x)
    return default, method


@needs_kernels
@pytest.mark.parametrize("method", ["dtps", "dynamicvit", "etps", "tome"])
def test_the_default_path_runs_one_fused_op_per_location(method: str) -> None:
    model = _compressed(method, 0.7)
    fused = "vitcompress.tome_merge" if method == "tome" else "vitcompress.select_squeeze"
    locations = sum(getattr(m, "supports_fused_kernel", False) for m in model.modules())
    assert locations == (3 if method == "tome" else 2)  # ToMe merges in every block from 1
    assert count_ops(model, torch.randn(2, *SIZE))[fused] == locations
    with method_path(model):
        assert count_ops(model, torch.randn(2, *SIZE))[fused] == 0


@needs_kernels
@pytest.mark.parametrize("method", ["dtps", "dynamicvit", "etps", "evit", "tome"])
def test_the_default_path_is_bit_for_bit_the_methods_at_keep_1(method: str) -> None:
    model = _compressed(method, 1.0)
    default, method_result = _default_and_method(model, torch.randn(4, *SIZE))
    assert torch.equal(default, method_result)


@needs_kernels
@pytest.mark.parametrize("method", ["dtps", "dynamicvit", "etps", "evit", "tome"])
def test_the_default_path_gives_the_methods_logits_at_keep_0_7(method: str) -> None:
    model = _compressed(method, 0.7)
    default, method_result = _default_and_method(model, torch.randn(4, *SIZE))
    assert (default - method_result).abs().max() <= 1e-5 * method_result.abs().max()


@needs_kernels
@pytest.mark.parametrize("method", ["dtps", "etps", "tome"])
def test_macs_are_the_same_on_either_path(method: str) -> None:
    """The kernels' flop formulas count the product the method's path counts."""
    model = _compressed(method, 0.7)
    default = count_macs(model, SIZE)
    with method_path(model):
        assert count_macs(model, SIZE) == default


@needs_kernels
def test_switched_off_or_under_autograd_the_methods_ops_run() -> None:
    model = _compressed("dtps", 0.7)
    x = torch.randn(2, *SIZE)
    assert enable_fused_kernels(model, False) == 2
    assert count_ops(model, x)["vitcompress.select_squeeze"] == 0
    enable_fused_kernels(model, None)
    with OpCounter() as counter:  # eval, but autograd records the input
        model(x.requires_grad_()).sum().backward()
    assert counter.counts["vitcompress.select_squeeze"] == 0 and x.grad is not None


@needs_kernels
def test_a_float64_model_keeps_the_methods_ops_and_its_precision() -> None:
    """The kernels compute in float32: at keep 1 a float64 model must stay exact."""
    torch.manual_seed(0)
    base = sharpen(timm_small("vit_small_patch16_224")).double()
    x = torch.randn(2, *SIZE, dtype=torch.float64)
    for method in ("dtps", "tome"):
        model = vitcompress.compress(base, method, keep=1.0 if method == "dtps" else 0.7, locs=[1])
        counts = count_ops(model, x)
        assert counts["vitcompress.select_squeeze"] + counts["vitcompress.tome_merge"] == 0
    model = vitcompress.compress(base, "dtps", keep=1.0, locs=[1, 2])
    with torch.inference_mode():
        assert (model(x) - base(x)).abs().max() <= 1e-9 * base(x).abs().max()


@needs_kernels
def test_compiled_default_path_is_the_methods_ops_in_one_graph() -> None:
    """Under a compiler the default (switch None) takes the method's ops: no build or custom op
    inside a trace unless the kernels were switched on."""
    model = _compressed("tome", 0.7)
    targets = compiled_targets(model, torch.randn(2, *SIZE))
    assert targets and not any("vitcompress" in t for t in targets)
