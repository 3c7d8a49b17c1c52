"""Position-dependent attention: after a token reduction every table indexed by token position
follows the kept tokens, or the model is refused with one line naming the table and the block."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import vitcompress
import vitcompress.graph.plan
from tests.models import SMALL, VANILLA, timm_small
from vitcompress import map_model
from vitcompress.cli.main import cli
from vitcompress.graph.plan import PlanError

VARIANTS = ["dtps", "etps", "dynamicvit", "evit"]
SIZE = (3, 32, 32)

# name -> (timm model, the table the refusal names, where it meets the tokens)
POSITION_FAMILIES = {
    "beit": (
        "beit_base_patch16_224",
        "blocks.{}.attn.relative_position_bias_table",
        "attention logits",
    ),
    "vit_relpos": ("vit_relpos_base_patch16_224", "blocks.{}.attn.rel_pos", "attention logits"),
    "rope": ("vit_small_patch16_rope_224", "<constant (64, 32)>", "queries/keys"),
    # RoPE sized from the patch grid at run time: reading a size does not make it image-derived.
    "dinov3": ("vit_small_patch16_dinov3", "<constant (64, 32)>", "queries/keys"),
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
    return sharpen(timm_small(POSITION_FAMILIES[name][0]))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(POSITION_FAMILIES))
def test_position_tables_after_a_reduction_are_refused_naming_table_and_block(name, variant):
    model = _family(name)
    _, table, meets = POSITION_FAMILIES[name]
    # Predictor variants reduce before block 1, so block 1's own attention sees fewer tokens;
    # attention variants reduce after block 1's attention, so block 2 is the first to be hit.
    block = 1 if variant in ("dtps", "dynamicvit") else 2
    for keep in (1.0, 0.7):
        with pytest.raises(PlanError) as refused:
            vitcompress.compress(model, variant, keep=keep, locs=[1], input_size=SIZE)
        message = str(refused.value)
        assert "\n" not in message
        assert f"block {block} (blocks.{block}.attn)" in message
        assert f"position table {table.format(block)} to its {meets}" in message
        assert "reduction at block 1" in message and variant in message


@pytest.mark.parametrize("name", list(POSITION_FAMILIES))
def test_without_the_refusal_the_logits_would_silently_change(name, monkeypatch):
    """What the refusal prevents: dTPS at keep 1 only re-sorts the tokens, which must not change
    the logits, yet with a position table they change and nothing says so."""
    model = _family(name)
    monkeypatch.setattr(vitcompress.graph.plan, "position_refusal", lambda model_map, plan: None)
    resorted = vitcompress.compress(model, "dtps", keep=1.0, locs=[1], input_size=SIZE).eval()
    x = torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(x)
        # Float rounding of a mere re-sort is ~1e-6 of the logits' scale.
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
            }
        ]
    rope = map_model(timm_small("vit_small_patch16_rope_224"), SIZE).to_json()
    # The sin/cos rows of the 64 patch tokens (the cls token is not rotated), on q and k.
    assert {(u["kind"], tuple(u["shape"])) for u in rope["blocks"][2]["position_uses"]} == {
        ("query/key table", (64, 32))
    }


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
    "variant, loc, refused",
    [
        ("dtps", 2, True),  # reduced before block 2: its biased attention sees fewer tokens
        ("dtps", 3, False),  # reduced after it
        ("dynamicvit", 1, True),
        ("etps", 2, False),  # reduced after block 2's attention: only its MLP sees fewer tokens
        ("evit", 1, True),
        ("etps", 3, False),
    ],
)
def test_only_a_table_after_the_reduction_refuses(variant, loc, refused):
    torch.manual_seed(0)
    model = OneBiasedBlockViT(biased=2).eval()
    if refused:
        with pytest.raises(
            PlanError,
            match=r"block 2 \(layers\.2\.mixer\) applies the position "
            r"table layers\.2\.mixer\.bias",
        ):
            vitcompress.compress(model, variant, keep=0.7, locs=[loc], input_size=SIZE)
        return
    same = vitcompress.compress(model, variant, keep=1.0, locs=[loc], input_size=SIZE).eval()
    x = torch.randn(2, *SIZE)
    with torch.no_grad():
        torch.testing.assert_close(same(x), model(x), atol=1e-5, rtol=0)
        reduced = vitcompress.compress(model, variant, keep=0.7, locs=[loc], input_size=SIZE)
        assert reduced.eval()(x).shape == (2, 10)


def test_the_cli_refuses_with_one_line_and_exit_code_2():
    args = [f"{k}={v}" for k, v in SMALL.items()]
    result = CliRunner().invoke(
        cli,
        [
            "apply",
            "--model",
            "beit_base_patch16_224",
            *[a for arg in args for a in ("--model-arg", arg)],
            "--input-size",
            "3,32,32",
            "--variant",
            "etps",
        ],
    )
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: block 2 (blocks.2.attn)"), lines
    assert "relative_position_bias_table" in lines[0]
