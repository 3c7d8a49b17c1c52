"""Blocks the tool cannot reduce at are refused in one line naming the blocker, not with the
generic "no transformer block found" (nor left out of the map): SAM's windowed attention on 3-D
(batch x heads, N, D) tensors written as a matmul and a softmax (its SDPA form is given its
heads axis back at capture and maps: tests/test_windowed_families.py). (Parallel blocks, refused here before, now compress:
tests/test_parallel_blocks.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.test_windowed_families import _sam_vit
from vitcompress import map_model
from vitcompress.analysis.analyse import MappingError

SIZE = (3, 32, 32)


def test_sam_windowed_attention_on_3d_tensors_gets_the_windowed_line():
    torch.manual_seed(0)
    sam = _sam_vit().eval()
    for block in sam.blocks:  # timm's unfused path: q @ k^T and a softmax on 3-D tensors
        block.attn.fused_attn = False
    with pytest.raises(MappingError) as refused:
        map_model(sam, (3, 64, 64))
    assert str(refused.value) == (
        "windowed attention: tokens cannot be dropped without breaking the windows "
        "(blocks.0.attn attends within 4 windows of 16 tokens per image)"
    )
