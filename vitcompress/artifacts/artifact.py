"""Compressed artifacts on disk: ``vitcompress.json`` (base model source + plan + fingerprint) and
``model.safetensors`` (the compressed model's weights).

Loading rebuilds the base model from its source, applies the plan to a fresh capture and loads
the weights, so no code or pickle is ever read from the artifact. That only gives back the saved
model if the source names every constructor argument that matters, so saving does the same
rebuild first and refuses when the rebuilt model differs; the fingerprint (``fingerprint.py``)
lets loading check that the base still builds the same model.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import nn

from vitcompress.analysis.analyse import MappingError
from vitcompress.analysis.capture import CaptureError
from vitcompress.artifacts.fingerprint import (
    SAVE_RTOL,
    Fingerprint,
    FingerprintError,
    eval_output,
    map_differences,
    map_summary,
    relative_difference,
    shape_differences,
    state_shapes,
)
from vitcompress.compilation.compression import capture_and_map, compress_mapped
from vitcompress.compilation.entries import FORWARD, EntryError, entry_of, entry_view
from vitcompress.compilation.metadata import attach, compression_info
from vitcompress.compilation.plan import Plan, PlanError
from vitcompress.compilation.rewrite import RewriteError
from vitcompress.data.config import artifact_data_config
from vitcompress.loading import (
    ARTIFACT_MARKER,
    LoadedModel,
    ModelLoadError,
    ModelSource,
    load_base_model,
    one_line,
)
from vitcompress.loading.shards import weights_sha256
from vitcompress.version import __version__

FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
ARTIFACT_FILES = frozenset({WEIGHTS_FILE, ARTIFACT_MARKER})  # all that an artifact writes
BASE_WEIGHTS_SHA256 = "base_weights_sha256"
FINGERPRINT_KEY = "fingerprint"

log = logging.getLogger(__name__)


class ArtifactError(ModelLoadError):
    """An artifact that cannot be written or read; one line for the user."""


def _infer_source(model: nn.Module) -> ModelSource | None:
    """A timm model records its architecture and the constructor arguments it shows."""
    cfg = getattr(model, "vitcompress_base_cfg", None)
    if cfg and cfg.get("architecture"):
        import timm

        if timm.is_model(cfg["architecture"]):
            return ModelSource(spec=cfg["architecture"], model_args=dict(cfg.get("model_args", {})))
    return None


def describe_source(source: ModelSource) -> str:
    """``'name' with a=1, b=(2, 2)``: what a rebuild is made from, for messages."""
    args = ", ".join(f"{key}={value!r}" for key, value in source.model_args.items())
    return f"'{source.spec}' with {args or 'no model arguments'}"


def _source_hint(source: ModelSource) -> str:
    return (
        f"pass the constructor arguments it was built with: save(model, dir, source="
        f"ModelSource({source.spec!r}, model_args={{...}})), or --model-arg KEY=VALUE on the "
        "command line"
    )


def _plan_words(error: PlanError) -> str:
    # The plan comes from the artifact, not from options the user passed now.
    return f"the plan's {error.parameter} {error.detail}" if error.parameter else str(error)


def _rebuild(
    source: ModelSource,
    size: tuple[int, ...],
    plan_json: dict[str, Any],
    recorded_map: dict[str, Any] | None,
    fail: Callable[[str], ArtifactError],
    entry: str = FORWARD,
) -> tuple[nn.Module, ModelSource]:
    """The compressed model (with fresh weights) that ``source`` and the plan build, and the
    base's source as loading resolved it; ``entry`` is the base's method compressed as the
    forward. ``fail(what differs)`` makes the error to raise."""
    try:
        base = load_base_model(source.spec, source.model_args, input_size=size)
        view = entry_view(base.model, entry)
        captured, model_map = capture_and_map(view, size)
    except (ModelLoadError, MappingError, CaptureError, EntryError) as e:
        raise fail(f"its base does not build: {e}") from e
    if recorded_map is not None:
        differences = map_differences(recorded_map, map_summary(model_map.to_json()))
        if differences:
            raise fail(f"model map: {'; '.join(differences)}")
    try:
        plan = Plan.from_json(plan_json)
        # A method's setting that replaced the keep ratios (ToMe's r) plans them again itself.
        keep = None if plan.method.keep_setting else plan.keep
        model = compress_mapped(
            view, captured, model_map, size, plan.method, keep, plan.locs, plan.policy
        )
    except PlanError as e:
        raise fail(
            f"its plan does not fit the rebuilt base ({len(model_map.blocks)} blocks): "
            f"{_plan_words(e)}"
        ) from e
    except (KeyError, TypeError, ValueError) as e:
        raise fail(f"its plan is malformed ({type(e).__name__}: {e})") from e
    except RewriteError as e:
        raise fail(f"its plan cannot be applied to the rebuilt base: {e}") from e
    if compression_info(model).plan != plan:
        raise fail("the plan made for the rebuilt base keeps other token counts")
    return model, base.source


def _dtype_differences(saved: nn.Module, rebuilt: nn.Module) -> list[str]:
    rebuilt_state = rebuilt.state_dict()
    return [
        f"{key} is {value.dtype} (a rebuilt model is {rebuilt_state[key].dtype}; convert "
        "with model.float() before saving)"
        for key, value in saved.state_dict().items()
        if key in rebuilt_state and value.dtype != rebuilt_state[key].dtype
    ][:1]


def _check_rebuilds(
    model: nn.Module,
    rebuilt: nn.Module,
    size: tuple[int, ...],
    directory: Path,
    fail: Callable[[str], ArtifactError],
) -> torch.Tensor:
    """Load ``model``'s weights into ``rebuilt`` and compare the two: state-dict keys, shapes
    and dtypes, then the eval output on the fingerprint's fixed input. Returns ``model``'s
    output, for the fingerprint."""
    problems = shape_differences(state_shapes(model), state_shapes(rebuilt))
    problems = problems or _dtype_differences(model, rebuilt)
    if problems:
        raise fail("; ".join(problems))
    try:
        saved_output = eval_output(model, size)
    except FingerprintError as e:
        raise ArtifactError(f"cannot save {directory}: {e}") from e
    except Exception as e:  # noqa: BLE001 - the model's own forward, whatever it raises
        raise ArtifactError(
            f"cannot save {directory}: the model does not run on a fixed input "
            f"of size {','.join(map(str, size))}: {one_line(e)}"
        ) from e
    rebuilt.load_state_dict({k: v.detach().cpu() for k, v in model.state_dict().items()})
    rebuilt_output = eval_output(rebuilt, size)
    if saved_output.shape != rebuilt_output.shape:
        raise fail(f"output has {rebuilt_output.numel()} values, {saved_output.numel()} saved")
    difference = relative_difference(rebuilt_output, saved_output)
    if difference > SAVE_RTOL:
        largest = float((rebuilt_output - saved_output).abs().max())
        raise fail(f"eval output on a fixed input differs (max abs difference {largest:.3g})")
    return saved_output


def save_artifact(
    model: nn.Module,
    directory: str | Path,
    source: ModelSource | str | None = None,
    input_size: tuple[int, ...] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``model`` (a result of ``compress``) to ``directory``, replacing it atomically: the
    new artifact is written beside it and renamed into place, so a failure leaves the old one.

    The base is first rebuilt from ``source`` (default: the source ``load_model`` recorded, else
    the timm architecture with the constructor arguments the model shows), the plan applied and
    the weights loaded; a model that differs from ``model`` is refused before anything is written.
    """
    try:
        info = compression_info(model)
    except ModelLoadError as e:
        raise ArtifactError(f"cannot save {directory}: {e}") from e
    if info is None:
        raise ArtifactError("only a model returned by vitcompress.compress can be saved")
    plan, model_map = info.plan.to_json(), info.model_map.to_json()
    if isinstance(source, str):
        source = ModelSource(spec=source)
    source = source or info.source or _infer_source(model)
    if source is None:
        raise ArtifactError(
            "cannot tell how to rebuild the base model; pass source='timm_name' or "
            "'path/to/file.py:factory' to save()"
        )
    size = input_size or info.input_size
    if size is None:
        raise ArtifactError("cannot tell the model's input size; pass input_size=(C, H, W)")
    size = tuple(int(v) for v in size)
    # Resolved: "." or ".." have no name to stage beside, and the staging folder must be a
    # sibling of the artifact, not of the working directory.
    directory = Path(directory).expanduser().resolve()
    if not directory.name:
        raise ArtifactError(f"cannot save an artifact as {directory}: name a folder inside it")

    def refuse(what_differs: str) -> ArtifactError:
        return ArtifactError(
            f"cannot save {directory}: the model rebuilt from "
            f"{describe_source(source)} differs from the one being saved: "
            f"{what_differs}; {_source_hint(source)}"
        )

    entry = entry_of(model)
    rebuilt, resolved = _rebuild(source, size, plan, map_summary(model_map), refuse, entry)
    output = _check_rebuilds(model, rebuilt, size, directory, refuse)
    fingerprint = Fingerprint.of(model, model_map, size, output)
    meta = {
        "format": FORMAT_VERSION,
        "vitcompress_version": __version__,
        # The spec as loading resolved it (a factory file's absolute path).
        "source": {
            **source.to_json(),
            "spec": resolved.spec,
            "checkpoint": None,
            "pretrained": False,
        },
        "base_weights": _base_weights_name(source),
        # A checkpoint overwritten after the save would silently give another base (eval --base
        # source, apply --model ARTIFACT, the fine-tuning teacher): its content is checked.
        BASE_WEIGHTS_SHA256: _base_weights_digest(source),
        "input_size": list(size),
        # The base's method compressed as the forward ("forward_features"); "forward" if absent.
        "entry": entry,
        "plan": plan,
        FINGERPRINT_KEY: fingerprint.to_json(),
        # The preprocessing the model expects (docs/data.md); extra may name another.
        "data_config": getattr(model, "vitcompress_data_config", None),
        **(extra or {}),
    }
    _write_in_place(model, meta, directory)
    return directory


def _base_weights_name(source: ModelSource) -> str | None:
    """The base weights as the artifact names them: the checkpoint's absolute path (the artifact
    is read from other working directories: eval, finetune), timm's pretrained ones, or none."""
    if source.checkpoint:
        return str(Path(source.checkpoint).expanduser().resolve())
    return "timm pretrained" if source.pretrained else None


def _write_in_place(model: nn.Module, meta: dict[str, Any], directory: Path) -> None:
    """The weights and the metadata written into a staging folder beside ``directory``, then
    swapped into its place: a failure leaves what was there."""
    staging: Path | None = None
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = _make_staging_directory(directory)
        safetensors.torch.save_model(model, str(staging / WEIGHTS_FILE))
        with open(staging / ARTIFACT_MARKER, "w") as f:
            json.dump(meta, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _follow_umask(staging / WEIGHTS_FILE, staging / ARTIFACT_MARKER)
        _swap_into_place(staging, directory)
    except OSError as e:
        raise ArtifactError(f"could not write {directory}: {e.strerror or e}") from e
    finally:  # after a failure or Ctrl-C, nothing half-written is left beside the artifact
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _make_staging_directory(directory: Path) -> Path:
    """A new hidden folder beside ``directory``. Made with ``os.mkdir``, not ``mkdtemp``, so that
    it (and so the artifact) gets the permissions the umask gives, not 0700."""
    for _ in range(100):
        staging = directory.with_name(f".{directory.name}.{secrets.token_hex(4)}")
        try:
            staging.mkdir()
        except FileExistsError:
            continue
        return staging
    raise FileExistsError(f"no free staging name beside {directory}")


def current_umask() -> int:
    """The process's umask, read without changing it where the system allows."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere the only way to read it is to set it
    os.umask(mask)
    return mask


def _follow_umask(*files: Path) -> None:
    """Give ``files`` the mode a plain ``open()`` would: safetensors writes its files 0600."""
    mode = 0o666 & ~current_umask()
    for path in files:
        os.chmod(path, mode)


def check_replaceable(directory: str | Path) -> None:
    """Refuse, in one line, a ``directory`` that saving an artifact would lose anything of: one
    that holds more than a compressed model's own files (a fine-tune's checkpoints and metrics,
    a user's notes), or is not a compressed model at all. Absent or empty is fine."""
    directory = Path(directory)
    if not directory.is_dir():
        return
    present = sorted(entry.name for entry in directory.iterdir())
    if not present:
        return
    if ARTIFACT_MARKER not in present:
        raise ArtifactError(f"{directory} exists and is not a compressed model; not overwriting it")
    others = [name for name in present if name not in ARTIFACT_FILES]
    if others:
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        raise ArtifactError(
            f"{directory} holds more than a compressed model ({shown}); not overwriting it: "
            "save into another folder"
        )


def _swap_into_place(staging: Path, directory: Path) -> None:
    """Rename ``staging`` to ``directory``; an artifact already there is moved aside first and
    moved back if the second rename fails, so ``directory`` always holds a complete artifact."""
    if not directory.exists():
        os.replace(staging, directory)
        return
    check_replaceable(directory)
    old = directory.with_name(f".{directory.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(directory, old)
    try:
        os.replace(staging, directory)
    except BaseException:
        try:
            os.rename(old, directory)
        except OSError as e:
            raise ArtifactError(
                f"could not write {directory}; the previous artifact is kept "
                f"in {old}: {e.strerror or e}"
            ) from e
        raise
    shutil.rmtree(old, ignore_errors=True)


def read_meta(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / ARTIFACT_MARKER
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ArtifactError(f"cannot read {path}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or "plan" not in meta:
        raise ArtifactError(f"{path} is not a vitcompress artifact of format {FORMAT_VERSION}")
    size = meta.get("input_size")
    if not isinstance(meta.get("source"), dict) or not isinstance(meta["source"].get("spec"), str):
        raise ArtifactError(f"{path} is malformed: its source is not an object with a spec")
    if not (
        isinstance(size, list)
        and 3 <= len(size) <= 8  # [C, H, W], or a video model's [C, T, H, W]
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)
    ):
        raise ArtifactError(
            f"{path} is malformed: input_size is not [C, H, W] (or a video's [C, T, H, W]), "
            f"got {size!r}"
        )
    return meta


def base_source(meta: dict[str, Any]) -> ModelSource:
    """The artifact's base model as it was given: spec and model arguments from ``source``,
    weights from ``base_weights`` (a checkpoint path, "timm pretrained", or None)."""
    source = ModelSource.from_json(meta["source"])
    weights = meta.get("base_weights")
    if weights is not None and not isinstance(weights, str):
        raise ArtifactError(f"malformed base_weights in {ARTIFACT_MARKER}: {weights!r}")
    pretrained = weights == "timm pretrained"
    return replace(source, checkpoint=None if pretrained else weights, pretrained=pretrained)


def _base_weights_digest(source: ModelSource) -> str | None:
    if not source.checkpoint:
        return None
    path = Path(source.checkpoint).expanduser()
    return _checkpoint_sha256(path) if path.is_file() else None


def _checkpoint_sha256(path: Path) -> str:
    try:
        return file_sha256(path)
    except OSError as e:
        raise ArtifactError(f"cannot read the base weights {path}: {e.strerror or e}") from e


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a weights file's bytes, read in chunks (weights files can be gigabytes);
    of a shard index, of it and every shard it names (a shard rewritten later changes it)."""
    return weights_sha256(Path(path))


def base_weights_problem(source: ModelSource, meta: dict[str, Any] | None = None) -> str | None:
    """Why rebuilding ``source`` (from ``base_source``) cannot give the trained base, or None.

    With the artifact's ``meta``, a checkpoint whose content changed since the save is a problem
    too (artifacts written before the digest was recorded are not checked)."""
    if source.pretrained:
        return None
    if source.checkpoint is None:
        return (
            "the artifact records no base weights (it was saved without --checkpoint or "
            "--pretrained)"
        )
    path = Path(source.checkpoint)
    if not path.is_file():
        return f"the base weights {source.checkpoint} named by the artifact are not there"
    expected = (meta or {}).get(BASE_WEIGHTS_SHA256)
    if expected is not None and _checkpoint_sha256(path) != expected:
        return (
            f"the base weights {source.checkpoint} changed since the artifact was saved "
            "(their sha256 differs)"
        )
    return None


def recorded_entry(meta: dict[str, Any], directory: str | Path) -> str:
    """The base's method the artifact compressed (its ``entry``), checked."""
    entry = meta.get("entry", FORWARD)
    if not isinstance(entry, str) or not entry.isidentifier():
        raise ArtifactError(f"{directory} is malformed: its entry is not a method name: {entry!r}")
    return entry


def _weights_file_shapes(path: Path) -> dict[str, list[int]]:
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            return {key: list(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for bad files
        raise ArtifactError(f"cannot read weights {path}: {str(e).splitlines()[0]}") from e


def _read_fingerprint(meta: dict[str, Any], directory: str | Path) -> Fingerprint | None:
    """The artifact's fingerprint; ``None`` (with a warning) for one written before artifacts
    carried it; one line for a malformed one."""
    if FINGERPRINT_KEY not in meta:
        log.warning(
            "%s was written before artifacts carried a fingerprint, so the rebuilt "
            "model cannot be verified against the saved one; save it again to add one",
            directory,
        )
        return None
    try:
        return Fingerprint.from_json(meta[FINGERPRINT_KEY])
    except FingerprintError as e:
        raise ArtifactError(f"{directory}: {e}") from e


def _load_weights(model: nn.Module, weights: Path, rebuilt_shapes: dict[str, list[int]]) -> None:
    """The weights file loaded into the rebuilt model, refused in one line where it cannot be
    read or its tensors do not fit (checked by shape before loading)."""
    # Shared tensors are stored once, so the file may name fewer keys than the state dict.
    file_shapes = _weights_file_shapes(weights)
    problems = shape_differences(
        file_shapes, {k: v for k, v in rebuilt_shapes.items() if k in file_shapes}
    )
    if problems:
        raise ArtifactError(
            f"weights in {weights} do not fit the rebuilt model: {'; '.join(problems)}"
        )
    try:
        missing, unexpected = safetensors.torch.load_model(model, str(weights), strict=False)
    except Exception as e:  # noqa: BLE001 - safetensors raises several types for bad files
        raise ArtifactError(f"cannot read weights {weights}: {str(e).splitlines()[0]}") from e
    if missing or unexpected:
        raise ArtifactError(
            f"weights in {weights} do not fit the rebuilt model: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}"
        )


def load_artifact(directory: str | Path) -> LoadedModel:
    """Rebuild the compressed model saved in ``directory`` and check it against the artifact's
    fingerprint (model map, state-dict shapes, eval output on a fixed input)."""
    meta = read_meta(directory)
    # The returned source names the base weights, so an artifact saved again from this model
    # (finetune --model DIR) still records them. The compressed model does not need them to
    # load, so a malformed record only loses that.
    try:
        source = base_source(meta)
    except ArtifactError:
        source = ModelSource.from_json(meta["source"])
    size = tuple(meta["input_size"])
    fingerprint = _read_fingerprint(meta, directory)

    def refuse(what_differs: str) -> ArtifactError:
        return ArtifactError(
            f"{directory} does not rebuild the model that was saved: the model "
            f"rebuilt from {describe_source(source)} differs: {what_differs}"
        )

    model, _ = _rebuild(
        replace(source, checkpoint=None, pretrained=False),
        size,
        meta["plan"],
        fingerprint.model_map if fingerprint else None,
        refuse,
        recorded_entry(meta, directory),
    )
    weights = Path(directory) / WEIGHTS_FILE
    rebuilt_shapes = state_shapes(model)
    if fingerprint is not None:
        problems = shape_differences(fingerprint.state_dict, rebuilt_shapes)
        if problems:
            raise refuse("; ".join(problems))
    _load_weights(model, weights, rebuilt_shapes)
    if fingerprint is not None:
        try:
            difference = fingerprint.output_difference(model, size)
        except FingerprintError as e:
            raise refuse(str(e)) from e
        if difference is not None:
            raise refuse(difference)
    model.eval()
    data_config, data_config_from = artifact_data_config(meta, model, str(directory))
    attach(
        model,
        vitcompress_artifact=str(Path(directory).resolve()),
        vitcompress_source=source,
        vitcompress_data_config=data_config or None,
        vitcompress_data_config_from=data_config_from or None,
    )
    return LoadedModel(model=model, source=source, input_size=size)
