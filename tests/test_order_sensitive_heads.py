"""A head that reads the last stage's tokens by position (a flatten of all tokens into one
feature vector, or a fixed patch token) would silently change after a reduction (dTPS re-sorts
the tokens even at keep 1): the analysis finds the op, and the compressed model restores the full
token set in the base's order before it. Pooling heads and cls heads need no restore."""

from __future__ import annotations

import pytest
import torch

import vitcompress
from tests.fixtures import edge_case_vits
from vitcompress import map_model
from vitcompress.analysis.analyse import MappingError
from vitcompress.modules.restore import TokenRestore

VARIANTS = ["dtps", "etps", "dynamicvit", "evit", "tome"]
SIZE = (3, 32, 32)


def _model(factory):
    torch.manual_seed(0)
    model = factory().eval()
    with torch.no_grad():  # sharper attention: a misplaced token shows in the logits
        for name, weight in model.named_parameters():
            if "qkv.weight" in name:
                weight.mul_(3.0)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "factory, names",
    [
        (edge_case_vits.flatten_head_vit, "flatten (flatten_1) merges the token axis of (65, 32)"),
        (
            edge_case_vits.patch_token_head_vit,
            "getitem (getitem_25) reads token(s) 5 of the 65 by position",
        ),
        (  # a negative start is counted from the end: these are not all the patch tokens
            edge_case_vits.last_tokens_head_vit,
            "reads token(s) slice(61, None, None) of the 65 by position",
        ),
    ],
)
def test_a_head_reading_tokens_by_position_gets_them_restored(factory, names, variant):
    model = _model(factory)
    x = torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))
    exact = vitcompress.compress(model, variant, keep=1.0, locs=[1], input_size=SIZE).eval()
    reduced = vitcompress.compress(model, variant, keep=0.7, locs=[1], input_size=SIZE).eval()
    with torch.no_grad():
        base = model(x)
        torch.testing.assert_close(exact(x), base, rtol=1e-4, atol=1e-5)
        assert reduced(x).shape == base.shape
    (restore,) = [m for m in reduced.modules() if isinstance(m, TokenRestore)]
    assert names in restore.where


def test_the_map_shows_the_head_s_reader_on_the_last_block():
    blocks = map_model(_model(edge_case_vits.flatten_head_vit), SIZE).to_json()["blocks"]
    (reader,) = blocks[-1]["readers"]
    assert reader["what"].startswith("flatten (flatten_1) merges the token axis")
    assert all(not b["readers"] for b in blocks[:-1])


def test_without_the_restore_the_flatten_head_gives_other_logits_at_keep_1(monkeypatch):
    """What the restore prevents: a mere re-sort (dTPS at keep 1) changes the logits."""
    model = _model(edge_case_vits.flatten_head_vit)
    monkeypatch.setattr(TokenRestore, "forward", lambda self, tokens, trace=(): tokens)
    resorted = vitcompress.compress(model, "dtps", keep=1.0, locs=[1], input_size=SIZE).eval()
    x = torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(x)
        assert (resorted(x) - base).abs().max() > 1e-3 * base.abs().max()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("factory", [edge_case_vits.mean_head_vit, edge_case_vits.TinyViT])
def test_order_free_heads_stay_exact_at_keep_1_and_reduce(factory, variant):
    model = _model(factory)
    x = torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))
    exact = vitcompress.compress(model, variant, keep=1.0, locs=[1], input_size=SIZE).eval()
    reduced = vitcompress.compress(model, variant, keep=0.7, locs=[1], input_size=SIZE).eval()
    with torch.no_grad():
        torch.testing.assert_close(exact(x), model(x), rtol=1e-4, atol=1e-5)
        assert reduced(x).shape == (2, 10)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "factory, attention",
    [
        (lambda: edge_case_vits.MapsViT(saliency=True), "blocks.3.attn"),
        # Multiplied block after block (from the identity): a product of maps is a map.
        (edge_case_vits.RolloutViT, "blocks.3.attn"),
    ],
    ids=["saliency", "rollout"],
)
def test_attention_maps_that_reach_the_output_are_refused_in_one_line(variant, factory, attention):
    # Their two token axes are the block's tokens: dTPS re-sorts them even at keep 1, every
    # method removes some below it, and nothing restores a map.
    with pytest.raises(MappingError) as refused:
        vitcompress.compress(factory(), variant, keep=1.0)
    assert str(refused.value).startswith(
        f"the attention maps of {attention} reach the model's output"
    )
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_maps_returned_by_blocks_but_dropped_do_not_stop_a_model(variant):
    model = _model(lambda: edge_case_vits.MapsViT(saliency=False))
    x = torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))
    exact = vitcompress.compress(model, variant, keep=1.0, locs=[1], input_size=SIZE).eval()
    with torch.no_grad():
        torch.testing.assert_close(exact(x), model(x), rtol=1e-4, atol=1e-5)


def test_attention_over_keys_joined_from_elsewhere_is_refused_in_one_line():
    # Learned memory tokens among the keys: no block attends over its own tokens alone.
    with pytest.raises(vitcompress.compilation.plan.PlanError) as refused:
        vitcompress.compress(edge_case_vits.memory_vit(), "etps", keep=0.7)
    assert str(refused.value) == (
        "locs 0 attends over 68 keys, more than its 65 tokens (keys joined from elsewhere, such "
        "as learned memory tokens): it has no tokens of its own to reduce; no block of this "
        "model attends over its own tokens alone"
    )
