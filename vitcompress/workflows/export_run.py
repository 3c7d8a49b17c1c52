"""``vitcompress export`` as one workflow: write the model's inference path, check it, with
``quantize`` quantize the ONNX file to int8, and with ``bench`` time a compressed ONNX file
against its base's in onnxruntime (and PyTorch, unquantized)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitcompress.loading import LoadedModel, ModelLoadError
from vitcompress.measure.models import base_for_timing
from vitcompress.status import step, warn
from vitcompress.workflows.export import ExportError, export_model
from vitcompress.workflows.export_bench import ExportTiming, bench_timed
from vitcompress.workflows.export_int8 import (
    QuantizedExport,
    QuantizeSettings,
    check_quantize_request,
)
from vitcompress.workflows.inputs import DataRequest, ModelRequest
from vitcompress.workflows.onnx_quantize import DEFAULT_CALIBRATION_IMAGES
from vitcompress.workflows.serving import ServingCheck, serving_check

# ``export --compile`` without ``--compile-mode``: inductor's CUDA-graph mode, the serving path.
SERVING_MODE = "reduce-overhead"


@dataclass(frozen=True)
class ExportSettings:
    fmt: str
    out: str
    batch_size: int = 1
    opset: int = 17
    dynamic_batch: bool = False
    check: bool = True
    dtype: str = "float32"
    # ``--compile``: also check the serving path (fullgraph, static batch, no host sync) in
    # ``compile_mode`` (None: reduce-overhead, CUDA graphs on a GPU); ``compile_backend`` is
    # inductor, or eager to check dynamo's capture alone.
    compile: bool = False
    compile_mode: str | None = None
    compile_backend: str = "inductor"
    # ``--quantize``: int8 (dynamic) or int8-static (calibrated on ``calibration_images`` images
    # of ``--data``); the file at ``out`` is then the int8 one, the float32 one beside it.
    quantize: str | None = None
    calibration_images: int | None = None  # None: DEFAULT_CALIBRATION_IMAGES

    def export(self, loaded: LoadedModel, model: Any, out: str | Path, fmt: str) -> dict:
        return export_model(
            model,
            loaded.input_size,
            fmt,
            out,
            batch_size=self.batch_size,
            opset=self.opset,
            check=self.check,
            dynamic_batch=self.dynamic_batch,
            dtype=self.dtype,
        )

    def quantize_settings(self, loaded: LoadedModel) -> QuantizeSettings:
        assert self.quantize is not None
        return QuantizeSettings(
            self.quantize,
            self.out,
            self.batch_size,
            self.dynamic_batch,
            self.calibration_images or DEFAULT_CALIBRATION_IMAGES,
            lambda model, path: self.export(loaded, model, path, "onnx"),
        )


@dataclass
class ExportResult:
    spec: str
    export: dict[str, Any]  # export_model's result
    bench: dict[str, Any] | None = None
    serving: ServingCheck | None = None  # ``--compile``'s check of the serving path
    quantized: dict[str, Any] | None = None  # ``--quantize``: what was quantized, what kept float

    def to_json(self) -> dict[str, Any]:
        data = {**self.export, "model": self.spec}
        if self.quantized is not None:
            data["quantize"] = self.quantized
        if self.bench is not None:
            data["bench"] = self.bench
        if self.serving is not None:
            data["serving"] = self.serving.to_json()
        return data


def export_request(
    request: ModelRequest,
    settings: ExportSettings,
    timing: ExportTiming | None = None,
    data: DataRequest | None = None,
) -> ExportResult:
    """Export ``request``'s model as ``settings`` say; with ``timing``, also export its base
    beside the file and time both (``--bench``); with ``settings.quantize``, quantize the file
    (calibrated on ``data`` for int8-static) and, with ``timing``, time the four files."""
    if timing is not None and settings.fmt != "onnx":
        raise ExportError("--bench times ONNX files in onnxruntime: use --format onnx")
    if timing is not None and settings.dtype != "float32":
        # The timed runners feed float32 batches to both runtimes.
        raise ExportError("--bench times float32 files: drop --dtype or time without --bench")
    check_quantize_request(
        settings.quantize, settings.fmt, settings.dtype, data, settings.calibration_images
    )
    loaded = request.load()
    base = _base_to_bench(loaded) if timing is not None else None  # before minutes of exporting
    quantized = None
    if settings.quantize is not None:
        quantized = QuantizedExport(  # reads --data before writing anything
            settings.quantize_settings(loaded), loaded, data, base
        )
        result = ExportResult(request.spec, quantized.export(), quantized=quantized.summary)
    elif base is not None:
        # --bench: the file and its base's are written together, or neither is.
        exported, base_export = _export_with_base(loaded, base, settings)
        result = ExportResult(request.spec, exported)
    else:
        result = ExportResult(
            request.spec, settings.export(loaded, loaded.model, settings.out, settings.fmt)
        )
    if settings.compile:
        mode = settings.compile_mode or SERVING_MODE
        with step(f"compiling the model (fullgraph, {mode}, batch {settings.batch_size})"):
            result.serving = serving_check(
                loaded.model,
                loaded.input_size,
                settings.batch_size,
                mode=mode,
                backend=settings.compile_backend,
            )
        if not result.serving.passed:
            warn(result.serving.text())
    if quantized is not None and timing is not None:
        result.bench = quantized.bench(timing)
    elif base is not None and timing is not None:
        result.bench = _bench(loaded, base, settings, timing) | {"base_export": base_export}
    return result


def _base_to_bench(loaded: LoadedModel) -> LoadedModel:
    base = base_for_timing(loaded)
    if base is None:
        raise ModelLoadError(
            "--bench times a compressed model against its base: --model must be a compressed "
            "model directory (vitcompress apply --out DIR)"
        )
    return base


def base_path(out: Path) -> Path:
    """Where ``--bench`` writes the base's file: ``NAME.base.onnx`` beside ``NAME.onnx``."""
    return out.with_name(f"{out.stem}.base{out.suffix or '.onnx'}")


def _export_with_base(
    loaded: LoadedModel, base: LoadedModel, settings: ExportSettings
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Export the compressed model to ``settings.out`` and its base beside it, both checked in a
    hidden folder beside ``out`` and moved into place only once both passed: a base that fails
    leaves the file already at ``out`` as it was (``export_model`` alone keeps each file safe,
    not the pair). Their ``export_model`` results, with the paths they were moved to."""
    out = Path(settings.out)
    paths = {"compressed": out, "base": base_path(out)}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        folder = tempfile.TemporaryDirectory(prefix=".vitcompress-export-", dir=out.parent)
    except OSError as e:
        raise ExportError(f"cannot write {out}: {e.strerror or e}") from e
    with folder as staging:
        staged = {name: Path(staging) / path.name for name, path in paths.items()}
        results = {
            "compressed": settings.export(loaded, loaded.model, staged["compressed"], "onnx")
        }
        with step(f"exporting the base to {paths['base']}"):
            results["base"] = settings.export(loaded, base.model, staged["base"], "onnx")
        try:
            for name, path in paths.items():
                os.replace(staged[name], path)
                results[name]["out"] = str(path)
        except OSError as e:
            raise ExportError(f"cannot write {paths[name]}: {e.strerror or e}") from e
    return results["compressed"], results["base"]


def _bench(
    loaded: LoadedModel, base: LoadedModel, settings: ExportSettings, timing: ExportTiming
) -> dict[str, Any]:
    out = Path(settings.out)
    with step(
        f"timing base and compressed in pytorch and onnxruntime (batch {settings.batch_size})"
    ):
        return bench_timed(
            {"base": base.model, "compressed": loaded.model},
            {"base": base_path(out), "compressed": out},
            loaded.input_size,
            "base",
            settings.batch_size,
            timing,
        )
