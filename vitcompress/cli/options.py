"""Options shared by every command: the text a user typed, parsed, and turned into a model."""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Sequence
from typing import Any

import click

from vitcompress.api import load_model
from vitcompress.artifact import load_artifact_base
from vitcompress.loading import LoadedModel, ModelLoadError, is_artifact_directory
from vitcompress.metadata import compression_info
from vitcompress.workflows.gates import GATES, Bounds
from vitcompress.workflows.measure_models import DEFAULT_BENCH_SECONDS, TimingOptions


def model_options(command: Callable) -> Callable:
    """``--model``, ``--model-arg``, ``--checkpoint``, ``--pretrained``, ``--input-size``."""
    decorators = [
        click.option(
            "--model",
            "model_spec",
            required=True,
            metavar="SPEC",
            help="timm name, path/to/file.py:factory, package.module:factory, or a "
            "compressed model directory.",
        ),
        click.option(
            "--model-arg",
            "model_args",
            multiple=True,
            metavar="KEY=VALUE",
            help="Keyword argument for the model factory (Python literal); repeatable.",
        ),
        click.option(
            "--checkpoint",
            type=click.Path(dir_okay=False),
            default=None,
            help="Weights: .safetensors, or a torch file (loaded with weights_only).",
        ),
        click.option("--pretrained", is_flag=True, help="timm's hub weights (needs network)."),
        click.option(
            "--input-size",
            default=None,
            metavar="C,H,W",
            help="Input size; default: what the model's config says.",
        ),
    ]
    for decorator in reversed(decorators):
        command = decorator(command)
    return command


def parse_model_args(pairs: Sequence[str]) -> dict[str, Any]:
    """Parse ``key=value`` pairs; values are Python literals where they parse, else plain strings.

    ``depth=2`` gives an int, ``img_size=(32,32)`` a tuple, ``act=gelu`` the string ``"gelu"``.
    """
    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep:
            raise ModelLoadError(f"model argument '{pair}' has no '=': write it as key=value")
        if not key.isidentifier():
            raise ModelLoadError(f"model argument '{pair}': '{key}' is not a valid argument name")
        if key in args:
            raise ModelLoadError(f"model argument '{key}' is given twice")
        args[key] = _parse_value(text.strip())
    return args


def _parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        # Not a literal (e.g. ``gelu`` or ``layer_norm``): the user meant the word itself.
        return text


def parse_input_size(text: str) -> tuple[int, int, int]:
    """Parse ``"C,H,W"`` such as ``"3,224,224"``."""
    parts = [part.strip() for part in text.split(",")]
    try:
        size = tuple(int(part) for part in parts)
    except ValueError:
        size = ()
    if len(size) != 3 or min(size) <= 0:
        raise ModelLoadError(
            f"input size '{text}' is not C,H,W with three positive integers (e.g. 3,224,224)"
        )
    return size  # type: ignore[return-value]  # length checked above


def load_from_options(
    model_spec: str,
    model_args: tuple[str, ...],
    checkpoint: str | None,
    pretrained: bool,
    input_size: str | None,
) -> LoadedModel:
    return load_model(
        model_spec,
        parse_model_args(model_args),
        checkpoint=checkpoint,
        pretrained=pretrained,
        input_size=parse_input_size(input_size) if input_size else None,
    )


BASE_FROM_ARTIFACT = "source"


def base_options_given(
    base_args: tuple[str, ...], base_checkpoint: str | None, base_pretrained: bool
) -> list[str]:
    """The ``--base-*`` options the user passed, by flag name (for refusals)."""
    return [
        name
        for name, used in (
            ("--base-model-arg", base_args),
            ("--base-checkpoint", base_checkpoint),
            ("--base-pretrained", base_pretrained),
        )
        if used
    ]


def load_base_from_options(
    base_spec: str,
    base_args: tuple[str, ...],
    base_checkpoint: str | None,
    base_pretrained: bool,
    model: LoadedModel,
) -> LoadedModel:
    """The ``--base`` model, at ``model``'s input size. ``--base source`` rebuilds the base a
    compressed ``model`` records (spec, model arguments and base weights)."""
    given = base_options_given(base_args, base_checkpoint, base_pretrained)
    if given and is_artifact_directory(base_spec):
        raise ModelLoadError(
            f"--base {base_spec} is a compressed model that fixes its "
            f"architecture and weights; drop {', '.join(given)}"
        )
    if base_spec != BASE_FROM_ARTIFACT:
        return load_model(
            base_spec,
            parse_model_args(base_args),
            checkpoint=base_checkpoint,
            pretrained=base_pretrained,
            input_size=model.input_size,
        )
    if given:
        raise ModelLoadError(
            f"--base {BASE_FROM_ARTIFACT} takes the base's arguments and "
            f"weights from the artifact; drop {', '.join(given)}"
        )
    info = compression_info(model.model)
    if info is None or info.artifact is None:
        raise ModelLoadError(
            f"--base {BASE_FROM_ARTIFACT} needs --model to be a compressed model directory"
        )
    return load_artifact_base(info.artifact, model.input_size)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def timing_options(command: Callable) -> Callable:
    decorators = [
        click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1)),
        click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1 ..."),
        click.option(
            "--dtype",
            type=click.Choice(["float32", "bfloat16", "float16"]),
            default="float32",
            show_default=True,
        ),
        click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=0)),
        click.option(
            "--runs",
            default=10,
            show_default=True,
            type=click.IntRange(min=1),
            help="Timed rounds (one batch of each model per round) at most.",
        ),
        click.option(
            "--bench-seconds",
            default=DEFAULT_BENCH_SECONDS,
            show_default=True,
            type=click.FloatRange(min=0, min_open=True),
            metavar="S",
            help="Time budget of the throughput step (warm-up and timed rounds): no "
            "round starts after S seconds; at least one is timed.",
        ),
        click.option(
            "--compile",
            "use_compile",
            is_flag=True,
            help="torch.compile every model timed, alike (inductor); compilation is not timed.",
        ),
        click.option(
            "--compile-mode",
            type=click.Choice(COMPILE_MODES),
            default=None,
            help="With --compile: torch.compile's mode (default: torch's).",
        ),
        click.option(
            "--fused-kernels",
            is_flag=True,
            help="Time compressed models with select, gather and squeeze as one C++ op "
            "(dtps, dynamicvit, etps; CPU; built on first use, about a minute).",
        ),
        click.option("--amp", is_flag=True, help="Autocast (GPU only) in --dtype."),
        click.option("--no-throughput", is_flag=True, help="Skip timing; count params and MACs."),
    ]
    for decorator in reversed(decorators):
        command = decorator(command)

    @functools.wraps(command)
    def wrapper(
        *args,
        batch_size,
        device,
        dtype,
        warmup,
        runs,
        bench_seconds,
        use_compile,
        compile_mode,
        fused_kernels,
        amp,
        no_throughput,
        **kwargs,
    ):
        if compile_mode and not use_compile:
            raise ModelLoadError("--compile-mode sets how models are compiled: add --compile")
        if fused_kernels and (no_throughput or not device.startswith("cpu")):
            raise ModelLoadError(
                "--fused-kernels changes only how compressed models are timed on the CPU: it has "
                "no effect with --no-throughput or another --device; drop it"
            )
        timing = (
            None
            if no_throughput
            else TimingOptions(
                batch_size=batch_size,
                device=device,
                dtype=dtype,
                warmup=warmup,
                runs=runs,
                compile=use_compile,
                amp=amp,
                seconds=bench_seconds,
                compile_mode=compile_mode,
                fused_kernels=fused_kernels,
            )
        )
        return command(*args, timing=timing, **kwargs)

    return wrapper


def gate_options(
    command: Callable | None = None, *, accepted: tuple[str, ...] = tuple(GATES)
) -> Callable:
    """``--max-acc-drop``, ``--min-speedup``, ``--max-gmacs``, folded into ``bounds: Bounds``.

    ``@gate_options`` offers all three; ``@gate_options(accepted=(...))`` lists only the named
    gates in ``--help``. The others are still parsed (hidden), so that giving one gets the
    command's own explanation from ``require`` instead of click's "no such option".
    A missed bound makes the command exit 3 after its report (docs/ci.md).
    """
    if command is None:
        return functools.partial(gate_options, accepted=accepted)
    positive = click.FloatRange(min=0, min_open=True)
    decorators = [
        click.option(
            "--max-acc-drop",
            type=float,
            default=None,
            metavar="POINTS",
            hidden="max_acc_drop" not in accepted,
            help="CI gate: fail (exit 3) if top-1 drops by more than this many points "
            "against the base.",
        ),
        click.option(
            "--min-speedup",
            type=positive,
            default=None,
            metavar="X",
            hidden="min_speedup" not in accepted,
            help="CI gate: fail (exit 3) if the speed-up over the base (median of the "
            "paired timed rounds) is below X.",
        ),
        click.option(
            "--max-gmacs",
            type=positive,
            default=None,
            metavar="G",
            hidden="max_gmacs" not in accepted,
            help="CI gate: fail (exit 3) if the (compressed) model needs more than G "
            "GMACs per image.",
        ),
    ]
    for decorator in reversed(decorators):
        command = decorator(command)

    @functools.wraps(command)
    def wrapper(*args, max_acc_drop, min_speedup, max_gmacs, **kwargs):
        bounds = Bounds(max_acc_drop=max_acc_drop, min_speedup=min_speedup, max_gmacs=max_gmacs)
        return command(*args, bounds=bounds, **kwargs)

    return wrapper
