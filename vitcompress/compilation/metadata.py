"""What a compressed model carries besides its weights (plan, model map, source, artifact path).

The values live as ``vitcompress_*`` attributes. ``torch.fx.GraphModule`` rebuilds itself on
``copy.deepcopy`` (EMA copies, users' own copies) and keeps only what its ``meta`` dict lists as
user-preserved attributes, so the values are registered there too. The plan and the model map
are attached as their JSON (artifacts write it, and a deepcopy keeps plain data); code reads
them back typed through :func:`compression_info`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from vitcompress.analysis.model_map import ModelMap
from vitcompress.compilation.plan import Plan
from vitcompress.loading import ModelLoadError, ModelSource

try:
    from torch.fx.graph_module import _USER_PRESERVED_ATTRIBUTES_KEY
except ImportError:  # older torch: attributes are set, but a deepcopy drops them
    _USER_PRESERVED_ATTRIBUTES_KEY = None


def attach(model: nn.Module, **values: Any) -> None:
    """Set ``model.<name> = value`` for each value, surviving ``copy.deepcopy`` of a GraphModule."""
    for name, value in values.items():
        setattr(model, name, value)
    meta = getattr(model, "meta", None)
    if _USER_PRESERVED_ATTRIBUTES_KEY is not None and isinstance(meta, dict):
        meta.setdefault(_USER_PRESERVED_ATTRIBUTES_KEY, {}).update(values)


@dataclass(frozen=True)
class CompressionInfo:
    """What :func:`vitcompress.compress` (or loading an artifact) attached to a model."""

    plan: Plan
    # The base model's map, read back from JSON: it describes the model, names no graph nodes.
    model_map: ModelMap
    input_size: tuple[int, ...] | None  # what the plan's token counts were made for
    source: ModelSource | None  # how to rebuild the base, when known
    artifact: Path | None  # the artifact directory the model was loaded from, if any


def compression_info(model: nn.Module) -> CompressionInfo | None:
    """The compression ``model`` carries, or ``None`` for a model that is not compressed.

    Raises ``ModelLoadError`` (one line) when the attached values are missing or malformed, as
    after a user deleted or replaced them: nothing can be said about such a model."""
    plan = getattr(model, "vitcompress_plan", None)
    if plan is None:
        return None
    model_map = getattr(model, "vitcompress_map", None)
    if not isinstance(plan, dict) or not isinstance(model_map, dict):
        raise ModelLoadError(
            "the model carries a compression plan but no model map "
            "(vitcompress_map); compress its base model again"
        )
    try:
        typed_plan, typed_map = Plan.from_json(plan), ModelMap.from_json(model_map)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ModelLoadError(
            f"the model's compression record is malformed ({type(e).__name__}: "
            f"{e}); compress its base model again"
        ) from e
    size = getattr(model, "vitcompress_input_size", None)
    artifact = getattr(model, "vitcompress_artifact", None)
    return CompressionInfo(
        plan=typed_plan,
        model_map=typed_map,
        input_size=tuple(int(v) for v in size) if size is not None else None,
        source=getattr(model, "vitcompress_source", None),
        artifact=Path(artifact) if artifact is not None else None,
    )
