"""Fused kernels: compiled C++ versions of method compositions, for serving on the CPU.

Optional and off by default: the first use builds the extension with the machine's C++ compiler
(about a minute, cached afterwards under torch's extensions directory). Each kernel is registered
as a ``torch.library`` custom op, so ``torch.compile(fullgraph=True)`` keeps it as one call.
"""

from vitcompress.kernels.ops import (
    FusedKernelError,
    build_fused_kernels,
    enable_fused_kernels,
    fused_kernels_available,
    method_path,
    select_squeeze,
    select_squeeze_reference,
)

__all__ = [
    "FusedKernelError",
    "build_fused_kernels",
    "enable_fused_kernels",
    "fused_kernels_available",
    "method_path",
    "select_squeeze",
    "select_squeeze_reference",
]
