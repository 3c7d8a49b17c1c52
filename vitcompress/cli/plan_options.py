"""``--variant``, ``--keep``, ``--locs``, ``--policy`` and ``--tome-r``: the plan's options as text,
and its errors in the words of the command line.

``vitcompress.graph.plan.make_plan`` takes typed lists and its errors name its parameters
(``keep``, ``locs``); here the text a user typed becomes those lists, and an error that names a
parameter is told with the option the user typed instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import click

from vitcompress.graph.plan import PlanError
from vitcompress.loading import is_artifact_directory
from vitcompress.method import CumulativeKeep, KeepListError, MergesPerBlock
from vitcompress.variants import variant_names

# make_plan's parameters -> the options that set them.
PLAN_OPTIONS = {
    "keep": "--keep",
    "locs": "--locs",
    "variant": "--variant",
    "policy": "--policy",
    "keep_cumulative": "--keep-cumulative",
    "tome_r": "--tome-r",
}


class VariantChoice(click.Choice):
    """``--variant``'s choices: the variants registered when the command line is read, so a
    method registered by importing its module is offered without editing the commands."""

    def __init__(self) -> None:
        super().__init__(variant_names())

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(variant_names())

    @choices.setter
    def choices(self, value) -> None:  # click.Choice.__init__ assigns it; the registry rules
        pass


def parse_keep(
    text: str | CumulativeKeep | MergesPerBlock | None,
) -> list[float] | CumulativeKeep | MergesPerBlock | None:
    """``"0.7"`` or ``"0.7,0.6,0.5"`` -> keep ratios; ``None`` (option not given) -> ``None``.
    A ``--keep-cumulative`` list (see :func:`keep_cumulative_option`) or a ``--tome-r`` count
    (:func:`tome_r_option`) passes through."""
    if text is None or isinstance(text, CumulativeKeep | MergesPerBlock):
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


def tome_r_option(command: Callable) -> Callable:
    """``--tome-r R`` next to a command's ``--keep``: ToMe's native setting, R tokens merged in
    every block from the first location on. Given, it reaches the command as its ``keep`` (a
    :class:`MergesPerBlock`); it excludes ``--keep`` and ``--keep-cumulative`` (one from a recipe
    yields to one on the command line, as for ``--keep-cumulative``). Apply it above
    :func:`keep_cumulative_option`."""
    command = click.option(
        "--tome-r",
        default=None,
        type=int,
        metavar="R",
        help="Instead of --keep (tome only): tokens merged in every block from the first "
        "location on, ToMe's r.",
    )(command)

    @functools.wraps(command)
    def wrapper(*args, keep, tome_r, **kwargs):
        if tome_r is not None:
            other = keep if keep is not None else kwargs.get("keep_cumulative")
            if other is not None and not _tome_r_wins():
                tome_r = None
        if tome_r is not None:
            try:
                keep = MergesPerBlock(tome_r)
            except KeepListError as e:
                raise PlanError(str(e), "tome_r") from None
            if "keep_cumulative" in kwargs:
                kwargs["keep_cumulative"] = None
        return command(*args, keep=keep, **kwargs)

    return wrapper


def _tome_r_wins() -> bool:
    """``--tome-r`` and ``--keep``/``--keep-cumulative`` both set: the command line wins over a
    recipe; both from the same place is a conflict."""
    context = click.get_current_context()
    from_recipe = click.core.ParameterSource.DEFAULT_MAP
    unset = {None, click.core.ParameterSource.DEFAULT}
    keep_sources = {context.get_parameter_source(n) for n in ("keep", "keep_cumulative")} - unset
    r_source = context.get_parameter_source("tome_r")
    if keep_sources == {from_recipe} and r_source != from_recipe:
        return True
    if r_source == from_recipe and from_recipe not in keep_sources:
        return False
    raise PlanError("--keep and --tome-r exclude each other; give one")


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


# What a plan file (``search``'s plan.yaml) may set: the plan's options, nothing else.
PLAN_FILE_KEYS = ("variant", "locs", "keep", "keep_cumulative", "policy", "tome_r")


def read_plan_file(path: str, accepted: Sequence[str]) -> dict[str, str]:
    """The plan file's values as the command line would have typed them (``locs: [3, 6, 9]`` ->
    ``"3,6,9"``), keyed by option name. A file that cannot be read, is no mapping, names another
    key or an unknown variant is a one-line :class:`PlanError`."""
    import yaml

    from vitcompress.graph.plan import VARIANTS

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise PlanError(f"--plan: cannot read {path}: {one_line_error(e)}") from None
    if not isinstance(data, dict) or not data:
        raise PlanError(f"--plan: {path} is not a mapping of plan options (variant, locs, keep)")
    values: dict[str, str] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in accepted:
            raise PlanError(
                f"--plan: {path} sets {key!r}; a plan file sets only "
                f"{', '.join(k.replace('_', '-') for k in accepted)}"
            )
        if isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value)
        values[name] = str(value)
    variant = values.get("variant")
    if variant is not None and variant not in VARIANTS:
        raise PlanError(
            f"--plan: {path} names the variant {variant!r}; choose from {', '.join(VARIANTS)}"
        )
    return values


# The forms of the keep ratios, one of which a plan gives.
_KEEP_FORMS = ("keep", "keep_cumulative", "tome_r")


def _typed_value(name: str, value: str, path: str) -> str | int:
    if name != "tome_r":
        return value  # parsed by the command, as typed text is
    try:
        return int(value)
    except ValueError:
        raise PlanError(f"--plan: {path} sets tome-r to {value!r}, not an integer") from None


def one_line_error(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def plan_file_option(
    command: Callable | None = None, *, compressed_model_keeps_plan: bool = False
) -> Callable:
    """``--plan FILE``: a plan file (``search`` writes one) sets the plan's options.

    ``compressed_model_keeps_plan``: the command uses a compressed ``--model``'s own plan
    (finetune), so a plan file with one is refused rather than ignored.

    Options typed on the command line override the file, as they override a ``--recipe``; the
    file overrides a recipe. ``--keep``, ``--keep-cumulative`` and ``--tome-r`` count as one:
    typing any of them replaces the file's keep ratios. Place it above the options that fold
    them (``tome_r_option``, ``keep_cumulative_option``).
    """
    if command is None:
        return functools.partial(
            plan_file_option, compressed_model_keeps_plan=compressed_model_keeps_plan
        )
    command = click.option(
        "--plan",
        "plan_file",
        type=click.Path(dir_okay=False, exists=True),
        default=None,
        metavar="FILE",
        help="A plan file (variant, locs, keep), e.g. the plan.yaml of vitcompress search; "
        "options given on the command line override it.",
    )(command)

    @functools.wraps(command)
    def wrapper(*args, plan_file, **kwargs):
        if plan_file is None:
            return command(*args, **kwargs)
        context = click.get_current_context()
        spec = kwargs.get("model_spec")
        if compressed_model_keeps_plan and spec and is_artifact_directory(spec):
            raise PlanError(
                f"--plan: {spec} is a compressed model and keeps its own plan; pass its base "
                "model to use the plan file"
            )
        accepted = [k for k in PLAN_FILE_KEYS if k in kwargs]
        values = read_plan_file(plan_file, accepted)
        typed = {
            name
            for name in accepted
            if context.get_parameter_source(name)
            in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
        }
        keep_typed = bool(typed & set(_KEEP_FORMS))
        for name, value in values.items():
            if name in typed or (name in _KEEP_FORMS and keep_typed):
                continue
            if name in _KEEP_FORMS:  # the file's keep form replaces a recipe's other form
                for other in _KEEP_FORMS:
                    if other in kwargs:
                        kwargs[other] = None
            kwargs[name] = _typed_value(name, value, plan_file)
        return command(*args, **kwargs)

    return wrapper
