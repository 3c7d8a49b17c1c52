"""Per-token residual branches after a windowed block (DaViT's channel blocks' MLPs) take a
carried choice: found by analysis (in the block's order, working on each token alone), reduced
by the choice, exact at keep 1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.test_windowed_families import _build, _images, window_order
from vitcompress import compress, map_model
from vitcompress.compilation.compression import capture_and_map
from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.plan import Plan
from vitcompress.compilation.rewrite import rewrite
from vitcompress.measure import count_macs

CARRY = {"carry_windows": True}
BRANCHES = {"carry_branches": True}  # the default: the branches only, no block carried
NO_BRANCHES = {"carry_branches": False}


class WindowBlock(nn.Module):
    """Attention within 4 x 4 windows of an 8 x 8 grid of (B, 64, C) tokens, then an MLP."""

    def __init__(self, dim: int = 16, side: int = 8, window: int = 4) -> None:
        super().__init__()
        self.side, self.window = side, window
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, dim = x.shape
        side, w, cut = self.side, self.window, self.side // self.window
        h = self.norm1(x).reshape(batch, cut, w, cut, w, dim).permute(0, 1, 3, 2, 4, 5)
        h = h.reshape(-1, w * w, dim)
        count, tokens = h.shape[0], h.shape[1]  # a predictor hands it fewer tokens
        q, k, v = self.qkv(h).reshape(count, tokens, 3, 2, dim // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(count, tokens, dim)
        a = self.proj(a).reshape(batch, cut, cut, w, w, dim).permute(0, 1, 3, 2, 4, 5)
        x = x + a.reshape(batch, side * side, dim)
        return x + self.mlp(self.norm2(x))


class Tail(nn.Module):
    """A residual after the windowed block: ``mlp`` works on each token alone; ``token_mix``
    mixes tokens (a linear over the token axis); ``flipped`` works per token on the tokens in
    reverse order (then puts them back); ``conv`` mixes neighbours on the grid."""

    def __init__(self, kind: str, dim: int = 16, tokens: int = 64) -> None:
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.mix = nn.Linear(tokens, tokens)
        self.conv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.mix_channels = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "token_mix":
            return x + self.mix(self.norm(x).transpose(1, 2)).transpose(1, 2)
        if self.kind == "flipped":
            x = x.flip(1)
            return (x + self.mlp(self.norm(x))).flip(1)
        if self.kind == "nested":  # a per-token residual inside a per-token residual
            h = self.norm(x)
            h = h + self.mlp(h)
            return x + self.mix_channels(h)
        if self.kind == "conv":
            grid = self.norm(x).transpose(1, 2).reshape(x.shape[0], -1, 8, 8)
            return x + self.conv(grid).flatten(2).transpose(1, 2)
        return x + self.mlp(self.norm(x))


class WithTails(nn.Module):
    def __init__(self, tails: tuple[str, ...], dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 4, 4)
        self.block0, self.block1 = WindowBlock(dim), WindowBlock(dim)
        self.tails = nn.Sequential(*(Tail(kind, dim) for kind in tails))
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = self.tails(self.block0(x))
        return self.head(self.block1(x).mean(1))


SIZE = (3, 32, 32)


def _sharpened(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("qkv.weight"):
                parameter.mul_(3.0)
    return model.eval()


@pytest.mark.parametrize(
    "tails, found",
    [
        (("mlp",), ["tails.0.{norm,mlp}"]),
        (("token_mix", "mlp"), ["tails.1.{norm,mlp}"]),
        (("flipped", "mlp"), ["tails.1.{norm,mlp}"]),
        (("conv", "mlp", "mlp"), ["tails.1.{norm,mlp}", "tails.2.{norm,mlp}"]),
        # Only the outer residual: the inner one is reduced with it.
        (("nested",), ["tails.0.{norm,mlp,mix_channels}"]),
    ],
    ids=["mlp", "token_mix", "flipped", "conv", "nested"],
)
def test_only_branches_on_the_blocks_tokens_in_order_that_work_per_token_are_found(tails, found):
    """A branch that mixes tokens (over the token axis, or neighbours on the grid) is not one;
    neither is one whose tokens arrive in another order (flipped), though it works per token.
    An MLP after any of them is: a residual on the way passes its skip's tokens on. A residual
    inside another's branch is not listed apart."""
    torch.manual_seed(0)
    model_map = map_model(WithTails(tails).eval(), SIZE)
    first, second = model_map.blocks
    assert first.windows is not None and first.windows.count == 4
    assert list(first.windows.order) == window_order(8, 8, 4)
    assert [branch.path for branch in first.per_token_after] == found
    assert second.per_token_after == []


def test_the_map_lists_davits_channel_mlps_after_each_spatial_block():
    model, size = _build("davit")
    model_map = map_model(model, size)
    after = [[b.path for b in block.per_token_after] for block in model_map.blocks]
    channel = [
        f"stages.{i}.blocks.{j}.1.{{norm2,mlp,drop_path2}}"
        for i, j in ((0, 0), (1, 0), (2, 0), (2, 1), (3, 0))
    ]
    assert after == [[path] for path in channel]
    data = model_map.to_json()
    assert [block["per_token_after"] for block in data["blocks"]] == [[p] for p in channel]


@pytest.mark.parametrize("tails", [("token_mix", "mlp"), ("nested",)], ids=["mlp", "nested"])
@pytest.mark.parametrize("method", ["etps", "dtps", "evit", "tome", "dynamicvit"])
def test_carrying_is_exact_at_keep_one_with_the_branches_reduced(method, tails):
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = _sharpened(WithTails(tails).double())
        x = torch.randn(2, *SIZE)
        compressed = compress(
            model, method, keep=[1.0], locs=[0], input_size=SIZE, variant_args=NO_BRANCHES
        )
        windows_only = compress(
            model,
            method,
            keep=[1.0],
            locs=[0],
            input_size=SIZE,
            variant_args={**CARRY, **NO_BRANCHES},
        )
        carrying = compress(
            model, method, keep=[1.0], locs=[0], input_size=SIZE, variant_args=CARRY
        )
        branches = compress(
            model, method, keep=[1.0], locs=[0], input_size=SIZE, variant_args=BRANCHES
        )
        expected = {
            "token_mix": ("tails.1.{norm,mlp}",),
            "nested": ("tails.0.{norm,mlp,mix_channels}",),
        }
        for reducing in (carrying, branches):
            location = compression_info(reducing).plan.locations[0]
            assert location.carried_branches == expected[tails[0]]
        for whole in (compressed, windows_only):
            assert compression_info(whole).plan.locations[0].carried_branches == ()
        with torch.no_grad():
            base = model(x)
            for candidate in (compressed, windows_only, carrying, branches):
                assert (candidate(x) - base).abs().max() <= 1e-12 * base.abs().max()
    finally:
        torch.set_default_dtype(default)


def _seen(model: nn.Module, names: list[str], images: torch.Tensor, pick) -> dict[str, object]:
    """``pick(inputs, output)`` of each named module in one pass."""
    seen: dict[str, object] = {}
    modules = dict(model.named_modules())
    handles = [
        modules[name].register_forward_hook(
            lambda m, i, o, name=name: seen.__setitem__(name, pick(i, o))
        )
        for name in names
    ]
    with torch.no_grad():
        model(images)
    for handle in handles:
        handle.remove()
    return seen


def _mlp_inputs(model: nn.Module, names: list[str], images: torch.Tensor) -> dict[str, object]:
    return _seen(model, names, images, lambda inputs, output: (inputs[0], output))


def _records(model: nn.Module, names: list[str], images: torch.Tensor) -> dict[str, object]:
    """Each named replay's record of the kept slots, (B x windows, K)."""
    return _seen(model, names, images, lambda inputs, output: output[1][-1].keep_index)


def test_a_carried_choice_runs_davits_channel_mlps_on_each_windows_kept_tokens():
    """DynamicViT keeps tokens as they are (nothing fused), so the channel block's MLP gets, in
    each window of the spatial block before it, 0.7 of that window's tokens: each exactly one of
    that window's tokens (the window written out by hand) as the residual took them, none from
    another window. Without carrying it gets every token."""
    model, size = _build("davit")
    images = _images(size)
    channel = "stages.1.blocks.0.1"  # a 16 x 16 grid in 16 windows of 4 x 4 at 128 pixels
    fc1 = f"{channel}.mlp.fc1"
    carrying = compress(model, "dynamicvit", keep=0.7, input_size=size, variant_args=CARRY)
    whole = compress(model, "dynamicvit", keep=0.7, input_size=size, variant_args=NO_BRANCHES)
    assert _mlp_inputs(whole.eval(), [fc1], images)[fc1][0].shape == (2, 256, 64)
    partition = "tps_hooks.windows1_after0"  # takes the residual's (B, 256, C) input
    seen = _mlp_inputs(carrying.eval(), [fc1, partition], images)
    reduced = seen[fc1][0]
    kept = int(0.7 * 16)
    assert reduced.shape == (2 * 16, kept, 64)
    with torch.no_grad():
        normed = model.stages[1].blocks[0][1].norm2(seen[partition][0])
    order = torch.tensor(window_order(16, 16, 4)).reshape(16, 16)
    # The same choice as the spatial block's own MLP: its replay and the branch's keep the same
    # slots of each window.
    replays = _records(carrying, ["tps_hooks.replay1", "tps_hooks.replay1_after0"], images)
    assert torch.equal(replays["tps_hooks.replay1"], replays["tps_hooks.replay1_after0"])
    for image in range(2):
        for window in range(16):
            tokens = normed[image, order[window]]  # the window's 16 tokens
            rows = reduced[image * 16 + window]
            near = (rows[:, None] - tokens[None]).abs().amax(-1) <= 1e-5
            assert bool((near.sum(1) == 1).all()), (image, window)
            assert len(set(near.float().argmax(1).tolist())) == kept


def test_carrying_saves_the_hand_counted_mlp_macs_of_the_branch():
    """Against carrying with the branch left whole (the plan's ``carried_branches`` emptied),
    the branch saves its MLP's 2 x (C x 2C) MACs and its norm's 5 C (fvcore's convention) for
    each of the N - K tokens it no longer runs: width 16, 4 windows of 16 tokens, 11 kept each
    (a predictor's int(0.7 x 16)), 2 images' worth is not counted (MACs per image)."""
    torch.manual_seed(0)
    model = WithTails(("mlp",)).eval()
    carrying = compress(model, "dtps", keep=[0.7], locs=[0], input_size=SIZE, variant_args=CARRY)
    plan = compression_info(carrying).plan
    data = plan.to_json()
    assert data["locations"][0]["carried_branches"] == ["tails.0.{norm,mlp}"]
    del data["locations"][0]["carried_branches"]
    captured, model_map = capture_and_map(model, SIZE)
    whole = rewrite(captured.module, model_map, Plan.from_json(data))
    width, dropped = 16, 4 * (16 - int(0.7 * 16))
    saved = dropped * (2 * width * 2 * width + 5 * width)
    assert count_macs(whole, SIZE) - count_macs(carrying, SIZE) == saved


def test_carrying_the_branches_alone_saves_their_hand_counted_macs():
    """``carry_branches`` (the default): against it turned off, the location's branch saves its
    MLP and norm for the N - K tokens it no longer runs, as under ``carry_windows``."""
    torch.manual_seed(0)
    model = WithTails(("mlp",)).eval()
    whole = compress(model, "dtps", keep=[0.7], locs=[0], input_size=SIZE, variant_args=NO_BRANCHES)
    branches = compress(model, "dtps", keep=[0.7], locs=[0], input_size=SIZE)
    width, dropped = 16, 4 * (16 - int(0.7 * 16))
    saved = dropped * (2 * width * 2 * width + 5 * width)
    assert count_macs(whole, SIZE) - count_macs(branches, SIZE) == saved


def test_davits_channel_mlps_take_each_spatial_locations_choice_by_default():
    """DaViT by default (``carry_branches``): every spatial block stays a location of its own
    (nothing carried from one to another, the locations as with the setting off), and the
    channel block after it runs its MLP on the slots the spatial block's own MLP kept, 0.7 of
    each window's."""
    model, size = _build("davit")
    images = _images(size)
    whole = compress(model, "dynamicvit", keep=0.7, input_size=size, variant_args=NO_BRANCHES)
    branches = compress(model, "dynamicvit", keep=0.7, input_size=size)
    whole_plan = compression_info(whole).plan
    plan = compression_info(branches).plan
    assert [loc.block for loc in plan.locations] == [loc.block for loc in whole_plan.locations]
    assert all(loc.carried_branches == () for loc in whole_plan.locations)
    assert all(loc.carried == () for loc in plan.locations)
    assert plan.locations[1].carried_branches == ("stages.1.blocks.0.1.{norm2,mlp,drop_path2}",)
    fc1 = "stages.1.blocks.0.1.mlp.fc1"
    reduced = _mlp_inputs(branches.eval(), [fc1], images)[fc1][0]
    assert reduced.shape == (2 * 16, int(0.7 * 16), 64)
    replays = _records(branches, ["tps_hooks.replay1", "tps_hooks.replay1_after0"], images)
    assert torch.equal(replays["tps_hooks.replay1"], replays["tps_hooks.replay1_after0"])
    assert count_macs(branches, size) < count_macs(whole, size)


def test_a_saved_davit_rebuilds_the_branches_choice_and_the_setting_off(tmp_path):
    """Saved and loaded back, a DaViT keeps its plan: the channel MLPs' choice by default, none
    with ``carry_branches=False`` (the setting is recorded, not taken from today's default)."""
    from vitcompress.api import load, save
    from vitcompress.loading import ModelSource

    args = {
        "embed_dims": (32, 64, 128, 256),
        "num_heads": (1, 2, 4, 8),
        "depths": (1, 1, 2, 1),
        "window_size": 4,
        "num_classes": 10,
    }
    model, size = _build("davit")
    images = _images(size)
    for name, settings in (("branches", None), ("whole", NO_BRANCHES)):
        compressed = compress(model, "etps", keep=0.7, input_size=size, variant_args=settings)
        save(compressed.eval(), tmp_path / name, source=ModelSource("davit_tiny", model_args=args))
        loaded = load(tmp_path / name)
        plan = compression_info(loaded).plan
        assert plan.locations == compression_info(compressed).plan.locations
        assert any(loc.carried_branches for loc in plan.locations) == (settings is None)
        with torch.no_grad():
            assert torch.equal(loaded(images), compressed(images))


DAVIT_ARGS = [
    *("--model", "davit_tiny", "--input-size", "3,128,128"),
    *("--model-arg", "embed_dims=(32,64,128,256)", "--model-arg", "num_heads=(1,2,4,8)"),
    *("--model-arg", "depths=(1,1,2,1)", "--model-arg", "window_size=4"),
]


def test_inspect_and_apply_name_davits_channel_mlps():
    import json

    from click.testing import CliRunner

    from vitcompress.cli.main import cli

    shown = CliRunner().invoke(cli, ["inspect", *DAVIT_ARGS])
    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    assert (
        "per-token branches a location's choice reduces too (carry_branches, on by default): "
        "stages.0.blocks.0.1.{norm2,mlp,drop_path2} (after block 0);" in text
    )
    applied = CliRunner().invoke(
        cli,
        [
            "apply",
            *DAVIT_ARGS,
            *("--variant", "etps", "--keep", "0.7", "--variant-arg", "carry_windows=True"),
            *("--batch-size", "2", "--runs", "1", "--bench-seconds", "1", "--json"),
        ],
    )
    assert applied.exit_code == 0, applied.output
    data = json.loads(applied.output[applied.output.index("{") :])
    branches = [entry.get("carried_branches", []) for entry in data["window_tokens"]]
    # Stage 2's two spatial blocks are one run: block 2 carries to block 3, and both blocks'
    # channel MLPs take block 2's choice.
    mlp = "stages.{}.blocks.{}.1.{{norm2,mlp,drop_path2}}"
    assert branches == [
        [mlp.format(0, 0)],
        [mlp.format(1, 0)],
        [mlp.format(2, 0), mlp.format(2, 1)],
        [mlp.format(3, 0)],
    ]


def test_apply_says_which_branches_take_a_choice():
    from vitcompress.cli.model_commands import window_text

    text = window_text(
        [
            {"block": 0, "windows": 4, "tokens": 16, "kept": 11, "carried": [1]},
            {"block": 2, "windows": 4, "tokens": 16, "kept": 11, "carried_branches": ["t.{a,b}"]},
        ]
    )
    assert text == (
        "within windows: blocks 0, 2: 4 x 16→11 (block 1 carries block 0's choice, "
        "t.{a,b} takes block 2's choice)"
    )


def test_a_davit_carrying_into_its_channel_mlps_exports_to_onnx(tmp_path):
    from vitcompress.workflows.export import export_model

    model, size = _build("davit")
    compressed = compress(model, "etps", keep=0.7, input_size=size, variant_args=CARRY)
    assert any(loc.carried_branches for loc in compression_info(compressed).plan.locations)
    result = export_model(compressed, size, "onnx", tmp_path / "davit.onnx")
    assert result["max_abs_diff"] < 1e-3


class FlippedMLP(WindowBlock):
    """The window attention, then the MLP on the tokens in reverse order (put back after)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, dim = x.shape
        side, w, cut = self.side, self.window, self.side // self.window
        h = self.norm1(x).reshape(batch, cut, w, cut, w, dim).permute(0, 1, 3, 2, 4, 5)
        h = h.reshape(-1, w * w, dim)
        count, tokens = h.shape[0], h.shape[1]
        q, k, v = self.qkv(h).reshape(count, tokens, 3, 2, dim // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(count, tokens, dim)
        a = self.proj(a).reshape(batch, cut, cut, w, w, dim).permute(0, 1, 3, 2, 4, 5)
        x = (x + a.reshape(batch, side * side, dim)).flip(1)
        return (x + self.mlp(self.norm2(x))).flip(1)


def test_an_mlp_that_reads_the_windows_tokens_in_another_order_is_refused():
    """Between the window attention and its MLP the tokens are reversed: reducing the MLP's
    input in the attention's windows would take the wrong tokens. The order check runs the flip
    on the token indices (it used to pass any same-shape op there as keeping each token in
    place) and refuses the model in one line."""
    from vitcompress.errors import UserError

    torch.manual_seed(0)
    model = WithTails(("mlp",))
    model.block0 = FlippedMLP()
    with pytest.raises(UserError) as refused:
        map_model(model.eval(), SIZE)
    message = str(refused.value)
    assert "\n" not in message
    assert "the MLP after it does not read its tokens in their order" in message
