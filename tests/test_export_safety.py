"""What a failed export leaves, and which failures are the file's: the file is written and checked
beside ``--out`` and moved onto it only once the check passes (a failure leaves nothing behind and
an existing file as it was); a half-precision ONNX file falls back to the structural check only
where onnxruntime has no kernel for it; ``--compile`` on a model ``torch.export`` cannot trace
warns and keeps the export; onnxruntime's warnings are not printed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from tests.models import timm_small
from vitcompress.cli.main import cli
from vitcompress.measure.onnx_runtime import onnx_session
from vitcompress.workflows.export import (
    SUFFIXES,
    ExportCheckError,
    ExportError,
    export_model,
    missing_kernel,
)
from vitcompress.workflows.serving import serving_check

# Small random models, each wrong in one way; written to a file for the command line's
# ``--model FILE.py:factory`` and executed here for the library's tests.
FACTORIES = """
import torch
from torch import nn


class BakedBatch(nn.Module):
    # Reads the batch as a Python int: the traced graph has the traced batch as a constant.
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, 4)
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        return self.head(self.conv(x).reshape(int(x.shape[0]), -1))


class Big(nn.Module):
    # Outputs of scale 1e7: float32 rounding alone exceeds the absolute tolerance 1e-4.
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, 4)
        self.head = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        return self.head(self.conv(x).flatten(1)) * 1e7


class Pointer(nn.Module):
    # x.data_ptr(): neither dynamo nor torch.export can trace it, for no data-dependent reason.
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, 4)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        y = self.conv(x).flatten(2).mean(-1)
        if x.data_ptr() == 0:
            y = y * 2
        return self.head(y)


class ValueBranch(nn.Module):
    # A Python decision on a tensor's value: neither tracer can capture it.
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 4, 4)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        y = self.conv(x).flatten(2).mean(-1)
        if float(y.mean().item()) > 100.0:
            y = y * 2
        return self.head(y)


def baked():
    torch.manual_seed(0)
    return BakedBatch()


def big():
    torch.manual_seed(0)
    return Big()


def pointer():
    torch.manual_seed(0)
    return Pointer()


def value_branch():
    torch.manual_seed(0)
    return ValueBranch()
"""
MODELS: dict = {}
exec(FACTORIES, MODELS)  # noqa: S102 - the source above, also written for the command line
SIZE = (3, 16, 16)
PRECIOUS = b"PRECIOUS: the user's own file\n"


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    path = tmp_path / "hand.py"
    path.write_text(FACTORIES)
    return path


def existing(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / name
    out.write_bytes(PRECIOUS)
    return out


def model(name: str) -> nn.Module:
    return MODELS[name]().eval()


# ---------------------------------------------------------------------------------------------
# A failed export leaves nothing behind, and the file already at --out as it was


@pytest.mark.parametrize("fmt", ["onnx", "torchscript", "exported-program"])
def test_a_batch_baked_into_the_graph_leaves_the_existing_file_alone(
    tmp_path: Path, fmt: str
) -> None:
    out = existing(tmp_path / "keep", f"m{SUFFIXES[fmt]}")
    # onnx and torchscript write a file that fails at batch 1; torch.export refuses to trace.
    expected = ExportError if fmt == "exported-program" else ExportCheckError
    with pytest.raises(expected):
        export_model(model("baked"), SIZE, fmt, out, dynamic_batch=True)
    assert out.read_bytes() == PRECIOUS
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


EXPORTERS = {"onnx": "_export_onnx", "torchscript": "_export_torchscript",
             "exported-program": "_export_program"}  # fmt: skip


@pytest.mark.parametrize("fmt", list(EXPORTERS))
def test_a_written_file_that_fails_its_check_is_not_moved_into_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    from vitcompress.workflows import export

    real = getattr(export, EXPORTERS[fmt])

    def off(*args, **kwargs):  # the file is written; what it computes is 10% off
        run = real(*args, **kwargs)
        return lambda x: run(x) * 1.1 + 0.1

    monkeypatch.setattr(export, EXPORTERS[fmt], off)
    out = existing(tmp_path, f"m{SUFFIXES[fmt]}")
    with pytest.raises(ExportCheckError, match="differs from PyTorch"):
        export_model(model("baked"), SIZE, fmt, out, batch_size=2)
    assert out.read_bytes() == PRECIOUS
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_a_file_that_misses_the_tolerance_leaves_the_existing_file_alone(tmp_path: Path) -> None:
    out = existing(tmp_path, "m.onnx")
    with pytest.raises(ExportCheckError, match="differs from PyTorch"):
        export_model(model("big"), SIZE, "onnx", out)
    assert out.read_bytes() == PRECIOUS
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_nan_in_the_file_output_alone_fails_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    from vitcompress.workflows import export

    real = export._export_onnx

    def one_nan(*args, **kwargs):
        run = real(*args, **kwargs)

        def nan_run(x):
            got = run(x).clone()
            got[0, 0] = float("nan")
            return got

        return nan_run

    monkeypatch.setattr(export, "_export_onnx", one_nan)
    out = existing(tmp_path, "m.onnx")
    with pytest.raises(ExportCheckError, match="NaN"):
        export_model(model("baked"), SIZE, "onnx", out, batch_size=2, dtype=dtype)
    assert out.read_bytes() == PRECIOUS


def test_equal_infinities_and_nans_in_both_outputs_are_no_difference() -> None:
    from vitcompress.workflows.export import _max_diff

    inf, nan = float("inf"), float("nan")
    assert (
        _max_diff(torch.tensor([inf, -inf, nan, 1.0]), torch.tensor([inf, -inf, nan, 1.5])) == 0.5
    )
    assert _max_diff(torch.tensor([inf]), torch.tensor([1.0])) == inf
    assert _max_diff(torch.tensor([nan, 1.0]), torch.tensor([1.0, 1.0])) != 0.0  # NaN


def test_a_passing_export_replaces_the_file_and_leaves_nothing_else(tmp_path: Path) -> None:
    import onnx

    out = existing(tmp_path, "m.onnx")
    result = export_model(model("baked"), SIZE, "onnx", out, batch_size=2)
    assert result["out"] == str(out) and result["bytes"] == out.stat().st_size
    onnx.checker.check_model(onnx.load(str(out)))
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    # Written by the exporter, not made by mkstemp: the folder's usual permissions.
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    assert out.stat().st_mode == probe.stat().st_mode


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_the_command_fails_in_one_line_and_keeps_the_file(
    tmp_path: Path, factories: Path, fmt: str
) -> None:
    out = existing(tmp_path / "keep", f"m{SUFFIXES[fmt]}")
    result = CliRunner().invoke(
        cli,
        ["export", "--model", f"{factories}:baked", "--input-size", "3,16,16", "--format", fmt,
         "--out", str(out), "--dynamic-batch"],
    )  # fmt: skip
    # docs/export.md: ExportCheckError is not a user error (exit 1), one error line.
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "ExportCheckError" in lines[0] and "batch 1" in lines[0]
    assert out.read_bytes() == PRECIOUS
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name]


# ---------------------------------------------------------------------------------------------
# Half precision: only a missing kernel is onnxruntime's gap; any other error is the file's


def test_a_float16_file_that_crashes_in_onnxruntime_fails_the_export(tmp_path: Path) -> None:
    out = tmp_path / "b16.onnx"
    with pytest.raises(ExportCheckError, match="does not run at batch 1"):
        export_model(model("baked"), SIZE, "onnx", out, dynamic_batch=True, dtype="float16")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_missing_kernel_tells_onnxruntime_errors_apart(tmp_path: Path) -> None:
    """onnxruntime's own errors, not made-up ones: a bfloat16 file it has no CPU kernels for, and
    a float16 file run at a batch its graph does not take."""
    torch.manual_seed(0)
    vit = timm_small("vit_small_patch16_224", depth=1).eval()
    bf16 = tmp_path / "bf16.onnx"
    result = export_model(vit, (3, 32, 32), "onnx", bf16, dtype="bfloat16")
    if result["check"] == "onnxruntime":
        pytest.skip("this onnxruntime runs bfloat16 on the CPU")
    with pytest.raises(Exception) as caught:
        onnx_session(bf16)
    assert missing_kernel(caught.value)
    f16 = tmp_path / "f16.onnx"
    export_model(model("baked"), SIZE, "onnx", f16, batch_size=2, dtype="float16")
    with pytest.raises(Exception) as caught:
        onnx_session(f16).run(None, {"image": torch.zeros(1, *SIZE).half().numpy()})
    assert not missing_kernel(caught.value)


# ---------------------------------------------------------------------------------------------
# --compile: what cannot be traced is a warning; the export is written either way


def test_serving_check_reports_a_model_torch_export_cannot_trace() -> None:
    checked = serving_check(model("pointer"), SIZE, 2, mode=None, backend="eager")
    assert not checked.passed
    assert checked.host_sync.untraced and "data pointer" in checked.host_sync.untraced
    assert checked.to_json()["host_sync"]["untraced"] == checked.host_sync.untraced
    assert "host synchronisation not checked" in checked.text()


def test_export_compile_warns_and_keeps_the_file(tmp_path: Path, factories: Path) -> None:
    out = tmp_path / "c" / "ptr.onnx"
    args = ["export", "--model", f"{factories}:pointer", "--input-size", "3,16,16",
            "--format", "onnx", "--out", str(out), "--compile", "--json"]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["serving"]["passed"] is False and data["serving"]["host_sync"]["untraced"]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "not checked" in warnings[0]
    assert out.is_file() and data["out"] == str(out)


# ---------------------------------------------------------------------------------------------
# onnxruntime's warnings are not printed


def test_a_float16_export_prints_no_onnxruntime_warnings(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    # A timm ViT at float16: onnxruntime cannot constant-fold its float16 Sqrt on the CPU and
    # says so at warning level for every session.
    torch.manual_seed(0)
    vit = timm_small("vit_small_patch16_224", depth=1).eval()
    capfd.readouterr()
    result = export_model(vit, (3, 32, 32), "onnx", tmp_path / "m.onnx", dtype="float16")
    assert result["check"] == "onnxruntime"
    err = capfd.readouterr().err
    assert "onnxruntime" not in err, err


def test_compile_check_after_a_graph_break_earlier_in_the_process() -> None:
    # torch 2.14's reset, after an eager compile that broke, fails while iterating its backend
    # cache once an inductor reduce-overhead compile is cached; compile_check resets again.
    import contextlib

    import torch._dynamo

    from vitcompress.workflows.export import compile_check

    for _ in range(2):  # from a clean cache, whatever ran before in this process
        with contextlib.suppress(RuntimeError):
            torch._dynamo.reset()
    assert compile_check(model("pointer"), SIZE, 2, backend="eager")["graph_break"]
    again = compile_check(model("pointer"), SIZE, 1, backend="inductor", mode="reduce-overhead")
    assert again["graph_break"] and "data pointer" in again["reason"].lower()


# ---------------------------------------------------------------------------------------------
# The graphs torch prints beside a failure are not printed: the error is one line


def test_a_failed_onnx_export_prints_nothing_on_stdout(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    # SDPA has no ONNX form before opset 14; the TorchScript exporter's C++ log then writes its
    # whole graph (about 180 kB for one block) to file descriptor 1.
    torch.manual_seed(0)
    vit = timm_small("vit_small_patch16_224", depth=1).eval()
    capfd.readouterr()
    with pytest.raises(ExportError, match="opset version 13 is not supported"):
        export_model(vit, (3, 32, 32), "onnx", tmp_path / "m.onnx", opset=13)
    captured = capfd.readouterr()
    assert captured.out == "", captured.out[:200]
    assert "graph(" not in captured.err
    print("stdout still works")  # descriptor 1 is back in place
    assert capfd.readouterr().out == "stdout still works\n"


@pytest.mark.parametrize(
    "command",
    [
        ["apply", "--variant", "etps", "--keep", "0.7", "--no-throughput"],
        ["export", "--format", "exported-program", "--out", "{tmp}/m.pt2"],
    ],
    ids=["apply", "export"],
)
def test_a_data_dependent_model_fails_in_one_line(
    tmp_path: Path, factories: Path, command: list[str]
) -> None:
    # torch.export prints the partial graph it traced to stderr before it raises.
    args = [a.replace("{tmp}", str(tmp_path)) for a in command]
    result = CliRunner().invoke(
        cli, [args[0], "--model", f"{factories}:value_branch", "--input-size", "3,16,16", *args[1:]]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr[:300]
    assert "data-dependent" in lines[0]
