"""compress(): the rewritten models behave like the method says, on every vanilla family."""

import copy

import pytest
import timm
import torch

import vitcompress
from tests.models import VANILLA, timm_small
from vitcompress.compilation.plan import PlanError
from vitcompress.measure import count_macs, count_params
from vitcompress.measure.models import tokens_per_block

VARIANTS = ["dtps", "dynamicvit", "etps", "evit"]


def _build(name):
    torch.manual_seed(0)
    factory, size, _, _ = VANILLA[name]
    return factory().eval(), size


@pytest.mark.parametrize("name", list(VANILLA))
@pytest.mark.parametrize("variant", VARIANTS)
def test_keep_one_gives_the_base_logits(name, variant):
    model, size = _build(name)
    x = torch.randn(3, *size)
    compressed = vitcompress.compress(model, variant, keep=1.0, locs=[1, 2], input_size=size)
    with torch.no_grad():
        torch.testing.assert_close(compressed.eval()(x), model(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(VANILLA))
@pytest.mark.parametrize("variant", VARIANTS)
def test_inference_drops_tokens_and_each_image_is_independent(name, variant):
    model, size = _build(name)
    _, _, prefix, _ = VANILLA[name]
    compressed = vitcompress.compress(model, variant, keep=0.5, locs=[1, 3], input_size=size).eval()
    x = torch.randn(4, *size)
    with torch.no_grad():
        together = compressed(x)
        alone = torch.cat([compressed(x[i : i + 1]) for i in range(4)])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-4)
    tokens = tokens_per_block(compressed, size)
    n0 = 64
    if variant in ("dtps", "dynamicvit"):
        expected = [prefix + n0] + [prefix + 32] * 2 + [prefix + 16]
    else:  # ceil(0.5 * n) of the tokens present, EViT adds its fused token
        extra = 1 if variant == "evit" else 0
        after_first = 32 + extra
        expected = [prefix + n0] * 2 + [prefix + after_first] * 2
    assert tokens == expected
    with torch.no_grad():  # (deit3's layer scale starts at 1e-5: differences are small there)
        assert not torch.equal(compressed(x), model(x))


def test_compress_leaves_the_model_unchanged():
    model, size = _build("vit")
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(2, *size)
    with torch.no_grad():
        out_before = model(x)
    compressed = vitcompress.compress(model, "dtps", keep=0.5, input_size=size)
    compressed.train()
    compressed(x).sum().backward()
    assert type(model).__name__ == "VisionTransformer"
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    with torch.no_grad():
        assert torch.equal(model(x), out_before)


@pytest.mark.parametrize("name", ["vit", "inhouse_mha", "inhouse_einsum", "inhouse_registers"])
@pytest.mark.parametrize("variant", ["dtps", "dynamicvit"])
def test_predictor_training_path_masks_instead_of_dropping(name, variant):
    model, size = _build(name)
    compressed = vitcompress.compress(model, variant, keep=0.5, locs=[1, 2], input_size=size)
    compressed.train()
    masks = []
    handles = [
        module.register_forward_hook(lambda m, i, o: masks.append(o[1]))
        for module in compressed.tps.children()
    ]
    x = torch.randn(3, *size)
    out = compressed(x)
    out.logsumexp(-1).sum().backward()
    for handle in handles:
        handle.remove()
    prefix = VANILLA[name][2]
    assert [tuple(m.shape) for m in masks] == [(3, prefix + 64)] * 2  # nothing dropped
    assert torch.all(masks[1] <= masks[0])  # once dropped, stays dropped
    assert torch.all(masks[0][:, :prefix] == 1)
    for param_name, param in compressed.named_parameters():
        if param_name.startswith("tps."):
            assert param.grad is not None and param.grad.abs().sum() > 0, param_name


def test_training_masks_change_the_later_blocks():
    """The key mask must reach the attention of later blocks: dropping tokens changes logits."""
    model, size = _build("vit")
    compressed = vitcompress.compress(model, "dynamicvit", keep=0.3, locs=[1], input_size=size)
    compressed.train()
    x = torch.randn(2, *size)
    torch.manual_seed(0)
    masked = compressed(x)
    compressed.tps.get_submodule("0").keep_ratio = 1.0
    with torch.no_grad():
        assert not torch.allclose(masked, model(x), atol=1e-3)


def test_paper_parameter_counts():
    for name, expected in (("deit_small_patch16_224", 22.77e6), ("deit_tiny_patch16_224", 5.90e6)):
        model = timm.create_model(name)
        compressed = vitcompress.compress(model, "dtps", keep=0.7, locs=[3, 6, 9])
        assert count_params(compressed) == pytest.approx(expected, abs=0.005e6), name


def _block_macs(n: int, c: int, mlp_ratio: int = 4) -> int:
    return (
        n * c * 3 * c  # qkv
        + 2 * n * n * c  # q @ k^T and attn @ v
        + n * c * c  # proj
        + 2 * n * c * mlp_ratio * c  # fc1, fc2
        + 2 * 5 * n * c  # two LayerNorms, counted as fvcore does
    )


def _vit_macs(tokens: list[int], c: int, patch_tokens: int, patch: int, classes: int) -> int:
    stem = patch_tokens * c * 3 * patch * patch
    return stem + sum(_block_macs(n, c) for n in tokens) + 5 * tokens[-1] * c + c * classes


def test_reported_macs_equal_an_analytic_count():
    model, size = _build("vit")  # 64 patches of 4x4, 1 cls token, dim 64, 4 blocks
    c = 64
    base = _vit_macs([65] * 4, c, 64, 4, 10)
    assert count_macs(model, size) == base

    # dtps at block 2, keep 0.5: predictor on 64 tokens (its first out Linear splits into a
    # per-token local half and one global row per image), cosine of 32 donors x 32 hosts.
    compressed = vitcompress.compress(model, "dtps", keep=0.5, locs=[2], input_size=size)
    half = c // 2
    predictor = (
        5 * 64 * c + 64 * c * c + 64 * half * half + half * half + 64 * (half * c // 4 + c // 4 * 2)
    )
    squeeze = 32 * 32 * c
    expected = _vit_macs([65, 65, 33, 33], c, 64, 4, 10) + predictor + squeeze
    assert count_macs(compressed, size) == expected

    # etps at block 2: the cls row (1 x 65 keys) is recomputed for the score, the MLP of block 2
    # already sees 33 tokens.
    compressed = vitcompress.compress(model, "etps", keep=0.5, locs=[2], input_size=size)
    n_full, n_kept = 65, 33
    block2 = (
        n_full * c * 3 * c
        + 2 * n_full * n_full * c
        + n_full * c * c
        + 5 * n_full * c
        + 2 * n_kept * c * 4 * c
        + 5 * n_kept * c
    )
    score = n_full * c
    expected = (
        _vit_macs([65, 65, 33, 33], c, 64, 4, 10)
        - _block_macs(33, c)
        + block2
        + score
        + 32 * 32 * c
    )
    assert count_macs(compressed, size) == expected


def test_random_policy_selects_differently():
    model, size = _build("vit")
    x = torch.randn(2, *size)
    scored = vitcompress.compress(model, "etps", keep=0.5, locs=[1], input_size=size).eval()
    rand = vitcompress.compress(
        model, "etps", keep=0.5, locs=[1], input_size=size, policy="random"
    ).eval()
    with torch.no_grad():
        assert not torch.allclose(scored(x), rand(x))


@pytest.mark.parametrize(
    "keep, locs, message",
    [
        (1.5, [1], "^keep must be in"),
        (0.0, [1], "^keep must be in"),
        (0.5, [4], "out of range"),
        (0.5, [2, 1], "strictly increasing"),
        (0.5, [1, 1], "strictly increasing"),
        ([0.5, 0.5], [1], "2 values for 1"),
    ],
)
def test_bad_plans_are_refused(keep, locs, message):
    model, size = _build("vit")
    with pytest.raises(PlanError, match=message):
        vitcompress.compress(model, "dtps", keep=keep, locs=locs, input_size=size)


def test_save_and_load_round_trip(tmp_path):
    model = timm_small("vit_small_patch16_224").eval()
    compressed = vitcompress.compress(model, "dtps", keep=0.5, locs=[1, 2], input_size=(3, 32, 32))
    with torch.no_grad():
        for p in compressed.tps.parameters():  # weights that differ from a fresh build
            p.add_(0.1)
    vitcompress.save(compressed, tmp_path / "art", source=_source_of_small_vit())
    again = vitcompress.load(tmp_path / "art")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(again(x), compressed.eval()(x))


def test_a_deep_copy_is_still_a_compressed_model(tmp_path):
    # EMA and users copy models with copy.deepcopy, which rebuilds a GraphModule from scratch.
    import copy

    compressed = vitcompress.compress(
        timm_small("vit_small_patch16_224"), "etps", keep=0.5, locs=[1], input_size=(3, 32, 32)
    )
    clone = copy.deepcopy(compressed)
    assert clone.vitcompress_plan == compressed.vitcompress_plan
    assert clone.vitcompress_block_nodes == compressed.vitcompress_block_nodes
    vitcompress.save(clone, tmp_path / "art", source=_source_of_small_vit())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vitcompress.load(tmp_path / "art")(x), compressed.eval()(x))


def _source_of_small_vit():
    from tests.models import SMALL
    from vitcompress.loading import ModelSource

    return ModelSource(spec="vit_small_patch16_224", model_args=dict(SMALL))


def test_a_float64_model_is_captured_on_a_float64_example():
    # torch's default dtype stays float32: the capture's example takes the model's dtype, where
    # a float32 example made the model fail and the input size was blamed.
    assert torch.get_default_dtype() == torch.float32
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10
    ).double()
    model.eval()
    images = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        base = model(images)
        same = vitcompress.compress(model, "etps", keep=1.0, input_size=(3, 32, 32))(images)
        reduced = vitcompress.compress(model, "etps", keep=0.7, input_size=(3, 32, 32))(images)
    assert same.dtype == torch.float64 and (same - base).abs().max() <= 1e-12
    assert reduced.dtype == torch.float64 and reduced.shape == base.shape


@pytest.mark.parametrize("variant", ["etps", "evit"])
def test_a_score_read_off_every_query_costs_no_second_attention(variant):
    # Without a cls token the score is the attention each token receives from every query: the
    # hook computes the probabilities once and the output from them. The fused kernel plus a
    # second q k^T for the score counted half the attention again (SAM-B at 1024 px cost more
    # than its base at keep 0.7).
    from tests.test_dense_outputs import sharpen  # q/k x3, LayerScale 1

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=64, patch_size=8, depth=3, class_token=False,
        global_pool="avg", num_classes=10,
    )  # fmt: skip
    with torch.no_grad():
        model.pos_embed.normal_()  # a position table ~N(0, 1)
    model = sharpen(model).double()
    size = (3, 64, 64)
    torch.set_default_dtype(torch.float64)
    try:
        compressed = vitcompress.compress(
            model, variant, keep=[1.0] * 3, locs=[0, 1, 2], input_size=size
        )
        # Nothing is removed at keep 1 and the score comes with the attention: the count is the
        # base's to the MAC (a second q k^T would add 3 x 64 x 64 x 192 = 2,359,296).
        assert count_macs(compressed, size) == count_macs(model, size)
        images = torch.randn(2, *size)
        with torch.no_grad():
            base = model(images)
            assert (compressed(images) - base).abs().max() <= 1e-10 * base.abs().max()
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_multihead_attention_model_without_cls_scores_with_one_attention():
    # nn.MultiheadAttention hides its weights: the hook recomputes attention from the module's
    # projections, and without a cls token takes the score and the output from one q k^T.
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = torch.nn.LayerNorm(32), torch.nn.LayerNorm(32)
            self.attn = torch.nn.MultiheadAttention(32, 2, batch_first=True)
            self.mlp = torch.nn.Sequential(
                torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)
            )

        def forward(self, x):
            y = self.norm1(x)
            x = x + self.attn(y, y, y, need_weights=False)[0]
            return x + self.mlp(self.norm2(x))

    class NoClsViT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch_embed = torch.nn.Conv2d(3, 32, 4, 4)
            self.pos_embed = torch.nn.Parameter(torch.randn(1, 64, 32) * 0.02)
            self.blocks = torch.nn.Sequential(*(Block() for _ in range(3)))
            self.head = torch.nn.Linear(32, 10)

        def forward(self, images):
            x = self.patch_embed(images).flatten(2).transpose(1, 2) + self.pos_embed
            return self.head(self.blocks(x).mean(dim=1))

    torch.manual_seed(0)
    model = NoClsViT()
    with torch.no_grad():
        model.pos_embed.normal_()  # a position table ~N(0, 1)
        for block in model.blocks:  # queries and keys x3: attention far from uniform
            block.attn.in_proj_weight[:64] *= 3.0
    model = model.double().eval()
    size = (3, 32, 32)
    torch.set_default_dtype(torch.float64)
    try:
        compressed = vitcompress.compress(
            model, "etps", keep=[1.0] * 3, locs=[0, 1, 2], input_size=size
        )
        # The base's count to the MAC (a second q k^T would add 3 x 64 x 64 x 32 = 393,216).
        assert count_macs(compressed, size) == count_macs(model, size)
        images = torch.randn(2, *size)
        with torch.no_grad():
            base = model(images)
            assert (compressed(images) - base).abs().max() <= 1e-10 * base.abs().max()
            reduced = vitcompress.compress(model, "etps", keep=0.7, input_size=size)(images)
    finally:
        torch.set_default_dtype(torch.float32)
    assert reduced.shape == (2, 10) and torch.isfinite(reduced).all()
