"""MAC counting in the convention of the token-pruning literature.

DeiT, DynamicViT, EViT, ToMe and TPS report "GFLOPs" as measured by fvcore: one multiply-accumulate
counts 1, batch size 1, the two attention products (``q @ k^T`` and ``attn @ v``) are included, and
element-wise work (softmax, GELU, residual adds, biases) is not. We build on
``torch.utils.flop_counter.FlopCounterMode`` because it sees every aten op that actually runs, so
models with data-dependent forwards (top-k token selection, gather, index scatter) are counted on
the tokens they really keep. The counter reports 2 FLOPs per MAC; every public number here is
halved back to MACs.

Four gaps of the stock counter are closed here:

* Fused fast paths. In eval mode ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` run as
  one fused kernel (``_native_multi_head_attention``, ``_transformer_encoder_layer_fwd``) that has
  no formula, so a model built on them would count its projections, attention and MLP as 0. The
  counter runs with those fast paths off (``fast_paths_off``), so they decompose into ops it
  counts; a TorchScript module ignores that switch, so both kernels also get formulas here, equal
  to what their decomposition counts.

* Attention through ``F.scaled_dot_product_attention``. On CPU it dispatches to
  ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no formula, so attention would
  silently count 0. We register formulas for every SDPA kernel of this torch build that lacks one
  (see ``SDPA_OPS_REGISTERED``). The math fallback decomposes into ``bmm`` and is counted anyway,
  so an SDPA model and its explicit matmul+softmax twin give the same count.
* Normalisation layers. fvcore counts LayerNorm/GroupNorm as 5 ops per element with an affine
  transform (4 without) and inference BatchNorm as 2 (1 without affine). We add the same light
  count so numbers line up with the published tables to the last digit instead of being ~0.4%
  low. These formulas are passed to each counter via ``custom_mapping`` rather than registered
  globally, so other users of ``FlopCounterMode`` in the process keep torch's convention.
* Products with a vector operand. ``tokens @ w`` with a learned vector ``w`` (an attention-pool's
  scoring) runs ``aten.mv``, which torch has no formula for, so it counted 0 where the same
  product written as an einsum (``bmm``) counted ``N x C``. ``mv``, ``addmv``, ``dot``, ``vdot``
  and ``addbmm`` get their products here, passed the same way.

Not counted: element-wise work (softmax, GELU, residual adds, biases, a product written as
``(x * w).sum(-1)``) and RMSNorm (it runs as element-wise ops), as in fvcore; pooling and
interpolation, which fvcore counts (1 per input element of an adaptive average pool, 4 per output
element of a bilinear resize: under 0.1% of a PVT's count).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from vitcompress.analysis.capture import fast_paths_off

__all__ = ["SDPA_OPS_REGISTERED", "count_macs", "macs_by_module"]

_aten = torch.ops.aten


def _prod(shape: Iterable[int]) -> int:
    return math.prod(int(s) for s in shape)


# --------------------------------------------------------------------------------------------------
# Scaled dot-product attention
# --------------------------------------------------------------------------------------------------


def _attention_flops(q_shape: Any, k_shape: Any, v_shape: Any) -> int:
    """FLOPs (2 per MAC) of ``softmax(q @ k^T) @ v``.

    Written over "query rows" instead of (batch, heads) so it holds for any number of leading dims
    and for grouped-query attention, where key/value have fewer heads and are broadcast: every
    query row is dotted with ``s_k`` keys of width ``d_q`` and mixes ``s_k`` values of width ``d_v``.
    This equals torch's own ``sdpa_flop_count`` for the 4-D case.
    """
    rows = _prod(q_shape[:-1])
    s_k = int(k_shape[-2])
    return 2 * rows * s_k * (int(q_shape[-1]) + int(v_shape[-1]))


def _attention_backward_flops(q_shape: Any, k_shape: Any, v_shape: Any) -> int:
    """FLOPs of the attention backward, as torch's ``sdpa_backward_flop_count`` counts it.

    Five products: recomputed scores (d_q), grad-scores (d_v), grad-V (d_v), grad-Q (d_q) and
    grad-K (d_q), each over ``rows x s_k``.
    """
    rows = _prod(q_shape[:-1])
    s_k = int(k_shape[-2])
    return 2 * rows * s_k * (3 * int(q_shape[-1]) + 2 * int(v_shape[-1]))


# torch's flop formulas are called with the op's arguments as shapes, then ``out_shape`` and
# any other keyword; only the attention's query, key and value shapes matter here.
def _sdpa_forward_flop(
    query_shape: Any, key_shape: Any, value_shape: Any, *_: Any, **__: Any
) -> int:
    return _attention_flops(query_shape, key_shape, value_shape)


def _sdpa_backward_flop(
    grad_out_shape: Any, query_shape: Any, key_shape: Any, value_shape: Any, *_: Any, **__: Any
) -> int:
    return _attention_backward_flops(query_shape, key_shape, value_shape)


def _flash_inplace_forward_flop(
    out: Any,
    query: Any,
    key: Any,
    value: Any,
    cum_seq_q: Any,
    cum_seq_k: Any,
    max_q: Any,
    max_k: Any,
    *args: Any,
    **kwargs: Any,
) -> int:
    # Same kernel as ``_flash_attention_forward`` writing into a given ``out``; reuse torch's formula,
    # which also understands the variable-length (cum_seq) layout.
    return flop_counter._flash_attention_forward_flop(  # type: ignore[attr-defined]
        query, key, value, cum_seq_q, cum_seq_k, max_q, max_k
    )


def _sdpa_formulas() -> list[tuple[str, Callable[..., int], bool]]:
    """(aten op name, formula, get_raw) for SDPA kernels torch 2.x may lack formulas for."""
    formulas: list[tuple[str, Callable[..., int], bool]] = [
        # CPU fused kernel, what F.scaled_dot_product_attention runs on CPU for 4-D inputs.
        ("_scaled_dot_product_flash_attention_for_cpu", _sdpa_forward_flop, False),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _sdpa_backward_flop, False),
        # Out-of-tree backends (XPU, HPU, PrivateUse1) route SDPA through this op.
        ("_scaled_dot_product_fused_attention_overrideable", _sdpa_forward_flop, False),
        ("_scaled_dot_product_fused_attention_overrideable_backward", _sdpa_backward_flop, False),
        # Apple MPS has a native "math" kernel that does not decompose into bmm.
        ("_scaled_dot_product_attention_math_for_mps", _sdpa_forward_flop, False),
    ]
    if hasattr(flop_counter, "_flash_attention_forward_flop"):
        # Variable-length flash attention (torch.nn.attention.varlen) on CUDA.
        formulas.append(
            ("_flash_attention_forward_no_dropout_inplace", _flash_inplace_forward_flop, True)
        )
    return formulas


def _register_missing_sdpa_formulas() -> tuple[str, ...]:
    """Register formulas for SDPA ops of this torch build that have none.

    Guarded twice: an op this torch does not have is skipped, and an op that already has a formula
    (torch's own, or ours from an earlier import of this module - ``register_flop_formula`` raises
    on duplicates) is left alone.
    """
    registered = []
    for name, formula, get_raw in _sdpa_formulas():
        packet = getattr(_aten, name, None)
        if packet is None or packet in flop_counter.flop_registry:
            continue
        register_flop_formula(packet, get_raw=get_raw)(formula)
        registered.append(name)
    return tuple(registered)


# Names of the aten ops this import registered (empty on a re-import or if torch covers them all).
SDPA_OPS_REGISTERED: tuple[str, ...] = _register_missing_sdpa_formulas()


# --------------------------------------------------------------------------------------------------
# Normalisation layers, fvcore's convention (values are 2x fvcore's count: everything gets halved)
# --------------------------------------------------------------------------------------------------


def _layer_norm_flop(
    input_shape: Any,
    normalized_shape: Any,
    weight: Any = None,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return 2 * _prod(input_shape) * (5 if weight is not None else 4)


def _group_norm_flop(
    input_shape: Any, weight: Any = None, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    return 2 * _prod(input_shape) * (5 if weight is not None else 4)


def _batch_norm_flop(
    input_shape: Any, weight: Any = None, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    # The batch-norm kernels disagree on where ``training`` sits (and the ``no_training`` variant has
    # none), but it is always the first bool after (input, weight, bias).
    training = next((a for a in args[1:] if isinstance(a, bool)), False)
    if training:
        return 2 * _prod(input_shape) * (5 if weight is not None else 4)
    # At inference the normalisation folds into one scale (+ shift with affine).
    return 2 * _prod(input_shape) * (2 if weight is not None else 1)


def _existing_ops(table: dict[str, Callable[..., int]]) -> dict[Any, Callable[..., int]]:
    """``table``'s formulas keyed by their aten ops, leaving out the ops this torch build lacks."""
    return {
        getattr(_aten, name): formula
        for name, formula in table.items()
        if getattr(_aten, name, None) is not None
    }


def _norm_formulas() -> dict[Any, Callable[..., int]]:
    # Only leaf kernels: FlopCounterMode decomposes composite ops first and counts what they become,
    # so listing e.g. both ``native_batch_norm`` and its decomposition cannot double count.
    return _existing_ops(
        {
            "native_layer_norm": _layer_norm_flop,
            "native_group_norm": _group_norm_flop,
            "native_batch_norm": _batch_norm_flop,
            "_native_batch_norm_legit": _batch_norm_flop,
            "_native_batch_norm_legit_no_training": _batch_norm_flop,
            "cudnn_batch_norm": _batch_norm_flop,
            "miopen_batch_norm": _batch_norm_flop,
        }
    )


_NORM_FORMULAS = _norm_formulas()


# --------------------------------------------------------------------------------------------------
# Products with a vector operand, which torch's registry leaves out
# --------------------------------------------------------------------------------------------------


def _mv_flop(matrix_shape: Any, vector_shape: Any, *args: Any, **kwargs: Any) -> int:
    # ``tokens @ w`` with a learned vector ``w`` (C,): matmul folds (B, N, C) to (B*N, C) and
    # runs ``mv``; the same product written as an einsum runs ``bmm`` and counts B*N*C.
    return 2 * _prod(matrix_shape)


def _addmv_flop(
    self_shape: Any, matrix_shape: Any, vector_shape: Any, *args: Any, **kwargs: Any
) -> int:
    return 2 * _prod(matrix_shape)


def _dot_flop(a_shape: Any, b_shape: Any, *args: Any, **kwargs: Any) -> int:
    return 2 * _prod(a_shape)


def _addbmm_flop(
    self_shape: Any, batch1_shape: Any, batch2_shape: Any, *args: Any, **kwargs: Any
) -> int:
    return 2 * _prod(batch1_shape) * int(batch2_shape[-1])


def _vector_product_formulas() -> dict[Any, Callable[..., int]]:
    return _existing_ops(
        {
            "mv": _mv_flop,
            "addmv": _addmv_flop,
            "dot": _dot_flop,
            "vdot": _dot_flop,
            "addbmm": _addbmm_flop,
        }
    )


# --------------------------------------------------------------------------------------------------
# Fused encoder kernels (what the decomposed path counts, for modules that cannot be switched off)
# --------------------------------------------------------------------------------------------------


def _self_attention_macs(query_shape: Any, key_shape: Any, embed_dim: int) -> int:
    """Projections and products of ``nn.MultiheadAttention`` with one width ``embed_dim``:
    q and out over the queries, k and v over the keys, and the two attention products."""
    queries = _prod(query_shape[:-1])
    keys = _prod(key_shape[:-1])
    keys_per_query = int(key_shape[-2])
    return (
        2 * queries * embed_dim * embed_dim
        + 2 * keys * embed_dim * embed_dim
        + 2 * queries * keys_per_query * embed_dim
    )


def _native_mha_flop(
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    embed_dim: int,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return 2 * _self_attention_macs(query_shape, key_shape, int(embed_dim))


def _encoder_layer_flop(
    src_shape: Any,
    embed_dim: int,
    num_heads: int,
    qkv_weight_shape: Any,
    qkv_bias_shape: Any,
    proj_weight_shape: Any,
    proj_bias_shape: Any,
    use_gelu: bool,
    norm_first: bool,
    eps: float,
    norm_weight_1_shape: Any,
    norm_bias_1_shape: Any,
    norm_weight_2_shape: Any,
    norm_bias_2_shape: Any,
    ffn_weight_1_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    tokens = _prod(src_shape[:-1])
    width = int(embed_dim)
    hidden = int(ffn_weight_1_shape[0])
    attention = _self_attention_macs(src_shape, src_shape, width)
    mlp = 2 * tokens * width * hidden
    flops = 2 * (attention + mlp)
    # Its two layer norms, in the convention of the decomposed ``native_layer_norm``.
    for weight in (norm_weight_1_shape, norm_weight_2_shape):
        flops += _layer_norm_flop(src_shape, (width,), weight)
    return flops


def _fused_formulas() -> dict[Any, Callable[..., int]]:
    return _existing_ops(
        {
            "_native_multi_head_attention": _native_mha_flop,
            "_transformer_encoder_layer_fwd": _encoder_layer_flop,
        }
    )


_COUNTER_FORMULAS = {**_NORM_FORMULAS, **_vector_product_formulas(), **_fused_formulas()}


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def _same_device(a: torch.device, b: torch.device) -> bool:
    # "cuda" and "cuda:0" name the same device when no index is given.
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def run_counter(
    model: nn.Module, input_size: tuple[int, ...], device: str | torch.device
) -> FlopCounterMode:
    """Run ``model`` once on a batch of one under torch's flop counter and return the counter
    (its totals and per-module counts)."""
    if len(input_size) < 3:
        raise ValueError(
            "input_size must be (channels, height, width) or of higher rank (a video's "
            f"(channels, frames, height, width)), got {tuple(input_size)}"
        )
    device = torch.device(device)
    first = next(iter(model.parameters()), None)
    if first is not None and not _same_device(first.device, device):
        raise ValueError(
            f"model lives on {first.device} but MACs were requested on {device}; move the model first"
        )
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
    # Random rather than zero input: data-dependent forwards (top-k on attention scores) should see
    # realistic, tie-free values; a fixed seed keeps the count reproducible.
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((1, *input_size), generator=generator, dtype=dtype).to(device)

    # Remember every module's flag, not just the root's: models may deliberately keep some
    # submodules in a different mode, and ``train(flag)`` alone would overwrite them.
    flags = [(m, m.training) for m in model.modules()]
    # The counter's module tracker hooks the backward of every module input that requires grad;
    # a parameter fed to a module as it is (CaiT's class token) has no grad_fn and makes it fail,
    # even under no_grad. Counting needs no gradients, so none are asked for while it runs.
    grads = [(p, p.requires_grad) for p in model.parameters()]
    counter = FlopCounterMode(display=False, custom_mapping=_COUNTER_FORMULAS)
    try:
        model.eval()
        for param, _ in grads:
            param.requires_grad_(False)
        with torch.no_grad(), fast_paths_off(), counter:
            model(x)
    finally:
        model.train(flags[0][1])
        for module, training in flags:
            module.training = training
        for param, requires_grad in grads:
            param.requires_grad_(requires_grad)
    return counter


def count_call_macs(call: Callable[[], object]) -> int:
    """Multiply-accumulates of ``call()``, counted as :func:`count_macs` counts them (fused fast
    paths off, the same formulas); the caller sets up the model and its input."""
    return sum(count_call_ops(call)[1].values())


def count_call_ops(call: Callable[[], Any]) -> tuple[Any, dict[Any, int]]:
    """``call()``'s result and its multiply-accumulates by aten op, counted as
    :func:`count_macs` counts them."""
    counter = FlopCounterMode(display=False, custom_mapping=_COUNTER_FORMULAS)
    with torch.no_grad(), fast_paths_off(), counter:
        result = call()
    totals = counter.get_flop_counts().get("Global", {})
    return result, {op: flops // 2 for op, flops in totals.items()}


def count_macs(
    model: nn.Module, input_size: tuple[int, ...], device: str | torch.device = "cpu"
) -> int:
    """Multiply-accumulates of one forward pass at batch size 1, in eval mode.

    ``input_size`` is the input without the batch dim: ``(channels, height, width)``, or of
    higher rank (a video model's ``(channels, frames, height, width)``). The model must already be on ``device``. Its
    training flags are restored afterwards. Divide by 1e9 for the "GFLOPs" of the papers.
    """
    return run_counter(model, input_size, device).get_total_flops() // 2


def macs_by_module(
    model: nn.Module, input_size: tuple[int, ...], device: str | torch.device = "cpu"
) -> dict[str, int]:
    """MACs per module, as in ``count_macs``, keyed by ``named_modules()`` path.

    Totals are inclusive (a block includes its attention and MLP); ``""`` is the whole model.
    Modules that did no counted work are absent. Ordered like ``model.named_modules()``.
    """
    counts = run_counter(model, input_size, device).get_flop_counts()
    root = type(model).__name__
    per_module: dict[str, int] = {}
    for name, per_op in counts.items():
        if name == "Global":  # duplicate of the root: only the model's forward ran
            continue
        # FlopCounterMode names the root after its class and prefixes children with it.
        if name == root:
            key = ""
        elif name.startswith(root + "."):
            key = name[len(root) + 1 :]
        else:
            key = name
        per_module[key] = per_module.get(key, 0) + sum(per_op.values()) // 2
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return dict(sorted(per_module.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))
