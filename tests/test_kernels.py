"""The fused kernels (``vitcompress.kernels``): select -> gather -> squeeze and ToMe's matching
and merge, each equal to the method's composition, by hand on a small case, inside compressed
models, and as one op under compile.

The first test to run builds the C++ extension (about a minute on 2 cores; cached afterwards).
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

import vitcompress
from tests.models import timm_small
from tests.op_count import compiled_targets
from tests.test_positions import sharpen
from vitcompress.kernels import (
    FusedKernelError,
    enable_fused_kernels,
    select_squeeze,
    select_squeeze_reference,
    tome_merge,
    tome_merge_reference,
)

SIZE = (3, 32, 32)


@pytest.mark.parametrize("prefix", [0, 1, 2])
@pytest.mark.parametrize("keep", [1, 7, 20])
@pytest.mark.parametrize("squeeze", [True, False])
def test_kernel_equals_the_method(prefix: int, keep: int, squeeze: bool) -> None:
    x = torch.randn(3, prefix + 20, 16)
    scores = torch.randn(3, 20)
    tokens, keep_index = select_squeeze(x, scores, prefix, keep, squeeze)
    want_tokens, want_index = select_squeeze_reference(x, scores, prefix, keep, squeeze)
    assert tokens.shape == (3, prefix + keep, 16) and tokens.dtype == x.dtype
    assert torch.equal(keep_index, want_index)
    torch.testing.assert_close(tokens, want_tokens, atol=1e-5, rtol=1e-5)
    if keep < 20 and squeeze:  # the donors changed their hosts
        pruned_only, _ = select_squeeze_reference(x, scores, prefix, keep, False)
        assert (tokens - pruned_only).abs().max() > 1e-3


def test_ties_keep_the_stable_order() -> None:
    scores = torch.tensor([[1.0, 2.0, 2.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    x = torch.randn(2, 6, 4)
    _, keep_index = select_squeeze(x, scores, 0, 4)
    assert keep_index.tolist() == [[1, 2, 4, 0], [0, 1, 2, 3]]


def test_half_precision_is_computed_in_float32_like_the_method() -> None:
    x = torch.randn(2, 1 + 30, 32).to(torch.bfloat16)
    scores = torch.randn(2, 30)
    tokens, _ = select_squeeze(x, scores, 1, 12)
    want, _ = select_squeeze_reference(x, scores, 1, 12)
    assert tokens.dtype == torch.bfloat16
    torch.testing.assert_close(tokens.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_by_hand() -> None:
    """Patches a (score 3), b (2), c (1), keep 2: c = (1, 2) has cosine 1/sqrt 5 to a = (2, 0) and
    2/sqrt 5 to b = (0, 3), so b hosts it: y_b = (e b + w c) / (e + w), w = exp(2/sqrt 5); a, which
    hosts nobody, comes out bit-identical."""
    cls, a, b, c = [0.5, -0.5], [2.0, 0.0], [0.0, 3.0], [1.0, 2.0]
    x = torch.tensor([[cls, a, b, c]])
    tokens, keep_index = select_squeeze(x, torch.tensor([[3.0, 2.0, 1.0]]), 1, 2)
    w = math.exp(2 / math.sqrt(5))
    y_b = [(math.e * b[i] + w * c[i]) / (math.e + w) for i in range(2)]
    assert keep_index.tolist() == [[0, 1]]
    torch.testing.assert_close(tokens, torch.tensor([[cls, a, y_b]]), atol=1e-6, rtol=1e-6)
    assert torch.equal(tokens[0, 1], x[0, 1])


def test_nan_and_double_scores_are_ordered_as_torch_sorts_them() -> None:
    x = torch.randn(2, 1 + 6, 8)
    nan = float("nan")
    scores = torch.tensor([[0.5, nan, 2.0, nan, -1.0, 2.0], [1.0, 1.0 + 1e-12, 1.0, 3.0, 0.0, 2.0]])
    scores = scores.double()
    scores[1, 1] = 1.0 + 1e-12  # a difference float32 would round away
    for squeeze in (True, False):
        got, got_index = select_squeeze(x, scores, 1, 4, squeeze)
        want, want_index = select_squeeze_reference(x, scores, 1, 4, squeeze)
        assert torch.equal(got_index, want_index)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got_index[0, :2].tolist() == [1, 3] and got_index[1, :2].tolist() == [3, 5]


def test_scores_that_require_grad_do_not_reach_the_op() -> None:
    """A trainable predictor's scores over a frozen backbone's tokens: the op has no backward,
    and the method passes no gradient to the scores either (they only choose indices)."""
    x = torch.randn(2, 1 + 10, 8)
    scores = torch.randn(2, 10, requires_grad=True)
    tokens, _ = select_squeeze(x, scores, 1, 6)
    want, _ = select_squeeze_reference(x, scores, 1, 6)
    assert not tokens.requires_grad and not want.requires_grad
    torch.testing.assert_close(tokens, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("protected", [0, 1, 2, 5])
@pytest.mark.parametrize("r", [1, 6, 40])  # 40: clamped to half the unprotected tokens
@pytest.mark.parametrize("with_sizes", [False, True])
def test_tome_kernel_equals_the_method(protected: int, r: int, with_sizes: bool) -> None:
    x = torch.randn(3, 23, 16)
    metric = torch.randn(3, 23, 8)
    sizes = torch.randint(1, 5, (3, 23)).float() if with_sizes else None
    tokens, new_sizes, index = tome_merge(x, metric, sizes, r, protected)
    want_tokens, want_sizes, want_index = tome_merge_reference(x, metric, sizes, r, protected)
    merged = min(r, (23 - protected) // 2)
    assert tokens.shape == (3, 23 - merged, 16) and tokens.dtype == x.dtype
    assert torch.equal(index, want_index) and torch.equal(new_sizes, want_sizes)
    torch.testing.assert_close(tokens, want_tokens, atol=1e-5, rtol=1e-5)
    assert torch.equal(index[:, :protected], torch.arange(protected).expand(3, -1))
    assert (new_sizes.sum(dim=1) == (23 if sizes is None else sizes.sum(dim=1))).all()


def test_tome_kernel_by_hand() -> None:
    """Tokens a0 b0 a1 b1 (even a, odd b), r = 1: a1's metric is b0's, a0's is orthogonal to
    both b, so a1 merges into b0 with sizes 1 and 3: (x1 + 3 x2) / 4, size 4; ToMe's order keeps
    a0, then b0 and b1."""
    x = torch.tensor([[[1.0, 0.0], [0.0, 4.0], [8.0, 0.0], [2.0, 2.0]]])
    metric = torch.tensor([[[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    sizes = torch.tensor([[1.0, 1.0, 3.0, 2.0]])
    tokens, new_sizes, index = tome_merge(x, metric, sizes, 1, 0)
    assert index.tolist() == [[0, 1, 3]] and new_sizes.tolist() == [[1.0, 4.0, 2.0]]
    want = torch.tensor([[[1.0, 0.0], [(0.0 + 24.0) / 4, 4.0 / 4], [2.0, 2.0]]])
    torch.testing.assert_close(tokens, want, atol=1e-6, rtol=1e-6)


def test_tome_kernel_ties_and_half_precision_as_the_method() -> None:
    """Equal best scores (repeated metric rows) merge the earlier token first; bf16 tokens are
    merged in float32 and returned in bf16, as the method does; r = 0 merges nothing."""
    metric = torch.randn(2, 5, 8).repeat(1, 4, 1)  # every row four times
    x = torch.randn(2, 20, 16).to(torch.bfloat16)
    tokens, new_sizes, index = tome_merge(x, metric, None, 7, 1)
    want_tokens, want_sizes, want_index = tome_merge_reference(x, metric, None, 7, 1)
    assert tokens.dtype == torch.bfloat16 and torch.equal(index, want_index)
    assert torch.equal(new_sizes, want_sizes)
    torch.testing.assert_close(tokens.float(), want_tokens.float(), atol=1e-2, rtol=1e-2)
    assert tome_merge(x, metric, None, 0, 1) is None


@pytest.mark.parametrize("prefix", [-1, 12])
def test_a_prefix_outside_the_tokens_is_refused(prefix: int) -> None:
    with pytest.raises(ValueError, match="prefix_tokens"):
        select_squeeze(torch.randn(1, 11, 4), torch.randn(1, 10), prefix, 2)


def test_off_the_cpu_is_refused_in_one_line() -> None:
    x = torch.empty(1, 5, 4, device="meta")
    with pytest.raises(FusedKernelError, match="CPU only"):
        select_squeeze(x, torch.empty(1, 4, device="meta"), 1, 2)


def _compressed(variant: str, name: str = "vit_small_patch16_224", keep: float = 0.6) -> nn.Module:
    """``variant`` at blocks 1 and 2 of a small ``name`` with sharpened weights (position tables
    ~N(0, 1), q/k x3, LayerScale 1): near one-hot attention, so that a token or a position table in
    the wrong place changes the logits (random-init attention is near uniform and would hide it)."""
    torch.manual_seed(0)
    base = sharpen(timm_small(name))
    return vitcompress.compress(base, variant, keep=keep, locs=[1, 2], input_size=SIZE).eval()


@pytest.mark.parametrize(
    ("variant", "name"),
    [
        ("dtps", "vit_small_patch16_224"),
        ("dynamicvit", "vit_small_patch16_224"),
        ("etps", "vit_small_patch16_224"),
        ("dtps", "vit_relpos_small_patch16_224"),  # position tables follow the kept index
        ("etps", "vit_small_patch16_rope_224"),
    ],
)
def test_compressed_model_gives_the_same_logits(variant: str, name: str) -> None:
    model = _compressed(variant, name)
    x = torch.randn(4, *SIZE)
    with torch.inference_mode():
        want = model(x)
        assert enable_fused_kernels(model) == 2
        got = model(x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # as in the keep-1 test below


@pytest.mark.parametrize("variant", ["dtps", "dynamicvit"])
@pytest.mark.parametrize(
    "name",
    [
        "vit_small_patch16_224",
        "deit3_small_patch16_224",  # LayerScale
        "beit_base_patch16_224",  # relative-position bias
        "vit_relpos_small_patch16_224",
        "vit_small_patch16_rope_224",  # RoPE
        "vit_small_patch16_dinov3",  # RoPE and register tokens
    ],
)
def test_exact_at_keep_1_on_the_fused_kernel(variant: str, name: str) -> None:
    """At keep 1 the predictor's reducers keep every token but re-sort them by score (the
    kernel's sort and gather): the logits must be the base's, position tables following."""
    torch.manual_seed(0)
    base = sharpen(timm_small(name))
    model = vitcompress.compress(base, variant, keep=1.0, locs=[1, 2], input_size=SIZE).eval()
    x = torch.randn(4, *SIZE)
    with torch.inference_mode():
        assert enable_fused_kernels(model) == 2
        got = model(x)
        want = base(x)
    # Relative to the logits' size, which is 1e-4 for some of these small heads: a kept-token
    # index off by one place moved them by 1e-3 to 1 of it, float rounding by under 1e-6.
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_training_and_autograd_keep_the_methods_path() -> None:
    model = _compressed("dtps")
    enable_fused_kernels(model)
    model.train()
    loss = model(torch.randn(2, *SIZE))
    loss = (loss[0] if isinstance(loss, tuple) else loss).sum()
    loss.backward()
    predictor_grads = [
        p.grad for n, p in model.named_parameters() if "predictor" in n and p.grad is not None
    ]
    assert predictor_grads and any(g.abs().sum() > 0 for g in predictor_grads)
    model.eval()  # eval with autograd on: gradients must still reach the input
    x = torch.randn(2, *SIZE, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_compiled_as_one_graph_with_the_kernel_as_one_call() -> None:
    model = _compressed("etps")
    enable_fused_kernels(model)
    targets = compiled_targets(model, torch.randn(2, *SIZE))
    assert sum("vitcompress.select_squeeze" in t for t in targets) == 2


def test_tome_compiled_as_one_graph_with_the_kernel_as_one_call() -> None:
    torch.manual_seed(0)
    base = sharpen(timm_small("vit_small_patch16_224"))
    model = vitcompress.compress(base, "tome", keep=0.7, locs=[1], input_size=SIZE).eval()
    assert enable_fused_kernels(model) == 3  # blocks 1, 2 and 3
    targets = compiled_targets(model, torch.randn(2, *SIZE))
    assert sum("vitcompress.tome_merge" in t for t in targets) == 3


def test_export_traces_the_methods_path_and_restores_the_switch(tmp_path) -> None:
    from vitcompress.workflows.export import export_model

    model = _compressed("dtps")
    enable_fused_kernels(model)
    result = export_model(model, SIZE, "onnx", tmp_path / "model.onnx", batch_size=2)
    assert result["max_abs_diff"] < 1e-4
    # Both reducers (blocks 1 and 2) have the fused op switched back on.
    assert [m.fused_kernel for m in model.modules() if hasattr(m, "fused_kernel")] == [True, True]


@pytest.mark.slow
def test_inductor_compiles_the_fused_model() -> None:
    model = _compressed("dtps")
    enable_fused_kernels(model)
    x = torch.randn(2, *SIZE)
    torch._dynamo.reset()
    with torch.inference_mode():
        compiled = torch.compile(model, fullgraph=True)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()


def _cli(*args: str):
    from click.testing import CliRunner

    from vitcompress.cli.main import cli

    return CliRunner().invoke(cli, list(args))


def test_apply_times_with_the_fused_kernels(tmp_path) -> None:
    from tests.models import FIXTURES

    result = _cli(
        "apply",
        "--model",
        f"{FIXTURES}:mha_vit",
        "--variant",
        "etps",
        "--keep",
        "0.5",
        "--locs",
        "1,2",
        "--fused-kernels",
        *("--batch-size", "2", "--warmup", "0", "--runs", "1", "--json"),
        "--out",
        str(tmp_path / "artifact"),
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert sorted(data["environment"]["fused_kernel_reducers"].values()) == [0, 2]
    # The artifact does not carry the switch: loaded again, it runs the method's path.
    loaded = vitcompress.load(str(tmp_path / "artifact"))
    assert any(hasattr(m, "fused_kernel") for m in loaded.modules())
    assert not any(getattr(m, "fused_kernel", False) for m in loaded.modules())


def test_a_batch_sweep_times_with_the_fused_kernels(tmp_path) -> None:
    from tests.models import FIXTURES

    artifact = tmp_path / "artifact"
    applied = _cli(
        "apply",
        *("--model", f"{FIXTURES}:mha_vit", "--variant", "dtps", "--keep", "0.5"),
        *("--locs", "1,2", "--no-throughput", "--out", str(artifact)),
    )
    assert applied.exit_code == 0, applied.output
    result = _cli(
        "bench",
        *("--model", str(artifact), "--batch-sizes", "1,2", "--fused-kernels"),
        *("--warmup", "0", "--runs", "1", "--json"),
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert sorted(data["environment"]["fused_kernel_reducers"].values()) == [0, 2]


def test_fused_kernels_without_timing_is_refused_in_one_line() -> None:
    from tests.models import FIXTURES

    result = _cli("bench", "--model", f"{FIXTURES}:mha_vit", "--no-throughput", "--fused-kernels")
    assert result.exit_code == 2
    assert result.stderr.strip().count("\n") == 0 and "--fused-kernels" in result.stderr


def test_an_edit_of_the_shared_header_rebuilds_both_extensions(tmp_path, monkeypatch) -> None:
    """cpp_extension rebuilds on a change of the sources it is given, not of a header they
    include: the build name carries a hash of both, so an edited header gives new names."""
    from vitcompress.kernels import ops

    header = tmp_path / "norm.h"
    header.write_bytes(ops._HEADERS[0].read_bytes())
    monkeypatch.setattr(ops, "_HEADERS", (header,))
    before = {name: ops._build_name(name) for name in ops._EXTENSIONS}
    assert before == {name: ops._build_name(name) for name in ops._EXTENSIONS}  # deterministic
    header.write_text(header.read_text() + "\n// edited\n")
    after = {name: ops._build_name(name) for name in ops._EXTENSIONS}
    assert all(before[name] != after[name] for name in ops._EXTENSIONS)
    assert all(after[name].startswith(f"{name}_") for name in ops._EXTENSIONS)


def test_a_kernel_built_before_is_said_to_load_not_to_build(tmp_path, monkeypatch) -> None:
    # Every command said "building ... (once per machine)" although the library was cached.
    from vitcompress.kernels import ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = "vitcompress_select_squeeze"
    assert ops._building_or_loading(name).startswith("building")  # an empty cache
    build_name = ops._build_name(name)
    (tmp_path / build_name).mkdir(exist_ok=True)  # the first call made it, as a build does
    (tmp_path / build_name / f"{build_name}.so").write_bytes(b"")
    assert ops._building_or_loading(name) == f"loading the fused CPU kernel {name}"


def _tokens_on(device_type: str, dtype: torch.dtype = torch.float32) -> object:
    """What ``kernel_runs`` reads of the tokens (their device, dtype and whether autograd
    records them), for a device this machine may not have."""

    class _Device:
        type = device_type

    class _Tokens:
        device = _Device()
        requires_grad = False

    tokens = _Tokens()
    tokens.dtype = dtype
    return tokens


def test_on_cuda_the_default_is_the_kernel_where_it_squeezes_or_merges(monkeypatch) -> None:
    """Timed on an H200: the Triton squeeze and merge beat the method's ops, selection alone
    does not. So the default (switch None) on CUDA is the kernel for dTPS, eTPS and ToMe and the
    method's ops for DynamicViT; a switch set either way still decides, and without Triton the
    method's ops run."""
    from vitcompress.kernels import ops
    from vitcompress.variants import fuses

    squeezing, selecting, merging = (
        fuses.Squeeze().select_op,
        fuses.Drop().select_op,
        fuses.FusedMerge(),
    )
    assert (squeezing.cuda_default, selecting.cuda_default) == (True, False)
    monkeypatch.setattr(ops, "triton_serves", lambda device: True)
    cuda = _tokens_on("cuda", torch.bfloat16)
    assert ops.kernel_runs(None, cuda, cuda_default=squeezing.cuda_default)
    assert not ops.kernel_runs(None, cuda, cuda_default=selecting.cuda_default)
    assert ops.kernel_runs(True, cuda, cuda_default=False)
    assert not ops.kernel_runs(False, cuda, cuda_default=True)
    assert not ops.kernel_runs(None, _tokens_on("cuda", torch.float64), cuda_default=True)
    assert not ops.kernel_runs(None, _tokens_on("mps"), cuda_default=True)
    # The ops themselves ask with their own answer: a CUDA call reaches the kernel only where
    # the default says so (here it would fail loudly on the fake tokens if it were reached).
    assert selecting(cuda, None, 1, 4, None) is None
    monkeypatch.setattr(ops, "triton_serves", lambda device: False)
    assert not ops.kernel_runs(None, cuda, cuda_default=True)
    assert merging(cuda, None, None, 2, 1, None) is None


def test_on_cuda_deterministic_algorithms_keep_the_methods_ops(monkeypatch) -> None:
    """The Triton squeeze and merge add with atomics in no fixed order, where the method's
    ``scatter_add`` is deterministic on CUDA under ``torch.use_deterministic_algorithms``: asked
    for, the default (switch None) on CUDA is the method's ops; a switch set on still decides,
    and the CPU's kernel (serial sums) is not affected."""
    from vitcompress.kernels import ops

    monkeypatch.setattr(ops, "triton_serves", lambda device: True)
    monkeypatch.setattr(ops, "fused_kernels_available", lambda: True)
    cuda, cpu = _tokens_on("cuda"), _tokens_on("cpu")
    assert ops.kernel_runs(None, cuda, cuda_default=True)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not ops.kernel_runs(None, cuda, cuda_default=True)
        assert ops.kernel_runs(True, cuda, cuda_default=True)
        assert ops.kernel_runs(None, cpu)
    finally:
        torch.use_deterministic_algorithms(before)
    assert ops.kernel_runs(None, cuda, cuda_default=True)


def test_where_the_triton_kernels_do_not_run_the_methods_ops_serve_with_one_warning(
    monkeypatch,
) -> None:
    """Triton installed is not Triton running (its launcher needs a C compiler; a GPU may lack
    what a kernel uses): the CUDA default tries the kernels once per device and, where they
    fail, runs the methods' own ops with one warning, not a failed forward. While a CUDA graph
    is being captured nothing is tried (nor cached)."""
    from vitcompress.kernels import ops

    monkeypatch.setattr(ops, "triton_available", lambda: True)
    monkeypatch.setattr(ops, "_triton_served", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    device = torch.device("cuda", 7)
    assert not ops.triton_serves(device) and ops._triton_served == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    # The try fails here as it would on a GPU whose Triton cannot compile (no device at all).
    with pytest.warns(UserWarning, match="do not run on cuda:7 .*their own ops there instead"):
        assert not ops.kernel_runs(None, _tokens_on_device(device), cuda_default=True)
    assert ops._triton_served == {7: False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second try, no second warning
        assert not ops.triton_serves(device)


def _tokens_on_device(device: torch.device) -> object:
    tokens = _tokens_on(device.type)
    tokens.device = device
    return tokens
