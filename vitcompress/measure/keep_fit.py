"""Keep chosen for a GMACs budget: the largest keep ratio, the same at every location, whose
compressed model costs at most a given share of the base's MACs, found by counting.

A keep ratio says how many tokens a location keeps, not what the model then costs: that depends
on where the locations are, what runs outside them (a windowed block's attention, a conv stage)
and on the method's own work. Asked for a budget instead, the keep is searched on a grid of
``step``; every keep tried is compressed and its MACs counted, so the answer is measured, not
modelled: its own cost within the budget, the next keep on the grid over it (or refused).

It sits above the compilation and the counter it drives: ``compress_within_gmacs`` for a model,
``compress_planned`` for the commands, whose keep may be such a budget.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from vitcompress.api import compress_loaded
from vitcompress.compilation.compression import (
    capture_and_map,
    compress_copy,
    compress_mapped,
    resolve_input_size,
)
from vitcompress.compilation.metadata import attach, compression_info
from vitcompress.compilation.plan import PlanError, resolve_variant
from vitcompress.loading import LoadedModel, ModelLoadError
from vitcompress.measure.macs import count_macs
from vitcompress.status import step
from vitcompress.variants import Variant

PARAMETER = "keep_for_gmacs_ratio"
NONE_TAKEN = "no keep tried is taken by this method here"
ATTRIBUTE = "vitcompress_keep_fit"  # what was found, on the compressed model


@dataclass(frozen=True)
class GmacsRatio:
    """Keep given as a budget: ``ratio`` of the base's GMACs, the keep searched in steps of
    ``step``. The commands pass it where a keep is taken (:func:`compress_planned`)."""

    ratio: float
    step: float = 0.01

    def __post_init__(self) -> None:
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
            raise PlanError(f"must be a number, got {ratio!r}", PARAMETER)
        if not (math.isfinite(ratio) and ratio > 0):
            raise PlanError(f"must be a finite number above 0, got {ratio:g}", PARAMETER)
        if not (0 < self.step <= 0.1 and abs(1 / self.step - round(1 / self.step)) < 1e-9):
            raise PlanError(
                f"its step must divide 1 and be at most 0.1, got {self.step:g}", PARAMETER
            )
        object.__setattr__(self, "ratio", float(ratio))


@dataclass(frozen=True)
class KeepFit:
    """What :func:`fit_keep` found: ``keep`` costs ``cost`` of the base's MACs; ``next_cost`` is
    the cost of the next keep on the grid, ``step`` above (``None`` when ``keep`` is 1 or the
    method refuses that keep: it would remove no token); ``tries``: the keeps compressed."""

    gmacs_ratio: float
    step: float
    keep: float
    cost: float
    next_cost: float | None
    tries: int

    def to_json(self) -> dict[str, float | int | None]:
        return {
            "gmacs_ratio": self.gmacs_ratio,
            "step": self.step,
            "keep": self.keep,
            "cost": self.cost,
            "next_cost": self.next_cost,
            "tries": self.tries,
        }

    def text(self) -> str:
        """``keep 0.62: the largest (in steps of 0.01) within 0.85 of the base's GMACs (0.8480;
        0.63 costs 0.8502), 8 keeps tried``: four places, where three would show 0.850 for a
        cost over 0.85."""
        after = (
            f"; {self.keep + self.step:g} costs {self.next_cost:.4f}"
            if self.next_cost is not None
            else ""
        )
        return (
            f"keep {self.keep:g}: the largest (in steps of {self.step:g}) within "
            f"{self.gmacs_ratio:g} of the base's GMACs ({self.cost:.4f}{after}), "
            f"{self.tries} keeps tried"
        )


def fit_keep(cost: Callable[[float], float | None], target: GmacsRatio) -> KeepFit:
    """The largest keep on ``target``'s grid whose ``cost`` (its MACs over the base's, counted on
    the compressed model; ``None``, or a :class:`PlanError` raised, where the method refuses that
    keep) is at most ``target.ratio``.

    The keeps a method takes are assumed to be one range and keep 1 (below it ToMe cannot merge
    as many tokens as asked; above it a keep removes no token), and the cost to grow with the
    keep within it. So: keep 1 first; then down in tenths to the first keep within the budget (a
    refusal met after a keep it took is the range's bottom, found by halving); then halving
    between that keep and the one above it that was over the budget or refused. The keep found
    is within the budget and the next step up is over it or refused, both tried.
    """
    steps = round(1 / target.step)
    tried: dict[int, float | None] = {}
    refusals: list[str] = []  # what ``cost`` raised, for the line where no keep is taken

    def at(index: int) -> float | None:
        if index not in tried:
            try:
                tried[index] = cost(index / steps)
            except PlanError as refused:
                refusals.append(str(refused))
                tried[index] = None
        return tried[index]

    def fit(within: int, over: int) -> KeepFit:
        while over - within > 1:  # at(within) within the budget; at(over) over it, or refused
            middle = (within + over) // 2
            if _within(at(middle), target):
                within = middle
            else:
                over = middle
        found = at(within)
        assert found is not None
        next_cost = tried.get(over) if over == within + 1 else None
        return KeepFit(target.ratio, target.step, within / steps, found, next_cost, len(tried))

    if _within(at(steps), target):
        return fit(steps, steps)
    over, tenth = steps, max(1, steps // 10)
    for index in [*range(steps - tenth, 0, -tenth), 1]:
        if index >= over:
            continue
        if at(index) is None:
            if not any(tried[i] is not None for i in tried if i > index and i < steps):
                over = index  # above the keeps it takes: removes no token
                continue
            bottom = _lowest_taken(at, index, over)
            if _within(at(bottom), target):
                return fit(bottom, over)
            raise _out_of_reach(target, bottom, at(bottom), steps)
        if _within(at(index), target):
            return fit(index, over)
        over = index
    taken = [i for i, c in tried.items() if c is not None]
    if not taken and refusals:
        # Most keeps were refused for a reason that is the method's on this model (ToMe on
        # pooled keys), not a keep's: that line says why.
        reason, count = Counter(refusals).most_common(1)[0]
        raise PlanError(
            f"{NONE_TAKEN}; {count} of the {len(tried)} keeps tried were refused: {reason}",
            PARAMETER,
        )
    if not taken:
        raise PlanError(NONE_TAKEN, PARAMETER)
    bottom = min(taken)
    raise _out_of_reach(target, bottom, tried[bottom], steps)


def _within(cost: float | None, target: GmacsRatio) -> bool:
    return cost is not None and cost <= target.ratio


def _lowest_taken(at: Callable[[int], float | None], refused: int, taken: int) -> int:
    """The lowest keep index in ``(refused, taken]`` the method takes, by halving."""
    while taken - refused > 1:
        middle = (refused + taken) // 2
        if at(middle) is None:
            refused = middle
        else:
            taken = middle
    return taken


def _out_of_reach(target: GmacsRatio, index: int, cost: float | None, steps: int) -> PlanError:
    return PlanError(
        f"{target.ratio:g} is out of reach: the smallest keep the method takes here, "
        f"{index / steps:g}, costs {cost:.3f} of the base's GMACs (what runs outside the "
        "locations, and the method's own work, cost more than that)",
        PARAMETER,
    )


def compress_within_gmacs(
    model: nn.Module,
    variant: str | Variant = "etps",
    gmacs_ratio: float | GmacsRatio = 0.85,
    locs: list[int] | None = None,
    input_size: tuple[int, ...] | None = None,
    policy: str = "score",
    variant_args: dict[str, Any] | None = None,
) -> nn.Module:
    """:func:`vitcompress.compress` with a budget in place of ``keep``: the largest keep (in steps
    of 0.01, the same at every location) whose compressed model costs at most ``gmacs_ratio`` of
    ``model``'s MACs (batch 1, as ``count_macs`` counts). What was found
    (:meth:`KeepFit.to_json`) is attached as ``vitcompress_keep_fit``; the plan records the keep.
    """
    if compression_info(model) is not None:
        raise ModelLoadError("the model is already compressed; compress its base model instead")
    target = gmacs_ratio if isinstance(gmacs_ratio, GmacsRatio) else GmacsRatio(gmacs_ratio)
    method = resolve_variant(variant, variant_args)
    if method.keep_setting is not None:
        raise PlanError(
            f"{PARAMETER} and {method.name}'s {method.keep_setting} exclude each other; give one"
        )
    size = resolve_input_size(model, input_size)
    captured, model_map = capture_and_map(model, size)
    device = captured.example.device
    base_macs = count_macs(model, size, device)

    def cost(keep: float) -> float:
        with step(f"counting the MACs at keep {keep:g}"):
            compressed = compress_copy(
                model, captured, model_map, size, method, [keep], locs, policy
            )  # a PlanError: this keep is refused (``fit_keep`` steps over it)
            return count_macs(compressed, size, device) / base_macs

    fit = fit_keep(cost, target)
    compressed = compress_mapped(model, captured, model_map, size, method, [fit.keep], locs, policy)
    attach(compressed, **{ATTRIBUTE: fit.to_json()})
    return compressed


def compress_planned(
    loaded: LoadedModel, variant: str | Variant, keep: Any, locs: list[int] | None, policy: str
) -> LoadedModel:
    """:func:`vitcompress.api.compress_loaded`, where ``keep`` may also be a :class:`GmacsRatio`
    budget (``--keep-for-gmacs-ratio``)."""
    if not isinstance(keep, GmacsRatio):
        return compress_loaded(loaded, variant=variant, keep=keep, locs=locs, policy=policy)
    model = compress_within_gmacs(loaded.model, variant, keep, locs, loaded.input_size, policy)
    attach(model, vitcompress_source=loaded.source)
    return LoadedModel(model=model, source=loaded.source, input_size=loaded.input_size)
