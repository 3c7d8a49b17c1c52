"""Hybrid ViTs: grid ops get their full grid back (pad in inference, mask in training)."""

import pytest
import timm
import torch

import vitcompress
import vitcompress.zoo  # noqa: F401 - registers pvt_* and cvt_* into timm
from tests.fixtures import inhouse
from vitcompress.method import MaskedRemoval, Removal
from vitcompress.modules.grid import GridGather
from vitcompress.modules.restore import TokenRestore

VARIANTS = ["dtps", "dynamicvit", "etps", "evit"]


def _small(name):
    if name == "inhouse_pyramid":
        return inhouse.tiny_pyramid(), (3, 64, 64)
    if name == "pvt_v2_b0":
        return timm.create_model("pvt_v2_b0", num_classes=10), (3, 64, 64)
    return timm.create_model(name, num_classes=10, img_size=64), (3, 64, 64)


# Every variant on the small pyramids; the full-width zoo models with one variant of each kind
# (predictor, attention) to keep the suite within its budget on two cores.
CASES = [(name, variant) for name in ("inhouse_pyramid", "pvt_v2_b0") for variant in VARIANTS]
CASES += [("pvt_tiny", "dtps"), ("pvt_tiny", "evit"), ("cvt_13", "dynamicvit"), ("cvt_13", "etps")]


@pytest.mark.parametrize("name, variant", CASES)
def test_hybrid_keep_one_gives_base_logits_and_training_runs(name, variant):
    torch.manual_seed(0)
    model, size = _small(name)
    model.eval()
    x = torch.randn(2, *size)
    same = vitcompress.compress(model, variant, keep=1.0, input_size=size).eval()
    with torch.no_grad():
        torch.testing.assert_close(same(x), model(x), atol=1e-5, rtol=0)
    reduced = vitcompress.compress(model, variant, keep=0.5, input_size=size)
    with torch.no_grad():
        out = reduced.eval()(x)
        alone = reduced(x[1:])
    torch.testing.assert_close(out[1:], alone, atol=1e-5, rtol=1e-4)
    reduced.train()
    reduced(x).logsumexp(-1).sum().backward()
    if variant in ("dtps", "dynamicvit"):
        grads = [p.grad for n, p in reduced.named_parameters() if n.startswith("tps.")]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("variant", ["dtps", "etps"])
def test_pvt_v2_restores_by_value_where_a_layer_sits_before_its_grid_op(variant):
    # PVT-v2's MLP runs fc1 before its depthwise conv: that restore falls back to the method's
    # local rule (host), while the stage's others restore by value; the reducer records both.
    torch.manual_seed(0)
    model, size = _small("pvt_v2_b0")
    model.eval()
    with torch.no_grad():  # sharper attention: a token out of place shows in the logits
        for name, weight in model.named_parameters():
            if name.endswith(("attn.q.weight", "attn.kv.weight")):
                weight.mul_(3.0)
    x = torch.randn(2, *size)
    same = vitcompress.compress(
        model, variant, keep=1.0, input_size=size, variant_args={"restore": "value"}
    ).eval()
    reduced = vitcompress.compress(
        model, variant, keep=0.7, input_size=size, variant_args={"restore": "value"}
    ).eval()
    rules = {m.rule for m in reduced.modules() if isinstance(m, TokenRestore)}
    assert rules == {"value", "host"}
    with torch.no_grad():
        torch.testing.assert_close(same(x), model(x), atol=1e-5, rtol=0)
        assert reduced(x).shape == (2, 10)


def _dropped(positions: torch.Tensor, cells: int) -> torch.Tensor:
    """The grid positions not in ``positions`` (B, k), ascending: what a reduction removed."""
    dropped = [sorted(set(range(cells)) - set(row.tolist())) for row in positions]
    return torch.tensor(dropped)


def _zero_filled(tokens: torch.Tensor, positions: torch.Tensor, cells: int) -> torch.Tensor:
    """What a grid op of a reduced stage reads under ``restore=zero``."""
    kept = positions[:, : (positions >= 0).sum(dim=1).min()]
    removal = Removal(keep_index=kept, prune_index=_dropped(positions, cells))
    return TokenRestore("zero", prefix_tokens=0)(tokens, (removal,))


def test_restore_then_gather_returns_the_kept_tokens_exactly():
    torch.manual_seed(1)
    tokens = torch.randn(3, 10, 8)
    positions = torch.stack([torch.randperm(16)[:10] for _ in range(3)])
    grid = _zero_filled(tokens, positions, 16)
    assert grid.shape == (3, 16, 8)
    assert torch.equal(GridGather((4, 4))(grid, positions), tokens)


def test_a_zero_restored_grid_is_zero_exactly_where_tokens_were_dropped():
    torch.manual_seed(2)
    tokens = torch.randn(2, 5, 4) + 10.0  # no accidental zeros
    positions = torch.tensor([[0, 3, 5, 6, 15], [1, 2, 3, 4, 8]])
    grid = _zero_filled(tokens, positions, 16)
    present = torch.zeros(2, 16, dtype=torch.bool).scatter(1, positions, True)
    assert torch.all(grid[~present] == 0)
    assert torch.all(grid[present] != 0)


def test_training_zero_restore_zeroes_the_masked_tokens_before_grid_ops():
    tokens = torch.ones(1, 4, 3)
    removed = torch.tensor([[0.0, 1.0, 0.0, 1.0]])  # 4 patch tokens, 2 removed
    out = TokenRestore("zero", prefix_tokens=0)(tokens, (MaskedRemoval(removed),))
    assert out[0, :, 0].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_evit_fused_token_stays_off_the_grid():
    tokens = torch.ones(1, 3, 2)
    positions = torch.tensor([[2, 0, -1]])  # the last one is EViT's fused token
    grid = _zero_filled(tokens, positions, 4)
    assert grid[0, :, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    back = GridGather((2, 2))(grid * 3, positions)
    assert back[0, :, 0].tolist() == [3.0, 3.0, 0.0]


def test_pvt_tiny_paper_setting_as_the_user_writes_it():
    from click.testing import CliRunner

    from vitcompress.cli.main import cli

    result = CliRunner().invoke(
        cli,
        [
            "apply",
            "--model",
            "pvt_tiny",
            "--variant",
            "dtps",
            "--keep",
            "0.7",
            "--no-throughput",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    import json

    data = json.loads(result.output)
    assert data["plan"]["locs"] == [2, 4, 6]  # first block of stages 2, 3, 4
    assert round(data["base"]["params"] / 1e6, 2) == 13.23
    assert round(data["compressed"]["params"] / 1e6, 2) == 13.85
    assert data["tokens_per_block"] == [3136, 3136, 548, 548, 137, 137, 35, 35]
