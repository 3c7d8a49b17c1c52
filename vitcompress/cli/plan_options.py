"""``--variant``, ``--keep``, ``--locs`` and ``--policy``: the plan's options as text, and its errors
in the words of the command line.

``vitcompress.graph.plan.make_plan`` takes typed lists and its errors name its parameters
(``keep``, ``locs``); here the text a user typed becomes those lists, and an error that names a
parameter is told with the option the user typed instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import click

from vitcompress.graph.plan import PlanError
from vitcompress.method import CumulativeKeep

# make_plan's parameters -> the options that set them.
PLAN_OPTIONS = {
    "keep": "--keep",
    "locs": "--locs",
    "variant": "--variant",
    "policy": "--policy",
    "keep_cumulative": "--keep-cumulative",
}


def parse_keep(text: str | CumulativeKeep | None) -> list[float] | CumulativeKeep | None:
    """``"0.7"`` or ``"0.7,0.6,0.5"`` -> keep ratios; ``None`` (option not given) -> ``None``.
    A ``--keep-cumulative`` list (see :func:`keep_cumulative_option`) passes through."""
    if text is None or isinstance(text, CumulativeKeep):
        return text
    try:
        return [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise PlanError(
            f"must be a number or a comma list of numbers, got {text!r}", "keep"
        ) from None


def parse_keep_cumulative(text: str) -> CumulativeKeep:
    """``"0.7,0.49,0.343"`` -> cumulative fractions, checked against the model when planned."""
    try:
        fractions = [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise PlanError(
            f"must be a comma list of numbers, got {text!r}", "keep_cumulative"
        ) from None
    if not fractions:
        raise PlanError("must not be empty", "keep_cumulative")
    for value in fractions:  # early, before the model loads; the rest needs the model's stages
        if not 0.0 < value <= 1.0:
            raise PlanError(f"must be in (0, 1], got {value}", "keep_cumulative")
    return CumulativeKeep(tuple(fractions))


def keep_cumulative_option(command: Callable) -> Callable:
    """``--keep-cumulative a,b,c`` next to a command's ``--keep``: the official configs' keep list
    (fractions of the stage's initial patch count after each location). Given, it reaches the
    command as its ``keep`` (a :class:`CumulativeKeep`, which :func:`parse_keep` passes on).

    The two exclude each other. One from a recipe and one from the command line is no conflict:
    the command line wins, as it does for every option.
    """
    command = click.option(
        "--keep-cumulative",
        default=None,
        metavar="A,B,C",
        help="Instead of --keep (dtps, dynamicvit): the fraction of the initial patch count kept "
        "after each location, as official configs give it (0.7,0.49,0.343 = --keep 0.7; "
        "int(N0 * fraction) tokens). Restarts at each stage of a pyramid.",
    )(command)

    @functools.wraps(command)
    def wrapper(*args, keep, keep_cumulative, **kwargs):
        if keep_cumulative is not None:
            if keep is not None:
                keep, keep_cumulative = _one_keep(keep, keep_cumulative)
            if keep_cumulative is not None:
                keep = parse_keep_cumulative(keep_cumulative)
        return command(*args, keep=keep, **kwargs)

    return wrapper


def _one_keep(keep: str, keep_cumulative: str) -> tuple[str | None, str | None]:
    """Both options set: the one from the command line wins over one from a recipe (click's
    default map); both from the same place is a conflict."""
    context = click.get_current_context()
    from_recipe = click.core.ParameterSource.DEFAULT_MAP
    keep_source = context.get_parameter_source("keep")
    cumulative_source = context.get_parameter_source("keep_cumulative")
    if keep_source == from_recipe and cumulative_source != from_recipe:
        return None, keep_cumulative
    if cumulative_source == from_recipe and keep_source != from_recipe:
        return keep, None
    raise PlanError("--keep and --keep-cumulative exclude each other; give one")


def parse_locs(text: str | None) -> list[int] | None:
    """``"3,6,9"`` -> block indices; ``None`` (option not given) -> ``None``."""
    if text is None:
        return None
    try:
        return [int(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise PlanError(f"must be a comma list of integers, got {text!r}", "locs") from None


def plan_error_line(error: PlanError) -> str:
    """The error as the command line says it: ``--keep must be in (0, 1], got 1.5``."""
    option = PLAN_OPTIONS.get(error.parameter or "")
    return f"{option} {error.detail}" if option else str(error)
