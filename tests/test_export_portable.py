"""Portable exports: the default ONNX file of every method has no scatter with a reduction (which
TensorRT's parser does not take) and matches PyTorch; the scatter-free forms of the index sums
(method/squeeze.py: one-hot, segment) equal the scatter on random, sharpened and tied inputs."""

from __future__ import annotations

import pytest
import torch

import vitcompress
from tests.models import timm_small
from vitcompress.measure.onnx_runtime import onnx_session
from vitcompress.method.merge import bipartite_soft_matching, merge_tokens
from vitcompress.method.squeeze import (
    ONE_HOT,
    PORTABLE_FORM,
    SCATTER,
    SEGMENT,
    SUM_FORMS,
    index_sum,
    index_sum_form,
    squeeze,
    squeeze_dense,
    sum_form,
)
from vitcompress.workflows.export import ATOL, export_model

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")
FUSING = ("dtps", "etps", "tome")  # the methods that sum tokens by index
FREE_FORMS = (ONE_HOT, SEGMENT)
SIZE = (3, 32, 32)


def _scatter_reductions(path) -> list[tuple[str, str]]:
    """``(op, reduction)`` of every Scatter* node in the ONNX file whose reduction is not none."""
    import onnx

    found = []
    for node in onnx.load(str(path)).graph.node:
        if not node.op_type.startswith("Scatter"):
            continue
        attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        reduction = attributes.get("reduction", b"none")
        reduction = reduction.decode() if isinstance(reduction, bytes) else str(reduction)
        if reduction != "none":
            found.append((node.op_type, reduction))
    return found


def _compressed(method: str, family: str = "vit_small_patch16_224") -> torch.nn.Module:
    torch.manual_seed(0)
    return vitcompress.compress(timm_small(family), method, 0.7, None, SIZE).eval()


@pytest.mark.parametrize(
    ("method", "family"),
    [(m, "vit_small_patch16_224") for m in METHODS]
    + [("tome", "deit_tiny_distilled_patch16_224"), ("dtps", "deit_tiny_distilled_patch16_224")],
)
def test_default_onnx_has_no_scatter_reduction_and_matches_pytorch(method, family, tmp_path):
    model = _compressed(method, family)
    path = tmp_path / "model.onnx"
    info = export_model(model, SIZE, "onnx", path, batch_size=2)
    assert _scatter_reductions(path) == []
    x = torch.randn(3, *SIZE)  # another batch than the file was written at: a fresh session
    dynamic = tmp_path / "dynamic.onnx"
    export_model(model, SIZE, "onnx", dynamic, dynamic_batch=True)
    assert _scatter_reductions(dynamic) == []
    got = onnx_session(dynamic).run(None, {"image": x.numpy()})[0]
    with torch.no_grad():
        expected = model(x)
    assert info["max_abs_diff"] <= ATOL
    torch.testing.assert_close(torch.from_numpy(got), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_dense_outputs_export_without_scatter_reduction(method, tmp_path):
    """A model that returns every token (restored after the reductions, method/restore.py)."""
    torch.manual_seed(0)
    base = timm_small("vit_small_patch16_224", global_pool="", num_classes=0)
    model = vitcompress.compress(base, method, 0.7, None, SIZE).eval()
    path = tmp_path / "dense.onnx"
    info = export_model(model, SIZE, "onnx", path, batch_size=2)
    assert _scatter_reductions(path) == []
    assert info["max_abs_diff"] <= ATOL


@pytest.mark.parametrize("method", FUSING)
def test_the_scatter_form_would_export_scatter_adds(method, tmp_path):
    """The control: the same model with the scatter form written has them, so the default file
    is free of them because of the form it takes, not because nothing is summed."""
    path = tmp_path / "model.onnx"
    with index_sum_form(SCATTER):
        export_model(_compressed(method), SIZE, "onnx", path, batch_size=2)
    assert ("ScatterElements", "add") in _scatter_reductions(path)


@pytest.mark.parametrize("method", FUSING)
@pytest.mark.parametrize("form", FREE_FORMS)
def test_every_scatter_free_form_exports_and_matches(method, form, tmp_path):
    path = tmp_path / "model.onnx"
    with index_sum_form(form):
        info = export_model(_compressed(method), SIZE, "onnx", path, batch_size=2)
    assert _scatter_reductions(path) == []
    assert info["max_abs_diff"] <= ATOL


@pytest.mark.parametrize("method", FUSING)
@pytest.mark.parametrize("form", FREE_FORMS)
def test_compressed_model_is_the_same_in_every_form(method, form):
    model = _compressed(method)
    x = torch.randn(4, *SIZE)
    with torch.no_grad():
        scattered = model(x)
        with index_sum_form(form):
            free = model(x)
    torch.testing.assert_close(free, scattered, atol=1e-5, rtol=1e-5)


def test_the_form_is_the_scatter_in_pytorch_and_portable_in_an_onnx_export(tmp_path):
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(sum_form())
            return x + 1

    assert sum_form() == SCATTER
    torch.onnx.export(Probe(), (torch.zeros(1),), str(tmp_path / "p.onnx"), dynamo=False)
    assert seen[-1] == PORTABLE_FORM != SCATTER
    with index_sum_form(SEGMENT):
        assert sum_form() == SEGMENT
        with index_sum_form(ONE_HOT):
            assert sum_form() == ONE_HOT
        assert sum_form() == SEGMENT
    assert sum_form() == SCATTER
    with pytest.raises(ValueError, match="form must be one of"):
        with index_sum_form("dense"):
            pass
    assert sum_form() == SCATTER


def _sharpened(batch: int, hosts: int, donors: int, dim: int, scale: float = 30.0):
    """Hosts of large, varied norms and donors that are near copies of a few of them (many
    donors on one host, cosine close to 1, similarities far from uniform), two hosts identical
    (a tie every donor of theirs breaks to the first)."""
    generator = torch.Generator().manual_seed(3)
    h = torch.randn(batch, hosts, dim, generator=generator) * scale
    h[:, 1] = h[:, 0]
    pick = torch.randint(0, 4, (batch, donors), generator=generator)
    d = h.gather(1, pick.unsqueeze(-1).expand(-1, -1, dim))
    d = d * (1 + torch.rand(batch, donors, 1, generator=generator))
    return h, d + 0.01 * scale * torch.randn(batch, donors, dim, generator=generator)


@pytest.mark.parametrize("form", SUM_FORMS)
def test_index_sum_is_scatter_add_with_duplicates_and_empty_bins(form):
    generator = torch.Generator().manual_seed(4)
    values = torch.randn(3, 40, 5, generator=generator) * 100
    index = torch.randint(0, 6, (3, 40), generator=generator)  # 6 bins for 40 rows: duplicates
    index[0] = 2  # every row in one bin
    index[1, :] = torch.where(index[1] == 5, 4, index[1])  # the last bin empty
    expected = torch.zeros(3, 9, 5).scatter_add(1, index.unsqueeze(-1).expand(-1, -1, 5), values)
    got = index_sum(values, index, 9, form)
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-5)
    empty = torch.ones(3, 9, dtype=torch.bool).scatter(1, index, False)
    assert torch.equal(got[empty], torch.zeros_like(got[empty]))  # exactly zero, not nearly


@pytest.mark.parametrize("form", FREE_FORMS)
@pytest.mark.parametrize("inputs", ["random", "sharpened"])
def test_squeeze_forms_equal_the_scatter_and_the_paper(form, inputs):
    if inputs == "random":
        generator = torch.Generator().manual_seed(5)
        hosts, donors = (torch.randn(4, n, 24, generator=generator) for n in (30, 20))
    else:
        hosts, donors = _sharpened(4, 30, 20, 24)
    prefix = torch.randn(4, 2, 24)
    scattered, host_index = squeeze(hosts, donors, prefix, return_hosts=True, form=SCATTER)
    free, free_index = squeeze(hosts, donors, prefix, return_hosts=True, form=form)
    assert torch.equal(free_index, host_index)
    if inputs == "sharpened":  # the tie: nobody goes to host 1, the copy of host 0
        assert (host_index == 0).any() and not (host_index == 1).any()
    scale = hosts.abs().max()
    torch.testing.assert_close(free, scattered, atol=1e-6 * scale, rtol=1e-5)
    torch.testing.assert_close(free[:, 2:], squeeze_dense(hosts, donors), atol=1e-5 * scale, rtol=0)
    assert torch.equal(free[:, :2], prefix)
    unhosted = torch.ones(4, 30, dtype=torch.bool).scatter(1, host_index, False)
    assert torch.equal(free[:, 2:][unhosted], hosts[unhosted])  # hosts without donors: bitwise


@pytest.mark.parametrize("form", FREE_FORMS)
@pytest.mark.parametrize("protected", [0, 1, 2, 3])
@pytest.mark.parametrize("inputs", ["random", "sharpened"])
def test_merge_forms_equal_the_scatter(form, protected, inputs):
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(3, 25, 16, generator=generator) * 10
    if inputs == "sharpened":  # every a token a near copy of one of two b tokens: shared dsts
        x[:, 0::2] = x[:, 5:6] + 0.01 * x[:, 0::2]
        x[:, 2::4] = x[:, 7:8] * 3
    sizes = torch.randint(1, 5, (3, 25), generator=generator).float()
    matching = bipartite_soft_matching(x, 8, protected)
    if inputs == "sharpened":
        assert matching.dst.unique().numel() < matching.dst.numel()  # destinations shared
    scattered = merge_tokens(x, sizes, matching, form=SCATTER)
    free = merge_tokens(x, sizes, matching, form=form)
    torch.testing.assert_close(free[0], scattered[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(free[1], scattered[1], atol=0, rtol=1e-6)
    assert torch.equal(free[2], scattered[2])
    torch.testing.assert_close(free[0][:, :protected], x[:, :protected])  # protected: as they came


def test_protected_tokens_are_neither_merged_nor_merged_into():
    x = torch.randn(2, 12, 8)
    x[:, 1] = x[:, 0]  # the protected tokens are the best matches of each other and of others
    x[:, 2::2] = x[:, 1:2]
    matching = bipartite_soft_matching(x, 5, protected=2)
    assert (matching.src >= 1).all()  # a token 0 (sequence 0) is never merged
    assert (matching.dst >= 1).all()  # b token 0 (sequence 1) is never merged into
