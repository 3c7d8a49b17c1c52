"""ToMe (``--variant tome``): the matching and merge against hand computations, proportional
attention against the dense formula, whole models against a ToMe forward written from the paper's
code, keep -> r, exactness at r = 0, training through merges, artifacts and refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitcompress
from tests.fixtures import inhouse
from tests.models import SMALL, timm_small
from tests.test_positions import sharpen
from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.plan import PlanError, make_plan
from vitcompress.loading import ModelSource
from vitcompress.method import bipartite_soft_matching, merge_count, merge_tokens
from vitcompress.modules import MergeReducer, MHAHook, SDPAHook, SoftmaxHook
from vitcompress.training.losses import DistillationTaps
from vitcompress.variants import get_variant
from vitcompress.variants.tome import fit_r

SIZE = (3, 32, 32)


def vit(depth: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return sharpen(timm_small("vit_small_patch16_224", depth=depth))


# --- the pure functions against hand computations ------------------------------------------


# Sequence: 0 cls (a, protected), 1 b0, 2 a1, 3 b1, 4 a2. a1 is most like b1 (cosine 1);
# a2 ties between b0 and b1 (1/sqrt 2 each): the first maximum, b0.
METRIC = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0]]])


def test_matching_by_hand() -> None:
    one = bipartite_soft_matching(METRIC, r=1, protected=1)
    assert one.src.tolist() == [[1]] and one.dst.tolist() == [[1]]
    assert one.unmerged.tolist() == [[0, 2]]
    # ToMe's order: unmerged a tokens (sequence 0, 4), then the b tokens (1, 3).
    index = merge_tokens(METRIC, torch.ones(1, 5), one)[2]
    assert index.tolist() == [[0, 4, 1, 3]]
    two = bipartite_soft_matching(METRIC, r=5, protected=1)  # at most (5 - 1) // 2 = 2
    assert two.src.tolist() == [[1, 2]] and two.dst.tolist() == [[1, 0]]
    assert two.unmerged.tolist() == [[0]]
    # Two protected tokens: b0 (index 1) takes no merge either, so a2 goes to b1.
    guarded = bipartite_soft_matching(METRIC, r=1, protected=2)
    assert guarded.src.tolist() == [[1]] and guarded.dst.tolist() == [[1]]
    assert bipartite_soft_matching(METRIC, r=0, protected=1).src.shape == (1, 0)


def test_merge_is_size_weighted_by_hand() -> None:
    x = torch.tensor([[[10.0], [20.0], [30.0], [40.0], [50.0]]])
    sizes = torch.tensor([[1.0, 1.0, 2.0, 3.0, 1.0]])
    matching = bipartite_soft_matching(METRIC, r=2, protected=1)
    tokens, new_sizes, index = merge_tokens(x, sizes, matching)
    # b0 (20, size 1) takes a2 (50, size 1): 35, size 2; b1 (40, size 3) takes a1 (30, size 2):
    # (120 + 60) / 5 = 36, size 5; the cls token passes.
    assert tokens[0, :, 0].tolist() == pytest.approx([10.0, 35.0, 36.0])
    assert new_sizes.tolist() == [[1.0, 2.0, 5.0]]
    assert index.tolist() == [[0, 1, 3]]


@pytest.mark.parametrize("t,protected", [(5, 1), (6, 2), (20, 4), (9, 0), (2, 1), (3, 3)])
def test_protected_tokens_are_never_merged(t: int, protected: int) -> None:
    metric = torch.randn(3, t, 4)
    matching = bipartite_soft_matching(metric, r=t, protected=protected)
    assert matching.src.shape[1] == merge_count(t, t, protected)
    merged_away = {2 * int(i) for i in matching.src.flatten()}
    merged_into = {2 * int(j) + 1 for j in matching.dst.flatten()}
    assert not merged_away & set(range(protected))
    assert not merged_into & set(range(protected))


def _order_by_definition(unmerged_a: int, b_count: int, protected: int) -> list[int]:
    """ToMe's order over ``cat([unmerged a, b])``, written out: the protected tokens in sequence
    order (a0 b0 a1 b1 ...), then the other unmerged ``a`` tokens, then the other ``b`` tokens."""
    protected_a, protected_b = (protected + 1) // 2, protected // 2
    prefix = [i // 2 if i % 2 == 0 else unmerged_a + i // 2 for i in range(protected)]
    rest = [*range(protected_a, unmerged_a), *range(unmerged_a + protected_b, unmerged_a + b_count)]
    return prefix + rest


@pytest.mark.parametrize(
    "t,protected,r", [(9, 0, 3), (9, 1, 3), (10, 2, 3), (11, 3, 2), (14, 5, 4)]
)
def test_merged_tokens_come_in_tomes_order_without_a_host_index(t, protected, r) -> None:
    torch.manual_seed(t + protected)
    x, metric = torch.randn(2, t, 6), torch.randn(2, t, 4)
    sizes = torch.randint(1, 4, (2, t)).float()
    matching = bipartite_soft_matching(metric, r=r, protected=protected)
    tokens, new_sizes, index = merge_tokens(x, sizes, matching)
    # The same merge with the order applied by an index built from the definition.
    unmerged_a, b_count = matching.unmerged.shape[1], t // 2
    order = torch.tensor(_order_by_definition(unmerged_a, b_count, protected))
    weights = sizes.unsqueeze(-1)
    wa, wb, sa, sb = (
        (x * weights)[:, ::2],
        (x * weights)[:, 1::2],
        weights[:, ::2],
        weights[:, 1::2],
    )
    src, dst = matching.src.unsqueeze(-1), matching.dst.unsqueeze(-1)
    merged = wb.scatter_add(1, dst.expand(-1, -1, 6), wa.gather(1, src.expand(-1, -1, 6)))
    merged_sizes = sb.scatter_add(1, dst, sa.gather(1, src))
    kept = wa.gather(1, matching.unmerged.unsqueeze(-1).expand(-1, -1, 6))
    kept_sizes = sa.gather(1, matching.unmerged.unsqueeze(-1))
    all_sizes = torch.cat([kept_sizes, merged_sizes], 1)[:, order]
    expected = torch.cat([kept, merged], 1)[:, order] / all_sizes
    b_index = torch.arange(b_count).expand(2, -1) * 2 + 1
    expected_index = torch.cat([matching.unmerged * 2, b_index], 1)[:, order]
    assert torch.equal(index, expected_index) and torch.equal(tokens, expected)
    assert torch.equal(new_sizes, all_sizes.squeeze(-1))
    assert index[:, :protected].tolist() == [list(range(protected))] * 2  # protected first


def test_tomes_merge_makes_no_tensor_from_host_data() -> None:
    """An index made from a Python list in the forward is, on a GPU, a copy from the host and a
    wait for the device on every call (and no CUDA-graph capture): the merge makes none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostTensors(TorchDispatchMode):
        made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if func is torch.ops.aten.lift_fresh.default:  # torch.tensor(data)
                HostTensors.made += 1
            return func(*args, **(kwargs or {}))

    matching = bipartite_soft_matching(torch.randn(2, 12, 4), r=3, protected=2)
    with HostTensors():
        merge_tokens(torch.randn(2, 12, 6), torch.ones(2, 12), matching)
    with HostTensors():
        torch.tensor([1, 2])  # the mode sees one where one is made
    assert HostTensors.made == 1


def test_merge_reducer_keeps_the_destinations_positions() -> None:
    x = torch.arange(5.0).reshape(1, 5, 1).repeat(1, 1, 2)
    reducer = MergeReducer(prefix_tokens=1, r=2)
    positions = torch.tensor([[7, 3, 9, 5]])  # grid positions of the 4 patch tokens present
    tokens, mask, new_positions, sizes, trace = reducer(x, METRIC, None, positions, None)
    assert mask is None and tokens.shape == (1, 3, 2) and trace == ()  # no restore asked
    assert new_positions.tolist() == [[7, 9]]  # b0 (sequence 1) and b1 (sequence 3)
    assert sizes.tolist() == [[1.0, 2.0, 2.0]]
    same = MergeReducer(prefix_tokens=1, r=0)(x, METRIC, None, positions, None)
    assert same[0] is x and same[2] is positions and same[3] is None


# --- proportional attention against the dense formula ----------------------------------------


def _dense(q, k, v, sizes, scale):
    logits = (q @ k.transpose(-2, -1)) * scale + sizes.log()[:, None, None, :]
    return logits.softmax(dim=-1) @ v


def test_proportional_attention_sdpa_and_softmax() -> None:
    q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
    sizes = torch.tensor([[1.0, 2.0, 1.0, 5.0, 1.0, 3.0], [1.0, 1.0, 4.0, 1.0, 2.0, 1.0]])
    scale = 8**-0.5
    expected = _dense(q, k, v, sizes, scale)
    hook = SDPAHook(prefix_tokens=1, has_cls=True, score=False)
    assert torch.allclose(hook(q, k, v, sizes=sizes), expected, atol=1e-6)
    softmax = SoftmaxHook(prefix_tokens=1, has_cls=True, score=False)
    probs = softmax((q @ k.transpose(-2, -1)) * scale, sizes=sizes)
    assert torch.allclose(probs @ v, expected, atol=1e-6)
    # Without sizes, nothing is added.
    plain = F.scaled_dot_product_attention(q, k, v)
    assert torch.equal(hook(q, k, v), plain)


def test_proportional_attention_multihead_module() -> None:
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    sizes = torch.tensor([[1.0, 3.0, 1.0, 2.0, 1.0]]).expand(2, -1)
    out, _ = MHAHook(prefix_tokens=1, has_cls=True, score=False)(mha, x, x, x, sizes=sizes)
    w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
    b_q, b_k, b_v = mha.in_proj_bias.chunk(3)
    q, k, v = (
        F.linear(x, w, b).reshape(2, 5, 2, 8).transpose(1, 2)
        for w, b in ((w_q, b_q), (w_k, b_k), (w_v, b_v))
    )
    expected = mha.out_proj(_dense(q, k, v, sizes, 8**-0.5).transpose(1, 2).reshape(2, 5, 16))
    assert torch.allclose(out, expected, atol=1e-6)


# --- whole models ----------------------------------------------------------------------------


def _reference_matching(metric, r, distill_token=False):
    """ToMe's ``bipartite_soft_matching`` with ``class_token=True`` (tome/merge.py)."""
    t = metric.shape[1]
    r = min(r, (t - 1 - distill_token) // 2)
    metric = metric / metric.norm(dim=-1, keepdim=True)
    a, b = metric[..., ::2, :], metric[..., 1::2, :]
    scores = a @ b.transpose(-1, -2)
    scores[..., 0, :] = -math.inf
    if distill_token:
        scores[..., :, 0] = -math.inf
    node_max, node_idx = scores.max(dim=-1)
    edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
    unm_idx, src_idx = edge_idx[..., r:, :], edge_idx[..., :r, :]
    dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
    unm_idx = unm_idx.sort(dim=1)[0]

    def merge(x):
        src, dst = x[..., ::2, :], x[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
        src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
        dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce="sum")
        if distill_token:
            return torch.cat([unm[:, :1], dst[:, :1], unm[:, 1:], dst[:, 1:]], dim=1)
        return torch.cat([unm, dst], dim=1)

    return merge


def tome_reference(model: nn.Module, image: torch.Tensor, merges: dict[int, int]) -> torch.Tensor:
    """A timm ViT run as ToMe's timm patch runs it: proportional attention, merge after the
    attention residual with the head-mean keys, size-weighted (``merges``: block -> r)."""
    x = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(image))))
    size = None
    for i, blk in enumerate(model.blocks):
        attn = blk.attn
        y = blk.norm1(x)
        b, n, c = y.shape
        qkv = attn.qkv(y).reshape(b, n, 3, attn.num_heads, c // attn.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = attn.q_norm(q), attn.k_norm(k)
        logits = (q * attn.scale) @ k.transpose(-2, -1)
        if size is not None:
            logits = logits + size.log()[:, None, None, :, 0]
        out = (logits.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, c)
        x = x + blk.ls1(attn.proj(attn.norm(out)))
        if merges.get(i, 0) > 0:
            merge = _reference_matching(k.mean(1), merges[i], model.num_prefix_tokens == 2)
            size = torch.ones_like(x[..., 0, None]) if size is None else size
            x = merge(x * size)
            size = merge(size)
            x = x / size
        x = x + blk.ls2(blk.mlp(blk.norm2(x)))
    return model.forward_head(model.norm(x))


@pytest.mark.parametrize(
    "name,keep,tome_r",
    [
        ("vit_small_patch16_224", 0.5, None),
        ("vit_small_patch16_224", 0.7, None),
        ("vit_small_patch16_224", None, 3),
        ("deit_tiny_distilled_patch16_224", 0.5, None),  # ToMe's distill_token protection
    ],
)
def test_compressed_vit_matches_the_tome_reference(name, keep, tome_r) -> None:
    torch.manual_seed(0)
    model = sharpen(timm_small(name, depth=6))
    settings = None if tome_r is None else {"r": tome_r}
    compressed = vitcompress.compress(
        model, "tome", keep=keep, variant_args=settings, input_size=SIZE
    )
    plan = compression_info(compressed).plan
    merges = {loc.block: loc.merge_tokens for loc in plan.locations}
    assert sum(merges.values()) > 0
    image = torch.randn(2, *SIZE)
    with torch.no_grad():
        expected = tome_reference(model, image, merges)
        got = compressed.eval()(image)
        base = model(image)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    assert not torch.allclose(got, base, atol=1e-3)  # the merges changed something


@pytest.mark.parametrize("name", ["vit", "deit_distilled", "mha", "registers"])
@pytest.mark.parametrize("how", [dict(keep=1.0), dict(variant_args={"r": 0})])
def test_exact_when_nothing_is_merged(name: str, how: dict) -> None:
    torch.manual_seed(0)
    model = {
        "vit": lambda: timm_small("vit_small_patch16_224"),
        "deit_distilled": lambda: timm_small("deit_tiny_distilled_patch16_224"),
        "mha": inhouse.mha_vit,
        "registers": inhouse.register_vit,
    }[name]()
    model = sharpen(model)
    compressed = vitcompress.compress(model, "tome", input_size=SIZE, **how).eval()
    assert all(loc.merge_tokens == 0 for loc in compression_info(compressed).plan.locations)
    image = torch.randn(2, *SIZE)
    with torch.no_grad():
        assert torch.allclose(compressed(image), model(image), atol=1e-6, rtol=0)


def test_keep_maps_to_r_by_the_tokens_left_after_the_last_block() -> None:
    model = vit(depth=12)  # 64 patch tokens; default locations 3, 6, 9
    for keep in (0.7, 0.5):
        plan = compression_info(vitcompress.compress(model, "tome", keep=keep)).plan
        assert [loc.block for loc in plan.locations] == list(range(3, 12))
        rs = {loc.merge_tokens for loc in plan.locations[:-1]}
        assert len(rs) == 1  # one r in every block (the last may be clamped to half)
        [r] = rs
        target = int(64 * keep**3)  # what dtps/dynamicvit keep after block 9

        def left(r: int) -> int:
            n = 64
            for _ in range(9):
                n -= min(r, n // 2)
            return n

        assert plan.locations[-1].keep_tokens == left(r)
        assert all(abs(left(r) - target) <= abs(left(o) - target) for o in range(33))
        assert all(abs(left(r) - target) < abs(left(o) - target) for o in range(r))
    assert fit_r(196, 9, int(196 * 0.125)) == 19  # DeiT-S, keep 0.5: 196 - 9 * 19 = 25


def test_r_is_merged_in_every_block_from_the_first_location() -> None:
    model = vit(depth=6)
    compressed = vitcompress.compress(model, "tome", variant_args={"r": 5}, locs=[2])
    plan = compression_info(compressed).plan
    assert plan.method.settings == {"r": 5} and plan.to_json()["variant_args"] == {"r": 5}
    assert [(loc.block, loc.merge_tokens, loc.keep_tokens) for loc in plan.locations] == [
        (2, 5, 59),
        (3, 5, 54),
        (4, 5, 49),
        (5, 5, 44),
    ]


def test_saved_tome_plan_rebuilds_the_same_model(tmp_path) -> None:
    model = vit(depth=6)
    compressed = vitcompress.compress(model, "tome", keep=0.6).eval()
    vitcompress.save(
        compressed,
        tmp_path / "art",
        source=ModelSource(spec="vit_small_patch16_224", model_args={**SMALL, "depth": 6}),
    )
    loaded = vitcompress.load(tmp_path / "art").eval()
    assert compression_info(loaded).plan == compression_info(compressed).plan
    image = torch.randn(2, *SIZE)
    with torch.no_grad():
        assert torch.equal(loaded(image), compressed(image))


def test_fine_tuning_goes_through_the_merges() -> None:
    model = vit(depth=4)
    compressed = vitcompress.compress(model, "tome", keep=0.5).train()
    taps = DistillationTaps(compressed, model, token_distill=True)
    assert not taps.learned  # no predictor, no ratio loss
    assert "ratio" not in get_variant("tome").losses
    image, target = torch.randn(4, *SIZE), torch.tensor([0, 1, 2, 3])
    optimizer = torch.optim.SGD(compressed.parameters(), lr=0.05)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = F.cross_entropy(compressed(image), target)
        loss.backward()
        losses.append(float(loss.detach()))
        optimizer.step()
    names = dict(compressed.named_parameters())
    for name in ("blocks.0.attn.qkv.weight", "blocks.3.mlp.fc1.weight", "head.weight"):
        assert names[name].grad is not None and names[name].grad.abs().sum() > 0, name
    assert losses[-1] < losses[0]
    # Token distillation pairs the merged tokens with the teacher's at their positions.
    assert taps.captured.positions is not None
    assert taps.captured.positions.shape[1] == taps.captured.student_tokens.shape[1] - 1
    taps.remove()


def test_refusals_are_one_line() -> None:
    torch.manual_seed(0)
    with pytest.raises(PlanError, match="einsum_softmax, whose keys tome cannot read"):
        vitcompress.compress(inhouse.einsum_vit(), "tome", input_size=SIZE)
    model = vit(depth=4)
    with pytest.raises(PlanError, match="policy 'random' is not defined for tome"):
        vitcompress.compress(model, "tome", policy="random")
    with pytest.raises(
        PlanError, match="variant_args r: etps has no such setting; it takes restore"
    ):
        vitcompress.compress(model, "etps", variant_args={"r": 2})
    with pytest.raises(PlanError, match="r: must be a whole number of tokens >= 0, got -1"):
        vitcompress.compress(model, "tome", variant_args={"r": -1})
    with pytest.raises(PlanError, match="keep_cumulative is for dtps and dynamicvit"):
        vitcompress.compress(model, "tome", keep_cumulative=[0.7, 0.49, 0.343])
    with pytest.raises(PlanError, match="has 2 attention cores; tome matches tokens by one"):
        vitcompress.compress(timm_small("vit_small_patch16_18x2_224"), "tome")
    model_map = vitcompress.compilation.compression.map_model(model)
    with pytest.raises(PlanError, match="at most half"):
        make_plan(model_map, get_variant("tome"), [0.4], [1, 2, 3])
    with pytest.raises(PlanError, match="keep and tome's r exclude each other"):
        vitcompress.compress(model, "tome", keep=0.5, variant_args={"r": 2})


def test_the_finetune_workflow_trains_tome_and_saves_it(tmp_path, monkeypatch) -> None:
    from accelerate.state import AcceleratorState, GradientState
    from torch.utils.data import TensorDataset

    from vitcompress.api import compress_loaded
    from vitcompress.loading import load_base_model
    from vitcompress.workflows.finetune import FinetuneConfig, finetune

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    torch.manual_seed(0)
    args = dict(img_size=32, patch_size=8, depth=4, embed_dim=32, num_heads=2, num_classes=2)
    base = load_base_model("vit_small_patch16_224", args)
    student = compress_loaded(base, "tome", keep=0.5)
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, (x[:, 0].mean((1, 2)) > 0).long())
    config = FinetuneConfig(epochs=1, batch_size=4, lr=1e-3, warmup_epochs=0, log_every=1)
    try:
        result = finetune(student, base.model, data, None, tmp_path / "run", config)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert result["steps"] == 4
    steps = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["type"] == "step"
    ]
    # No ratio loss (no predictor); token distillation pairs the merged tokens by position.
    assert {"ce", "distill", "token_distill"} <= set(steps[0]) and "ratio" not in steps[0]
    loaded = vitcompress.load(tmp_path / "run").eval()
    assert compression_info(loaded).plan == compression_info(student.model).plan
