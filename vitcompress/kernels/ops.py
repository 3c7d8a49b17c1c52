"""The fused ops: ``vitcompress::select_squeeze`` (select -> gather -> squeeze, dTPS, eTPS and
DynamicViT) and ``vitcompress::tome_merge`` (ToMe's matching and merge), each one C++ kernel on
the CPU at inference; both also have a CUDA implementation in Triton
(``kernels/triton_select_squeeze.py``, ``kernels/triton_tome_merge.py``, each imported on its
op's first CUDA call only).

:func:`select_squeeze_reference` and :func:`tome_merge_reference` are the same computations from
the method's functions; the kernels must equal them. The kernels serve inference only: they have
no backward, and training keeps the method's path (dTPS trains on masks, eTPS and ToMe need the
gradients of their gathers and sums).

Which path a reducer takes is its switch (``fused_kernel``): ``True`` (:func:`enable_fused_kernels`)
always the kernel when autograd does not record, ``False`` always the method's ops, ``None`` (the
default) the kernel where it can serve (:func:`kernel_runs`): outside autograd and outside a
compiler's or an exporter's trace, on the CPU once the extension is built here, and on CUDA
(Triton installed) where the op says it is faster there. Timed on an H200 (run 8 in
docs/results-speed-gpu.md), the Triton squeeze and ToMe merge ran 1.44-1.59x faster than the
method's ops, selection without a squeeze (DynamicViT) 0.68-0.91x: so the CUDA default is the
kernel for dTPS, eTPS and ToMe, and the method's ops for DynamicViT.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import register_flop_formula

from vitcompress.errors import UserError
from vitcompress.method import (
    bipartite_soft_matching,
    gather_tokens,
    merge_count,
    merge_tokens,
    split_by_score,
    squeeze,
)
from vitcompress.status import quiet_logger, step, warn

_SOURCES = Path(__file__).resolve().parent / "csrc"
# extension name -> its source (one extension each: a change to one rebuilds only that one)
_EXTENSIONS = {
    "vitcompress_select_squeeze": _SOURCES / "select_squeeze.cpp",
    "vitcompress_tome_merge": _SOURCES / "tome_merge.cpp",
}
# Included by both sources. cpp_extension rebuilds when a source it is given changes, not a header
# it includes: each build's name carries a hash of its source and the headers (_build_name).
_HEADERS = (_SOURCES / "norm.h",)


def _build_name(name: str) -> str:
    """``name`` with the first 10 hex digits of the SHA-256 of its source and the shared headers:
    an edit of either gives another name, which cpp_extension builds afresh."""
    digest = hashlib.sha256()
    for path in (_EXTENSIONS[name], *_HEADERS):
        digest.update(path.read_bytes())
    return f"{name}_{digest.hexdigest()[:10]}"


class FusedKernelError(RuntimeError, UserError):
    """The fused kernels cannot be built or used here (a user error: one line)."""


# Each built extension, or the error its build raised: either way a build is tried once per
# process (a failed build takes as long as a good one).
_built: dict[str, ModuleType | FusedKernelError] = {}


# Importing ``torch.utils.cpp_extension`` on a machine without a CUDA runtime logs "No CUDA
# runtime is found": true and beside the point for a CPU kernel, and it would land on every
# command's stderr (JSON readers included) now that the kernels are the default path.
_CPP_EXTENSION_LOGGER = "torch.utils.cpp_extension"


def _extension(name: str = "vitcompress_select_squeeze") -> ModuleType:
    if name not in _built:
        try:
            with quiet_logger(_CPP_EXTENSION_LOGGER):
                from torch.utils.cpp_extension import load
            # The first build on a machine takes about a minute (cached on disk afterwards): said
            # as a step, so that a command does not seem to hang at its first forward.
            with step(_building_or_loading(name)):
                _built[name] = load(
                    name=_build_name(name),
                    sources=[str(_EXTENSIONS[name])],
                    extra_include_paths=[str(_SOURCES)],
                    extra_cflags=["-O3"],
                    verbose=False,
                )
        except Exception as error:  # noqa: BLE001 - a compiler's failure has many types
            text = str(error).strip()
            first = text.splitlines()[0] if text else type(error).__name__
            _built[name] = FusedKernelError(
                f"the fused kernels could not be built (they need a C++ compiler and ninja): "
                f"{first}"
            )
    built = _built[name]
    if isinstance(built, FusedKernelError):
        raise built
    return built


def _building_or_loading(name: str) -> str:
    """The step's words: a build where torch's cache has no library of this source yet, else a
    load (a second of work, which "building" would misstate on every command)."""
    building = f"building the fused CPU kernel {name} (once per machine)"
    try:
        with quiet_logger(_CPP_EXTENSION_LOGGER):
            from torch.utils.cpp_extension import _get_build_directory
        build_name = _build_name(name)
        library = Path(_get_build_directory(build_name, verbose=False)) / f"{build_name}.so"
    except Exception:  # noqa: BLE001 - a private helper of torch's: when it moves, say "building"
        return building
    return f"loading the fused CPU kernel {name}" if library.is_file() else building


def build_fused_kernels() -> None:
    """Build the extensions now (about a minute each the first time; cached on disk afterwards),
    so that a machine that cannot build them fails here, in one line (:class:`FusedKernelError`)."""
    for name in _EXTENSIONS:
        _extension(name)


def fused_kernels_available() -> bool:
    """Whether the extensions build (or are built) here."""
    try:
        build_fused_kernels()
    except FusedKernelError:
        return False
    return True


def _tracing() -> bool:
    """Whether a compiler, an exporter or ``torch.fx`` traces the forward now: the default path
    is then the method's (no build inside a trace, and exporters have no form for the ops)."""
    return (
        torch.compiler.is_compiling()
        or torch.compiler.is_exporting()
        or torch.onnx.is_in_onnx_export()
        or torch.jit.is_tracing()
        or torch.fx._symbolic_trace.is_fx_symbolic_tracing()
    )


# The kernels compute in float32 and return the tokens' dtype: exact for these, where the method
# computes in float32 too; a float64 model keeps the method's ops, which keep what they gather
# (and a kept token) in float64.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_runs(setting: bool | None, x: Tensor, cuda_default: bool = False) -> bool:
    """Whether a reducer whose switch is ``setting`` runs its fused op on ``x`` (at inference;
    the reducer has checked training, recording and restores). ``True``: whenever autograd does
    not record ``x`` (another device is refused by the op, in one line). ``None``: where the
    kernel serves: float32 or half-precision tokens outside autograd and any trace, on the CPU
    with the extensions built here, on CUDA with Triton installed where the op is faster than
    the method's ops there (``cuda_default``, the op's own measured answer) and deterministic
    algorithms are not asked for (``torch.use_deterministic_algorithms``: the kernels' atomic
    sums are not, the method's ops then are)."""
    if setting is False:
        return False
    if setting is True:
        return not x.requires_grad
    if _tracing() or x.requires_grad or x.dtype not in _KERNEL_DTYPES:
        return False
    if x.device.type == "cuda":
        # The Triton kernels add with atomics in no fixed order; the method's scatter_add is
        # deterministic on CUDA where torch.use_deterministic_algorithms asks for it.
        deterministic = torch.are_deterministic_algorithms_enabled()
        return cuda_default and not deterministic and triton_serves(x.device)
    return x.device.type == "cpu" and fused_kernels_available()


# ---------------------------------------------------------------------------------------------
# vitcompress::select_squeeze


def _without_autocast(device_type: str = "cpu") -> contextlib.AbstractContextManager:
    """The kernels' ATen calls (their batched products) outside autocast on ``device_type``: a
    custom op's kernel sees the caller's autocast, which would cast the float32 product they read
    to half precision (an error where the C++ kernel reads it as float; on CUDA, hosts and merges
    chosen on half-precision similarities), and the method computes its similarities in float32
    under autocast too."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


@torch.library.custom_op("vitcompress::select_squeeze", mutates_args=())
def _select_squeeze_op(
    x: Tensor, scores: Tensor, prefix_tokens: int, keep_tokens: int, squeeze: bool
) -> tuple[Tensor, Tensor]:
    with _without_autocast():
        return tuple(_extension().select_squeeze(x, scores, prefix_tokens, keep_tokens, squeeze))


@_select_squeeze_op.register_kernel("cuda")
def _select_squeeze_cuda(
    x: Tensor, scores: Tensor, prefix_tokens: int, keep_tokens: int, squeeze: bool
) -> tuple[Tensor, Tensor]:
    # Imported here: a CPU-only install never imports Triton for the kernels.
    from vitcompress.kernels.triton_select_squeeze import select_squeeze_triton

    with _without_autocast(x.device.type):
        return select_squeeze_triton(x, scores, prefix_tokens, keep_tokens, squeeze)


def triton_available() -> bool:
    """Whether Triton is installed (found, not imported): the ops' CUDA kernels."""
    return importlib.util.find_spec("triton") is not None


# CUDA device index -> whether the Triton kernels compiled and ran there (tried once).
_triton_served: dict[int | None, bool] = {}


def triton_serves(device: torch.device) -> bool:
    """Whether the Triton kernels run on ``device`` (CUDA): tried once per device on tiny
    tensors, each op once. Installed is not enough for a default: Triton compiles its launcher
    with the machine's C compiler, and a GPU may lack what a kernel uses; where either fails the
    methods' own ops run instead, with one warning. Not tried while a CUDA graph is being
    captured (it would synchronise): the method's ops are captured then."""
    if device.index in _triton_served:
        return _triton_served[device.index]
    if not triton_available():
        return False
    try:
        if torch.cuda.is_current_stream_capturing():
            return False  # not cached: tried at the next call outside the capture
        with torch.no_grad(), _without_autocast("cuda"):
            tokens = torch.randn(1, 6, 8, device=device)
            select_squeeze(tokens, torch.randn(1, 5, device=device), 1, 2, True)
            tome_merge(tokens, tokens, None, 2, 1)
            torch.cuda.synchronize(device)
        served = True
    except Exception as error:  # noqa: BLE001 - any failure: the methods' ops serve instead
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        warn(
            f"the fused Triton kernels do not run on {device} ({type(error).__name__}: {first}); "
            "dTPS, eTPS and ToMe run their own ops there instead"
        )
        served = False
    _triton_served[device.index] = served
    return served


@_select_squeeze_op.register_fake
def _(
    x: Tensor, scores: Tensor, prefix_tokens: int, keep_tokens: int, squeeze: bool
) -> tuple[Tensor, Tensor]:
    batch, _, channels = x.shape
    return (
        x.new_empty(batch, prefix_tokens + keep_tokens, channels),
        x.new_empty(batch, keep_tokens, dtype=torch.long),
    )


@register_flop_formula(torch.ops.vitcompress.select_squeeze)
def _select_squeeze_flops(
    x_shape, scores_shape, prefix_tokens, keep_tokens, squeeze, *args, out_shape=None, **kwargs
) -> int:
    """The method's one counted product: each pruned token against each kept one (2 per MAC)."""
    batch, tokens, channels = x_shape
    pruned = tokens - prefix_tokens - keep_tokens
    return 2 * batch * pruned * keep_tokens * channels if squeeze and pruned > 0 else 0


def select_squeeze(
    x: Tensor, scores: Tensor, prefix_tokens: int, keep_tokens: int, squeeze: bool = True
) -> tuple[Tensor, Tensor]:
    """Keep the ``keep_tokens`` best-scored of ``x``'s non-prefix tokens; with ``squeeze``, fuse
    the rest into them. Returns ``(tokens (B, P + K, C), keep_index (B, K))``, as the reference.
    On the CPU the C++ kernel, on CUDA the Triton one (where Triton is installed)."""
    if x.device.type != "cpu" and not (x.device.type == "cuda" and triton_available()):
        raise FusedKernelError(
            f"select_squeeze runs on the CPU only, or on CUDA with Triton installed; not on "
            f"{x.device}"
        )
    if not 0 <= prefix_tokens <= x.shape[1]:
        raise ValueError(f"prefix_tokens must be in 0..{x.shape[1]}, got {prefix_tokens}")
    # The scores only choose indices (no gradient reaches them in the method either); detached,
    # a trainable predictor's output cannot carry autograd into an op that has no backward.
    return _select_squeeze_op(x, scores.detach(), prefix_tokens, keep_tokens, squeeze)


def select_squeeze_reference(
    x: Tensor, scores: Tensor, prefix_tokens: int, keep_tokens: int, squeeze: bool = True
) -> tuple[Tensor, Tensor]:
    """:func:`select_squeeze` composed from the method's functions (what the reducers run)."""
    prefix, patches = x[:, :prefix_tokens], x[:, prefix_tokens:]
    keep_index, prune_index = split_by_score(scores, keep_tokens)
    kept = gather_tokens(patches, keep_index)
    if not squeeze:
        return torch.cat([prefix, kept], dim=1), keep_index
    return _squeeze(kept, gather_tokens(patches, prune_index), prefix), keep_index


_squeeze = squeeze  # the parameter named ``squeeze`` shadows the method's function above


# ---------------------------------------------------------------------------------------------
# vitcompress::tome_merge


@torch.library.custom_op("vitcompress::tome_merge", mutates_args=())
def _tome_merge_op(
    x: Tensor, metric: Tensor, sizes: Tensor | None, r: int, protected: int
) -> tuple[Tensor, Tensor, Tensor]:
    with _without_autocast():
        return tuple(
            _extension("vitcompress_tome_merge").tome_merge(x, metric, sizes, r, protected)
        )


@_tome_merge_op.register_kernel("cuda")
def _tome_merge_cuda(
    x: Tensor, metric: Tensor, sizes: Tensor | None, r: int, protected: int
) -> tuple[Tensor, Tensor, Tensor]:
    # Imported here: a CPU-only install never imports Triton for the kernels.
    from vitcompress.kernels.triton_tome_merge import tome_merge_triton

    with _without_autocast(x.device.type):
        return tome_merge_triton(x, metric, sizes, r, protected)


@_tome_merge_op.register_fake
def _(
    x: Tensor, metric: Tensor, sizes: Tensor | None, r: int, protected: int
) -> tuple[Tensor, Tensor, Tensor]:
    batch, tokens, channels = x.shape
    return (
        x.new_empty(batch, tokens - r, channels),
        x.new_empty(batch, tokens - r, dtype=torch.float32),
        x.new_empty(batch, tokens - r, dtype=torch.long),
    )


@register_flop_formula(torch.ops.vitcompress.tome_merge)
def _tome_merge_flops(
    x_shape, metric_shape, sizes_shape, r, protected, *args, out_shape=None, **kwargs
) -> int:
    """The method's one counted product: the even tokens' metric against the odd ones'."""
    batch, tokens, width = metric_shape
    return 2 * batch * ((tokens + 1) // 2) * (tokens // 2) * width


def tome_merge(
    x: Tensor, metric: Tensor, sizes: Tensor | None, r: int, protected: int = 0
) -> tuple[Tensor, Tensor, Tensor] | None:
    """ToMe's step on ``x`` (B, t, C) by ``metric`` (B, t, D), ``sizes`` (B, t) or ``None`` (all
    1): ``(tokens, sizes, index)`` as :func:`tome_merge_reference`; ``None`` where the clamped
    ``r`` merges nothing (the tokens pass as they came). On the CPU the C++ kernel, on CUDA the
    Triton one (where Triton is installed)."""
    if x.device.type != "cpu" and not (x.device.type == "cuda" and triton_available()):
        raise FusedKernelError(
            f"tome_merge runs on the CPU only, or on CUDA with Triton installed; not on {x.device}"
        )
    r = merge_count(x.shape[1], r, protected)
    if r == 0 or x.shape[1] < 2:
        return None
    sizes = None if sizes is None else sizes.detach()
    return _tome_merge_op(x, metric.detach(), sizes, r, protected)


def tome_merge_reference(
    x: Tensor, metric: Tensor, sizes: Tensor | None, r: int, protected: int = 0
) -> tuple[Tensor, Tensor, Tensor] | None:
    """:func:`tome_merge` composed from the method's functions (what ``MergeReducer`` runs)."""
    matching = bipartite_soft_matching(metric, r, protected)
    if matching.src.shape[1] == 0:
        return None
    if sizes is None:
        sizes = x.new_ones(x.shape[:2], dtype=torch.float32)
    return merge_tokens(x, sizes, matching)


# ---------------------------------------------------------------------------------------------
# The switch


def enable_fused_kernels(model: nn.Module, enabled: bool | None = True) -> int:
    """Set the fused-kernel switch of the model's dTPS/DynamicViT/eTPS/ToMe reducers.

    ``True`` builds the kernels first, so a machine that cannot build them fails here, in one
    line, and not in the middle of a forward; ``False`` keeps the method's ops; ``None`` is the
    default (the kernel where it serves, :func:`kernel_runs`). Returns how many reducers were
    switched. Training and autograd take the method's path whatever the switch.
    """
    if enabled:
        build_fused_kernels()
    switched = 0
    for module in model.modules():
        if getattr(module, "supports_fused_kernel", False):
            module.fused_kernel = enabled
            switched += 1
    return switched


@contextlib.contextmanager
def method_path(model: nn.Module) -> Iterator[None]:
    """Within the block, every reducer of ``model`` runs the method's ops (export traces them;
    the custom ops have no ONNX or ``torch.export`` form); the switches are restored afterwards."""
    switched = [
        (module, module.fused_kernel)
        for module in model.modules()
        if getattr(module, "supports_fused_kernel", False)
    ]
    for module, _ in switched:
        module.fused_kernel = False
    try:
        yield
    finally:
        for module, setting in switched:
            module.fused_kernel = setting
