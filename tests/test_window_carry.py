"""``carry_windows``: a windowed block after a location, in the same windows, reduces by the
location's choice instead of running whole. Runs of such blocks are found from the windows the
analysis read; keep 1 stays exact; a carried block runs its attention and MLP on the kept tokens
only, by the location's choice, for exactly the MACs a hand count gives; and a saved model
rebuilds the same carry."""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

from tests.test_windowed import swin
from tests.test_windowed_families import FAMILIES, _build, sharpen
from vitcompress import compress, map_model
from vitcompress.api import load, save
from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.placement import default_locs
from vitcompress.compilation.plan import Plan
from vitcompress.errors import UserError
from vitcompress.loading import ModelSource
from vitcompress.measure import count_macs
from vitcompress.variants import variant_names, variant_settings

METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")
CARRY = {"carry_windows": True}
SIZE = (3, 64, 64)


HIERA = dict(
    num_classes=10,
    embed_dim=32,
    stages=(1, 2, 4, 2),
    window_spec=(4, 4, 4, 2),
    global_att_blocks=(5,),
)


def hiera() -> nn.Module:
    """SAM2-Hiera at 64 x 64, stage grids 16, 8, 4, 2: block 0 in 16 windows of 4 x 4; blocks 1,
    3 and 7 pool their queries (left whole); block 2 in 4 windows; blocks 4, 5 and 6 one window
    of the 4 x 4 grid each (5 global): one run, mapped as blocks 2, 3 and 4; block 8 one 2 x 2
    window. The head drawn (timm starts it at zero)."""
    torch.manual_seed(0)
    model = timm.create_model("sam2_hiera_tiny", **HIERA)
    nn.init.normal_(model.head.fc.weight, std=0.2)
    return sharpen(model)


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return hiera()


def images(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1)).to(dtype)


def test_every_method_takes_the_setting_and_refuses_a_non_bool_in_one_line(model):
    for name in variant_names():
        assert variant_settings(name)["carry_windows"] is False
    with pytest.raises(UserError) as refused:
        compress(model, "etps", keep=[0.7], input_size=SIZE, variant_args={"carry_windows": 1})
    assert "\n" not in str(refused.value)
    assert "carry_windows: must be true or false, got 1" in str(refused.value)


def test_runs_of_the_same_windows_are_carried_from_their_first_block(model):
    model_map = map_model(model, SIZE)
    assert [b.path for b in model_map.blocks] == [f"blocks.{i}" for i in (0, 2, 4, 5, 6, 8)]
    assert default_locs(model_map) == [0, 1, 2, 3, 4, 5]
    assert default_locs(model_map, carry_windows=True) == [0, 1, 2, 5]
    plan = compression_info(
        compress(model, "etps", keep=[0.7], input_size=SIZE, variant_args=CARRY)
    ).plan
    assert [(loc.block, loc.carried) for loc in plan.locations] == [
        (0, ()),
        (1, ()),
        (2, (3, 4)),
        (5, ()),
    ]
    # A location inside a run makes its own choice, which the rest of the run carries.
    plan = compression_info(
        compress(model, "etps", keep=[0.7], locs=[2, 4], input_size=SIZE, variant_args=CARRY)
    ).plan
    assert [(loc.block, loc.carried) for loc in plan.locations] == [(2, (3,)), (4, ())]
    assert Plan.from_json(plan.to_json()).locations == plan.locations


def test_swin_carries_only_its_unshifted_one_window_stage():
    """Swin's shifted windows hold other tokens than the block before them: a run is one block,
    except in the last stage, one window wide, where blocks 2 and 3 share it."""
    plan = compression_info(
        compress(swin(), "dtps", keep=[0.7], input_size=(3, 56, 56), variant_args=CARRY)
    ).plan
    assert [(loc.block, loc.carried) for loc in plan.locations] == [(0, ()), (1, ()), (2, (3,))]


@pytest.mark.parametrize(
    "build, size",
    [(hiera, SIZE), (swin, (3, 56, 56))],  # Swin's carried block gathers its position table
    ids=["sam2_hiera", "swin"],
)
def test_keep_one_is_exact_on_sharpened_weights(build, size):
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        double = build().double()
        x = torch.randn(2, *size, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            base = double(x)
            for method in METHODS:
                out = compress(double, method, keep=[1.0], input_size=size, variant_args=CARRY)(x)
                assert (out - base).abs().max() <= 1e-9 * base.abs().max(), method
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_windowed_family_is_exact_at_keep_one_when_carrying(name):
    """Each family of test_windowed_families with every method it takes, carrying (NesT's last
    level: eight blocks of one window, read by its attention as (B, T, N, C))."""
    model, size = _build(name)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        double = model.double()
        x = torch.randn(2, *size, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            base = double(x)
            for method in FAMILIES[name][2]:
                out = compress(double, method, keep=[1.0], input_size=size, variant_args=CARRY)(x)
                assert (out - base).abs().max() <= 1e-9 * base.abs().max(), method
    finally:
        torch.set_default_dtype(default)


def _outputs(compressed: nn.Module, names: list[str]) -> dict[str, object]:
    """Each named submodule's output in one forward pass."""
    seen: dict[str, object] = {}
    modules = dict(compressed.named_modules())
    for name in names:
        modules[name].register_forward_hook(
            lambda m, i, o, name=name: seen.__setitem__(name, (i, o))
        )
    with torch.no_grad():
        compressed(images())
    return seen


@pytest.mark.parametrize("method", METHODS)
def test_a_carried_block_attends_over_the_locations_choice(model, method):
    """Blocks 3 and 4 carry block 2's choice: their attention gets the tokens of the one window
    that block 2's reducer kept, gathered from their own input, and no more."""
    compressed = compress(model, method, keep=[0.7], locs=[2], input_size=SIZE, variant_args=CARRY)
    seen = _outputs(compressed, ["tps.0", "tps_hooks.carry3", "tps_hooks.carry4"])
    location = seen["tps.0"][1][-1][-1]  # the record of the location's reducer
    kept = int(0.7 * 16) if method in ("dtps", "dynamicvit", "tome") else 12
    for block in (3, 4):
        (windows, trace), (tokens, keep_mask, positions, _) = seen[f"tps_hooks.carry{block}"]
        assert windows.shape[:2] == (2, 16) and keep_mask is None
        assert tokens.shape[:2] == (2, kept)
        assert torch.equal(positions, location.keep_index)
        gathered = windows.gather(1, location.keep_index[..., None].expand(-1, -1, 128))
        assert torch.equal(tokens, gathered)


def test_a_dropped_token_passes_a_carried_block_unchanged(model):
    """DynamicViT in a carried block: a dropped token gets no attention update (``zero``) and
    comes back from the MLP as it entered it (``value``), so it leaves the block as it entered;
    the kept ones change."""
    compressed = compress(
        model, "dynamicvit", keep=[0.7], locs=[2], input_size=SIZE, variant_args=CARRY
    )
    seen = _outputs(
        compressed, ["tps_hooks.unwindows2", "tps_hooks.unwindows3", "tps_hooks.carry3"]
    )
    entering = seen["tps_hooks.unwindows2"][1].flatten(1, 2)  # block 2's output, (B, 16, C)
    leaving = seen["tps_hooks.unwindows3"][1].flatten(1, 2)
    kept = seen["tps_hooks.carry3"][1][2]
    dropped = torch.ones(2, 16, dtype=torch.bool).scatter(1, kept, False)
    assert torch.equal(leaving[dropped], entering[dropped])
    assert not torch.allclose(leaving[~dropped], entering[~dropped])


@pytest.mark.parametrize("method", METHODS)
def test_carrying_saves_the_hand_counted_macs_of_the_carried_blocks(model, method):
    """Against the same location without carrying, blocks 3 and 4 (width 128, 16 tokens, MLP x4)
    each save, for the N - K tokens they no longer run: the q, k, v and output projections
    (4 C^2), the MLP (8 C^2), its norm (5 C, fvcore's convention), and 2 (N^2 - K^2) C of the
    attention's two products. The norm before the attention runs on every token."""
    carried = compress(model, method, keep=[0.7], locs=[2], input_size=SIZE, variant_args=CARRY)
    whole = compress(model, method, keep=[0.7], locs=[2], input_size=SIZE)
    width, tokens = 128, 16
    kept = int(0.7 * 16) if method in ("dtps", "dynamicvit", "tome") else 12
    per_block = (tokens - kept) * (12 * width * width + 5 * width) + 2 * (
        tokens**2 - kept**2
    ) * width
    assert count_macs(whole, SIZE) - count_macs(carried, SIZE) == 2 * per_block


def test_training_carries_the_predictors_mask(model):
    """While a predictor trains nothing leaves: a carried block masks the keys its location
    removed (the location's mask, with its gradient), and a step is finite."""
    compressed = compress(
        model, "dtps", keep=[0.7], locs=[2], input_size=SIZE, variant_args=CARRY
    ).train()
    seen = []
    carry = dict(compressed.named_modules())["tps_hooks.carry3"]
    carry.register_forward_hook(lambda m, i, o: seen.append((i, o)))
    loss = nn.functional.cross_entropy(compressed(images()), torch.tensor([1, 2]))
    loss.backward()
    assert torch.isfinite(loss)
    (windows, trace), (tokens, keep_mask, positions, _) = seen[0]
    assert tokens.shape == windows.shape and positions is None
    assert torch.equal(keep_mask, 1.0 - trace[-1].removed)
    # Gumbel's hard draws (their count is the ratio loss's to hold), straight-through.
    assert set(keep_mask.unique().tolist()) == {0.0, 1.0} and keep_mask.requires_grad


def test_a_saved_model_rebuilds_the_same_carry(model, tmp_path):
    compressed = compress(model, "etps", keep=[0.7], input_size=SIZE, variant_args=CARRY).eval()
    save(compressed, tmp_path / "carried", source=ModelSource("sam2_hiera_tiny", model_args=HIERA))
    loaded = load(tmp_path / "carried")
    assert compression_info(loaded).plan.locations == compression_info(compressed).plan.locations
    assert "carry3" in dict(loaded.named_modules())["tps_hooks"]._modules
    with torch.no_grad():
        assert torch.equal(loaded(images()), compressed(images()))


@pytest.mark.slow  # about 20 s a method
@pytest.mark.parametrize("method", ["dtps", "etps", "tome"])
def test_a_carrying_model_exports_to_onnx(model, method, tmp_path):
    from vitcompress.workflows.export import export_model

    torch.manual_seed(0)
    compressed = compress(model, method, keep=[0.7], input_size=SIZE, variant_args=CARRY)
    result = export_model(compressed, SIZE, "onnx", tmp_path / f"{method}.onnx")
    assert result["max_abs_diff"] < 1e-3


def test_apply_reports_which_blocks_carry_a_choice():
    import json

    from click.testing import CliRunner

    from vitcompress.cli.main import cli
    from vitcompress.cli.model_commands import window_text

    args = [
        "apply",
        *("--model", "sam2_hiera_tiny", "--input-size", "3,64,64"),
        *(
            arg
            for key in ("embed_dim", "stages", "window_spec", "global_att_blocks")
            for arg in ("--model-arg", f"{key}={HIERA[key]}".replace(" ", ""))
        ),
        *("--variant", "etps", "--keep", "0.7", "--variant-arg", "carry_windows=True"),
        *("--batch-size", "2", "--runs", "1", "--bench-seconds", "1", "--json"),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{") :])
    assert [entry.get("carried", []) for entry in data["window_tokens"]] == [[], [], [3, 4], []]
    assert "block 2: 1 x 16→12 (blocks 3-4 carry block 2's choice)" in window_text(
        data["window_tokens"]
    )
