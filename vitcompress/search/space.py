"""The candidate space: which blocks, keeping how much, with which variant.

Locations are one to four blocks that attend over their own tokens. A single-stage ViT takes any
such blocks; a CvT-like model (its last stage holds two thirds of the blocks) takes them from that
stage, where the paper puts them. A pyramid takes at most one block per stage: a stage's exit
gives the next stage its full grid back, so a reduction acts only within its stage, and a stage
with two would compound them into an ever smaller grid share. Keep ratios come from a grid;
a candidate has one ratio per location. A variant whose plan is set by one location and one
ratio per stage (ToMe: merging in every block from the first location) gets single locations
(in a pyramid, one per stage, as every variant).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vitcompress.analysis.model_map import ModelMap
from vitcompress.compilation.placement import dominant_last_stage, token_stages
from vitcompress.compilation.plan import Plan, PlanError, make_plan
from vitcompress.variants import VariantRefusal, get_variant

DEFAULT_KEEP_GRID = tuple(round(0.3 + 0.05 * i, 2) for i in range(13))  # 0.3 .. 0.9
MAX_LOCATIONS = 4


@dataclass(frozen=True)
class Candidate:
    """One point of the space. ``keep`` has one ratio per location."""

    variant: str
    locs: tuple[int, ...]
    keep: tuple[float, ...]

    @property
    def key(self) -> str:
        """A stable text key (the cache's)."""
        return f"{self.variant}|{','.join(map(str, self.locs))}|{','.join(map(str, self.keep))}"

    def to_json(self) -> dict[str, Any]:
        return {"variant": self.variant, "locs": list(self.locs), "keep": list(self.keep)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Candidate:
        return cls(
            variant=str(data["variant"]),
            locs=tuple(int(b) for b in data["locs"]),
            keep=tuple(float(k) for k in data["keep"]),
        )

    def plan(self, model_map: ModelMap, settings: dict[str, Any] | None = None) -> Plan:
        """The candidate's plan, its method made with ``settings`` (``kept_multiple``)."""
        method = get_variant(self.variant, settings)
        return make_plan(model_map, method, list(self.keep), list(self.locs))


@dataclass
class Space:
    """Where locations may go, and the keep grid."""

    groups: list[list[int]]  # blocks to choose from; a pyramid: one group per stage
    one_per_group: bool  # a pyramid: at most one location per stage
    keep_grid: tuple[float, ...] = DEFAULT_KEEP_GRID
    max_locations: int = MAX_LOCATIONS
    variants: tuple[str, ...] = field(default_factory=tuple)
    single_location: frozenset[str] = frozenset()  # variants searched at one location

    def most_locations(self, variant: str | None = None) -> int:
        """Locations a candidate of ``variant`` may have. A single-location variant gets one,
        except in a pyramid, where each stage is planned on its own and one per stage is already
        the rule."""
        if variant in self.single_location and not self.one_per_group:
            return 1
        return self.max_locations

    def location_sets(self, variant: str | None = None) -> Iterator[tuple[int, ...]]:
        """Every allowed set of 1..max_locations blocks (for ``variant``), in increasing order."""
        for locs in self._location_sets():
            if len(locs) <= self.most_locations(variant):
                yield locs

    def _location_sets(self) -> Iterator[tuple[int, ...]]:
        if self.one_per_group:
            for size in range(1, min(self.max_locations, len(self.groups)) + 1):
                for stages in itertools.combinations(self.groups, size):
                    yield from itertools.product(*stages)
            return
        blocks = self.groups[0]
        for size in range(1, min(self.max_locations, len(blocks)) + 1):
            yield from itertools.combinations(blocks, size)

    def allows(self, locs: Sequence[int], variant: str | None = None) -> bool:
        if not locs or len(locs) > self.most_locations(variant):
            return False
        if list(locs) != sorted(set(locs)):
            return False
        if self.one_per_group:
            stages = [next((i for i, g in enumerate(self.groups) if b in g), None) for b in locs]
            return None not in stages and len(set(stages)) == len(stages)
        return all(b in self.groups[0] for b in locs)

    def describe(self) -> str:
        if self.one_per_group:
            return "one block in each of 1-{} of the stages {}".format(
                min(self.max_locations, len(self.groups)),
                "; ".join(f"{g[0]}..{g[-1]}" for g in self.groups),
            )
        blocks = self.groups[0]
        return f"1-{min(self.max_locations, len(blocks))} of blocks {blocks[0]}..{blocks[-1]}"


def build_space(
    model_map: ModelMap,
    variants: Sequence[str],
    keep_grid: Sequence[float] = DEFAULT_KEEP_GRID,
    max_locations: int = MAX_LOCATIONS,
    single_location: Sequence[str] = (),
) -> Space:
    """The space for ``model_map`` (see the module's docstring); ``single_location`` names the
    variants searched at one location."""
    stages = token_stages(model_map)
    if not stages:
        raise PlanError(
            "the model has no block that attends over its own tokens: nothing to search"
        )
    if dominant_last_stage(stages):
        groups, one_per_group = [stages[-1]], False
    elif len(stages) > 1:
        groups, one_per_group = stages, True
    else:
        groups, one_per_group = [stages[0]], False
    return Space(
        groups=groups,
        one_per_group=one_per_group,
        keep_grid=tuple(sorted(keep_grid)),
        max_locations=max_locations,
        variants=tuple(variants),
        single_location=frozenset(single_location),
    )


def valid(
    candidate: Candidate, model_map: ModelMap, settings: dict[str, Any] | None = None
) -> Plan | None:
    """The candidate's plan, or None where make_plan refuses it (a position table, class
    attention, a training mask that cannot reach, a method whose own setting fixes its counts
    where ``settings`` round them)."""
    try:
        return candidate.plan(model_map, settings)
    except (PlanError, VariantRefusal):
        return None
