"""HuggingFace ``transformers`` models: a local ``save_pretrained`` directory as ``--model DIR``.

The directory holds a ``config.json`` (and the weights): the model is built with its Auto class,
``AutoModelForImageClassification`` where the config names an image-classification architecture,
``AutoModelForVideoClassification`` for a video one (VideoMAE), else ``AutoModel``, offline (``local_files_only=True``) with the directory's weights. It is
wrapped in :class:`HFImageClassifier` so that images go in and logits (or a backbone's pooled
features) come out, as the rest of the tool expects.

What the wrapper states: its input size from the config's ``image_size`` and ``num_channels``
(and ``num_frames`` for a video model, whose ``pixel_values`` are (B, T, C, H, W)), and its preprocessing (mean, std, interpolation) from a ``preprocessor_config.json`` in the
directory when there is one (HF keeps the image processor in a separate file); the data config's
precedence (``vitcompress.data.config``) does the rest.

``transformers`` is an optional extra: ``pip install 'vitcompress[hf]'``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitcompress.loading.errors import SHOW_KEYS, ModelLoadError, one_line

HF_CONFIG = "config.json"
HF_PREPROCESSOR = "preprocessor_config.json"
# Weights files save_pretrained writes, in the order transformers prefers them.
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# PIL's resampling codes, as preprocessor configs write them ("resample": 3).
_PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def is_hf_directory(spec: str) -> bool:
    """True if ``spec`` is a directory holding a HuggingFace ``config.json``."""
    return Path(spec).expanduser().joinpath(HF_CONFIG).is_file()


class HFImageClassifier(nn.Module):
    """A transformers vision model as an image classifier: ``forward(images) -> logits``.

    Image-classification models return an output object: its ``logits`` are taken. A backbone
    (``AutoModel``) gives its ``pooler_output``.
    """

    def __init__(
        self,
        model: nn.Module,
        input_size: tuple[int, ...] | None = None,
        data_config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        if input_size is not None:
            self.default_input_size = input_size  # read by loading.input_size
        if data_config:
            self.data_config = dict(data_config)  # read by vitcompress.data.config

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        output = self.model(pixel_values=pixel_values)
        logits = getattr(output, "logits", None)
        if logits is None:
            logits = getattr(output, "pooler_output", None)
        return logits if logits is not None else output[0]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelLoadError(
            "a HuggingFace model directory needs transformers, which is not installed; "
            "pip install 'vitcompress[hf]'"
        ) from exc
    return transformers


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {one_line(exc)}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def weights_file(directory: Path) -> Path | None:
    """The single-file weights ``save_pretrained`` wrote into ``directory``, if any."""
    return next((directory / n for n in HF_WEIGHTS if (directory / n).is_file()), None)


def input_size_of(config: Any) -> tuple[int, ...] | None:
    """(C, H, W) from the config's ``image_size`` (an int or a pair) and ``num_channels``; a
    video model's (T, C, H, W) with its ``num_frames``, as its ``pixel_values`` lay them out."""
    side = getattr(config, "image_size", None)
    channels = getattr(config, "num_channels", 3)
    frames = getattr(config, "num_frames", None)
    if isinstance(side, int) and not isinstance(side, bool):
        side = (side, side)
    if (
        isinstance(side, (list, tuple))
        and len(side) == 2
        and all(isinstance(v, int) and v > 0 for v in side)
        and isinstance(channels, int)
        and channels > 0
    ):
        if isinstance(frames, int) and not isinstance(frames, bool) and frames > 0:
            return (frames, channels, int(side[0]), int(side[1]))
        return (channels, int(side[0]), int(side[1]))
    return None


def data_config_of(directory: Path) -> dict[str, Any]:
    """Mean, std and interpolation from the directory's ``preprocessor_config.json``."""
    path = directory / HF_PREPROCESSOR
    if not path.is_file():
        return {}
    processor = _read_json(path)
    found: dict[str, Any] = {}
    for ours, theirs in (("mean", "image_mean"), ("std", "image_std")):
        value = processor.get(theirs)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, list) and value:
            found[ours] = [float(v) for v in value]
    resample = processor.get("resample")
    if isinstance(resample, int) and resample in _PIL_RESAMPLE:
        found["interpolation"] = _PIL_RESAMPLE[resample]
    return found


def load_hf_directory(spec: str, args: Mapping[str, Any]) -> tuple[HFImageClassifier, Path]:
    """The model saved in directory ``spec``, wrapped, and the weights file it was read from."""
    transformers = _transformers()
    directory = Path(spec).expanduser().resolve()
    config_json = _read_json(directory / HF_CONFIG)
    weights = weights_file(directory)
    if weights is None:
        raise ModelLoadError(
            f"HuggingFace directory {directory} holds no weights file ({' or '.join(HF_WEIGHTS)})"
            "; save it with model.save_pretrained(DIR)"
        )
    architectures = config_json.get("architectures") or []
    classifier = any(
        a.endswith(("ForImageClassification", "ForImageClassificationWithTeacher"))
        for a in architectures
        if isinstance(a, str)
    )
    video = any(a.endswith("ForVideoClassification") for a in architectures if isinstance(a, str))
    auto = (
        transformers.AutoModelForImageClassification
        if classifier
        else transformers.AutoModelForVideoClassification
        if video
        else transformers.AutoModel
    )
    # Its progress bar would interleave with the CLI's own output on stderr.
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    try:
        model, info = auto.from_pretrained(
            str(directory), local_files_only=True, output_loading_info=True, **dict(args)
        )
    except Exception as exc:  # transformers raises ValueError, OSError, KeyError, ...
        raise ModelLoadError(
            f"could not build the HuggingFace model in {directory} with {auto.__name__}: "
            f"{one_line(exc)}"
        ) from exc
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    # transformers starts weights the file lacks (or has in another shape) from random values,
    # with a warning only: such a base would be silently another model.
    missing = sorted(info.get("missing_keys") or []) + sorted(
        str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or []
    )
    if missing:
        shown = ", ".join(missing[:SHOW_KEYS]) + (", ..." if len(missing) > SHOW_KEYS else "")
        raise ModelLoadError(
            f"the weights in {directory} do not cover {type(model).__name__}: {len(missing)} "
            f"missing or mismatched ({shown}), which transformers would start from random values"
        )
    wrapped = HFImageClassifier(
        model, input_size=input_size_of(model.config), data_config=data_config_of(directory)
    )
    return wrapped.eval(), weights
