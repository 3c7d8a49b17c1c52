"""The preprocessing a model expects (its data config) and where each value comes from.

Precedence, highest first (docs/data.md):

1. options: ``--mean``, ``--std``, ``--interpolation``, ``--crop-pct`` (or a recipe's keys);
2. what the model states: a compressed model's record (``data_config`` in ``vitcompress.json``,
   or, for a model compressed in this process, what its base stated), an in-house model's
   ``data_config`` attribute, timm's ``pretrained_cfg`` (read with
   ``timm.data.resolve_model_data_config``);
3. defaults: ImageNet's mean/std, bicubic, the crop chosen by the images' size.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from timm.data.constants import (
    IMAGENET_DEFAULT_MEAN,
    IMAGENET_DEFAULT_STD,
    IMAGENET_INCEPTION_MEAN,
    IMAGENET_INCEPTION_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
)
from torch import nn

from vitcompress.data.transforms import DataError

FIELDS = ("mean", "std", "interpolation", "crop_pct", "crop_mode")
# What torchvision can resize with (timm's str_to_interp_mode).
INTERPOLATIONS = ("bilinear", "bicubic", "nearest", "box", "hamming", "lanczos")
CROP_MODES = ("center", "squash", "border")
# Named statistics accepted by --mean/--std (and recipes) instead of numbers.
NAMED_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "imagenet": (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD),
    "inception": (IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD),  # 0.5 / 0.5
    "openai": (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),  # CLIP, EVA02
}
# The attribute an in-house model sets to state its preprocessing.
MODEL_ATTRIBUTE = "data_config"
OPTIONS = {
    "mean": "--mean",
    "std": "--std",
    "interpolation": "--interpolation",
    "crop_pct": "--crop-pct",
}
DEFAULTS_SOURCE = "defaults"
# What every `finetune` before data configs were recorded normalised with.
LEGACY_FINETUNE = {
    "mean": list(IMAGENET_DEFAULT_MEAN),
    "std": list(IMAGENET_DEFAULT_STD),
    "interpolation": "bicubic",
}


@dataclass(frozen=True)
class DataConfig:
    """Normalisation, resize interpolation and center crop of the evaluation transform.

    ``crop_pct`` None means nobody stated one: the images decide (1.0 for images smaller than
    the input, so none of their border is cropped away; timm's 0.875 otherwise).
    ``sources`` says where each field came from; ``explicit`` names the fields given by the
    user (options, recipe, ``build_dataset`` arguments), which are never adapted.
    """

    mean: tuple[float, ...] = tuple(IMAGENET_DEFAULT_MEAN)
    std: tuple[float, ...] = tuple(IMAGENET_DEFAULT_STD)
    interpolation: str = "bicubic"
    crop_pct: float | None = None
    crop_mode: str = "center"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    explicit: frozenset[str] = field(default_factory=frozenset, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "mean": list(self.mean),
            "std": list(self.std),
            "interpolation": self.interpolation,
            "crop_pct": self.crop_pct,
            "crop_mode": self.crop_mode,
        }

    def defaulted(self) -> list[str]:
        """The fields nobody stated (taken from the defaults)."""
        return [
            name
            for name in FIELDS
            if self.sources.get(name, DEFAULTS_SOURCE).startswith(DEFAULTS_SOURCE)
        ]

    def with_field(self, name: str, value: Any, source: str) -> DataConfig:
        return replace(self, **{name: value}, sources={**self.sources, name: source})

    def for_channels(self, channels: int) -> DataConfig:
        """Mean and std with one value per input channel.

        One value is repeated. Three values stated by a model (timm keeps its weights' RGB
        config for ``in_chans=1``) or by the defaults become their average for a 1-channel
        model; any other count, and three values the user gave for one channel, are an error.
        """
        config = self
        for name in ("mean", "std"):
            values = getattr(config, name)
            if len(values) == channels:
                continue
            source = config.sources.get(name, DEFAULTS_SOURCE)
            if len(values) == 1:
                config = config.with_field(name, values * channels, source)
            elif channels == 1 and len(values) == 3 and name not in config.explicit:
                config = config.with_field(
                    name, (sum(values) / 3,), f"{source}, averaged over RGB for a 1-channel model"
                )
            else:
                raise DataError(
                    f"{name} has {len(values)} values ({_where(source)}) but the "
                    f"model takes {channels} channels"
                )
        return config


def _where(source: str) -> str:
    return source if source.startswith("--") else f"from {source}"


# ---------------------------------------------------------------------------------------------
# Checking values


def check_fields(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A (partial) data config from a model, an artifact or a recipe, validated: unknown keys
    and ill-typed values are a ``DataError`` naming ``where``. Returns normalised values
    (tuples of floats, lower-case names)."""
    if not isinstance(values, Mapping):
        raise DataError(
            f"{where} is a {type(values).__name__}, not a mapping of {', '.join(FIELDS)}"
        )
    unknown = sorted(str(k) for k in values if k not in FIELDS)
    if unknown:
        extra = (
            "; the input size is the model's default_input_size or --input-size"
            if "input_size" in unknown
            else ""
        )
        raise DataError(
            f"{where}: unknown key {', '.join(unknown)} (expected {', '.join(FIELDS)}){extra}"
        )
    checked: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue  # not stated
        if name in ("mean", "std"):
            checked[name] = check_stats(value, name, where)
        elif name == "interpolation":
            checked[name] = _check_choice(value, INTERPOLATIONS, name, where)
        elif name == "crop_mode":
            checked[name] = _check_choice(value, CROP_MODES, name, where)
        else:
            checked[name] = check_crop_pct(value, where)
    return checked


def check_stats(value: Any, name: str, where: str) -> tuple[float, ...]:
    """A mean or std: one number or a sequence of them, finite; a std is positive."""
    items = [value] if isinstance(value, numbers.Real) else value
    if (
        isinstance(items, (str, bytes))
        or not isinstance(items, Sequence)
        or not items
        or not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in items)
    ):
        raise DataError(f"{where}: {name} {value!r} is not a number or a list of numbers")
    floats = tuple(float(v) for v in items)
    if not all(math.isfinite(v) for v in floats):
        raise DataError(f"{where}: {name} {value!r} is not finite")
    if name == "std" and min(floats) <= 0:
        raise DataError(f"{where}: std {value!r} must be positive (it divides the pixels)")
    return floats


def check_crop_pct(value: Any, where: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (math.isfinite(value) and value > 0)
    ):
        raise DataError(f"{where}: crop_pct {value!r} is not a positive number")
    return float(value)


def _check_choice(value: Any, choices: tuple[str, ...], name: str, where: str) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise DataError(f"{where}: {name} {value!r} is not one of {', '.join(choices)}")
    return value.lower()


def parse_stats(text: str, name: str) -> tuple[float, ...]:
    """``--mean``/``--std`` text: ``0.5``, ``0.485,0.456,0.406`` or a name in ``NAMED_STATS``."""
    option = OPTIONS[name]
    named = NAMED_STATS.get(text.strip().lower())
    if named is not None:
        return tuple(named[0] if name == "mean" else named[1])
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise DataError(
            f"{option} {text!r} is not a comma list of numbers or one of {', '.join(NAMED_STATS)}"
        ) from None
    return check_stats(values, name, option)


def data_overrides(
    mean: str | None = None,
    std: str | None = None,
    interpolation: str | None = None,
    crop_pct: float | None = None,
) -> dict[str, Any]:
    """The fields given as options (text as typed), parsed and checked."""
    overrides: dict[str, Any] = {}
    if mean is not None:
        overrides["mean"] = parse_stats(str(mean), "mean")
    if std is not None:
        overrides["std"] = parse_stats(str(std), "std")
    if interpolation is not None:
        overrides["interpolation"] = _check_choice(
            interpolation, INTERPOLATIONS, "interpolation", "--interpolation"
        )
    if crop_pct is not None:
        overrides["crop_pct"] = check_crop_pct(crop_pct, "--crop-pct")
    return overrides


# ---------------------------------------------------------------------------------------------
# What a model states


def stated_data_config(model: nn.Module) -> tuple[dict[str, Any], str]:
    """``(fields, where)``: the part of its data config ``model`` states, and where it says it.

    In order: the record a compressed model carries (``vitcompress_data_config``), an in-house
    model's ``data_config`` attribute, timm's ``pretrained_cfg`` / ``default_cfg`` (only the
    fields it has). ``({}, "")`` when the model states none.
    """
    recorded = getattr(model, "vitcompress_data_config", None)
    if recorded is not None:
        where = getattr(model, "vitcompress_data_config_from", None) or "the compressed model"
        return check_fields(recorded, where), where
    own = getattr(model, MODEL_ATTRIBUTE, None)
    if own is not None:
        where = f"the model's {MODEL_ATTRIBUTE} attribute"
        return check_fields(own, where), where
    for attribute in ("pretrained_cfg", "default_cfg"):
        cfg = getattr(model, attribute, None)
        if isinstance(cfg, Mapping) and any(cfg.get(name) is not None for name in FIELDS):
            from timm.data import resolve_model_data_config

            resolved = resolve_model_data_config(model)
            where = f"the model's {attribute} (timm)"
            present = {name: resolved[name] for name in FIELDS if cfg.get(name) is not None}
            return check_fields(present, where), where
    return {}, ""


def resolve_data_config(
    model: nn.Module, channels: int, overrides: Mapping[str, Any] | None = None
) -> DataConfig:
    """The data config to feed ``model`` with: ``overrides`` (from ``data_overrides``) over what
    the model states over the defaults, with one mean/std value per channel."""
    stated, where = stated_data_config(model)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, value in stated.items():
        values[name], sources[name] = value, where
    for name, value in (overrides or {}).items():
        values[name], sources[name] = value, OPTIONS[name]
    for name in FIELDS:
        sources.setdefault(name, DEFAULTS_SOURCE)
    config = DataConfig(**values, sources=sources, explicit=frozenset(overrides or ()))
    return config.for_channels(channels)


def artifact_data_config(
    meta: Mapping[str, Any], rebuilt: nn.Module, directory: str
) -> tuple[dict[str, Any], str]:
    """``(fields, where)`` for a compressed model saved in ``directory`` with ``meta``.

    A fine-tuned artifact uses the config it was fine-tuned with; one fine-tuned before the
    config was recorded was fed ImageNet's mean/std, bicubic, the only normalisation
    ``finetune`` had. Otherwise the record ``apply`` wrote, else what the base states (an
    artifact written before records existed): ``rebuilt``, the model rebuilt from the base by
    ``compress``, carries that.
    """
    where = f"{directory}/vitcompress.json"
    finetuned = meta.get("finetune")
    if isinstance(finetuned, Mapping):
        recorded = finetuned.get("data_config")
        if recorded is None:
            return dict(LEGACY_FINETUNE), (
                f"{DEFAULTS_SOURCE} of finetune when {where} was written (no data_config recorded)"
            )
        return check_fields(recorded, f"{where} (finetune.data_config)"), where
    if meta.get("data_config") is not None:
        return check_fields(meta["data_config"], f"{where} (data_config)"), where
    return stated_data_config(rebuilt)


def mismatch_note(model: nn.Module, config: DataConfig) -> str | None:
    """One line when images normalised by ``config`` are not what ``model`` states it expects.

    Only the mean and std are compared (a wrong normalisation shifts every input; a crop or a
    resize filter changes little), and only where the model states them and ``config`` took its
    value from the defaults: a value the user gave (an option, a recipe, an argument) is a
    choice, not a slip. None when they agree or nothing can be told.
    """
    stated, where = stated_data_config(model)
    wrong = []
    for name in ("mean", "std"):
        if name not in stated or name in config.explicit:
            continue
        ours = getattr(config, name)
        try:
            restated = replace(config, **{name: stated[name]}).for_channels(len(ours))
        except DataError:  # stated for another number of channels: nothing to compare
            continue
        expected = getattr(restated, name)
        if any(abs(a - b) > 1e-6 for a, b in zip(ours, expected, strict=True)):
            wrong.append(f"{name} {_show(ours)} where {where} states {_show(expected)}")
    if not wrong:
        return None
    return (
        f"the images are normalised with {'; '.join(wrong)}: the accuracy is of inputs the model "
        "does not expect; build the set with vitcompress.data.model_dataset(model, ...)"
    )


def defaults_note(config: DataConfig, name: str) -> str | None:
    """One line for stderr when ``config`` (of model ``name``) took values nobody stated."""
    missing = config.defaulted()
    # An unstated crop mode or crop is no news once the normalisation is stated: center, and the
    # crop the images' size calls for, are what any model expects.
    if not set(missing) & {"mean", "std", "interpolation"}:
        return None
    shown = ", ".join(
        f"{field_name} {_show(getattr(config, field_name))}" for field_name in missing
    )
    return (
        f"note: {name} states no {'/'.join(missing)}; used {shown}. If it was trained "
        f"otherwise, pass --mean/--std/--interpolation/--crop-pct or give the model a "
        f"{MODEL_ATTRIBUTE} attribute (docs/data.md)"
    )


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(f"{v:.4g}" for v in value) + ")"
    return "by image size" if value is None else str(value)
