"""What a compressed model carries, read back typed: ``ModelMap.from_json``, ``Plan.from_json``
and ``compression_info(model)``."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import timm
import torch

import vitcompress
from tests.fixtures import inhouse
from tests.models import FIXTURES, SMALL
from vitcompress.analysis.model_map import ModelMap
from vitcompress.api import capture_and_map, compress_loaded
from vitcompress.artifacts.artifact import ArtifactError
from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.placement import default_locs, reduces_tokens
from vitcompress.compilation.plan import Plan, make_plan
from vitcompress.compilation.rewrite import RewriteError, rewrite
from vitcompress.loading import ModelLoadError, load_base_model
from vitcompress.variants import get_variant

MHA = f"{FIXTURES}:mha_vit"
MHA_ARGS = {"dim": 32, "depth": 4}
SIZE = (3, 32, 32)


def _cait() -> torch.nn.Module:
    return timm.create_model("cait_xxs24_224", **{**SMALL, "depth": 4})  # + 2 class-attention


@pytest.mark.parametrize(
    "factory, size",
    [
        (lambda: inhouse.mha_vit(**MHA_ARGS), SIZE),
        (inhouse.tiny_pyramid, (3, 64, 64)),  # stages, grid ops, exits
        (_cait, SIZE),  # class-attention blocks: query and key tokens matter
    ],
)
def test_a_model_map_reads_back_what_it_wrote(factory, size) -> None:
    torch.manual_seed(0)
    model_map = vitcompress.map_model(factory().eval(), size)
    written = model_map.to_json()
    read = ModelMap.from_json(written)
    assert read.to_json() == written
    assert [reduces_tokens(b) for b in read.blocks] == [reduces_tokens(b) for b in model_map.blocks]
    assert default_locs(read) == default_locs(model_map)
    assert [s.grid for s in read.stages] == [s.grid for s in model_map.stages]
    assert [len(b.grid_ops) for b in read.blocks] == [len(b.grid_ops) for b in model_map.blocks]
    assert model_map.has_nodes and not read.has_nodes


def test_a_map_read_back_cannot_rewrite_a_graph() -> None:
    captured, model_map = capture_and_map(inhouse.mha_vit(**MHA_ARGS).eval(), SIZE)
    plan = make_plan(model_map, get_variant("etps"), [0.5], [1])
    with pytest.raises(RewriteError, match="names no graph nodes"):
        rewrite(captured.module, ModelMap.from_json(model_map.to_json()), plan)


def test_compression_info_of_a_compressed_model_and_its_copy() -> None:
    base = inhouse.mha_vit(**MHA_ARGS).eval()
    assert compression_info(base) is None
    compressed = vitcompress.compress(base, "dtps", keep=0.5, locs=[1, 2], input_size=SIZE)
    for model in (compressed, copy.deepcopy(compressed)):  # EMA copies are deepcopies
        info = compression_info(model)
        assert isinstance(info.plan, Plan) and isinstance(info.model_map, ModelMap)
        assert info.plan == make_plan(
            vitcompress.map_model(base, SIZE), get_variant("dtps"), [0.5], [1, 2]
        )
        assert info.plan.locs == [1, 2] and info.plan.locations[1].cumulative_keep == 0.25
        assert [b.tokens for b in info.model_map.blocks] == [65] * 4
        assert info.model_map.final_norm == "final_ln"
        assert info.input_size == SIZE and info.source is None and info.artifact is None


def test_compression_info_names_source_and_artifact(tmp_path: Path) -> None:
    loaded = load_base_model(MHA, MHA_ARGS, input_size=SIZE)
    compressed = compress_loaded(loaded, "etps", keep=0.5, locs=[1]).model
    info = compression_info(compressed)
    assert info.source == loaded.source and info.artifact is None
    vitcompress.save(compressed, tmp_path / "art")
    info = compression_info(vitcompress.load(tmp_path / "art"))
    assert info.artifact == (tmp_path / "art").resolve()
    assert info.source.spec == loaded.source.spec and info.plan == compression_info(compressed).plan


def test_a_model_missing_its_map_is_refused_in_one_line(tmp_path: Path) -> None:
    compressed = vitcompress.compress(
        inhouse.mha_vit(**MHA_ARGS), "etps", keep=0.5, locs=[1], input_size=SIZE
    )
    del compressed.vitcompress_map
    with pytest.raises(ModelLoadError, match="no model map") as raised:
        compression_info(compressed)
    assert "\n" not in str(raised.value)
    with pytest.raises(ArtifactError, match=r"cannot save .*no model map"):
        vitcompress.save(compressed, tmp_path / "art", source=MHA)
    assert not (tmp_path / "art").exists()
