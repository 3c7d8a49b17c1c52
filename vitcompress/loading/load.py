"""``load_base_model``: build the base model a spec names, load its weights, check its input size."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from vitcompress.loading.checkpoint import load_checkpoint
from vitcompress.loading.errors import ModelLoadError
from vitcompress.loading.hf import HF_CONFIG, is_hf_directory, load_hf_directory, weights_file
from vitcompress.loading.input_size import check_runs, checked_input_size, default_input_size
from vitcompress.loading.source import LoadedModel, ModelSource
from vitcompress.loading.spec import (
    ARTIFACT_MARKER,
    call_factory,
    import_file,
    import_module,
    is_artifact_directory,
    parse_spec,
)
from vitcompress.loading.timm_hub import create_timm


def load_base_model(
    spec: str,
    model_args: Mapping[str, Any] | None = None,
    checkpoint: str | Path | None = None,
    pretrained: bool = False,
    input_size: Sequence[int] | None = None,
) -> LoadedModel:
    """Build the model named by ``spec``, load its weights, and return it in eval mode."""
    if not spec or not spec.strip():
        raise ModelLoadError("no model given")
    args = dict(model_args or {})
    size = checked_input_size(input_size)

    if is_artifact_directory(spec):
        # Which loader a spec needs is decided above this package (vitcompress.api), which
        # builds on it; loading itself only builds base models.
        raise ModelLoadError(
            f"'{spec}' is a compressed model; load it with vitcompress.api.load_model or "
            "vitcompress.load"
        )
    if os.path.isdir(spec) and is_hf_directory(spec):
        return _load_hf(spec, args, checkpoint, pretrained, size, input_size is not None)
    if os.path.isdir(spec) and (os.sep in spec or "/" in spec or spec.startswith(".")):
        # Only for something written as a path: a bare word may be a timm name that happens to
        # match an output folder in the working directory.
        raise ModelLoadError(
            f"'{spec}' is a directory without {ARTIFACT_MARKER} (a compressed model) or "
            f"{HF_CONFIG} (a HuggingFace model); for a model file write path/to/file.py:factory"
        )

    # Check the checkpoint before building: building a large model takes a while.
    ckpt_path: Path | None = None
    if checkpoint is not None:
        ckpt_path = Path(checkpoint).expanduser()
        if not ckpt_path.is_file():
            raise ModelLoadError(f"checkpoint {checkpoint} not found")

    kind, target, attr = parse_spec(spec)
    if pretrained and kind != "timm":
        raise ModelLoadError(
            f"--pretrained only applies to timm model names, not '{spec}'; "
            "use --checkpoint FILE to load weights"
        )
    if kind == "file":
        path = Path(target).expanduser().resolve()
        model = call_factory(import_file(path, spec), attr, args, spec, folder=path.parent)
        # Recorded absolute so that the source still resolves from another working directory.
        recorded_spec = f"{path}:{attr}"
    elif kind == "module":
        model = call_factory(import_module(target, spec), attr, args, spec, folder=None)
        recorded_spec = spec
    else:
        model = create_timm(target, args, pretrained)
        recorded_spec = spec

    if ckpt_path is not None:
        load_checkpoint(model, ckpt_path, model_name=spec)

    if size is None:
        size = default_input_size(model)
    if size is None:
        raise ModelLoadError(
            f"cannot tell the input size of '{spec}'; pass --input-size C,H,W (e.g. 3,224,224) "
            "or give the model a default_input_size attribute"
        )

    model.eval()
    check_runs(model, size, spec, given=input_size is not None)
    source = ModelSource(
        spec=recorded_spec,
        model_args=args,
        checkpoint=str(ckpt_path.resolve()) if ckpt_path is not None else None,
        pretrained=pretrained,
    )
    return LoadedModel(model=model, source=source, input_size=size)


def _load_hf(
    spec: str,
    args: dict[str, Any],
    checkpoint: str | Path | None,
    pretrained: bool,
    size: tuple[int, ...] | None,
    size_given: bool,
) -> LoadedModel:
    """A HuggingFace ``save_pretrained`` directory. The source records the directory and, as
    its checkpoint, the weights file read (or the one given): an artifact made from it records
    that file's sha256, so weights changed later are caught when its base is rebuilt."""
    if pretrained:
        raise ModelLoadError(
            f"--pretrained only applies to timm model names, not the directory '{spec}' "
            "(its weights are loaded from it)"
        )
    other: Path | None = None
    if checkpoint is not None:
        other = Path(checkpoint).expanduser()
        if not other.is_file():
            raise ModelLoadError(f"checkpoint {checkpoint} not found")
        own = weights_file(Path(spec).expanduser().resolve())
        if own is not None and other.resolve() == own.resolve():
            other = None  # the directory's own file (what an artifact's base records)
    # Another weights file is handed to transformers like the directory's own: it renames the
    # keys of the layout save_pretrained writes to the model's (transformers 5 renames ViT's).
    model, weights = load_hf_directory(spec, args, other)
    size = size or default_input_size(model)
    if size is None:
        raise ModelLoadError(f"cannot tell the input size of '{spec}'; pass --input-size C,H,W")
    check_runs(model, size, spec, given=size_given)
    directory = str(Path(spec).expanduser().resolve())
    source = ModelSource(
        spec=directory, model_args=args, checkpoint=str(weights.resolve()), pretrained=False
    )
    return LoadedModel(model=model, source=source, input_size=size)
