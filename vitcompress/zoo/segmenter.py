"""Segmenter with a linear decoder (Strudel et al., ICCV 2021, arXiv:2105.05633), small.

A timm-style ViT encoder (conv patch embedding, cls token, learned position embedding, pre-norm
blocks of timm's ``Attention``/``Mlp``, final norm) and the paper's "linear" decoder: the cls
token is dropped, each patch token goes through one ``Linear`` to class logits, the tokens are
put back on their (H/p, W/p) grid as ``(B, classes, h, w)`` and upsampled bilinearly to the
input: the output is ``(B, classes, H, W)``, per-pixel logits.

The decoder is written the plain way a user would (``x[:, 1:]``, ``transpose(1, 2).reshape(B,
C, h, w)``), so that compressing it exercises a head that needs every token in the base's order.

Registered into timm: ``segmenter_tiny_fmnist`` (64x64 gray input, patch 8: 64 patch tokens,
width 64, depth 6, 2 heads, 11 classes) for ``fashion-mnist-seg``
(``vitcompress.data.segmentation``), whose canvas statistics its config states. No weights are
registered (train it, e.g. with ``benchmarks/dense_segmentation.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import Block
from torch import nn

from vitcompress.zoo._common import (
    LinearHead,
    base_cfg,
    drop_path_rates,
    init_weights,
    require_weight_source,
    stating_input_size,
)

__all__ = ["Segmenter"]

# The pixel statistics of the fashion-mnist-seg canvases (vitcompress.data.segmentation's
# SEG_MEAN/SEG_STD; the zoo lies below the data layer, so they are repeated here and a test
# checks that both agree).
FMNIST_SEG_MEAN = (0.1368,)
FMNIST_SEG_STD = (0.2836,)


class PatchEmbed(nn.Module):
    """A strided conv; the tokens (B, N, C) with the grid read from the conv's output."""

    def __init__(self, in_chans: int, embed_dim: int, patch_size: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class Segmenter(LinearHead):
    """ViT encoder + linear decoder; ``forward`` returns (B, num_classes, H, W) logits."""

    def __init__(
        self,
        img_size: int = 64,
        patch_size: int = 8,
        in_chans: int = 1,
        num_classes: int = 11,
        embed_dim: int = 64,
        depth: int = 6,
        num_heads: int = 2,
        mlp_ratio: float = 2.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        **kwargs: Any,  # timm's builder passes its own (pretrained_cfg, ...); none is used
    ) -> None:
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
        self.num_features = self.embed_dim = embed_dim
        self.patch_size = patch_size
        grid = img_size // patch_size
        self.patch_embed = PatchEmbed(in_chans, embed_dim, patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + grid * grid, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        rates = drop_path_rates(drop_path_rate, [depth])
        self.blocks = nn.Sequential(
            *[
                Block(
                    embed_dim,
                    num_heads,
                    mlp_ratio=mlp_ratio,
                    qkv_bias=qkv_bias,
                    proj_drop=drop_rate,
                    attn_drop=attn_drop_rate,
                    drop_path=rates[i],
                )
                for i in range(depth)
            ]
        )
        self.norm = nn.LayerNorm(embed_dim)
        self.reset_classifier(num_classes)  # the linear decoder
        trunc_normal_(self.pos_embed, std=0.02)
        trunc_normal_(self.cls_token, std=0.02)
        self.apply(init_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token"}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        x = self.blocks(x)
        return self.norm(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, H, W = x.shape
        h, w = H // self.patch_size, W // self.patch_size
        x = self.forward_features(x)
        x = self.head(x[:, 1:])  # drop the cls token; per-patch class logits (B, h*w, classes)
        x = x.transpose(1, 2).reshape(B, self.num_classes, h, w)
        return F.interpolate(x, size=(H, W), mode="bilinear", align_corners=False)


default_cfgs = generate_default_cfgs(
    {
        "segmenter_tiny_fmnist": base_cfg(
            num_classes=11,
            input_size=(1, 64, 64),
            crop_pct=1.0,
            interpolation="bilinear",
            mean=FMNIST_SEG_MEAN,
            std=FMNIST_SEG_STD,
            first_conv="patch_embed.proj",
            license="apache-2.0",
            paper_ids="arXiv:2105.05633",
            paper_name="Segmenter: Transformer for Semantic Segmentation",
        ),
    }
)


@register_model
def segmenter_tiny_fmnist(pretrained: bool = False, **kwargs: Any) -> Segmenter:
    """Segmenter (linear decoder) for fashion-mnist-seg: 64x64 gray input, patch 8 (8x8 = 64
    patch tokens + cls), width 64, depth 6, 2 heads, MLP ratio 2, 11 classes; about 0.2 M
    params."""
    require_weight_source("segmenter_tiny_fmnist", pretrained, kwargs)
    model_args: dict[str, Any] = {
        "img_size": 64,
        "patch_size": 8,
        "in_chans": 1,
        "num_classes": 11,
        "embed_dim": 64,
        "depth": 6,
        "num_heads": 2,
        "mlp_ratio": 2.0,
    }
    kwargs = stating_input_size(dict(model_args, **kwargs), img_size=64, in_chans=1)
    return build_model_with_cfg(Segmenter, "segmenter_tiny_fmnist", pretrained, **kwargs)
