"""The input size a model says it takes, without the batch dim: an image model's (C, H, W), or
of higher rank (a video model's (C, T, H, W), or HF VideoMAE's (T, C, H, W): whatever follows
the batch dim of the tensor the model takes)."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vitcompress.loading.errors import ModelInputError, ModelLoadError, one_line
from vitcompress.loading.inferred_size import inferred_input_size

MIN_RANK = 3  # (C, H, W): an image; more for a video's (C, T, H, W)
MAX_RANK = 8


def as_size(value: Any) -> tuple[int, ...] | None:
    """``value`` as an input size if it is three (C, H, W) or more positive ints, else None."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return None
    if not MIN_RANK <= len(value) <= MAX_RANK:
        return None
    # Integral rather than int: numpy integers from a config are fine, True is not a size.
    if not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in value
    ):
        return None
    return tuple(int(v) for v in value)


def default_input_size(model: nn.Module) -> tuple[int, ...] | None:
    """The input the model expects ((C, H, W), or a video's of higher rank); None if it cannot
    be told.

    What the model declares (:func:`declared_input_size`), else what its patch embedding and
    position table show, else 224 tried (``inferred_size.py``; a note on stderr says which).
    """
    return declared_input_size(model) or inferred_input_size(model)


def declared_input_size(model: nn.Module) -> tuple[int, ...] | None:
    """The input the model says it takes; None if it says nothing.

    In order: timm's ``pretrained_cfg`` (or ``default_cfg``); a ``default_input_size`` or
    ``input_size`` attribute; the image size a timm-style ``patch_embed`` was built for.
    """
    for attr in ("pretrained_cfg", "default_cfg"):
        cfg = getattr(model, attr, None)
        size = as_size(cfg.get("input_size")) if isinstance(cfg, Mapping) else None
        if size is not None:
            # timm keeps the weights' config when a model is created with another img_size (or
            # in_chans), and such a model rejects the config's size: what it was built for wins.
            return _patch_embed_size(model, channels=size[0]) or size
    for attr in ("default_input_size", "input_size"):
        size = as_size(getattr(model, attr, None))
        if size is not None:
            return size
    return _patch_embed_size(model, channels=None)


def _patch_embed_size(model: nn.Module, channels: int | None) -> tuple[int, int, int] | None:
    embed = getattr(model, "patch_embed", None)
    if not isinstance(embed, nn.Module):
        return None
    img_size = getattr(embed, "img_size", None)  # None in timm when the size is dynamic
    if not isinstance(img_size, Sequence) or len(img_size) != 2:
        return None
    # The first conv of the embedding reads the image; in a hybrid embedding (a ResNet stem)
    # ``proj`` reads the stem's features, not the image's channels.
    first_conv = next((m for m in embed.modules() if isinstance(m, nn.Conv2d)), None)
    if first_conv is not None:
        channels = first_conv.in_channels
    if channels is None:
        return None
    return as_size((channels, *img_size))


def checked_input_size(input_size: Sequence[int] | None) -> tuple[int, ...] | None:
    """``input_size`` as a tuple, None if not given; refused unless three positive ints (C, H, W)
    or more (a video model's (C, T, H, W))."""
    if input_size is None:
        return None
    size = as_size(tuple(input_size)) if isinstance(input_size, Sequence) else None
    if size is None:
        raise ModelLoadError(
            f"input size {input_size!r} is not three positive integers (C, H, W) or up to "
            f"{MAX_RANK} (a video model's C, T, H, W)"
        )
    return size


def check_runs(model: nn.Module, size: tuple[int, ...], spec: str, given: bool) -> None:
    """Run ``model`` once on a batch of ``size``: a wrong ``--input-size``, or a factory that
    returns something other than an image model, is the user's error and must read as one line,
    not as the traceback of a later step. Costs one batch-1 forward."""
    example = torch.randn(1, *size, generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad():
            model(example)
    except Exception as exc:
        text = ",".join(map(str, size))
        if given:
            own = declared_input_size(model)  # an inferred size is no word of the model's
            says = f" (the model says {','.join(map(str, own))})" if own and own != size else ""
            hint = f"pass the input size it was built for{says}"
            where = f"--input-size {text}"
        else:
            hint = "pass --input-size C,H,W if it takes another, or check that it is an image model"
            where = f"its input size {text}"
        raise ModelInputError(
            f"model '{spec}' does not run on {where}: {one_line(exc)}; {hint}"
        ) from exc
