"""Options shared by every command: the text a user typed, parsed into the objects the workflows
take (a :class:`ModelRequest`, :class:`TimingOptions`, :class:`Bounds`), one decorator each."""

from __future__ import annotations

import ast
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import click

# Re-exported: the commands import every option from here.
from vitcompress.cli.outputs import OutputError as OutputError
from vitcompress.cli.outputs import check_writable as check_writable
from vitcompress.cli.outputs import output_option as output_option
from vitcompress.errors import given_options
from vitcompress.loading import ModelLoadError
from vitcompress.loading.input_size import MAX_RANK, MIN_RANK
from vitcompress.measure.models import DEFAULT_BENCH_SECONDS, TimingOptions
from vitcompress.workflows.gates import GATES, Bounds
from vitcompress.workflows.inputs import BaseRequest, ModelRequest

# What ``--model`` can name, in the words of its help; each command lists those it accepts.
MODEL_FORMS = {
    "timm": "a timm name (also timm's hf-hub:owner/name)",
    "file": "path/to/file.py:factory",
    "module": "package.module:factory",
    "hf": "a HuggingFace save_pretrained directory",
    "artifact": "a compressed model directory",
}


def folded_options(
    name: str, options: Sequence[Callable], fold: Callable[..., Any]
) -> Callable[[Callable], Callable]:
    """Decorate a command with ``options`` (listed in ``--help`` in this order), whose values
    reach it as one argument ``name``: ``fold(**values)``, keyed by the options' names."""

    def decorate(command: Callable) -> Callable:
        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            values = {key: kwargs.pop(key) for key in names}
            return command(*args, **{name: fold(**values)}, **kwargs)

        for option in reversed(options):
            wrapper = option(wrapper)
        names = [param.name for param in wrapper.__click_params__[-len(options) :]]
        return wrapper

    return decorate


def with_options(options: Sequence[Callable]) -> Callable[[Callable], Callable]:
    """Decorate a command with ``options``, listed in ``--help`` in this order."""

    def decorate(command: Callable) -> Callable:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def model_options(
    command: Callable | None = None, *, accepts: Sequence[str] = tuple(MODEL_FORMS)
) -> Callable:
    """``--model``, ``--model-arg``, ``--checkpoint``, ``--pretrained``, ``--input-size``,
    ``--entry``, folded into ``model: ModelRequest``. ``accepts``: the forms of
    :data:`MODEL_FORMS` the command takes, which its ``--help`` lists (and no other); a command
    that takes compressed model directories alone offers ``--model`` and ``--input-size``."""
    if command is None:
        return functools.partial(model_options, accepts=accepts)
    forms = [MODEL_FORMS[form] for form in accepts]
    listed = ", ".join(forms[:-1]) + (" or " if len(forms) > 1 else "") + forms[-1]
    model = click.option("--model", "model_spec", required=True, metavar="SPEC", help=f"{listed}.")
    input_size = click.option(
        "--input-size",
        default=None,
        metavar="C,H,W",
        help=(
            "Input size without the batch dim (a video model's: C,T,H,W, or 16,3,224,224 "
            "for HF VideoMAE's frames first); default: what the model's config says."
        ),
    )
    entry = click.option(
        "--entry",
        default="forward",
        show_default=True,
        metavar="METHOD",
        help=(
            "The base's method to run (and compress) as the model, e.g. forward_features: "
            "DINOv2's features, every token back in the base's order."
        ),
    )
    factory_and_weights = _factory_and_weights_options(
        "",
        "the model factory (Python literal)",
        "Weights: .safetensors, or a torch file (loaded with weights_only).",
        "timm's hub weights (needs network).",
    )
    if tuple(accepts) == ("artifact",):
        # A compressed model directory fixes its factory, weights and entry: the options that
        # would choose them could only be refused, so such a command does not offer them.
        options = [model, input_size]
    else:
        options = [model, *factory_and_weights, input_size, entry]

    def request(
        model_spec: str,
        model_args: Sequence[str] = (),
        checkpoint: str | None = None,
        pretrained: bool = False,
        input_size: str | None = None,
        entry: str = "forward",
    ) -> ModelRequest:
        return ModelRequest(
            spec=model_spec,
            args=parse_model_args(model_args),
            checkpoint=checkpoint,
            pretrained=pretrained,
            input_size=parse_input_size(input_size) if input_size is not None else None,
            typed_args=tuple(model_args),
            entry=entry,
        )

    return folded_options("model", options, request)(command)


def parse_model_args(
    pairs: Sequence[str], what: str = "model argument", error: type[Exception] = ModelLoadError
) -> dict[str, Any]:
    """Parse ``key=value`` pairs; values are Python literals where they parse, else plain strings.

    ``depth=2`` gives an int, ``img_size=(32,32)`` a tuple, ``act=gelu`` the string ``"gelu"``.
    ``what`` names the pairs in ``error``'s one-line messages.
    """
    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep:
            raise error(f"{what} '{pair}' has no '=': write it as key=value")
        if not key.isidentifier():
            raise error(f"{what} '{pair}': '{key}' is not a valid argument name")
        if key in args:
            raise error(f"{what} '{key}' is given twice")
        args[key] = _parse_value(text.strip())
    return args


def _parse_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        # Not a literal (e.g. ``gelu`` or ``layer_norm``): the user meant the word itself.
        return text


def parse_input_size(text: str) -> tuple[int, ...]:
    """Parse ``"C,H,W"`` such as ``"3,224,224"``, or the input of higher rank a video model takes
    (``"3,16,224,224"``), without the batch dim."""
    parts = [part.strip() for part in text.split(",")]
    try:
        size = tuple(int(part) for part in parts)
    except ValueError:
        size = ()
    if not MIN_RANK <= len(size) <= MAX_RANK or min(size) <= 0:
        raise ModelLoadError(
            f"input size '{text}' is not C,H,W with three positive integers (e.g. 3,224,224) "
            f"or up to {MAX_RANK} for a video model (e.g. 3,16,224,224)"
        )
    return size


def _factory_and_weights_options(
    prefix: str, factory: str, checkpoint_help: str, pretrained_help: str
) -> list[Callable]:
    """``--{prefix}model-arg``, ``--{prefix}checkpoint``, ``--{prefix}pretrained``."""
    return [
        click.option(
            f"--{prefix}model-arg",
            f"{prefix.replace('-', '_')}model_args",
            multiple=True,
            metavar="KEY=VALUE",
            help=f"Keyword argument for {factory}; repeatable.",
        ),
        click.option(
            f"--{prefix}checkpoint",
            type=click.Path(dir_okay=False),
            default=None,
            help=checkpoint_help,
        ),
        click.option(f"--{prefix}pretrained", is_flag=True, help=pretrained_help),
    ]


def base_options(command: Callable) -> Callable:
    """``--base``, ``--base-model-arg``, ``--base-checkpoint``, ``--base-pretrained``, folded into
    ``base: BaseRequest | None`` (None without ``--base``)."""
    options = [
        click.option(
            "--base",
            "base_spec",
            default=None,
            metavar="SPEC",
            help="A second model (e.g. the uncompressed one): report both, the accuracy delta, "
            "and GMACs and throughput timed in this process. 'source': the base a "
            "compressed --model records, with its model args and base weights.",
        ),
        *_factory_and_weights_options(
            "base-", "the --base factory", "Weights for --base.", "timm's hub weights for --base."
        ),
    ]

    def request(
        base_spec: str | None,
        base_model_args: Sequence[str],
        base_checkpoint: str | None,
        base_pretrained: bool,
    ) -> BaseRequest | None:
        given = tuple(
            given_options(
                (
                    ("--base-model-arg", base_model_args),
                    ("--base-checkpoint", base_checkpoint),
                    ("--base-pretrained", base_pretrained),
                )
            )
        )
        if base_spec is None:
            if given:
                verb = "needs" if len(given) == 1 else "need"
                raise ModelLoadError(f"{' and '.join(given)} {verb} --base")
            return None
        args = parse_model_args(base_model_args)
        return BaseRequest(base_spec, args, base_checkpoint, base_pretrained, given)

    return folded_options("base", options, request)(command)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


# ``--amp`` alone, as timing commands took it before it took a value: autocast in --dtype.
AMP_IN_DTYPE = "in-dtype"
AMP_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


class _AmpChoice(click.Choice):
    """bf16 or fp16; a bare ``--amp`` (the older spelling) passes as :data:`AMP_IN_DTYPE`."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        return value if value == AMP_IN_DTYPE else super().convert(value, param, ctx)


def amp_option(help_text: str, bare_means_dtype: bool = False) -> Callable:
    """``--amp bf16|fp16``, one form in every command. ``bare_means_dtype``: a bare ``--amp`` is
    still read as autocast in ``--dtype`` (how the timing commands spelled it before)."""
    extra: dict[str, Any] = {"is_flag": False, "flag_value": AMP_IN_DTYPE}
    return click.option(
        "--amp",
        type=_AmpChoice(list(AMP_DTYPES)),
        default=None,
        help=help_text,
        **(extra if bare_means_dtype else {}),
    )


def workers_option(command: Callable) -> Callable:
    return click.option(
        "--workers",
        default=0,
        show_default=True,
        type=click.IntRange(min=0),
        help="DataLoader worker processes.",
    )(command)


def warmup_option() -> Callable:
    return click.option("--warmup", default=3, show_default=True, type=click.IntRange(min=0))


def runs_option(help_text: str) -> Callable:
    return click.option(
        "--runs", default=10, show_default=True, type=click.IntRange(min=1), help=help_text
    )


def compile_options(compile_help: str, mode_help: str) -> list[Callable]:
    """``--compile`` (reaching the command as ``use_compile``) and ``--compile-mode``, worded for
    the command that compiles."""
    return [
        click.option("--compile", "use_compile", is_flag=True, help=compile_help),
        click.option(
            "--compile-mode", type=click.Choice(COMPILE_MODES), default=None, help=mode_help
        ),
    ]


def bench_seconds_option(help_text: str) -> Callable:
    return click.option(
        "--bench-seconds",
        default=DEFAULT_BENCH_SECONDS,
        show_default=True,
        type=FiniteFloat(min=0, min_open=True),
        metavar="S",
        help=help_text,
    )


def timing_options(command: Callable) -> Callable:
    """The throughput step's options, folded into ``timing: TimingOptions | None`` (None with
    ``--no-throughput``); ``--batch-size`` and ``--device`` stay in the context's params."""
    options = [
        click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1)),
        click.option(
            "--device",
            default="cpu",
            show_default=True,
            callback=lambda ctx, param, value: check_device(value),
            help="cpu, cuda, cuda:1 ...",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["float32", "bfloat16", "float16"]),
            default="float32",
            show_default=True,
        ),
        warmup_option(),
        runs_option("Timed rounds (one batch of each model per round) at most."),
        bench_seconds_option(
            "Time budget of the throughput step (warm-up and timed rounds): no "
            "round starts after S seconds; at least one is timed."
        ),
        *compile_options(
            "torch.compile every model timed, alike (inductor); compilation is not timed.",
            "With --compile: torch.compile's mode (default: torch's); reduce-overhead "
            "serves with CUDA graphs on a GPU (docs/serving.md).",
        ),
        click.option(
            "--fused-kernels",
            is_flag=True,
            help="Time compressed models with select, gather and squeeze as one C++ op "
            "(dtps, dynamicvit, etps; CPU; built on first use, about a minute).",
        ),
        click.option(
            "--cuda-graphs",
            is_flag=True,
            help="Time every model replayed from a CUDA graph of its eager forward (CUDA; "
            "captured and checked in seconds, no compiler; docs/serving.md).",
        ),
        amp_option(
            "Time float32 models under autocast to bf16 or fp16 (GPU only).", bare_means_dtype=True
        ),
        click.option("--no-throughput", is_flag=True, help="Skip timing; count params and MACs."),
    ]
    return folded_options("timing", options, timing_from_options)(command)


def check_device(device: str) -> str:
    """``device`` if this machine has it; otherwise one line, when the command line is read
    (before a model is loaded), rather than a torch error after the work."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(
            f"--device {device}: not a device name (cpu, cuda, cuda:1, mps ...)"
        ) from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ModelLoadError(f"--device {device}: this machine has no CUDA GPU torch can use")
        if parsed.index is not None and parsed.index >= count:
            raise ModelLoadError(f"--device {device}: this machine has {count} CUDA GPU(s)")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError(f"--device {device}: MPS is not available on this machine")
    return device


# The timing options that only say how models are timed (not --batch-size and --device, which
# eval and search also read for their own work), by parameter name.
_TIMED_ONLY = (
    "dtype", "warmup", "runs", "bench_seconds", "use_compile", "compile_mode", "cuda_graphs", "amp",
)  # fmt: skip


def _given_timing_options() -> tuple[str, ...]:
    """The flags of the timing-only options the command line (or a recipe) gave."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:  # called outside a command (tests, the library)
        return ()
    given = []
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if param.name in _TIMED_ONLY and source not in (None, click.core.ParameterSource.DEFAULT):
            given.append(param.opts[0])
    return tuple(given)


def timing_from_options(
    batch_size: int,
    device: str,
    dtype: str,
    warmup: int,
    runs: int,
    bench_seconds: float,
    use_compile: bool,
    compile_mode: str | None,
    fused_kernels: bool,
    amp: str | None,
    no_throughput: bool,
    cuda_graphs: bool = False,
) -> TimingOptions | None:
    if compile_mode and not use_compile:
        raise ModelLoadError("--compile-mode sets how models are compiled: add --compile")
    if cuda_graphs and use_compile:
        raise ModelLoadError(
            "--cuda-graphs and --compile: choose one (--compile-mode reduce-overhead is "
            "inductor's own CUDA graphs)"
        )
    if cuda_graphs and not no_throughput and not device.startswith("cuda"):
        raise ModelLoadError(
            f"--cuda-graphs replays CUDA graphs: it needs --device cuda, not {device}"
        )
    if fused_kernels and (no_throughput or not device.startswith("cpu")):
        raise ModelLoadError(
            "--fused-kernels changes only how compressed models are timed on the CPU: it has "
            "no effect with --no-throughput or another --device; drop it"
        )
    given = _given_timing_options()
    if no_throughput:
        if given:
            raise ModelLoadError(
                f"{', '.join(given)}: {'they set' if len(given) > 1 else 'it sets'} how models "
                "are timed, and --no-throughput times nothing; drop "
                f"{'them' if len(given) > 1 else 'it'}"
            )
        return None
    if amp is not None and not device.startswith("cuda"):
        raise ModelLoadError(
            f"--amp times models under CUDA's autocast: it needs --device cuda, not {device}"
        )
    if amp is not None and amp != AMP_IN_DTYPE:
        if dtype not in ("float32", AMP_DTYPES[amp]):
            raise ModelLoadError(
                f"--amp {amp} times float32 models under autocast to {AMP_DTYPES[amp]}; "
                f"--dtype {dtype} contradicts it: drop --dtype"
            )
        dtype = AMP_DTYPES[amp]
    elif amp == AMP_IN_DTYPE and dtype == "float32":
        raise ModelLoadError("--amp autocasts to bf16 or fp16: write --amp bf16 or --amp fp16")
    return TimingOptions(
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        warmup=warmup,
        runs=runs,
        compile=use_compile,
        amp=amp is not None,
        seconds=bench_seconds,
        compile_mode=compile_mode,
        fused_kernels=fused_kernels,
        cuda_graphs=cuda_graphs,
        given=given + (("--fused-kernels",) if fused_kernels else ()),
    )


def serving_compile_options(command: Callable) -> Callable:
    """``export``'s ``--compile`` and ``--compile-mode``, folded into ``serving_mode: str | None``
    (None without ``--compile``; else the mode, reduce-overhead by default: the serving path)."""

    def fold(use_compile: bool, compile_mode: str | None) -> str | None:
        if compile_mode and not use_compile:
            raise ModelLoadError("--compile-mode sets how the model is compiled: add --compile")
        return (compile_mode or "reduce-overhead") if use_compile else None

    options = compile_options(
        "Also check the serving path: torch.compile(fullgraph=True) at --batch-size "
        "(static shapes), one graph, outputs as eager, and no host synchronisation (.item(), "
        "nonzero, data-dependent shapes) in the forward.",
        "With --compile: torch.compile's mode (default reduce-overhead: CUDA graphs on "
        "a GPU; on the CPU inductor compiles it as its default mode).",
    )
    return folded_options("serving_mode", options, fold)(command)


class FiniteFloat(click.FloatRange):
    """A float in the range that is a number: NaN (which compares false with every bound, so a
    range lets it through) and infinity are refused when the command line is read."""

    name = "float"  # the metavar click derives, as for a plain float

    def _describe_range(self) -> str:
        # click words a range with neither bound as "x<=None"; such a float has no range to say.
        if self.min is None and self.max is None:
            return ""
        return super()._describe_range()

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number


_POSITIVE = FiniteFloat(min=0, min_open=True)
# Each gate's option: its type, metavar and what fails it.
GATE_OPTIONS = {
    "max_acc_drop": (
        FiniteFloat(),
        "POINTS",
        "top-1 drops by more than this many points against the base",
    ),
    "min_speedup": (
        _POSITIVE,
        "X",
        "the speed-up over the base (median of the paired timed rounds) is below X",
    ),
    "max_gmacs": (_POSITIVE, "G", "the (compressed) model needs more than G GMACs per image"),
}


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
    options = [
        click.option(
            GATES[name].flag,
            type=kind,
            default=None,
            metavar=metavar,
            hidden=name not in accepted,
            help=f"CI gate: fail (exit 3) if {text}.",
        )
        for name, (kind, metavar, text) in GATE_OPTIONS.items()
    ]
    return folded_options("bounds", options, Bounds)(command)
