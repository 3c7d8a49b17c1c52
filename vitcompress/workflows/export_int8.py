"""``export --format onnx --quantize int8|int8-static``: the float32 file exported and checked as
always, quantized (:func:`~vitcompress.workflows.onnx_quantize.quantize_onnx_file`), audited and
compared with the float32 file; with ``--bench``, the base exported and quantized the same way and
the four files timed in onnxruntime.

Files, for ``--out NAME.onnx``: ``NAME.onnx`` is the int8 file (what the user asked for),
``NAME.fp32.onnx`` the float32 file it was made from; with ``--bench`` also ``NAME.base.onnx``
(the int8 base) and ``NAME.base.fp32.onnx``. Everything is written into a temporary folder and
moved into place only once all of it has been written and checked: a refusal or a failure leaves
nothing behind.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitcompress.errors import given_options
from vitcompress.loading import LoadedModel
from vitcompress.measure.onnx_runtime import onnx_session
from vitcompress.status import step
from vitcompress.workflows.export import ExportError
from vitcompress.workflows.export_bench import ExportTiming, bench_timed
from vitcompress.workflows.inputs import DataRequest
from vitcompress.workflows.onnx_file import onnx_op_audit, onnx_static_shapes
from vitcompress.workflows.onnx_quantize import (
    DYNAMIC_CALIBRATION_BATCH,
    ImageCalibration,
    QuantizeError,
    inserted_module_scopes,
    quantize_onnx_file,
)

# The four files ``--bench`` times, by runner name; the reference is the float32 base.
FP32_BASE, FP32_COMPRESSED = "base", "compressed"
INT8_BASE, INT8_COMPRESSED = "base.int8", "compressed.int8"


def check_quantize_request(
    quantize: str | None,
    fmt: str,
    dtype: str,
    data: DataRequest | None,
    calibration_images: int | None = None,
) -> None:
    """The refusals of ``--quantize`` that need nothing loaded: one line each, before anything
    is written. ``calibration_images`` is None where the user did not give a count."""
    has_data = data is not None and data.source is not None
    if calibration_images is not None and quantize != "int8-static":
        raise QuantizeError(
            "--calibration-images sets how many images --quantize int8-static calibrates on: "
            "drop it, or use --quantize int8-static"
        )
    if quantize != "int8-static" and data is not None:
        # The data options only choose and prepare the calibration images.
        given = given_options((("--data-dir", data.data_dir), ("--split", data.split != "train")))
        given += [f"--{name.replace('_', '-')}" for name in data.overrides]
        if given:
            raise QuantizeError(
                f"{', '.join(given)}: read only to calibrate --quantize int8-static; drop "
                f"{'it' if len(given) == 1 else 'them'}, or use --quantize int8-static"
            )
    if quantize is None:
        if has_data:
            raise QuantizeError("--data is read to calibrate --quantize int8-static; drop it")
        return
    if fmt != "onnx":
        raise QuantizeError(f"--quantize writes int8 ONNX: use --format onnx, not {fmt}")
    if dtype != "float32":
        raise QuantizeError(f"--quantize starts from a float32 file: drop --dtype {dtype}")
    if quantize == "int8-static" and not has_data:
        raise QuantizeError(
            "--quantize int8-static calibrates activation ranges on images: give --data DIR"
        )
    if quantize == "int8" and has_data:
        raise QuantizeError(
            "--quantize int8 quantizes activations at run time and reads no images: drop --data, "
            "or use --quantize int8-static"
        )


def quantized_paths(out: Path) -> dict[str, Path]:
    """Where each file lands, by runner name (module docstring)."""
    stem, suffix = out.stem, out.suffix or ".onnx"
    return {
        INT8_COMPRESSED: out,
        FP32_COMPRESSED: out.with_name(f"{stem}.fp32{suffix}"),
        INT8_BASE: out.with_name(f"{stem}.base{suffix}"),
        FP32_BASE: out.with_name(f"{stem}.base.fp32{suffix}"),
    }


@dataclass(frozen=True)
class QuantizeSettings:
    """``--quantize``'s mode, the file to write, the export's batch, and how the float32 files
    are exported (``export(model, path)``, the export's settings bound)."""

    mode: str
    out: str | Path
    batch_size: int
    dynamic_batch: bool
    calibration_images: int
    export: Callable[[nn.Module, Path], dict[str, Any]]


class QuantizedExport:
    """One ``export --quantize``: :meth:`export` writes the files, :meth:`bench` times them.

    The calibration images are read here, when it is made: an unreadable ``--data`` is refused
    before anything is exported."""

    def __init__(
        self,
        settings: QuantizeSettings,
        loaded: LoadedModel,
        data: DataRequest | None,
        base: LoadedModel | None = None,
    ) -> None:
        self.settings = settings
        self.loaded = loaded
        self.base = base
        self.paths = quantized_paths(Path(settings.out))
        if self.paths[INT8_COMPRESSED].is_dir():
            raise ExportError(
                f"--out {settings.out} is a directory; give a file such as model.onnx"
            )
        self.dataset = None
        if settings.mode == "int8-static" and data is not None:
            with step(f"reading calibration images from {data.source}"):
                self.dataset, _ = data.for_model(loaded.model, loaded.input_size)
            if len(self.dataset) == 0:  # type: ignore[arg-type]
                raise QuantizeError(f"--data {data.source} holds no calibration images")
        self.summary: dict[str, Any] | None = None
        self.base_summary: dict[str, Any] | None = None

    def export(self) -> dict[str, Any]:
        """Export, quantize and check the compressed model (and with a base, the base), then
        move the files into place; ``export_model``'s result for the float32 file with the int8
        file's ``out``, ``bytes``, ``static_shapes`` and ``op_audit``, the float32 file's under
        ``fp32``. ``summary`` holds the quantization's result."""
        with tempfile.TemporaryDirectory(prefix="vitcompress-export-") as folder:
            staged = {name: Path(folder) / path.name for name, path in self.paths.items()}
            fp32 = self._one(self.loaded.model, staged[FP32_COMPRESSED], staged[INT8_COMPRESSED])
            self.summary = fp32.pop("quantize")
            if self.base is not None:
                with step(f"exporting and quantizing the base to {self.paths[INT8_BASE]}"):
                    base = self._one(self.base.model, staged[FP32_BASE], staged[INT8_BASE])
                self.base_summary = base.pop("quantize")
            out = self.paths[INT8_COMPRESSED]
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                for name, path in staged.items():
                    if path.exists():
                        shutil.move(path, self.paths[name])
            except OSError as e:
                raise ExportError(f"cannot write {out}: {e.strerror or e}") from e
        int8 = self.paths[INT8_COMPRESSED]
        fp32_path = self.paths[FP32_COMPRESSED]
        return fp32 | {
            "out": str(int8),
            "bytes": int8.stat().st_size,
            "static_shapes": onnx_static_shapes(int8),
            "op_audit": onnx_op_audit(int8),
            "fp32": {
                "out": str(fp32_path),
                "bytes": fp32_path.stat().st_size,
                "op_audit": fp32["op_audit"],
            },
        }

    def _one(self, model: Any, fp32_path: Path, int8_path: Path) -> dict[str, Any]:
        """Export ``model`` to ``fp32_path`` (checked against PyTorch) and quantize it into
        ``int8_path``; the export's result with the quantization's under ``quantize``."""
        settings = self.settings
        written = settings.export(model, fp32_path)
        calibration = None
        if self.dataset is not None:
            batch = DYNAMIC_CALIBRATION_BATCH if settings.dynamic_batch else settings.batch_size
            calibration = ImageCalibration(self.dataset, settings.calibration_images, batch)
        what = f"{settings.calibration_images} calibration images" if calibration else "dynamic"
        with step(f"quantizing to int8 ({what})"):
            quantized = quantize_onnx_file(
                fp32_path,
                int8_path,
                settings.mode,
                float_scopes=inserted_module_scopes(model),
                calibration=calibration,
            )
        if calibration is not None:  # in-distribution images, where the ranges were set
            calibration.rewind()  # the quantizer read them all
            images = calibration.get_next()["image"]  # type: ignore[index]
        else:
            batch = 1 if settings.dynamic_batch else settings.batch_size
            generator = torch.Generator().manual_seed(1)
            images = torch.randn((batch, *self.loaded.input_size), generator=generator).numpy()
        quantized["check"] = compare_files(fp32_path, int8_path, images)
        return written | {"quantize": quantized}

    def bench(self, timing: ExportTiming) -> dict[str, Any]:
        """The four files timed in onnxruntime, interleaved; speed-ups over the float32 base and
        the int8 compressed file over the int8 base."""
        batch_size = self.settings.batch_size
        files = {
            name: self.paths[name]
            for name in (FP32_BASE, FP32_COMPRESSED, INT8_BASE, INT8_COMPRESSED)
        }
        with step(
            f"timing float32 and int8, base and compressed, in onnxruntime (batch {batch_size})"
        ):
            timed = bench_timed(
                {},
                files,
                self.loaded.input_size,
                FP32_BASE,
                batch_size,
                timing,
                also_paired=[(INT8_COMPRESSED, INT8_BASE)],
            )
        return timed | {"base_quantize": self.base_summary}


def compare_files(fp32_path: Path, int8_path: Path, batch: Any) -> dict[str, Any]:
    """The int8 file against the float32 file it was made from on ``batch`` (a NumPy array: a
    random batch for dynamic quantization, the first calibration batch for static): the
    quantization's error, reported (not a pass/fail: int8 is lossy by request), with the scale
    of the float32 output to read it against."""
    reference = onnx_session(fp32_path).run(None, {"image": batch})[0]
    got = onnx_session(int8_path).run(None, {"image": batch})[0]
    return {
        "max_abs_diff_to_fp32": float(abs(got - reference).max()),
        "fp32_output_scale": float(abs(reference).max()),
        "batch_shape": list(batch.shape),
    }
