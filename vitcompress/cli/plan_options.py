"""``--variant``, ``--variant-arg``, ``--keep``, ``--locs`` and ``--policy``: the plan's options as
text, and its errors in the words of the command line.

``vitcompress.compilation.plan.make_plan`` takes typed lists and its errors name its parameters
(``keep``, ``locs``); here the text a user typed becomes those lists, and an error that names a
parameter is told with the option the user typed instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import click

from vitcompress.compilation.plan import PlanError, resolve_variant
from vitcompress.loading import is_artifact_directory
from vitcompress.measure.keep_fit import GmacsRatio
from vitcompress.method import CumulativeKeep
from vitcompress.variants import variant_names
from vitcompress.workflows.inputs import PlanRequest

# make_plan's parameters -> the options that set them.
PLAN_OPTIONS = {
    "keep": "--keep",
    "locs": "--locs",
    "variant": "--variant",
    "policy": "--policy",
    "keep_cumulative": "--keep-cumulative",
    "keep_for_gmacs_ratio": "--keep-for-gmacs-ratio",
    "variant_args": "--variant-arg",
    "kept_multiple": "--kept-multiple",
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
    text: str | CumulativeKeep | GmacsRatio | None,
) -> list[float] | CumulativeKeep | GmacsRatio | None:
    """``"0.7"`` or ``"0.7,0.6,0.5"`` -> keep ratios; ``None`` (option not given) -> ``None``.
    A ``--keep-cumulative`` list (see :func:`keep_cumulative_option`) and a
    ``--keep-for-gmacs-ratio`` budget (:func:`keep_for_gmacs_option`) pass through."""
    if text is None or isinstance(text, CumulativeKeep | GmacsRatio):
        return text
    try:
        return [float(part) for part in _comma_list(text)]
    except ValueError:
        raise PlanError(
            f"must be a number or a comma list of numbers, got {text!r}", "keep"
        ) from None


def _comma_list(text: str | float) -> list[str]:
    """The items of a comma list (``[]`` for blank text). An empty item (``0.7,,0.5``,
    ``3,6,``) is a ``ValueError``, as a word is: dropped, it would shift the values given after
    it onto other locations."""
    if not str(text).strip():
        return []
    parts = [part.strip() for part in str(text).split(",")]
    if "" in parts:
        raise ValueError(f"an empty item in {text!r}")
    return parts


def parse_keep_cumulative(text: str) -> CumulativeKeep:
    """``"0.7,0.49,0.343"`` -> cumulative fractions, checked against the model when planned."""
    try:
        fractions = [float(part) for part in _comma_list(text)]
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
    option = click.option(
        "--keep-cumulative",
        default=None,
        metavar="A,B,C",
        help="Instead of --keep (dtps, dynamicvit): the fraction of the initial patch count kept "
        "after each location, as official configs give it (0.7,0.49,0.343 = --keep 0.7; "
        "int(N0 * fraction) tokens). Restarts at each stage of a pyramid.",
    )
    conflict = "--keep and --keep-cumulative exclude each other; give one"
    fold = functools.partial(
        _fold_keep_form,
        name="keep_cumulative",
        others=("keep",),
        conflict=conflict,
        parse=parse_keep_cumulative,
    )
    return _as_keep(option(command), "keep_cumulative", fold)


def keep_for_gmacs_option(command: Callable) -> Callable:
    """``--keep-for-gmacs-ratio R`` next to a command's ``--keep``: the largest keep, the same at
    every location, whose compressed model costs at most R of the base's GMACs (found by
    counting: :mod:`vitcompress.measure.keep_fit`). Given, it reaches the command as its
    ``keep`` (a :class:`GmacsRatio`). It excludes ``--keep`` and ``--keep-cumulative`` as they
    exclude each other: one from a recipe or plan file yields to the other typed on the command
    line. Apply it below :func:`keep_cumulative_option`."""
    option = click.option(
        "--keep-for-gmacs-ratio",
        "keep_for_gmacs_ratio",
        default=None,
        metavar="R",
        help="Instead of --keep: the largest keep (in steps of 0.01, the same at every "
        "location) whose compressed model needs at most R times the base's GMACs, found by "
        "compressing and counting (0.85: 85%).",
    )
    conflict = "--keep-for-gmacs-ratio excludes --keep and --keep-cumulative; give one"
    fold = functools.partial(
        _fold_keep_form,
        name="keep_for_gmacs_ratio",
        others=("keep", "keep_cumulative"),
        conflict=conflict,
        parse=lambda text: GmacsRatio(_parse_ratio(text)),
    )
    return _as_keep(option(command), "keep_for_gmacs_ratio", fold)


def _as_keep(command: Callable, parameter: str, fold: Callable[[Any, str | None], Any]) -> Callable:
    """``command`` with its ``parameter`` (another form of the keep ratios) folded into its
    ``keep`` by ``fold(keep, value)``, so that the command sees only ``keep``."""

    @functools.wraps(command)
    def wrapper(*args, keep, **kwargs):
        value = kwargs.pop(parameter)
        return command(*args, keep=fold(keep, value), **kwargs)

    return wrapper


def _parse_ratio(text: str | float) -> float:
    try:
        return float(text)
    except ValueError:
        raise PlanError(f"must be a number, got {text!r}", "keep_for_gmacs_ratio") from None


def _fold_keep_form(
    keep: Any,
    value: str | None,
    name: str,
    others: tuple[str, ...],
    conflict: str,
    parse: Callable[[str], Any],
) -> Any:
    """Another form of the keep ratios, option ``name`` given as ``value``, folded into ``keep``:
    parsed when given alone; beside a ``keep`` from ``others``, the one typed on the command line
    wins over a recipe's or plan file's, and both from one place are ``conflict``."""
    if value is None:
        return keep
    if keep is not None and not _first_wins((name,), others, conflict):
        return keep
    return parse(value)


def _first_wins(first: tuple[str, ...], second: tuple[str, ...], conflict: str) -> bool:
    """Two forms of the keep ratios both set: the one typed on the command line wins over one
    from a recipe or plan file (click's default map); both from the same place is a conflict,
    ``conflict`` its one line. True when ``first`` wins."""
    context = click.get_current_context()
    from_recipe = click.core.ParameterSource.DEFAULT_MAP
    unset = {None, click.core.ParameterSource.DEFAULT}

    def sources(names: tuple[str, ...]) -> set:
        return {context.get_parameter_source(name) for name in names} - unset

    first_sources, second_sources = sources(first), sources(second)
    if second_sources == {from_recipe} and from_recipe not in first_sources:
        return True
    if first_sources == {from_recipe} and from_recipe not in second_sources:
        return False
    raise PlanError(conflict)


def kept_multiple_option(help_text: str) -> Callable[[Callable], Callable]:
    """``--kept-multiple N`` (``kept_multiple``: ``None`` or N >= 1), said as ``help_text``."""
    return click.option(
        "--kept-multiple",
        "kept_multiple",
        default=None,
        type=click.IntRange(min=1),
        metavar="N",
        help=help_text,
    )


def variant_args_option(command: Callable) -> Callable:
    """``--variant-arg KEY=VALUE`` (repeatable) next to a command's ``--variant``: the method's own
    settings (``vitcompress.variants.variant_settings``), values read as Python literals. The
    command receives ``variant`` as the method object, made once here with those settings.

    A setting that replaces the keep ratios (ToMe's ``r``) excludes ``--keep`` and
    ``--keep-cumulative``; one from a recipe or plan file yields to the other on the command
    line, and both from the same place is a conflict. Apply it above
    :func:`keep_cumulative_option`.
    """
    command = click.option(
        "--variant-arg",
        "variant_args",
        multiple=True,
        metavar="KEY=VALUE",
        help="A setting of the chosen variant, repeatable (tome: r=8, the tokens merged in every "
        "block, in place of --keep). `vitcompress variants` lists each method's settings.",
    )(command)
    command = kept_multiple_option(
        "Round the tokens present after each location (prefix tokens included) to the nearest "
        "multiple of N the method can keep (8: tensor-core tiles); the same as --variant-arg "
        "kept_multiple=N, recorded with the plan."
    )(command)

    @functools.wraps(command)
    def wrapper(*args, variant, variant_args, keep, kept_multiple, **kwargs):
        from vitcompress.cli.options import parse_model_args

        settings = parse_model_args(
            variant_args or (), "--variant-arg", PlanError
        )  # None: a plan file cleared it
        if kept_multiple is not None:
            given = (settings or {}).get("kept_multiple", kept_multiple)
            # The one typed on the command line wins over one from a recipe or plan file.
            conflict = f"--kept-multiple {kept_multiple} and --variant-arg kept_multiple={given} differ; give one"
            if given != kept_multiple and not _first_wins(
                ("kept_multiple",), ("variant_args",), conflict
            ):
                kept_multiple = given
            settings = {**(settings or {}), "kept_multiple": kept_multiple}
        method = resolve_variant(variant, settings) if variant is not None else None
        if method is not None and method.keep_setting is not None:
            forms = ("keep", "keep_cumulative", "keep_for_gmacs_ratio")
            given = {"keep": keep, **{form: kwargs.get(form) for form in forms[1:]}}
            if any(value is not None for value in given.values()):
                named = ", ".join(
                    PLAN_OPTIONS[form] for form, value in given.items() if value is not None
                )
                conflict = (
                    f"{named} and --variant-arg {method.keep_setting} exclude each other; give one"
                )
                if _first_wins(("variant_args",), forms, conflict):
                    keep = None
                    for form in forms[1:]:
                        if form in kwargs:
                            kwargs[form] = None
                else:  # the command line's keep wins over the recipe's setting
                    method = resolve_variant(variant)
        return command(*args, variant=method, keep=keep, **kwargs)

    return wrapper


def parse_locs(text: str | None) -> list[int] | None:
    """``"3,6,9"`` -> block indices; ``None`` (option not given) -> ``None``."""
    if text is None:
        return None
    try:
        return [int(part) for part in _comma_list(text)]
    except ValueError:
        raise PlanError(f"must be a comma list of integers, got {text!r}", "locs") from None


def plan_error_line(error: PlanError) -> str:
    """The error as the command line says it: ``--keep must be in (0, 1], got 1.5``."""
    option = PLAN_OPTIONS.get(error.parameter or "")
    return f"{option} {error.detail}" if option else str(error)


# What a plan file (``search``'s plan.yaml) may set: the plan's options, nothing else.
PLAN_FILE_KEYS = (
    "variant",
    "locs",
    "keep",
    "keep_cumulative",
    "keep_for_gmacs_ratio",
    "policy",
    "variant_args",
)


def read_plan_file(path: str, accepted: Sequence[str]) -> dict[str, str | tuple[str, ...]]:
    """The plan file's values as the command line would have typed them (``locs: [3, 6, 9]`` ->
    ``"3,6,9"``), keyed by option name. A file that cannot be read, is no mapping, names another
    key or an unknown variant is a one-line :class:`PlanError`."""
    import yaml

    from vitcompress.compilation.plan import VARIANTS

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise PlanError(f"--plan: cannot read {path}: {one_line_error(e)}") from None
    if not isinstance(data, dict) or not data:
        raise PlanError(f"--plan: {path} is not a mapping of plan options (variant, locs, keep)")
    values: dict[str, str | tuple[str, ...]] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in accepted:
            raise PlanError(
                f"--plan: {path} sets {key!r}; a plan file sets only "
                f"{', '.join(k.replace('_', '-') for k in accepted)}"
            )
        if name == "variant_args":
            if not isinstance(value, dict):
                raise PlanError(f"--plan: {path} sets variant-args to {value!r}, not a mapping")
            values[name] = tuple(f"{k}={v!r}" for k, v in value.items())
            continue
        if isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value)
        values[name] = str(value)
    variant = values.get("variant")
    if variant is not None and variant not in VARIANTS:
        raise PlanError(
            f"--plan: {path} names the variant {variant!r}; choose from {', '.join(VARIANTS)}"
        )
    return values


# The forms of the keep ratios, one of which a plan gives (a method's settings may replace them).
_KEEP_FORMS = ("keep", "keep_cumulative", "keep_for_gmacs_ratio", "variant_args")


def one_line_error(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def plan_file_option(
    command: Callable | None = None, *, compressed_model_keeps_plan: bool = False
) -> Callable:
    """``--plan FILE``: a plan file (``search`` writes one) sets the plan's options.

    ``compressed_model_keeps_plan``: the command uses a compressed ``--model``'s own plan
    (finetune), so a plan file with one is refused rather than ignored.

    Options typed on the command line override the file, as they override a ``--recipe``; the
    file overrides a recipe. ``--keep``, ``--keep-cumulative`` and ``--variant-arg`` count as one:
    typing any of them replaces the file's keep ratios. Place it above the options that fold
    them (``variant_args_option``, ``keep_cumulative_option``).
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
        spec = context.params.get("model_spec")
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
        if "variant_args" in values and context.get_parameter_source("kept_multiple") in (
            click.core.ParameterSource.COMMANDLINE,
            click.core.ParameterSource.ENVIRONMENT,
        ):  # a typed --kept-multiple overrides the file's rounding
            values["variant_args"] = tuple(
                arg for arg in values["variant_args"] if not arg.startswith("kept_multiple=")
            )
        for name, value in values.items():
            if name in typed or (name in _KEEP_FORMS and keep_typed):
                continue
            if name in _KEEP_FORMS:  # the file's keep form replaces a recipe's other form
                for other in _KEEP_FORMS:  # not one the file gives too (keep and variant-args)
                    if other in kwargs and other not in values:
                        kwargs[other] = None
            kwargs[name] = value  # parsed by the command, as typed text is
        from_file = {
            name
            for name in values
            if name not in typed and not (name in _KEEP_FORMS and keep_typed)
        }
        try:
            return command(*args, **kwargs)
        except PlanError as error:
            # A value the user did not type: say where it came from.
            if error.parameter in from_file:
                detail = f"{error.detail} (set by --plan {plan_file})"
                raise PlanError(detail, error.parameter) from None
            raise

    return wrapper


# One default in every command: eTPS needs no training to work (its scores are the cls token's
# attention), so a plan made without a variant named is usable as it is.
DEFAULT_VARIANT = "etps"


def plan_options(
    command: Callable | None = None, *, compressed_model_keeps_plan: bool = False
) -> Callable:
    """``--variant``, ``--keep``, ``--plan``, ``--variant-arg``, ``--keep-cumulative``,
    ``--keep-for-gmacs-ratio``, ``--locs``, ``--policy``: the plan's options in every command that makes a plan, folded into ``plan:
    PlanRequest``: ``variant`` (the method object, with its settings), ``keep`` (parsed:
    :func:`parse_keep`), ``locs`` (parsed), ``policy``, and whether any of them was given.
    ``compressed_model_keeps_plan``: see :func:`plan_file_option`."""
    if command is None:
        return functools.partial(
            plan_options, compressed_model_keeps_plan=compressed_model_keeps_plan
        )

    @functools.wraps(command)
    def parsed(*args, variant, keep, locs, policy, **kwargs):
        context = click.get_current_context()
        unset = (None, click.core.ParameterSource.DEFAULT)  # None: not an option here
        given = any(context.get_parameter_source(name) not in unset for name in PLAN_OPTIONS)
        plan = PlanRequest(variant, parse_keep(keep), parse_locs(locs), policy, given)
        return command(*args, plan=plan, **kwargs)

    options = [
        click.option("--variant", type=VariantChoice(), default=DEFAULT_VARIANT, show_default=True),
        click.option(
            "--keep",
            default=None,
            help="Keep ratio per location, or a comma list with one per location (default: "
            "0.7; 0.5 for CvT-like models, as in the paper).",
        ),
        plan_file_option(compressed_model_keeps_plan=compressed_model_keeps_plan),
        variant_args_option,
        keep_cumulative_option,
        keep_for_gmacs_option,
        click.option(
            "--locs",
            default=None,
            help="0-based block indices, e.g. 3,6,9 (default: 1/4, 1/2, 3/4 of the depth; "
            "stage starts for pyramids; stage 3 for CvT; every windowed block for Swin).",
        ),
        click.option(
            "--policy",
            type=click.Choice(["score", "random"]),
            default="score",
            show_default=True,
            help="random: select tokens at random (robustness analysis).",
        ),
    ]
    for option in reversed(options):
        parsed = option(parsed)
    return parsed
