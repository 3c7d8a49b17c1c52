"""timm model names, including timm's ``hf-hub:`` / ``local-dir:`` sources, and the Hugging Face
hub behind ``--pretrained``: fail fast and in one line when the weights host cannot be reached."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import re
import socket
import urllib.request
import warnings
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from torch import nn

from vitcompress.loading.errors import SHOW_KEYS, ModelLoadError, one_line

# timm's model-source prefixes; such names are handed to timm as they are.
TIMM_SOURCES = ("hf-hub", "hf_hub", "local-dir")
_PROBE_TIMEOUT_S = 3.0
# Libraries whose exceptions mean "the download failed" rather than "the weights do not fit".
_NETWORK_MODULES = ("huggingface_hub", "httpx", "httpx2", "requests", "urllib3")


def register_zoo() -> None:
    """Import the model zoo, whose import registers extra names in timm's registry."""
    try:
        importlib.import_module("vitcompress.zoo")
    except ImportError as exc:
        if exc.name not in ("vitcompress", "vitcompress.zoo"):
            # A broken zoo must not take every timm model down with it, but should not go unseen.
            warnings.warn(f"vitcompress.zoo could not be imported: {exc}", stacklevel=3)


def create_timm(name: str, args: dict[str, Any], pretrained: bool) -> nn.Module:
    import timm

    head, sep, _ = name.partition(":")
    prefixed = bool(sep) and head.lower() in TIMM_SOURCES
    if not prefixed:
        register_zoo()
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
    close = difflib.get_close_matches(wanted, known, n=SHOW_KEYS)
    suggestions = list(dict.fromkeys(prefixed + close))[:SHOW_KEYS]
    # timm refuses "owner/name" without a source prefix; say how to write a Hub model. A path
    # ("/tmp/x", "a/b/c", "./x") is no Hub id: the hint would send the user the wrong way.
    hub_id = re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is not None
    hub = f"; for a Hugging Face Hub model write hf-hub:{name}" if hub_id else ""
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
