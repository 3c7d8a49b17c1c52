"""The constructor arguments a built timm model still shows about itself.

A model made with ``timm.create_model(name, **kwargs)`` does not keep ``kwargs``; some of them can
be read back from what the model holds (its head size, patch embedding, depth). Each is kept only
where the model's class takes an argument of that name. What cannot be read (``act_layer``,
``norm_layer``, epsilons) is not guessed: saving rebuilds the model from these arguments and
refuses when the rebuilt model differs (see ``artifacts/artifact.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn


def _patch_embed(model: nn.Module) -> nn.Module | None:
    embed = getattr(model, "patch_embed", None)
    return embed if isinstance(embed, nn.Module) else None


def _pair(value: Any) -> tuple[int, int] | None:
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return (value[0], value[1])
    return None


def _in_chans(model: nn.Module) -> int | None:
    proj = getattr(_patch_embed(model), "proj", None)
    return proj.in_channels if isinstance(proj, nn.Conv2d) else None


def _blocks(model: nn.Module) -> nn.Module | None:
    blocks = getattr(model, "blocks", None)
    return blocks if isinstance(blocks, (nn.Sequential, nn.ModuleList)) and len(blocks) else None


def _num_heads(model: nn.Module) -> int | None:
    blocks = _blocks(model)
    heads = getattr(getattr(blocks[0], "attn", None), "num_heads", None) if blocks else None
    return heads if isinstance(heads, int) else None


def _mlp_ratio(model: nn.Module) -> float | None:
    blocks = _blocks(model)
    fc1 = getattr(getattr(blocks[0], "mlp", None), "fc1", None) if blocks else None
    if isinstance(fc1, nn.Linear) and fc1.in_features:
        return fc1.out_features / fc1.in_features
    return None


def _attribute(name: str, kind: type | tuple[type, ...]) -> Callable[[nn.Module], Any]:
    def read(model: nn.Module) -> Any:
        value = getattr(model, name, None)
        # bool is an int: a flag is never read as a count, nor a count as a flag.
        if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
            return value
        return None

    return read


# constructor argument -> how to read it from a built model (None: not readable)
_READERS: dict[str, Callable[[nn.Module], Any]] = {
    "num_classes": _attribute("num_classes", int),
    "global_pool": _attribute("global_pool", str),
    "img_size": lambda m: _pair(getattr(_patch_embed(m), "img_size", None)),
    "patch_size": lambda m: _pair(getattr(_patch_embed(m), "patch_size", None)),
    "in_chans": _in_chans,
    "embed_dim": _attribute("embed_dim", int),
    "depth": lambda m: len(_blocks(m)) if _blocks(m) is not None else None,
    "num_heads": _num_heads,
    "mlp_ratio": _mlp_ratio,
    "class_token": _attribute("has_class_token", bool),
    "reg_tokens": _attribute("num_reg_tokens", int),
    "no_embed_class": _attribute("no_embed_class", bool),
}


def _accepted(model: nn.Module) -> Callable[[str], bool]:
    try:
        parameters = inspect.signature(type(model)).parameters
    except (TypeError, ValueError):
        return lambda name: False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return lambda name: True  # a subclass passing **kwargs on to its base
    return lambda name: name in parameters


def readable_timm_args(model: nn.Module) -> dict[str, Any]:
    """The constructor arguments ``model`` shows, for those its class accepts."""
    accepts = _accepted(model)
    args = {}
    for name, read in _READERS.items():
        if accepts(name):
            value = read(model)
            if value is not None:
                args[name] = value
    return args
