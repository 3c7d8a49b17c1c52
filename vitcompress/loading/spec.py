"""What a ``--model SPEC`` names, and importing the user's file or module to call its factory."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import itertools
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import nn

from vitcompress.loading.errors import ModelLoadError, one_line
from vitcompress.loading.timm_hub import TIMM_SOURCES

# The file that marks a directory as a compressed model (written by vitcompress.artifacts.artifact).
ARTIFACT_MARKER = "vitcompress.json"
_CHECKPOINT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors", ".tar")

_user_module_ids = itertools.count()


def is_artifact_directory(spec: str | os.PathLike[str]) -> bool:
    """True if ``spec`` is a directory holding a compressed model (its ``vitcompress.json``)."""
    return os.path.isfile(os.path.join(spec, ARTIFACT_MARKER))


def parse_spec(spec: str) -> tuple[str, str, str]:
    """Split a spec into (kind, target, factory) with kind "file", "module" or "timm"."""
    head, sep, _ = spec.partition(":")
    if sep and head.lower() in TIMM_SOURCES:
        return "timm", spec, ""
    # rpartition: the factory never contains ':' but a Windows path ("C:\\...") does.
    target, sep, attr = spec.rpartition(":")
    if not sep:
        if spec.endswith(".py"):
            raise ModelLoadError(f"'{spec}' names a file but no factory; write {spec}:FUNCTION")
        if spec.endswith(_CHECKPOINT_SUFFIXES) and os.path.isfile(spec):
            raise ModelLoadError(
                f"'{spec}' is a weights file; name the architecture with --model and pass the "
                "file with --checkpoint"
            )
        if os.path.isfile(spec):
            raise ModelLoadError(
                f"'{spec}' is a file but not a model: --model takes a timm name, "
                "path/to/file.py:factory, package.module:factory, a HuggingFace save_pretrained "
                "directory or a compressed model directory"
            )
        return "timm", spec, ""
    if not attr or not all(part.isidentifier() for part in attr.split(".")):
        raise ModelLoadError(f"model spec '{spec}': '{attr}' is not a factory name")
    if target.endswith(".py") or "/" in target or os.sep in target or os.path.isfile(target):
        return "file", target, attr
    if all(part.isidentifier() for part in target.split(".")):
        return "module", target, attr
    raise ModelLoadError(
        f"cannot read model spec '{spec}': expected a timm model name, path/to/file.py:factory, "
        "package.module:factory or a compressed model directory"
    )


@contextlib.contextmanager
def _on_sys_path(folder: str, *, first: bool) -> Iterator[None]:
    """Make ``folder`` importable for the duration of the block only."""
    if first:
        sys.path.insert(0, folder)
    else:
        sys.path.append(folder)
    try:
        yield
    finally:
        # Remove our own entry only: the same folder may legitimately be on sys.path already.
        index = 0 if first else len(sys.path) - 1
        if sys.path and sys.path[index] == folder:
            del sys.path[index]
        elif folder in sys.path:
            sys.path.remove(folder)


def import_file(path: Path, spec: str) -> ModuleType:
    if not path.is_file():
        raise ModelLoadError(f"model file {path} not found (from '{spec}')")
    # A fresh, unique name: two user files called model.py must not overwrite each other, and the
    # user's module must never shadow a real package in sys.modules.
    stem = re.sub(r"\W", "_", path.stem)
    name = f"_vitcompress_user_{next(_user_module_ids)}_{stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ModelLoadError(f"cannot import {path} as Python source")
    module = importlib.util.module_from_spec(module_spec)
    # Registered because dataclasses, typing and pickling look classes up by module name.
    sys.modules[name] = module
    try:
        # The file's folder is on the path while it runs so it can import the modules beside it.
        with _on_sys_path(str(path.parent), first=True):
            module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ModelLoadError(f"could not import {path}: {one_line(exc)}") from exc
    return module


def import_module(name: str, spec: str) -> ModuleType:
    try:
        # Like ``python -m``, let a module in the working directory be found even when running
        # from an installed console script (whose sys.path lacks the working directory). Appended,
        # so that it never shadows an installed package.
        with _on_sys_path(os.getcwd(), first=False):
            return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise ModelLoadError(
                f"no module named '{exc.name}' (from '{spec}'); to load a file, write "
                "path/to/file.py:factory"
            ) from exc
        raise ModelLoadError(f"could not import module '{name}': {one_line(exc)}") from exc
    except Exception as exc:
        raise ModelLoadError(f"could not import module '{name}': {one_line(exc)}") from exc


def call_factory(
    module: ModuleType, attr: str, args: dict[str, Any], spec: str, folder: Path | None
) -> nn.Module:
    factory: Any = module
    for part in attr.split("."):
        try:
            factory = getattr(factory, part)
        except AttributeError:
            hint = _defined_callables(module)
            defined = f"; it defines: {', '.join(hint)}" if hint else ""
            raise ModelLoadError(f"'{spec}': no attribute '{attr}'{defined}") from None
    if not callable(factory):
        raise ModelLoadError(f"'{spec}' is a {type(factory).__name__}, not a callable factory")

    paths = (
        _on_sys_path(str(folder), first=True) if folder is not None else contextlib.nullcontext()
    )
    try:
        with paths, _quiet_nested_tensor_notice():  # a factory may import sibling modules lazily
            model = factory(**args)
    except Exception as exc:
        raise ModelLoadError(f"factory '{spec}' failed: {one_line(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise ModelLoadError(
            f"factory '{spec}' returned {type(model).__module__}.{type(model).__qualname__}, "
            "not a torch.nn.Module"
        )
    return model


@contextlib.contextmanager
def _quiet_nested_tensor_notice() -> Iterator[None]:
    """Without torch's ``enable_nested_tensor is True, but self.use_nested_tensor is False``
    warning, which ``nn.TransformerEncoder`` gives when built with a layer its nested-tensor fast
    path cannot take (pre-norm, ``batch_first=False``, ...). That path only turns a padding mask
    into a nested tensor; an image model passes none, and vitcompress runs the encoder with fast
    paths off wherever it traces, counts or exports it (``analysis.capture.fast_paths_off``), so
    the notice would say nothing about its work, and would say it on every command. Exactly that
    message is silenced; every other warning of the factory still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=r"enable_nested_tensor is True, but self\.use_nested_tensor is False",
            category=UserWarning,
        )
        yield


def _defined_callables(module: ModuleType, limit: int = 8) -> list[str]:
    """Public functions and classes defined in ``module`` itself (not imported into it)."""
    names = [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and getattr(obj, "__module__", None) == module.__name__
    ]
    return names[:limit] + (["..."] if len(names) > limit else [])
