"""Blocks with parallel branches compress: attention and MLP side by side on one residual
(``vit_pwee``, ``x + attn(h) + mlp(h)``), parallel attentions summed on one residual
(``vit_small_patch16_18x2``) and differential attention's two softmaxes (``vit_dwee``).

Each model is built small with sharpened weights (q/k x3, LayerScale 1), where a wrong token order
or a wrongly placed reduction shows in the logits. Every variant is exact at keep 1, cuts MACs
at keep 0.7 and trains a step; the attention variants score with the block's whole map (the
mean over parallel attentions' heads, A1 - lambda A2 for differential attention) and reduce
after the whole of a parallel block.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.fixtures import edge_case_vits as issue10
from tests.models import timm_small
from vitcompress import compress, map_model
from vitcompress.analysis.analyse import MappingError
from vitcompress.compilation.plan import PlanError
from vitcompress.compilation.rewrite import RewriteError
from vitcompress.measure import count_macs
from vitcompress.modules import AttentionReducer

SIZE = (3, 32, 32)
VARIANTS = ("dtps", "etps", "dynamicvit", "evit")
MODELS = {
    "pwee": lambda: timm_small("vit_pwee_patch16_reg1_gap_256"),
    "18x2": lambda: timm_small("vit_small_patch16_18x2_224"),
    "dwee": lambda: timm_small("vit_dwee_patch16_reg1_gap_256"),
    "inhouse_parallel": issue10.parallel_vit,
    "inhouse_two_attentions": issue10.two_attentions_vit,
}


def sharpen(model: nn.Module) -> nn.Module:
    """q/k projections x3 and LayerScale 1: attention far from uniform."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("qkv.weight"):
                param[: 2 * param.shape[0] // 3] *= 3.0
            elif name.endswith("in_proj.weight"):  # ParallelScalingBlock: [mlp | q | k | v]
                dim = param.shape[1]
                hidden = param.shape[0] - 3 * dim
                param[hidden : hidden + 2 * dim] *= 3.0
            elif name.endswith("gamma"):
                param.fill_(1.0)
    return model.eval()


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return sharpen(MODELS[name]().eval())


def image() -> torch.Tensor:
    return torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))


def reducers(model: nn.Module) -> list[AttentionReducer]:
    return [m for m in model.modules() if isinstance(m, AttentionReducer)]


def test_the_map_says_how_each_block_is_built():
    pwee, two, diff = (map_model(build(n), SIZE).blocks[1] for n in ("pwee", "18x2", "dwee"))
    assert pwee.parallel_mlp and pwee.attn_add_node == pwee.output_node
    assert not pwee.parallel_cores and pwee.score_combination is None
    assert not two.parallel_mlp and two.attn_add_node != two.output_node
    assert len(two.parallel_cores) == 1 and two.score_combination == "mean"
    assert len(diff.parallel_cores) == 1 and diff.score_combination == "difference"
    assert diff.score_blocker is None
    data = map_model(build("pwee"), SIZE).to_json()["blocks"][1]
    assert data["parallel_mlp"] is True and data["attention_cores"] == 1


# The fast subset: every model with a predictor and an attention variant, all four variants
# covered; the rest of the product runs with -m slow.
FAST = [
    ("pwee", "dtps"),
    ("pwee", "evit"),
    ("18x2", "dynamicvit"),
    ("18x2", "etps"),
    ("dwee", "dtps"),
    ("dwee", "evit"),
    ("inhouse_parallel", "etps"),
    ("inhouse_two_attentions", "dynamicvit"),
]
CASES = [
    pytest.param(name, variant, marks=() if (name, variant) in FAST else pytest.mark.slow)
    for name in MODELS
    for variant in VARIANTS
]


@pytest.mark.parametrize("name, variant", CASES)
def test_exact_at_keep_1_fewer_macs_at_keep_07_and_one_training_step(name, variant):
    model = build(name)
    x = image()
    with torch.no_grad():
        base = model(x)
        same = compress(model, variant, keep=1.0, input_size=SIZE).eval()(x)
    assert (same - base).abs().max() <= 1e-5 * base.abs().max()
    reduced = compress(model, variant, keep=0.7, input_size=SIZE)
    assert count_macs(reduced, SIZE) < 0.9 * count_macs(model, SIZE)
    reduced.train()
    loss = F.cross_entropy(reduced(x), torch.tensor([0, 1]))
    loss.backward()
    grads = [p.grad for p in reduced.parameters() if p.grad is not None]
    assert math.isfinite(loss.item()) and grads and all(torch.isfinite(g).all() for g in grads)


def _captured_scores(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    handles = [
        r.register_forward_pre_hook(lambda _m, args: found.append(args[1].detach()))
        for r in reducers(model)
    ]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return found


def _attention_inputs(module: nn.Module, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    seen: list[torch.Tensor] = []
    handle = module.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen[0]


def test_differential_attention_is_scored_by_its_map_a1_minus_lambda_a2():
    model = build("dwee")
    x = image()
    block = 1
    attn = model.blocks[block].attn
    tokens = _attention_inputs(attn, model, x)
    b, n, c = tokens.shape
    with torch.no_grad():
        q, k, _ = attn.qkv(tokens).chunk(3, dim=2)
        heads, half = attn.num_heads, attn.head_dim
        q = attn.q_norm(q.reshape(b, n, 2 * heads, half).transpose(1, 2))
        k = attn.k_norm(k.reshape(b, n, 2 * heads, half).transpose(1, 2))
        probs = ((q @ k.transpose(-2, -1)) * half**-0.5).softmax(dim=-1)
        probs = probs.view(b, heads, 2, n, n)
        lam = attn._compute_lambda()
        differential = probs[:, :, 0] - lam * probs[:, :, 1]
    prefix = 1  # one register token, no cls: each token's score is the attention it receives
    expected = differential[..., prefix:].mean(dim=(1, 2))
    compressed = compress(model, "evit", keep=0.7, locs=[block], input_size=SIZE).eval()
    (score,) = _captured_scores(compressed, x)
    torch.testing.assert_close(score, expected, rtol=1e-4, atol=1e-6)
    # The mean of the two softmaxes (what scoring each core alone and averaging gives) differs.
    assert (score - probs[..., prefix:].mean(dim=(1, 2, 3))).abs().max() > 1e-3


def test_parallel_attentions_are_scored_by_the_mean_over_all_their_heads():
    model = build("18x2")
    x = image()
    block = 1
    rows = []
    for branch in model.blocks[block].attns:
        tokens = _attention_inputs(branch.attn, model, x)
        b, n, c = tokens.shape
        heads = branch.attn.num_heads
        with torch.no_grad():
            q, k, _ = branch.attn.qkv(tokens).reshape(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4)
            q, k = branch.attn.q_norm(q), branch.attn.k_norm(k)
            probs = ((q @ k.transpose(-2, -1)) * branch.attn.scale).softmax(dim=-1)
        rows.append(probs[:, :, 0, 1:])  # the cls row over the patch tokens, per head
    expected = torch.cat(rows, dim=1).mean(dim=1)
    compressed = compress(model, "etps", keep=0.7, locs=[block], input_size=SIZE).eval()
    (score,) = _captured_scores(compressed, x)
    torch.testing.assert_close(score, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("variant", ["etps", "evit"])
def test_a_parallel_block_reduces_after_its_whole_output(variant):
    """The reference: the base model, with the reducer applied by hand to the block's output."""
    model = build("pwee")
    x = image()
    block = 1
    compressed = compress(model, variant, keep=0.7, locs=[block], input_size=SIZE).eval()
    (score,) = _captured_scores(compressed, x)
    (reducer,) = reducers(compressed)
    handle = model.blocks[block].register_forward_hook(
        lambda _m, _args, out: reducer(out, score)[0]
    )
    with torch.no_grad():
        expected = model(x)
    handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(compressed(x), expected, rtol=1e-5, atol=1e-6)


def test_differential_map_formed_after_one_softmax_is_refused_for_attention_scoring():
    """Written out (no fused attention), differential attention subtracts halves of one softmax's
    heads: their mean is not the block's map. eTPS/EViT are refused in one line; the predictor
    variants, which only mask keys, stay exact."""
    model = build("dwee")
    for block in model.blocks:
        block.attn.fused_attn = False
    x = image()
    with pytest.raises(PlanError) as refused:
        compress(model, "etps", keep=0.7, input_size=SIZE)
    line = str(refused.value)
    assert "\n" not in line and "differential attention at blocks." in line
    assert "etps scores tokens with that attention" in line
    with torch.no_grad():
        base = model(x)
        same = compress(model, "dtps", keep=1.0, input_size=SIZE).eval()(x)
    assert (same - base).abs().max() <= 1e-5 * base.abs().max()


class _SideBranchViT(nn.Module):
    """Each block's MLP branch is kept aside and joins the stream only before the head: no block
    boundary follows its attention, so nothing can be reduced there."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, issue10.DIM, issue10.PATCH, issue10.PATCH)
        self.norms = nn.ModuleList([nn.LayerNorm(issue10.DIM) for _ in range(2)])
        self.attns = nn.ModuleList([issue10.Attention() for _ in range(2)])
        self.ffs = nn.ModuleList([issue10.FeedForward() for _ in range(2)])
        self.head = nn.Linear(issue10.DIM, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        side = torch.zeros_like(x)
        for norm, attn, ff in zip(self.norms, self.attns, self.ffs, strict=True):
            h = norm(x)
            x = x + attn(h)
            side = side + ff(h)
        return self.head((x + side).mean(dim=1))


def test_branches_that_never_rejoin_before_the_next_attention_are_refused_in_one_line():
    torch.manual_seed(0)
    with pytest.raises(MappingError) as refused:
        map_model(_SideBranchViT().eval(), SIZE)
    line = str(refused.value)
    assert "\n" not in line and line.startswith("parallel block at attns.0 ")
    assert "branches do not rejoin into one token stream before other attention" in line


def test_a_variant_that_matches_on_keys_is_refused_at_a_block_with_several_attention_cores():
    """ToMe matches tokens by one attention's keys: two softmaxes' keys make no such set. Its plan
    refuses it; the rewrite refuses it too, should a plan get that far."""
    with pytest.raises((PlanError, RewriteError)) as refused:
        compress(build("dwee"), "tome", keep=0.9, input_size=SIZE)
    line = str(refused.value)
    assert "\n" not in line and "has 2 attention cores; tome " in line
