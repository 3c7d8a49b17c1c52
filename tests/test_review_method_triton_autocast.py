"""The ops' CUDA implementations (the Triton kernels) run their batched product outside the
caller's autocast, as the CPU kernels do: a custom op's kernel sees the caller's autocast, which
would hand the kernels a half-precision similarity product, while the method computes its
similarities in float32 under autocast too. Run on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``) and CPU autocast, through the functions registered for CUDA."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from tests.triton_interpreted import KERNELS, interpreted_module
from vitcompress.kernels import ops
from vitcompress.kernels.ops import select_squeeze_reference, tome_merge_reference


@pytest.fixture(scope="module")
def select_module() -> Iterator[ModuleType]:
    yield from interpreted_module(
        KERNELS / "triton_select_squeeze.py",
        "_interpreted_select_squeeze_autocast",
        lambda module: module.select_squeeze_triton(
            torch.randn(1, 3, 4), torch.randn(1, 3), 0, 2, True
        ),
    )


@pytest.fixture(scope="module")
def merge_module() -> Iterator[ModuleType]:
    yield from interpreted_module(
        KERNELS / "triton_tome_merge.py",
        "_interpreted_tome_merge_autocast",
        lambda module: module.tome_merge_triton(
            torch.randn(1, 5, 4), torch.randn(1, 5, 3), None, 1, 1
        ),
    )


def _clustered() -> torch.Tensor:
    """(2, 1 + 40, 64) tokens around a few centres: each donor's host is clear-cut."""
    generator = torch.Generator().manual_seed(1)
    centres = 10 * torch.randn(2, 5, 64, generator=generator)
    which = torch.randint(0, 5, (41,), generator=generator)
    return centres[:, which] + 0.3 * torch.randn(2, 41, 64, generator=generator)


def test_select_squeeze_for_cuda_runs_its_product_outside_autocast(
    select_module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vitcompress.kernels.triton_select_squeeze", select_module)
    x, scores = _clustered(), torch.randn(2, 40, generator=torch.Generator().manual_seed(2))
    want_tokens, want_index = select_squeeze_reference(x, scores, 1, 28, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tokens, keep_index = ops._select_squeeze_cuda(x, scores, 1, 28, True)
        assert torch.is_autocast_enabled("cpu")  # the caller's autocast is back afterwards
    assert torch.equal(keep_index, want_index)
    torch.testing.assert_close(tokens, want_tokens, atol=1e-5, rtol=1e-5)


def test_tome_merge_for_cuda_runs_its_product_outside_autocast(
    merge_module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vitcompress.kernels.triton_tome_merge", merge_module)
    x = _clustered()
    metric = x @ torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    want_tokens, want_sizes, want_index = tome_merge_reference(x, metric, None, 12, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tokens, sizes, index = ops._tome_merge_cuda(x, metric, None, 12, 1)
    assert torch.equal(index, want_index) and torch.equal(sizes, want_sizes)
    torch.testing.assert_close(tokens, want_tokens, atol=1e-5, rtol=1e-5)
