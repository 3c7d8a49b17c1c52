"""Position-dependent attention: after a token reduction every table indexed by token position
follows the kept tokens (gathered by their grid positions), or the model is refused with one line
naming the table, the block and why it cannot follow."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import vitcompress
from tests.fixtures import position_tables
from tests.models import FIXTURES, VANILLA, timm_small
from vitcompress import map_model
from vitcompress.analysis.positions import gather_layout
from vitcompress.cli.main import cli
from vitcompress.compilation.plan import PlanError
from vitcompress.compilation.rewrite import _Rewriter
from vitcompress.measure import count_macs

VARIANTS = ["dtps", "etps", "dynamicvit", "evit"]
SIZE = (3, 32, 32)

# name -> timm model: relative-position bias (BEiT, vit_relpos, the shared table of vit_srelpos)
# and RoPE (EVA02, rope ViT, its mixed-frequency form, DINOv3, Perception Encoder).
POSITION_FAMILIES = {
    "beit": "beit_base_patch16_224",
    "vit_relpos": "vit_relpos_base_patch16_224",
    "vit_srelpos": "vit_srelpos_small_patch16_224",
    "eva02": "eva02_tiny_patch14_224",
    "rope": "vit_small_patch16_rope_224",
    "rope_mixed": "vit_small_patch16_rope_mixed_224",
    # RoPE sized from the patch grid at run time: reading a size does not make it image-derived.
    "dinov3": "vit_small_patch16_dinov3",
    "pe": "vit_pe_core_tiny_patch16_384",
}


def sharpen(model: nn.Module) -> nn.Module:
    """Weights under which a position table matters: random weights give near-uniform
    attention, where reordering the tokens changes the logits by ~1e-7 only. Relative-position
    parameters from N(0, 1), query/key projections x3, LayerScale 1."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "rel_pos" in name or "relative_position" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name.endswith("qkv.weight"):
                param[: 2 * param.shape[1]] *= 3.0  # the q and k rows of a fused projection
            elif "gamma" in name:
                param.fill_(1.0)
    return model.eval()


def _family(name: str) -> nn.Module:
    torch.manual_seed(0)
    return sharpen(timm_small(POSITION_FAMILIES[name]))


# Every family with every variant is the slow run; by default a bias family and a RoPE family
# with all four, and each other family with dTPS
_FAST = {("beit", v) for v in VARIANTS} | {("dinov3", v) for v in VARIANTS}
# (at keep 1 eTPS and EViT keep the tokens as they are: it is dTPS's re-sort that tests the
# gather there; keep 0.7 tests all of them)
_FAST |= {(name, "dtps") for name in POSITION_FAMILIES}
_CASES = [
    pytest.param(name, variant, marks=() if (name, variant) in _FAST else pytest.mark.slow)
    for name in POSITION_FAMILIES
    for variant in VARIANTS
]


@pytest.mark.parametrize("name, variant", _CASES)
def test_position_tables_follow_the_tokens_exact_at_keep_1_and_cheaper_at_0_7(name, variant):
    """Reductions at the default blocks (1, 2, 3 of 4): keep 1 re-sorts the tokens (dTPS,
    DynamicViT) or keeps them, and must give the base's logits; keep 0.7 runs and costs less."""
    model = _family(name)
    x = torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))
    same = vitcompress.compress(model, variant, keep=1.0, input_size=SIZE).eval()
    reduced = vitcompress.compress(model, variant, keep=0.7, input_size=SIZE).eval()
    with torch.no_grad():
        base = model(x)
        # Float rounding of a re-sort is ~1e-6 of the logits' scale; a wrong row ~1e-2.
        assert (same(x) - base).abs().max() <= 1e-5 * base.abs().max()
        assert torch.isfinite(reduced(x)).all()
    assert count_macs(reduced, SIZE) < 0.9 * count_macs(model, SIZE)


# (EVA02's sharpened logits move by only ~1e-7 here; test_position_tables.py checks it by hand.)
@pytest.mark.parametrize("name", ["beit", "vit_srelpos", "rope", "dinov3"])
def test_without_the_gather_the_logits_would_silently_change(name, monkeypatch):
    """What the gather prevents: dTPS at keep 1 only re-sorts the tokens, which must not change
    the logits, yet with the table left in grid order they change and nothing says so."""
    model = _family(name)
    monkeypatch.setattr(_Rewriter, "_gather_position_tables", lambda self, *args: None)
    resorted = vitcompress.compress(model, "dtps", keep=1.0, locs=[1], input_size=SIZE).eval()
    x = torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(x)
        assert (resorted(x) - base).abs().max() > 1e-3 * base.abs().max()


def test_the_map_lists_every_block_s_position_table():
    beit = map_model(timm_small("beit_base_patch16_224"), SIZE).to_json()
    for i, block in enumerate(beit["blocks"]):
        assert block["position_uses"] == [
            {
                "table": f"blocks.{i}.attn.relative_position_bias_table",
                "kind": "attention bias",
                "branch": "attention",
                "path": f"blocks.{i}.attn",
                "shape": [1, 2, 65, 65],
                "blocker": None,  # it can follow the kept tokens
                "neutral": 0.0,  # added: a token off the grid gets no bias
            }
        ]
    rope = map_model(timm_small("vit_small_patch16_rope_224"), SIZE).to_json()
    # The sin/cos rows of the 64 patch tokens (the cls token is not rotated), on q and k: the
    # cos multiplies q (neutral 1), the sin the rotated q (neutral 0: no rotation).
    assert {
        (u["kind"], tuple(u["shape"]), u["neutral"]) for u in rope["blocks"][2]["position_uses"]
    } == {("query/key table", (64, 32), 1.0), ("query/key table", (64, 32), 0.0)}


@pytest.mark.parametrize("name", list(VANILLA))
def test_absolute_position_embeddings_before_the_blocks_are_not_position_tables(name):
    factory, size, _, _ = VANILLA[name]
    assert all(not block.position_uses for block in map_model(factory(), size).blocks)


# An in-house ViT with a learned (H, N, N) attention bias in one block only, written without
# timm, so the rule is seen to come from the graph and to depend on where the reduction is.
class BiasedAttention(nn.Module):
    def __init__(self, dim: int, heads: int, tokens: int | None) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.out = nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.randn(heads, tokens, tokens)) if tokens else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        logits = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        if self.bias is not None:
            logits = logits + self.bias
        y = logits.softmax(dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, n, c))


class BiasedBlock(nn.Module):
    def __init__(self, dim: int, heads: int, tokens: int | None) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mixer = BiasedAttention(dim, heads, tokens)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class OneBiasedBlockViT(nn.Module):
    def __init__(self, biased: int = 2, dim: int = 32, depth: int = 4, heads: int = 2) -> None:
        super().__init__()
        tokens = 1 + 8 * 8
        self.stem = nn.Conv2d(3, dim, 4, 4)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.where = nn.Parameter(torch.randn(1, tokens, dim))
        self.layers = nn.ModuleList(
            BiasedBlock(dim, heads, tokens if i == biased else None) for i in range(depth)
        )
        self.head = nn.Linear(dim, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.stem(image).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.where
        for layer in self.layers:
            x = layer(x)
        return self.head(x[:, 0])


def test_an_in_house_bias_is_found_in_its_block_only():
    model_map = map_model(OneBiasedBlockViT(biased=2), SIZE)
    assert [len(b.position_uses) for b in model_map.blocks] == [0, 0, 1, 0]
    use = model_map.blocks[2].position_uses[0]
    assert (use.table, use.kind, use.path) == (
        "layers.2.mixer.bias",
        "attention bias",
        "layers.2.mixer",
    )


@pytest.mark.parametrize(
    "variant, loc",
    [("dtps", 2), ("dtps", 3), ("dynamicvit", 1), ("etps", 2), ("evit", 1), ("etps", 3)],
)
def test_an_in_house_bias_follows_the_kept_tokens_wherever_the_reduction_is(variant, loc):
    torch.manual_seed(0)
    model = OneBiasedBlockViT(biased=2).eval()
    with torch.no_grad():
        model.layers[2].mixer.bias.mul_(3.0)  # a bias that matters
    same = vitcompress.compress(model, variant, keep=1.0, locs=[loc], input_size=SIZE).eval()
    x = torch.randn(2, *SIZE)
    with torch.no_grad():
        torch.testing.assert_close(same(x), model(x), atol=1e-5, rtol=0)
        reduced = vitcompress.compress(model, variant, keep=0.7, locs=[loc], input_size=SIZE)
        assert torch.isfinite(reduced.eval()(x)).all()


def _with_bias(shape_of: str) -> nn.Module:
    """OneBiasedBlockViT with block 2's bias replaced by one broadcast over queries or keys."""
    torch.manual_seed(0)
    model = OneBiasedBlockViT(biased=2).eval()
    mixer = model.layers[2].mixer
    heads, tokens = mixer.bias.shape[0], mixer.bias.shape[-1]
    shape = {"keys": (heads, 1, tokens), "keys 1-D": (tokens,), "queries": (heads, tokens, 1)}
    mixer.bias = nn.Parameter(3.0 * torch.randn(shape[shape_of]))  # strong enough to matter
    return model


@pytest.mark.parametrize("shape_of", ["keys", "keys 1-D", "queries"])
def test_a_bias_over_the_keys_or_queries_alone_follows_the_kept_tokens(shape_of):
    """A bias with the token count in the logits' last dim only (one value per key) is a position
    table too: dTPS reorders the tokens even at keep 1, and an undetected key bias then paired
    each key with another key's value (the logits moved by 0.17, with no error)."""
    model = _with_bias(shape_of)
    model_map = map_model(model, SIZE)
    assert [len(b.position_uses) for b in model_map.blocks] == [0, 0, 1, 0]
    assert model_map.blocks[2].position_uses[0].kind == "attention bias"
    x = torch.randn(2, *SIZE)
    for variant in VARIANTS:
        same = vitcompress.compress(model, variant, keep=1.0, locs=[1], input_size=SIZE).eval()
        reduced = vitcompress.compress(model, variant, keep=0.7, locs=[1], input_size=SIZE).eval()
        with torch.no_grad():
            torch.testing.assert_close(same(x), model(x), atol=1e-5, rtol=0)
            assert torch.isfinite(reduced(x)).all()


def test_the_gather_layout_of_biases_broadcast_over_queries_or_keys():
    # rank 4 logits (B, H, N, N) over 1 + 64 tokens
    layout = partial(gather_layout, rank=4, kind="attention bias", tokens=65, prefix_tokens=1)
    assert layout((2, 65, 65)) == ((2, 3), (1, 1))
    assert layout((2, 1, 65)) == ((3,), (1,))
    assert layout((65,)) == ((3,), (1,))
    assert layout((2, 64, 1)) == ((2,), (0,))
    assert layout((2, 7, 65)) == "its last two dims (7, 65) are not the queries and keys"
    assert layout((2, 1, 1)) == "its last two dims (1, 1) are not the queries and keys"


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_table_that_meets_the_tokens_in_a_matrix_product_is_refused(variant):
    """A learned (N, N) token-mixing matrix: rows and columns are positions, but it is applied
    by a matrix product, where no generic gather is known to be right."""
    torch.manual_seed(0)
    model = position_tables.token_mixing_vit().eval()
    with pytest.raises(PlanError) as refused:
        vitcompress.compress(model, variant, keep=0.7, locs=[1], input_size=SIZE)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        "block 2 (blocks.2.attn.after) applies the position table blocks.2.attn.after.mix to "
        "its tokens after the token reduction at block 1, and it cannot follow the kept tokens: "
        "it meets the tokens in matmul"
    )
    assert f"so {variant} is refused" in message
    # Reducing after it is fine: no table is read after the reduction.
    vitcompress.compress(model, variant, keep=0.7, locs=[3], input_size=SIZE)


def test_a_rotation_whose_cos_cannot_be_told_refuses_evit_only():
    """RoPE on halves of q/k: the tables follow the kept tokens (the predictor variants and eTPS
    are exact at keep 1), but EViT's fused token would need the identity rotation, and which
    table is the cos cannot be told from the graph: EViT alone is refused."""
    torch.manual_seed(0)
    model = position_tables.halves_rope_vit().eval()
    x = torch.randn(2, *SIZE)
    for variant in ("dtps", "etps", "dynamicvit"):
        same = vitcompress.compress(model, variant, keep=1.0, locs=[1], input_size=SIZE).eval()
        with torch.no_grad():
            torch.testing.assert_close(same(x), model(x), atol=1e-5, rtol=0)
    with pytest.raises(PlanError, match=r"^block 2 \(blocks\.2\.attn\.rotate\) .*evit's fused "):
        vitcompress.compress(model, "evit", keep=0.7, locs=[1], input_size=SIZE)


def test_the_cli_refuses_with_one_line_and_exit_code_2():
    result = CliRunner().invoke(
        cli,
        [
            "apply",
            "--model",
            f"{FIXTURES.parent / 'position_tables.py'}:token_mixing_vit",
            "--input-size",
            "3,32,32",
            "--variant",
            "etps",
            "--locs",
            "1",
        ],
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: block 2 (blocks.2.attn.after)"), lines
    assert "blocks.2.attn.after.mix" in lines[0] and "cannot follow the kept tokens" in lines[0]
