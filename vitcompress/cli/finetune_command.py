"""``finetune``: recover accuracy with distillation, on Accelerate."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import click
from rich.table import Table

from vitcompress.cli.app import cli, console, json_option, show_result
from vitcompress.cli.data_options import data_options, task_option
from vitcompress.cli.options import (
    FiniteFloat,
    _factory_and_weights_options,
    amp_option,
    folded_options,
    model_options,
    output_option,
    parse_model_args,
    workers_option,
)
from vitcompress.cli.plan_options import plan_options
from vitcompress.loading import ModelLoadError
from vitcompress.training.config import FinetuneConfig
from vitcompress.workflows.inputs import DataRequest, ModelRequest, PlanRequest

if TYPE_CHECKING:  # the workflow imports Accelerate: only when the command runs
    from vitcompress.workflows.finetune import FinetuneReport


def _load_recipe(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--recipe FILE``: its values become the command's defaults, so flags given on the
    command line still win (click's default_map)."""
    if not value:
        return value
    import yaml

    try:
        with open(value) as f:
            recipe = yaml.safe_load(f) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise click.BadParameter(f"cannot read {value}: {e}", ctx=ctx, param=param) from e
    if not isinstance(recipe, dict):
        raise click.BadParameter(f"{value} is not a mapping of option: value", ctx=ctx, param=param)
    names = {p.name for p in ctx.command.params}
    aliases = {
        "model": "model_spec",
        "model_arg": "model_args",
        "teacher": "teacher_spec",
        "teacher_model_arg": "teacher_model_args",
        "json": "as_json",
        "num_workers": "workers",  # the option's name before it was --workers in every command
    }
    defaults = {}
    for key, item in recipe.items():
        name = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name not in names or name == "recipe":
            raise click.BadParameter(f"{value}: unknown option {key!r}", ctx=ctx, param=param)
        if isinstance(item, list) and name in (
            "keep",
            "keep_cumulative",
            "locs",
            "input_size",
            "mean",
            "std",
        ):
            item = ",".join(str(v) for v in item)
        if name in ("model_args", "teacher_model_args") and isinstance(item, dict):
            item = [f"{k}={v!r}" for k, v in item.items()]
        defaults[name] = item
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def training_options(command: Callable) -> Callable:
    """The run's settings, folded into ``config: FinetuneConfig``. A float is a finite number in
    its range (:class:`FiniteFloat`): NaN, infinity or a negative weight would train into NaN
    weights, or fail in the optimiser, after the model and data were loaded."""
    positive = click.IntRange(min=1)
    options = [
        click.option("--epochs", default=30, show_default=True, type=positive),
        click.option(
            "--max-steps",
            default=None,
            type=positive,
            help="Stop after N optimizer steps (overrides --epochs; the schedule spans N).",
        ),
        click.option(
            "--batch-size",
            default=128,
            show_default=True,
            type=positive,
            help="Images per process and step.",
        ),
        click.option(
            "--accum",
            default=1,
            show_default=True,
            type=positive,
            help="Gradient accumulation steps.",
        ),
        click.option(
            "--lr",
            default=None,
            type=FiniteFloat(min=0, min_open=True),
            help="Default: batch x accum x processes / 1024 x 2.5e-4.",
        ),
        click.option(
            "--warmup-epochs",
            default=5.0,
            show_default=True,
            type=FiniteFloat(min=0),
        ),
        click.option(
            "--weight-decay",
            default=0.05,
            show_default=True,
            type=FiniteFloat(min=0),
        ),
        *(
            click.option(flag, default=default, show_default=True, type=FiniteFloat(min=0))
            for flag, default in (
                ("--ratio-weight", 2.0),
                ("--distill-weight", 0.5),
                ("--token-distill-weight", 0.5),
            )
        ),
        click.option(
            "--ema-decay",
            default=None,
            type=FiniteFloat(0, 1, max_open=True),
            help="Keep an EMA of the weights (also written to OUT/ema).",
        ),
        amp_option("Train under autocast to bf16 or fp16 (Accelerate's mixed precision)."),
        click.option(
            "--save-every",
            default=0,
            show_default=True,
            type=click.IntRange(min=0),
            help="Also checkpoint every N optimizer steps (0: each epoch only).",
        ),
        click.option("--keep-checkpoints", default=2, show_default=True, type=positive),
        click.option(
            "--val-images",
            default=None,
            type=positive,
            metavar="N",
            help="Validate on N images spread evenly over the validation set (default: all).",
        ),
        click.option(
            "--fsdp",
            is_flag=True,
            help="Shard the model with FSDP2 over the processes (torchrun or accelerate "
            "launch with DDP; CPU or CUDA); checkpoints and the artifact stay whole.",
        ),
        click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in OUT."),
        click.option("--seed", default=0, show_default=True, type=int),
        task_option,
        workers_option,
        click.option(
            "--log-every",
            default=10,
            show_default=True,
            type=positive,
            help="Log every N steps to metrics.jsonl, and as a line on stderr when it is not a "
            "terminal.",
        ),
    ]

    def config(workers: int, **values: Any) -> FinetuneConfig:
        return FinetuneConfig(num_workers=workers, **values)

    return folded_options("config", options, config)(command)


def head_options(command: Callable) -> Callable:
    """``--keep-head`` and ``--teacher`` with its ``--teacher-model-arg``,
    ``--teacher-checkpoint``, ``--teacher-pretrained``, folded into ``head: HeadOptions``."""
    options = [
        click.option(
            "--keep-head",
            is_flag=True,
            help="Refuse a model whose head predicts another number of classes than the data "
            "has, instead of replacing the head with a new one (docs/finetune.md).",
        ),
        click.option(
            "--teacher",
            "teacher_spec",
            default=None,
            metavar="SPEC",
            help="The distillation teacher (default: the uncompressed base); it must predict "
            "the data's classes. Needed for logit distillation when the head is replaced.",
        ),
        *_factory_and_weights_options(
            "teacher-",
            "the --teacher factory",
            "Weights for --teacher.",
            "timm's hub weights for --teacher.",
        ),
    ]

    def request(
        keep_head: bool,
        teacher_spec: str | None,
        teacher_model_args: Sequence[str],
        teacher_checkpoint: str | None,
        teacher_pretrained: bool,
    ) -> HeadOptions:
        given = teacher_model_args or teacher_checkpoint or teacher_pretrained
        if teacher_spec is None:
            if given:
                raise ModelLoadError(
                    "--teacher-model-arg, --teacher-checkpoint and --teacher-pretrained need "
                    "--teacher"
                )
            return HeadOptions(keep_head, None)
        teacher = ModelRequest(
            teacher_spec,
            parse_model_args(teacher_model_args),
            teacher_checkpoint,
            teacher_pretrained,
        )
        return HeadOptions(keep_head, teacher)

    return folded_options("head", options, request)(command)


@dataclass(frozen=True)
class HeadOptions:
    keep_head: bool
    teacher: ModelRequest | None


@cli.command()
@click.option(
    "--recipe",
    type=click.Path(dir_okay=False, exists=True),
    is_eager=True,
    expose_value=True,
    callback=_load_recipe,
    help="YAML file of option values; options given on the command line override it.",
)
@model_options
@plan_options(compressed_model_keeps_plan=True)
@data_options(None, required=False)
@click.option(
    "--augment",
    type=click.Choice(["deit", "light", "none"]),
    default=None,
    help="Augmentation preset (default: the data's own: light for fashion-mnist, deit otherwise).",
)
@training_options
@head_options
@output_option(
    "--out",
    folder=True,
    required=True,
    help="Output folder: the fine-tuned artifact, checkpoints/, metrics.jsonl.",
)
@json_option("Print the summary as JSON.")
@click.pass_context
def finetune(
    ctx: click.Context,
    recipe: str | None,
    model: ModelRequest,
    plan: PlanRequest,
    data: DataRequest,
    augment: str | None,
    config: FinetuneConfig,
    head: HeadOptions,
    out: str,
    as_json: bool,
) -> None:
    """Fine-tune a compressed model with the paper's losses; OUT becomes a compressed model."""
    from vitcompress.cli.progress import LogLines, RichProgress
    from vitcompress.workflows.finetune import finetune_model

    def source(name: str) -> click.core.ParameterSource | None:
        return ctx.get_parameter_source(name)

    from_recipe = sorted(
        n for n in ctx.params if source(n) == click.core.ParameterSource.DEFAULT_MAP
    )
    config.extra = {"recipe": recipe, "from_recipe": from_recipe}
    # A bar where someone watches a terminal; plain lines on stderr where it is captured.
    show_bar = not as_json and sys.stdout.isatty() and sys.stderr.isatty()
    progress = RichProgress() if show_bar else LogLines(config.log_every)
    report = finetune_model(
        model, plan, data, augment, out, config, progress, head.keep_head, head.teacher
    )
    if report.main_process:  # one summary per run, not one per process
        show_result(report, _print_finetune, as_json)


def _print_finetune(report: FinetuneReport) -> None:
    summary = report.summary
    table = Table(show_edge=False)
    # Segmentation is validated by mean IoU, classification by top-1.
    key, header = ("val_top1", "val top-1 (%)")
    if summary.get("task") == "segmentation":
        key, header = ("val_miou", "val mIoU (%)")
    for column in ("epoch", "step", "train loss", header):
        table.add_column(column)
    for row in summary["history"]:
        value = row.get(key)
        table.add_row(
            str(row["epoch"] + 1),
            str(row["step"]),
            f"{row['train_loss']:.4f}",
            f"{100 * value:.2f}" if value is not None else "-",
        )
    console.print(table)
    console.print(
        f"{summary['variant']} keep {summary['keep']} at blocks {summary['locs']}; "
        f"{summary['steps']} steps, lr {summary['lr']:.3g}, effective batch "
        f"{summary['effective_batch']}, {summary['seconds']:.0f} s"
    )
    console.print(f"saved to {report.out} (load with --model {report.out})")
