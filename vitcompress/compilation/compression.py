"""Compression itself: capture and map a model, make its plan, rewrite it, attach metadata.

``vitcompress.api`` is the public face of this module (with ``save``, ``load`` and
``load_model``); ``vitcompress.artifacts.artifact`` rebuilds saved models with it.
"""

from __future__ import annotations

import copy
import logging
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vitcompress.analysis.analyse import analyse
from vitcompress.analysis.capture import (
    CapturedGraph,
    CaptureError,
    capture,
    check_rewritable,
)
from vitcompress.analysis.model_map import ModelMap
from vitcompress.compilation.entries import (
    ENTRY_ATTRIBUTE,
    FORWARD,
    EntryError,
    entry_of,
    entry_view,
    with_base_methods,
)
from vitcompress.compilation.graph_edits import devices_follow_input
from vitcompress.compilation.keep_lists import plan_from_cumulative
from vitcompress.compilation.metadata import attach, compression_info
from vitcompress.compilation.naming import (
    HOOK_PREFIX,
    REDUCER_PREFIX,
    RewrittenModelError,
)
from vitcompress.compilation.placement import default_keep
from vitcompress.compilation.plan import Plan, PlanError, make_plan, resolve_variant
from vitcompress.compilation.rewrite import rewrite
from vitcompress.compilation.weight_decay import (
    NO_WEIGHT_DECAY_ATTRIBUTE,
    no_weight_decay_parameters,
    parameter_names,
)
from vitcompress.data.config import stated_data_config
from vitcompress.errors import UserError
from vitcompress.loading import (
    LoadedModel,
    ModelInputError,
    ModelLoadError,
    default_input_size,
    one_line,
)
from vitcompress.method import CumulativeKeep
from vitcompress.model_args import readable_timm_args
from vitcompress.model_copy import copy_model
from vitcompress.variants import Variant

log = logging.getLogger(__name__)

EXAMPLE_BATCH = 2  # batch 1 would hide which dimension is the batch


def example_input(input_size: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
    """The capture's example batch: seeded noise of ``input_size``, in ``dtype`` (default: torch's
    default dtype)."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(EXAMPLE_BATCH, *input_size, generator=generator, dtype=dtype)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype of ``model``'s first floating parameter or buffer: the input it takes
    (a float64 model is traced on a float64 example, not refused for the default float32)."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.get_default_dtype()


def resolve_input_size(model: nn.Module, input_size: tuple[int, ...] | None) -> tuple[int, ...]:
    if input_size is not None:
        return tuple(input_size)
    size = default_input_size(model)
    if size is None:
        raise ValueError("the model does not say its input size; pass input_size=(C, H, W)")
    return size


def capture_and_map(
    model: nn.Module, input_size: tuple[int, ...]
) -> tuple[CapturedGraph, ModelMap]:
    """Capture ``model`` on an example of ``input_size`` and analyse it.

    A model that does not run on that input at all (a wrong input size, a model that is no
    image model) is the caller's mistake, not a capture failure: that is told apart by running
    the model itself, only after the capture failed, and raised as ``ModelInputError``.
    """
    _refuse_bare_transformers(model)
    example = example_input(input_size, model_dtype(model))
    try:
        captured = capture(model, example)
    except CaptureError:
        raise
    except Exception as capture_error:
        problem = _run_problem(model, example)
        if problem is None:
            raise  # the model runs: the failure is ours, not the input's
        raise ModelInputError(
            f"the model does not run on input {','.join(map(str, input_size))}: {problem}; pass "
            "the input size it was built for (--input-size C,H,W)"
        ) from capture_error
    return captured, analyse(captured)


def _refuse_bare_transformers(model: nn.Module) -> None:
    """A transformers model as it is (``ViTForImageClassification(config)``) takes keyword
    inputs and returns an output object, which the capture cannot follow: one line that says
    how to hand it over, rather than the tracer's error. (A method of it that takes the image,
    compressed as the entry through ``entry_view``, passes.)"""
    bare = type(model).__module__.startswith("transformers.") and hasattr(model, "config")
    if bare and entry_of(model) == FORWARD:
        raise ModelLoadError(
            f"{type(model).__name__} is a transformers model as it is (keyword inputs, an output "
            "object): wrap it, vitcompress.loading.hf.HFImageClassifier(model) (images in, "
            "logits out), or give its save_pretrained directory as the model"
        )


def _run_problem(model: nn.Module, example: torch.Tensor) -> str | None:
    probe = copy_model(model).eval()  # the caller's model keeps its mode and state
    try:
        with torch.no_grad():
            probe(example)
    except Exception as e:  # noqa: BLE001 - any failure means the input does not fit
        return one_line(e)
    return None


def _rewritten_problem(compressed: nn.Module, example: torch.Tensor) -> str | None:
    """Why the rewritten graph fails on one image of the example (an attention that lays out
    its windows with a fixed token count, reduced by a predictor), or ``None``: a raw error at
    the user's first call becomes a one-line refusal here."""
    compressed.eval()
    try:
        # ``forward`` itself: fx's call wrapper prints the generated code around a failure to
        # stderr, and the one line is ours (the traceback goes to the debug log).
        with torch.no_grad():
            compressed.forward(example[:1])
    except Exception as e:  # noqa: BLE001 - any failure refuses the model
        log.debug("the rewritten model failed on one example image", exc_info=True)
        return one_line(e)
    return None


def map_model(model: nn.Module, input_size: tuple[int, ...] | None = None) -> ModelMap:
    """Capture ``model`` and return its model map (blocks, attention, prefix tokens, grid ops)."""
    return capture_and_map(model, resolve_input_size(model, input_size))[1]


Keep = float | list[float] | CumulativeKeep | None


def compress(
    model: nn.Module,
    variant: str | Variant = "etps",
    keep: Keep = None,
    locs: list[int] | None = None,
    input_size: tuple[int, ...] | None = None,
    policy: str = "score",
    keep_cumulative: Sequence[float] | None = None,
    variant_args: dict[str, Any] | None = None,
    entry: str | None = None,
) -> nn.Module:
    """Return a compressed copy of ``model`` (left unchanged): an ordinary ``nn.Module`` whose
    ``.eval()`` drops tokens physically and whose ``.train()`` runs its variant's training path.

    ``keep`` is a ratio per location (``0.7`` or ``[0.7, 0.7, 0.7]``); ``keep_cumulative``, the
    official configs' form, gives instead the fraction of the stage's initial patch count kept
    after each location (``[0.7, 0.49, 0.343]``: 137, 96 and 67 of DeiT-S's 196), dtps and
    dynamicvit only. ``variant`` names a registered variant
    (:func:`vitcompress.variants.variant_names`) or is a variant object; ``variant_args`` are the
    method's own settings (:func:`vitcompress.variants.variant_settings`), e.g. ToMe's
    ``{"r": 8}``, the tokens merged in every block, which replaces ``keep``.

    ``entry`` names the base's method to compress as the forward (``"forward_features"``: the
    result's forward returns the base's features, every token back in the base's order; default:
    ``forward``, or the method of a :func:`vitcompress.compilation.entries.entry_view`). The
    result also answers the base's ``forward_features``, ``forward_head``,
    ``forward_intermediates``, ``get_intermediate_layers`` and ``get_image_features`` where the
    base has them (:mod:`vitcompress.compilation.entries`).

    The result carries its plan and model map (read them with
    :func:`vitcompress.compilation.metadata.compression_info`).
    """
    if compression_info(model) is not None:
        raise ModelLoadError("the model is already compressed; compress its base model instead")
    if keep_cumulative is not None:
        if keep is not None:
            raise PlanError("keep and keep_cumulative exclude each other; give one")
        keep = CumulativeKeep(tuple(keep_cumulative))
    method = resolve_variant(variant, variant_args)
    size = resolve_input_size(model, input_size)
    view = entry_view(model, _entry(model, entry))
    captured, model_map = capture_and_map(view, size)
    return compress_mapped(view, captured, model_map, size, method, keep, locs, policy)


def _entry(model: nn.Module, entry: str | None) -> str:
    """The method to compress: ``entry``, or the one ``model`` (a view) stands for."""
    viewed = entry_of(model)
    if entry is None or entry == viewed:
        return viewed
    if viewed != FORWARD:
        raise EntryError(
            f"entry '{entry}': the model is already a view of its base's {viewed}; pass the "
            "base model itself"
        )
    return entry


def compress_mapped(
    model: nn.Module,
    captured: CapturedGraph,
    model_map: ModelMap,
    size: tuple[int, ...],
    method: Variant,
    keep: Keep,
    locs: list[int] | None,
    policy: str,
    base_methods: bool = True,
) -> nn.Module:
    """``compress`` from a capture of ``model`` made by :func:`capture_and_map` (consumed):
    ``model`` is the base, or its :func:`entry_view` for a method. With ``base_methods``, the
    result answers the base's methods (``forward_features``, ...)."""
    check_rewritable(captured)
    setting = method.keep_setting
    if setting is not None and keep is not None:
        raise PlanError(f"keep and {method.name}'s {setting} exclude each other; give one")
    if isinstance(keep, CumulativeKeep):
        plan = plan_from_cumulative(model_map, method, keep, locs, policy)
    else:
        plan = make_plan(model_map, method, _keep_ratios(keep, model_map), locs, policy)
    # Found before the rewrite, which changes the graph they are read from.
    no_decay = no_weight_decay_parameters(model, captured.module, EXAMPLE_BATCH)
    compressed = rewrite(captured.module, model_map, plan)
    devices_follow_input(compressed, captured.example.device)
    # The modules the rewrite adds (reducers, predictors, restores) in the model's own dtype: a
    # float64 model gets float64 predictors, not the default float32's.
    for added in (REDUCER_PREFIX, HOOK_PREFIX):
        getattr(compressed, added).to(captured.example.dtype)
    problem = _rewritten_problem(compressed, captured.example)
    if problem is not None:
        raise RewrittenModelError(
            f"the rewritten model fails on one example image ({problem}), so {method.name} "
            "is refused here"
        )
    metadata = dict(
        vitcompress_plan=plan.to_json(),
        vitcompress_map=model_map.to_json(),
        vitcompress_input_size=size,
        **{ENTRY_ATTRIBUTE: entry_of(model)},
        # The attention residual add keeps the token count the block was entered with.
        vitcompress_block_nodes=[b.attn_add_node for b in model_map.blocks],
        # The block's last residual add: what it hands on, after a reduction inside it (eTPS,
        # EViT, ToMe) as well as one before it (dTPS, DynamicViT).
        vitcompress_block_output_nodes=[b.output_node for b in model_map.blocks],
        # The graph does not forward the base's no_weight_decay(): training reads this.
        **{NO_WEIGHT_DECAY_ATTRIBUTE: parameter_names(compressed, no_decay)},
    )
    # What the base states of its preprocessing, recorded by save(); the graph drops attributes.
    data_config, data_config_from = stated_data_config(model)
    if data_config:
        metadata.update(
            vitcompress_data_config=data_config, vitcompress_data_config_from=data_config_from
        )
    cfg = getattr(model, "pretrained_cfg", None)
    if isinstance(cfg, dict) and cfg.get("architecture"):
        # What the base shows of its constructor arguments: the compressed graph no longer has
        # the attributes they are read from, and ``save`` needs them to rebuild the base.
        metadata["vitcompress_base_cfg"] = {
            "architecture": cfg["architecture"],
            "model_args": readable_timm_args(model),
        }
    attach(compressed, **metadata)
    if base_methods:
        with_base_methods(compressed, model, compile_entry)
    compressed.train(model.training)
    return compressed


def compile_entry(
    base: nn.Module, entry: str, args: tuple, kwargs: dict[str, Any], compressed: nn.Module
) -> nn.Module:
    """``base``'s method ``entry`` (called on the image with ``args`` and ``kwargs``) compressed
    under ``compressed``'s plan, which must give it the same locations and token counts: what
    ``compressed`` runs when its base's method is called on it. Anything that stops it is one
    line naming the method."""
    info = compression_info(compressed)
    plan: Plan = info.plan
    size = info.input_size
    shown = entry if not (args or kwargs) else f"{entry} with {args or ''}{kwargs or ''}"
    try:
        view = entry_view(base, entry, args, kwargs)
        captured, model_map = capture_and_map(view, size)
        # Scored as the forward scores (its head reads a cls token the entry may not): the
        # method keeps the same tokens in both.
        model_map.cls_token = info.model_map.cls_token
        keep = None if plan.method.keep_setting else plan.keep
        model = compress_mapped(
            view,
            captured,
            model_map,
            size,
            plan.method,
            keep,
            plan.locs,
            plan.policy,
            base_methods=False,
        )
    except UserError as e:
        raise EntryError(
            f"{shown} cannot run on this compressed model: {one_line(e)}; call it on the "
            f"base, or compress the base with compress(..., entry='{entry}')"
        ) from e
    if compression_info(model).plan != plan:
        raise EntryError(
            f"{shown} cannot run on this compressed model: its plan for {entry} keeps other "
            f"token counts; compress the base with compress(..., entry='{entry}')"
        )
    return model


def compress_copy(
    model: nn.Module, captured: CapturedGraph, model_map: ModelMap, *settings: Any, **named: Any
) -> nn.Module:
    """:func:`compress_mapped` on copies of ``captured`` and ``model_map``, which compressing
    consumes: one capture of ``model`` then makes as many compressed models as asked (a search's
    candidates, the keeps a budget fit tries). ``settings`` and ``named`` are the rest of
    :func:`compress_mapped`'s arguments (size, method, keep, locs, policy)."""
    return compress_mapped(
        model, copy.deepcopy(captured), copy.deepcopy(model_map), *settings, **named
    )


def _keep_ratios(keep: float | Sequence[float] | None, model_map: ModelMap) -> list[float]:
    """The API takes one ratio or one per location; ``None`` is the paper's ratio for the model.
    Anything else goes to ``make_plan`` as it is, whose error says what it must be."""
    if keep is None:
        return [default_keep(model_map)]
    if isinstance(keep, numbers.Real) and not isinstance(keep, bool):
        return [float(keep)]
    return list(keep) if isinstance(keep, tuple) else keep


def compress_loaded(
    loaded: LoadedModel,
    variant: str | Variant = "etps",
    keep: Keep = None,
    locs: list[int] | None = None,
    policy: str = "score",
    variant_args: dict[str, Any] | None = None,
    entry: str | None = None,
) -> LoadedModel:
    """``compress`` for a model from :func:`vitcompress.loading.load_base_model`, keeping its source
    so the result can be saved and rebuilt."""
    model = compress(
        loaded.model,
        variant,
        keep,
        locs,
        loaded.input_size,
        policy,
        variant_args=variant_args,
        entry=entry,
    )
    attach(model, vitcompress_source=loaded.source)
    return LoadedModel(model=model, source=loaded.source, input_size=loaded.input_size)
