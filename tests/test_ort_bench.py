"""Exported speed: ``export --bench`` and ``bench_exported`` time ONNX files in onnxruntime
against the same models in eager PyTorch, interleaved, with paired speed-ups per runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import vitcompress
from tests.models import timm_small
from vitcompress.cli.main import cli
from vitcompress.measure import paired_ratio
from vitcompress.workflows.export import export_model
from vitcompress.workflows.export_bench import bench_exported

SIZE = (3, 32, 32)
FAST = ["--warmup", "0", "--runs", "5", "--bench-seconds", "30"]


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def tiny_base() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm_small("vit_small_patch16_224", depth=2).eval()


def test_bench_exported_pairs_every_runner_round_by_round(tmp_path: Path) -> None:
    base = tiny_base()
    models = {"base": base, "dtps": vitcompress.compress(base, "dtps", 0.5, [0], SIZE).eval()}
    files = {name: tmp_path / f"{name}.onnx" for name in models}
    for name, model in models.items():
        export_model(model, SIZE, "onnx", files[name], batch_size=3)
    base.train()  # the caller's mode comes back after timing
    result = bench_exported(models, files, SIZE, reference="base", batch_size=3, warmup=0, runs=5)
    assert base.training
    samples = result["samples"]
    assert set(samples) == {"pytorch:base", "pytorch:dtps", "onnxruntime:base", "onnxruntime:dtps"}
    assert all(len(values) == 5 for values in samples.values())
    for runtime in ("pytorch", "onnxruntime"):
        want = paired_ratio(samples[f"{runtime}:dtps"], samples[f"{runtime}:base"]).to_json()
        assert result["speedup"][runtime] == {"dtps": want}
        assert want["ci95"] is not None and want["pairs"] == 5
    assert set(result["onnxruntime_vs_pytorch"]) == {"base", "dtps"}
    assert result["environment"]["onnxruntime"] and result["batch_size"] == 3


def test_bench_exported_refuses_mismatched_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="differ"):
        bench_exported({"a": tiny_base()}, {"b": tmp_path / "b.onnx"}, SIZE, reference="a")


def test_export_bench_command(tmp_path: Path) -> None:
    base = tiny_base()
    art = vitcompress.save(vitcompress.compress(base, "etps", 0.5, [0], SIZE), tmp_path / "art")
    out = tmp_path / "exports" / "m.onnx"
    result = run(
        "export", "--model", str(art), "--format", "onnx", "--out", str(out), "--bench",
        "--batch-size", "2", *FAST, "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (tmp_path / "exports" / "m.base.onnx").is_file()
    bench = data["bench"]
    assert bench["batch_size"] == 2 and bench["base_export"]["checked"]
    for runtime in ("pytorch", "onnxruntime"):
        assert bench["speedup"][runtime]["compressed"]["pairs"] == 5
        assert set(bench["throughput"][runtime]) == {"base", "compressed"}


def test_export_bench_writes_both_files_or_neither(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vitcompress.workflows import export_run

    base = tiny_base()
    art = vitcompress.save(vitcompress.compress(base, "etps", 0.5, [0], SIZE), tmp_path / "art")
    folder = tmp_path / "exports"
    folder.mkdir()
    out, base_out = folder / "m.onnx", folder / "m.base.onnx"
    for path in (out, base_out):
        path.write_bytes(b"the user's earlier file")
    real = export_run.export_model
    calls: list[Path] = []

    def base_fails(model, input_size, fmt, path, **kwargs):  # the compressed file, then the base's
        calls.append(Path(path))
        if len(calls) == 2:
            raise export_run.ExportError("onnx export failed: the base's")
        return real(model, input_size, fmt, path, **kwargs)

    monkeypatch.setattr(export_run, "export_model", base_fails)
    result = run(
        "export", "--model", str(art), "--format", "onnx", "--out", str(out), "--bench", *FAST,
    )  # fmt: skip
    assert result.exit_code == 2 and "the base's" in result.stderr, result.output
    assert out.read_bytes() == base_out.read_bytes() == b"the user's earlier file"
    assert sorted(p.name for p in folder.iterdir()) == ["m.base.onnx", "m.onnx"]
    assert calls[0].name == "m.onnx" and calls[1].name == "m.base.onnx"  # staged, not in place
    assert calls[0].parent != folder


@pytest.mark.parametrize(
    "args, message",
    [
        (["--format", "torchscript"], "--bench times ONNX files in onnxruntime: use --format onnx"),
        (["--format", "onnx"], "--model must be a compressed model directory"),
    ],
)
def test_export_bench_refusals(args: list[str], message: str, tmp_path: Path) -> None:
    spec = [f"--model-arg={k}={v}" for k, v in dict(img_size=32, patch_size=4, depth=1).items()]
    # Named for the format asked (another format's suffix is a refusal of its own).
    out = tmp_path / ("m.pt" if "torchscript" in args else "m.onnx")
    result = run(
        "export", "--model", "vit_small_patch16_224", *spec, *args, "--out", str(out), "--bench",
    )  # fmt: skip
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]
    assert not out.exists()  # refused before anything was written
