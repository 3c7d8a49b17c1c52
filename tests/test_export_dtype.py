"""``export --dtype float16|bfloat16``: the file at that dtype, checked against PyTorch run at the
same dtype within ``HALF_RTOL[dtype] * max(1, max |output|)``. A float16 ONNX file runs in
onnxruntime on the CPU; a bfloat16 one does not (no CPU kernels), so it is checked as a file
(onnx.checker with full_check), and the result says so. Each claim is checked here against the
written file itself, loaded with onnx / onnxruntime / torch independently of ``export_model``."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import vitcompress
from tests.models import timm_small
from vitcompress.cli.main import cli
from vitcompress.workflows.export import HALF_RTOL, SUFFIXES, export_model

SIZE = (3, 32, 32)
METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")
ONNX_TYPE = {"float16": onnx.TensorProto.FLOAT16, "bfloat16": onnx.TensorProto.BFLOAT16}


@pytest.fixture(scope="module")
def base() -> nn.Module:
    torch.manual_seed(0)
    return timm_small("vit_small_patch16_224", depth=2).eval()


def compressed(base: nn.Module, method: str) -> nn.Module:
    return vitcompress.compress(base, method, keep=0.7, locs=[1], input_size=SIZE).eval()


def io_types(path: Path) -> tuple[int, int]:
    graph = onnx.load(str(path)).graph
    return graph.input[0].type.tensor_type.elem_type, graph.output[0].type.tensor_type.elem_type


@pytest.mark.parametrize("method", METHODS)
def test_float16_onnx_runs_in_onnxruntime_and_matches_pytorch_at_float16(
    base: nn.Module, method: str, tmp_path: Path
) -> None:
    import onnxruntime as ort

    model = compressed(base, method)
    out = tmp_path / "m.onnx"
    result = export_model(model, SIZE, "onnx", out, dtype="float16", dynamic_batch=True)
    assert result["dtype"] == "float16" and result["check"] == "onnxruntime" and result["checked"]
    assert io_types(out) == (onnx.TensorProto.FLOAT16,) * 2
    assert result["structure"]["passed"] and result["structure"]["weight_dtypes"] == {
        "float16": result["structure"]["weight_dtypes"]["float16"]
    }
    # The caller's model stays float32.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # Independently: a batch export_model did not check, against PyTorch at float16.
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = torch.randn(4, *SIZE, generator=torch.Generator().manual_seed(7)).half()
    got = torch.from_numpy(session.run(None, {"image": x.numpy()})[0])
    with torch.no_grad():
        want = _half(model)(x)
    assert got.dtype == torch.float16 and got.shape == want.shape
    scale = max(1.0, float(want.float().abs().max()))
    assert float((got.float() - want.float()).abs().max()) <= HALF_RTOL["float16"] * scale
    assert result["max_abs_diff"] <= result["atol"] and result["atol"] >= HALF_RTOL["float16"]


def _half(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model).half()


@pytest.mark.parametrize("method", ["dtps", "tome"])
def test_bfloat16_onnx_is_checked_as_a_file_where_onnxruntime_cannot_run_it(
    base: nn.Module, method: str, tmp_path: Path
) -> None:
    import onnxruntime as ort

    out = tmp_path / "m.onnx"
    result = export_model(compressed(base, method), SIZE, "onnx", out, dtype="bfloat16")
    assert io_types(out) == (onnx.TensorProto.BFLOAT16,) * 2
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)  # valid ONNX at bfloat16
    # The check says what it did, and what it says is true of onnxruntime.
    try:
        import ml_dtypes

        session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
        x = torch.randn(1, *SIZE).numpy().astype(ml_dtypes.bfloat16)
        session.run(None, {"image": x})
        runs = True
    except Exception:
        runs = False
    if runs:
        assert result["check"] == "onnxruntime" and result["checked"]
    else:
        assert result["check"] == "structural" and result["checked"] is False
        assert result["onnxruntime_error"] and result["structure"]["passed"]
    # Convolutions stay float32 (ONNX Conv has no bfloat16 before opset 22), nothing else does.
    graph = onnx.load(str(out)).graph
    float32_weights = {t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    conv_inputs = {name for node in graph.node if node.op_type == "Conv" for name in node.input}
    assert float32_weights and float32_weights <= conv_inputs
    assert result["structure"]["weight_dtypes"]["bfloat16"] > 0


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("fmt", ["torchscript", "exported-program"])
def test_torch_formats_at_half_precision(
    base: nn.Module, dtype: str, fmt: str, tmp_path: Path
) -> None:
    model = compressed(base, "etps")
    out = tmp_path / f"m{SUFFIXES[fmt]}"
    result = export_model(model, SIZE, fmt, out, dtype=dtype, batch_size=2)
    assert result["check"] == "pytorch" and result["max_abs_diff"] <= result["atol"]
    loaded = (
        torch.jit.load(str(out)) if fmt == "torchscript" else torch.export.load(str(out)).module()
    )
    x = torch.randn(2, *SIZE).to(getattr(torch, dtype))
    with torch.no_grad():
        assert loaded(x).dtype == getattr(torch, dtype)


def test_a_wrong_file_fails_the_half_precision_check(
    base: nn.Module, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vitcompress.workflows import export

    # The file's outputs 10% off PyTorch's: beyond the tolerance, so the check must fail.
    real = export._export_onnx

    def off(*args, **kwargs):
        run = real(*args, **kwargs)
        return lambda x: run(x) * 1.1 + 0.1

    monkeypatch.setattr(export, "_export_onnx", off)
    with pytest.raises(export.ExportCheckError, match="at float16"):
        export_model(compressed(base, "evit"), SIZE, "onnx", tmp_path / "m.onnx", dtype="float16")


def test_export_command_dtype(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = vitcompress.compress(timm_small("vit_small_patch16_224", depth=2), "dtps", 0.7, [1])
    art = vitcompress.save(model, tmp_path / "art")
    out = tmp_path / "m.onnx"
    args = ["export", "--model", str(art), "--format", "onnx", "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--dtype", "float16", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["dtype"] == "float16" and data["check"] == "onnxruntime"
    text = CliRunner().invoke(cli, [*args, "--dtype", "bfloat16"])
    assert text.exit_code == 0, text.output
    assert "bfloat16" in text.stdout
    refused = CliRunner().invoke(cli, [*args, "--dtype", "float16", "--bench"])
    assert refused.exit_code == 2 and "--bench times float32" in refused.output
