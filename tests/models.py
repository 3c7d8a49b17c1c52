"""Small configurations of every supported vanilla family, shared by the tests."""

from __future__ import annotations

from pathlib import Path

import timm

from tests.fixtures import inhouse

FIXTURES = Path(__file__).parent / "fixtures" / "inhouse.py"
SMALL = dict(img_size=32, patch_size=4, depth=4, embed_dim=64, num_heads=2, num_classes=10)


def timm_small(name: str, **extra):
    return timm.create_model(name, **{**SMALL, **extra})


# name -> (factory, input size, prefix tokens, attention kind)
VANILLA = {
    "vit": (lambda: timm_small("vit_small_patch16_224"), (3, 32, 32), 1, "sdpa"),
    "deit_distilled": (
        lambda: timm_small("deit_tiny_distilled_patch16_224"),
        (3, 32, 32),
        2,
        "sdpa",
    ),
    "deit3": (lambda: timm_small("deit3_small_patch16_224"), (3, 32, 32), 1, "sdpa"),
    "vit_registers": (lambda: timm_small("vit_base_patch16_reg4_gap_256"), (3, 32, 32), 4, "sdpa"),
    "inhouse_mha": (inhouse.mha_vit, (3, 32, 32), 1, "multihead_attention"),
    "inhouse_einsum": (inhouse.einsum_vit, (3, 32, 32), 0, "einsum_softmax"),
    "inhouse_registers": (inhouse.register_vit, (3, 32, 32), 4, "matmul_softmax"),
}
