"""``finetune``: recover accuracy with distillation, on Accelerate."""

from __future__ import annotations

import sys

import click
from rich.table import Table

from vitcompress.cli.app import (
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    cli,
    console,
    emit_json,
    err_console,
)
from vitcompress.cli.data_options import data_config_options
from vitcompress.cli.options import load_from_options, model_options
from vitcompress.cli.plan_options import (
    VariantChoice,
    keep_cumulative_option,
    parse_keep,
    parse_locs,
    plan_file_option,
    tome_r_option,
)


def _load_recipe(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--recipe FILE``: its values become the command's defaults, so flags given on the
    command line still win (click's default_map)."""
    if not value:
        return value
    import yaml

    try:
        with open(value) as f:
            recipe = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise click.BadParameter(f"cannot read {value}: {e}", ctx=ctx, param=param) from e
    if not isinstance(recipe, dict):
        raise click.BadParameter(f"{value} is not a mapping of option: value", ctx=ctx, param=param)
    names = {p.name for p in ctx.command.params}
    aliases = {"model": "model_spec", "model_arg": "model_args", "json": "as_json"}
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
        if name == "model_args" and isinstance(item, dict):
            item = [f"{k}={v!r}" for k, v in item.items()]
        defaults[name] = item
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


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
@click.option("--variant", type=VariantChoice(), default="dtps", show_default=True)
@click.option("--keep", default=None, help="Keep ratio per location, or a comma list.")
@plan_file_option(compressed_model_keeps_plan=True)
@tome_r_option
@keep_cumulative_option
@click.option("--locs", default=None, help="0-based block indices, e.g. 3,6,9.")
@click.option(
    "--policy", type=click.Choice(["score", "random"]), default="score", show_default=True
)
@click.option("--data", default=None, help="ImageFolder root (train/, val/) or fashion-mnist.")
@click.option("--data-dir", default=None, help="Where a named dataset's files are.")
@click.option("--epochs", default=30, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--max-steps",
    default=None,
    type=click.IntRange(min=1),
    help="Stop after N optimizer steps (overrides --epochs; the schedule spans N).",
)
@click.option(
    "--batch-size",
    default=128,
    show_default=True,
    type=click.IntRange(min=1),
    help="Images per process and step.",
)
@click.option(
    "--accum",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Gradient accumulation steps.",
)
@click.option(
    "--lr", default=None, type=float, help="Default: batch x accum x processes / 1024 x 2.5e-4."
)
@click.option("--warmup-epochs", default=5.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--weight-decay", default=0.05, show_default=True, type=click.FloatRange(min=0))
@click.option(
    "--augment",
    type=click.Choice(["deit", "light", "none"]),
    default=None,
    help="Augmentation preset (default: light for fashion-mnist, deit otherwise).",
)
@click.option("--ratio-weight", default=2.0, show_default=True, type=float)
@click.option("--distill-weight", default=0.5, show_default=True, type=float)
@click.option("--token-distill-weight", default=0.5, show_default=True, type=float)
@click.option(
    "--ema-decay",
    default=None,
    type=click.FloatRange(0, 1, max_open=True),
    help="Keep an EMA of the weights (also written to OUT/ema).",
)
@click.option("--amp", type=click.Choice(["bf16", "fp16"]), default=None)
@click.option(
    "--save-every",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Also checkpoint every N optimizer steps (0: each epoch only).",
)
@click.option("--keep-checkpoints", default=2, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--fsdp",
    is_flag=True,
    help="Shard the model with FSDP2 over the processes (torchrun or accelerate "
    "launch with DDP; CPU or CUDA); checkpoints and the artifact stay whole.",
)
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in OUT.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--num-workers", default=0, show_default=True, type=click.IntRange(min=0))
@click.option(
    "--log-every",
    default=10,
    show_default=True,
    type=click.IntRange(min=1),
    help="Log every N steps to metrics.jsonl, and as a line on stderr when it is not a terminal.",
)
@data_config_options
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    required=True,
    help="Output folder: the fine-tuned artifact, checkpoints/, metrics.jsonl.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.pass_context
def finetune(
    ctx: click.Context,
    recipe,
    model_spec,
    model_args,
    checkpoint,
    pretrained,
    input_size,
    variant,
    keep,
    locs,
    policy,
    data,
    data_dir,
    epochs,
    batch_size,
    accum,
    lr,
    warmup_epochs,
    weight_decay,
    augment,
    ratio_weight,
    distill_weight,
    token_distill_weight,
    ema_decay,
    amp,
    save_every,
    keep_checkpoints,
    resume,
    seed,
    num_workers,
    data_overrides,
    out,
    as_json,
    max_steps=None,
    log_every=10,
    fsdp=False,
) -> None:
    """Fine-tune a compressed model with the paper's losses; OUT becomes a compressed model."""
    from vitcompress.cli.progress import LogLines, RichProgress
    from vitcompress.data import AugmentConfig, build_dataset, num_classes, resolve_data_config
    from vitcompress.data.config import defaults_note
    from vitcompress.metadata import attach, compression_info
    from vitcompress.workflows.finetune import (
        FinetuneConfig,
        FinetuneError,
        FinetuneInterrupted,
        TrainingDiverged,
        student_and_teacher,
    )
    from vitcompress.workflows.finetune import finetune as run_finetune

    # A bar where someone watches a terminal; plain lines on stderr where it is captured.
    show_bar = not as_json and sys.stdout.isatty() and sys.stderr.isatty()

    if not data:
        raise click.UsageError("--data is required (on the command line or in the recipe)")
    from_recipe = sorted(
        name
        for name in ctx.params
        if ctx.get_parameter_source(name) == click.core.ParameterSource.DEFAULT_MAP
    )
    # --seed also decides what is drawn before training: a base without weights and the
    # predictors' initial weights.
    import torch

    torch.manual_seed(seed)
    loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
    student, teacher, from_artifact = student_and_teacher(
        loaded, variant, parse_keep(keep), parse_locs(locs), policy
    )
    if from_artifact and any(
        ctx.get_parameter_source(n) != click.core.ParameterSource.DEFAULT
        for n in ("variant", "keep", "keep_cumulative", "tome_r", "locs", "policy")
    ):
        err_console.print(
            "[yellow]warning:[/] --model is a compressed model: its own plan is "
            "used, --variant/--keep/--locs/--policy are ignored"
        )
    preset = (
        {"deit": AugmentConfig.deit, "light": AugmentConfig.light, "none": AugmentConfig.none}[
            augment
        ]()
        if augment
        else None
    )
    # DataError is one of the group's user errors: one line, exit code 2.
    data_config = resolve_data_config(student.model, student.input_size[0], data_overrides)
    train_set = build_dataset(
        data,
        "train",
        student.input_size,
        augment=preset,
        data_dir=data_dir,
        data_config=data_config,
    )
    val_set = build_dataset(
        data, "val", student.input_size, data_dir=data_dir, data_config=data_config
    )
    # What the model is fine-tuned with becomes its own: the artifact records it (docs/data.md).
    used = val_set.data_config
    attach(
        student.model,
        vitcompress_data_config=used.to_json(),
        vitcompress_data_config_from=f"{out} (fine-tuned with it)",
    )
    if note := defaults_note(used, model_spec):
        click.echo(note, err=True)
    classes = num_classes(train_set)
    if preset is None:
        preset = AugmentConfig.light() if "mnist" in data.lower() else AugmentConfig.deit()
    plan = compression_info(student.model).plan  # compressed: student_and_teacher made it so
    config = FinetuneConfig(
        epochs=epochs,
        batch_size=batch_size,
        accum=accum,
        lr=lr,
        warmup_epochs=warmup_epochs,
        weight_decay=weight_decay,
        ratio_weight=ratio_weight,
        distill_weight=distill_weight,
        token_distill_weight=token_distill_weight,
        ema_decay=ema_decay,
        amp=amp,
        save_every=save_every,
        keep_checkpoints=keep_checkpoints,
        resume=resume,
        seed=seed,
        num_workers=num_workers,
        mixup=preset.mixup_args(classes),
        smoothing=preset.smoothing,
        max_steps=max_steps,
        log_every=log_every,
        fsdp=fsdp,
        extra={
            "data": data,
            "data_config": used.to_json(),
            "data_config_sources": dict(used.sources),
            "augment": augment,
            "recipe": recipe,
            "from_recipe": from_recipe,
            "variant": plan.variant,
            "keep": plan.keep,
            "locs": plan.locs,
        },
    )
    try:
        result = run_finetune(
            student,
            teacher,
            train_set,
            val_set,
            out,
            config,
            progress=RichProgress() if show_bar else LogLines(log_every),
        )
    except FinetuneInterrupted as e:  # says where the last step was saved
        click.echo(f"error: {e}", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    except TrainingDiverged as e:
        click.echo(f"error: {e}", err=True)
        ctx.exit(1)
    except FinetuneError as e:
        click.echo(f"error: {e}", err=True)
        ctx.exit(EXIT_USAGE)
    from accelerate import PartialState

    if not PartialState().is_main_process:  # one summary per run, not one per process
        return
    if as_json:
        emit_json(result)
        return
    table = Table(show_edge=False)
    for column in ("epoch", "step", "train loss", "val top-1 (%)"):
        table.add_column(column)
    for row in result["history"]:
        top1 = row.get("val_top1")
        table.add_row(
            str(row["epoch"] + 1),
            str(row["step"]),
            f"{row['train_loss']:.4f}",
            f"{100 * top1:.2f}" if top1 is not None else "-",
        )
    console.print(table)
    console.print(
        f"{plan.variant} keep {plan.keep} at blocks {plan.locs}; "
        f"{result['steps']} steps, lr {result['lr']:.3g}, effective batch "
        f"{result['effective_batch']}, {result['seconds']:.0f} s"
    )
    console.print(f"saved to {out} (load with --model {out})")
