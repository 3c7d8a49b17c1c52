"""Turn a ``--model SPEC`` (plus options) into an ``nn.Module``.

A spec is one of:

* a timm model name (``deit_small_patch16_224``), including the names ``vitcompress.zoo`` adds to
  timm's registry and timm's own ``hf-hub:`` / ``local-dir:`` prefixes;
* ``path/to/file.py:factory`` -- a Python file of the user's, imported by path;
* ``package.module:factory`` -- an importable module;
* a directory holding ``vitcompress.json`` -- a compressed model saved by ``vitcompress``.

Every failure the user can cause is raised as :class:`ModelLoadError` with a one-line message; the
CLI prints it and exits with status 2 instead of showing a traceback.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import importlib
import importlib.util
import inspect
import itertools
import math
import numbers
import os
import pickle
import re
import socket
import sys
import urllib.request
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import torch
from torch import nn

__all__ = [
    "ARTIFACT_MARKER",
    "LoadedModel",
    "ModelInputError",
    "ModelLoadError",
    "ModelSource",
    "default_input_size",
    "load_checkpoint",
    "load_model",
    "one_line",
    "parse_input_size",
    "parse_model_args",
]

ARTIFACT_MARKER = "vitcompress.json"

# Keys under which training scripts commonly nest the weights, in order of preference: the raw
# weights before their EMA copy, because that is what a plain ``state_dict()`` would have saved.
_WRAPPER_KEYS = ("model", "state_dict", "state_dict_ema", "model_ema")
# Prefixes added by DistributedDataParallel and torch.compile respectively.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# timm's model-source prefixes; such names are handed to timm as they are.
_TIMM_SOURCES = ("hf-hub", "hf_hub", "local-dir")
_CHECKPOINT_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt", ".safetensors", ".tar")
_PROBE_TIMEOUT_S = 3.0
# Libraries whose exceptions mean "the download failed" rather than "the weights do not fit".
_NETWORK_MODULES = ("huggingface_hub", "httpx", "httpx2", "requests", "urllib3")
_SHOW_KEYS = 5  # how many keys an error message lists before "..."

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_user_module_ids = itertools.count()


class ModelLoadError(Exception):
    """One clear line for the user; the CLI prints ``str(e)`` and exits 2."""

    def __init__(self, message: str) -> None:
        # Messages embed text from other libraries that may span lines; the CLI promises one line.
        super().__init__(" ".join(str(message).splitlines()))


class ModelInputError(ModelLoadError):
    """The model does not run on the input size it was given or says it takes."""


# --------------------------------------------------------------------------------------------------
# What was asked for
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelSource:
    """What was asked for; serialisable so that a compressed artifact can name its base model."""

    spec: str  # timm name, "path/to/file.py:factory", "package.module:factory", or an artifact dir
    model_args: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None
    pretrained: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "model_args": {key: _encode_arg(key, value) for key, value in self.model_args.items()},
            "checkpoint": self.checkpoint,
            "pretrained": self.pretrained,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ModelSource:
        if not isinstance(d, Mapping) or not isinstance(d.get("spec"), str):
            raise ModelLoadError(f"not a model source (expected an object with a 'spec'): {d!r}")
        args = d.get("model_args") or {}
        checkpoint = d.get("checkpoint")
        pretrained = d.get("pretrained", False)
        if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
            raise ModelLoadError(f"model source has malformed model_args: {args!r}")
        if checkpoint is not None and not isinstance(checkpoint, str):
            raise ModelLoadError(f"model source has a malformed checkpoint: {checkpoint!r}")
        if not isinstance(pretrained, bool):
            raise ModelLoadError(f"model source has a malformed pretrained flag: {pretrained!r}")
        return cls(
            spec=d["spec"],
            model_args={key: _decode_arg(key, value) for key, value in args.items()},
            checkpoint=checkpoint,
            pretrained=pretrained,
        )


def _is_plain_json(value: Any) -> bool:
    """True if ``json`` stores ``value`` and reads it back as an equal object of the same types."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_plain_json(v) for v in value)
    if isinstance(value, dict):
        if set(value) == {"__literal__"}:  # would be mistaken for our own encoding
            return False
        return all(isinstance(k, str) and _is_plain_json(v) for k, v in value.items())
    return False


def _encode_arg(key: str, value: Any) -> Any:
    # JSON would turn tuples into lists (and cannot hold sets, bytes, ...), but a factory may care:
    # such values are stored as their Python literal, which is how the CLI parsed them anyway.
    if _is_plain_json(value):
        return value
    text = repr(value)
    try:
        faithful = ast.literal_eval(text) == value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        faithful = False
    if not faithful:
        raise ModelLoadError(
            f"model argument {key}={text} cannot be recorded; use numbers, strings, bools, None, "
            "tuples, lists or dicts"
        )
    return {"__literal__": text}


def _decode_arg(key: str, value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"__literal__"}:
        try:
            return ast.literal_eval(value["__literal__"])
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
            raise ModelLoadError(
                f"model source has a malformed value for '{key}': {value!r}"
            ) from exc
    return value


@dataclass
class LoadedModel:
    model: nn.Module
    source: ModelSource
    input_size: tuple[int, int, int]


# --------------------------------------------------------------------------------------------------
# Parsing CLI text
# --------------------------------------------------------------------------------------------------


def parse_model_args(pairs: Sequence[str]) -> dict[str, Any]:
    """Parse ``key=value`` pairs; values are Python literals where they parse, else plain strings.

    ``depth=2`` gives an int, ``img_size=(32,32)`` a tuple, ``act=gelu`` the string ``"gelu"``.
    """
    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep:
            raise ModelLoadError(f"model argument '{pair}' has no '=': write it as key=value")
        if not key.isidentifier():
            raise ModelLoadError(f"model argument '{pair}': '{key}' is not a valid argument name")
        if key in args:
            raise ModelLoadError(f"model argument '{key}' is given twice")
        args[key] = _parse_value(text.strip())
    return args


def _parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        # Not a literal (e.g. ``gelu`` or ``layer_norm``): the user meant the word itself.
        return text


def parse_input_size(text: str) -> tuple[int, int, int]:
    """Parse ``"C,H,W"`` such as ``"3,224,224"``."""
    parts = [part.strip() for part in text.split(",")]
    try:
        size = tuple(int(part) for part in parts)
    except ValueError:
        size = ()
    if len(size) != 3 or min(size) <= 0:
        raise ModelLoadError(
            f"input size '{text}' is not C,H,W with three positive integers (e.g. 3,224,224)"
        )
    return size  # type: ignore[return-value]  # length checked above


def _as_size(value: Any) -> tuple[int, int, int] | None:
    """``value`` as a (C, H, W) size if it is three positive ints, else None."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return None
    if len(value) != 3:
        return None
    # Integral rather than int: numpy integers from a config are fine, True is not a size.
    if not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in value
    ):
        return None
    return (int(value[0]), int(value[1]), int(value[2]))


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def load_model(
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
    size: tuple[int, int, int] | None = None
    if input_size is not None:
        size = _as_size(tuple(input_size)) if isinstance(input_size, Sequence) else None
        if size is None:
            raise ModelLoadError(
                f"input size {input_size!r} is not three positive integers (C, H, W)"
            )

    if os.path.isfile(os.path.join(spec, ARTIFACT_MARKER)):
        return _load_artifact(spec, args, checkpoint, pretrained, size)
    if os.path.isdir(spec) and (os.sep in spec or "/" in spec or spec.startswith(".")):
        # Only for something written as a path: a bare word may be a timm name that happens to
        # match an output folder in the working directory.
        raise ModelLoadError(
            f"'{spec}' is a directory without {ARTIFACT_MARKER}, so not a compressed model; "
            "for a model file write path/to/file.py:factory"
        )

    # Check the checkpoint before building: building a large model takes a while.
    ckpt_path: Path | None = None
    if checkpoint is not None:
        ckpt_path = Path(checkpoint).expanduser()
        if not ckpt_path.is_file():
            raise ModelLoadError(f"checkpoint {checkpoint} not found")

    kind, target, attr = _parse_spec(spec)
    if pretrained and kind != "timm":
        raise ModelLoadError(
            f"--pretrained only applies to timm model names, not '{spec}'; "
            "use --checkpoint FILE to load weights"
        )
    if kind == "file":
        path = Path(target).expanduser().resolve()
        model = _call_factory(_import_file(path, spec), attr, args, spec, folder=path.parent)
        # Recorded absolute so that the source still resolves from another working directory.
        recorded_spec = f"{path}:{attr}"
    elif kind == "module":
        model = _call_factory(_import_module(target, spec), attr, args, spec, folder=None)
        recorded_spec = spec
    else:
        model = _create_timm(target, args, pretrained)
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
    _check_runs(model, size, spec, given=input_size is not None)
    source = ModelSource(
        spec=recorded_spec,
        model_args=args,
        checkpoint=str(ckpt_path.resolve()) if ckpt_path is not None else None,
        pretrained=pretrained,
    )
    return LoadedModel(model=model, source=source, input_size=size)


def _check_runs(model: nn.Module, size: tuple[int, int, int], spec: str, given: bool) -> None:
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
            own = default_input_size(model)
            says = f" (the model says {','.join(map(str, own))})" if own and own != size else ""
            hint = f"pass the input size it was built for{says}"
            where = f"--input-size {text}"
        else:
            hint = "pass --input-size C,H,W if it takes another, or check that it is an image model"
            where = f"its input size {text}"
        raise ModelInputError(
            f"model '{spec}' does not run on {where}: {one_line(exc)}; {hint}"
        ) from exc


def _load_artifact(
    spec: str,
    args: dict[str, Any],
    checkpoint: str | Path | None,
    pretrained: bool,
    size: tuple[int, int, int] | None,
) -> LoadedModel:
    # An artifact fixes architecture and weights; silently ignoring these would mislead the user.
    given = [
        name
        for name, used in (
            ("model arguments", args),
            ("--checkpoint", checkpoint),
            ("--pretrained", pretrained),
        )
        if used
    ]
    if given:
        raise ModelLoadError(
            f"'{spec}' is a compressed model that already fixes its architecture and weights; "
            f"drop {', '.join(given)}"
        )
    # Imported here: the artifact module itself imports this one.
    from vitcompress.artifact import load_artifact

    loaded = load_artifact(spec)
    loaded.model.eval()
    if size is None or size == loaded.input_size:
        return loaded
    # A plan's token counts were made for the artifact's own input size.
    _check_runs(loaded.model, size, spec, given=True)
    return replace(loaded, input_size=size)


def _parse_spec(spec: str) -> tuple[str, str, str]:
    """Split a spec into (kind, target, factory) with kind "file", "module" or "timm"."""
    head, sep, _ = spec.partition(":")
    if sep and head.lower() in _TIMM_SOURCES:
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


def _import_file(path: Path, spec: str) -> ModuleType:
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


def _import_module(name: str, spec: str) -> ModuleType:
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


def _call_factory(
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
        with paths:  # a factory may import sibling modules lazily
            model = factory(**args)
    except Exception as exc:
        raise ModelLoadError(f"factory '{spec}' failed: {one_line(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise ModelLoadError(
            f"factory '{spec}' returned {type(model).__module__}.{type(model).__qualname__}, "
            "not a torch.nn.Module"
        )
    return model


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


# --------------------------------------------------------------------------------------------------
# timm
# --------------------------------------------------------------------------------------------------


def _register_zoo() -> None:
    """Import the model zoo, whose import registers extra names in timm's registry."""
    try:
        importlib.import_module("vitcompress.zoo")
    except ImportError as exc:
        if exc.name not in ("vitcompress", "vitcompress.zoo"):
            # A broken zoo must not take every timm model down with it, but should not go unseen.
            warnings.warn(f"vitcompress.zoo could not be imported: {exc}", stacklevel=3)


def _create_timm(name: str, args: dict[str, Any], pretrained: bool) -> nn.Module:
    import timm

    head, sep, _ = name.partition(":")
    prefixed = bool(sep) and head.lower() in _TIMM_SOURCES
    if not prefixed:
        _register_zoo()
        if not timm.is_model(name):
            raise ModelLoadError(_unknown_model_message(name, timm.list_models()))

    # An "hf-hub:" name fetches its configuration from the hub even without pretrained weights.
    from_hub = prefixed and head.lower() in ("hf-hub", "hf_hub")
    unreachable = _weights_host_unreachable(name, prefixed) if pretrained or from_hub else None
    try:
        if unreachable is None:
            return timm.create_model(name, pretrained=pretrained, **args)
        # The network is known to be down: try the local cache only, instead of letting the hub
        # client retry with back-off for a minute or more before giving up.
        with _hub_offline():
            return timm.create_model(name, pretrained=pretrained, **args)
    except TypeError as exc:  # unknown or ill-typed keyword arguments
        raise ModelLoadError(f"could not build timm model '{name}': {one_line(exc)}") from exc
    except Exception as exc:
        if not (pretrained or from_hub):
            raise ModelLoadError(f"could not build timm model '{name}': {one_line(exc)}") from exc
        if unreachable is not None:
            reason = f"{unreachable} and the files are not in the local cache"
        elif _hub_is_offline():
            reason = "HF_HUB_OFFLINE is set and the files are not in the local cache"
        else:
            reason = one_line(exc)
        verb = "download" if unreachable is not None or _is_network_error(exc) else "load"
        if pretrained:
            raise ModelLoadError(
                f"could not {verb} pretrained weights for {name}: {reason}; "
                "use --checkpoint FILE to load local weights"
            ) from exc
        raise ModelLoadError(
            f"could not {verb} model {name}: {reason}; name the timm architecture instead and "
            "use --checkpoint FILE to load local weights"
        ) from exc


def _unknown_model_message(name: str, known: Sequence[str]) -> str:
    wanted = name.lower()
    # Prefix matches first: a truncated name ("deit_smal") is the commonest slip and difflib ranks
    # it poorly against long names; shortest first puts the plain variant before distilled etc.
    prefixed = sorted((n for n in known if n.startswith(wanted)), key=lambda n: (len(n), n))
    close = difflib.get_close_matches(wanted, known, n=_SHOW_KEYS)
    suggestions = list(dict.fromkeys(prefixed + close))[:_SHOW_KEYS]
    # timm refuses "owner/name" without a source prefix; say how to write a Hub model.
    hub = f"; for a Hugging Face Hub model write hf-hub:{name}" if "/" in name else ""
    if suggestions:
        return f"unknown model '{name}'; closest: {', '.join(suggestions)}{hub}"
    return (
        f"unknown model '{name}': not a timm model name (see timm.list_models()); for your own "
        f"model write path/to/file.py:factory{hub}"
    )


def _weights_host_unreachable(name: str, prefixed: bool) -> str | None:
    """Why the host serving ``name``'s pretrained weights cannot be reached, or None if it can.

    None also when we cannot tell (behind a proxy, unknown source): then timm just tries.
    """
    if _hub_is_offline():
        return None  # the hub client fails fast by itself in offline mode
    url: str | None = None
    try:
        from huggingface_hub import constants as hub_constants

        hub_endpoint: str | None = hub_constants.ENDPOINT
    except ImportError:
        hub_endpoint = None
    if prefixed:
        url = hub_endpoint if name.lower().startswith(("hf-hub:", "hf_hub:")) else None
    else:
        try:
            from timm.models import get_pretrained_cfg

            cfg = get_pretrained_cfg(name)
        except Exception:  # no config for this tag: timm will report it itself
            cfg = None
        if cfg is not None:
            url = hub_endpoint if getattr(cfg, "hf_hub_id", None) else getattr(cfg, "url", None)
    if not url:
        return None
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()  # also lists "no" (NO_PROXY), which is not a proxy
    if not parts.hostname or proxies.get(parts.scheme) or proxies.get("all"):
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"cannot reach {parts.hostname} ({exc.strerror or exc})"
    return None


def _hub_is_offline() -> bool:
    try:
        from huggingface_hub import constants as hub_constants
    except ImportError:
        return False
    return bool(hub_constants.HF_HUB_OFFLINE)


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """Put the Hugging Face hub client in offline mode (cache only) for the block."""
    try:
        from huggingface_hub import constants as hub_constants
    except ImportError:
        yield
        return
    # The client reads HF_HUB_OFFLINE once at import, so the environment variable would be too late.
    before = hub_constants.HF_HUB_OFFLINE
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE = before


def _is_network_error(exc: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        module = type(current).__module__.split(".")[0]
        if isinstance(current, OSError) or module in _NETWORK_MODULES:
            return True
        current = current.__cause__ or current.__context__
    return False


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


def load_checkpoint(model: nn.Module, path: str | Path, *, model_name: str | None = None) -> None:
    """Load weights from ``path`` into ``model``, strictly; every key must match.

    ``.safetensors`` files are read with safetensors; anything else with ``torch.load`` in
    ``weights_only`` mode, so a checkpoint can never run code on this machine.
    """
    path = Path(path)
    name = model_name or type(model).__name__
    state = _unwrap_state_dict(_read_checkpoint(path), path)
    expected = model.state_dict()
    state = _strip_wrapper_prefixes(state, expected)

    problems = _fit_problems(state, expected)
    if problems:
        raise ModelLoadError(f"checkpoint {path} does not fit model {name}: {'; '.join(problems)}")
    try:
        model.load_state_dict(state, strict=True)
    except Exception as exc:  # e.g. a module's own load hook objecting
        raise ModelLoadError(
            f"checkpoint {path} does not fit model {name}: {one_line(exc)}"
        ) from exc


def _read_checkpoint(path: Path) -> Any:
    if not path.is_file():
        raise ModelLoadError(f"checkpoint {path} not found")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(
                f"checkpoint {path} is truncated or not a safetensors file: {one_line(exc)}"
            ) from exc

    # argparse.Namespace is allowed because timm's training script stores its arguments as one next
    # to the weights; it only holds attributes and runs no code when unpickled. (torch < 2.5 has no
    # safe_globals; such checkpoints are then refused like any other pickled object.)
    safe_globals = getattr(torch.serialization, "safe_globals", None)
    allow = safe_globals([argparse.Namespace]) if safe_globals else contextlib.nullcontext()
    try:
        with allow:
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = _ANSI.sub("", str(exc))
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if found:
            raise ModelLoadError(
                f"checkpoint {path} contains pickled Python objects ({found.group(1)}), which are "
                "not loaded because unpickling can run arbitrary code; save plain weights instead: "
                "torch.save(model.state_dict(), FILE) or a .safetensors file"
            ) from exc
        # Otherwise the pickle stream itself is broken (e.g. "Unsupported operand").
        found = re.search(r"WeightsUnpickler error:\s*(.+)", text)
        reason = " ".join(found.group(1).split()) if found else one_line(exc)
        raise ModelLoadError(
            f"checkpoint {path} is truncated or corrupt (not a PyTorch weights file): {reason}"
        ) from exc
    except Exception as exc:  # torch reports corruption as RuntimeError, EOFError, KeyError, ...
        raise ModelLoadError(
            f"checkpoint {path} is truncated or corrupt: {one_line(exc)}"
        ) from exc


def _is_state_dict(obj: Any) -> bool:
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def _unwrap_state_dict(obj: Any, path: Path) -> dict[str, torch.Tensor]:
    # Training checkpoints nest the weights next to optimizer state, epoch counters and the like,
    # sometimes twice over (e.g. {"model": {"state_dict": ...}}).
    for _ in range(3):
        if _is_state_dict(obj):
            return dict(obj)
        if not isinstance(obj, Mapping):
            break
        key = next((k for k in _WRAPPER_KEYS if k in obj), None)
        if key is None:
            keys = ", ".join(_first(list(map(str, obj))))
            raise ModelLoadError(
                f"checkpoint {path} holds no weights: a dict with keys {keys or '(none)'} "
                f"and none of {', '.join(_WRAPPER_KEYS)}"
            )
        obj = obj[key]
    raise ModelLoadError(
        f"checkpoint {path} holds a {type(obj).__name__}, not a dict of tensors (a state dict)"
    )


def _strip_wrapper_prefixes(
    state: dict[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    for prefix in _WRAPPER_PREFIXES:
        # Only when every key carries it and the model's keys do not: a model may genuinely have a
        # submodule called "module".
        if all(k.startswith(prefix) for k in state) and not all(
            k.startswith(prefix) for k in expected
        ):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def _fit_problems(
    state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]
) -> list[str]:
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    mismatched = [
        f"{k} (checkpoint {list(state[k].shape)} vs model {list(v.shape)})"
        for k, v in expected.items()
        if k in state and state[k].shape != v.shape
    ]
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {', '.join(_first(missing))}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(_first(unexpected))}")
    if mismatched:
        problems.append(f"shape mismatch ({len(mismatched)}): {', '.join(_first(mismatched))}")
    return problems


def _first(items: list[str]) -> list[str]:
    return items[:_SHOW_KEYS] + (["..."] if len(items) > _SHOW_KEYS else [])


# --------------------------------------------------------------------------------------------------
# Input size
# --------------------------------------------------------------------------------------------------


def default_input_size(model: nn.Module) -> tuple[int, int, int] | None:
    """The (C, H, W) input the model expects, if the model says so; None if it cannot be told.

    In order: timm's ``pretrained_cfg`` (or ``default_cfg``); a ``default_input_size`` or
    ``input_size`` attribute; the image size a timm-style ``patch_embed`` was built for.
    """
    for attr in ("pretrained_cfg", "default_cfg"):
        cfg = getattr(model, attr, None)
        size = _as_size(cfg.get("input_size")) if isinstance(cfg, Mapping) else None
        if size is not None:
            # timm keeps the weights' config when a model is created with another img_size (or
            # in_chans), and such a model rejects the config's size: what it was built for wins.
            return _patch_embed_size(model, channels=size[0]) or size
    for attr in ("default_input_size", "input_size"):
        size = _as_size(getattr(model, attr, None))
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
    return _as_size((channels, *img_size))


# --------------------------------------------------------------------------------------------------


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` -- what the user needs, without the traceback."""
    lines = [line.strip() for line in _ANSI.sub("", str(exc)).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
