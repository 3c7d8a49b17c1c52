"""benchmarks/compiled_kernels.py: the kernel count of a compiled forward, read from inductor's
generated code, on a model whose kernels are known."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from tests.benchmark_scripts import benchmark_script

pytestmark = pytest.mark.usefixtures("one_thread")


# The shape of inductor's CPU wrapper: kernel calls, library calls and a fallback op in ``call``;
# comments, aliases, allocations and a kernel's definition are not calls.
GENERATED = '''
cpp_fused_gelu_0 = async_compile.cpp_pybinding(['float*'], r"""
extern "C" void kernel(float* in_out_ptr0) {}
""")

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def call(self, args):
        arg0_1, arg1_1, arg2_1 = args
        args.clear()
        buf0 = empty_strided_cpu((2, 8), (8, 1), torch.float32)
        # Original ATen: [aten.addmm, aten.sort]
        extern_kernels.addmm(arg1_1, arg2_1, reinterpret_tensor(arg0_1, (8, 8), (1, 8), 0), out=buf0)
        cpp_fused_gelu_0(buf0)
        buf1 = torch.ops.aten.sort.stable(buf0, stable=True, dim=-1)
        buf2 = buf1[0]
        assert_tensor_metadata(buf2, (2, 8), (8, 1), torch.float32, 'torch.ops.aten.sort.stable')
        cpp_fused_mul_1(buf2)
        buf3 = torch.ops.vitcompress.select_squeeze.default(buf2, buf0, 1, 4, True)
        return (buf2, )

runner = Runner(partitions=[])
call = runner.call


def get_args():
    cpp_fused_gelu_0(rand_strided((2, 8), (8, 1), device="cpu"))
    return [extern_kernels.mm(a, b) for a, b in pairs]
'''


def test_count_calls_reads_only_the_call_function() -> None:
    counted = benchmark_script("compiled_kernels").count_calls(GENERATED)
    assert counted["cpp_calls"] == 2
    assert dict(counted["extern"]) == {
        "extern_kernels.addmm": 1,
        "aten.sort": 1,
        "vitcompress.select_squeeze": 1,
    }


# The shape of inductor's CUDA wrapper: Triton launches by name under a device guard.
GENERATED_CUDA = """
triton_poi_fused_cat_0 = async_compile.triton('triton_poi_fused_cat_0', '''
@triton.jit
def triton_poi_fused_cat_0(in_ptr0, out_ptr0, xnumel, XBLOCK: tl.constexpr):
    pass
''', device_str='cuda')

def call(args):
    arg0_1, arg1_1 = args
    args.clear()
    with torch.cuda._DeviceGuard(0):
        torch.cuda.set_device(0)
        buf0 = empty_strided_cuda((1, 197, 384), (75648, 384, 1), torch.float32)
        # Topologically Sorted Source Nodes: [cat]
        stream0 = get_raw_stream(0)
        triton_poi_fused_cat_0.run(arg0_1, buf0, 75648, stream=stream0)
        extern_kernels.mm(buf0, arg1_1, out=buf1)
        triton_per_fused_native_layer_norm_1.run(buf1, buf2, 197, 384, stream=stream0)
        buf3 = torch.ops.aten._scaled_dot_product_flash_attention.default(buf2, buf2, buf2)
    return (buf3, )


def benchmark_compiled_module(times=10, repeat=10):
    triton_poi_fused_cat_0.run(a, b, 1, stream=stream0)
"""


def test_count_calls_counts_triton_launches_in_cuda_code() -> None:
    counted = benchmark_script("compiled_kernels").count_calls(GENERATED_CUDA)
    assert (counted["cpp_calls"], counted["triton_calls"]) == (0, 2)
    assert dict(counted["extern"]) == {
        "extern_kernels.mm": 1,
        "aten._scaled_dot_product_flash_attention": 1,
    }


class _Known(nn.Module):
    """Linear, GELU, Linear, LayerNorm, sort, scale: two matmuls and a sort that inductor calls
    as library kernels, and three pointwise/reduction stretches between them that it generates
    (GELU; the layer norm; the scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.fc2(nn.functional.gelu(self.fc1(x))))
        return y.sort(dim=-1, stable=True).values * 2.0


def test_compiled_counts_on_a_model_of_known_kernels(tmp_path: Path, monkeypatch) -> None:
    benchmark = benchmark_script("compiled_kernels")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    record = benchmark.compiled_counts(_Known().eval(), torch.randn(4, 8), tmp_path / "code")
    assert record["graphs"] == 1
    assert record["extern_names"] == {"aten.sort": 1, "extern_kernels.addmm": 2}
    assert record["extern_calls"] == 3
    assert record["cpp_calls"] == 3
    # GELU, the layer norm (its statistics and output one outer-loop group), the scale
    assert (record["node_groups"], record["outer_loop_fused"]) == (3, 1)
    assert record["kernels"] == 6
    assert record["kernels_cpu"] == 6
    assert not record["custom_op_compiled"]
    assert (tmp_path / "code_0.py").read_text().count("extern_kernels.addmm(") == 2
