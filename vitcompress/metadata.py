"""What a compressed model carries besides its weights (plan, model map, source, artifact path).

The values live as ``vitcompress_*`` attributes. ``torch.fx.GraphModule`` rebuilds itself on
``copy.deepcopy`` (EMA copies, users' own copies) and keeps only what its ``meta`` dict lists as
user-preserved attributes, so the values are registered there too.
"""

from __future__ import annotations

from typing import Any

from torch import nn

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
