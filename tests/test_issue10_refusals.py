"""Blocks the tool cannot reduce at are refused in one line naming the blocker, not with the
generic "no transformer block found" (nor left out of the map): parallel attention+MLP on one
residual, parallel attentions; SAM's windowed attention on 3-D (batch x heads, N, D) tensors."""

from __future__ import annotations

import pytest
import timm
import torch

from tests.fixtures import issue10
from tests.models import timm_small
from vitcompress import map_model
from vitcompress.graph.analyse import MappingError

SIZE = (3, 32, 32)


@pytest.mark.parametrize(
    "factory, blocker",
    [
        (issue10.parallel_vit, "its attention is not followed by an MLP residual"),
        (
            issue10.two_attentions_vit,
            "2 attention cores (blocks.0.attns.0, blocks.0.attns.1) are added to one residual",
        ),
        (lambda: timm_small("vit_small_patch16_18x2_224"), "2 attention cores"),
        (lambda: timm_small("vit_pwee_patch16_reg1_gap_256"), "not followed by an MLP residual"),
    ],
)
def test_parallel_blocks_are_refused_naming_the_blocker(factory, blocker):
    with pytest.raises(MappingError) as refused:
        map_model(factory().eval(), SIZE)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("parallel block at blocks.0 ")
    assert blocker in message and "no transformer block found" not in message


def test_sam_windowed_attention_on_3d_tensors_gets_the_windowed_line():
    torch.manual_seed(0)
    sam = timm.create_model(
        "samvit_base_patch16",
        img_size=64,
        patch_size=8,
        window_size=4,
        depth=2,
        embed_dim=64,
        num_heads=2,
        global_attn_indexes=(1,),
    ).eval()
    with pytest.raises(MappingError) as refused:
        map_model(sam, (3, 64, 64))
    assert str(refused.value) == (
        "windowed attention: tokens cannot be dropped without breaking the windows "
        "(blocks.0.attn attends within 4 windows of 16 tokens per image)"
    )
