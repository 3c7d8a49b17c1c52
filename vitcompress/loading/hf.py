"""HuggingFace ``transformers`` models: a local ``save_pretrained`` directory as ``--model DIR``.

The directory holds a ``config.json`` (and the weights): the model is built with its Auto class,
``AutoModelForImageClassification`` where the config names an image-classification architecture,
``AutoModelForVideoClassification`` for a video one (VideoMAE), else ``AutoModel``, offline
(``local_files_only=True``) with the directory's weights: one file, or shards named by an index
(``model.safetensors.index.json``, ``pytorch_model.bin.index.json``), each shard checked to hold
exactly the weights the index maps to it (``vitcompress.loading.shards``). It is wrapped in
:class:`HFImageClassifier` so that images go in and logits (or a backbone's pooled features) come
out, as the rest of the tool expects.

What the wrapper states: its input size from the config's ``image_size`` and ``num_channels``
(and ``num_frames`` for a video model, whose ``pixel_values`` are (B, T, C, H, W)), and its preprocessing (mean, std, interpolation) from a ``preprocessor_config.json`` in the
directory when there is one (HF keeps the image processor in a separate file); the data config's
precedence (``vitcompress.data.config``) does the rest.

``transformers`` is an optional extra: ``pip install 'vitcompress[hf]'``.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitcompress.loading.checkpoint import read_state_dict, strip_wrapper_prefixes
from vitcompress.loading.errors import SHOW_KEYS, ModelLoadError, one_line
from vitcompress.loading.shards import check_shards, is_index, read_sharded
from vitcompress.status import warn

HF_CONFIG = "config.json"
HF_PREPROCESSOR = "preprocessor_config.json"
# Weights files save_pretrained writes, in the order transformers prefers them: a single file,
# or an index naming the shards of a model saved in several (``max_shard_size``).
HF_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
_BIN_WEIGHTS = "pytorch_model.bin"  # how another weights file is handed to transformers
# from_pretrained arguments that would make it read other weights than the file named above,
# which the source records (and an artifact checks) as the model's weights.
_WEIGHTS_ARGS = ("use_safetensors", "variant", "subfolder", "gguf_file", "state_dict")
# PIL's resampling codes, as preprocessor configs write them ("resample": 3).
_PIL_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def is_hf_directory(spec: str) -> bool:
    """True if ``spec`` is a directory holding a HuggingFace ``config.json``."""
    return Path(spec).expanduser().joinpath(HF_CONFIG).is_file()


class HFImageClassifier(nn.Module):
    """A transformers vision model as an image classifier: ``forward(images) -> logits``.

    Image-classification models return an output object: its ``logits`` are taken. A backbone
    (``AutoModel``) gives its ``pooler_output``. ``forward_features`` gives either's tokens.
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

    def forward_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The backbone's ``last_hidden_state`` (its tokens; a classifier's without its head):
        what ``--entry forward_features`` compresses, a dense output."""
        return self.model.base_model(pixel_values=pixel_values).last_hidden_state


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
    """The weights ``save_pretrained`` wrote into ``directory``, if any, as transformers picks
    them: the single file, or the index of the shards."""
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
    """Mean, std, interpolation and the resize and crop (``crop_pct``, ``crop_mode``) from the
    directory's ``preprocessor_config.json``."""
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
    if processor.get("do_normalize") is False:  # pixels in [0, 1], whatever the stats say
        found["mean"], found["std"] = [0.0], [1.0]
    resample = processor.get("resample")
    if isinstance(resample, int) and resample in _PIL_RESAMPLE:
        found["interpolation"] = _PIL_RESAMPLE[resample]
    return {**found, **_crop_of(processor)}


def _side(value: Any, *keys: str) -> tuple[int, ...] | None:
    """The sizes under ``keys`` of a processor's size dict, when it holds exactly those."""
    if not isinstance(value, dict) or set(value) != set(keys):
        return None
    sides = tuple(value[k] for k in keys)
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sides)
    return sides if ok else None


def _crop_pct(crop: int, resized: int) -> float:
    """timm's ``crop_pct`` for a crop of ``crop`` pixels out of an image resized to
    ``resized``: timm resizes to ``floor(crop / crop_pct)``, which must come out as ``resized``
    (``crop / resized`` itself can fall a float's width short of it)."""
    pct = crop / resized
    while math.floor(crop / pct) < resized:
        pct = math.nextafter(pct, 0.0)
    return pct


def _crop_of(processor: Mapping[str, Any]) -> dict[str, Any]:
    """The resize and crop an image processor applies, as timm's ``crop_pct`` and ``crop_mode``
    ("squash": resized to a fixed height and width, as ViT's processor does; "center": the
    shorter side resized, keeping the aspect ratio, then a centre crop). Nothing where the
    config writes another pipeline (or an older form of one): the defaults then apply."""
    if processor.get("do_resize") is False:
        return {}
    size = processor.get("size")
    centre_crop = processor.get("do_center_crop") is True
    crop = _side(processor.get("crop_size"), "height", "width") if centre_crop else None
    fixed = _side(size, "height", "width")
    if fixed is not None:
        if crop is None:
            return {} if centre_crop else {"crop_pct": 1.0, "crop_mode": "squash"}
        if crop[0] * fixed[1] != crop[1] * fixed[0]:
            return {}
        return {"crop_pct": _crop_pct(crop[0], fixed[0]), "crop_mode": "squash"}
    shortest = _side(size, "shortest_edge")
    if shortest is None:
        return {}
    (side,) = shortest
    kind = str(processor.get("image_processor_type") or "")
    if kind.startswith("ConvNextImageProcessor") and not centre_crop:
        # ConvNeXt's (and CvT's): below 384 px the shorter side is resized to side / crop_pct
        # and the centre cropped to side; from 384 px up the image is resized to side x side.
        pct = processor.get("crop_pct")
        if side >= 384:
            return {"crop_pct": 1.0, "crop_mode": "squash"}
        if isinstance(pct, (int, float)) and not isinstance(pct, bool) and 0 < pct <= 1:
            return {"crop_pct": _crop_pct(side, int(side / pct)), "crop_mode": "center"}
        return {}
    if crop is not None and crop[0] == crop[1] and crop[0] <= side:
        return {"crop_pct": _crop_pct(crop[0], side), "crop_mode": "center"}
    return {}


def load_hf_directory(
    spec: str, args: Mapping[str, Any], checkpoint: Path | None = None
) -> tuple[HFImageClassifier, Path]:
    """The model saved in directory ``spec``, wrapped, and the weights file it was read from:
    the directory's own (a sharded directory's index), or ``checkpoint`` (any weights file of
    the same architecture, or a shard index, read as ``--checkpoint`` files are and handed to
    transformers, which renames the keys of older layouts as it does for the directory's own
    file)."""
    transformers = _transformers()
    chosen = [k for k in _WEIGHTS_ARGS if k in args]
    if chosen:
        raise ModelLoadError(
            f"--model-arg {chosen[0]}: a HuggingFace directory is built with the weights "
            f"transformers picks by default ({', '.join(HF_WEIGHTS)}), which its source "
            "records; give other weights with --checkpoint FILE"
        )
    directory = Path(spec).expanduser().resolve()
    config_json = _read_json(directory / HF_CONFIG)
    weights = checkpoint if checkpoint is not None else weights_file(directory)
    if weights is None:
        raise ModelLoadError(
            f"HuggingFace directory {directory} holds no weights file "
            f"({', '.join(HF_WEIGHTS[:-1])} or {HF_WEIGHTS[-1]}); save it with "
            "model.save_pretrained(DIR)"
        )
    architectures = [a for a in config_json.get("architectures") or [] if isinstance(a, str)]
    classifier = any(
        a.endswith(("ForImageClassification", "ForImageClassificationWithTeacher"))
        for a in architectures
    )
    video = any(a.endswith("ForVideoClassification") for a in architectures)
    labels = [k for k in ("num_labels", "id2label", "label2id") if k in args]
    if labels and not (classifier or video):
        # transformers takes any config key; on a model without a head it changes nothing.
        raise ModelLoadError(
            f"--model-arg {labels[0]}: {directory} holds {', '.join(architectures) or 'a model'}"
            " without a classification head, which has no labels to set; save a "
            "...ForImageClassification model there to give it one"
        )
    auto = (
        transformers.AutoModelForImageClassification
        if classifier
        else transformers.AutoModelForVideoClassification
        if video
        else transformers.AutoModel
    )
    if checkpoint is None:
        if is_index(weights):
            # Every shard holds exactly the weights the index maps to it; transformers then
            # reads them as it reads a single file, and the same checks apply to what it loaded.
            check_shards(weights)
        model = _from_pretrained(transformers, auto, directory, args, directory)
    else:
        read = read_sharded if is_index(checkpoint) else read_state_dict
        state = strip_wrapper_prefixes(read(checkpoint))
        with tempfile.TemporaryDirectory(prefix="vitcompress-hf-") as tmp:
            shutil.copyfile(directory / HF_CONFIG, Path(tmp) / HF_CONFIG)
            torch.save(state, Path(tmp) / _BIN_WEIGHTS)
            model = _from_pretrained(transformers, auto, Path(tmp), args, checkpoint)
    wrapped = HFImageClassifier(
        model, input_size=input_size_of(model.config), data_config=data_config_of(directory)
    )
    return wrapped.eval(), weights


def _from_pretrained(
    transformers: Any, auto: Any, directory: Path, args: Mapping[str, Any], shown: Path
) -> nn.Module:
    """``auto.from_pretrained(directory)`` offline, refusing in one line weights that do not fit
    the model exactly (``shown`` names them). transformers' own load report (a table of
    several lines) and progress bar are kept off: the refusal says what they would."""
    logging = transformers.utils.logging
    bars = logging.is_progress_bar_enabled()
    verbosity = logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        # Mismatched shapes are reported back (and refused below, naming them) instead of
        # raised with a pointer to the report.
        kwargs = {**dict(args), "ignore_mismatched_sizes": True}
        model, info = auto.from_pretrained(
            str(directory), local_files_only=True, output_loading_info=True, **kwargs
        )
    except Exception as exc:  # transformers raises ValueError, OSError, KeyError, ...
        raise ModelLoadError(
            f"could not build the HuggingFace model in {shown} with {auto.__name__}: "
            f"{one_line(exc)}"
        ) from exc
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    # transformers starts weights the file lacks (or has in another shape) from random values,
    # and skips weights the model lacks, with a warning only: such a base would silently be
    # another model.
    missing = sorted(info.get("missing_keys") or []) + sorted(
        _mismatch(k) for k in info.get("mismatched_keys") or []
    )
    unexpected, unused = _unexpected(model, sorted(info.get("unexpected_keys") or []))
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} missing or mismatched ({_first(missing)}), which transformers "
            "would start from random values"
        )
    if unexpected:
        problems.append(
            f"{len(unexpected)} unexpected ({_first(unexpected)}), which the model has no place for"
        )
    if problems:
        raise ModelLoadError(
            f"the weights in {shown} do not fit {type(model).__name__}: {'; '.join(problems)}"
        )
    if unused:
        warn(
            f"{len(unused)} weights in {shown} belong to no module of {type(model).__name__} "
            f"and are not used ({_first(unused)}); the model computes what its config says"
        )
    return model


def _unexpected(model: nn.Module, keys: list[str]) -> tuple[list[str], list[str]]:
    """``keys`` the model has no place for, split into those that change what it computes and
    those it merely does not use. A weight of a module the model has (a bias its config turned
    off) or of a layer past the end of one of its layer lists (a config with fewer layers than
    its weights) means the config describes another model than the weights; a weight of a whole
    part the model does not build (a pooler a classifier has no use for, as hub checkpoints of
    ViT carry) does not."""
    modules = dict(model.named_modules())
    changing, unused = [], []
    for key in keys:
        path = key.split(".")[:-1]
        known = max(i for i in range(len(path) + 1) if ".".join(path[:i]) in modules)
        parent = modules[".".join(path[:known])]
        past_a_list = (
            known < len(path)
            and path[known].isdigit()
            and isinstance(parent, (nn.ModuleList, nn.Sequential))
        )
        (changing if known == len(path) or past_a_list else unused).append(key)
    return changing, unused


def _mismatch(key: Any) -> str:
    """A mismatched key as transformers reports it: the name, or (name, shape, shape)."""
    if isinstance(key, tuple) and len(key) == 3:
        return f"{key[0]} (checkpoint {list(key[1])} vs model {list(key[2])})"
    return str(key[0] if isinstance(key, tuple) else key)


def _first(keys: list[str]) -> str:
    return ", ".join(keys[:SHOW_KEYS]) + (", ..." if len(keys) > SHOW_KEYS else "")
