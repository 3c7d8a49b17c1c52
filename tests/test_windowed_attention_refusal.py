"""Blocks the tool cannot reduce at are refused in one line naming the blocker, not with the
generic "no transformer block found" (nor left out of the map): SAM's windowed attention on 3-D
(batch x heads, N, D) tensors written as a matmul and a softmax (its SDPA form is given its
heads axis back at capture and maps: tests/test_windowed_families.py). (Parallel blocks, refused here before, now compress:
tests/test_parallel_blocks.py.)"""

from __future__ import annotations

import re

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


@pytest.mark.parametrize(
    "name, kwargs, where, rows",
    [
        # TNT's inner attention over each patch's pixels, (B x patches, pixels, C).
        ("tnt_s_patch16_224", {"img_size": 64}, "blocks.0.attn_in", "32 rows of 16 tokens"),
        # MobileViT's transformer over the unfolded patches, (B x patch area, patches, C).
        ("mobilevit_xxs", {}, "stages.2.1.transformer.0.attn", "8 rows of 16 tokens"),
    ],
)
def test_a_stream_cut_into_windows_between_blocks_is_refused_with_that_line(
    name, kwargs, where, rows
):
    """Where the blocks' residual stream is itself batched as windows (no per-image tokens to
    put back between blocks), the line says so, naming the attention."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10, **kwargs).eval()
    with pytest.raises(MappingError) as refused:
        map_model(model, (3, 64, 64))
    assert str(refused.value) == (
        f"windowed attention at {where}: its block's tokens are themselves cut into windows "
        f"({rows} for 2 images, between blocks too), which is not supported"
    )


def test_factorised_space_time_attention_is_refused_with_that_line():
    """transformers' TimeSformer: its time attention's windows (each patch position's frames)
    leave the class token out and add back to ``x[:, 1:]`` inside the block, so no block of the
    residual stream closes it; the line says so, naming the attention and the slice."""
    pytest.importorskip("transformers")
    from tests.fixtures import dense_models

    model, size = dense_models.build("video_hf_timesformer")
    with pytest.raises(MappingError) as refused:
        map_model(model, size)
    message = str(refused.value)
    assert "\n" not in message
    # The add's node name is transformers' code's, not ours: any name.
    assert re.fullmatch(
        r"windowed attention at model\.encoder\.layer\.0\.temporal_attention\.attention: its "
        r"residual add \(\w+\) is on 64 of its block's 65 tokens \(x\[:, 1:\]\), so it closes "
        r"no block of the residual stream \(a factorised attention, e\.g\. TimeSformer's time "
        r"attention, is not supported\)",
        message,
    ), message
