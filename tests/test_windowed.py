"""Windowed attention (Swin): the windows are found by analysis (the shift included), every
method reduces within them alike, the block gives its tokens back, keep 1 is exact on sharpened
weights, keep 0.7 is cheaper, a training step is finite and the ONNX export matches."""

from __future__ import annotations

import json
import math

import pytest
import timm
import torch
from torch import nn

from tests.test_windowed_families import one_choice_both_ways, window_order
from vitcompress import compress, map_model
from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.plan import Plan
from vitcompress.errors import UserError
from vitcompress.measure import count_macs
from vitcompress.modules.windows import WindowTableGather
from vitcompress.workflows.export import export_model

METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")
SIZE = (3, 56, 56)
# A Swin small enough to run in a test: a 14 x 14 grid in 4 windows of 7 x 7 (shifted by 3 in
# every other block), then a 7 x 7 grid in one window.
SWIN = dict(img_size=56, embed_dim=32, depths=(2, 2), num_heads=(2, 4), window_size=7)


def sharpen(model: nn.Module) -> nn.Module:
    """Weights under which positions matter: random init attends almost uniformly, which hides a
    token put in the wrong window or slot. Relative-position tables from N(0, 1), queries and
    keys x3, the residual branches' last linears x2."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "relative_position_bias_table" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name.endswith("qkv.weight"):
                param[: 2 * param.shape[1]] *= 3.0
            elif name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
                param *= 2.0
    return model.eval()


def swin(**extra) -> nn.Module:
    torch.manual_seed(0)
    return sharpen(
        timm.create_model("swin_tiny_patch4_window7_224", num_classes=10, **SWIN, **extra)
    )


@pytest.fixture(scope="module")
def model() -> nn.Module:
    return swin()


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))


def test_windows_and_their_shift_are_found_by_analysis(model):
    model_map = map_model(model, SIZE)
    windows = [(b.windows.count, b.windows.tokens) for b in model_map.blocks]
    assert windows == [(4, 49), (4, 49), (1, 49), (1, 49)]
    assert list(model_map.blocks[0].windows.order) == window_order(14, 14, 7, 0)
    assert list(model_map.blocks[1].windows.order) == window_order(14, 14, 7, 3)
    # One window over the whole 7 x 7 grid: the last stage's shift is dropped by timm there.
    assert list(model_map.blocks[3].windows.order) == list(range(49))
    assert [s.grid for s in model_map.stages] == [(14, 14), (7, 7)]


@pytest.mark.parametrize("method", METHODS)
def test_keep_one_is_exact_on_sharpened_weights(model, images, method):
    with torch.no_grad():
        base = model(images)
        compressed = compress(model, method, keep=[1.0], input_size=SIZE)(images)
    assert torch.allclose(compressed, base, atol=1e-5 * base.abs().max().item())


@pytest.mark.parametrize("method", METHODS)
def test_keep_07_reduces_every_window_alike_and_gives_the_tokens_back(model, images, method):
    compressed = compress(model, method, keep=[0.7], input_size=SIZE)
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen[name] = (tuple(inputs[0].shape), tuple(output[0].shape))

        return hook

    for name, module in compressed.named_modules():
        if name.startswith("tps.") and name.count(".") == 1:
            module.register_forward_hook(record(name))
    with torch.no_grad():
        out = compressed(images)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    assert sorted(seen) == [f"tps.{i}" for i in range(4)]  # every windowed block reduces
    for before, after in seen.values():
        windows, tokens, _ = before
        assert tokens == 49 and windows in (2 * 4, 2 * 1)
        assert after[0] == windows and after[1] < tokens  # fewer in every window, windows whole


def test_keep_07_costs_under_085_of_the_base_at_swin_t_width():
    """At Swin-T's width (96, 3 heads, MLP ratio 4): a method scored by the attention saves in
    the MLP only (it needs the whole window's attention to score), a predictor in the whole
    block; every one of them stays under 0.85 of the base."""
    torch.manual_seed(0)
    wide = timm.create_model(
        "swin_tiny_patch4_window7_224", num_classes=10, **{**SWIN, "embed_dim": 96}
    ).eval()
    base = count_macs(wide, SIZE)
    ratios = {
        method: count_macs(compress(wide, method, keep=[0.7], input_size=SIZE), SIZE) / base
        for method in METHODS
    }
    assert all(ratio < 0.85 for ratio in ratios.values()), ratios
    # The predictor's whole block runs on fewer tokens: it saves more than the MLP-only ones.
    assert ratios["dtps"] < ratios["etps"] and ratios["dynamicvit"] < ratios["evit"]


@pytest.mark.parametrize("method", METHODS)
def test_one_training_step_is_finite_and_trains_the_predictor(model, images, method):
    compressed = compress(model, method, keep=[0.7], input_size=SIZE).train()
    loss = nn.functional.cross_entropy(compressed(images), torch.tensor([1, 2]))
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in compressed.named_parameters() if p.requires_grad}
    assert all(g is None or torch.isfinite(g).all() for g in grads.values())
    predictor = [g for n, g in grads.items() if "predictor" in n]
    if method in ("dtps", "dynamicvit"):
        assert predictor and all(g is not None and g.abs().sum() > 0 for g in predictor)


@pytest.mark.parametrize(
    "method, settings", [("dtps", {}), ("dynamicvit", {}), ("dtps", {"window_sizes": True})]
)
def test_training_masks_give_what_inference_gathers_for_the_same_choice(
    model, images, method, settings, monkeypatch
):
    """A predictor trains on every token with masks (keys masked, removed tokens restored by
    mask) and infers on gathered windows (tables gathered, tokens restored by index). With the
    Gumbel draw replaced by inference's own top-k, the two paths must give the same logits: a
    mismatch would train the model for a network it never runs. With ``window_sizes`` both
    paths weigh each kept key by the tokens squeezed into it (and that changes the logits)."""
    torch.manual_seed(0)  # the predictors' weights: the same with and without the setting
    compressed = compress(model, method, keep=[0.7], input_size=SIZE, variant_args=settings).eval()
    if settings:
        torch.manual_seed(0)
        plain = compress(model, method, keep=[0.7], input_size=SIZE).eval()
        with torch.no_grad():
            assert (plain(images) - compressed(images)).abs().max() > 1e-4
    keep_tokens = {m.keep_tokens for m in compressed.modules() if hasattr(m, "keep_tokens")}
    assert keep_tokens == {34}

    inferred, trained, other = one_choice_both_ways(
        compressed, images, monkeypatch, lambda tokens: 34
    )
    torch.testing.assert_close(trained, inferred, atol=1e-6, rtol=1e-5)
    assert (other - inferred).abs().max() > 1e-3


@pytest.mark.parametrize("method", ("dtps", "etps", "tome"))
def test_onnx_export_matches_pytorch(model, method, tmp_path):
    compressed = compress(model, method, keep=[0.7], input_size=SIZE)
    result = export_model(compressed, SIZE, "onnx", tmp_path / "swin.onnx")
    assert result["max_abs_diff"] < 1e-3


def test_the_plan_says_its_windows_and_reads_back(model):
    plan = compression_info(compress(model, "etps", keep=[0.7], input_size=SIZE)).plan
    data = json.loads(json.dumps(plan.to_json()))
    assert [loc["windows"] for loc in data["locations"]] == [4, 4, 1, 1]
    assert [loc["patch_tokens"] for loc in data["locations"]] == [49] * 4
    assert Plan.from_json(data).locations == plan.locations


def _padded_swin(**extra) -> nn.Module:
    # 48 pixels: a 12 x 12 grid in windows of 7, padded to 14 x 14; stage 2 is 6 x 6 in one.
    torch.manual_seed(0)
    return sharpen(
        timm.create_model(
            "swin_tiny_patch4_window7_224",
            img_size=48,
            embed_dim=32,
            depths=(2, 2),
            num_heads=(2, 4),
            num_classes=10,
            **extra,
        )
    )


def _windows_by_tokens(windows) -> dict[int, int]:
    """How many windows hold each number of real tokens."""
    counts: dict[int, int] = {}
    for w in range(windows.count):
        real = sum(
            1 for i in windows.order[w * windows.tokens : (w + 1) * windows.tokens] if i >= 0
        )
        counts[real] = counts.get(real, 0) + 1
    return counts


def test_padded_windows_are_mapped_with_their_padding_and_grouped_by_token_count():
    """The padding's slots are read off the index run as -1 (the padding is zeros where a token
    index starts at 1); every real token sits in exactly one slot, the unshifted block's where
    the partition of the padded grid puts it."""
    blocks = map_model(_padded_swin(), (3, 48, 48)).blocks
    first = blocks[0].windows
    assert first.padded and (first.count, first.tokens) == (4, 49)
    padded_grid = [r * 12 + c if r < 12 and c < 12 else -1 for r in range(14) for c in range(14)]
    assert list(first.order) == [padded_grid[i] for i in window_order(14, 14, 7)]
    # 7 x 7, 7 x 5, 5 x 7 and 5 x 5 real tokens: three groups, the fullest first.
    assert _windows_by_tokens(first) == {49: 1, 35: 2, 25: 1}
    assert [len(tokens) for _, tokens in first.groups()] == [49, 70, 25]
    for block in blocks:
        real = sorted(i for i in block.windows.order if i >= 0)
        assert real == list(range(len(real)))  # each token once
        assert sum(len(tokens) for _, tokens in block.windows.groups()) == len(real)


@pytest.mark.parametrize("method", ("etps", "evit", "tome", "dtps", "dynamicvit"))
def test_padded_windows_reduce_by_groups_exact_at_keep_one(method):
    """In double precision, on sharpened weights: keep 1 equals the base; keep 0.7 reduces the
    windows of each token count alike and never keeps a padded slot (each group's reducer sees
    only its real tokens). A predictor chooses there on the MLP's input, as the others do after
    the attention."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        model = _padded_swin().double()
        images = torch.randn(2, 3, 48, 48, generator=torch.Generator().manual_seed(1)).double()
        with torch.no_grad():
            base = model(images)
            same = compress(model, method, keep=[1.0], input_size=(3, 48, 48))(images)
            assert (same - base).abs().max() <= 1e-9 * base.abs().max()
            compressed = compress(model, method, keep=[0.7], input_size=(3, 48, 48))
            seen: list[tuple[int, int]] = []
            kept: list[int] = []

            def record(module, inputs, output) -> None:  # returns None: the output stays
                seen.append((inputs[0].shape[0], inputs[0].shape[1]))
                kept.append(output[0].shape[1])

            for name, module in compressed.named_modules():
                if name.startswith("tps.") and name.count(".") == 1:
                    module.register_forward_hook(record)
            out = compressed(images)
    finally:
        torch.set_default_dtype(default)
    assert out.shape == base.shape and torch.isfinite(out).all()
    assert not torch.allclose(out, base)
    # Block 0's and 1's windows as grouped by their real tokens, batch 2; block 2 and 3 (one
    # 6 x 6 grid in one window of 36) as one group of 36.
    by_block = seen[:3]
    assert by_block == [(2, 49), (4, 35), (2, 25)], seen
    assert (2, 36) in seen
    # Each group keeps its own share: ceil(0.7 n) for eTPS (EViT adds its fused token); ToMe
    # merges round(0.3 n) of each group, not a full window's r (which left 20 of 35, 13 of 25).
    share = {
        "etps": [math.ceil(0.7 * n) for n in (49, 35, 25)],
        "evit": [math.ceil(0.7 * n) + 1 for n in (49, 35, 25)],
        "tome": [n - round(n * (1 - 0.7)) for n in (49, 35, 25)],
        # A predictor keeps floor(0.7 n) of each group's, as floor(0.7 x 49) of a full window.
        "dtps": [int(0.7 * n) for n in (49, 35, 25)],
        "dynamicvit": [int(0.7 * n) for n in (49, 35, 25)],
    }
    assert kept[:3] == share[method], kept


@pytest.mark.parametrize("method", ("dtps", "dynamicvit"))
def test_padded_windows_take_a_predictor_on_the_mlp_only(method):
    """Padded windows enter the attention with different numbers of real tokens, so no one
    count kept per window leaves the windows' batch whole: the attention runs on every window
    whole (its projection gets all 49 slots of each), and the predictor chooses on the MLP's
    input, group by group. A training step is finite, its ratio loss over every group."""
    model = _padded_swin()
    size = (3, 48, 48)
    compressed = compress(model, method, keep=[0.7], input_size=size)
    seen: list[tuple[int, ...]] = []
    qkv = dict(compressed.named_modules())["layers.0.blocks.0.attn.qkv"]
    qkv.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    with torch.no_grad():
        compressed.eval()(torch.randn(2, *size))
    assert seen == [(2 * 4, 49, 32)], seen
    from vitcompress.training.losses import DistillationTaps, ratio_loss

    compressed.train()
    taps = DistillationTaps(compressed, None, token_distill=False)
    loss = compressed(torch.randn(2, *size)).logsumexp(-1).mean()
    # The ratio loss sees every group's keep mask at block 0 (4 windows: 49, 2 x 35, 25 real
    # tokens), not only the last group's; block 2's one window is one group.
    first = taps.captured.masks[0]
    assert [tuple(mask.shape) for mask in first] == [(2, 49), (4, 35), (2, 25)]
    shares = torch.cat([mask.float().mean(1) for mask in first])
    expected = ((shares - 0.7) ** 2).mean()
    assert torch.allclose(ratio_loss([first], [0.7], [0]), expected)
    loss = loss + ratio_loss(taps.captured.masks, [0.7] * 4, [0] * 4)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in compressed.parameters() if p.grad is not None)
    with torch.no_grad():  # the next pass starts its masks anew
        compressed(torch.randn(2, *size))
    assert [tuple(mask.shape) for mask in taps.captured.masks[0]] == [(2, 49), (4, 35), (2, 25)]
    taps.remove()


@pytest.mark.parametrize("method", ("dtps", "dynamicvit"))
def test_a_predictor_on_the_mlp_only_counts_like_a_hand_count(method):
    """Block 0 alone (width 32, a 12 x 12 grid in 4 padded windows: 49, 2 x 35 and 25 real
    tokens): the attention runs whole, so against the base the model saves only the MLP and its
    norm (8 C^2 + 5 C) of the tokens each group drops, floor(0.7 n) kept: 15, 2 x 11 and 8; it
    pays the predictor on the 144 real tokens (its norm, C^2, the local half (C/2)^2 per token,
    one global row (C/2)^2 per window, then C/2 x C/4 and C/4 x 2) and, for dTPS, the cosine
    of each window's donors against its hosts."""
    model = _padded_swin()
    size = (3, 48, 48)
    compressed = compress(model, method, keep=[0.7], locs=[0], input_size=size)
    width, half = 32, 16
    dropped = 15 + 2 * 11 + 8
    saved = dropped * (8 * width * width + 5 * width)
    predictor = (
        144 * (5 * width + width * width + half * half + half * (width // 4) + (width // 4) * 2)
        + 4 * half * half
    )
    squeeze = (15 * 34 + 2 * 11 * 24 + 8 * 17) * width if method == "dtps" else 0
    assert count_macs(model, size) - count_macs(compressed, size) == saved - predictor - squeeze


def test_apply_says_where_a_predictor_runs_the_attention_whole():
    from click.testing import CliRunner

    from vitcompress.cli.main import cli

    args = [
        "apply",
        *("--model", "swin_tiny_patch4_window7_224", "--input-size", "3,48,48"),
        *("--model-arg", "img_size=48", "--model-arg", "embed_dim=32"),
        *("--model-arg", "depths=(2,2)", "--model-arg", "num_heads=(2,4)"),
        *("--variant", "dtps", "--keep", "0.7"),
        *("--batch-size", "2", "--runs", "1", "--bench-seconds", "1"),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert (
        "within windows: blocks 0, 1: 4 x 49→34; blocks 2, 3: 1 x 36→25 attention run on every "
        "token (the choice made on the MLP's input) at blocks 0, 1: its windows are padded" in text
    ), text


def test_a_windowed_block_refuses_restoring_zeros_and_restores_by_value():
    """A windowed block restores its tokens before the next block reads them: zeros there would
    erase every pruned token, so the zero rule is refused; the value rule works, its record
    holding the hosts the window attention's own restore reads."""
    model = swin()
    with pytest.raises(UserError) as refused:
        compress(model, "dtps", keep=[0.7], input_size=SIZE, variant_args={"restore": "zero"})
    assert "restore=zero" in str(refused.value) and "\n" not in str(refused.value)
    images = torch.randn(2, *SIZE)
    compressed = compress(
        model, "dtps", keep=[0.7], input_size=SIZE, variant_args={"restore": "value"}
    )
    with torch.no_grad():
        assert torch.isfinite(compressed(images)).all()


@pytest.mark.parametrize("method", ("dtps", "dynamicvit"))
def test_a_predictor_runs_the_windows_attention_on_the_kept_tokens(model, images, method):
    compressed = compress(model, method, keep=[0.7], input_size=SIZE)
    seen = []
    for name in ("qkv", "proj"):  # in a shifted block
        layer = compressed.get_submodule(f"layers.0.blocks.1.attn.{name}")
        layer.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    with torch.no_grad():
        compressed(images)
    assert seen == [(2 * 4, 34, 32)] * 2  # int(49 * 0.7) of each window's 49 tokens


@pytest.mark.parametrize("lead", [(6,), (2, 3)])
def test_window_tables_are_gathered_by_each_windows_positions(lead):
    """Against a loop: row i, column j of window w's table is the table at its kept tokens'
    positions (i, j); a (B * windows, ...) and a (B, windows, ...) layout."""
    generator = torch.Generator().manual_seed(0)
    tokens, kept, heads, windows = 9, 5, 2, 3
    rows = 6
    table = torch.randn(1, windows, heads, tokens, tokens, generator=generator)
    if len(lead) == 1:
        table = torch.randn(1, heads, tokens, tokens, generator=generator)
    positions = torch.stack(
        [torch.randperm(tokens, generator=generator)[:kept] for _ in range(rows)]
    )
    gathered = WindowTableGather(windows, 3 + len(lead))(table, positions)
    assert gathered.shape == (*lead, heads, kept, kept)
    flat = gathered.reshape(rows, heads, kept, kept)
    for row in range(rows):
        source = table[0] if len(lead) == 1 else table[0, row % windows]
        pos = positions[row]
        assert torch.equal(flat[row], source[:, pos][:, :, pos])
    assert WindowTableGather(windows, 4)(table, None) is table


def test_apply_says_what_each_window_keeps_and_saves_a_model_that_loads_back(tmp_path):
    """The command line on a windowed model: the blocks' full token counts, the tokens each
    window keeps, and an artifact that is rewritten again on load to the same model."""
    from click.testing import CliRunner

    from vitcompress.api import load
    from vitcompress.cli.main import cli

    args = [
        "apply",
        "--model",
        "swin_tiny_patch4_window7_224",
        *("--model-arg", "img_size=56", "--model-arg", "embed_dim=32"),
        *("--model-arg", "depths=(2,2)", "--model-arg", "num_heads=(2,4)"),
        *("--variant", "dtps", "--keep", "0.7", "--batch-size", "2", "--runs", "1"),
        *("--bench-seconds", "1", "--out", str(tmp_path / "swin"), "--json"),
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output[result.output.index("{") :])
    assert data["tokens_per_block"] == [196, 196, 49, 49]
    assert data["window_tokens"] == [
        {"block": block, "windows": windows, "tokens": 49, "kept": 34}
        for block, windows in ((0, 4), (1, 4), (2, 1), (3, 1))
    ]
    loaded = load(
        tmp_path / "swin"
    )  # the model, rewritten again from its plan, checked against the save
    reducers = [n for n, _ in loaded.named_modules() if n.count(".") == 1]
    assert [n for n in reducers if n.startswith("tps.")] == [f"tps.{i}" for i in range(4)]
    with torch.no_grad():
        out = loaded(torch.randn(2, *SIZE))
    assert out.shape == (2, 1000) and torch.isfinite(out).all()


def test_window_sizes_count_each_kept_token_and_the_tokens_squeezed_into_it():
    from vitcompress.method.restore import MaskedRemoval, Removal
    from vitcompress.modules.windows import WindowSizes

    # Inference: 3 kept, 2 pruned both squeezed into kept token 0.
    record = Removal(
        torch.tensor([[4, 1, 2]]), torch.tensor([[0, 3]]), torch.tensor([[0, 0]]), None, None
    )
    assert WindowSizes()((record,)).tolist() == [[3.0, 1.0, 1.0]]
    # Training: every token stays; tokens 1 and 2 removed, into hosts 0 and 3.
    masked = MaskedRemoval(torch.tensor([[0.0, 1.0, 1.0, 0.0]]), torch.tensor([[0, 0, 3, 3]]))
    assert WindowSizes()((masked,)).tolist() == [[2.0, 1.0, 1.0, 2.0]]
    # A drop records no hosts: no sizes.
    assert WindowSizes()((record._replace(host_index=None),)) is None


def test_visualize_refuses_padded_windows_in_one_line():
    """Padded windows are reduced group by group, several reductions per location: visualize,
    which draws one per location, says so rather than failing on a count."""
    from vitcompress.workflows.visualize import VisualizeError, record_locations

    compressed = compress(_padded_swin(), "etps", keep=[0.7], input_size=(3, 48, 48))
    with pytest.raises(VisualizeError) as refused:
        record_locations(compressed, torch.randn(1, 3, 48, 48))
    message = str(refused.value)
    assert "\n" not in message and "groups of different sizes" in message


def test_window_sizes_is_refused_where_no_block_is_windowed():
    from tests.models import timm_small

    with pytest.raises(UserError) as refused:
        compress(
            timm_small("deit_tiny_patch16_224"),
            "dtps",
            keep=[0.7],
            input_size=(3, 32, 32),
            variant_args={"window_sizes": True},
        )
    assert "no block of this plan runs its window attention on fewer tokens" in str(refused.value)


def test_window_sizes_is_refused_where_every_location_runs_its_attention_whole():
    """Padded windows run their attention on every token under a predictor: weighing the kept
    keys there would change nothing."""
    with pytest.raises(UserError) as refused:
        compress(
            _padded_swin(),
            "dtps",
            keep=[0.7],
            locs=[0, 1],
            input_size=(3, 48, 48),
            variant_args={"window_sizes": True},
        )
    assert "no block of this plan runs its window attention on fewer tokens" in str(refused.value)
    # Block 2's one window is not padded: there the setting weighs the kept keys.
    compress(
        _padded_swin(),
        "dtps",
        keep=[0.7],
        locs=[0, 2],
        input_size=(3, 48, 48),
        variant_args={"window_sizes": True},
    )


def _etps_block_by_hand(block: nn.Module, x: torch.Tensor, order: list[int], keep: float):
    """A timm Swin block with eTPS at keep ``keep``, written out from the method's functions:
    the attention on every token; in each window (slot s holds grid token ``order[s]``) the
    tokens scored by the attention they receive there, the best ``ceil(keep * 49)`` kept and the
    rest squeezed into their hosts; the MLP on what is kept; every token given back by eTPS's
    rule (``delta``) and put back on the grid."""
    from vitcompress.method import Removal, restore_tokens, split_by_score, squeeze

    batch, height, width, channels = x.shape
    probs = []
    hook = block.attn.softmax.register_forward_hook(lambda m, i, o: probs.append(o))
    after_attention = x + block._attn(block.norm1(x))
    hook.remove()
    tokens_per_window = probs[0].shape[-1]
    scores = probs[0].mean(dim=(1, 2))  # (B x windows, 49): what each token receives
    windows = after_attention.reshape(batch, height * width, channels)[:, order]
    windows = windows.reshape(-1, tokens_per_window, channels)
    keep_index, prune_index = split_by_score(scores, math.ceil(keep * tokens_per_window))
    kept = torch.gather(windows, 1, keep_index[..., None].expand(-1, -1, channels))
    pruned = torch.gather(windows, 1, prune_index[..., None].expand(-1, -1, channels))
    squeezed, hosts = squeeze(kept, pruned, return_hosts=True)
    out = squeezed + block.mlp(block.norm2(squeezed))
    removal = Removal(keep_index, prune_index, hosts, pruned, squeezed, kept)
    restored = restore_tokens(out, [removal], "delta").reshape(batch, -1, channels)
    grid = torch.empty_like(restored)
    grid[:, order] = restored
    return grid.reshape(batch, height, width, channels)


def test_etps_at_keep_07_is_the_method_written_out_window_by_window(images):
    """Beyond keep 1 (where no token is chosen): the compressed Swin's logits at keep 0.7 are
    those of the base with each block replaced by eTPS written out by hand, in float64 on
    sharpened weights, the shifted windows' order included (from ``window_order``, not the
    analysis). The hand version calls the method's own pure functions (select, squeeze,
    restore; their arithmetic is tested against the reference code elsewhere): what it checks
    is the compilation around them, which tokens enter which window and slot, where the score
    comes from, what the MLP sees and where each token is given back."""
    base = swin().double()
    for block in (b for layer in base.layers for b in layer.blocks):
        block.attn.fused_attn = False  # the hand version reads the probabilities
    images = images.double()
    with torch.no_grad():
        compressed = compress(base, "etps", keep=[0.7], input_size=SIZE)(images)
        orders = {0: window_order(14, 14, 7, 0), 1: window_order(14, 14, 7, 3)}
        for index, block in enumerate(base.layers[0].blocks):
            block.forward = lambda x, b=block, o=orders[index]: _etps_block_by_hand(b, x, o, 0.7)
        for block in base.layers[1].blocks:  # one window over the 7 x 7 grid
            block.forward = lambda x, b=block: _etps_block_by_hand(b, x, list(range(49)), 0.7)
        by_hand = base(images)
        for block in (b for layer in base.layers for b in layer.blocks):
            del block.forward
        plain = base(images)
    assert not torch.allclose(by_hand, plain, atol=1e-3)  # keep 0.7 changes the logits
    assert torch.allclose(compressed, by_hand, rtol=0, atol=1e-9 * by_hand.abs().max().item())


@pytest.mark.parametrize(
    "build, size, other",
    [(swin, SIZE, (3, 84, 84)), (_padded_swin, (3, 48, 48), (3, 56, 56))],
    ids=["whole windows", "padded windows"],
)
@pytest.mark.parametrize("keep", [1.0, 0.7])
def test_an_input_of_another_size_than_compressed_at_is_refused_in_one_line(
    build, size, other, keep
):
    # The windows' order is the captured grid's: a larger grid would have some of its tokens
    # picked into the wrong windows, so the compressed model refuses it (the base, built with
    # strict_img_size=False, runs it).
    model = build(strict_img_size=False)
    images = torch.randn(2, *other)
    assert model(images).shape == (2, 10)
    compressed = compress(model, "etps", keep=[keep], input_size=size)
    with pytest.raises(UserError) as refused:
        compressed(images)
    grid = (size[1] // 4) ** 2
    assert str(refused.value).startswith(f"the windows were laid out for {grid} tokens per image")
    assert f"this input gives {(other[1] // 4) ** 2}: compress the model" in str(refused.value)
