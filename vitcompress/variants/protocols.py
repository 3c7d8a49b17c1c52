"""What a method reads of the layers around it, named by the fields it uses.

The model map (analysis) lies below the variants and the plan (compilation) above them; a method
reads a few fields of each, declared here so that ``base.py``, ``scorers.py`` and a new method's
module name the same things without importing the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Block(Protocol):
    index: int
    path: str
    dim: int
    tokens: int  # prefix included
    prefix_tokens: int
    stage: int
    grid: tuple[int, ...]
    attention: Any  # AttentionCore: kind, key_tokens, path
    parallel_cores: Sequence[Any]  # further attention cores of a parallel block (AttentionCore)
    windows: Any  # Windows where it attends within windows (count, padded, attention_reducible)


class Location(Protocol):
    block: int
    stage: int
    keep: float
    cumulative_keep: float
    patch_tokens: int
    keep_tokens: int | None
    merge_tokens: int | None
    windows: int | None
    carried: Sequence[int]  # the windowed blocks that carry its choice


class Plan(Protocol):
    variant: str  # the method's name
    method: Any  # the Variant itself
    policy: str
    locations: Sequence[Location]


class ModelMap(Protocol):
    blocks: Sequence[Block]
    stages: Sequence[Any]  # Stage: index, blocks, grid
