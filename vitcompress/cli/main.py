"""``vitcompress`` command line."""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import click
from rich.console import Console
from rich.table import Table

from vitcompress import __version__
from vitcompress.cli.options import load_from_options, model_options, timing_options
from vitcompress.data import DataError
from vitcompress.graph.analyse import MappingError
from vitcompress.graph.capture import CaptureError
from vitcompress.graph.rewrite import RewriteError
from vitcompress.loading import ModelLoadError
from vitcompress.plan import VARIANTS, PlanError

# Errors that are the user's input, not a bug: one line on stderr, exit code 2.
USER_ERRORS = (ModelLoadError, PlanError, MappingError, CaptureError, RewriteError, DataError)
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

console = Console()
err_console = Console(stderr=True)


class VitcompressGroup(click.Group):
    """Turns known errors into one clear line; ``--debug`` shows the traceback instead."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except USER_ERRORS as e:
            self._fail(ctx, e, EXIT_USAGE)
        except KeyboardInterrupt as e:
            self._fail(ctx, e, EXIT_INTERRUPTED, "interrupted")

    @staticmethod
    def _fail(ctx: click.Context, error: BaseException, code: int, text: str | None = None):
        if ctx.obj and ctx.obj.get("debug"):
            traceback.print_exception(error)
        message = text or str(error).splitlines()[0] if str(error) else type(error).__name__
        click.echo(f"error: {message}", err=True)
        ctx.exit(code)


@click.group(cls=VitcompressGroup)
@click.version_option(__version__, prog_name="vitcompress")
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Compress Vision Transformers by joint Token Pruning & Squeezing (TPS)."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def _emit_json(data: dict[str, Any]) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@cli.command()
@model_options
@click.option("--json", "as_json", is_flag=True, help="Print the model map as JSON.")
def inspect(model_spec, model_args, checkpoint, pretrained, input_size, as_json) -> None:
    """Print the model map: stages, blocks, attention cores, prefix tokens and grid ops."""
    from vitcompress.api import map_model

    loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
    model_map = map_model(loaded.model, loaded.input_size).to_json()
    if as_json:
        _emit_json(model_map)
        return
    console.print(
        f"[bold]{model_spec}[/]  input {tuple(model_map['input_size'])}  captured by "
        f"{model_map['capture']}  prefix tokens {model_map['prefix_tokens']} "
        f"({'cls' if model_map['cls_token'] else 'no cls'})  grid {tuple(model_map['grid'])}"
    )
    table = Table(show_edge=False)
    for column in ("#", "path", "stage", "tokens", "dim", "heads", "attention", "grid ops"):
        table.add_column(column, justify="right" if column in ("#", "tokens", "dim", "heads")
                         else "left")
    for block in model_map["blocks"]:
        ops = ", ".join(f"{op['kind']} {op['path']} {op['grid'][0]}x{op['grid'][1]}"
                        for op in block["grid_ops"]) or "-"
        table.add_row(str(block["index"]), block["path"] or "<root>", str(block["stage"]),
                      str(block["tokens"]), str(block["dim"]), str(block["heads"]),
                      block["attention"], ops)
    console.print(table)
    if model_map["leaves"]:
        console.print(f"kept whole by the tracer: {', '.join(model_map['leaves'])}")


@cli.command()
@model_options
@timing_options
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def bench(model_spec, model_args, checkpoint, pretrained, input_size, timing, as_json) -> None:
    """Count parameters and MACs and time the model's throughput."""
    from vitcompress.workflows.measure_models import measure_models

    loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
    measured, environment = measure_models({"model": loaded.model}, loaded.input_size, timing)
    result = {**measured["model"].to_json(), "input_size": list(loaded.input_size),
              "environment": environment}
    if as_json:
        _emit_json(result)
        return
    table = Table(show_edge=False)
    for column in ("model", "params (M)", "GMACs", "throughput (img/s)"):
        table.add_column(column)
    table.add_row(model_spec, f"{result['params'] / 1e6:.2f}", f"{result['gmacs']:.3f}",
                  _fmt_throughput(result["throughput"]))
    console.print(table)
    _print_environment(environment)


def _fmt_throughput(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _print_environment(environment: dict[str, Any]) -> None:
    if environment:
        console.print(
            f"[dim]{environment.get('device_name', environment.get('device'))}, "
            f"{environment.get('dtype')}, {environment.get('threads')} threads, batch "
            f"{environment.get('batch_size')}, torch {environment.get('torch')}[/]"
        )


@cli.command()
@model_options
@click.option("--variant", type=click.Choice(list(VARIANTS)), default="etps", show_default=True)
@click.option("--keep", default=None,
              help="Keep ratio per location, or a comma list with one per location (default: "
                   "0.7; 0.5 for CvT-like models, as in the paper).")
@click.option("--locs", default=None, help="0-based block indices, e.g. 3,6,9 (default: "
              "1/4, 1/2, 3/4 of the depth; stage starts for pyramids; stage 3 for CvT).")
@click.option("--policy", type=click.Choice(["score", "random"]), default="score",
              show_default=True, help="random: select tokens at random (robustness analysis).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Write the compressed model here (safetensors + vitcompress.json).")
@timing_options
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def apply(model_spec, model_args, checkpoint, pretrained, input_size, variant, keep, locs,
          policy, out, timing, as_json) -> None:
    """Compress a model and report params, GMACs and throughput, before and after."""
    from vitcompress.workflows.apply import apply as run_apply

    loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
    result = run_apply(loaded, variant=variant, keep=keep, locs=locs, policy=policy, out=out,
                       timing=timing)
    data = result.to_json()
    if as_json:
        _emit_json(data)
        return
    plan = data["plan"]
    console.print(f"[bold]{model_spec}[/] + {variant} at blocks {plan['locs']} keep "
                  f"{plan['keep']} (policy {policy})")
    table = Table(show_edge=False)
    for column in ("", "params (M)", "GMACs", "throughput (img/s)"):
        table.add_column(column)
    for name in ("base", "compressed"):
        row = data[name]
        table.add_row(name, f"{row['params'] / 1e6:.2f}", f"{row['gmacs']:.3f}",
                      _fmt_throughput(row["throughput"]))
    ratio_tp = f"{data['speedup']:.2f}x" if data["speedup"] else "-"
    table.add_row("ratio", f"{data['compressed']['params'] / data['base']['params']:.3f}",
                  f"{data['macs_ratio']:.3f}", ratio_tp)
    console.print(table)
    console.print("tokens per block: " + " ".join(
        f"{b}->{c}" if b != c else str(b)
        for b, c in zip(data["base_tokens_per_block"], data["tokens_per_block"], strict=True)))
    _print_environment(data["environment"])
    if data["out"]:
        console.print(f"saved to {data['out']}")


@cli.command(name="eval")
@model_options
@click.option("--data", required=True, metavar="DATA",
              help="ImageNet-style folder with train/ and val/, or 'fashion-mnist'.")
@click.option("--data-dir", default=None, type=click.Path(file_okay=False),
              help="Folder with the Fashion-MNIST IDX files (plain or .gz).")
@click.option("--split", type=click.Choice(["val", "train"]), default="val", show_default=True,
              help="Split to evaluate (train is read without augmentation).")
@click.option("--base", "base_spec", default=None, metavar="SPEC",
              help="A second model (e.g. the uncompressed one): report both, the accuracy delta, "
                   "and GMACs and throughput timed in this process.")
@click.option("--workers", default=0, show_default=True, type=click.IntRange(min=0),
              help="DataLoader worker processes.")
@timing_options
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.pass_context
def eval_command(ctx: click.Context, model_spec, model_args, checkpoint, pretrained, input_size,
                 data, data_dir, split, base_spec, workers, timing, as_json) -> None:
    """Top-1/top-5 accuracy on a dataset; with --base, against a second model."""
    from vitcompress.data import AugmentConfig, build_dataset
    from vitcompress.loading import load_model
    from vitcompress.workflows.evaluate import evaluate
    from vitcompress.workflows.measure_models import measure_models

    # --batch-size and --device belong to timing_options, which folds them into `timing` (None
    # with --no-throughput); read them from the parsed parameters so evaluation always has them.
    batch_size, device = ctx.params["batch_size"], ctx.params["device"]
    loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
    dataset = build_dataset(data, split, loaded.input_size, augment=AugmentConfig.none(),
                            data_dir=data_dir)
    models = {"model": loaded.model}
    if base_spec:
        models = {"base": load_model(base_spec, input_size=loaded.input_size).model, **models}
    accuracy = {name: evaluate(m, dataset, batch_size=batch_size, device=device,
                               num_workers=workers) for name, m in models.items()}
    result: dict[str, Any] = {"model": model_spec, "data": data, "split": split,
                              "input_size": list(loaded.input_size),
                              "images": accuracy["model"]["images"],
                              "top1": accuracy["model"]["top1"], "top5": accuracy["model"]["top5"]}
    if base_spec:
        measured, environment = measure_models(models, loaded.input_size, timing)
        for name, key in (("base", "base"), ("model", "compressed")):
            result[key] = {"top1": accuracy[name]["top1"], "top5": accuracy[name]["top5"],
                           **measured[name].to_json()}
        result["base"]["spec"] = base_spec
        result["delta_top1"] = result["top1"] - result["base"]["top1"]
        result["delta_top5"] = result["top5"] - result["base"]["top5"]
        result["environment"] = environment
    if as_json:
        _emit_json(result)
        return
    console.print(f"[bold]{model_spec}[/] on {data} ({split}, {result['images']} images, input "
                  f"{tuple(loaded.input_size)})")
    table = Table(show_edge=False)
    if not base_spec:
        for column in ("top-1 (%)", "top-5 (%)"):
            table.add_column(column, justify="right")
        table.add_row(f"{result['top1']:.2f}", f"{result['top5']:.2f}")
        console.print(table)
        return
    for column in ("", "top-1 (%)", "top-5 (%)", "params (M)", "GMACs", "throughput (img/s)"):
        table.add_column(column, justify="left" if not column else "right")
    for key, label in (("base", f"base {base_spec}"), ("compressed", model_spec)):
        row = result[key]
        table.add_row(label, f"{row['top1']:.2f}", f"{row['top5']:.2f}",
                      f"{row['params'] / 1e6:.2f}", f"{row['gmacs']:.3f}",
                      _fmt_throughput(row["throughput"]))
    table.add_row("delta", f"{result['delta_top1']:+.2f}", f"{result['delta_top5']:+.2f}",
                  "", "", "")
    console.print(table)
    _print_environment(result["environment"])


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
        raise click.BadParameter(f"{value} is not a mapping of option: value", ctx=ctx,
                                 param=param)
    names = {p.name for p in ctx.command.params}
    aliases = {"model": "model_spec", "model_arg": "model_args", "json": "as_json"}
    defaults = {}
    for key, item in recipe.items():
        name = aliases.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name not in names or name == "recipe":
            raise click.BadParameter(f"{value}: unknown option {key!r}", ctx=ctx, param=param)
        if isinstance(item, list) and name in ("keep", "locs", "input_size"):
            item = ",".join(str(v) for v in item)
        if name == "model_args" and isinstance(item, dict):
            item = [f"{k}={v!r}" for k, v in item.items()]
        defaults[name] = item
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


@cli.command()
@click.option("--recipe", type=click.Path(dir_okay=False, exists=True), is_eager=True,
              expose_value=True, callback=_load_recipe,
              help="YAML file of option values; options given on the command line override it.")
@model_options
@click.option("--variant", type=click.Choice(list(VARIANTS)), default="dtps", show_default=True)
@click.option("--keep", default=None, help="Keep ratio per location, or a comma list.")
@click.option("--locs", default=None, help="0-based block indices, e.g. 3,6,9.")
@click.option("--policy", type=click.Choice(["score", "random"]), default="score",
              show_default=True)
@click.option("--data", default=None, help="ImageFolder root (train/, val/) or fashion-mnist.")
@click.option("--data-dir", default=None, help="Where a named dataset's files are.")
@click.option("--epochs", default=30, show_default=True, type=click.IntRange(min=1))
@click.option("--batch-size", default=128, show_default=True, type=click.IntRange(min=1),
              help="Images per process and step.")
@click.option("--accum", default=1, show_default=True, type=click.IntRange(min=1),
              help="Gradient accumulation steps.")
@click.option("--lr", default=None, type=float,
              help="Default: batch x accum x processes / 1024 x 2.5e-4.")
@click.option("--warmup-epochs", default=5.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--weight-decay", default=0.05, show_default=True, type=click.FloatRange(min=0))
@click.option("--augment", type=click.Choice(["deit", "light", "none"]), default=None,
              help="Augmentation preset (default: light for fashion-mnist, deit otherwise).")
@click.option("--ratio-weight", default=2.0, show_default=True, type=float)
@click.option("--distill-weight", default=0.5, show_default=True, type=float)
@click.option("--token-distill-weight", default=0.5, show_default=True, type=float)
@click.option("--ema-decay", default=None, type=click.FloatRange(0, 1, max_open=True),
              help="Keep an EMA of the weights (also written to OUT/ema).")
@click.option("--amp", type=click.Choice(["bf16", "fp16"]), default=None)
@click.option("--save-every", default=0, show_default=True, type=click.IntRange(min=0),
              help="Also checkpoint every N optimizer steps (0: each epoch only).")
@click.option("--keep-checkpoints", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--resume", is_flag=True, help="Continue from the latest checkpoint in OUT.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--num-workers", default=0, show_default=True, type=click.IntRange(min=0))
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Output folder: the fine-tuned artifact, checkpoints/, metrics.jsonl.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.pass_context
def finetune(ctx: click.Context, recipe, model_spec, model_args, checkpoint, pretrained,
             input_size, variant, keep, locs, policy, data, data_dir, epochs, batch_size, accum,
             lr, warmup_epochs, weight_decay, augment, ratio_weight, distill_weight,
             token_distill_weight, ema_decay, amp, save_every, keep_checkpoints, resume, seed,
             num_workers, out, as_json) -> None:
    """Fine-tune a compressed model with the paper's losses; OUT becomes a compressed model."""
    from vitcompress.data import AugmentConfig, DataError, build_dataset, num_classes
    from vitcompress.workflows.finetune import (
        FinetuneConfig,
        FinetuneError,
        TrainingDiverged,
        student_and_teacher,
    )
    from vitcompress.workflows.finetune import finetune as run_finetune

    if not data:
        raise click.UsageError("--data is required (on the command line or in the recipe)")
    from_recipe = sorted(name for name in ctx.params
                         if ctx.get_parameter_source(name) == click.core.ParameterSource.DEFAULT_MAP)
    loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)
    student, teacher, from_artifact = student_and_teacher(loaded, variant, keep, locs, policy)
    if from_artifact and any(ctx.get_parameter_source(n) != click.core.ParameterSource.DEFAULT
                             for n in ("variant", "keep", "locs", "policy")):
        err_console.print("[yellow]warning:[/] --model is a compressed model: its own plan is "
                          "used, --variant/--keep/--locs/--policy are ignored")
    preset = {"deit": AugmentConfig.deit, "light": AugmentConfig.light,
              "none": AugmentConfig.none}[augment]() if augment else None
    try:
        train_set = build_dataset(data, "train", student.input_size, augment=preset,
                                  data_dir=data_dir)
        val_set = build_dataset(data, "val", student.input_size, data_dir=data_dir)
        classes = num_classes(train_set)
    except DataError as e:
        raise click.UsageError(str(e)) from e
    if preset is None:
        preset = AugmentConfig.light() if "mnist" in data.lower() else AugmentConfig.deit()
    plan = student.model.vitcompress_plan
    config = FinetuneConfig(
        epochs=epochs, batch_size=batch_size, accum=accum, lr=lr, warmup_epochs=warmup_epochs,
        weight_decay=weight_decay, ratio_weight=ratio_weight, distill_weight=distill_weight,
        token_distill_weight=token_distill_weight, ema_decay=ema_decay, amp=amp,
        save_every=save_every, keep_checkpoints=keep_checkpoints, resume=resume, seed=seed,
        num_workers=num_workers, mixup=preset.mixup_args(classes), smoothing=preset.smoothing,
        progress=not as_json and sys.stdout.isatty(),
        extra={"data": data, "augment": augment, "recipe": recipe, "from_recipe": from_recipe,
               "variant": plan["variant"], "keep": plan["keep"], "locs": plan["locs"]})
    try:
        result = run_finetune(student, teacher, train_set, val_set, out, config)
    except TrainingDiverged as e:
        click.echo(f"error: {e}", err=True)
        ctx.exit(1)
    except FinetuneError as e:
        click.echo(f"error: {e}", err=True)
        ctx.exit(EXIT_USAGE)
    if as_json:
        _emit_json(result)
        return
    table = Table(show_edge=False)
    for column in ("epoch", "step", "train loss", "val top-1 (%)"):
        table.add_column(column)
    for row in result["history"]:
        top1 = row.get("val_top1")
        table.add_row(str(row["epoch"] + 1), str(row["step"]), f"{row['train_loss']:.4f}",
                      f"{100 * top1:.2f}" if top1 is not None else "-")
    console.print(table)
    console.print(f"{plan['variant']} keep {plan['keep']} at blocks {plan['locs']}; "
                  f"{result['steps']} steps, lr {result['lr']:.3g}, effective batch "
                  f"{result['effective_batch']}, {result['seconds']:.0f} s")
    console.print(f"saved to {out} (load with --model {out})")


def main() -> None:
    cli(prog_name="vitcompress")


if __name__ == "__main__":
    sys.exit(main())
