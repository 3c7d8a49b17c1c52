"""ToMe (Token Merging, Bolya et al., ICLR 2023): in every block from the first location to the end
of its stage, after the attention residual add, merge ``r`` tokens into their most similar ones
(bipartite soft matching on the head-mean keys, size-weighted average, prefix tokens protected);
every later block of the stage adds ``log(size)`` to its key logits (proportional attention).

``keep`` maps to ``r`` through token counts (docs/method.md, "ToMe"):

- the locations name every block of the range (as a saved plan does): each location's ratio is
  that block's, ``r_i = round(n_i * (1 - keep_i))`` of the ``n_i`` patch tokens entering it;
- otherwise (the default placements, or any sparser list): merging starts at the stage's first
  location and one ``r`` is used in every block, the one whose patch-token count after the
  stage's last block comes nearest to ``int(N0 * c)``, ``c`` the cumulative keep of the stage's
  last location, i.e. the count dTPS/DynamicViT keep there (ties to the smaller r);
- its setting ``r`` (``--variant-arg r=8``, ``variant_args={"r": 8}``) gives ``r`` itself,
  in place of keep ratios.

As in ToMe, a block merges at most half of its unprotected tokens (``r`` is clamped there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from vitcompress.method import merge_count
from vitcompress.modules.reducers import MergeReducer
from vitcompress.variants.base import Block, Location, ModelMap, Plan, Variant, VariantRefusal
from vitcompress.variants.fuses import Fuse, Merge
from vitcompress.variants.registry import register_variant
from vitcompress.variants.scorers import MatchingScorer, Scorer, keys_from_an_earlier_stage


def _merging_blocks(model_map: ModelMap, first: Location) -> list[Block]:
    """The blocks of ``first``'s stage from it to the stage's end; a class-attention block (keys
    from elsewhere) ends the range. A block that pools its keys (spatial-reduction attention) is
    refused: its keys are not its tokens, so neither the matching nor the sizes apply."""
    blocks = []
    for block in model_map.blocks[first.block :]:
        keys = block.attention.key_tokens
        if block.stage != first.stage or block.tokens <= 1 or (keys or 0) > block.tokens:
            break
        if keys is not None and keys < block.tokens:
            raise VariantRefusal(
                f"block {block.index} ({block.attention.path}) attends over {keys} pooled keys "
                f"for its {block.tokens} tokens: tome matches tokens by their keys and weighs "
                "keys by the tokens' sizes, so it is refused on this stage"
            )
        blocks.append(block)
    return blocks


def _window_r(location: Location, r: int | None) -> int:
    """Tokens merged in each window: ``r`` where given, else what ``keep`` leaves, at most half of
    a window's tokens (bipartite matching pairs each with one of the other half)."""
    tokens = location.patch_tokens
    wanted = r if r is not None else round(tokens * (1.0 - location.keep))
    return min(wanted, tokens // 2)


def _counts_after(n0: int, rs: list[int]) -> list[int]:
    counts, n = [], n0
    for r in rs:
        n -= r
        counts.append(n)
    return counts


def _clamped(n0: int, r: int, blocks: int) -> list[int]:
    """ToMe's per-block r: at most half the patch tokens present (prefix tokens protected)."""
    rs, n = [], n0
    for _ in range(blocks):
        step = merge_count(n, r, 0)
        rs.append(step)
        n -= step
    return rs


def fit_r(n0: int, blocks: int, target: int) -> int:
    """The ``r`` whose patch-token count after ``blocks`` blocks is nearest ``target`` (ties: the
    smaller r, which merges less)."""
    best, best_gap = 0, None
    for r in range(n0 // 2 + 1):
        gap = abs(_counts_after(n0, _clamped(n0, r, blocks))[-1] - target)
        if best_gap is None or gap < best_gap:
            best, best_gap = r, gap
    return best


@dataclass(frozen=True, kw_only=True)
class TokenMerging(Variant):
    scorer: Scorer = MatchingScorer()
    fuse: Fuse = Merge()
    resorts_tokens: bool = False  # survivors stay in their original order
    policies: tuple[str, ...] = ("score",)
    single_location: bool = True
    r: int | None = None  # tokens merged per block, in place of keep ratios

    @property
    def tracks_sizes(self) -> bool:
        return True

    @property
    def keep_setting(self) -> str | None:
        return "r" if self.r is not None else None

    def amount_text(self, locations: Sequence[Mapping[str, Any]], keep: Any) -> str | None:
        """``r=8``, or ``r=9,8`` where the clamp or a per-block plan varies it."""
        merged = [loc.get("merge_tokens") for loc in locations if isinstance(loc, Mapping)]
        if not merged or not all(isinstance(r, int) for r in merged):
            return super().amount_text(locations, keep)
        texts = sorted({str(r) for r in merged}, key=int, reverse=True)
        return "r=" + ",".join(texts)

    def reduction_refusal(self, plan: Plan) -> str | None:
        return None  # its plan already fixed a merge count per block

    def location_for_count(self, present: int, location: Location, count: int) -> Location | None:
        """The merge count that leaves ``count`` tokens, within ToMe's bound (at most half of the
        tokens present merged), and the count recorded with it."""
        merged = present - count
        if merged > merge_count(present, merged, 0):
            return None
        changed = super().location_for_count(present, location, count)
        return None if changed is None else dataclasses.replace(changed, keep_tokens=count)

    def plan_locations(self, model_map: ModelMap, locations: list[Location]) -> list[Location]:
        merge_r = self.r
        # A windowed block merges within each window, r of its tokens there, and restores them
        # all before its output: its own block is all it acts on.
        planned: list[Location] = [
            dataclasses.replace(loc, merge_tokens=_window_r(loc, merge_r))
            for loc in locations
            if loc.windows
        ]
        locations = [loc for loc in locations if not loc.windows]
        for stage in dict.fromkeys(loc.stage for loc in locations):
            given = [loc for loc in locations if loc.stage == stage]
            blocks = _merging_blocks(model_map, given[0])
            n0 = blocks[0].tokens - blocks[0].prefix_tokens
            if merge_r is None and [loc.block for loc in given] == [b.index for b in blocks]:
                rs, n = [], n0
                for loc in given:  # a ratio per block: the form a saved plan is written in
                    r = round(n * (1.0 - loc.keep))
                    if r > merge_count(n, r, 0):
                        raise VariantRefusal(
                            f"{loc.keep:g} at block {loc.block} merges {r} of {n} tokens; ToMe "
                            f"merges at most half of a block's tokens (keep >= 0.5 per block)",
                            "keep",
                        )
                    rs.append(r)
                    n -= r
            else:
                beyond = [loc.block for loc in given if loc.block > blocks[-1].index]
                if beyond:
                    raise VariantRefusal(
                        f"{beyond} lie after block {blocks[-1].index}, where tome's merging in "
                        f"every block from block {given[0].block} ends",
                        "locs",
                    )
                if merge_r is None:
                    target = int(n0 * given[-1].cumulative_keep)
                    merge_r = fit_r(n0, len(blocks), target)
                rs = _clamped(n0, merge_r, len(blocks))
            after = _counts_after(n0, rs)
            before = [n0, *after[:-1]]
            for step, (block, r, n, kept) in enumerate(
                zip(blocks, rs, before, after, strict=True), start=1
            ):
                planned.append(
                    dataclasses.replace(
                        given[0],
                        block=block.index,
                        step=step,
                        keep=kept / n,
                        cumulative_keep=kept / n0,
                        patch_tokens=n0,
                        keep_tokens=kept,
                        merge_tokens=r,
                    )
                )
        return sorted(planned, key=lambda loc: loc.block)

    def refusal(self, model_map: ModelMap, plan: Plan) -> str | None:
        scored = super().refusal(model_map, plan)
        if scored is not None:
            return scored
        for loc in plan.locations:
            block = model_map.blocks[loc.block]
            if block.windows is not None and block.windows.score_slots is not None:
                return (
                    f"block {block.index} ({block.path}): its attention is factorised, and the "
                    "attention that scores its tokens holds them frame by frame, a class token "
                    "copied into each frame: tome matches tokens by that attention's keys, so "
                    "it is refused there"
                )
            if block.windows is not None and block.score_blocker is not None:
                return (
                    f"block {block.index}: {block.score_blocker}; tome matches tokens by that "
                    "attention's keys, so it is refused there"
                )
            keys = block.attention.key_tokens
            # A block whose attention runs whole within one window over its grid (MViTv2's
            # pooling attention) may pool its keys: they are not the window's tokens.
            if block.windows is not None and keys is not None and keys < block.windows.tokens:
                return (
                    f"block {block.index} ({block.attention.path}) attends over {keys} pooled "
                    f"keys for its {block.windows.tokens} tokens: tome matches tokens by their "
                    "keys, so it is refused there"
                )
        found = keys_from_an_earlier_stage(model_map, plan)
        if found is not None:
            where, first = found
            return (
                f"{where}, merged from block {first} on, without their sizes: proportional "
                "attention cannot reach it, so tome is refused"
            )
        return None

    def build_reducer(self, block: Block, location: Location, plan: Plan) -> nn.Module:
        # Padded windows come in groups of fewer real tokens: with a keep ratio (no r given),
        # each group merges its own share; a given r is ToMe's own setting, the same everywhere.
        padded = block.windows is not None and block.windows.padded
        share = location.keep if padded and self.r is None else None
        return MergeReducer(
            prefix_tokens=block.prefix_tokens,
            r=location.merge_tokens or 0,
            keep=share,
            fuse=self.fuse,
        )


@register_variant
def tome(r: int | None = None, restore: str = Merge.restore_default) -> Variant:
    """``r``: the tokens merged in every block from the first location on (ToMe's own setting),
    in place of keep ratios. ``restore``: how a merged token comes back where the model reads
    tokens by position (dense outputs, grid ops): delta (each token its group's value now plus its
    own offset then), host (ToMe's unmerge), value or zero; default delta."""
    if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
        raise VariantRefusal(f"r: must be a whole number of tokens >= 0, got {r!r}", "variant_args")
    return TokenMerging(
        name="tome",
        summary="merges r tokens in every block by bipartite matching on the keys (ToMe)",
        report_order=4,
        r=r,
        restore=restore,
    )
