"""dTPS training follows the official TPSModule training branch in its predictor GRADIENTS.

The reference below is written from the equations of the method note (Scoring; Training; Squeezing,
"Training (dTPS)"), as plain functions of tensors: nothing from vitcompress is called to compute
it. The library runs its own reducers (and, in the model test, a whole compressed ViT) under the
same fixed Gumbel noise and the same loss, and the predictors' gradients are compared per location.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from tests.models import timm_small
from vitcompress import compress
from vitcompress.modules.reducers import PredictorReducer
from vitcompress.variants import Squeeze, fuses

RELATIVE_TOLERANCE = 1e-3


# ---------------------------------------------------------------- the reference, from the note
def reference_predictor(p: dict[str, Tensor], x: Tensor, previous: Tensor) -> Tensor:
    """LayerNorm -> Linear -> GELU; local half, mask-weighted global mean of the other half;
    Linear(C, C/2) -> GELU -> Linear(C/2, C/4) -> GELU -> Linear(C/4, 2) -> log-softmax."""
    c = x.shape[-1]
    z = F.gelu(
        F.linear(
            F.layer_norm(x, (c,), p["in_conv.0.weight"], p["in_conv.0.bias"]),
            p["in_conv.1.weight"],
            p["in_conv.1.bias"],
        )
    )
    local, rest = z[..., : c // 2], z[..., c // 2 :]
    d = previous.unsqueeze(-1)
    global_ = (rest * d).sum(dim=1, keepdim=True) / d.sum(dim=1, keepdim=True)
    h = torch.cat([local, global_.expand_as(local)], dim=-1)
    h = F.gelu(F.linear(h, p["out_conv.0.weight"], p["out_conv.0.bias"]))
    h = F.gelu(F.linear(h, p["out_conv.2.weight"], p["out_conv.2.bias"]))
    return F.linear(h, p["out_conv.4.weight"], p["out_conv.4.bias"]).log_softmax(dim=-1)


def straight_through_gumbel(log_probs: Tensor, noise: Tensor) -> Tensor:
    """Hard Gumbel-softmax at tau 1 with given noise: forward one-hot, gradient of the softmax."""
    soft = (log_probs + noise).softmax(dim=-1)
    hard = F.one_hot(soft.argmax(dim=-1), soft.shape[-1]).to(soft.dtype)
    return hard - soft.detach() + soft


def reference_squeeze(x: Tensor, keep: Tensor, pruned: Tensor) -> Tensor:
    """The official training branch as the note states it, over all N tokens."""
    n = x.shape[1]
    unit = x / (x.norm(dim=-1, keepdim=True) + 1e-6)
    c = unit @ unit.transpose(1, 2)
    c = c.masked_fill(torch.eye(n, dtype=torch.bool), -100.0)  # no token matches itself
    c = c.masked_fill(~keep.bool().unsqueeze(1), -100.0)  # boolean: no gradient through keep
    m = (c == c.amax(dim=-1, keepdim=True)).float() * pruned.unsqueeze(-1)  # M_ij (donor i)
    w = torch.exp(m * c) * m  # W_ij
    den = math.e + w.sum(dim=1)  # (B, N): per host j
    return x * (math.e / den).unsqueeze(-1) + (w.transpose(1, 2) / den.unsqueeze(-1)) @ x


def reference_location(
    p: dict[str, Tensor], x: Tensor, previous: Tensor, noise: Tensor
) -> tuple[Tensor, Tensor]:
    """One dTPS location on the patch tokens: the new patch tokens and the keep mask D_s."""
    keep = straight_through_gumbel(reference_predictor(p, x, previous), noise)[..., 0] * previous
    pruned = (1.0 - keep) * previous
    return reference_squeeze(x, keep, pruned), keep


# ---------------------------------------------------------------- fixed noise for the library
class FixedGumbel:
    """Stands in for ``F.gumbel_softmax``: the given noise, in call order."""

    def __init__(self, noises: list[Tensor]) -> None:
        self.noises = list(noises)

    def __call__(self, logits: Tensor, tau: float = 1.0, hard: bool = False, **_) -> Tensor:
        assert tau == 1.0 and hard, "dTPS samples a hard mask at tau 1"
        return straight_through_gumbel(logits, self.noises.pop(0))


def relative_difference(got: list[Tensor], expected: list[Tensor]) -> float:
    a = torch.cat([g.flatten() for g in got])
    b = torch.cat([e.flatten() for e in expected])
    return ((a - b).norm() / b.norm()).item()


def assert_close_per_location(got: list[list[Tensor]], expected: list[list[Tensor]]) -> None:
    differences = [relative_difference(g, e) for g, e in zip(got, expected, strict=True)]
    assert max(differences) < RELATIVE_TOLERANCE, "predictor gradients apart per location: " + (
        ", ".join(f"{d:.2%}" for d in differences)
    )


def gradients(module: torch.nn.Module) -> list[Tensor]:
    return [p.grad.detach().clone() for p in module.parameters()]


def noise_for(shape: tuple[int, ...], locations: int, seed: int) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    uniform = [torch.rand(*shape, 2, generator=generator) for _ in range(locations)]
    return [-(-u.clamp_min(1e-10).log()).log() for u in uniform]


# ---------------------------------------------------------------- tests
def test_masked_squeeze_gradients_match_the_official_form():
    # The squeeze alone: token features and both masks carry gradient, the loss is fixed.
    torch.manual_seed(11)
    b, n, c = 3, 24, 16
    x = torch.randn(b, n, c, dtype=torch.float64)
    previous = (torch.rand(b, n) > 0.2).double()
    logits = torch.randn(b, n, dtype=torch.float64)
    probe = torch.randn(b, n, c, dtype=torch.float64)

    def run(squeeze_fn):
        xs = x.clone().requires_grad_(True)
        ls = logits.clone().requires_grad_(True)
        soft = torch.sigmoid(ls)
        keep = ((ls > 0).double() - soft.detach() + soft) * previous
        out = squeeze_fn(xs, keep, (1.0 - keep) * previous)
        (out * probe).sum().backward()
        return out.detach(), xs.grad, ls.grad

    out, x_grad, mask_grad = run(fuses.squeeze_masked)
    ref_out, ref_x_grad, ref_mask_grad = run(reference_squeeze)
    torch.testing.assert_close(out, ref_out)
    assert relative_difference([mask_grad], [ref_mask_grad]) < RELATIVE_TOLERANCE
    assert relative_difference([x_grad], [ref_x_grad]) < RELATIVE_TOLERANCE


def test_predictor_gradients_match_the_reference_per_location(monkeypatch: pytest.MonkeyPatch):
    # Two dTPS locations, a fixed token mixer between them (a stand-in for the blocks), and a loss
    # made of a fixed projection of the tokens plus DynamicViT's ratio loss.
    torch.manual_seed(12)
    b, prefix, n, c = 4, 1, 36, 32
    keeps = (0.7, 0.49)
    x0 = torch.randn(b, prefix + n, c)
    mixer = torch.randn(c, c) / math.sqrt(c)
    probe = torch.randn(b, prefix + n, c)
    noises = noise_for((b, n), len(keeps), seed=13)
    library = [
        PredictorReducer(c, prefix, keep_tokens=int(n * k), keep_ratio=k, fuse=Squeeze()).train()
        for k in keeps
    ]
    reference = [copy.deepcopy(r.predictor) for r in library]

    def block(tokens: Tensor) -> Tensor:
        return tokens + torch.tanh(tokens @ mixer)

    def loss(tokens: Tensor, masks: list[Tensor]) -> Tensor:
        ratio = sum(((m.mean(dim=1) - k) ** 2).mean() for m, k in zip(masks, keeps, strict=True))
        return (tokens * probe).sum() + 2.0 * ratio / len(keeps)

    monkeypatch.setattr(torch.nn.functional, "gumbel_softmax", FixedGumbel(noises))
    tokens, keep_mask, masks = x0, None, []
    for reducer in library:
        tokens, keep_mask, _, _ = reducer(block(tokens), keep_mask)  # positions, trace
        masks.append(keep_mask[:, prefix:])
    loss(tokens, masks).backward()

    tokens, previous, masks = x0, torch.ones(b, n), []
    for predictor, noise in zip(reference, noises, strict=True):
        tokens = block(tokens)
        params = dict(predictor.named_parameters())
        patches, previous = reference_location(params, tokens[:, prefix:], previous, noise)
        tokens = torch.cat([tokens[:, :prefix], patches], dim=1)
        masks.append(previous)
    loss(tokens, masks).backward()

    expected = [gradients(ref) for ref in reference]
    assert all(torch.cat([g.flatten() for g in e]).norm() > 0 for e in expected)
    assert_close_per_location([gradients(lib.predictor) for lib in library], expected)
    assert all(0 < m.sum() < m.numel() for m in masks)  # both hosts and donors at each location


def test_compressed_vit_trains_with_the_official_squeeze_gradients(monkeypatch: pytest.MonkeyPatch):
    # A whole compressed ViT in training mode (masked attention in the blocks between): the
    # library's squeeze against the reference squeeze put in its place, same noise, same loss.
    torch.manual_seed(14)
    base = timm_small("vit_small_patch16_224")
    model = compress(base, variant="dtps", keep=0.7, locs=[1, 2], input_size=(3, 32, 32)).train()
    images = torch.randn(4, 3, 32, 32)
    labels = torch.tensor([0, 3, 5, 9])
    noises = noise_for((4, 64), 2, seed=15)
    predictors = [m.predictor for m in model.modules() if isinstance(m, PredictorReducer)]
    assert len(predictors) == 2

    def predictor_gradients(squeeze_fn) -> list[list[Tensor]]:
        monkeypatch.setattr(torch.nn.functional, "gumbel_softmax", FixedGumbel(noises))
        monkeypatch.setattr(fuses, "squeeze_masked", squeeze_fn)
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        return [gradients(p) for p in predictors]

    got = predictor_gradients(fuses.squeeze_masked)
    expected = predictor_gradients(
        lambda x, host_mask, donor_mask: reference_squeeze(x, host_mask, donor_mask)
    )
    assert all(torch.cat([t.flatten() for t in e]).norm() > 0 for e in expected)
    assert_close_per_location(got, expected)
