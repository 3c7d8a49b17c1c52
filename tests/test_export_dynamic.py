"""``export --dynamic-batch``: a symbolic batch dimension in every format, checked at two batch
sizes against eager PyTorch; the static batch stays the default. Also ONNX of ``aten::rms_norm``
(AIMv2's RmsNorm), which the TorchScript-based exporter has no symbolic for."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import timm
import torch
from click.testing import CliRunner
from torch import nn
from torch.nn import functional as F

import vitcompress
from tests.models import timm_small
from vitcompress.cli.main import cli
from vitcompress.workflows.export import (
    ATOL,
    BATCH_AXIS,
    FORMATS,
    SUFFIXES,
    export_model,
)

SIZE = (3, 32, 32)


# Every method: each reducer reads the batch in its own way (dTPS/DynamicViT's predictor, the
# attention reducers' class-attention scores, ToMe's bipartite matching).
@pytest.fixture(scope="module", params=["dtps", "etps", "dynamicvit", "evit", "tome"])
def compressed(request: pytest.FixtureRequest) -> nn.Module:
    torch.manual_seed(0)
    base = timm_small("vit_small_patch16_224", depth=2)
    return vitcompress.compress(base, request.param, keep=0.7, locs=[1], input_size=SIZE).eval()


def load(fmt: str, path: Path):
    """The written file as a callable on a CPU tensor, loaded independently of export_model."""
    if fmt == "onnx":
        import onnxruntime as ort

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return lambda x: torch.from_numpy(session.run(None, {"image": x.numpy()})[0])
    if fmt == "torchscript":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated, still works
            return torch.jit.load(str(path))
    return torch.export.load(str(path)).module()


@pytest.mark.parametrize("fmt", FORMATS)
def test_dynamic_batch_runs_at_other_batch_sizes(
    compressed: nn.Module, fmt: str, tmp_path: Path
) -> None:
    out = tmp_path / f"model{SUFFIXES[fmt]}"
    result = export_model(compressed, SIZE, fmt, out, dynamic_batch=True)
    assert result["batch"] == "dynamic" and result["input_shape"] == [BATCH_AXIS, *SIZE]
    assert result["checked_batch_sizes"] == [1, 3] and result["max_abs_diff"] <= ATOL
    if fmt == "exported-program":  # the input's batch is a symbol, the rest fixed
        program = torch.export.load(str(out))
        (image,) = [s for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        shape = next(n for n in program.graph.nodes if n.name == image.arg.name).meta["val"].shape
        assert isinstance(shape[0], torch.SymInt) and tuple(shape[1:]) == SIZE
    run = load(fmt, out)
    for batch in (5, 2):  # neither checked by export_model
        x = torch.randn(batch, *SIZE, generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            got, want = run(x), compressed(x)
        assert got.shape == (batch, 10)
        assert torch.allclose(got, want, atol=ATOL, rtol=0)


def test_onnx_batch_axis_is_symbolic_only_with_dynamic_batch(
    compressed: nn.Module, tmp_path: Path
) -> None:
    import onnx

    dynamic = export_model(compressed, SIZE, "onnx", tmp_path / "d.onnx", dynamic_batch=True)
    static = export_model(compressed, SIZE, "onnx", tmp_path / "s.onnx", batch_size=2)
    assert dynamic["static_shapes"] is False and static["static_shapes"] is True
    assert static["batch"] == "fixed" and static["checked_batch_sizes"] == [2]
    graph = onnx.load(str(tmp_path / "d.onnx")).graph
    dims = [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input]
    assert dims == [[BATCH_AXIS, *SIZE]]  # only the batch is symbolic: token counts stay fixed
    # The static file refuses another batch: the default is unchanged.
    import onnxruntime as ort

    session = ort.InferenceSession(str(tmp_path / "s.onnx"), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception, match="(?i)dimension|shape"):
        session.run(None, {"image": torch.randn(3, *SIZE).numpy()})


def test_export_command_dynamic_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = vitcompress.compress(timm_small("vit_small_patch16_224", depth=2), "evit", 0.7, [1])
    art = vitcompress.save(model, tmp_path / "art")
    out = tmp_path / "m.onnx"
    args = ["export", "--model", str(art), "--format", "onnx", "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--dynamic-batch", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["batch"] == "dynamic" and data["checked_batch_sizes"] == [1, 3]
    table = CliRunner().invoke(cli, [*args, "--dynamic-batch"])
    assert "(dynamic batch)" in table.stdout and "at batch sizes 1, 3" in table.stdout
    static = json.loads(CliRunner().invoke(cli, [*args, "--json"]).stdout)
    assert static["batch"] == "fixed" and static["static_shapes"] is True


# --------------------------------------------------------------------------------------------------
# aten::rms_norm in ONNX
# --------------------------------------------------------------------------------------------------


class RmsNormHead(nn.Module):
    """``F.rms_norm`` without weight and without eps (torch then uses the dtype's epsilon)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3 * 32 * 32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(self.proj(x.flatten(1)).view(-1, 4, 4), (4,)).flatten(1) * 0.01


@pytest.mark.parametrize("opset", [17, 18])
def test_rms_norm_without_weight_or_eps_exports_to_onnx(opset: int, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = RmsNormHead()
    with torch.no_grad():
        model.proj.weight.mul_(1e-3)  # small activations: eps matters for the result
    result = export_model(model, SIZE, "onnx", tmp_path / "r.onnx", batch_size=2, opset=opset)
    assert result["max_abs_diff"] <= 1e-6


@pytest.mark.parametrize("variant", ["etps", "dtps"])
def test_aimv2_compressed_exports_to_onnx(variant: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = timm.create_model(
        "aimv2_large_patch14_224",
        img_size=32,
        patch_size=4,
        depth=4,
        embed_dim=64,
        num_heads=2,
        num_classes=10,
    )
    model = vitcompress.compress(base, variant, keep=0.7, input_size=SIZE).eval()
    result = export_model(model, SIZE, "onnx", tmp_path / "aimv2.onnx", batch_size=2)
    assert result["checked"] and result["max_abs_diff"] <= ATOL
