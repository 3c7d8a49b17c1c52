"""Sharded HuggingFace weights: an index (``model.safetensors.index.json`` or
``pytorch_model.bin.index.json``) whose ``weight_map`` names the shard file holding each weight.

transformers loads every shard the map names, and every weight in it, whatever the map says: a
weight the map routes to a shard that lacks it is only reported missing, and a shard holding a
weight the map does not route to it is loaded without a word (a second copy of a weight another
shard holds then silently decides its value). Here every shard must hold exactly the weights the
map routes to it, or the directory is refused in one line.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch

from vitcompress.loading.checkpoint import read_state_dict
from vitcompress.loading.errors import SHOW_KEYS, ModelLoadError, one_line

INDEX_SUFFIX = ".index.json"


def is_index(path: Path) -> bool:
    """True if ``path`` names a shard index (``*.index.json``)."""
    return path.name.endswith(INDEX_SUFFIX)


def weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map`` (weight name -> shard file name), refused in one line where
    the file is not a readable index."""
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the shard index {index}: {one_line(exc)}") from exc
    mapping = data.get("weight_map") if isinstance(data, dict) else None
    if (
        not isinstance(mapping, dict)
        or not mapping
        or not all(isinstance(v, str) and v for v in mapping.values())
    ):
        raise ModelLoadError(
            f"the shard index {index} holds no weight_map of weight names to shard files"
        )
    return dict(mapping)


def check_shards(index: Path) -> list[Path]:
    """The shard files of ``index``, each checked to be there and to hold exactly the weights
    the map routes to it (one line naming the first shard that does not); returns them."""
    shards = []
    for name, keys in _routed(index).items():
        shard = _shard(index, name, keys)
        _check_keys(index, name, keys, _keys_of(shard))
        shards.append(shard)
    return shards


def read_sharded(index: Path) -> dict[str, torch.Tensor]:
    """Every weight of every shard ``index`` names, each shard checked as by
    :func:`check_shards` (read as ``--checkpoint`` files are)."""
    state: dict[str, torch.Tensor] = {}
    for name, keys in _routed(index).items():
        part = read_state_dict(_shard(index, name, keys))
        _check_keys(index, name, keys, set(part))
        state.update(part)
    return state


def _routed(index: Path) -> dict[str, set[str]]:
    """Shard file name -> the weights the index maps to it, in the order transformers loads
    the shards (sorted by name)."""
    routed: dict[str, set[str]] = {}
    for key, name in weight_map(index).items():
        routed.setdefault(name, set()).add(key)
    return dict(sorted(routed.items()))


def _shard(index: Path, name: str, keys: set[str]) -> Path:
    shard = index.parent / name
    if not shard.is_file():
        raise ModelLoadError(
            f"shard {name} named by {index.name} is not in {index.parent} "
            f"({len(keys)} weights: {_first(keys)})"
        )
    return shard


def _check_keys(index: Path, name: str, expected: set[str], found: set[str]) -> None:
    lacking, unlisted = expected - found, found - expected
    problems = []
    if lacking:
        problems.append(f"lacks {len(lacking)} weights {index.name} maps to it ({_first(lacking)})")
    if unlisted:
        problems.append(
            f"holds {len(unlisted)} weights {index.name} does not map to it ({_first(unlisted)})"
        )
    if problems:
        raise ModelLoadError(f"shard {index.parent / name} {' and '.join(problems)}")


def _keys_of(shard: Path) -> set[str]:
    """The weight names in one shard: a safetensors file's from its header (transformers reads
    the tensors right after), a ``.bin`` file's by loading it (``weights_only``)."""
    if shard.suffix != ".safetensors":
        return set(read_state_dict(shard))
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(shard), framework="pt") as f:
            return set(f.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelLoadError(
            f"shard {shard} is truncated or not a safetensors file: {one_line(exc)}"
        ) from exc


def weights_sha256(path: Path) -> str:
    """Hex sha256 of a weights file, or of a shard index together with every shard it names
    (each shard's name and bytes, in order): a shard rewritten later changes it."""
    if not is_index(path):
        return _sha256(path)
    digest = hashlib.sha256(path.read_bytes())
    for name in _routed(path):
        digest.update(f"\0{name}\0{_sha256(path.parent / name)}".encode())
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _first(keys: Iterable[str]) -> str:
    names = sorted(keys)
    return ", ".join(names[:SHOW_KEYS]) + (", ..." if len(names) > SHOW_KEYS else "")
