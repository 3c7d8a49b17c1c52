"""A zoo model takes the caller's arguments over its size's (PVT's ``depths`` too), and one
built for another input (``img_size``, ``in_chans``) states that input in its timm config, so
that loading runs, measures and evaluates it there, not at the registered weights' 3 x 224 x
224."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.data import resolve_model_data_config

import vitcompress.zoo  # noqa: F401  (registers the zoo)
from vitcompress.loading import load_base_model

SMALL = {"depths": (1, 1, 1, 1)}


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("pvt_tiny", {"img_size": 64, "in_chans": 1, **SMALL}, (1, 64, 64)),
        ("cvt_13", {"img_size": 48, "in_chans": 2, "depths": (1, 1, 1)}, (2, 48, 48)),
        ("segmenter_tiny_fmnist", {"img_size": 32, "depth": 1}, (1, 32, 32)),
    ],
)
def test_the_input_it_is_built_for_is_the_input_it_states(name, args, expected):
    loaded = load_base_model(name, args)
    assert loaded.input_size == expected
    assert tuple(resolve_model_data_config(loaded.model)["input_size"]) == expected
    with torch.no_grad():
        out = loaded.model(torch.randn(2, *expected))
    assert out.shape[0] == 2


def test_pvt_built_for_64_px_is_not_run_at_224_on_resampled_positions():
    loaded = load_base_model("pvt_tiny", {"img_size": 64, **SMALL})
    # Its position tables are laid out for the 16 x 16 grid of a 64 px input.
    assert tuple(loaded.model.pos_embed1.shape[1:2]) == (16 * 16,)
    assert loaded.input_size == (3, 64, 64)


def test_the_registered_sizes_and_an_overlay_of_the_callers_are_kept():
    assert load_base_model("pvt_tiny", SMALL).input_size == (3, 224, 224)
    assert timm.create_model("cvt_w24", depths=(1, 1, 1)).pretrained_cfg["input_size"] == (
        3,
        384,
        384,
    )
    model = timm.create_model(
        "pvt_tiny", img_size=64, pretrained_cfg_overlay={"input_size": (3, 96, 96)}, **SMALL
    )
    assert model.pretrained_cfg["input_size"] == (3, 96, 96)


def test_pvt_takes_the_callers_depths_over_its_sizes():
    model = timm.create_model("pvt_small", depths=(1, 2, 1, 1), img_size=32)
    assert [len(getattr(model, f"block{i}")) for i in range(1, 5)] == [1, 2, 1, 1]
    assert len(load_base_model("pvt_large", SMALL).model.block3) == 1
