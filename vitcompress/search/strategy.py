"""Which candidates to score, under a MAC budget.

1. **Budget matching.** For each variant and location set, the candidate kept is the one with the
   largest keep ratio of the grid (the same at every location) whose analytic MACs fit the
   budget. Keeping fewer tokens at the same places costs less and, before any fine-tuning, follows
   the base less closely, so a candidate far under the budget is assumed no better than its
   matched twin. This leaves one candidate per (variant, locations).
2. **Exhaustive** when those are at most ``max_candidates``: all are scored.
3. **Evolutionary** otherwise, in generations over the scored front: the seeds are the paper's
   placement and evenly spaced placements of 1-4 locations; each generation takes the best scored
   candidates as parents and proposes their neighbours: one location moved by one or two blocks,
   one added in the widest gap, one removed, the same placement with another variant, and
   per-location keep ratios (one location one grid step up, another one down, still within the
   budget); a single-location variant (ToMe) only moves, and takes another variant's placement
   from its first block. Unscored neighbours are scored best parent first, until
   ``max_candidates`` are scored; when no parent has an unscored neighbour left, the next
   unscored matched candidate is taken.

The cost is one scoring pass over the calibration images per scored candidate (plus, for learned
variants, a warm-up of seconds); :class:`Proposals` yields candidates one at a time, so the caller
scores, caches and reports them as they come.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from vitcompress.search.space import Candidate, Space

Cost = Callable[[Candidate], float | None]  # analytic MACs, None where the plan is refused


def match_budget(
    variant: str, locs: tuple[int, ...], space: Space, cost: Cost, budget: float
) -> Candidate | None:
    """The largest uniform keep of the grid at ``locs`` within ``budget``."""
    for keep in sorted(space.keep_grid, reverse=True):
        candidate = Candidate(variant, locs, (keep,) * len(locs))
        macs = cost(candidate)
        if macs is not None and macs <= budget:
            return candidate
    return None


def evenly_spaced(space: Space, variant: str | None = None) -> list[tuple[int, ...]]:
    """Seeds: for 1..4 locations (1 for a single-location variant), blocks spread evenly over
    the allowed ones (for a pyramid, the first block of the later stages first)."""
    seeds: list[tuple[int, ...]] = []
    most = space.most_locations(variant)
    if space.one_per_group:
        firsts = [g[0] for g in space.groups]
        for size in range(1, min(most, len(firsts)) + 1):
            seeds.append(tuple(firsts[-size:]))
        return seeds
    blocks = space.groups[0]
    for size in range(1, min(most, len(blocks)) + 1):
        picks = sorted({blocks[(len(blocks) * (i + 1)) // (size + 1)] for i in range(size)})
        seeds.append(tuple(picks))
    return seeds


def neighbours(
    parent: Candidate, space: Space, variants: Sequence[str], cost: Cost, budget: float
) -> list[Candidate]:
    """The moves listed in the module's docstring, each matched to the budget."""
    locs = list(parent.locs)
    blocks = sorted({b for g in space.groups for b in g})
    moved: list[tuple[int, ...]] = []
    for i in range(len(locs)):
        for step in (-1, 1, -2, 2):
            changed = locs.copy()
            changed[i] += step
            moved.append(tuple(sorted(changed)))
    gaps = [blocks[0] - 1, *locs, blocks[-1] + 1]
    widest = max(range(len(gaps) - 1), key=lambda i: gaps[i + 1] - gaps[i])
    moved.append(tuple(sorted({*locs, (gaps[widest] + gaps[widest + 1]) // 2})))
    for i in range(len(locs)):
        moved.append(tuple(locs[:i] + locs[i + 1 :]))
    out: list[Candidate] = []
    for placement in moved:
        if space.allows(placement, parent.variant):
            matched = match_budget(parent.variant, placement, space, cost, budget)
            if matched is not None:
                out.append(matched)
    for variant in variants:
        if variant != parent.variant:
            # A single-location variant (ToMe) takes the placement's first block, where its
            # reduction would start.
            placement = parent.locs[: space.most_locations(variant)]
            matched = match_budget(variant, placement, space, cost, budget)
            if matched is not None:
                out.append(matched)
    out.extend(_keep_shifts(parent, space, cost, budget))
    return out


def _keep_shifts(parent: Candidate, space: Space, cost: Cost, budget: float) -> list[Candidate]:
    grid = sorted(space.keep_grid)
    out = []
    for up in range(len(parent.locs)):
        for down in range(len(parent.locs)):
            if up == down:
                continue
            keep = list(parent.keep)
            try:
                keep[up] = grid[grid.index(keep[up]) + 1]
                index = grid.index(keep[down]) - 1
            except (ValueError, IndexError):
                continue
            if index < 0:
                continue
            keep[down] = grid[index]
            candidate = Candidate(parent.variant, parent.locs, tuple(keep))
            macs = cost(candidate)
            if macs is not None and macs <= budget:
                out.append(candidate)
    return out


class Proposals:
    """Yields the candidates to score next; told each result through :meth:`scored`."""

    def __init__(
        self,
        matched: list[Candidate],
        seeds: list[Candidate],
        space: Space,
        variants: Sequence[str],
        cost: Cost,
        budget: float,
        max_candidates: int,
    ) -> None:
        self.matched = matched
        self.exhaustive = len(matched) <= max_candidates
        self.space = space
        self.variants = list(variants)
        self.cost = cost
        self.budget = budget
        self.max_candidates = max_candidates
        self.scores: dict[Candidate, float] = {}
        self.seeds = [c for c in dict.fromkeys(seeds)]

    @property
    def name(self) -> str:
        return "exhaustive" if self.exhaustive else "evolutionary"

    def scored(self, candidate: Candidate, score: float | None) -> None:
        """``None``: the candidate could not be scored (it ranks last)."""
        self.scores[candidate] = float("-inf") if score is None else score

    def __iter__(self) -> Iterator[Candidate]:
        if self.exhaustive:
            for candidate in self.matched:
                if candidate not in self.scores:
                    yield candidate
            return
        for candidate in self.seeds:
            if len(self.scores) >= self.max_candidates:
                return
            if candidate not in self.scores:
                yield candidate
        while len(self.scores) < self.max_candidates:
            child = self._next_child()
            if child is None:
                return
            yield child

    def _next_child(self) -> Candidate | None:
        parents = sorted(self.scores, key=lambda c: -self.scores[c])[:4]
        for parent in parents:
            for child in neighbours(parent, self.space, self.variants, self.cost, self.budget):
                if child not in self.scores:
                    return child
        return next((c for c in self.matched if c not in self.scores), None)
