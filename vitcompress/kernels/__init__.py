"""Fused kernels: compiled C++ (CPU) and Triton (CUDA) versions of method compositions.

The default eval path on the CPU wherever the extensions build (:func:`kernel_runs`): the first
use builds them with the machine's C++ compiler and ninja (about a minute, cached afterwards under
torch's extensions directory); where they cannot be built the method's ops run, with the same
results. Each kernel is registered as a ``torch.library`` custom op with a fake implementation,
so ``torch.compile(fullgraph=True)`` keeps it as one call. Both ops have a CUDA implementation
in Triton too (``triton_select_squeeze.py``, ``triton_tome_merge.py``): the default on CUDA where
it squeezes or merges (dTPS, eTPS, ToMe; faster than the method's ops there), else where a
reducer's switch is on.
"""

from vitcompress.kernels.ops import (
    FusedKernelError,
    build_fused_kernels,
    enable_fused_kernels,
    fused_kernels_available,
    kernel_runs,
    method_path,
    select_squeeze,
    select_squeeze_reference,
    tome_merge,
    tome_merge_reference,
    triton_available,
)

__all__ = [
    "FusedKernelError",
    "build_fused_kernels",
    "enable_fused_kernels",
    "fused_kernels_available",
    "kernel_runs",
    "method_path",
    "select_squeeze",
    "select_squeeze_reference",
    "tome_merge",
    "tome_merge_reference",
    "triton_available",
]
