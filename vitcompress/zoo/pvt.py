"""PVT v1: Pyramid Vision Transformer (Wang et al., ICCV 2021, arXiv:2102.12122).

Four stages of transformer blocks on a shrinking patch grid (stride 4, 8, 16, 32). Attention is
*spatial-reduction attention*: queries are all tokens of the stage, keys/values come from the token
grid downsampled by a strided conv (``sr``, stride ``sr_ratio``) followed by a LayerNorm. The class
token only exists in the last stage.

Parameter names follow ``classification/pvt.py`` of github.com/whai362/PVT exactly, so the released
checkpoints load with ``strict=True`` (see ``docs/zoo.md``).

Written for graph rewriting, as every zoo model (see ``vitcompress.zoo``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from timm.layers import to_2tuple, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from vitcompress.zoo._common import (
    GridBlock,
    GridClassifier,
    GridEmbed,
    NormLayer,
    attend,
    base_cfg,
    drop_path_rates,
    head_width,
    init_weights,
    require_weight_source,
    stating_input_size,
)

__all__ = ["PyramidVisionTransformer", "checkpoint_filter_fn"]


class SpatialReductionAttention(nn.Module):
    """Multi-head attention whose keys/values come from a ``sr_ratio``-times coarser token grid."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        sr_ratio: int = 1,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_width(dim, num_heads)
        self.scale = self.head_dim**-0.5
        self.sr_ratio = sr_ratio

        self.q = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        # The original only creates ``sr``/``norm`` when there is a reduction; keeping that makes
        # the last stage's keys (no ``block4.*.attn.sr``) match the checkpoints.
        self.sr: nn.Conv2d | None = None
        self.norm: nn.Module | None = None
        if sr_ratio > 1:
            self.sr = nn.Conv2d(dim, dim, kernel_size=sr_ratio, stride=sr_ratio)
            # A plain ``nn.LayerNorm`` (eps 1e-5) as in the original, not the model's eps-1e-6 norm.
            self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        B, N, C = x.shape
        q = self.q(x).reshape(B, N, self.num_heads, self.head_dim).permute(0, 2, 1, 3)

        kv_in = x
        if self.sr is not None and self.norm is not None:
            # Keys/values see the full grid of this stage; H and W come from the patch embedding's
            # output shape so that the grid follows whatever resolution is fed in.
            grid = x.transpose(1, 2).reshape(B, C, H, W)
            kv_in = self.norm(self.sr(grid).flatten(2).transpose(1, 2))
        kv = self.kv(kv_in).reshape(B, -1, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        k, v = kv[0], kv[1]

        x = attend(q, k, v, self.scale, self.attn_drop).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class PyramidVisionTransformer(GridClassifier):
    """PVT v1 classifier (four stages, class token in the last stage, classification on it)."""

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dims: Sequence[int] = (64, 128, 320, 512),
        num_heads: Sequence[int] = (1, 2, 5, 8),
        mlp_ratios: Sequence[float] = (8, 8, 4, 4),
        qkv_bias: bool = True,
        depths: Sequence[int] = (2, 2, 2, 2),
        sr_ratios: Sequence[int] = (8, 4, 2, 1),
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        norm_layer: NormLayer | None = None,
    ) -> None:
        super().__init__()
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        self.num_stages = len(depths)
        self.num_features = self.embed_dim = embed_dims[-1]
        self.num_prefix_tokens = 1

        dpr = drop_path_rates(drop_path_rate, depths)
        size = to_2tuple(img_size)
        # Build-time grid of each stage's position embedding. Only the *parameter layout* depends on
        # it; at run time the grid is read from the patch embedding output and the embedding is
        # resampled to it.
        self.pos_grids: list[tuple[int, int]] = []
        self.sr_ratios: list[int] = []
        cur = 0
        for i in range(self.num_stages):
            patch = patch_size if i == 0 else 2
            # Below 32 px input the original patch/reduction sizes no longer fit the grid; shrink
            # them to the grid there (those layers then have non-original shapes). At 32 px and up
            # every size is the original one.
            patch = max(1, min(patch, *size))
            size = (size[0] // patch, size[1] // patch)
            sr = max(1, min(sr_ratios[i], *size))
            self.pos_grids.append(size)
            self.sr_ratios.append(sr)

            num_pos = size[0] * size[1] + (1 if i == self.num_stages - 1 else 0)
            # Non-overlapping patches; the embedding's norm is a plain ``nn.LayerNorm`` (eps 1e-5)
            # as in the original: only the blocks and the final norm use the eps-1e-6 norm_layer.
            embed = GridEmbed(
                in_chans if i == 0 else embed_dims[i - 1], embed_dims[i], patch, patch
            )
            setattr(self, f"patch_embed{i + 1}", embed)
            setattr(self, f"pos_embed{i + 1}", nn.Parameter(torch.zeros(1, num_pos, embed_dims[i])))
            setattr(self, f"pos_drop{i + 1}", nn.Dropout(drop_rate))
            blocks = nn.ModuleList(
                GridBlock(
                    embed_dims[i],
                    SpatialReductionAttention(
                        embed_dims[i], num_heads[i], qkv_bias, sr, attn_drop_rate, drop_rate
                    ),
                    mlp_ratios[i],
                    drop=drop_rate,
                    drop_path=dpr[cur + j],
                    norm_layer=norm_layer,
                )
                for j in range(depths[i])
            )
            setattr(self, f"block{i + 1}", blocks)
            cur += depths[i]

        self.norm = norm_layer(embed_dims[-1])
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dims[-1]))
        self.reset_classifier(num_classes)  # the head, on num_features

        for i in range(self.num_stages):
            trunc_normal_(getattr(self, f"pos_embed{i + 1}"), std=0.02)
        trunc_normal_(self.cls_token, std=0.02)
        self.apply(init_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"cls_token"}

    def _resize_pos_embed(
        self, pos_embed: torch.Tensor, stage: int, H: int, W: int
    ) -> torch.Tensor:
        # Always resample instead of branching on ``H * W == num_patches``: a branch on a run-time
        # shape is not fx-traceable, and bilinear resampling to the same size is an exact identity.
        return _resample(pos_embed, self.pos_grids[stage], (H, W))

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        last = self.num_stages - 1
        for i in range(self.num_stages):
            x, H, W = getattr(self, f"patch_embed{i + 1}")(x)
            pos_embed = getattr(self, f"pos_embed{i + 1}")
            if i == last:
                # The class token joins only in the last stage; its position entry is not resampled.
                x = torch.cat((self.cls_token.expand(B, -1, -1), x), dim=1)
                pos_embed = torch.cat(
                    (pos_embed[:, :1], self._resize_pos_embed(pos_embed[:, 1:], i, H, W)), dim=1
                )
            else:
                pos_embed = self._resize_pos_embed(pos_embed, i, H, W)
            x = getattr(self, f"pos_drop{i + 1}")(x + pos_embed)
            for blk in getattr(self, f"block{i + 1}"):
                x = blk(x, H, W)
            if i != last:
                # Tokens back to an image grid for the next stage's patch conv.
                x = x.transpose(1, 2).reshape(B, -1, H, W)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, 0]
        return x if pre_logits else self.head(x)


def _resample(pos: torch.Tensor, grid: tuple[int, int], new_grid: tuple[int, int]) -> torch.Tensor:
    """A position embedding (1, gh * gw, C) laid out on ``grid``, resampled (bilinear) to
    ``new_grid``."""
    gh, gw = grid
    image = pos.reshape(1, gh, gw, -1).permute(0, 3, 1, 2)
    image = F.interpolate(image, size=new_grid, mode="bilinear", align_corners=False)
    return image.flatten(2).transpose(1, 2)


def _resample_grid(pos: torch.Tensor, new_grid: tuple[int, int]) -> torch.Tensor:
    old = int(round(pos.shape[1] ** 0.5))  # released checkpoints are square (224 px)
    if old * old != pos.shape[1]:
        raise ValueError(
            f"cannot infer the grid of a position embedding with {pos.shape[1]} entries"
        )
    return _resample(pos, (old, old), new_grid)


def checkpoint_filter_fn(
    state_dict: dict[str, torch.Tensor], model: PyramidVisionTransformer
) -> dict[str, torch.Tensor]:
    """Adapt an official PVT checkpoint to ``model``: resample position embeddings to its grid.

    Keys are not renamed: the model uses the original names. Everything else is left to a strict
    ``load_state_dict`` so that a mismatching checkpoint fails loudly.
    """
    if "model" in state_dict and isinstance(state_dict["model"], dict):  # training checkpoint
        state_dict = state_dict["model"]
    out = dict(state_dict)
    for i in range(model.num_stages):
        key = f"pos_embed{i + 1}"
        target = getattr(model, key)
        if key not in out or out[key].shape == target.shape:
            continue
        pos = out[key]
        if i == model.num_stages - 1:
            out[key] = torch.cat(
                (pos[:, :1], _resample_grid(pos[:, 1:], model.pos_grids[i])), dim=1
            )
        else:
            out[key] = _resample_grid(pos, model.pos_grids[i])
    return out


# The PVT repo evaluates with DeiT's pipeline (resize 256, crop 224): ``base_cfg``'s crop_pct.
_CFG = base_cfg(
    first_conv="patch_embed1.proj",
    license="apache-2.0",
    origin_url="https://github.com/whai362/PVT",
    paper_ids="arXiv:2102.12122",
    paper_name=(
        "Pyramid Vision Transformer: A Versatile Backbone for Dense Prediction without Convolutions"
    ),
)

default_cfgs = generate_default_cfgs(
    {name: dict(_CFG) for name in ("pvt_tiny", "pvt_small", "pvt_medium", "pvt_large")}
)

# Shared by all four sizes; only the depths differ (Table 1 of the paper).
_PVT_ARGS: dict[str, Any] = {
    "patch_size": 4,
    "embed_dims": (64, 128, 320, 512),
    "num_heads": (1, 2, 5, 8),
    "mlp_ratios": (8, 8, 4, 4),
    "qkv_bias": True,
    "sr_ratios": (8, 4, 2, 1),
}


def _create_pvt(
    variant: str, pretrained: bool, sizes_depths: tuple[int, ...], **kwargs: Any
) -> PyramidVisionTransformer:
    require_weight_source(variant, pretrained, kwargs)
    # The caller's arguments win, ``depths`` included, as for the other zoo families.
    model_args = {**_PVT_ARGS, "depths": sizes_depths, **kwargs}
    return build_model_with_cfg(
        PyramidVisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        **stating_input_size(model_args, img_size=224, in_chans=3),
    )


@register_model
def pvt_tiny(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Tiny: depths (2, 2, 2, 2), 13.2 M params."""
    return _create_pvt("pvt_tiny", pretrained, (2, 2, 2, 2), **kwargs)


@register_model
def pvt_small(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Small: depths (3, 4, 6, 3), 24.5 M params."""
    return _create_pvt("pvt_small", pretrained, (3, 4, 6, 3), **kwargs)


@register_model
def pvt_medium(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Medium: depths (3, 4, 18, 3), 44.2 M params."""
    return _create_pvt("pvt_medium", pretrained, (3, 4, 18, 3), **kwargs)


@register_model
def pvt_large(pretrained: bool = False, **kwargs: Any) -> PyramidVisionTransformer:
    """PVT-Large: depths (3, 8, 27, 3), 61.4 M params."""
    return _create_pvt("pvt_large", pretrained, (3, 8, 27, 3), **kwargs)
