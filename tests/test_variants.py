"""The variant registry: every method is one registered ``Variant`` object, and adding one is one
new module (here written to a temporary file) with nothing else edited."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import vitcompress
from tests.models import FIXTURES, timm_small
from vitcompress.cli.main import cli
from vitcompress.graph import plan as plan_module
from vitcompress.graph.plan import Plan, PlanError
from vitcompress.metadata import compression_info
from vitcompress.training.losses import DistillationTaps
from vitcompress.variants import (
    VARIANTS,
    UnknownVariantError,
    get_variant,
    register_variant,
    unregister_variant,
    variant_names,
)
from vitcompress.variants.base import AFTER_ATTENTION, BEFORE_BLOCK
from vitcompress.workflows.report import _variant_colour

SIZE = (3, 32, 32)

# A whole new method in one file: keep the tokens the cls attends to most, drop the others.
ONE_FILE_METHOD = '''
"""attndrop: keeps ceil(rho * n) tokens by cls attention after the attention residual; drops
the rest (EViT without its fused token)."""

import math
from dataclasses import dataclass

import torch
from torch import nn

from vitcompress.method import gather_tokens, split_by_score
from vitcompress.variants import register_variant
from vitcompress.variants.base import (
    AFTER_ATTENTION,
    ATTENTION_GIVES_SCORE,
    COUNT_OF_PRESENT,
    Variant,
)


class DropByAttention(nn.Module):
    def __init__(self, prefix_tokens, keep_ratio):
        super().__init__()
        self.prefix_tokens = prefix_tokens
        self.keep_ratio = keep_ratio

    def forward(self, x, scores, keep_mask=None, positions=None):
        p = self.prefix_tokens
        k = max(1, math.ceil(self.keep_ratio * (x.shape[1] - p)))
        keep = split_by_score(scores, k)[0].sort(dim=1).values
        kept_positions = keep if positions is None else torch.gather(positions, 1, keep)
        return torch.cat([x[:, :p], gather_tokens(x[:, p:], keep)], 1), None, kept_positions


@dataclass(frozen=True, kw_only=True)
class AttentionDrop(Variant):
    def build_reducer(self, block, location, plan):
        return DropByAttention(block.prefix_tokens, location.keep)


@register_variant
def attndrop():
    return AttentionDrop(
        name="attndrop",
        summary="cls attention inside the block; pruned tokens dropped",
        placement=AFTER_ATTENTION,
        scorer="attention",
        fuse="drop",
        learned=False,
        keep_count=COUNT_OF_PRESENT,
        resorts_tokens=False,
        attention_gives=ATTENTION_GIVES_SCORE,
    )
'''


@pytest.fixture
def one_file_method(tmp_path: Path):
    path = tmp_path / "attndrop_method.py"
    path.write_text(ONE_FILE_METHOD)
    spec = importlib.util.spec_from_file_location("attndrop_method", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["attndrop_method"] = module
    spec.loader.exec_module(module)  # registers it
    try:
        yield module
    finally:
        unregister_variant("attndrop")
        del sys.modules["attndrop_method"]


def test_the_built_in_variants_are_registered_objects() -> None:
    assert variant_names()[:5] == ["dtps", "dynamicvit", "etps", "evit", "tome"]
    assert plan_module.VARIANTS is VARIANTS  # the old name is the registry's view
    dtps, evit, tome = get_variant("dtps"), get_variant("evit"), get_variant("tome")
    assert (dtps.placement, dtps.scorer, dtps.fuse, dtps.learned) == (
        BEFORE_BLOCK,
        "predictor",
        "squeeze",
        True,
    )
    assert (evit.placement, evit.scorer, evit.fuse, evit.learned) == (
        AFTER_ATTENTION,
        "attention",
        "evit",
        False,
    )
    assert (tome.placement, tome.scorer, tome.fuse, tome.tracks_sizes) == (
        AFTER_ATTENTION,
        "matching",
        "merge",
        True,
    )
    assert "ratio" in dtps.losses and "ratio" not in evit.losses
    assert dtps.keep_tokens(196, 0.49) == 96 and evit.keep_tokens(196, 0.49) is None


def test_the_registry_is_read_only_and_refuses_a_second_name() -> None:
    with pytest.raises(TypeError):
        VARIANTS["dtps"] = get_variant("etps")  # type: ignore[index]
    with pytest.raises(ValueError, match="already registered"):
        register_variant(lambda: get_variant("etps"))
    with pytest.raises(UnknownVariantError, match="'nope' is unknown; choose from dtps, "):
        get_variant("nope")
    model = timm_small("vit_small_patch16_224")
    with pytest.raises(PlanError, match="variant 'nope' is unknown; choose from dtps"):
        vitcompress.compress(model, "nope")


def test_plans_ask_their_variant_and_keep_their_json() -> None:
    model = timm_small("vit_small_patch16_224")
    compressed = vitcompress.compress(model, "etps", keep=0.7)
    plan = compression_info(compressed).plan
    assert plan.method is get_variant("etps") and plan.scorer == "attention"
    data = plan.to_json()
    # Only ToMe's locations carry merge_tokens: the others' JSON is as before, and JSON without
    # it (every artifact saved before) reads back.
    assert all("merge_tokens" not in loc for loc in data["locations"])
    assert Plan.from_json(json.loads(json.dumps(data))) == plan
    tome = compression_info(vitcompress.compress(model, "tome", keep=0.7)).plan.to_json()
    assert all(isinstance(loc["merge_tokens"], int) for loc in tome["locations"])


def test_losses_and_report_ask_the_variant() -> None:
    model = timm_small("vit_small_patch16_224")
    for name, learned in (("dtps", True), ("dynamicvit", True), ("etps", False), ("tome", False)):
        taps = DistillationTaps(vitcompress.compress(model, name), None, token_distill=False)
        assert taps.learned is learned, name
    slots = [_variant_colour(name) for name in ("dtps", "etps", "dynamicvit", "evit", "tome")]
    assert slots == [0, 1, 2, 3, 4] and _variant_colour("none") == len(VARIANTS)


def test_adding_a_method_is_one_file(one_file_method) -> None:
    torch.manual_seed(0)
    model = timm_small("vit_small_patch16_224").eval()
    image = torch.randn(2, *SIZE)
    compressed = vitcompress.compress(model, "attndrop", keep=0.5, locs=[1]).eval()
    seen = []
    compressed.tps.get_submodule("0").register_forward_hook(
        lambda module, args, output: seen.append(output[0].shape[1])
    )
    with torch.no_grad():
        out = compressed(image)
        same = vitcompress.compress(model, "attndrop", keep=1.0, locs=[1]).eval()(image)
        base = model(image)
    assert seen == [1 + 32]  # cls + ceil(0.5 * 64) patch tokens
    assert out.shape == base.shape and not torch.allclose(out, base, atol=1e-4)
    assert torch.allclose(same, base, atol=1e-6)
    # The command line offers it and runs it, through the same choices.
    runner = CliRunner()
    assert "attndrop" in runner.invoke(cli, ["apply", "--help"]).output
    result = runner.invoke(
        cli,
        [
            "apply",
            "--model",
            f"{FIXTURES}:mha_vit",
            "--model-arg",
            "depth=2",
            "--variant",
            "attndrop",
            "--keep",
            "0.5",
            "--no-throughput",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["plan"]["variant"] == "attndrop"


def test_an_unregistered_method_is_not_offered() -> None:
    result = CliRunner().invoke(
        cli, ["apply", "--model", f"{FIXTURES}:mha_vit", "--variant", "attndrop"]
    )
    assert result.exit_code == 2 and "'attndrop' is not one of" in result.output


@pytest.mark.parametrize(
    "name, keep, keep_tokens, merge_tokens, present, after",
    [
        ("dtps", 0.5, 32, None, 64, 32),  # the plan's static count
        ("dtps", 0.5, 32, None, 20, 20),  # never more than were present
        ("dynamicvit", 0.7, 44, None, 64, 44),
        ("etps", 0.5, None, None, 63, 32),  # ceil(0.5 * 63) of those present
        ("etps", 0.99, None, None, 4, 4),  # ceil rounds up to all: nothing removed
        ("evit", 0.5, None, None, 63, 33),  # plus the one fused token
        ("evit", 0.7, None, None, 4, 4),  # ceil(2.8) = 3, plus 1 fused: 4, nothing removed
        ("tome", 0.7, None, 13, 64, 51),  # r merged
    ],
)
def test_tokens_after_a_location(name, keep, keep_tokens, merge_tokens, present, after):
    location = plan_module.Location(
        block=1,
        stage=0,
        step=1,
        keep=keep,
        cumulative_keep=keep,
        patch_tokens=64,
        keep_tokens=keep_tokens,
        merge_tokens=merge_tokens,
    )
    assert get_variant(name).tokens_after(present, location) == after
