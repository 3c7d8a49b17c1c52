"""``--variant``, ``--keep``, ``--locs`` and ``--policy``: the plan's options as text, and its errors
in the words of the command line.

``vitcompress.graph.plan.make_plan`` takes typed lists and its errors name its parameters
(``keep``, ``locs``); here the text a user typed becomes those lists, and an error that names a
parameter is told with the option the user typed instead.
"""

from __future__ import annotations

from vitcompress.graph.plan import PlanError

# make_plan's parameters -> the options that set them.
PLAN_OPTIONS = {"keep": "--keep", "locs": "--locs", "variant": "--variant", "policy": "--policy"}


def parse_keep(text: str | None) -> list[float] | None:
    """``"0.7"`` or ``"0.7,0.6,0.5"`` -> keep ratios; ``None`` (option not given) -> ``None``."""
    if text is None:
        return None
    try:
        return [float(part) for part in str(text).split(",") if part.strip()]
    except ValueError:
        raise PlanError(f"must be a number or a comma list of numbers, got {text!r}",
                        "keep") from None


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
