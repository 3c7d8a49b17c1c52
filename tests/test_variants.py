"""The variant registry: every method is one registered ``Variant`` object, and adding one is one
new module (here written to a temporary file) with nothing else edited."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

import vitcompress
from tests.models import FIXTURES, timm_small
from tests.test_search_cli import image_folder
from vitcompress.cli.main import cli
from vitcompress.compilation import plan as plan_module
from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.plan import Plan, PlanError
from vitcompress.training.losses import DistillationTaps
from vitcompress.variants import (
    VARIANTS,
    AttentionScorer,
    FuseOne,
    MatchingScorer,
    Merge,
    PredictorScorer,
    Squeeze,
    UnknownVariantError,
    get_variant,
    register_variant,
    unregister_variant,
    variant_names,
    variant_settings,
)
from vitcompress.variants.placement import AFTER_ATTENTION, BEFORE_BLOCK
from vitcompress.workflows.report import _variant_colour

SIZE = (3, 32, 32)

# A whole new method in one file, with a scorer and a fuse of its own: score the patch tokens by
# their norm before the block, keep the largest, and average the others into the kept token they
# lie nearest to on the grid.
ONE_FILE_METHOD = '''
"""normpool: keeps the ceil(rho * n) patch tokens of largest norm before a block and averages
each other token into the kept one nearest to it on the token axis."""

from dataclasses import dataclass

import torch
from torch import nn

from vitcompress.method import gather_tokens, keep_count, split_by_score
from vitcompress.modules.reducers import RecordsAssignment
from vitcompress.variants import Fuse, Scorer, Variant, register_variant
from vitcompress.variants.placement import BEFORE_BLOCK, COUNT_OF_PRESENT


@dataclass(frozen=True)
class NormScorer(Scorer):
    label: str = "token norm"
    placement: str = BEFORE_BLOCK
    keep_count: str = COUNT_OF_PRESENT

    def macs(self, cost):
        return cost.patch_tokens * cost.dim  # one squared norm per patch token


@dataclass(frozen=True)
class NearestAverage(Fuse):
    label: str = "averaged into the nearest kept token"

    def fuse(self, prefix, kept, pruned, pruned_scores, keep_index=None, prune_index=None):
        distance = (prune_index.unsqueeze(-1) - keep_index.unsqueeze(1)).abs()
        host_index = distance.argmin(dim=-1)  # (B, pruned)
        index = host_index.unsqueeze(-1).expand(-1, -1, kept.shape[-1])
        total = kept.scatter_add(1, index, pruned)
        count = torch.ones(kept.shape[:2]).scatter_add(1, host_index, torch.ones(host_index.shape))
        return torch.cat([prefix, total / count.unsqueeze(-1)], dim=1), host_index

    def macs(self, removed, kept, dim):
        return removed * dim  # one add per channel of every averaged token

    def explain(self, assignment, present, groups):
        kept = [present[i] for i in assignment.keep_index[0].tolist()]
        hosts = {pos: [] for pos in kept}
        pruned = [present[i] for i in assignment.prune_index[0].tolist()]
        for donor, host in zip(pruned, assignment.host_index[0].tolist()):
            hosts[kept[host]].append(donor)
        return hosts


class NormPool(RecordsAssignment, nn.Module):
    def __init__(self, prefix_tokens, keep_ratio, fuse):
        super().__init__()
        self.prefix_tokens, self.keep_ratio, self.fuse = prefix_tokens, keep_ratio, fuse

    def forward(self, x, keep_mask=None, positions=None, trace=()):
        p = self.prefix_tokens
        prefix, patches = x[:, :p], x[:, p:]
        k = keep_count(patches.shape[1], self.keep_ratio, "ceil")
        if k >= patches.shape[1]:
            return x, keep_mask, positions, trace
        keep_index, prune_index = split_by_score(patches.norm(dim=-1), k)
        keep_index, prune_index = keep_index.sort(dim=1).values, prune_index.sort(dim=1).values
        kept, pruned = gather_tokens(patches, keep_index), gather_tokens(patches, prune_index)
        tokens, host_index = self.fuse.fuse(prefix, kept, pruned, None, keep_index, prune_index)
        self._recorded(x, keep_index=keep_index, prune_index=prune_index, host_index=host_index)
        kept_positions = keep_index if positions is None else positions.gather(1, keep_index)
        removal = self._removal(keep_index, prune_index, host_index, pruned, tokens[:, p:], kept)
        return tokens, None, kept_positions, self._traced(trace, removal)


@dataclass(frozen=True, kw_only=True)
class NormPoolVariant(Variant):
    def build_reducer(self, block, location, plan):
        return NormPool(block.prefix_tokens, location.keep, self.fuse)


@register_variant
def normpool():
    return NormPoolVariant(
        name="normpool",
        summary="token norm before the block; the others averaged into the nearest kept token",
        scorer=NormScorer(),
        fuse=NearestAverage(),
        resorts_tokens=False,
        policies=("score",),
    )
'''


@pytest.fixture
def one_file_method(tmp_path: Path):
    path = tmp_path / "normpool_method.py"
    path.write_text(ONE_FILE_METHOD)
    spec = importlib.util.spec_from_file_location("normpool_method", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["normpool_method"] = module
    spec.loader.exec_module(module)  # registers it
    try:
        yield module
    finally:
        unregister_variant("normpool")
        del sys.modules["normpool_method"]


def test_the_built_in_variants_are_registered_objects() -> None:
    assert variant_names()[:5] == ["dtps", "dynamicvit", "etps", "evit", "tome"]
    assert plan_module.VARIANTS is VARIANTS  # the old name is the registry's view
    dtps, evit, tome = get_variant("dtps"), get_variant("evit"), get_variant("tome")
    assert (dtps.placement, dtps.scorer, dtps.fuse, dtps.learned) == (
        BEFORE_BLOCK,
        PredictorScorer(),
        Squeeze(),
        True,
    )
    assert (evit.placement, evit.scorer, evit.fuse, evit.learned) == (
        AFTER_ATTENTION,
        AttentionScorer(),
        FuseOne(),
        False,
    )
    assert (tome.placement, tome.scorer, tome.fuse, tome.tracks_sizes) == (
        AFTER_ATTENTION,
        MatchingScorer(),
        Merge(),
        True,
    )
    # What callers ask, answered by the parts.
    assert dtps.fused_kernel and tome.fused_kernel and not evit.fused_kernel
    assert dtps.keeps_grid_positions and not evit.keeps_grid_positions
    assert all(v.searchable for v in (dtps, evit, tome))
    assert tome.settings == {} and get_variant("tome", {"r": 4}).settings == {"r": 4}
    assert variant_settings("tome") == {
        "r": None,
        "restore": "delta",
        "carry_windows": False,
        "carry_branches": True,
        "kept_multiple": None,
    }
    assert variant_settings("dtps") == {
        "restore": "delta",
        "window_sizes": False,
        "carry_windows": False,
        "carry_branches": True,
        "kept_multiple": None,
    }
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
    assert plan.method is get_variant("etps") and plan.method.scorer == AttentionScorer()
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


def test_adding_a_method_is_one_file(one_file_method, tmp_path) -> None:
    """A method with its own scorer and fuse, defined in one file, goes through compress, apply,
    search, visualize, report and export with nothing else edited."""
    torch.manual_seed(0)
    model = timm_small("vit_small_patch16_224").eval()
    image = torch.randn(2, *SIZE)
    compressed = vitcompress.compress(model, "normpool", keep=0.5, locs=[1]).eval()
    seen = []
    compressed.tps.get_submodule("0").register_forward_hook(
        lambda module, args, output: seen.append(output[0].shape[1])
    )
    with torch.no_grad():
        out = compressed(image)
        same = vitcompress.compress(model, "normpool", keep=1.0, locs=[1]).eval()(image)
        base = model(image)
    assert seen == [1 + 32]  # cls + ceil(0.5 * 64) patch tokens
    assert out.shape == base.shape and not torch.allclose(out, base, atol=1e-4)
    assert torch.allclose(same, base, atol=1e-6)

    # apply: offered and run through the same choices, its MACs counted.
    runner = CliRunner()
    assert "normpool" in runner.invoke(cli, ["apply", "--help"]).output
    tiny = ["--model", f"{FIXTURES}:mha_vit", "--model-arg", "depth=4", "--model-arg", "dim=32"]
    art = tmp_path / "art"
    applied = runner.invoke(
        cli,
        [*("apply", *tiny, "--variant", "normpool", "--keep", "0.5", "--locs", "1"),
         *("--no-throughput", "--out", str(art), "--json")],
    )  # fmt: skip
    assert applied.exit_code == 0, applied.output
    data = json.loads(applied.stdout)
    assert data["plan"]["variant"] == "normpool"
    assert data["compressed"]["gmacs"] < data["base"]["gmacs"]
    (tmp_path / "apply.json").write_text(applied.stdout)

    # search: its scorer and fuse give its MACs, so it is searched, and they match the count.
    searched = runner.invoke(
        cli,
        [*("search", *tiny, "--data", str(image_folder(tmp_path / "data"))),
         *("--max-gmacs-ratio", "0.8", "--variants", "normpool", "--calib-images", "8"),
         *("--max-candidates", "3", "--batch-size", "4", "--out", str(tmp_path / "s"), "--json")],
    )  # fmt: skip
    assert searched.exit_code == 0, searched.output
    found = json.loads(searched.stdout)
    assert found["best"]["variant"] == "normpool" and not found["space"]["left_out"]
    assert found["macs_check"]["max_relative_error"] < 0.01, found["macs_check"]

    # visualize: the assignment its reducer recorded, as its fuse explains it.
    rows, cols = np.mgrid[0:32, 0:32]
    pixels = np.stack([cols * 7, rows * 7, (rows // 8 % 2) * 200], axis=-1).astype(np.uint8)
    Image.fromarray(pixels).save(tmp_path / "image.png")
    shown = runner.invoke(
        cli,
        [*("visualize", "--model", str(art), "--image", str(tmp_path / "image.png")),
         *("--out", str(tmp_path / "v.png"), "--json")],
    )  # fmt: skip
    assert shown.exit_code == 0, shown.output
    (location,) = json.loads(shown.stdout)["locations"]
    members = sorted(m for group in location["hosts"].values() for m in group)
    assert members == sorted(location["pruned"]) and len(location["kept"]) == 32
    for host, group in location["hosts"].items():  # each went to its nearest kept token
        for donor in group:
            assert all(abs(donor - int(host)) <= abs(donor - k) for k in location["kept"])

    # the list of methods, read from its object.
    listed = runner.invoke(cli, ["variants", "--json"])
    assert listed.exit_code == 0, listed.output
    rows = {row["name"]: row for row in json.loads(listed.stdout)["variants"]}
    assert rows["normpool"]["scorer"] == "token norm" and rows["normpool"]["searchable"]
    assert rows["normpool"]["fuse"] == "averaged into the nearest kept token"
    assert rows["tome"]["settings"] == {
        "r": None,
        "restore": "delta",
        "carry_windows": False,
        "carry_branches": True,
        "kept_multiple": None,
    }
    assert rows["dtps"]["fused_kernel"]

    # report and export.
    report = runner.invoke(cli, ["report", str(tmp_path / "apply.json"), "--json"])
    assert report.exit_code == 0, report.output
    assert any(row["variant"] == "normpool" and row["keep"] == "0.5" for row in
               json.loads(report.stdout)["rows"])  # fmt: skip
    exported = runner.invoke(
        cli,
        [*("export", "--model", str(art), "--format", "onnx", "--out", str(tmp_path / "m.onnx")),
         *("--batch-size", "2", "--json")],
    )  # fmt: skip
    assert exported.exit_code == 0, exported.output
    assert json.loads(exported.stdout)["max_abs_diff"] <= 1e-4


def test_an_unregistered_method_is_not_offered() -> None:
    result = CliRunner().invoke(
        cli, ["apply", "--model", f"{FIXTURES}:mha_vit", "--variant", "normpool"]
    )
    assert result.exit_code == 2 and "'normpool' is not one of" in result.output


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
