"""Dense outputs come back in the base's token order, checked exactly.

A cosine to the base (``test_dense_outputs.py``) passes with a few tokens misplaced. Here the
blocks' residual branches are zeroed (attention and MLP still run, on q/k weights sharpened 8x,
so the methods still choose by peaked attention), so every block passes each token through
unchanged: the base's output is the input's tokens, each distinct (its patch plus its position
embedding), and a compressed model restoring by ``value`` (DynamicViT, EViT) or ``delta`` (dTPS,
eTPS, ToMe) must give back every token, kept or removed, exactly where the base has it. A token
put back one place off, a row of the batch restored with another row's indices, or a prefix or
register token miscounted changes the output.

Every method on: timm ViT tokens out, the compressed classifier's ``forward_intermediates`` and
``get_intermediate_layers`` (registers), HF DINOv2 with registers (all hidden states), Swin's
``features_only`` (windowed), at batch 3 with different images, reductions at three blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import timm
import torch
from torch import Tensor, nn

from tests.fixtures.dense_models import compress_restoring

METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")
_QUERY_KEY_ROWS = {"qkv": 2 / 3}
_QUERY_KEY = ("query", "key", "q", "k", "q_proj", "k_proj")
_BRANCH_ENDS = ("attn.proj", "mlp.fc2", "attention.output.dense", "attention.o_proj")


def passing_blocks(model: nn.Module) -> int:
    """Scales ``model``'s queries and keys 8x and zeroes every residual branch's last linear, so
    that each block leaves its tokens as they came; in place, eval mode. Returns how many
    linears it zeroed (two per block)."""
    zeroed = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            leaf = name.rsplit(".", 1)[-1]
            share = _QUERY_KEY_ROWS.get(leaf, 1.0 if leaf in _QUERY_KEY else 0.0)
            rows = int(module.out_features * share)
            module.weight[:rows] *= 8.0
            if module.bias is not None:
                module.bias[:rows] *= 8.0
            if name.endswith(_BRANCH_ENDS):
                zeroed += 1
                module.weight.zero_()
                if module.bias is not None:
                    module.bias.zero_()
    model.eval()
    return zeroed


def _tensors(out) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, dict):
        return _tensors(list(out.values()))
    if hasattr(out, "to_tuple"):
        return _tensors(out.to_tuple())
    return [t for item in out for t in _tensors(item)]


class _HFHidden(nn.Module):
    """An HF backbone's last hidden state and every hidden state."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: Tensor) -> tuple[Tensor, ...]:
        out = self.model(pixel_values=pixel_values, output_hidden_states=True)
        return (out.last_hidden_state, *out.hidden_states)


def _vit(**kwargs) -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, depth=4, **kwargs)


def _reg4() -> nn.Module:
    return timm.create_model(
        "vit_small_patch14_reg4_dinov2",
        img_size=28,
        patch_size=4,
        embed_dim=64,
        num_heads=2,
        depth=4,
        num_classes=0,
    )


def _hf_dinov2_registers() -> nn.Module:
    from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersModel

    config = Dinov2WithRegistersConfig(
        image_size=28,
        patch_size=4,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=128,
        num_register_tokens=4,
    )
    return _HFHidden(Dinov2WithRegistersModel(config))


def _swin() -> nn.Module:
    return timm.create_model(
        "swin_tiny_patch4_window7_224",
        img_size=64,
        window_size=4,
        embed_dim=32,
        depths=(2, 2, 2, 2),
        num_heads=(1, 2, 4, 8),
        features_only=True,
    )


def _forward(model: nn.Module, x: Tensor):
    return model(x)


# name: (build, input size, how the dense output is read, locations, blocks)
CASES: dict[
    str, tuple[Callable[[], nn.Module], tuple[int, ...], Callable, list[int] | None, int]
] = {
    "vit-tokens": (
        lambda: _vit(num_classes=0, global_pool=""),
        (3, 32, 32),
        _forward,
        [1, 2, 3],
        4,
    ),
    "vit-forward_intermediates": (
        lambda: _vit(num_classes=10),
        (3, 32, 32),
        lambda m, x: m.forward_intermediates(x, return_prefix_tokens=True),
        [1, 2, 3],
        4,
    ),
    "reg4-get_intermediate_layers": (
        _reg4,
        (3, 28, 28),
        lambda m, x: m.get_intermediate_layers(
            x, n=[1, 2, 3], reshape=True, return_prefix_tokens=True, norm=True
        ),
        [1, 2, 3],
        4,
    ),
    "hf-dinov2-registers": (_hf_dinov2_registers, (3, 28, 28), _forward, [1, 2, 3], 4),
    "swin-features_only": (_swin, (3, 64, 64), _forward, None, 8),
}


@pytest.fixture(scope="module")
def bases() -> dict[str, tuple[nn.Module, Tensor, list[Tensor]]]:
    return {}


def _base(bases: dict, name: str) -> tuple[nn.Module, Tensor, list[Tensor]]:
    if name not in bases:
        build, size, read, _, blocks = CASES[name]
        torch.manual_seed(0)
        model = build()
        assert passing_blocks(model) == 2 * blocks  # every block passes its tokens through
        x = torch.randn(3, *size, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            bases[name] = (model, x, _tensors(read(model, x)))
    return bases[name]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(CASES))
def test_every_token_comes_back_at_its_own_place(bases, name, method):
    model, x, expected = _base(bases, name)
    _, size, read, locs, _ = CASES[name]
    rule = "value" if method in ("dynamicvit", "evit") else "delta"
    small = compress_restoring(model, method, rule, size, locs)
    with torch.no_grad():
        out = _tensors(read(small, x))
    assert [(o.shape, o.dtype) for o in out] == [(e.shape, e.dtype) for e in expected]
    for o, e in zip(out, expected, strict=True):
        torch.testing.assert_close(o, e, atol=2e-6, rtol=0)
