"""Which parameters fine-tuning does not decay: facts about the model, not guesses by name."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

import vitcompress
from tests.models import timm_small
from vitcompress.api import compress
from vitcompress.compilation.weight_decay import NO_WEIGHT_DECAY_ATTRIBUTE
from vitcompress.training.optim import param_groups

IMAGE, PATCH, DIM = 16, 4, 32


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_a, self.norm_b = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_a(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm_b(x))


class OddNames(nn.Module):
    """A ViT whose position table is ``where`` and whose class token is ``start``, with a
    ``gain`` of shape (1, D) that multiplies the tokens: a weight, not a table."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, DIM, PATCH, PATCH)
        self.start = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.where = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, DIM) * 0.02)
        self.gain = nn.Parameter(torch.ones(1, DIM))
        self.blocks = nn.Sequential(_Block(), _Block())
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 3)
        self.default_input_size = (3, IMAGE, IMAGE)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.stem(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.start.expand(x.shape[0], -1, -1), x], dim=1) + self.where
        x = self.blocks(x * self.gain)
        return self.head(self.norm(x)[:, 0])


def _split(model: nn.Module) -> tuple[set[str], set[str]]:
    decay, no_decay = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    return ({names[id(p)] for p in decay["params"]}, {names[id(p)] for p in no_decay["params"]})


def test_position_table_and_prefix_token_found_by_structure_whatever_their_names() -> None:
    compressed = compress(OddNames().eval(), "etps", keep=0.5, locs=[1])
    assert getattr(compressed, NO_WEIGHT_DECAY_ATTRIBUTE) == ["start", "where"]
    decayed, kept = _split(compressed)
    assert {"where", "start"} <= kept
    # Multiplied into the tokens, not added: a weight of leading dimension 1 is still decayed.
    assert "gain" in decayed and "head.weight" in decayed and "stem.weight" in decayed
    assert {"norm.weight", "head.bias"} <= kept
    # An EMA copy (a deepcopy of the GraphModule) keeps the record.
    assert _split(copy.deepcopy(compressed)) == (decayed, kept)


def test_a_timm_models_no_weight_decay_is_honoured_through_compression() -> None:
    base = timm_small("vit_small_patch16_224", depth=2).eval()
    # The model's word wins over structure, patterns included (as timm's optimizer reads it).
    base.no_weight_decay = lambda: {"pos_embed", "blocks.*.mlp.fc1.weight"}
    compressed = compress(base, "etps", keep=0.5, locs=[1])
    assert not hasattr(compressed, "no_weight_decay")  # the graph does not forward it
    decayed, kept = _split(compressed)
    assert {"pos_embed", "blocks.0.mlp.fc1.weight", "blocks.1.mlp.fc1.weight"} <= kept
    assert "cls_token" in decayed and "blocks.0.mlp.fc2.weight" in decayed
    # The uncompressed base is read the same way, from its own method.
    base_decayed, base_kept = _split(base)
    assert "blocks.1.mlp.fc1.weight" in base_kept and "cls_token" in base_decayed


def test_the_record_survives_save_and_load(tmp_path: Path) -> None:
    base = timm_small("vit_small_patch16_224", depth=2).eval()
    compressed = compress(base, "etps", keep=0.5, locs=[1])
    loaded = vitcompress.load(vitcompress.save(compressed, tmp_path / "artifact"))
    assert getattr(loaded, NO_WEIGHT_DECAY_ATTRIBUTE) == ["cls_token", "pos_embed"]
    assert _split(loaded) == _split(compressed)


def test_a_plain_model_without_a_record_or_method() -> None:
    # No graph to read: a leading dimension of 1 held by the module itself (not by a layer).
    model = OddNames()
    model.head = nn.Linear(DIM, 1)  # one output: a (1, D) weight that is a layer's weight
    decayed, kept = _split(model)
    assert {"where", "start", "gain"} <= kept
    assert {"head.weight", "stem.weight"} <= decayed
