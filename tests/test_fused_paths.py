"""Fused fast paths seen through.

In eval mode torch runs ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` as one fused
kernel. MACs of every attention form (that kernel, SDPA, einsum, matmul + softmax) must equal a
count by hand from the dimensions; a ViT written with torch's own ``nn.TransformerEncoderLayer``
must map, compress, be exact at keep 1, be cheaper at keep 0.7 and train; and the search's
analytic MACs must agree with the counted MACs on the families the tool compresses.
"""

from __future__ import annotations

import inspect
import json
import math
import warnings

import pytest
import timm
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from torchvision.models.vision_transformer import VisionTransformer

import vitcompress
import vitcompress.zoo  # noqa: F401 - registers the zoo's models into timm
from tests.fixtures import inhouse
from tests.models import timm_small
from vitcompress.analysis.capture import capture, fast_paths_off
from vitcompress.api import capture_and_map
from vitcompress.cli.main import cli
from vitcompress.compilation.plan import make_plan
from vitcompress.measure import count_macs
from vitcompress.search.cost import profile, relative_error
from vitcompress.variants import get_variant

SIZE = (3, 32, 32)
DIM = 64
DEPTH = 4
PATCH = 4
CLASSES = 10
PATCHES = (SIZE[1] // PATCH) ** 2
TOKENS = PATCHES + 1  # and a class token


pytestmark = pytest.mark.usefixtures("one_thread")


def hand_macs(*, hidden: int, depth: int = DEPTH, final_norm: bool = True) -> int:
    """MACs of a class-token ViT of this file's dimensions, in the papers' (fvcore's) convention:
    every linear layer and the patch convolution, both attention products (``q @ k^T`` and
    ``attn @ v``, over every head: ``tokens x tokens x width`` each) and 5 per element of an
    affine layer norm; biases, softmax, GELU and residual adds count nothing. The final norm
    runs on every token, the head on the class token."""
    stem = PATCHES * DIM * SIZE[0] * PATCH * PATCH
    projections = 4 * TOKENS * DIM * DIM  # q, k, v and the output projection
    products = 2 * TOKENS * TOKENS * DIM
    mlp = 2 * TOKENS * DIM * hidden
    norms = 2 * 5 * TOKENS * DIM
    final = 5 * TOKENS * DIM if final_norm else 0
    return stem + depth * (projections + products + mlp + norms) + final + DIM * CLASSES


# ---------------------------------------------------------------------------------------------
# Models, written as a new user would


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(SIZE[0], DIM, PATCH, PATCH)
        self.cls = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, TOKENS, DIM) * 0.02)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.patch(image).flatten(2).transpose(1, 2)
        return torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos


class MHABlock(nn.Module):
    """Pre-norm block on a batch-first ``nn.MultiheadAttention``: eval mode takes its fused
    ``_native_multi_head_attention``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm_a = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.norm_b = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm_a(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm_b(x))


class FormAttention(nn.Module):
    """The same attention written as SDPA, einsum or matmul + softmax."""

    def __init__(self, form: str, heads: int = 2) -> None:
        super().__init__()
        self.form, self.heads = form, heads
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scale = (c // self.heads) ** -0.5
        if self.form == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v)
        elif self.form == "einsum":
            weights = torch.einsum("bhnd,bhmd->bhnm", q, k).mul(scale).softmax(dim=-1)
            y = torch.einsum("bhnm,bhmd->bhnd", weights, v)
        else:
            y = (q @ k.transpose(-2, -1) * scale).softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class FormBlock(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.norm_a = nn.LayerNorm(DIM)
        self.attn = FormAttention(form)
        self.norm_b = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_a(x))
        return x + self.mlp(self.norm_b(x))


class BlockViT(nn.Module):
    def __init__(self, make_block) -> None:
        super().__init__()
        self.embed = Embed()
        self.blocks = nn.ModuleList([make_block() for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.embed(image)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class EncoderViT(nn.Module):
    """A ViT on torch's own ``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer``s."""

    def __init__(
        self,
        dim: int = 64,
        depth: int = 4,
        heads: int = 4,
        patch: int = 4,
        image: int = 32,
        classes: int = 10,
        norm_first: bool = True,
        sequential: bool = False,
    ) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, activation="gelu", batch_first=True, norm_first=norm_first
        )
        # Pre-norm layers leave their output unnormalised: the encoder's norm closes them.
        encoder = nn.TransformerEncoder(
            layer, depth, norm=nn.LayerNorm(dim) if norm_first else None
        )
        self.encoder = nn.Sequential(encoder) if sequential else encoder
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.encoder(x)[:, 0])


def torchvision_vit() -> nn.Module:
    return VisionTransformer(
        image_size=SIZE[1],
        patch_size=PATCH,
        num_layers=DEPTH,
        num_heads=2,
        hidden_dim=DIM,
        mlp_dim=2 * DIM,
        num_classes=CLASSES,
    )


def sharpen(model: nn.Module) -> nn.Module:
    """Scale every ``nn.MultiheadAttention``'s query and key projections by 3: attention far from
    uniform, so that a keep-1 model that reorders or mixes tokens shows it."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.MultiheadAttention):
                module.in_proj_weight[: 2 * module.embed_dim] *= 3.0
    return model


def bare_count(model: nn.Module) -> int:
    """MACs as torch's counter sees an eval-mode model on its own: fast paths as they are."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.eval()(torch.randn(1, *SIZE))
    return counter.get_total_flops() // 2


# ---------------------------------------------------------------------------------------------
# 1. MACs of every attention form


def test_an_inhouse_multihead_attention_model_counts_like_a_hand_count():
    model = BlockViT(MHABlock).eval()
    expected = hand_macs(hidden=4 * DIM)
    # The fused kernel hides projections and products alike from a bare counter: the test
    # exercises the fast path, not a model that never takes it.
    assert bare_count(model) < 0.7 * expected
    assert count_macs(model, SIZE) == expected
    assert torch.backends.mha.get_fastpath_enabled()  # restored for everyone else


def test_the_fast_path_setting_is_restored_as_it_was():
    model = BlockViT(MHABlock).eval()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        assert count_macs(model, SIZE) == hand_macs(hidden=4 * DIM)
        capture(model, torch.randn(2, *SIZE))
        assert not torch.backends.mha.get_fastpath_enabled()
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    with fast_paths_off():
        assert not torch.backends.mha.get_fastpath_enabled()
    assert torch.backends.mha.get_fastpath_enabled()


def test_a_torchvision_vit_counts_like_a_hand_count():
    model = torchvision_vit().eval()
    expected = hand_macs(hidden=2 * DIM)
    assert bare_count(model) < 0.7 * expected
    assert count_macs(model, SIZE) == expected


@pytest.mark.parametrize("form", ["sdpa", "einsum", "matmul"])
def test_every_attention_form_counts_like_a_hand_count(form):
    assert count_macs(BlockViT(lambda: FormBlock(form)), SIZE) == hand_macs(hidden=4 * DIM)


@pytest.mark.parametrize("norm_first", [True, False])
def test_a_transformer_encoder_counts_like_a_hand_count(norm_first):
    model = EncoderViT(norm_first=norm_first).eval()
    expected = hand_macs(hidden=4 * DIM, final_norm=norm_first)
    assert bare_count(model) < 0.1 * expected  # the fused layer hides the whole encoder
    assert count_macs(model, SIZE) == expected


def test_a_scripted_encoder_takes_the_fused_kernel_and_is_counted_the_same():
    """A TorchScript module ignores the fast-path switch: the fused kernels' formulas count it."""
    model = EncoderViT().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script is deprecated
        model.encoder = torch.jit.script(model.encoder)
    assert count_macs(model, SIZE) == hand_macs(hidden=4 * DIM)


# ---------------------------------------------------------------------------------------------
# 2. A ViT on nn.TransformerEncoderLayer maps, compresses, is exact at keep 1, and trains

ENCODERS = [
    pytest.param(dict(norm_first=True), id="pre-norm"),
    pytest.param(dict(norm_first=False), id="post-norm"),
    pytest.param(dict(norm_first=True, sequential=True), id="pre-norm-in-sequential"),
    pytest.param(dict(norm_first=False, sequential=True), id="post-norm-in-sequential"),
]


@pytest.mark.parametrize("options", ENCODERS)
def test_a_transformer_encoder_maps_to_its_layers(options):
    captured, model_map = capture_and_map(EncoderViT(**options).eval(), SIZE)
    # Traced plainly: nothing kept whole, no guard on the input's metadata (torch's encoder
    # checks ``is_nested`` for its nested-tensor path).
    assert captured.method == "symbolic_trace" and captured.leaves == []
    assert not any(n.target is torch._assert for n in captured.module.graph.nodes)
    prefix = "encoder.0" if options.get("sequential") else "encoder"
    assert [block.path for block in model_map.blocks] == [
        f"{prefix}.layers.{i}" for i in range(DEPTH)
    ]
    assert {block.attention.kind for block in model_map.blocks} == {"multihead_attention"}
    assert [block.attention.path for block in model_map.blocks] == [
        f"{prefix}.layers.{i}.self_attn" for i in range(DEPTH)
    ]
    assert len(model_map.stages) == 1 and model_map.stages[0].prefix_tokens == 1
    assert [block.tokens for block in model_map.blocks] == [TOKENS] * DEPTH


@pytest.mark.parametrize("options", ENCODERS)
@pytest.mark.parametrize("variant", ["etps", "dtps", "tome"])
def test_a_transformer_encoder_compresses_exactly_at_keep_one_and_cheaper_below(options, variant):
    model = sharpen(EncoderViT(**options)).eval()
    x = torch.randn(3, *SIZE)
    same = vitcompress.compress(model, variant, keep=1.0, locs=[1, 2], input_size=SIZE).eval()
    reduced = vitcompress.compress(model, variant, keep=0.7, locs=[1, 2], input_size=SIZE).eval()
    with torch.no_grad():
        base = model(x)
        torch.testing.assert_close(same(x), base, atol=1e-5, rtol=0)
        assert (reduced(x) - base).abs().max() > 1e-3  # tokens were really dropped
    base_macs = count_macs(model, SIZE)
    assert base_macs == hand_macs(hidden=4 * DIM, final_norm=options["norm_first"])
    assert count_macs(reduced, SIZE) < 0.85 * base_macs


@pytest.mark.parametrize("options", ENCODERS[:2])
@pytest.mark.parametrize("variant", ["etps", "dtps"])
def test_a_compressed_transformer_encoder_trains(options, variant):
    model = EncoderViT(**options).eval()
    compressed = vitcompress.compress(model, variant, keep=0.7, locs=[1, 2], input_size=SIZE)
    compressed.train()
    x, labels = torch.randn(4, *SIZE), torch.tensor([0, 1, 2, 3])
    out = compressed(x)
    logits = out[0] if isinstance(out, tuple) else out
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    assert math.isfinite(loss.item())
    grads = {name: p.grad for name, p in compressed.named_parameters() if p.requires_grad}
    assert all(g is None or torch.isfinite(g).all() for g in grads.values())
    attention = [g for name, g in grads.items() if name.endswith("self_attn.in_proj_weight")]
    assert len(attention) == DEPTH and all(g is not None and g.abs().sum() > 0 for g in attention)


def test_a_torchvision_vit_compresses_exactly_at_keep_one():
    model = sharpen(torchvision_vit()).eval()
    x = torch.randn(3, *SIZE)
    same = vitcompress.compress(model, "etps", keep=1.0, locs=[1, 2], input_size=SIZE).eval()
    with torch.no_grad():
        torch.testing.assert_close(same(x), model(x), atol=1e-5, rtol=0)


def test_apply_on_a_users_transformer_encoder_file(tmp_path):
    source = "\n\n".join(
        [
            "import torch\nfrom torch import nn",
            inspect.getsource(EncoderViT),
            "def build():\n    return EncoderViT()\n",
        ]
    )
    path = tmp_path / "mymodel.py"
    path.write_text(source)
    result = CliRunner().invoke(
        cli,
        [
            "apply",
            "--model",
            f"{path}:build",
            "--variant",
            "etps",
            "--keep",
            "0.7",
            *("--batch-size", "2", "--warmup", "1", "--runs", "2"),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["base"]["macs"] == hand_macs(hidden=4 * DIM)
    assert data["compressed"]["macs"] < 0.85 * data["base"]["macs"]


# ---------------------------------------------------------------------------------------------
# The search's analytic MACs against the counted MACs


FAMILIES = {
    "deit_tiny": (lambda: timm_small("deit_tiny_patch16_224"), SIZE),
    "pvt_v2_b0": (lambda: timm.create_model("pvt_v2_b0", num_classes=CLASSES), (3, 64, 64)),
    "inhouse_mha": (inhouse.mha_vit, SIZE),
    "inhouse_einsum": (inhouse.einsum_vit, SIZE),
    "inhouse_registers": (inhouse.register_vit, SIZE),
    "torchvision_vit": (torchvision_vit, SIZE),
    "transformer_encoder": (EncoderViT, SIZE),
    "transformer_encoder_post_norm": (lambda: EncoderViT(norm_first=False), SIZE),
    # The MLP beside the attention on one residual: it sees every token an eTPS block enters with.
    "vit_pwee": (lambda: timm_small("vit_pwee_patch16_reg1_gap_256"), SIZE),
    # Two attentions side by side in every block: both attentions' products are quadratic.
    "vit_parallel": (lambda: timm_small("vit_small_patch16_18x2_224"), SIZE),
    # Tails that see the tokens left: an attention-pooling head, and class attention.
    "vit_siglip": (lambda: timm_small("vit_base_patch16_siglip_224"), SIZE),
    "cait": (lambda: timm_small("cait_xxs24_224", depth_token_only=1), SIZE),
    # A bias table built by an MLP from coordinates: its cost does not depend on the tokens.
    "vit_relpos": (lambda: timm_small("vit_relpos_small_patch16_224"), SIZE),
    # Differential attention: q and k narrower than v (the cls-row score's width is q k^T's).
    "vit_diff": (lambda: timm_small("vit_dwee_patch16_reg1_gap_256"), SIZE),
    # Keys and values projected from the pooled grid (strided convs): their linears are constant.
    "cvt_13": (lambda: timm.create_model("cvt_13", num_classes=CLASSES), (3, 64, 64)),
}
# ToMe matches on keys: refused on pooled keys (PVT, CvT), on einsum attention, on a block with two
# attentions (parallel, differential), and before class attention over the keys it would merge.
TOME_REFUSED = {"pvt_v2_b0", "inhouse_einsum", "vit_parallel", "cait", "vit_diff", "cvt_13"}
# CvT's default locations, in its deepest stage, where the keys' constant projections weigh most.
LOCS = {"cvt_13": [3, 6, 9]}
# Predictors are refused where a later block attends over keys from before the reduction (CaiT's
# class attention): their training path could not mask the pruned keys there.
PREDICTORS_REFUSED = {"cait"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_analytic_macs_agree_with_counted_macs(family):
    factory, size = FAMILIES[family]
    model = factory().eval()
    _, model_map = capture_and_map(model, size)
    cost = profile(model, model_map)
    base = count_macs(model, size)
    assert cost.base_macs == base
    # The profile splits the base into parts; put back together at full tokens they are it.
    rebuilt = cost.outside + sum(b.macs(b.tokens, b.tokens) for b in cost.blocks)
    assert relative_error(rebuilt, base) < 1e-9
    # One location in the second stage of a pyramid, two in a plain ViT.
    # (CaiT's class attention is a stage of its own, with nothing to reduce.)
    pyramid = len(model_map.stages) > 1 and family != "cait"
    locs = [model_map.stages[1].blocks[0]] if pyramid else [1, 2]
    locs = LOCS.get(family, locs)
    variants = ["etps", "evit"]
    variants += [] if family in PREDICTORS_REFUSED else ["dtps", "dynamicvit"]
    variants += [] if family in TOME_REFUSED else ["tome"]
    for variant in variants:
        plan = make_plan(model_map, get_variant(variant), [0.7] * len(locs), locs)
        compressed = vitcompress.compress(model, variant, [0.7] * len(locs), locs, size)
        counted = count_macs(compressed, size)
        assert counted < base, (family, variant)
        assert relative_error(cost.macs(plan), counted) < 0.01, (family, variant)


def test_models_on_torchs_multihead_attention_export_to_onnx(tmp_path):
    """Eval mode would run nn.MultiheadAttention's fused kernel, which the ONNX exporter has no
    op for: the export runs with fast paths off, and the file matches PyTorch."""
    from vitcompress.workflows.export import export_model

    model = sharpen(EncoderViT(norm_first=True)).eval()
    reduced = vitcompress.compress(model, "etps", keep=0.7, locs=[1, 2], input_size=SIZE)
    for label, candidate in (("base", model), ("etps", reduced)):
        result = export_model(candidate, SIZE, "onnx", tmp_path / f"{label}.onnx")
        assert result["max_abs_diff"] < 1e-4, label
