"""``vitcompress::select_squeeze``: top-k -> gather -> squeeze as one op (TPS at inference, CPU).

:func:`select_squeeze_reference` is the same computation from the method's functions; the kernel
must equal it. The kernel serves inference only: it has no backward, and training keeps the
method's path (dTPS trains on masks, eTPS needs the gradients of its gathers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn

from vitcompress.errors import UserError
from vitcompress.method import gather_tokens, split_by_score, squeeze

_SOURCE = Path(__file__).resolve().parent / "csrc" / "select_squeeze.cpp"


class FusedKernelError(RuntimeError, UserError):
    """The fused kernels cannot be built or used here (a user error: one line)."""


# The built extension, or the error its build raised: either way the build is tried once per
# process (a failed build takes as long as a good one).
_built: dict[str, ModuleType | FusedKernelError] = {}


def _extension() -> ModuleType:
    if "extension" not in _built:
        from torch.utils.cpp_extension import load

        try:
            _built["extension"] = load(
                name="vitcompress_select_squeeze",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3"],
                verbose=False,
            )
        except Exception as error:  # noqa: BLE001 - a compiler's failure has many types
            text = str(error).strip()
            first = text.splitlines()[0] if text else type(error).__name__
            _built["extension"] = FusedKernelError(
                f"the fused kernels could not be built (they need a C++ compiler and ninja): "
                f"{first}"
            )
    built = _built["extension"]
    if isinstance(built, FusedKernelError):
        raise built
    return built


def build_fused_kernels() -> None:
    """Build the extension now (about a minute the first time; cached on disk afterwards), so
    that a machine that cannot build it fails here, in one line (:class:`FusedKernelError`)."""
    _extension()


def fused_kernels_available() -> bool:
    """Whether the extension builds (or is built) here."""
    try:
        _extension()
    except FusedKernelError:
        return False
    return True


@torch.library.custom_op("vitcompress::select_squeeze", mutates_args=())
def _select_squeeze_op(
    x: Tensor, scores: Tensor, prefix_tokens: int, keep_tokens: int, squeeze: bool
) -> tuple[Tensor, Tensor]:
    tokens, keep_index = _extension().select_squeeze(x, scores, prefix_tokens, keep_tokens, squeeze)
    return tokens, keep_index


@_select_squeeze_op.register_fake
def _(
    x: Tensor, scores: Tensor, prefix_tokens: int, keep_tokens: int, squeeze: bool
) -> tuple[Tensor, Tensor]:
    batch, _, channels = x.shape
    return (
        x.new_empty(batch, prefix_tokens + keep_tokens, channels),
        x.new_empty(batch, keep_tokens, dtype=torch.long),
    )


def select_squeeze(
    x: Tensor, scores: Tensor, prefix_tokens: int, keep_tokens: int, squeeze: bool = True
) -> tuple[Tensor, Tensor]:
    """Keep the ``keep_tokens`` best-scored of ``x``'s non-prefix tokens; with ``squeeze``, fuse
    the rest into them. Returns ``(tokens (B, P + K, C), keep_index (B, K))``, as the reference."""
    if x.device.type != "cpu":
        raise FusedKernelError(f"the fused kernels run on the CPU only, not on {x.device}")
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


def enable_fused_kernels(model: nn.Module, enabled: bool = True) -> int:
    """Let the model's dTPS/DynamicViT/eTPS reducers use the fused kernel at inference.

    Builds the kernel first, so a machine that cannot build it fails here, in one line, and not
    in the middle of a forward. Returns how many reducers were switched. Training and autograd
    still take the method's path; a model on another device is refused at its first forward.
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
    the custom op has no ONNX or ``torch.export`` form); the switches are restored afterwards."""
    switched = [m for m in model.modules() if getattr(m, "fused_kernel", False)]
    for module in switched:
        module.fused_kernel = False
    try:
        yield
    finally:
        for module in switched:
            module.fused_kernel = True
