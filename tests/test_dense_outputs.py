"""Dense outputs: a compressed model whose output is its tokens (features, segmentation, video)
returns every token in the base's order and shape (the restore: ``method/restore.py``,
``modules/restore.py``, the rewrite's ``_restore_for``).

For each model (timm ViT without pooling or head; timm DINOv2's ``forward_features``, compressed
as the entry (``entry_view``); HF ``Dinov2Model``'s last hidden state, and all its hidden states;
the zoo's Segmenter; an in-house Conv3d video ViT, written below) and every method:

- keep 1 is exact (the reducers' permutations are undone);
- keep 0.7 gives the base's shapes at <= 0.85 of its MACs, a median per-token cosine to the base
  >= 0.95 (per pixel for the Segmenter's logits) and, for the Segmenter, >= 90% per-pixel argmax
  agreement.

Random weights are *sharpened* (:func:`sharpen`): the q/k projections scaled 3x so that attention
is far from uniform, LayerScale gammas set to 1, and the blocks' residual branches (attention
output and MLP's second linear) scaled so that the blocks move the tokens: timm's 0.02-std init
leaves a token's output within cosine 0.994 of its input, where restoring a token's value at any
time would pass the bar. ``test_the_sharpened_blocks_move_the_tokens`` holds them to that.

Also: training mode restores too (finite, the base's shapes, gradients reach dTPS's predictor);
``restore="zero"`` is zero-filling at the right positions; and the restore functions on
hand-made tensors (a permutation undone exactly, each rule as documented, a chain of two
removals where a host is removed later, the masked form agreeing with the indexed one).
``benchmarks/dense_restore.py`` measures every rule on these models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import Block
from torch import Tensor, nn

import vitcompress.zoo  # noqa: F401  registers segmenter_tiny_fmnist
from vitcompress.api import compress
from vitcompress.compilation.entries import entry_view
from vitcompress.measure import count_macs
from vitcompress.method.restore import (
    DELTA,
    HOST,
    RESTORE_RULES,
    VALUE,
    ZERO,
    MaskedRemoval,
    Removal,
    restore_masked,
    restore_tokens,
)
from vitcompress.modules.restore import TokenRestore

METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")
KEEP = 0.7
MAX_MACS_RATIO = 0.85
MIN_COSINE = 0.95
MIN_ARGMAX_AGREEMENT = 0.90
# Median cosine between a token entering the first block and leaving the last, at most: the
# blocks must move the tokens for the cosine bar to mean anything.
MAX_BLOCK_COSINE = 0.99

# --- the models --------------------------------------------------------------------------------

# Leaf names of the linears that make queries and keys (fused qkv: its first two thirds; PVT's kv:
# its first half), and of the linears that end a residual branch.
_QUERY_KEY = ("q", "k", "q_proj", "k_proj", "query", "key", "proj_q", "proj_k")
_BRANCH_ENDS = ("attn.proj", "mlp.fc2", "o_proj", "output.dense")
_LAYER_SCALES = ("ls1.gamma", "ls2.gamma", "lambda1")


def sharpen(model: nn.Module, branch: float = 1.0, query_key: float = 3.0) -> nn.Module:
    """Random weights under which the blocks do something: queries and keys scaled by
    ``query_key`` (attention far from uniform), LayerScale gammas 1, the residual branches'
    last linears scaled by ``branch``. In place; returns the model in eval mode."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, nn.Linear):
                continue
            leaf = name.rsplit(".", 1)[-1]
            rows = {"qkv": 2 * module.out_features // 3, "kv": module.out_features // 2}.get(
                leaf, module.out_features if leaf in _QUERY_KEY else 0
            )
            module.weight[:rows] *= query_key
            if module.bias is not None:
                module.bias[:rows] *= query_key
            if name.endswith(_BRANCH_ENDS):
                module.weight *= branch
        for name, param in model.named_parameters():
            if name.endswith(_LAYER_SCALES):
                param.fill_(1.0)
    return model.eval()


class HFFeatures(nn.Module):
    """HF ``Dinov2Model``: its last hidden state, or with ``hidden`` every hidden state too."""

    def __init__(self, model: nn.Module, hidden: bool = False) -> None:
        super().__init__()
        self.model, self.hidden = model, hidden

    def forward(self, pixel_values: Tensor):
        out = self.model(pixel_values=pixel_values, output_hidden_states=self.hidden)
        if self.hidden:
            return (out.last_hidden_state, *out.hidden_states)
        return out.last_hidden_state


class TubeletViT(nn.Module):
    """An in-house video ViT: a Conv3d tubelet embedding of (B, 3, T, H, W) to (B, T'H'W', D)
    tokens, a cls token, a learned position table, timm ``Block``s, a final norm; the output is
    the token sequence. Input (3, 4, 24, 32), tubelets 2x4x4: the grid (2, 6, 8), no two sides
    alike. Linears are initialised as timm's ViT does (truncated normal, std 0.02)."""

    def __init__(self, dim: int = 64, depth: int = 4, heads: int = 2) -> None:
        super().__init__()
        self.tubelets = nn.Conv3d(3, dim, (2, 4, 4), (2, 4, 4))
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + 2 * 6 * 8, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads, qkv_bias=True) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        for module in self.blocks.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)

    def forward(self, video: Tensor) -> Tensor:
        x = self.tubelets(video).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.norm(self.blocks(x))


def _timm_vit() -> nn.Module:
    return timm.create_model(
        "vit_small_patch16_224",
        img_size=32,
        patch_size=4,
        embed_dim=64,
        depth=6,
        num_heads=2,
        num_classes=0,
        global_pool="",
    )


def _timm_dinov2() -> nn.Module:
    model = timm.create_model(
        "vit_small_patch14_dinov2",
        img_size=28,
        patch_size=4,
        embed_dim=64,
        depth=6,
        num_heads=2,
        num_classes=0,
    )
    # Its forward_features as the model (what compress(..., entry="forward_features") compresses).
    return entry_view(model, "forward_features")


def _hf_dinov2(hidden: bool) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        from transformers import Dinov2Config, Dinov2Model

        config = Dinov2Config(
            image_size=28,
            patch_size=4,
            hidden_size=64,
            num_hidden_layers=6,
            num_attention_heads=2,
            intermediate_size=128,
        )
        return HFFeatures(Dinov2Model(config), hidden)

    return build


def _segmenter() -> nn.Module:
    return timm.create_model("segmenter_tiny_fmnist")  # 64x64 gray, patch 8, width 64, depth 6


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    input_size: tuple[int, ...]
    branch: float  # the residual branches' scale (sharpen): blocks moving tokens to cos ~0.92-0.99
    blocks: str  # the path of the block list, for the block-cosine guard
    batch: int = 4
    pixels: bool = False  # output (B, classes, H, W): cosine and argmax per pixel


# HF's own init already moves the tokens (cos 0.92 at branch 1); the Segmenter's per-pixel argmax
# over 11 near-tied random logits flips first, so its branches are scaled less.
MODELS: dict[str, Spec] = {
    "timm-vit": Spec(_timm_vit, (3, 32, 32), 3.0, "blocks"),
    "timm-dinov2": Spec(_timm_dinov2, (3, 28, 28), 3.0, "blocks"),
    "hf-dinov2": Spec(_hf_dinov2(False), (3, 28, 28), 1.0, "model.encoder.layer"),
    "hf-dinov2-hidden": Spec(_hf_dinov2(True), (3, 28, 28), 1.0, "model.encoder.layer"),
    "segmenter": Spec(_segmenter, (1, 64, 64), 2.0, "blocks", batch=8, pixels=True),
    "video": Spec(TubeletViT, (3, 4, 24, 32), 3.0, "blocks"),
}


def build_model(name: str, seed: int = 0) -> nn.Module:
    """The named model with sharpened random weights (the same for the same seed)."""
    spec = MODELS[name]
    torch.manual_seed(seed)
    return sharpen(spec.build(), branch=spec.branch)


def example_input(name: str, seed: int = 1) -> Tensor:
    spec = MODELS[name]
    return torch.randn(spec.batch, *spec.input_size, generator=torch.Generator().manual_seed(seed))


def outputs(out) -> list[Tensor]:
    """A model's output as a flat list of tensors."""
    return list(out) if isinstance(out, (tuple, list)) else [out]


def median_cosine(out: Tensor, base: Tensor, pixels: bool = False) -> float:
    """Median cosine per token (last axis) or, with ``pixels``, per pixel (axis 1)."""
    return F.cosine_similarity(out, base, dim=1 if pixels else -1).flatten().median().item()


def argmax_agreement(out: Tensor, base: Tensor) -> float:
    return (out.argmax(1) == base.argmax(1)).float().mean().item()


def compressed(model: nn.Module, name: str, method: str, keep: float, **variant_args):
    """``model`` compressed (eval mode); the predictors' random init drawn from a fixed seed."""
    torch.manual_seed(0)
    return compress(
        model,
        variant=method,
        keep=keep,
        input_size=MODELS[name].input_size,
        variant_args=variant_args or None,
    ).eval()


class _Cache:
    """Bases, their outputs and MACs, and the keep-0.7 compressions, built once per module."""

    def __init__(self) -> None:
        self.bases: dict[str, tuple[nn.Module, Tensor, list[Tensor]]] = {}
        self.macs: dict[str, int] = {}
        self.reduced: dict[tuple[str, str], nn.Module] = {}

    def base(self, name: str) -> tuple[nn.Module, Tensor, list[Tensor]]:
        if name not in self.bases:
            model, x = build_model(name), example_input(name)
            with torch.no_grad():
                self.bases[name] = (model, x, outputs(model(x)))
        return self.bases[name]

    def base_macs(self, name: str) -> int:
        if name not in self.macs:
            self.macs[name] = count_macs(self.base(name)[0], MODELS[name].input_size)
        return self.macs[name]

    def at_keep(self, name: str, method: str) -> nn.Module:
        if (name, method) not in self.reduced:
            self.reduced[name, method] = compressed(self.base(name)[0], name, method, KEEP)
        return self.reduced[name, method]


@pytest.fixture(scope="module")
def cache() -> _Cache:
    return _Cache()


MODEL_METHODS = [(name, method) for name in MODELS for method in METHODS]


# --- the done-when ----------------------------------------------------------------------------


def block_cosine(model: nn.Module, x: Tensor, blocks_path: str) -> float:
    """Median cosine between a token entering the first block of ``blocks_path`` and leaving the
    last: how much the blocks move the tokens."""
    blocks = model.get_submodule(blocks_path)
    seen: dict[str, Tensor] = {}
    first = blocks[0].register_forward_pre_hook(lambda m, args: seen.setdefault("in", args[0]))
    last = blocks[-1].register_forward_hook(
        lambda m, args, out: seen.setdefault("out", out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        model(x)
    first.remove()
    last.remove()
    return median_cosine(seen["out"], seen["in"])


@pytest.mark.parametrize("name", list(MODELS))
def test_the_sharpened_blocks_move_the_tokens(cache, name):
    """The bar below is not met by a token's value from anywhere along the way: the blocks
    change each token to a median cosine <= MAX_BLOCK_COSINE from what entered the first."""
    model, x, _ = cache.base(name)
    assert block_cosine(model, x, MODELS[name].blocks) <= MAX_BLOCK_COSINE


@pytest.mark.parametrize(("name", "method"), MODEL_METHODS)
def test_keep_one_is_exact(cache, name, method):
    model, x, base = cache.base(name)
    with torch.no_grad():
        out = outputs(compressed(model, name, method, 1.0)(x))
    assert [o.shape for o in out] == [b.shape for b in base]
    for o, b in zip(out, base, strict=True):
        torch.testing.assert_close(o, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("name", "method"), MODEL_METHODS)
def test_keep_07_gives_the_base_shapes_close_to_the_base(cache, name, method):
    model, x, base = cache.base(name)
    with torch.no_grad():
        out = outputs(cache.at_keep(name, method)(x))
    assert [o.shape for o in out] == [b.shape for b in base]
    pixels = MODELS[name].pixels
    cosines = [median_cosine(o, b, pixels) for o, b in zip(out, base, strict=True)]
    assert min(cosines) >= MIN_COSINE, cosines
    if pixels:
        assert argmax_agreement(out[0], base[0]) >= MIN_ARGMAX_AGREEMENT


@pytest.mark.parametrize(("name", "method"), MODEL_METHODS)
def test_keep_07_saves_macs(cache, name, method):
    ratio = count_macs(cache.at_keep(name, method), MODELS[name].input_size) / cache.base_macs(name)
    assert ratio <= MAX_MACS_RATIO


# --- training mode ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_dtps_restores_in_training_and_its_predictor_learns(cache, name):
    model, x, base = cache.base(name)
    student = compressed(model, name, "dtps", KEEP).train()
    out = outputs(student(x))
    assert [o.shape for o in out] == [b.shape for b in base]
    assert all(torch.isfinite(o).all() for o in out)
    sum(o.float().pow(2).mean() for o in out).backward()
    grads = [p.grad for n, p in student.named_parameters() if "predictor" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum().item() for g in grads) > 0


def test_dtps_in_training_restores_what_its_masks_removed():
    """Training keeps every token under masks (so the shape alone proves nothing): with the
    ``zero`` rule the reader gets exact zeros where a mask removed a token, the tokens elsewhere."""
    model, x = build_model("timm-vit"), example_input("timm-vit")
    student = compressed(model, "timm-vit", "dtps", KEEP, restore=ZERO).train()
    (restore,) = [m for m in student.modules() if isinstance(m, TokenRestore)]
    seen = []
    hook = restore.register_forward_hook(lambda m, a, o: seen.append((*a, o)))
    student(x)
    hook.remove()
    ((tokens, trace, restored),) = seen
    assert len(trace) > 1 and all(isinstance(r, MaskedRemoval) for r in trace)
    removed = torch.stack([r.removed for r in trace]).sum(dim=0) > 0  # (B, N)
    assert removed.any(dim=1).all() and not removed.all()
    p = restore.prefix_tokens
    assert torch.equal(restored[:, :p], tokens[:, :p])
    assert (restored[:, p:][removed] == 0).all()
    assert torch.equal(restored[:, p:][~removed], tokens[:, p:][~removed])


@pytest.mark.parametrize("method", METHODS)
def test_every_method_restores_in_training(cache, method):
    model, x, base = cache.base("video")
    out = outputs(compressed(model, "video", method, KEEP).train()(x))
    assert [o.shape for o in out] == [b.shape for b in base]
    assert all(torch.isfinite(o).all() for o in out)


# --- restore="zero" -----------------------------------------------------------------------------


def _grid_positions(trace: tuple, present: int) -> Tensor:
    """The grid position of each of the ``present`` non-prefix tokens after ``trace`` (-1: a
    token on no position, EViT's fused one), by following each removal's kept indices."""
    first = trace[0]
    batch = first.keep_index.shape[0]
    n0 = first.keep_index.shape[1] + first.prune_index.shape[1]
    positions = torch.arange(n0).expand(batch, -1)
    for i, removal in enumerate(trace):
        positions = positions.gather(1, removal.keep_index)
        after = (
            present
            if i + 1 == len(trace)
            else trace[i + 1].keep_index.shape[1] + trace[i + 1].prune_index.shape[1]
        )
        extra = after - positions.shape[1]  # tokens a fuse appended (not on the grid)
        positions = torch.cat([positions, positions.new_full((batch, extra), -1)], dim=1)
    return positions


@pytest.mark.parametrize("name", ["timm-vit", "segmenter", "video"])
@pytest.mark.parametrize("method", METHODS)
def test_the_zero_rule_scatters_the_present_tokens_into_zeros(cache, name, method):
    """What the restore gives the reader is the present tokens put at their grid positions, found
    independently from the trace's kept indices, and exact zeros everywhere else."""
    model, x, base = cache.base(name)
    reduced = compressed(model, name, method, KEEP, restore=ZERO)
    restores = [m for m in reduced.modules() if isinstance(m, TokenRestore)]
    assert restores and all(m.rule == ZERO for m in restores)
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, o: seen.append((m, *a, o))) for m in restores]
    with torch.no_grad():
        out = outputs(reduced(x))
    for hook in hooks:
        hook.remove()
    assert [o.shape for o in out] == [b.shape for b in base]
    assert seen
    for module, tokens, trace, restored in seen:
        assert module.axis == 1 and tokens.dim() == 3
        p = module.prefix_tokens
        positions = _grid_positions(trace, tokens.shape[1] - p)
        n0 = trace[0].keep_index.shape[1] + trace[0].prune_index.shape[1]
        expected = tokens.new_zeros(tokens.shape[0], n0, tokens.shape[2])
        for b in range(tokens.shape[0]):
            on_grid = positions[b] >= 0
            expected[b, positions[b][on_grid]] = tokens[b, p:][on_grid]
        torch.testing.assert_close(restored[:, :p], tokens[:, :p], atol=0, rtol=0)
        torch.testing.assert_close(restored[:, p:], expected, atol=0, rtol=0)
        zero_rows = (restored[:, p:] == 0).all(dim=-1).sum(dim=1)
        assert (zero_rows == n0 - (positions >= 0).sum(dim=1)).all() and (zero_rows > 0).all()
    if name == "timm-vit":  # the reader is the model's output: the zeros are what it returns
        assert torch.equal(seen[0][-1], out[0])


# --- method/restore.py on hand-made tensors -----------------------------------------------------


def _tokens(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _index(rows: list[list[int]]) -> Tensor:
    return torch.tensor(rows, dtype=torch.long)


@pytest.mark.parametrize("rule", RESTORE_RULES)
def test_restore_undoes_a_permutation_exactly(rule):
    """Nothing removed, the tokens reordered (a selection's kept order): every rule puts each
    token back where it came from, bit for bit."""
    grid = _tokens(2, 6, 3, seed=0)
    keep = _index([[4, 1, 5, 0, 3, 2], [0, 5, 2, 3, 1, 4]])
    reordered = grid.gather(1, keep.unsqueeze(-1).expand(-1, -1, 3))
    removal = Removal(
        keep,
        keep[:, :0],
        host_index=keep[:, :0],
        removed=grid[:, :0],
        output=reordered,
        kept=reordered,
    )
    assert torch.equal(restore_tokens(reordered, [removal], rule), grid)


def _one_removal() -> tuple[Tensor, Tensor, Removal, Tensor]:
    """Six tokens; tokens 0, 2 and 5 are removed into output tokens 1, 0 and 1 (which stand at
    the input's 1 and 4); the output then changes. Returns (input, output, removal, now)."""
    grid = _tokens(1, 6, 2, seed=1)
    keep, prune, hosts = _index([[4, 1, 3]]), _index([[0, 2, 5]]), _index([[1, 0, 1]])
    kept = grid[:, [4, 1, 3]]
    fused = kept.clone()
    fused[:, 0] += 0.5 * grid[:, 2]  # what the fuse added to each host
    fused[:, 1] += 0.25 * (grid[:, 0] + grid[:, 5])
    removal = Removal(keep, prune, hosts, grid[:, [0, 2, 5]], fused, kept)
    now = fused + _tokens(1, 3, 2, seed=2)  # the blocks after the location
    return grid, fused, removal, now


def test_each_rule_fills_the_removed_tokens_as_documented():
    grid, fused, removal, now = _one_removal()
    change = now - fused  # each present token's change since the location
    # Kept tokens at their positions: 4 <- now[0], 1 <- now[1], 3 <- now[2].
    kept_at = {4: 0, 1: 1, 3: 2}
    host_of = {0: 1, 2: 0, 5: 1}  # removed position -> its host among the output tokens
    expected = {
        HOST: {pos: now[0, h] for pos, h in host_of.items()},
        VALUE: {pos: grid[0, pos] for pos in host_of},
        DELTA: {pos: grid[0, pos] + change[0, h] for pos, h in host_of.items()},
        ZERO: {pos: torch.zeros(2, dtype=torch.float64) for pos in host_of},
    }
    for rule, removed in expected.items():
        restored = restore_tokens(now, [removal], rule)
        for pos, i in kept_at.items():
            # delta: a host sheds what the fuse added (its own value then + the group's change)
            want = grid[0, pos] + change[0, i] if rule == DELTA else now[0, i]
            torch.testing.assert_close(restored[0, pos], want, msg=f"{rule}: kept {pos}")
        for pos, want in removed.items():
            torch.testing.assert_close(restored[0, pos], want, msg=f"{rule}: removed {pos}")


def _chain() -> tuple[dict[str, Tensor], list[Removal]]:
    """ToMe-style: t3 is merged into t1 (removal 1); the blocks change the three tokens; t1's
    token is then merged into t2's (removal 2), which comes out first, before t0's."""
    t = _tokens(1, 4, 2, seed=3)
    m1 = (t[:, 1] + t[:, 3]) / 2
    out1 = torch.stack([t[:, 0], m1, t[:, 2]], dim=1)
    first = Removal(
        _index([[0, 1, 2]]), _index([[3]]), _index([[1]]), t[:, [3]], out1, t[:, [0, 1, 2]]
    )
    y = out1 + _tokens(1, 3, 2, seed=4)
    m2 = (y[:, 2] + y[:, 1]) / 2
    out2 = torch.stack([m2, y[:, 0]], dim=1)
    second = Removal(_index([[2, 0]]), _index([[1]]), _index([[0]]), y[:, [1]], out2, y[:, [2, 0]])
    z = out2 + _tokens(1, 2, 2, seed=5)
    return {"t": t, "m1": m1, "y": y, "m2": m2, "z": z}, [first, second]


def test_a_chain_where_the_host_is_removed_later_follows_its_host():
    v, chain = _chain()
    t, m1, y, m2, z = v["t"][0], v["m1"][0], v["y"][0], v["m2"][0], v["z"][0]
    # z[0] is the group {t1, t3, y1 -> y2}'s token now (at t2's position), z[1] is t0's.
    h1 = y[1] + z[0] - m2  # t1's token restored by delta after undoing removal 2
    expected = {
        HOST: [z[1], z[0], z[0], z[0]],  # t3 follows its host t1, which follows t2's token
        VALUE: [z[1], y[1], z[0], t[3]],
        DELTA: [z[1], h1 - m1 + t[1], y[2] + z[0] - m2, t[3] + h1 - m1],
        ZERO: [
            z[1],
            torch.zeros(2, dtype=torch.float64),
            z[0],
            torch.zeros(2, dtype=torch.float64),
        ],
    }
    for rule, rows in expected.items():
        restored = restore_tokens(v["z"], chain, rule)
        torch.testing.assert_close(restored[0], torch.stack(rows), msg=rule)
    # delta: the members of a merged group move together, each from its own value.
    delta = restore_tokens(v["z"], chain, DELTA)[0]
    torch.testing.assert_close(delta[1] - t[1], delta[3] - t[3])


def _masked(removal: Removal, n: int) -> MaskedRemoval:
    """``removal`` (over ``n`` tokens) in training's form: the same selection as masks over the
    ``n`` tokens; each removed token's host as a grid index, the output scattered back."""
    batch, c = removal.removed.shape[0], removal.removed.shape[-1]
    removed = torch.zeros(batch, n, dtype=torch.float64)
    removed.scatter_(1, removal.prune_index, 1.0)
    hosts = torch.arange(n).expand(batch, -1).clone()  # the kept: any host (unread)
    hosts.scatter_(1, removal.prune_index, removal.keep_index.gather(1, removal.host_index))
    values = removal.removed.new_zeros(batch, n, c)
    before = removal.removed.new_zeros(batch, n, c)
    k = removal.keep_index.shape[1]
    keep = removal.keep_index.unsqueeze(-1).expand(-1, -1, c)
    prune = removal.prune_index.unsqueeze(-1).expand(-1, -1, c)
    values.scatter_(1, keep, removal.output[:, :k]).scatter_(1, prune, removal.removed)
    before.scatter_(1, keep, removal.kept).scatter_(1, prune, removal.removed)
    return MaskedRemoval(removed, hosts, values, before)


@pytest.mark.parametrize("rule", RESTORE_RULES)
def test_the_masked_form_agrees_with_the_indexed_one(rule):
    """One removal: the same selection restored from the reduced tokens (inference) and from all
    tokens under a mask (training), where the removed tokens' current values are noise."""
    _, _, removal, now = _one_removal()
    grid_now = _tokens(1, 6, 2, seed=6)  # removed positions: whatever training left there
    grid_now[:, removal.keep_index[0]] = now
    masked = _masked(removal, 6)
    torch.testing.assert_close(
        restore_masked(grid_now, [masked], rule), restore_tokens(now, [removal], rule)
    )


@pytest.mark.parametrize("rule", RESTORE_RULES)
def test_the_masked_form_agrees_on_a_chain(rule):
    """Two removals, the second removing the first's host: dTPS in training removes under masks
    at each location, every token staying at its grid position."""
    v, (first, second) = _chain()
    # The second removal over grid positions: its input is the first's output (t0, t1, t2).
    second_grid = second._replace(keep_index=first.keep_index.gather(1, second.keep_index))
    second_grid = second_grid._replace(prune_index=first.keep_index.gather(1, second.prune_index))
    host_positions = second_grid.keep_index.gather(1, second.host_index)
    grid_now = _tokens(1, 4, 2, seed=7)
    grid_now[:, second_grid.keep_index[0]] = v["z"]
    masked_first = _masked(first, 4)
    # The second's masks over all four positions: the tokens gone at the first are neither kept
    # nor removed here (their values unchanged by the fuse).
    removed = torch.zeros(1, 4, dtype=torch.float64).scatter_(1, second_grid.prune_index, 1.0)
    hosts = (
        torch.arange(4).expand(1, -1).clone().scatter_(1, second_grid.prune_index, host_positions)
    )
    values = grid_now.clone()
    before = grid_now.clone()
    at = first.keep_index[0]  # positions of the first's outputs
    values[:, at] = v["y"]
    before[:, at] = v["y"]
    values[:, second_grid.keep_index[0]] = second.output
    masked_second = MaskedRemoval(removed, hosts, values, before)
    torch.testing.assert_close(
        restore_masked(grid_now, [masked_first, masked_second], rule),
        restore_tokens(v["z"], [first, second], rule),
    )


def test_two_readers_of_one_block_at_one_node_each_get_their_own_restore():
    """HF DINOv2's hidden states: the model's output reads block 5's tokens twice (its last
    hidden state after the final norm, and the hidden state itself). Each reading gets its own
    restore module; a second of the same name used to replace the first, whose call then ran
    the second's."""
    spec = MODELS["hf-dinov2-hidden"]
    compressed = compress(spec.build().eval(), "dtps", keep=[0.7], input_size=spec.input_size)
    hooks = dict(compressed.named_modules())
    restores = [name for name in hooks if name.startswith("tps_hooks.restore5_output")]
    assert restores == ["tps_hooks.restore5_output", "tps_hooks.restore5_output_1"]
    assert hooks[restores[0]] is not hooks[restores[1]]
    assert all(isinstance(hooks[name], TokenRestore) for name in restores)
