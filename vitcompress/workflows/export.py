"""``export``: write a model's inference path as ONNX, TorchScript or an ExportedProgram, and check
the written file against PyTorch; ``compile_check``: ``torch.compile(fullgraph=True)`` on it.

Every shape in the exported graph is a constant, the batch dimension included: the input is
``(batch_size, *input_size)``, fixed at export time. A compressed model's token counts are
constants for a fixed input size (``PredictorReducer`` keeps ``keep_tokens``; ``AttentionReducer``
computes ``ceil(rho * n)`` from a token count that only depends on the input size), so a fixed
batch is the one choice left, and it is made explicitly rather than left to the tracer. The check
runs the written file on a fresh input (not the example the graph was traced with), so a top-k
selection baked in as constants would show up as a mismatch.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vitcompress.analysis.capture import fast_paths_off
from vitcompress.artifacts.fingerprint import eval_mode
from vitcompress.data.config import resolve_data_config, stated_data_config
from vitcompress.errors import UserError, one_line
from vitcompress.kernels import method_path
from vitcompress.measure.onnx_eval import preprocessing_props
from vitcompress.measure.onnx_runtime import onnx_session, require_export_extra
from vitcompress.model_copy import copy_model
from vitcompress.torch_output import native_stdout_dropped, partial_graph_print_dropped
from vitcompress.workflows.onnx_file import onnx_op_audit, onnx_static_shapes, onnx_structure
from vitcompress.workflows.onnx_symbolics import onnx_symbolics

FORMATS = ("onnx", "torchscript", "exported-program")
SUFFIXES = {"onnx": ".onnx", "torchscript": ".pt", "exported-program": ".pt2"}
ATOL = 1e-4
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Half precision: the file and PyTorch both compute at the dtype but accumulate and round in
# different orders (onnxruntime's CPU float16 kernels round where PyTorch accumulates in float32),
# and a reducer's top-k may then keep a different token where two scores nearly tie, which moves
# the output by about a percent of its scale (deit_small, eTPS, float16: 1.1%). The tolerance is
# this times max(1, max |PyTorch output|): loose enough for that, far below the tens of percent a
# wrong graph or wrong weights give.
HALF_RTOL = {"float16": 5e-2, "bfloat16": 1e-1}
DEFAULT_OPSET = 17
BATCH_AXIS = "batch"  # the name of the symbolic batch dimension (ONNX dim_param, export Dim)
# With a dynamic batch the graph is traced at this batch (not 1, which torch.export would
# specialise) and checked at two other sizes, 1 included.
DYNAMIC_TRACE_BATCH = 2


class ExportError(UserError):
    """The request cannot be exported as asked (a user error: bad output path, an unsupported
    model output, a model the exporter cannot handle)."""


class ExportCheckError(RuntimeError):
    """The written file does not reproduce PyTorch's output within the tolerance."""


class _Inference(nn.Module):
    """``forward(image) -> logits`` and nothing else: hides optional arguments of the wrapped
    forward (timm's ``attn_mask=None, is_causal=False``), which the TorchScript-based ONNX
    exporter would otherwise turn into graph inputs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        # In eval mode itself: exporters that restore the top module's mode after exporting
        # (``torch.onnx.export`` does, recursively) must not switch the model to training.
        self.eval()

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)


def _inputs(batch_size: int, input_size: tuple[int, ...], seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, *input_size, generator=generator)


def _max_diff(a: Tensor, b: Tensor) -> float:
    """max |a - b|, where equal infinities and NaN in both count as equal, and a NaN in one only
    makes the difference NaN (which no tolerance accepts)."""
    a, b = a.detach().float(), b.detach().float()
    same = (a == b) | (a.isnan() & b.isnan())
    return float(torch.where(same, 0.0, (a - b).abs()).max())


def _finite_scale(t: Tensor) -> float:
    """max |t| over its finite values (0 when it has none): an infinite output must not make
    the half-precision tolerance infinite."""
    values = t.detach().float().abs()
    values = values[values.isfinite()]
    return float(values.max()) if values.numel() else 0.0


def _export_onnx(
    module: nn.Module, example: Tensor, out: Path, opset: int, dynamic_batch: bool
) -> Callable:
    with onnx_symbolics(opset), warnings.catch_warnings(), native_stdout_dropped():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            (example,),
            str(out),
            dynamo=False,
            opset_version=opset,
            input_names=["image"],
            output_names=["logits"],
            dynamic_axes=(
                {"image": {0: BATCH_AXIS}, "logits": {0: BATCH_AXIS}} if dynamic_batch else None
            ),
            do_constant_folding=True,
        )

    def run(x: Tensor) -> Tensor:
        session = onnx_session(out)
        return _from_numpy(session.run(None, {"image": _to_numpy(x)})[0])

    return run


def _to_numpy(x: Tensor) -> Any:
    """``x`` as NumPy, bfloat16 included (NumPy has none; ``ml_dtypes``, an onnx dependency,
    has the type onnxruntime reads)."""
    if x.dtype != torch.bfloat16:
        return x.numpy()
    import ml_dtypes

    return x.float().numpy().astype(ml_dtypes.bfloat16)


def _from_numpy(array: Any) -> Tensor:
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.astype("float32")).to(torch.bfloat16)
    return torch.from_numpy(array)


class _Float32Conv(nn.Module):
    """A convolution run in float32 between casts from and back to the model's dtype.

    ONNX ``Conv`` takes bfloat16 only from opset 22, beyond the TorchScript-based exporter
    (opset 20 at most), so a bfloat16 export keeps its convolutions (the patch embedding, a
    pyramid's reductions) in float32 with float32 weights. PyTorch's bfloat16 convolution also
    accumulates in float32 and rounds its output once, as the cast back does.
    """

    def __init__(self, conv: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.conv = conv.float()
        self.dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x.float()).to(self.dtype)


def _at_dtype(model: nn.Module, dtype: str, float32_convs: bool = False) -> nn.Module:
    """``model`` itself at float32, else a copy at ``dtype`` (the caller's model is not cast),
    with ``float32_convs`` its convolutions in float32 (:class:`_Float32Conv`)."""
    if dtype == "float32":
        return model
    copied = copy_model(model).to(DTYPES[dtype])
    if float32_convs:
        for parent in list(copied.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.modules.conv._ConvNd):
                    setattr(parent, name, _Float32Conv(child, DTYPES[dtype]))
    return copied


def _export_torchscript(module: nn.Module, example: Tensor, out: Path) -> Callable:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(module, example, check_trace=False)
        traced.save(str(out))
        return torch.jit.load(str(out))


def _export_program(module: nn.Module, example: Tensor, out: Path, dynamic_batch: bool) -> Callable:
    dynamic_shapes = {"x": {0: torch.export.Dim(BATCH_AXIS, min=1)}} if dynamic_batch else None
    with partial_graph_print_dropped():
        program = torch.export.export(
            module, (example,), dynamic_shapes=dynamic_shapes, strict=False
        )
    torch.export.save(program, str(out))
    return torch.export.load(str(out)).module()


def export_model(
    model: nn.Module,
    input_size: tuple[int, ...],
    fmt: str,
    out: str | Path,
    batch_size: int = 1,
    opset: int = DEFAULT_OPSET,
    check: bool = True,
    dynamic_batch: bool = False,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Export ``model``'s inference path (eval mode; its mode is restored afterwards) for inputs of
    shape ``(batch_size, *input_size)`` and, with ``check``, run the written file on a fresh input
    and compare with PyTorch (``max_abs_diff``; :class:`ExportCheckError` above ``ATOL``).

    ``fmt``: ``onnx`` (``torch.onnx.export``, TorchScript-based exporter, checked with
    onnxruntime), ``torchscript`` (``torch.jit.trace``), ``exported-program``
    (``torch.export.export`` + ``torch.export.save``, reloaded with ``torch.export.load``).

    ``dynamic_batch``: the batch dimension is symbolic (ONNX ``dynamic_axes``, a ``torch.export``
    ``Dim``; a TorchScript trace reads it at run time anyway); token counts stay constants. The
    graph is traced at batch :data:`DYNAMIC_TRACE_BATCH` and checked at two other batch sizes
    (``checked_batch_sizes``), so a batch baked into the graph shows up as an error or a mismatch
    (:class:`ExportCheckError`). ``batch_size`` is then not used.

    ``dtype`` (``float32``, ``float16``, ``bfloat16``): weights, input and output at that dtype
    (a copy of the model is cast; a bfloat16 ONNX file keeps its convolutions in float32, which
    ONNX has no bfloat16 ``Conv`` for before opset 22). The check compares with PyTorch run at the
    same dtype, within ``HALF_RTOL[dtype] * max(1, max |PyTorch output|)``. Where onnxruntime
    cannot run a half-precision file on the CPU (no kernel for an op at that type), the file is
    checked without running it (:func:`onnx_structure`; ``check: "structural"``, ``checked``
    false, and onnxruntime's error in ``onnxruntime_error``); it fails the export only if the
    file is not valid ONNX at that dtype. Any other onnxruntime error (:func:`missing_kernel`
    tells them apart) fails the export as at float32.

    The file is written and checked at a hidden path beside ``out`` and moved onto ``out`` only
    once the check has passed (:func:`staged_file`): a failed export leaves nothing behind, and a
    file already at ``out`` as it was.
    """
    out = _checked_request(fmt, dtype, batch_size, out)
    input_size = tuple(int(v) for v in input_size)
    trace_batch = DYNAMIC_TRACE_BATCH if dynamic_batch else batch_size
    check_batches = [1, DYNAMIC_TRACE_BATCH + 1] if dynamic_batch else [batch_size]
    example = _inputs(trace_batch, input_size, seed=0).to(DTYPES[dtype])
    start = time.perf_counter()
    # Fast paths off: the exporters have no op for torch's fused nn.MultiheadAttention kernel,
    # which eval mode would take; its decomposed path gives the same numbers.
    with eval_mode(model), method_path(model), torch.no_grad(), fast_paths_off():
        # Copies made here are in eval mode with the method's ops switched on, as the model is.
        float32_convs = fmt == "onnx" and dtype == "bfloat16"
        module = _Inference(_at_dtype(model, dtype, float32_convs))
        # The reference is PyTorch at the dtype throughout, float32 islands or not.
        reference = _Inference(_at_dtype(model, dtype)) if float32_convs else module
        if not isinstance(module(example), Tensor):
            raise ExportError(
                "the model's output is not a single tensor; only image -> tensor "
                "models can be exported"
            )
        # Written and checked beside ``out``, moved onto it only once the check has passed.
        with staged_file(out) as staging:
            try:
                if fmt == "onnx":
                    run = _export_onnx(module, example, staging, opset, dynamic_batch)
                    _record_preprocessing(staging, model, input_size)
                elif fmt == "torchscript":
                    run = _export_torchscript(module, example, staging)
                else:
                    run = _export_program(module, example, staging, dynamic_batch)
            except OSError as e:
                raise ExportError(f"cannot write {out}: {e.strerror or e}") from e
            except Exception as e:
                raise ExportError(f"{fmt} export failed: {one_line(e)}") from e
            seconds = time.perf_counter() - start
            result = _written_file_record(fmt, staging, dtype, opset, seconds)
            result["input_shape"] = [BATCH_AXIS if dynamic_batch else batch_size, *input_size]
            result["batch"] = "dynamic" if dynamic_batch else "fixed"
            if check:
                _check(result, run, reference, fmt, dtype, input_size, check_batches, trace_batch)
    result["out"] = str(out)
    return result


@contextlib.contextmanager
def staged_file(out: Path) -> Iterator[Path]:
    """A hidden path beside ``out`` (the same folder, so the move is a rename) to write and
    check a file at: moved onto ``out`` (``os.replace``) when the block ends without an error,
    removed when it raises. A failed export leaves no file behind and an existing ``out`` as it
    was. The staged name keeps ``out``'s suffix (``torch.export.save`` wants ``.pt2``)."""
    staging = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.partial{out.suffix}")
    try:
        yield staging
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    try:
        os.replace(staging, out)
    except OSError as e:
        staging.unlink(missing_ok=True)
        raise ExportError(f"cannot write {out}: {e.strerror or e}") from e


def _checked_request(fmt: str, dtype: str, batch_size: int, out: str | Path) -> Path:
    """``out`` as a path whose folder exists, once the format, dtype and batch are known ones
    (:class:`ExportError` otherwise, before any work)."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if batch_size < 1:
        raise ExportError(f"batch size must be at least 1, got {batch_size}")
    out = Path(out)
    if out.is_dir():
        raise ExportError(
            f"--out {out} is a directory; give a file such as {out / ('model' + SUFFIXES[fmt])}"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"cannot create {out.parent}: {e.strerror or e}") from e
    if fmt == "onnx":
        require_export_extra("onnx", "onnxruntime")
    return out


def _written_file_record(
    fmt: str, out: Path, dtype: str, opset: int, seconds: float
) -> dict[str, Any]:
    """What export reports of the file it wrote, before the check fills in its fields (an ONNX
    file's opset, static shapes, op audit and, at half precision, its structure)."""
    result: dict[str, Any] = {
        "format": fmt,
        "out": str(out),
        "bytes": out.stat().st_size,
        "export_seconds": round(seconds, 3),
        "checked": False,
        "checked_batch_sizes": [],
        "max_abs_diff": None,
        "atol": ATOL if dtype == "float32" else None,
        "dtype": dtype,
        "rtol": HALF_RTOL.get(dtype),
        "check": None,
    }
    if fmt == "onnx":
        result["opset"] = opset
        result["static_shapes"] = onnx_static_shapes(out)
        result["op_audit"] = onnx_op_audit(out)
        if dtype != "float32":
            result["structure"] = onnx_structure(out, dtype)
    return result


def _record_preprocessing(path: Path, model: nn.Module, input_size: tuple[int, ...]) -> None:
    """Write the data config fields the model states into the ONNX file's ``metadata_props``, so
    that ``eval --model FILE.onnx`` feeds the file what its model expects. Fields it does not
    state are not written, and a model that states none gets no entry: the defaults are not a
    statement, and eval then chooses or asks for them as it does for the model."""
    stated, _ = stated_data_config(model)
    if not stated:
        return
    import onnx

    # Only what the model states: a default recorded here would read as stated, and eval of the
    # file would use it where eval of the model lets the images choose (an unstated crop_pct).
    config = resolve_data_config(model, channels=int(input_size[0])).to_json()
    recorded = {name: value for name, value in config.items() if name in stated}
    onnx_model = onnx.load(str(path))
    for key, value in preprocessing_props(recorded).items():
        entry = onnx_model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(onnx_model, str(path))


def _check(
    result: dict[str, Any],
    run: Callable,
    reference: nn.Module,
    fmt: str,
    dtype: str,
    input_size: tuple[int, ...],
    check_batches: list[int],
    trace_batch: int,
) -> None:
    """Run the written file on fresh inputs and compare with ``reference`` (PyTorch at
    ``dtype``); fill in ``result``'s check fields, or raise :class:`ExportCheckError`."""
    diff = scale = 0.0
    for seed, batch in enumerate(check_batches, start=1):
        fresh = _inputs(batch, input_size, seed=seed).to(DTYPES[dtype])
        try:
            got = run(fresh)
        except Exception as e:
            if fmt == "onnx" and dtype != "float32" and missing_kernel(e):
                # onnxruntime's CPU kernels cover few ops at half precision (bfloat16 hardly
                # any): a runtime's gap, not the file's, so the file is checked as a file. Any
                # other error is the file's, and fails the export as at float32.
                _structural(result, dtype, one_line(e))
                return
            if len(check_batches) == 1 and batch == trace_batch:
                raise
            # A batch read as a constant somewhere in the graph fails here.
            raise ExportCheckError(
                f"the {fmt} file does not run at batch {batch} (traced at "
                f"{trace_batch}): {one_line(e)}"
            ) from e
        expected = reference(fresh)
        batch_diff = _max_diff(got, expected)
        if math.isnan(batch_diff):  # NaN in one output only: no tolerance accepts it
            diff = batch_diff
            break
        diff = max(diff, batch_diff)
        scale = max(scale, _finite_scale(expected))
    atol = ATOL if dtype == "float32" else HALF_RTOL[dtype] * max(1.0, scale)
    result.update(
        checked=True,
        check="onnxruntime" if fmt == "onnx" else "pytorch",
        checked_batch_sizes=check_batches,
        max_abs_diff=diff,
        atol=atol,
    )
    if not diff <= atol:
        by = "with NaN where the other has none" if math.isnan(diff) else f"by {diff:.3g}"
        raise ExportCheckError(
            f"{fmt} output differs from PyTorch{'' if dtype == 'float32' else ' at ' + dtype} "
            f"{by} (tolerance {atol:.3g})"
            + (f" at batch sizes {check_batches}" if len(check_batches) > 1 else "")
        )


def missing_kernel(error: BaseException) -> bool:
    """Whether ``error`` is onnxruntime saying it has no kernel for an op at the file's types
    (status ``NOT_IMPLEMENTED``, "Could not find an implementation for ..."), rather than that
    the file is wrong (a shape mismatch, an invalid graph) or failed at run time."""
    text = str(error)
    return (
        type(error).__name__ == "NotImplemented"  # onnxruntime's class for NOT_IMPLEMENTED
        or "NOT_IMPLEMENTED" in text
        or "Could not find an implementation" in text
    )


def _structural(result: dict[str, Any], dtype: str, runtime_error: str) -> None:
    """The check of a file onnxruntime could not run: :func:`onnx_structure`'s."""
    structure = result.get("structure") or onnx_structure(result["out"], dtype)
    result.update(check="structural", onnxruntime_error=runtime_error, structure=structure)
    if not structure["passed"]:
        raise ExportCheckError(
            f"the {dtype} ONNX file cannot be run by onnxruntime on the CPU ({runtime_error}) "
            f"and is not valid ONNX at {dtype}: "
            + (
                structure["error"]
                or f"input {structure['input_dtype']}, output {structure['output_dtype']}"
            )
        )


def _reset_dynamo() -> None:
    """``torch._dynamo.reset()``, once more where it fails with "dictionary changed size during
    iteration": with torch 2.14, after a graph break in an earlier compile of the same process, a
    cached inductor backend's reset can add to the backend cache that reset is iterating; the
    second pass finds it consistent."""
    import torch._dynamo

    try:
        torch._dynamo.reset()
    except RuntimeError as e:
        if "changed size during iteration" not in str(e):
            raise
        torch._dynamo.reset()


def compile_check(
    model: nn.Module,
    input_size: tuple[int, ...],
    batch_size: int = 2,
    backend: str = "eager",
    mode: str | None = None,
) -> dict[str, Any]:
    """``torch.compile(model, fullgraph=True)`` in eval mode, run on two batches of the same size.

    Reports ``graph_break`` (fullgraph raises on the first one; its reason is kept), ``frames``
    (graphs dynamo compiled, from ``torch._dynamo.utils.counters``), ``recompiles`` (frames beyond
    the first; 0 means the second batch reused the first graph) and ``max_abs_diff`` to eager.
    ``backend="eager"`` checks capture only (dynamo's part: breaks and guards); ``"inductor"``
    also generates code, which on CPU needs a C++ compiler and takes far longer. ``mode``
    (inductor only): torch.compile's mode, ``reduce-overhead`` for CUDA graphs, which inductor
    uses on CUDA only (on the CPU it compiles as the default mode). Shapes are static
    (``dynamic=False``): one graph per batch size, as a CUDA graph needs.
    """
    import torch._dynamo
    from torch._dynamo.utils import counters

    batches = [_inputs(batch_size, tuple(input_size), seed=s) for s in (1, 2)]
    result: dict[str, Any] = {
        "backend": backend,
        "mode": mode if backend == "inductor" else None,
        "fullgraph": True,
        "graph_break": False,
        "reason": None,
        "frames": 0,
        "recompiles": 0,
        "max_abs_diff": None,
    }
    _reset_dynamo()
    counters.clear()
    with eval_mode(model), torch.no_grad():
        module = _Inference(model)
        options = {"mode": mode} if mode and backend == "inductor" else {}
        compiled = torch.compile(module, fullgraph=True, backend=backend, dynamic=False, **options)
        try:
            outputs = [compiled(x) for x in batches]
        except Exception as e:  # dynamo raises on a graph break under fullgraph
            result.update(graph_break=True, reason=one_line(e))
        else:
            result["max_abs_diff"] = max(
                _max_diff(o, module(x)) for o, x in zip(outputs, batches, strict=True)
            )
        frames = int(counters["stats"]["unique_graphs"])
        result.update(frames=frames, recompiles=max(0, frames - 1))
    _reset_dynamo()
    return result
