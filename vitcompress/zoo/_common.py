"""What the zoo's model families share: the grid token embedding, the pre-norm block around a
family's own attention (with timm's ``Mlp``, whose ``fc1``/``fc2`` are the originals' names), the
originals' weight init, the refusal of ``pretrained=True`` without a local file, and the base of
their timm configs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import DropPath, Mlp, to_2tuple, trunc_normal_
from timm.models import resolve_pretrained_cfg
from torch import nn

NormLayer = Callable[[int], nn.Module]
ActLayer = Callable[[], nn.Module]


class GridEmbed(nn.Module):
    """Strided conv + norm; returns the tokens and the grid read off the conv's output."""

    def __init__(
        self,
        in_chans: int,
        embed_dim: int,
        kernel_size: int,
        stride: int,
        padding: int = 0,
        norm_layer: NormLayer = nn.LayerNorm,
    ) -> None:
        super().__init__()
        self.proj = nn.Conv2d(
            in_chans, embed_dim, kernel_size=kernel_size, stride=stride, padding=padding
        )
        self.norm = norm_layer(embed_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        x = self.proj(x)
        B, C, H, W = x.shape
        x = self.norm(x.flatten(2).transpose(1, 2))
        return x, H, W


class GridBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x), H, W)`` then ``x + mlp(norm2(x))``.

    ``attn`` is the family's attention, called with the token grid ``H, W``.
    """

    def __init__(
        self,
        dim: int,
        attn: nn.Module,
        mlp_ratio: float,
        drop: float = 0.0,
        drop_path: float = 0.0,
        act_layer: ActLayer = nn.GELU,
        norm_layer: NormLayer = nn.LayerNorm,
    ) -> None:
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = attn
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, drop=drop)

    def forward(self, x: torch.Tensor, H: int, W: int) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), H, W))
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, attn_drop: nn.Module
) -> torch.Tensor:
    """``softmax(q @ k^T * scale) @ v`` over (B, heads, T, head_dim), written out so that graph
    analysis and ``FlopCounterMode`` see each op; returned as (B, T, heads, head_dim)."""
    attn = q @ k.transpose(-2, -1) * scale
    attn = attn.softmax(dim=-1)
    attn = attn_drop(attn)
    return (attn @ v).transpose(1, 2)


def head_width(dim: int, num_heads: int) -> int:
    """The width of one of ``num_heads`` attention heads over ``dim``; a width the heads do not
    divide is refused."""
    if dim % num_heads:
        raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
    return dim // num_heads


def drop_path_rates(drop_path_rate: float, depths: tuple[int, ...] | list[int]) -> list[float]:
    """Stochastic depth rates growing linearly over all blocks (plain Python so that building on
    the meta device works)."""
    total = sum(depths)
    return [drop_path_rate * j / max(total - 1, 1) for j in range(total)]


def init_weights(m: nn.Module) -> None:
    """The originals' init: truncated normal linears, unit norms, default convs."""
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, (nn.LayerNorm, nn.BatchNorm2d)):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def require_weight_source(variant: str, pretrained: bool, kwargs: dict[str, Any]) -> None:
    """Refuse ``pretrained=True`` without weights to load, naming the local-file route.

    The registry carries no download location, so ``pretrained=True`` only makes sense with a
    local file or an in-memory state dict; say so instead of timm's generic "no weights" error.
    """
    if not pretrained:
        return
    cfg = resolve_pretrained_cfg(
        variant,
        pretrained_cfg=kwargs.get("pretrained_cfg"),
        pretrained_cfg_overlay=kwargs.get("pretrained_cfg_overlay"),
    )
    if not (cfg.has_weights or cfg.state_dict is not None):
        raise RuntimeError(
            f"{variant}: no pretrained weights are registered (nothing is downloaded). Load the "
            f"official checkpoint from disk with timm.create_model('{variant}', pretrained=True, "
            f"pretrained_cfg_overlay=dict(file='/path/to/checkpoint.pth'))."
        )


def stating_input_size(
    kwargs: dict[str, Any], img_size: int | tuple[int, int], in_chans: int
) -> dict[str, Any]:
    """``kwargs`` for ``build_model_with_cfg`` whose ``pretrained_cfg`` states the input the
    model is built for (``img_size``, ``in_chans``; the class's defaults given here), not the
    registered weights' 3 x 224 x 224: a model built with ``in_chans=1`` or ``img_size=64``
    says so to whoever reads its input size or preprocessing from its config (timm's own ViTs
    say it through ``patch_embed.img_size``, which these models have no single one of). An
    ``input_size`` the caller overlays itself is kept."""
    side = to_2tuple(kwargs.get("img_size") or img_size)
    chans = kwargs.get("in_chans") or in_chans
    overlay = dict(kwargs.get("pretrained_cfg_overlay") or {})
    overlay.setdefault("input_size", (int(chans), int(side[0]), int(side[1])))
    return {**kwargs, "pretrained_cfg_overlay": overlay}


def base_cfg(**kwargs: Any) -> dict[str, Any]:
    """A zoo model's pretrained config: ImageNet-1k at 224 px, the originals' test pipeline
    (resize to 224 / 0.875, centre crop 224, bicubic), overridden by ``kwargs``."""
    return {
        # No url/hf_hub_id on purpose: nothing is downloaded. Official weights load from a local
        # file via ``pretrained_cfg_overlay=dict(file=...)``.
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "classifier": "head",
        **kwargs,
    }


class LinearHead(nn.Module):
    """timm's accessors of a model whose head is one linear layer on ``num_features``."""

    num_classes: int
    num_features: int
    head: nn.Module

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()


class GridClassifier(LinearHead):
    """What both pyramid families' classifiers share: the head's accessors and
    ``forward = forward_head(forward_features(x))``."""

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))
