"""``torch.compile(fullgraph=True)`` of every registered variant (on a plain ViT, a windowed Swin
and a dense-output ViT), and compiled timing.

The variants are read from the registry at collection time (``vitcompress.compilation.plan.VARIANTS``),
so a variant added there is covered without editing this file. Graph breaks are dynamo's decision,
the same for every backend: all variants are captured with the ``eager`` backend in every run.
Inductor (C++ code generation on the CPU, minutes cold on 2 cores) runs one variant by default and
all of them under ``-m slow``.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import vitcompress
from tests.models import timm_small
from tests.test_windowed import SIZE as SWIN_SIZE
from tests.test_windowed import swin
from vitcompress.cli.main import cli
from vitcompress.compilation.plan import VARIANTS
from vitcompress.measure import measure_throughput
from vitcompress.workflows.export import compile_check

SIZE = (3, 32, 32)
INDUCTOR_DEFAULT = "dtps"  # the paper's method: predictor, sort, gathers and the squeeze


def compressed(variant: str) -> nn.Module:
    torch.manual_seed(0)
    base = timm_small("vit_small_patch16_224", depth=2)
    return vitcompress.compress(base, variant, keep=0.7, locs=[1], input_size=SIZE).eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_captures_as_one_graph(variant: str) -> None:
    result = compile_check(compressed(variant), SIZE, batch_size=2, backend="eager")
    assert not result["graph_break"], result["reason"]
    assert result["frames"] == 1 and result["recompiles"] == 0
    assert result["max_abs_diff"] < 1e-5


def _dense(variant: str) -> nn.Module:
    """A dense-output ViT (``global_pool=""``): the compressed model gives every token back."""
    torch.manual_seed(0)
    base = timm_small("vit_small_patch16_224", depth=2, global_pool="", num_classes=0)
    return vitcompress.compress(base, variant, keep=0.7, locs=[1], input_size=SIZE).eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", ["windowed", "dense"])
def test_every_variant_captures_as_one_graph_on_windowed_and_dense_models(
    kind: str, variant: str
) -> None:
    if kind == "windowed":  # a small Swin: shifted windows, every block reduced
        model, size = (
            vitcompress.compress(swin(), variant, keep=0.7, input_size=SWIN_SIZE),
            SWIN_SIZE,
        )
    else:
        model, size = _dense(variant), SIZE
    result = compile_check(model, size, batch_size=2, backend="eager")
    assert not result["graph_break"], result["reason"]
    assert result["frames"] == 1 and result["recompiles"] == 0
    assert result["max_abs_diff"] < 1e-5


def _inductor_cases() -> list[pytest.param]:
    return [
        pytest.param(v, marks=() if v == INDUCTOR_DEFAULT else pytest.mark.slow) for v in VARIANTS
    ]


@pytest.mark.parametrize("variant", _inductor_cases())
def test_inductor_compiles_the_variant_fullgraph(variant: str) -> None:
    result = compile_check(compressed(variant), SIZE, batch_size=2, backend="inductor")
    assert not result["graph_break"], result["reason"]
    assert result["frames"] == 1 and result["recompiles"] == 0
    assert result["max_abs_diff"] < 1e-4


@pytest.mark.slow  # inductor's code generation on 2 cores: about a minute
def test_reduce_overhead_compiles_on_the_cpu_as_one_graph() -> None:
    # No CUDA graphs on a CPU: inductor compiles the mode as its default one, still one graph.
    result = compile_check(
        compressed("etps"), SIZE, batch_size=2, backend="inductor", mode="reduce-overhead"
    )
    assert result["mode"] == "reduce-overhead" and not result["graph_break"], result["reason"]
    assert result["frames"] == 1 and result["recompiles"] == 0
    assert result["max_abs_diff"] < 1e-4


class Breaks(nn.Module):
    """A model dynamo must split in two: a Python branch on a tensor's value."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x.flatten(1)[:, :8])
        if y.sum().item() > 0:  # data-dependent control flow: a graph break
            y = y * 2
        return self.b(y)


def test_compiled_timing_records_compilation_and_warns_on_graph_breaks() -> None:
    models = {"one_graph": compressed("etps"), "breaks": Breaks(), "eager": Breaks()}
    report = measure_throughput(
        models,
        SIZE,
        batch_size=2,
        warmup=0,
        runs=2,
        compile=["one_graph", "breaks"],
        compile_options={"backend": "eager"},
    )
    env = report.environment
    assert env["compiled_models"] == ["one_graph", "breaks"]
    assert env["compile_options"] == {"backend": "eager"}
    assert set(env["compile_seconds"]) == {"one_graph", "breaks"}
    assert env["compiled_graphs"]["one_graph"] == 1
    assert env["compiled_graphs"]["breaks"] >= 2
    assert any(w.startswith("breaks compiled into") for w in report.warnings)
    assert not any(w.startswith("one_graph compiled") for w in report.warnings)
    assert all(len(r.samples) == 2 for r in report.results.values())


def test_compile_names_must_be_timed_models() -> None:
    with pytest.raises(ValueError, match="not timed"):
        measure_throughput({"a": Breaks()}, SIZE, batch_size=1, runs=1, compile=["b"])


def test_compile_mode_without_compile_is_refused() -> None:
    result = CliRunner().invoke(
        cli, ["bench", "--model", "vit_small_patch16_224", "--compile-mode", "max-autotune"]
    )
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: --compile-mode sets how models are compiled: add --compile"
    )


@pytest.mark.slow  # inductor on a plain ViT: a minute cold on 2 cores
def test_bench_compile_reports_the_compilation() -> None:
    args = [
        f"--model-arg={k}={v}"
        for k, v in dict(img_size=32, patch_size=4, depth=2, embed_dim=32, num_heads=2).items()
    ]
    result = CliRunner().invoke(
        cli,
        [
            "bench",
            "--model",
            "vit_small_patch16_224",
            *args,
            "--batch-size",
            "2",
            "--warmup",
            "0",
            "--runs",
            "1",
            "--compile",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    env = json.loads(result.stdout)["environment"]
    assert env["compile"] is True and env["compiled_graphs"] == {"model": 1}


ITEM_MODEL = '''
import torch
from torch import nn


class ItemNet(nn.Module):
    """A classifier that reads a value on the host in its forward."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3 * 8 * 8, 4)

    def forward(self, x):
        return self.head(x.flatten(1)) * x.mean().item()


def build():
    return ItemNet()
'''


def test_export_compile_checks_the_serving_path(tmp_path) -> None:
    from vitcompress.workflows.export_run import ExportSettings, export_request
    from vitcompress.workflows.inputs import ModelRequest

    small = dict(img_size=32, patch_size=4, depth=2, embed_dim=32, num_heads=2)
    request = ModelRequest("vit_small_patch16_224", args=small)
    settings = ExportSettings(
        "torchscript", str(tmp_path / "m.pt"), batch_size=2, compile=True, compile_backend="eager"
    )
    served = export_request(request, settings).to_json()["serving"]
    assert served["passed"] and served["batch_size"] == 2
    assert served["compile"]["frames"] == 1 and served["host_sync"]["passed"]
    (tmp_path / "item_net.py").write_text(ITEM_MODEL)
    request = ModelRequest(f"{tmp_path / 'item_net.py'}:build", input_size=(3, 8, 8))
    settings = ExportSettings(  # a trace bakes the value in: its check would fail first
        "torchscript",
        str(tmp_path / "i.pt"),
        batch_size=2,
        check=False,
        compile=True,
        compile_backend="eager",
    )
    served = export_request(request, settings).to_json()["serving"]
    assert not served["passed"]
    assert "aten._local_scalar_dense" in served["host_sync"]["ops"][0]


def test_export_compile_mode_without_compile_is_refused(tmp_path) -> None:
    out = str(tmp_path / "m.onnx")
    args = ["export", "--model", "vit_small_patch16_224", "--format", "onnx", "--out", out]
    result = CliRunner().invoke(cli, [*args, "--compile-mode", "default"])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: --compile-mode sets how the model is compiled: add --compile"
    )
