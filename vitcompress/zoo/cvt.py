"""CvT: Convolutional vision Transformer (Wu et al., ICCV 2021, arXiv:2103.15808).

Three stages; each starts with an overlapping strided conv ("convolutional token embedding") and
runs transformer blocks whose q/k/v come from a *convolutional projection*: tokens are put back on
their grid, passed through a depthwise 3x3 conv + BatchNorm ("dw_bn"; stride 1 for q, 2 for k and
v), then through a linear layer. There are no position embeddings. The class token exists in the
last stage only; it bypasses the convolutional projection and is concatenated back in front of q,
k and v.

Parameter names follow ``lib/models/cls_cvt.py`` of github.com/microsoft/CvT exactly, so the
released checkpoints load with ``strict=True`` (see ``docs/zoo.md``).

Written for graph rewriting, as every zoo model (see ``vitcompress.zoo``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from timm.layers import QuickGELU, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from vitcompress.zoo._common import (
    ActLayer,
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

__all__ = ["ConvolutionalVisionTransformer"]


class ConvProjection(nn.Module):
    """The original "dw_bn" projection: depthwise conv + BatchNorm on the grid, back to tokens.

    Submodule names ``conv``/``bn`` give the checkpoint keys ``conv_proj_q.conv.weight`` etc. (the
    original's third entry, an einops ``Rearrange``, has no parameters and is done in ``forward``).
    """

    def __init__(self, dim: int, kernel_size: int, stride: int, padding: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(
            dim, dim, kernel_size, stride=stride, padding=padding, bias=False, groups=dim
        )
        self.bn = nn.BatchNorm2d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).flatten(2).transpose(1, 2)


class ConvAttention(nn.Module):
    """Multi-head attention with convolutional q/k/v projections (keys/values on a strided grid)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        with_cls_token: bool = False,
        kernel_size: int = 3,
        stride_q: int = 1,
        stride_kv: int = 2,
        padding_q: int = 1,
        padding_kv: int = 1,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_width(dim, num_heads)
        # The original scales by the *full* width (``dim_out ** -0.5``), not the head width; the
        # released weights were trained that way, so it is kept.
        self.scale = dim**-0.5
        self.with_cls_token = with_cls_token

        self.conv_proj_q = ConvProjection(dim, kernel_size, stride_q, padding_q)
        self.conv_proj_k = ConvProjection(dim, kernel_size, stride_kv, padding_kv)
        self.conv_proj_v = ConvProjection(dim, kernel_size, stride_kv, padding_kv)
        self.proj_q = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj_k = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj_v = nn.Linear(dim, dim, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        return x.reshape(B, T, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        B, N, C = x.shape
        if self.with_cls_token:
            # The class token has no grid position: split it off, convolve the patch tokens only,
            # and put it back in front of q, k and v (as the original ``forward_conv`` does).
            cls_token, x = x[:, :1], x[:, 1:]
        grid = x.transpose(1, 2).reshape(B, C, H, W)
        q = self.conv_proj_q(grid)
        k = self.conv_proj_k(grid)
        v = self.conv_proj_v(grid)
        if self.with_cls_token:
            q = torch.cat((cls_token, q), dim=1)
            k = torch.cat((cls_token, k), dim=1)
            v = torch.cat((cls_token, v), dim=1)

        q = self._heads(self.proj_q(q))
        k = self._heads(self.proj_k(k))
        v = self._heads(self.proj_v(v))

        x = attend(q, k, v, self.scale, self.attn_drop).reshape(B, -1, C)
        return self.proj_drop(self.proj(x))


class CvTStage(nn.Module):
    """One stage (the original's per-stage ``VisionTransformer``): conv embedding + blocks."""

    def __init__(
        self,
        in_chans: int,
        embed_dim: int,
        depth: int,
        num_heads: int,
        patch_size: int,
        patch_stride: int,
        patch_padding: int,
        with_cls_token: bool,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop: float = 0.0,
        attn_drop: float = 0.0,
        drop_path: Sequence[float] = (),
        act_layer: ActLayer = QuickGELU,
        norm_layer: NormLayer = nn.LayerNorm,
    ) -> None:
        super().__init__()
        # Overlapping patches (the original's "convolutional token embedding").
        self.patch_embed = GridEmbed(
            in_chans, embed_dim, patch_size, patch_stride, patch_padding, norm_layer
        )
        if with_cls_token:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
            trunc_normal_(self.cls_token, std=0.02)
        else:
            self.register_parameter("cls_token", None)
        self.pos_drop = nn.Dropout(drop)
        dpr = list(drop_path) or [0.0] * depth
        self.blocks = nn.ModuleList(
            GridBlock(
                embed_dim,
                ConvAttention(
                    embed_dim,
                    num_heads,
                    qkv_bias=qkv_bias,
                    with_cls_token=with_cls_token,
                    attn_drop=attn_drop,
                    proj_drop=drop,
                ),
                mlp_ratio,
                drop=drop,
                drop_path=dpr[j],
                act_layer=act_layer,
                norm_layer=norm_layer,
            )
            for j in range(depth)
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        x, H, W = self.patch_embed(x)
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = self.pos_drop(x)
        for blk in self.blocks:
            x = blk(x, H, W)
        return x, H, W


class ConvolutionalVisionTransformer(GridClassifier):
    """CvT classifier: three stages, classification on the last stage's class token."""

    def __init__(
        self,
        img_size: int | tuple[int, int] = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dims: Sequence[int] = (64, 192, 384),
        depths: Sequence[int] = (1, 2, 10),
        num_heads: Sequence[int] = (1, 3, 6),
        patch_sizes: Sequence[int] = (7, 3, 3),
        patch_strides: Sequence[int] = (4, 2, 2),
        patch_paddings: Sequence[int] = (2, 1, 1),
        cls_tokens: Sequence[bool] = (False, False, True),
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        act_layer: ActLayer | None = None,
        norm_layer: NormLayer | None = None,
    ) -> None:
        super().__init__()
        # No position embeddings, so the model itself does not depend on ``img_size``; it is
        # accepted so that timm's ``img_size=`` keyword works the same as for other models (the
        # factories state it as the config's input size).
        del img_size
        # QuickGELU (x * sigmoid(1.702 x)) is what the original builds its released models with.
        act_layer = act_layer or QuickGELU
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-5)
        self.num_stages = len(depths)
        self.num_features = self.embed_dim = embed_dims[-1]
        self.use_cls_token = bool(cls_tokens[-1])
        self.num_prefix_tokens = 1 if self.use_cls_token else 0

        dpr = drop_path_rates(drop_path_rate, depths)
        cur = 0
        for i in range(self.num_stages):
            stage = CvTStage(
                in_chans if i == 0 else embed_dims[i - 1],
                embed_dims[i],
                depths[i],
                num_heads[i],
                patch_sizes[i],
                patch_strides[i],
                patch_paddings[i],
                bool(cls_tokens[i]),
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                drop=drop_rate,
                attn_drop=attn_drop_rate,
                drop_path=dpr[cur : cur + depths[i]],
                act_layer=act_layer,
                norm_layer=norm_layer,
            )
            setattr(self, f"stage{i}", stage)
            cur += depths[i]

        self.norm = norm_layer(embed_dims[-1])
        self.reset_classifier(num_classes)  # the head, on num_features
        self.apply(init_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {f"stage{i}.cls_token" for i in range(self.num_stages)}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        B = x.shape[0]
        last = self.num_stages - 1
        for i in range(self.num_stages):
            stage = getattr(self, f"stage{i}")
            x, H, W = stage(x)
            if i != last:
                if stage.cls_token is not None:
                    x = x[:, 1:]  # a non-final class token is dropped, as in the original
                # Tokens back to an image grid for the next stage's conv embedding.
                x = x.transpose(1, 2).reshape(B, -1, H, W)
        # LayerNorm is per token, so normalising all tokens and then taking the class token equals
        # the original's ``norm(cls_token)``.
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, 0] if self.use_cls_token else x.mean(dim=1)
        return x if pre_logits else self.head(x)


def _cfg(**kwargs: Any) -> dict[str, Any]:
    # ``base_cfg``'s crop_pct is the original test pipeline: resize to 224 / 0.875, centre crop.
    return base_cfg(
        first_conv="stage0.patch_embed.proj",
        license="mit",
        origin_url="https://github.com/microsoft/CvT",
        paper_ids="arXiv:2103.15808",
        paper_name="CvT: Introducing Convolutions to Vision Transformers",
        **kwargs,
    )


default_cfgs = generate_default_cfgs(
    {
        "cvt_13": _cfg(),
        "cvt_21": _cfg(),
        # CvT-W24 exists only as an ImageNet-22k model fine-tuned at 384 px, evaluated on the
        # whole resized image (no centre crop).
        "cvt_w24": _cfg(input_size=(3, 384, 384), crop_pct=1.0),
    }
)


def _create_cvt(variant: str, pretrained: bool, **kwargs: Any) -> ConvolutionalVisionTransformer:
    require_weight_source(variant, pretrained, kwargs)
    kwargs = stating_input_size(kwargs, img_size=224, in_chans=3)
    return build_model_with_cfg(ConvolutionalVisionTransformer, variant, pretrained, **kwargs)


@register_model
def cvt_13(pretrained: bool = False, **kwargs: Any) -> ConvolutionalVisionTransformer:
    """CvT-13: dims (64, 192, 384), depths (1, 2, 10), heads (1, 3, 6); 20.0 M params."""
    model_args: dict[str, Any] = {
        "embed_dims": (64, 192, 384),
        "depths": (1, 2, 10),
        "num_heads": (1, 3, 6),
    }
    return _create_cvt("cvt_13", pretrained, **dict(model_args, **kwargs))


@register_model
def cvt_21(pretrained: bool = False, **kwargs: Any) -> ConvolutionalVisionTransformer:
    """CvT-21: dims (64, 192, 384), depths (1, 4, 16), heads (1, 3, 6); 31.6 M params."""
    model_args: dict[str, Any] = {
        "embed_dims": (64, 192, 384),
        "depths": (1, 4, 16),
        "num_heads": (1, 3, 6),
    }
    return _create_cvt("cvt_21", pretrained, **dict(model_args, **kwargs))


@register_model
def cvt_w24(pretrained: bool = False, **kwargs: Any) -> ConvolutionalVisionTransformer:
    """CvT-W24: dims (192, 768, 1024), depths (2, 2, 20), heads (3, 12, 16); 384 px default."""
    model_args: dict[str, Any] = {
        "img_size": 384,
        "embed_dims": (192, 768, 1024),
        "depths": (2, 2, 20),
        "num_heads": (3, 12, 16),
    }
    return _create_cvt("cvt_w24", pretrained, **dict(model_args, **kwargs))
