"""Data options: where the images come from (``--data``, ``--data-dir``, ``--split``) and
``--mean``, ``--std``, ``--interpolation``, ``--crop-pct``, which override the model's data config."""

from __future__ import annotations

import functools
from collections.abc import Callable

import click

from vitcompress.data.config import INTERPOLATIONS, NAMED_STATS, DataConfig, data_overrides


def data_source_options(split_default: str, split_help: str) -> Callable[[Callable], Callable]:
    """``--data``, ``--data-dir`` and ``--split``, with the split a command reads by default."""
    options = (
        click.option(
            "--data",
            required=True,
            metavar="DATA",
            help="ImageNet-style folder with train/ and val/, or 'fashion-mnist'.",
        ),
        click.option(
            "--data-dir",
            default=None,
            type=click.Path(file_okay=False),
            help="Folder with the Fashion-MNIST IDX files (plain or .gz).",
        ),
        click.option(
            "--split",
            type=click.Choice(["val", "train"]),
            default=split_default,
            show_default=True,
            help=split_help,
        ),
    )

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):  # click lists options in decorator order, top first
            command = option(command)
        return command

    return decorate


def data_config_options(command: Callable) -> Callable:
    """The four options, folded into ``data_overrides`` (parsed and checked, docs/data.md)."""
    names = "/".join(NAMED_STATS)
    decorators = [
        click.option(
            "--mean",
            default=None,
            metavar="M[,M,M]",
            help=f"Normalisation mean per channel (one value: every channel; or {names}). "
            "Default: the model's data config.",
        ),
        click.option(
            "--std",
            default=None,
            metavar="S[,S,S]",
            help=f"Normalisation std per channel (one value: every channel; or {names}). "
            "Default: the model's data config.",
        ),
        click.option(
            "--interpolation",
            type=click.Choice(INTERPOLATIONS),
            default=None,
            help="Resize interpolation. Default: the model's data config.",
        ),
        click.option(
            "--crop-pct",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            metavar="PCT",
            help="Center crop as a fraction of the resized image (1.0: resize only). "
            "Default: the model's data config, else by image size.",
        ),
    ]
    for decorator in reversed(decorators):
        command = decorator(command)

    @functools.wraps(command)
    def wrapper(*args, mean, std, interpolation, crop_pct, **kwargs):
        overrides = data_overrides(mean, std, interpolation, crop_pct)
        return command(*args, data_overrides=overrides, **kwargs)

    return wrapper


def describe(config: DataConfig) -> str:
    """``mean (0.5, 0.5, 0.5), std (...), bilinear, crop_pct 1.0 (center)`` for a header."""

    def values(v: tuple[float, ...]) -> str:
        return "(" + ", ".join(f"{x:.4g}" for x in v) + ")"

    crop = "by image size" if config.crop_pct is None else config.crop_pct
    return (
        f"mean {values(config.mean)}, std {values(config.std)}, {config.interpolation}, "
        f"crop_pct {crop} ({config.crop_mode})"
    )
