"""A compression plan: which variant, at which blocks, keeping how much. Derived from a model map.

``make_plan`` takes typed values (``keep: list[float]``, ``locs: list[int] | None``); reading them
from text is the command line's business. Its errors name its own parameters (``keep``,
``locs``), which the command line turns into its option names.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from vitcompress.analysis.model_map import ModelMap
from vitcompress.compilation.placement import (
    default_locs,
    describe_blocks,
    reduces_tokens,
    token_stages,
    window_runs,
)
from vitcompress.errors import UserError
from vitcompress.method import SELECTION_POLICIES
from vitcompress.variants import (
    AFTER_ATTENTION,
    UnknownVariantError,
    Variant,
    VariantRefusal,
    get_variant,
)
from vitcompress.variants import VARIANTS as VARIANTS  # the registry's live, read-only view

POLICIES = SELECTION_POLICIES


class PlanError(ValueError, UserError):
    """A plan that cannot be applied to this model; the message is one line for the user.

    ``parameter`` names the argument of :func:`make_plan` at fault (``"keep"``, ``"locs"``,
    ``"variant"``, ``"policy"``), and the message is ``f"{parameter} {detail}"``; it is ``None``
    when the plan as a whole does not fit the model (the message is then ``detail``).
    """

    def __init__(self, detail: str, parameter: str | None = None) -> None:
        self.detail = detail
        self.parameter = parameter
        super().__init__(f"{parameter} {detail}" if parameter else detail)


@dataclass
class Location:
    block: int  # 0-based block index
    stage: int
    step: int  # s = 1, 2, ... counted within the stage
    keep: float  # this location's keep ratio rho
    cumulative_keep: float  # product of the stage's keep ratios so far (rho**s when uniform)
    patch_tokens: int  # N0 of the stage (predictor variants keep a fraction of it)
    keep_tokens: int | None  # the static patch-token count kept, where the variant fixes it
    merge_tokens: int | None = None  # ToMe: tokens merged at this block (its r)
    # Windows per image where the block attends within windows: the counts above are then a
    # window's, each location reduces every window alike and its block restores them all.
    windows: int | None = None
    # The windowed blocks after this one that reduce by its choice (the method's
    # ``carry_windows``): each in the same windows, with no other location between.
    carried: tuple[int, ...] = ()
    # The per-token branches after this block and those it carries to that reduce by its
    # choice too (``Block.per_token_after``: DaViT's channel blocks' MLPs), by module path.
    carried_branches: tuple[str, ...] = ()


@dataclass
class Plan:
    method: Variant  # the method object, with its settings
    policy: str
    locations: list[Location]
    # Where ``kept_multiple`` rounded a count: block -> the patch tokens after it before and after.
    # Said in reports; not part of what the plan is (a plan rebuilt from the rounded ratios has
    # nothing left to round, and is the same plan).
    rounded_from: dict[int, tuple[int, int]] = field(default_factory=dict, compare=False)

    @property
    def kept_multiple(self) -> int | None:
        """The multiple the tokens after each location were rounded to (a method setting)."""
        return self.method.kept_multiple

    @property
    def variant(self) -> str:
        """The method's name, as users type it and artifacts record it."""
        return self.method.name

    @property
    def locs(self) -> list[int]:
        return [loc.block for loc in self.locations]

    @property
    def keep(self) -> list[float]:
        return [loc.keep for loc in self.locations]

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"variant": self.variant}
        if self.method.settings:  # only a method made with settings says them
            data["variant_args"] = self.method.settings
        return {
            **data,
            "policy": self.policy,
            "locs": self.locs,
            "keep": self.keep,
            "locations": [_location_json(loc) for loc in self.locations],
            **({"kept_multiple": self.kept_multiple} if self.kept_multiple else {}),
            **(
                {"rounded_from": {str(b): list(n) for b, n in self.rounded_from.items()}}
                if self.rounded_from
                else {}
            ),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        """The plan :meth:`to_json` wrote (``locs`` and ``keep`` there repeat the locations).

        A ``carry_windows`` setting recorded with no windowed location is left out: it changed
        nothing there, and :func:`make_plan` refuses it on a model without windowed blocks, where
        earlier versions took it; a model they saved with it loads."""
        settings = data.get("variant_args")
        if isinstance(settings, dict) and settings.get("carry_windows") is True:
            if not any(isinstance(loc, dict) and loc.get("windows") for loc in data["locations"]):
                rest = {k: v for k, v in settings.items() if k != "carry_windows"}
                data = {**data, "variant_args": rest}
        return cls(
            method=variant_from_json(data),
            policy=data["policy"],
            locations=[
                Location(
                    **{
                        **loc,
                        "carried": tuple(loc.get("carried", ())),
                        "carried_branches": tuple(loc.get("carried_branches", ())),
                    }
                )
                for loc in data["locations"]
            ],
            rounded_from={
                int(b): (int(n[0]), int(n[1])) for b, n in (data.get("rounded_from") or {}).items()
            },
        )


def variant_from_json(data: dict[str, Any]) -> Variant:
    """The method a plan's JSON names, with the settings it recorded."""
    try:
        return get_variant(str(data["variant"]), data.get("variant_args") or None)
    except (UnknownVariantError, VariantRefusal) as e:
        raise PlanError(str(e), "variant") from None


def _location_json(location: Location) -> dict[str, Any]:
    data = asdict(location)
    for optional in ("merge_tokens", "windows"):  # said only where they apply
        if data[optional] is None:
            del data[optional]
    for carried in ("carried", "carried_branches"):  # said only where there are any
        if data[carried]:
            data[carried] = list(data[carried])
        else:
            del data[carried]
    return data


def resolve_variant(variant: str | Variant, args: dict[str, Any] | None = None) -> Variant:
    """Where a method enters by name (``compress()``, the command line): the method object with
    its settings; below, every layer receives the object. Errors are one-line ``PlanError`` exceptions."""
    if isinstance(variant, Variant):
        if args:
            raise PlanError("settings go with a method's name, not with a method object", "variant")
        return variant
    try:
        return get_variant(variant, args)
    except UnknownVariantError as e:
        raise PlanError(str(e), "variant") from None
    except VariantRefusal as e:
        raise PlanError(e.detail, e.parameter) from None


def make_plan(
    model_map: ModelMap,
    method: Variant,
    keep: list[float],
    locs: list[int] | None = None,
    policy: str = "score",
) -> Plan:
    """The plan for ``model_map``: ``method`` at blocks ``locs`` (``None``: the paper's
    placements, :func:`default_locs`), keeping ``keep`` of the tokens at each (one ratio for
    all locations, or one per location); :func:`default_keep` gives the paper's ratio. A method
    made with a setting that replaces keep ratios (ToMe's ``r``) reads it instead."""
    if policy not in method.policies:
        known = policy in POLICIES
        raise PlanError(
            f"{policy!r} is {'not defined for ' + method.name if known else 'unknown'}; "
            f"choose from {', '.join(method.policies)}",
            "policy",
        )
    if method.carry_windows and not _windowed_blocks(model_map):
        raise PlanError(
            "carry_windows: no block of this model attends within windows and reduces tokens, "
            "so there is no windowed location's choice to carry; leave it off",
            "variant_args",
        )
    if not isinstance(keep, list | tuple):
        raise PlanError(f"must be a list of keep ratios, got {keep!r}", "keep")
    if locs is not None and not isinstance(locs, list | tuple):
        raise PlanError(f"must be a list of block indices or None, got {locs!r}", "locs")
    checked_locs = _checked_locs(model_map, method, locs)
    keeps = _checked_keeps(keep, len(checked_locs))
    locations = _locations(model_map, method, checked_locs, keeps)
    try:
        locations = method.plan_locations(model_map, locations)
    except VariantRefusal as e:
        raise PlanError(e.detail, e.parameter) from None
    if method.carry_windows:
        locations = _carry_windows(model_map, locations, method.carry_branches)
    elif method.carry_branches:
        locations = _carry_branches(model_map, locations)
    rounded_from: dict[int, tuple[int, int]] = {}
    if method.kept_multiple is not None:
        if method.keep_setting is not None:
            raise PlanError(
                f"kept_multiple rounds the counts keep ratios give; {method.name}'s "
                f"{method.keep_setting} fixes its counts itself: give one",
                "variant_args",
            )
        locations, rounded_from = round_kept_counts(model_map, method, locations)
    plan = Plan(method=method, policy=policy, locations=locations, rounded_from=rounded_from)
    refusal = (
        method.refusal(model_map, plan)
        or position_refusal(model_map, plan)
        or method.reduction_refusal(plan)
    )
    if refusal is not None:
        raise PlanError(refusal)
    return plan


def _checked_locs(model_map: ModelMap, method: Variant, locs: Sequence[int] | None) -> list[int]:
    """``locs`` (None: :func:`default_locs`) as block indices, each a block with tokens of its
    own to reduce, strictly increasing; anything else is a ``PlanError`` naming ``locs``."""
    depth = len(model_map.blocks)
    locs = list(default_locs(model_map, method.carry_windows) if locs is None else locs)
    if not locs:
        raise PlanError("must not be empty", "locs")
    for loc in locs:
        if isinstance(loc, bool) or not isinstance(loc, numbers.Integral):
            raise PlanError(f"must be block indices (integers), got {loc!r}", "locs")
        if not 0 <= loc < depth:
            raise PlanError(
                f"{loc} is out of range: the model has {depth} blocks (0..{depth - 1})", "locs"
            )
    for loc in locs:
        block = model_map.blocks[loc]
        if not reduces_tokens(block):
            core = block.attention
            stages = token_stages(model_map)
            choose = (
                f"choose among blocks {describe_blocks(stages)}"
                if stages
                else "no block of this model attends over its own tokens alone"
            )
            what = (
                f"is a class-attention block ({core.query_tokens} query token(s) over "
                f"{core.key_tokens} keys from earlier blocks)"
                if block.tokens <= 1
                else f"attends over {core.key_tokens} keys, more than its {block.tokens} tokens "
                "(keys joined from elsewhere, such as learned memory tokens)"
            )
            raise PlanError(
                f"{loc} {what}: it has no tokens of its own to reduce; {choose}", "locs"
            )
    locs = [int(loc) for loc in locs]
    if sorted(set(locs)) != locs:
        raise PlanError(f"must be strictly increasing without duplicates, got {locs}", "locs")
    return locs


def _checked_keeps(keep: Sequence[float], locations: int) -> list[float]:
    """One keep ratio in (0, 1] per location (one ratio given: the same at all); anything else
    is a ``PlanError`` naming ``keep``."""
    if not keep:
        raise PlanError("must not be empty", "keep")
    keeps = list(keep) * locations if len(keep) == 1 else list(keep)
    if len(keeps) != locations:
        raise PlanError(f"has {len(keeps)} values for {locations} locations", "keep")
    for rho in keeps:
        if isinstance(rho, bool) or not isinstance(rho, numbers.Real):
            raise PlanError(f"must be numbers, got {rho!r}", "keep")
    keeps = [float(rho) for rho in keeps]
    for rho in keeps:
        if not (0.0 < rho <= 1.0) or math.isnan(rho):
            raise PlanError(f"must be in (0, 1], got {rho}", "keep")
    return keeps


def _locations(
    model_map: ModelMap, method: Variant, locs: list[int], keeps: list[float]
) -> list[Location]:
    """A location per block of ``locs`` keeping its ratio of ``keeps``: of each window's tokens
    in a windowed block, else of the stage's patch tokens, cumulatively over the stage's earlier
    locations."""
    locations: list[Location] = []
    for block_index, rho in zip(locs, keeps, strict=True):
        block = model_map.blocks[block_index]
        stage = model_map.stages[block.stage]
        if block.windows is not None:  # every window alike, restored after the block
            windows = block.windows
            patches = windows.tokens - windows.prefix_tokens  # a leading prefix is kept
            locations.append(
                Location(
                    block=block_index,
                    stage=block.stage,
                    step=1,
                    keep=rho,
                    cumulative_keep=rho,
                    patch_tokens=patches,
                    keep_tokens=method.keep_tokens(patches, rho),
                    windows=windows.count,
                )
            )
            continue
        earlier = [loc for loc in locations if loc.stage == block.stage and loc.windows is None]
        cumulative = _cumulative([loc.keep for loc in earlier], rho)
        patch_tokens = math.prod(stage.grid)
        keep_tokens = method.keep_tokens(patch_tokens, cumulative)
        locations.append(
            Location(
                block=block_index,
                stage=block.stage,
                step=len(earlier) + 1,
                keep=rho,
                cumulative_keep=cumulative,
                patch_tokens=patch_tokens,
                keep_tokens=keep_tokens,
            )
        )
    return locations


def _cumulative(earlier: list[float], rho: float) -> float:
    """The cumulative keep of a location keeping ``rho`` after a stage's ``earlier`` ratios:
    ``rho ** s`` when they are all equal, else their product left to right."""
    if all(keep == rho for keep in earlier):
        return rho ** (len(earlier) + 1)
    return math.prod([*earlier, rho])


def round_kept_counts(
    model_map: ModelMap, method: Variant, locations: list[Location]
) -> tuple[list[Location], dict[int, tuple[int, int]]]:
    """Each location's tokens after it, prefix tokens included (a window's, in a windowed
    block), rounded to the nearest multiple of ``method.kept_multiple`` that the method can land
    on there (:meth:`Variant.location_for_count`): at least one patch token and fewer than were
    present, ties to the smaller; a location with no such multiple, one that removes nothing, or
    a padded window (its groups keep their own shares) is left as it is. Returns the locations
    and, for each one rounded, its patch tokens after it before and after rounding. A changed keep ratio
    changes the stage's cumulative keeps as :func:`make_plan` computes them."""
    multiple = method.kept_multiple
    assert multiple is not None
    present: dict[int, int] = {}  # patch tokens present in each stage (a fused one counts)
    rounded: list[Location] = []
    rounded_from: dict[int, tuple[int, int]] = {}
    for loc in locations:
        block = model_map.blocks[loc.block]
        windows = block.windows
        if loc.windows and windows is not None:
            before, prefix = loc.patch_tokens, windows.prefix_tokens
        else:
            before, prefix = present.get(loc.stage, loc.patch_tokens), block.prefix_tokens
        after = method.tokens_after(before, loc)
        padded = windows is not None and windows.padded
        if after < before and not padded and (prefix + after) % multiple:
            low = (prefix + after) // multiple * multiple - prefix
            candidates = sorted(
                (count for count in (low, low + multiple) if 0 < count < before),
                key=lambda count: (abs(count - after), count),
            )
            for count in candidates:
                changed = method.location_for_count(before, loc, count)
                if changed is not None:
                    rounded_from[loc.block] = (after, count)
                    loc, after = changed, count
                    break
        if not loc.windows:
            present[loc.stage] = after
        rounded.append(loc)
    return _recumulated(locations, rounded), rounded_from


def _recumulated(planned: list[Location], rounded: list[Location]) -> list[Location]:
    """``rounded`` with the cumulative keeps of every stage whose ratios the rounding changed
    computed again from them (a windowed location's is its own ratio)."""
    changed = {new.stage for old, new in zip(planned, rounded, strict=True) if old.keep != new.keep}
    result: list[Location] = []
    for loc in rounded:
        if loc.stage in changed:
            if loc.windows:
                loc = replace(loc, cumulative_keep=loc.keep)
            else:
                earlier = [e.keep for e in result if e.stage == loc.stage and not e.windows]
                loc = replace(loc, cumulative_keep=_cumulative(earlier, loc.keep))
        result.append(loc)
    return result


def _windowed_blocks(model_map: ModelMap) -> list[int]:
    """The blocks that attend within windows and can reduce tokens: where ``carry_windows``
    acts."""
    return [b.index for b in model_map.blocks if b.windows is not None and reduces_tokens(b)]


def _carry_windows(
    model_map: ModelMap, locations: list[Location], branches_too: bool
) -> list[Location]:
    """Each windowed location with the blocks after it that carry its choice: the rest of its
    run (:func:`window_runs`) up to the next location; and, ``branches_too``, the per-token
    branches after any of them (``Block.per_token_after``), which take the choice too."""
    located = {loc.block for loc in locations}
    carried: dict[int, tuple[int, ...]] = {}
    for run in window_runs(model_map, _windowed_blocks(model_map)):
        owner = None
        for index in run:
            if index in located:
                owner = index
                carried[owner] = ()
            elif owner is not None:
                carried[owner] += (index,)
    located_windows = []
    for loc in locations:
        if loc.windows:
            run = (loc.block, *carried.get(loc.block, ()))
            branches = _branches_after(model_map, run) if branches_too else ()
            loc = replace(loc, carried=carried.get(loc.block, ()), carried_branches=branches)
        located_windows.append(loc)
    return located_windows


def _carry_branches(model_map: ModelMap, locations: list[Location]) -> list[Location]:
    """Each windowed location with the per-token branches after its block
    (``Block.per_token_after``), which take its choice; no block carries it."""
    return [
        replace(loc, carried_branches=_branches_after(model_map, (loc.block,)))
        if loc.windows
        else loc
        for loc in locations
    ]


def _branches_after(model_map: ModelMap, blocks: tuple[int, ...]) -> tuple[str, ...]:
    """The module paths of the per-token branches after ``blocks``, in their order."""
    return tuple(b.path for index in blocks for b in model_map.blocks[index].per_token_after)


_MEETS = {
    "attention bias": "attention logits",
    "query/key table": "queries/keys",
    "token table": "tokens",
}


def position_refusal(model_map: ModelMap, plan: Plan) -> str | None:
    """One line naming the first position table that would see reduced tokens and cannot follow
    them, or the place where a reduced stage's tokens bypass its exit grid, else ``None``.

    Reductions act per stage (a stage's exit gives the next stage its full grid back). A
    predictor variant reduces before its block, so the whole block sees fewer tokens; an
    attention variant reduces after the block's attention residual, so only its MLP does.
    """
    first: dict[int, Location] = {}
    for loc in plan.locations:
        if loc.windows is None:  # a windowed block restores its tokens itself, tables unread
            first.setdefault(loc.stage, loc)
    for stage_index, loc in first.items():
        bypass = model_map.stages[stage_index].exit_bypass
        if bypass is not None:
            return (
                f"stage {stage_index}'s tokens reach the next stage at {bypass} without "
                "being laid out on their grid (an op there reads their order or count): "
                f"tokens reduced at block {loc.block} cannot follow, so {plan.variant} is "
                "refused rather than giving wrong logits"
            )
    for block in model_map.blocks:
        loc = first.get(block.stage)
        if loc is None or block.index < loc.block:
            continue
        for use in block.position_uses:
            after_attention = plan.method.placement == AFTER_ATTENTION
            if block.index == loc.block and after_attention and use.branch != "mlp":
                continue
            refusal = _table_refusal(use, block.index, loc.block, plan)
            if refusal is not None:
                return refusal
    return None


def _table_refusal(use, block: int, reduced_at: int, plan: Plan) -> str | None:
    """A position table read after a reduction is gathered by the kept tokens' positions
    (``modules/position_tables.py``); one line when it cannot be, else ``None``."""
    where = (
        f"block {block} ({use.path}) applies the position table {use.table} to its "
        f"{_MEETS[use.kind]} after the token reduction at block {reduced_at}"
    )
    if use.blocker is not None:
        return (
            f"{where}, and it cannot follow the kept tokens: {use.blocker}; so {plan.variant} "
            "is refused rather than giving wrong logits"
        )
    if use.neutral is None and not plan.method.keeps_grid_positions:
        return (
            f"{where}: {plan.variant}'s fused token has no grid position, and no row of that table is "
            "known to leave it unchanged (the table is not added, nor multiplied alone, nor "
            "told apart as the cos or the sin of a rotation x * cos + r(x) * sin), so "
            f"{plan.variant} is refused rather than guessing one"
        )
    return None
