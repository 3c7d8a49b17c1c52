"""Augmentation presets and the transforms that bring any image to a model's input size."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from PIL import Image
from timm.data import auto_augment, create_transform
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from vitcompress.errors import UserError


class DataError(UserError):
    """A problem with the data the user pointed at; its message is one line for the CLI."""


@dataclass
class AugmentConfig:
    """Training augmentation. The defaults are DeiT's recipe."""

    rand_augment: str | None = "rand-m9-mstd0.5-inc1"  # timm auto_augment string; None = off
    mixup: float = 0.8
    cutmix: float = 1.0
    smoothing: float = 0.1
    random_erasing: float = 0.25
    color_jitter: float | None = None
    hflip: float = 0.5
    crop_scale: tuple[float, float] = field(default=(0.08, 1.0))

    @classmethod
    def deit(cls) -> AugmentConfig:
        """DeiT's recipe: RandAugment m9, mixup 0.8, cutmix 1.0, smoothing 0.1, erasing 0.25."""
        return cls()

    @classmethod
    def light(cls) -> AugmentConfig:
        """For small images (Fashion-MNIST, CIFAR-sized): RandAugment, mixup and cutmix would
        destroy most of a 28-pixel image, so only mild crops and flips remain."""
        return replace(cls.none(), smoothing=0.1, hflip=0.5, crop_scale=(0.8, 1.0))

    @classmethod
    def none(cls) -> AugmentConfig:
        """Everything off: the training split gets the deterministic evaluation transform."""
        return cls(
            rand_augment=None,
            mixup=0.0,
            cutmix=0.0,
            smoothing=0.0,
            random_erasing=0.0,
            color_jitter=None,
            hflip=0.0,
            crop_scale=(1.0, 1.0),
        )

    def mixup_args(self, num_classes: int) -> dict[str, Any] | None:
        """Keyword arguments for ``timm.data.Mixup``; None when mixup and cutmix are both off."""
        if self.mixup <= 0 and self.cutmix <= 0:
            return None
        return dict(
            mixup_alpha=self.mixup,
            cutmix_alpha=self.cutmix,
            cutmix_minmax=None,
            prob=1.0,
            switch_prob=0.5,
            mode="batch",
            label_smoothing=self.smoothing,
            num_classes=num_classes,
        )

    @property
    def is_off(self) -> bool:
        """True when no per-image augmentation is random (mixup is applied per batch, later)."""
        return (
            self.rand_augment is None
            and self.random_erasing <= 0
            and not self.color_jitter
            and self.hflip <= 0
            and tuple(self.crop_scale) == (1.0, 1.0)
        )


def check_input_size(input_size: Sequence[int]) -> tuple[int, int, int]:
    """(C, H, W) with C in {1, 3}: the only channel counts an image can be brought to."""
    try:
        size = tuple(int(v) for v in input_size)
    except (TypeError, ValueError):
        size = ()
    if len(size) != 3 or min(size) <= 0:
        raise DataError(
            f"input size {tuple(input_size)!r} is not three positive integers (C, H, W)"
        )
    if size[0] not in (1, 3):
        raise DataError(
            f"input size {size}: images can be fed to 1- or 3-channel models only, "
            f"not {size[0]} channels"
        )
    return size  # type: ignore[return-value]


def normalisation(
    channels: int, mean: Sequence[float] | None, std: Sequence[float] | None
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """ImageNet's mean/std by default; their channel average for 1-channel models."""

    def pick(given: Sequence[float] | None, default: tuple[float, ...], name: str):
        if given is None:
            values = tuple(default)
            return values if channels == 3 else (sum(values) / len(values),)
        values = tuple(float(v) for v in given)
        if len(values) == 1:
            values = values * channels
        if len(values) != channels:
            raise DataError(
                f"{name} has {len(values)} values but the model takes {channels} channels"
            )
        return values

    return (pick(mean, IMAGENET_DEFAULT_MEAN, "mean"), pick(std, IMAGENET_DEFAULT_STD, "std"))


def build_transform(
    input_size: tuple[int, int, int],
    train: bool,
    augment: AugmentConfig,
    mean: tuple[float, ...],
    std: tuple[float, ...],
    crop_pct: float | None = None,
    interpolation: str = "bicubic",
    crop_mode: str = "center",
) -> Callable[[Image.Image], torch.Tensor]:
    """timm's ImageNet transforms at the model's size, fed an image already in the model's mode.

    The caller converts images to "RGB" or "L" first, so a 28x28 grayscale digit goes through
    exactly the same crop/flip/RandAugment/erasing code as an ImageNet photo. ``crop_pct`` and
    ``crop_mode`` shape the evaluation transform (None: timm's 0.875); ``interpolation`` is used
    by both.
    """
    channels, height, width = input_size
    if not train or augment.is_off:
        return create_transform(
            (channels, height, width),
            is_training=False,
            crop_pct=crop_pct,
            crop_mode=crop_mode,
            interpolation=interpolation,
            mean=mean,
            std=std,
        )
    transform = create_transform(
        (channels, height, width),
        is_training=True,
        scale=tuple(augment.crop_scale),
        hflip=augment.hflip,
        color_jitter=augment.color_jitter,
        auto_augment=augment.rand_augment,
        interpolation=interpolation,
        mean=mean,
        std=std,
        re_prob=augment.random_erasing,
        re_mode="pixel",
        re_count=1,
    )
    guard_posterize(transform)
    return transform


def posterize_keeping_zero_bits(img: Image.Image, bits_to_keep: int, **_: Any) -> Image.Image:
    """timm's posterize, with the 0-bit level every RandAugment magnitude range reaches.

    timm maps the strongest "PosterizeIncreasing" magnitude (and the weakest "Posterize" one)
    to 0 bits kept, which Pillow answered with a black image until Pillow 12 began to raise
    ValueError instead; one such draw in a few hundred images ended a training run.
    TensorFlow's reference posterize gives black, so that is what 0 bits gives here.
    """
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)  # all channels 0
    return auto_augment.posterize(img, bits_to_keep)


def guard_posterize(transform: Any) -> None:
    """Swap timm's posterize for ``posterize_keeping_zero_bits`` in every augmentation op
    inside ``transform`` (a Compose, RandAugment, AutoAugment or AugMix)."""
    if getattr(transform, "aug_fn", None) is auto_augment.posterize:
        transform.aug_fn = posterize_keeping_zero_bits
        return
    for attribute in ("transforms", "ops", "policy"):
        for child in getattr(transform, attribute, None) or ():
            # AutoAugment's policy is a list of sub-policies, each a list of ops.
            for op in child if isinstance(child, (list, tuple)) else (child,):
                guard_posterize(op)
