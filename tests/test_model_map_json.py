"""The model map's JSON reads back to the map that wrote it: ``ModelMap.from_json(m.to_json())``
equals ``m`` (dataclass equality, node names aside: they are handles into one captured graph,
written nowhere and compared by no one), for a plain ViT, RoPE's tables, a dense model, Swin (tables on the
logits, a shifted window's mask), GCViT (a global query, full-window size reads), SAM (a term
made from the queries) and MViTv2 (attention left whole, keys pooled)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields

import pytest
import timm
import torch
from torch import nn

from tests.fixtures import dense_models
from vitcompress import map_model
from vitcompress.analysis.model_map import Block, ModelMap
from vitcompress.analysis.window_map import ReducedAttention, SlotKind, WholeAttention

SWIN = dict(img_size=56, embed_dim=32, depths=(2, 2), num_heads=(2, 4), window_size=7)


def _timm(name: str, side: int, **args) -> Callable[[], tuple[nn.Module, tuple[int, ...]]]:
    return lambda: (timm.create_model(name, num_classes=10, **args), (3, side, side))


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[int, ...]]]] = {
    "vit": _timm("vit_tiny_patch16_224", 32, img_size=32, patch_size=4, depth=3),
    "vit_rope": _timm(
        "vit_small_patch16_rope_224",
        32,
        img_size=32,
        patch_size=4,
        depth=2,
        embed_dim=64,
        num_heads=2,
    ),
    "dense_vit": lambda: dense_models.build("dense_vit"),
    "swin": _timm("swin_tiny_patch4_window7_224", 56, **SWIN),
    "gcvit": _timm("gcvit_xxtiny", 64, img_size=64),
    "sam_vit": _timm(
        "samvit_base_patch16",
        64,
        img_size=64,
        patch_size=8,
        embed_dim=64,
        depth=3,
        num_heads=2,
        window_size=4,
        global_attn_indexes=(2,),
    ),
    "mvitv2": _timm("mvitv2_tiny", 64, img_size=64),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def mapped(request) -> tuple[str, ModelMap]:
    torch.manual_seed(0)
    model, size = MODELS[request.param]()
    return request.param, map_model(model.eval(), size)


def test_a_map_read_back_equals_the_map_written(mapped) -> None:
    name, model_map = mapped
    read = ModelMap.from_json(model_map.to_json())
    assert read == model_map
    assert model_map.has_nodes and not read.has_nodes
    assert read.to_json() == model_map.to_json()


def test_what_the_round_trip_covers(mapped) -> None:
    """Each model brings the records its family adds (so the equality above is not vacuous)."""
    name, model_map = mapped
    windows = [b.windows for b in model_map.blocks if b.windows is not None]
    reduced = [w.attention for w in windows if isinstance(w.attention, ReducedAttention)]
    kinds = {slot.kind for attention in reduced for slot in attention.slot_inputs}
    expected = {
        "vit": lambda: not windows,
        # RoPE's sin and cos rows meet q and k: four uses alike but for their nodes.
        "vit_rope": lambda: len(model_map.blocks[0].position_uses) == 4,
        "dense_vit": lambda: model_map.dense,
        "swin": lambda: SlotKind.TABLE in kinds,
        "gcvit": lambda: {SlotKind.QUERY_ROWS, SlotKind.FULL_SIZE_READ} <= kinds,
        "sam_vit": lambda: SlotKind.QUERY_TERM in kinds,
        "mvitv2": lambda: any(isinstance(w.attention, WholeAttention) for w in windows),
    }
    assert expected[name]()


def test_a_changed_field_is_seen_and_a_node_name_is_not(mapped) -> None:
    """Equality compares what the map says about the model (a block's token count, its
    attention's path), never which graph node it names."""
    _, model_map = mapped
    read = ModelMap.from_json(model_map.to_json())
    node_fields = [f.name for f in fields(Block) if not f.compare]
    assert node_fields == ["input_node", "attn_add_node", "output_node"]
    read.blocks[0].input_node = "another_node"
    assert read == model_map
    read.blocks[0].attention.path = "elsewhere"
    assert read != model_map
