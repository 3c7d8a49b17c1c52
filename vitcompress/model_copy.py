"""A deep copy of a user's model that survives the caches some models keep.

TinyViT's attention, among others, caches its position bias in eval mode once it has run, and
when it ran with gradients on, that cache is a tensor made by an op (not a leaf), which
``copy.deepcopy`` refuses. Such caches are recomputed on the next call, so the copy is made
without them: they are set aside from the module while it is copied and put back after, and the
caller's model is left as it was."""

from __future__ import annotations

import copy
from typing import TypeVar

from torch import Tensor, nn

M = TypeVar("M", bound=nn.Module)


def _made_by_an_op(value: object) -> bool:
    """A tensor computed with gradients on (not a leaf), or a container holding one."""
    if isinstance(value, Tensor):
        return value.grad_fn is not None
    if isinstance(value, dict):
        return any(_made_by_an_op(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_made_by_an_op(v) for v in value)
    return False


def copy_model(model: M) -> M:
    """``copy.deepcopy(model)``, leaving out the attributes (not parameters or buffers) that
    hold tensors computed with gradients on: the copy has them empty where they were a dict or
    a list, else ``None``."""
    try:
        return copy.deepcopy(model)
    except RuntimeError as e:
        if "deepcopy protocol" not in str(e):
            raise
    aside: list[tuple[nn.Module, str, object]] = []
    try:
        for module in model.modules():
            for name, value in list(vars(module).items()):
                if name.startswith("_") or not _made_by_an_op(value):
                    continue
                aside.append((module, name, value))
                empty = {} if isinstance(value, dict) else [] if isinstance(value, list) else None
                setattr(module, name, empty)
        return copy.deepcopy(model)
    finally:
        for module, name, value in aside:
            setattr(module, name, value)
