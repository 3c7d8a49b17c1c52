"""``vitcompress inspect`` and ``vitcompress bench`` as workflows: load the model, map or measure
it, and return a typed result whose ``to_json()`` is what ``--json`` prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vitcompress.analysis.model_map import ModelMap
from vitcompress.measure.models import (
    Measurement,
    TimingOptions,
    base_for_timing,
    measure_models,
)
from vitcompress.status import step, warn
from vitcompress.workflows.batch_sweep import (
    BatchSizesError,
    BatchSweep,
    plot_sweep,
    sweep_batch_sizes,
    sweep_slower_than_base,
)
from vitcompress.workflows.gates import Bounds, GateResult, check_gates, require
from vitcompress.workflows.identity import model_identity
from vitcompress.workflows.inputs import ModelRequest
from vitcompress.workflows.serving import cuda_graphs_counted

BASE, COMPRESSED, MODEL = "base", "compressed", "model"


def inspect_model(request: ModelRequest) -> ModelMap:
    """The model map of ``--model``: stages, blocks, attention cores, prefix tokens, grid ops.
    For a compressed model, the map of its base that its plan was made on (its own graph holds
    the method's modules, which the analysis would map as parts of the model)."""
    from vitcompress.api import map_model
    from vitcompress.compilation.metadata import compression_info

    loaded = request.load()
    info = compression_info(loaded.model)
    if info is not None:
        return info.model_map
    return map_model(loaded.model, loaded.input_size)


@dataclass
class BenchResult:
    """One model's params, MACs and throughput, and the gates checked on them."""

    spec: str
    identity: dict[str, Any]
    measurement: Measurement
    input_size: tuple[int, ...]
    environment: dict[str, Any]
    gates: list[GateResult]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.spec,
            "identity": self.identity,
            **self.measurement.to_json(),
            "input_size": list(self.input_size),
            "environment": self.environment,
            "gates": [g.to_json() for g in self.gates],
        }


@dataclass
class SweepResult:
    """``bench --batch-sizes``: the model (against its recorded base when it is a compressed
    model directory) timed at each batch size; ``save_error`` says why the plot was not
    written, if it was not (the numbers are reported anyway)."""

    spec: str
    identity: dict[str, Any]
    measurement: Measurement  # params and MACs (no throughput: the sweep has that)
    input_size: tuple[int, ...]
    gates: list[GateResult]
    sweep: BatchSweep
    models: list[str]
    plot: str | None = None
    save_error: str | None = None  # the plot's
    # What the sweep says a user must hear (on CUDA: batches where compression costs time).
    warnings: list[str] = field(default_factory=list)
    compared: bool = field(init=False)

    def __post_init__(self) -> None:
        self.compared = self.sweep.reference is not None

    def to_json(self) -> dict[str, Any]:
        counts = {k: v for k, v in self.measurement.to_json().items() if k != "throughput"}
        data = {
            "model": self.spec,
            "identity": self.identity,
            **counts,
            "input_size": list(self.input_size),
            "gates": [g.to_json() for g in self.gates],
            **self.sweep.to_json(),
        }
        if self.plot is not None:
            data["plot"] = self.plot
        data["warnings"] = list(self.warnings)
        return data


def bench_model(
    request: ModelRequest,
    timing: TimingOptions | None,
    bounds: Bounds,
    batch_sizes: list[int] | None = None,
    plot: str | None = None,
) -> BenchResult | SweepResult:
    """``vitcompress bench``: count params and MACs, time the throughput (at each of
    ``batch_sizes`` when given, drawn to ``plot``), and check ``--max-gmacs``."""
    require(
        bounds,
        {
            "max_acc_drop": "bench measures no accuracy; use eval --base",
            "min_speedup": "bench times one model, so there is no speedup to check; use apply or "
            "eval --base",
        },
    )
    if batch_sizes is None and plot is not None:
        raise BatchSizesError("--plot draws a batch sweep: add --batch-sizes")
    if batch_sizes is not None and timing is None:
        raise BatchSizesError("--batch-sizes times the model: drop --no-throughput")
    with step(f"loading {request.spec}"):
        loaded = request.load()
    identity = model_identity(loaded, request.spec)
    sweeping = batch_sizes is not None and timing is not None
    with cuda_graphs_counted(None if sweeping else timing) as cuda_graphs:
        measured, environment = measure_models(
            {MODEL: loaded.model}, loaded.input_size, None if sweeping else timing
        )
    environment.update(cuda_graphs)
    gates = check_gates(bounds, {"gmacs": measured[MODEL].macs / 1e9})
    if not sweeping:
        return BenchResult(
            request.spec, identity, measured[MODEL], loaded.input_size, environment, gates
        )
    assert batch_sizes is not None and timing is not None
    with step("loading the base of the model, if it is a compressed model directory"):
        base = base_for_timing(loaded)
    models = (
        {BASE: base.model, COMPRESSED: loaded.model} if base is not None else {MODEL: loaded.model}
    )
    with cuda_graphs_counted(timing) as cuda_graphs:
        sweep = sweep_batch_sizes(
            models, loaded.input_size, batch_sizes, timing, reference=BASE if base else None
        )
    sweep.environment.update(cuda_graphs)
    result = SweepResult(
        request.spec, identity, measured[MODEL], loaded.input_size, gates, sweep, list(models)
    )
    slower = sweep_slower_than_base(sweep, COMPRESSED, timing.device) if base else None
    if slower is not None:
        warn(slower)
        result.warnings.append(slower)
    if plot is not None:
        try:
            title = f"{request.spec}: throughput by batch size"
            result.plot = str(plot_sweep(sweep, plot, title))
        except OSError as e:
            result.save_error = f"--plot {plot}: {e.strerror or e}"
    return result
