"""The Pareto front of (MACs, score): no other point is as cheap and at least as good."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def pareto_front(
    points: Sequence[T], cost: Callable[[T], float], score: Callable[[T], float]
) -> list[T]:
    """The points not dominated by another (lower or equal cost and higher or equal score, one of
    them strictly), by increasing cost. Of exact ties (same cost and score) the first is kept."""
    ordered = sorted(points, key=lambda p: (cost(p), -score(p)))
    front: list[T] = []
    best = float("-inf")
    for point in ordered:
        if score(point) > best:
            front.append(point)
            best = score(point)
    return front
