"""Video ViTs: token grids of any rank. A Conv3d tubelet embedding's (B, C, T, H, W) output,
flattened to (B, T*H*W, C) tokens, gives the stage the grid (T', H', W'); channels-last grids
(B, T, H, W, C) too. The in-house video classifier is exact at keep 1 with every variant and
cheaper at keep 0.7; HF VideoMAE loads from a save_pretrained directory, maps and compresses;
``--input-size`` takes the model's input of any rank (without the batch dim)."""

from __future__ import annotations

import math

import pytest
import torch
from click.testing import CliRunner

import vitcompress
from tests.fixtures import video_models as vm
from vitcompress.analysis.model_map import ModelMap
from vitcompress.api import load_model
from vitcompress.cli.main import cli
from vitcompress.cli.options import parse_input_size
from vitcompress.loading import ModelLoadError, ModelSource
from vitcompress.measure import count_macs

VIDEO = f"{vm.__file__}:video_vit"
VARIANTS = ("dtps", "etps", "tome", "dynamicvit", "evit")


def _one_line(error: BaseException) -> None:
    assert "\n" not in str(error), str(error)


def _video(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, *vm.INPUT_SIZE, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def classifier():
    """The in-house video classifier (cls token, cls head), sharpened."""
    torch.manual_seed(0)
    return vm.sharpen(vm.video_vit())


# --- the grid --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},  # cls token, cls head
        {"cls_token": False, "pool": "mean"},
        {"channels_last": True},  # the grid normed as (B, T, H, W, C) before the flatten
    ],
    ids=["cls", "mean-pool", "channels-last"],
)
def test_the_inhouse_video_vit_maps_to_its_t_h_w_grid(kwargs):
    model_map = vitcompress.map_model(vm.video_vit(**kwargs).eval())
    assert model_map.grid == vm.GRID == (3, 4, 6)
    assert len(model_map.blocks) == 4
    assert all(block.grid == vm.GRID for block in model_map.blocks)
    prefix = 0 if kwargs.get("cls_token") is False else 1
    assert model_map.prefix_tokens == prefix
    assert model_map.blocks[0].tokens == math.prod(vm.GRID) + prefix
    assert model_map.input_size == vm.INPUT_SIZE
    # The grid goes through JSON and back with its rank.
    again = ModelMap.from_json(model_map.to_json())
    assert again.grid == vm.GRID and again.blocks[0].grid == vm.GRID
    assert again.input_size == vm.INPUT_SIZE


def test_a_conv3d_inside_the_blocks_is_a_grid_op_on_the_t_h_w_grid():
    model_map = vitcompress.map_model(vm.hybrid_video_vit().eval())
    assert model_map.grid == vm.GRID
    ops = model_map.blocks[0].grid_ops
    assert [(op.kind, op.path, op.grid) for op in ops] == [("conv", "blocks.0.mlp.conv", vm.GRID)]
    assert ops[0].from_grid_node is not None  # flattened back at the same resolution
    assert ModelMap.from_json(model_map.to_json()).blocks[0].grid_ops[0].grid == vm.GRID


# --- compression of the in-house classifier ---------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_keep_one_is_exact_and_keep_0_7_is_cheaper(classifier, variant):
    x = _video()
    with torch.no_grad():
        base = classifier(x)
        same = vitcompress.compress(classifier, variant, keep=1.0).eval()(x)
    assert torch.allclose(same, base, rtol=1e-5, atol=1e-5), float((same - base).abs().max())

    reduced = vitcompress.compress(classifier, variant, keep=0.7).eval()
    with torch.no_grad():
        assert reduced(x).shape == base.shape
    assert count_macs(reduced, vm.INPUT_SIZE) < 0.85 * count_macs(classifier, vm.INPUT_SIZE)


def test_a_compressed_video_model_saves_and_loads_with_its_input_size(tmp_path):
    torch.manual_seed(0)
    small = vitcompress.compress(vm.video_vit(), "etps", keep=0.7).eval()
    vitcompress.save(small, tmp_path / "art", source=ModelSource(spec=VIDEO))
    loaded = load_model(str(tmp_path / "art"))
    assert loaded.input_size == vm.INPUT_SIZE
    x = _video()
    with torch.no_grad():
        assert torch.allclose(loaded.model(x), small(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ("dtps", "etps"))
def test_the_video_hybrid_pads_its_conv3d_grid_exact_at_keep_one(variant):
    torch.manual_seed(0)
    model = vm.sharpen(vm.hybrid_video_vit())
    x = _video()
    with torch.no_grad():
        base = model(x)
        same = vitcompress.compress(model, variant, keep=1.0).eval()(x)
        assert torch.allclose(same, base, rtol=1e-5, atol=1e-5)
        reduced = vitcompress.compress(model, variant, keep=0.7).eval()
        assert reduced(x).shape == base.shape
    assert count_macs(reduced, vm.INPUT_SIZE) < count_macs(model, vm.INPUT_SIZE)


# --- HuggingFace VideoMAE -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def videomae_dirs(tmp_path_factory):
    """save_pretrained directories of a VideoMAE classifier and of the bare VideoMAEModel."""
    pytest.importorskip("transformers")
    from tests.fixtures import hf_models

    root = tmp_path_factory.mktemp("videomae")
    dirs = {}
    for name, classifier in (("classifier", True), ("model", False)):
        model = hf_models.sharpen(vm.videomae(classifier=classifier))
        model.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


@pytest.mark.parametrize("name", ["classifier", "model"])
def test_videomae_loads_through_the_hf_path_and_maps_its_grid(videomae_dirs, name):
    loaded = load_model(str(videomae_dirs[name]))
    # num_frames, num_channels, image_size: its pixel_values are (B, T, C, H, W).
    assert loaded.input_size == vm.VIDEOMAE_INPUT
    model_map = vitcompress.map_model(loaded.model, loaded.input_size)
    assert model_map.grid == vm.VIDEOMAE_GRID
    assert len(model_map.blocks) == 4 and model_map.prefix_tokens == 0


@pytest.mark.parametrize("variant", ("dtps", "etps", "tome"))
def test_videomae_classifier_exact_at_keep_one_cheaper_at_0_7(videomae_dirs, variant):
    loaded = load_model(str(videomae_dirs["classifier"]))
    size = loaded.input_size
    x = torch.randn(2, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = loaded.model(x)
        same = vitcompress.compress(loaded.model, variant, keep=1.0, input_size=size).eval()(x)
        assert torch.allclose(same, base, rtol=1e-5, atol=1e-5)
        reduced = vitcompress.compress(loaded.model, variant, keep=0.7, input_size=size).eval()
        assert reduced(x).shape == base.shape
    assert count_macs(reduced, size) < count_macs(loaded.model, size)


@pytest.mark.parametrize("variant", ("dtps", "tome"))
def test_videomae_model_whose_output_is_the_token_sequence_gets_it_back_in_full(
    videomae_dirs, variant
):
    """VideoMAEModel's output is its last_hidden_state, the (T'*H'*W') tokens in grid order: the
    restore brings the full token set back (dtps re-sorts the tokens even at keep 1)."""
    loaded = load_model(str(videomae_dirs["model"]))
    size = loaded.input_size
    x = torch.randn(2, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = loaded.model(x)
        assert base.shape == (2, math.prod(vm.VIDEOMAE_GRID), 64)
        same = vitcompress.compress(loaded.model, variant, keep=1.0, input_size=size).eval()(x)
        assert torch.allclose(same, base, rtol=1e-5, atol=1e-5)
        reduced = vitcompress.compress(loaded.model, variant, keep=0.7, input_size=size).eval()
        assert reduced(x).shape == base.shape
    assert count_macs(reduced, size) < count_macs(loaded.model, size)


# --- input sizes of any rank ------------------------------------------------------------------


def test_input_sizes_of_rank_four_parse():
    assert parse_input_size("3,16,224,224") == (3, 16, 224, 224)
    assert parse_input_size(" 16, 3,224,224 ") == (16, 3, 224, 224)
    assert parse_input_size("3,224,224") == (3, 224, 224)


@pytest.mark.parametrize("text", ["3,16,224,x", "3,16,0,224", "3,224", "3,16,224,224,"])
def test_a_malformed_input_size_is_one_line(text):
    with pytest.raises(ModelLoadError, match="C,H,W") as info:
        parse_input_size(text)
    _one_line(info.value)


def test_load_model_and_compress_take_a_rank_four_input_size(classifier):
    loaded = load_model(VIDEO, input_size=vm.INPUT_SIZE)
    assert loaded.input_size == vm.INPUT_SIZE
    with pytest.raises(ModelLoadError, match="three positive integers"):
        load_model(VIDEO, input_size=(3, 6))
    # Sizes of a rank the model does not take, or in another order, are the model's to refuse.
    for wrong in ((3, 6, 32), (6, 3, 32, 48)):
        text = ",".join(map(str, wrong))
        with pytest.raises(ModelLoadError, match=f"does not run on --input-size {text}") as info:
            load_model(VIDEO, input_size=wrong)
        _one_line(info.value)
    small = vitcompress.compress(classifier, "etps", keep=0.7, input_size=vm.INPUT_SIZE)
    assert count_macs(small, vm.INPUT_SIZE) < count_macs(classifier, vm.INPUT_SIZE)


def test_the_cli_takes_a_video_input_size_and_refuses_a_malformed_one(tmp_path):
    runner = CliRunner()
    ok = runner.invoke(cli, ["inspect", "--model", VIDEO, "--input-size", "3,6,32,48", "--json"])
    assert ok.exit_code == 0, ok.output
    assert '"grid": [\n    3,\n    4,\n    6\n  ]' in ok.output or "[3, 4, 6]" in ok.output
    bad = runner.invoke(cli, ["inspect", "--model", VIDEO, "--input-size", "3,6,32,x"])
    assert bad.exit_code == 2
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "3,6,32,x" in lines[0]
    assert "Traceback" not in bad.output


def test_visualize_refuses_a_video_model_in_one_line(classifier):
    from vitcompress.workflows.visualize import VisualizeError, record_locations

    small = vitcompress.compress(classifier, "etps", keep=0.7).eval()
    with pytest.raises(VisualizeError, match="3x4x6") as info:
        record_locations(small, _video()[:1])
    _one_line(info.value)


def test_attention_scores_of_pooled_keys_on_a_3d_grid_are_refused_at_the_plan():
    """eTPS/EViT spread pooled keys' scores to the tokens they cover on a 2-D grid only: on a
    video grid that attention is refused in one line before any forward, not at run time."""
    from types import SimpleNamespace

    from vitcompress.variants import get_variant

    def block(grid):
        attention = SimpleNamespace(key_tokens=8, kind="sdpa", path="blocks.0.attn")
        return SimpleNamespace(
            index=0,
            path="blocks.0",
            tokens=48,
            grid=grid,
            attention=attention,
            score_blocker=None,
            windows=None,
        )

    plan = SimpleNamespace(locations=[SimpleNamespace(block=0)], variant="etps")
    for name in ("etps", "evit"):
        scorer = get_variant(name).scorer
        line = scorer.refusal(SimpleNamespace(blocks=[block((3, 4, 4))]), plan)
        assert line is not None and "\n" not in line and "3-D token grid (3, 4, 4)" in line
        assert scorer.refusal(SimpleNamespace(blocks=[block((4, 12))]), plan) is None
