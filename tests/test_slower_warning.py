"""On CUDA, ``apply`` and ``bench --batch-sizes`` say when the compressed model is slower than its
base at the batch timed, with the crossover batch of a sweep. No GPU is needed: the timings are
faked at the workflow level (the device named, the images/s given), everything else runs."""

from __future__ import annotations

import warnings as warnings_module
from pathlib import Path

import pytest
import torch

import vitcompress
import vitcompress.workflows.apply as apply_workflow
import vitcompress.workflows.bench as bench_workflow
from tests.models import SMALL, timm_small
from vitcompress.measure import PairedRatio
from vitcompress.measure.models import TimingOptions, measure_models
from vitcompress.workflows.apply import apply_model
from vitcompress.workflows.batch_sweep import BatchSweep, SweepPoint
from vitcompress.workflows.bench import bench_model
from vitcompress.workflows.gates import Bounds
from vitcompress.workflows.inputs import ModelRequest, PlanRequest

REQUEST = ModelRequest("vit_small_patch16_224", args={**SMALL, "depth": 2})
PLAN = PlanRequest("etps", keep=[0.7], locs=[1])


def _faked_timing(monkeypatch: pytest.MonkeyPatch, compressed_over_base: float) -> None:
    """``measure_models`` counts for real and 'times' the compressed model at the given ratio
    of its base, round by round."""

    def fake(models, input_size, timing):
        measured, _ = measure_models(models, input_size, None)
        for name, measurement in measured.items():
            scale = compressed_over_base if name == "compressed" else 1.0
            measurement.samples = [100.0 * scale * (1 + 0.01 * i) for i in range(6)]
            measurement.throughput = measurement.samples[3]
        return measured, {"device": timing.device, "warnings": []}

    monkeypatch.setattr(apply_workflow, "measure_models", fake)


@pytest.mark.parametrize(
    ("device", "ratio", "warned"),
    [("cuda", 0.8, True), ("cuda:1", 0.95, True), ("cuda", 1.2, False), ("cpu", 0.8, False)],
)
def test_apply_warns_on_cuda_when_the_compressed_model_is_slower(
    monkeypatch: pytest.MonkeyPatch, device: str, ratio: float, warned: bool
) -> None:
    _faked_timing(monkeypatch, ratio)
    timing = TimingOptions(batch_size=8, device=device)
    with warnings_module.catch_warnings(record=True) as shown:
        warnings_module.simplefilter("always")
        report = apply_model(REQUEST, PLAN, None, timing, Bounds())
    warnings = report.to_json()["environment"]["warnings"]
    slower = [w for w in warnings if "slower than its base" in w]
    if not warned:
        assert not slower
        return
    assert slower == [
        f"the compressed model is slower than its base on {device} at batch 8 ({ratio:.2f}x): "
        "the reducers' own kernels cost more than the tokens they remove save there; try "
        "larger batches, or --cuda-graphs (each batch one launch); bench DIR "
        "--batch-sizes finds the batch from which it pays"
    ]
    assert slower[0] in [str(w.message) for w in shown]  # said, not only recorded


def _sweep(ratios: list[float]) -> BatchSweep:
    points = [
        SweepPoint(
            batch_size=size,
            throughput={"base": 100.0, "compressed": 100.0 * ratio},
            samples={},
            speedup={"compressed": PairedRatio(median=ratio, low=None, high=None, pairs=3)},
        )
        for size, ratio in zip([1, 8, 64, 256], ratios, strict=True)
    ]
    return BatchSweep(points=points, reference="base", environment={})


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = vitcompress.compress(
        timm_small("vit_small_patch16_224", depth=2), "etps", keep=0.5, locs=[0]
    )
    return vitcompress.save(model, tmp_path_factory.mktemp("slower") / "art")


@pytest.mark.parametrize(
    ("device", "ratios", "expected"),
    [
        (
            "cuda",
            [0.6, 0.9, 1.1, 1.3],
            "the compressed model is slower than its base on cuda at batches 1 (0.60x), "
            "8 (0.90x): it is faster from batch 64 on (the crossover of those swept)",
        ),
        (
            "cuda",
            [0.7, 0.8, 0.9, 0.95],
            "the compressed model is slower than its base on cuda at batches 1 (0.70x), "
            "8 (0.80x), 64 (0.90x), 256 (0.95x): it is not faster at the largest batch swept "
            "(no crossover)",
        ),
        ("cuda", [1.1, 1.2, 1.3, 1.4], None),
        ("cpu", [0.6, 0.9, 1.1, 1.3], None),
    ],
)
def test_bench_sweep_warns_on_cuda_with_the_crossover(
    monkeypatch: pytest.MonkeyPatch, artifact: Path, device: str, ratios, expected
) -> None:
    seen = {}

    def fake_sweep(models, input_size, batch_sizes, timing, reference=None):
        seen["models"], seen["reference"] = sorted(models), reference
        return _sweep(ratios)

    monkeypatch.setattr(bench_workflow, "sweep_batch_sizes", fake_sweep)
    timing = TimingOptions(device=device)
    result = bench_model(ModelRequest(str(artifact)), timing, Bounds(), [1, 8, 64, 256])
    assert seen == {"models": ["base", "compressed"], "reference": "base"}
    warnings = result.to_json()["warnings"]
    if expected is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith(expected)


@pytest.mark.parametrize(
    ("mode", "device", "counted", "warned"),
    [
        ("reduce-overhead", "cuda", True, True),
        ("reduce-overhead", "cpu", True, False),  # no CUDA graphs on a CPU: counted, not said
        ("default", "cuda", False, False),  # a mode without CUDA graphs: nothing to count
    ],
)
def test_apply_counts_the_graphs_compiled_without_cuda_graphs(
    monkeypatch: pytest.MonkeyPatch, mode: str, device: str, counted: bool, warned: bool
) -> None:
    from torch._dynamo.utils import counters

    def fake(models, input_size, timing):
        measured, _ = measure_models(models, input_size, None)
        counters["inductor"]["cudagraph_skips"] += 2  # what inductor does when it skips
        for measurement in measured.values():
            measurement.samples = [100.0] * 3
            measurement.throughput = 100.0
        return measured, {"warnings": []}

    monkeypatch.setattr(apply_workflow, "measure_models", fake)
    timing = TimingOptions(batch_size=8, device=device, compile=True, compile_mode=mode)
    with warnings_module.catch_warnings(record=True) as shown:
        warnings_module.simplefilter("always")
        report = apply_model(REQUEST, PLAN, None, timing, Bounds())
    environment = report.to_json()["environment"]
    assert environment.get("cuda_graph_skips") == (2 if counted else None)
    said = [str(w.message) for w in shown if "without CUDA graphs" in str(w.message)]
    assert said == (
        ["inductor compiled 2 graphs without CUDA graphs (--compile-mode reduce-overhead): they "
         "run kernel by kernel; TORCH_LOGS=perf_hints says why"] if warned else []
    )  # fmt: skip
