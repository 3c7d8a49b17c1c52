"""Capture of models whose forward branches on metadata (HuggingFace's input checks): the guarded
trace, its guards, and the one-line refusal to compress a graph only torch.export took."""

import pytest
import torch
from torch import nn

from tests.fixtures import inhouse
from vitcompress import compress, map_model
from vitcompress.analysis.capture import CaptureError, capture
from vitcompress.errors import UserError


class BranchOnWidth(nn.Module):
    """Doubles the image where it is wider than 16 pixels: a branch on a size."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = inhouse.register_vit()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.shape[-1] > 16:
            pixels = pixels * 2.0
        return self.inner(pixels)


class BranchOnData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = inhouse.register_vit()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.sum() > 0:  # tensor data: differs from image to image
            pixels = -pixels
        return self.inner(pixels)


class IntOfSize(nn.Module):
    """``int()`` of a traced size: symbolic tracing cannot, torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = inhouse.register_vit()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        side = int(pixels.shape[-1])
        return self.inner(pixels[..., :side])


def test_a_branch_on_a_size_is_traced_with_a_guard_that_fails_on_the_other_branch():
    model = BranchOnWidth().eval()
    example = torch.randn(2, 3, 32, 32)
    captured = capture(model, example)
    assert captured.method == "guarded_trace"
    with torch.no_grad():
        assert torch.equal(captured.module(example), model(example))
        # A 16-pixel input takes the other branch in the model: the graph says so, never
        # silently runs the branch it recorded.
        with pytest.raises(AssertionError, match="another branch than the captured graph"):
            captured.module(torch.randn(2, 3, 32, 16))


def test_a_branch_on_tensor_data_is_not_decided_at_capture():
    example = torch.randn(2, 3, 32, 32)
    try:
        captured = capture(BranchOnData().eval(), example)
    except CaptureError:
        return
    assert captured.method != "guarded_trace"


def test_compressing_a_graph_only_torch_export_took_is_refused_in_one_line():
    model = IntOfSize().eval()
    assert map_model(model, (3, 32, 32)).capture == "export"  # inspect still works
    with pytest.raises(CaptureError) as refused:
        compress(model, "etps", keep=0.7, input_size=(3, 32, 32))
    line = str(refused.value)
    assert "\n" not in line
    assert "only torch.export could capture it" in line and "int()" in line


def test_a_bare_transformers_model_is_refused_with_how_to_hand_it_over():
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(
        image_size=32, patch_size=4, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
        intermediate_size=96,
    )  # fmt: skip
    model = transformers.ViTForImageClassification(config).eval()
    with pytest.raises(UserError) as refused:
        compress(model, "etps", keep=0.7, input_size=(3, 32, 32))
    assert "HFImageClassifier(model)" in str(refused.value)
    assert "save_pretrained directory" in str(refused.value)
    from vitcompress.loading.hf import HFImageClassifier

    wrapped = HFImageClassifier(model)
    x = torch.randn(2, 3, 32, 32)
    exact = compress(wrapped, "etps", keep=1.0, input_size=(3, 32, 32)).eval()
    with torch.no_grad():
        torch.testing.assert_close(exact(x), wrapped(x), atol=1e-5, rtol=0)
