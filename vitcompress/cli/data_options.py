"""Data options: where the images come from (``--data``, ``--data-dir``, ``--split``) and
``--mean``, ``--std``, ``--interpolation``, ``--crop-pct``, which override the model's data config."""

from __future__ import annotations

from collections.abc import Callable

import click

from vitcompress.cli.options import folded_options
from vitcompress.data.config import INTERPOLATIONS, NAMED_STATS, DataConfig, data_overrides
from vitcompress.data.segmentation import FASHION_MNIST_SEG, TASKS
from vitcompress.workflows.inputs import DataRequest


def data_options(
    split_default: str | None, split_help: str = "", required: bool = True
) -> Callable[[Callable], Callable]:
    """``--data``, ``--data-dir``, ``--split`` (without a ``split_default``: none, the command
    reads both splits) and the data config options, folded into ``data: DataRequest``.
    ``required=False``: ``--data`` may come from a recipe; the command checks it."""
    options = [
        click.option(
            "--data",
            required=required,
            # No ``default=None`` beside ``required``: click 8.3 and later take an explicit
            # default of None as a value given, and would not refuse a missing --data.
            **({} if required else {"default": None}),
            metavar="DATA",
            help="ImageNet-style folder with train/ and val/, 'fashion-mnist', or "
            f"'{FASHION_MNIST_SEG}' (segmentation, generated from Fashion-MNIST).",
        ),
        click.option(
            "--data-dir",
            default=None,
            type=click.Path(file_okay=False),
            help="Folder with the Fashion-MNIST IDX files (plain or .gz).",
        ),
    ]
    if split_default is not None:
        options.append(
            click.option(
                "--split",
                type=click.Choice(["val", "train"]),
                default=split_default,
                show_default=True,
                help=split_help,
            )
        )
    options += _config_options()

    def request(
        data: str | None,
        data_dir: str | None,
        mean: str | None,
        std: str | None,
        interpolation: str | None,
        crop_pct: float | None,
        split: str = "train",
    ) -> DataRequest:
        overrides = data_overrides(mean, std, interpolation, crop_pct)
        return DataRequest(data, data_dir, split, overrides)

    return folded_options("data", options, request)


task_option = click.option(
    "--task",
    type=click.Choice(TASKS),
    default=TASKS[0],
    show_default=True,
    help="classification: top-1 on image labels; segmentation: mean IoU and pixel accuracy of "
    f"per-pixel logits (B, classes, H, W) on per-pixel labels (--data {FASHION_MNIST_SEG}).",
)


def _config_options() -> list[Callable]:
    """``--mean``, ``--std``, ``--interpolation``, ``--crop-pct``: the model's data config,
    overridden (docs/data.md)."""
    names = "/".join(NAMED_STATS)
    return [
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


def describe(config: DataConfig) -> str:
    """``mean (0.5, 0.5, 0.5), std (...), bilinear, crop_pct 1.0 (center)`` for a header."""

    def values(v: tuple[float, ...]) -> str:
        return "(" + ", ".join(f"{x:.4g}" for x in v) + ")"

    crop = "by image size" if config.crop_pct is None else config.crop_pct
    return (
        f"mean {values(config.mean)}, std {values(config.std)}, {config.interpolation}, "
        f"crop_pct {crop} ({config.crop_mode})"
    )
