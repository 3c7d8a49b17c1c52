"""``eval``: accuracy of a model, optionally against its base."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from vitcompress.cli.app import (
    cli,
    console,
    emit_json,
    finish_gates,
    fmt_throughput,
    print_environment,
)
from vitcompress.cli.data_options import data_config_options, data_source_options, describe
from vitcompress.cli.options import (
    BASE_FROM_ARTIFACT,
    base_options_given,
    gate_options,
    load_base_from_options,
    load_from_options,
    model_options,
    timing_options,
)
from vitcompress.loading import ModelLoadError
from vitcompress.workflows.gates import NO_THROUGHPUT, Bounds, check_gates, require
from vitcompress.workflows.identity import model_identity
from vitcompress.workflows.measure_models import speedup


@cli.command(name="eval")
@model_options
@data_source_options("val", "Split to evaluate (train is read without augmentation).")
@click.option(
    "--base",
    "base_spec",
    default=None,
    metavar="SPEC",
    help="A second model (e.g. the uncompressed one): report both, the accuracy delta, "
    "and GMACs and throughput timed in this process. 'source': the base a "
    "compressed --model records, with its model args and base weights.",
)
@click.option(
    "--base-model-arg",
    "base_args",
    multiple=True,
    metavar="KEY=VALUE",
    help="Keyword argument for the --base factory; repeatable.",
)
@click.option(
    "--base-checkpoint", type=click.Path(dir_okay=False), default=None, help="Weights for --base."
)
@click.option("--base-pretrained", is_flag=True, help="timm's hub weights for --base.")
@click.option(
    "--workers",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="DataLoader worker processes.",
)
@data_config_options
@timing_options
@gate_options
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.pass_context
def eval_command(
    ctx: click.Context,
    model_spec,
    model_args,
    checkpoint,
    pretrained,
    input_size,
    data,
    data_dir,
    split,
    base_spec,
    base_args,
    base_checkpoint,
    base_pretrained,
    workers,
    data_overrides,
    timing,
    bounds: Bounds,
    as_json,
) -> None:
    """Top-1/top-5 accuracy on a dataset; with --base, against a second model.

    Each model is fed its own data config (an artifact's record, the model's data_config or
    timm pretrained_cfg); --mean/--std/--interpolation/--crop-pct override it for both.
    """
    from vitcompress.data import model_dataset
    from vitcompress.data.config import defaults_note
    from vitcompress.workflows.evaluate import evaluate
    from vitcompress.workflows.measure_models import measure_models

    # --batch-size and --device belong to timing_options, which folds them into `timing` (None
    # with --no-throughput); read them from the parsed parameters so evaluation always has them.
    batch_size, device = ctx.params["batch_size"], ctx.params["device"]
    unavailable = (
        {}
        if base_spec
        else {
            "max_acc_drop": "needs --base to compare against",
            "min_speedup": "needs --base to compare against",
        }
    )
    if timing is None:
        unavailable.setdefault("min_speedup", NO_THROUGHPUT)
    require(bounds, unavailable)
    if not base_spec and base_options_given(base_args, base_checkpoint, base_pretrained):
        raise ModelLoadError(
            "--base-model-arg, --base-checkpoint and --base-pretrained need --base"
        )
    loaded = load_from_options(model_spec, model_args, checkpoint, pretrained, input_size)

    def dataset_for(model):
        return model_dataset(model, data, split, loaded.input_size, data_dir, data_overrides)[0]

    datasets = {"model": dataset_for(loaded.model)}
    models = {"model": loaded.model}
    used = {"model": datasets["model"].data_config}
    if base_spec:
        base = load_base_from_options(
            base_spec, base_args, base_checkpoint, base_pretrained, loaded
        )
        models = {"base": base.model, **models}
        base_set = dataset_for(base.model)
        used["base"] = base_set.data_config
        # The same images when both configs agree (equality ignores where each value came from).
        datasets["base"] = datasets["model"] if used["base"] == used["model"] else base_set
    accuracy = {
        name: evaluate(m, datasets[name], batch_size=batch_size, device=device, num_workers=workers)
        for name, m in models.items()
    }
    result: dict[str, Any] = {
        "model": model_spec,
        "data": data,
        "split": split,
        "input_size": list(loaded.input_size),
        "images": accuracy["model"]["images"],
        "top1": accuracy["model"]["top1"],
        "top5": accuracy["model"]["top5"],
        "data_config": used["model"].to_json(),
        "data_config_sources": dict(used["model"].sources),
    }
    result["identity"] = model_identity(loaded, model_spec)  # what report joins on
    if base_spec:
        measured, environment = measure_models(models, loaded.input_size, timing)
        paired = speedup(measured["model"], measured["base"])  # what --min-speedup compares
        result["speedup"] = None if paired is None else paired.to_json()
        for name, key in (("base", "base"), ("model", "compressed")):
            result[key] = {
                "top1": accuracy[name]["top1"],
                "top5": accuracy[name]["top5"],
                **measured[name].to_json(),
                "data_config": used[name].to_json(),
                "data_config_sources": dict(used[name].sources),
            }
        # What was compared: "source" stands for the artifact's recorded base, so name that.
        if base_spec == BASE_FROM_ARTIFACT:
            base_spec, base_checkpoint = base.source.spec, base.source.checkpoint
            base_pretrained = base.source.pretrained
        result["base"]["spec"] = base_spec
        result["base"]["identity"] = model_identity(base, base_spec)
        result["base"]["weights"] = base_checkpoint or (
            "timm pretrained" if base_pretrained else None
        )
        result["delta_top1"] = result["top1"] - result["base"]["top1"]
        result["delta_top5"] = result["top5"] - result["base"]["top5"]
        result["environment"] = environment
    elif bounds.max_gmacs is not None:  # only the gate needs the MACs of a lone model
        result["gmacs"] = measure_models(models, loaded.input_size, None)[0]["model"].macs / 1e9
    interval = (result.get("speedup") or {}).get("ci95")
    gates = check_gates(bounds, _gate_values(result), intervals={"speedup": interval})
    result["gates"] = [g.to_json() for g in gates]
    # After the report (a failed run has one error line only), before any gate failure.
    notes = [
        defaults_note(used[name], label)
        for name, label in (
            ("model", model_spec),
            ("base", f"the base {result.get('base', {}).get('spec')}"),
        )
        if name in used
    ]
    if as_json:
        emit_json(result)
        _print_notes(notes)
        finish_gates(gates, as_json)
        return
    console.print(
        f"[bold]{model_spec}[/] on {data} ({split}, {result['images']} images, input "
        f"{tuple(loaded.input_size)})"
    )
    for name, label in (("model", "data config"), ("base", "base data config")):
        if name in used and (name == "model" or used[name] != used["model"]):
            console.print(f"[dim]{label}: {describe(used[name])}[/]", highlight=False)
    table = Table(show_edge=False)
    if not base_spec:
        for column in ("top-1 (%)", "top-5 (%)"):
            table.add_column(column, justify="right")
        table.add_row(f"{result['top1']:.2f}", f"{result['top5']:.2f}")
        console.print(table)
        _print_notes(notes)
        finish_gates(gates, as_json)
        return
    for column in ("", "top-1 (%)", "top-5 (%)", "params (M)", "GMACs", "throughput (img/s)"):
        table.add_column(column, justify="left" if not column else "right")
    for key, label in (("base", f"base {base_spec}"), ("compressed", model_spec)):
        row = result[key]
        table.add_row(
            label,
            f"{row['top1']:.2f}",
            f"{row['top5']:.2f}",
            f"{row['params'] / 1e6:.2f}",
            f"{row['gmacs']:.3f}",
            fmt_throughput(row["throughput"]),
        )
    table.add_row(
        "delta", f"{result['delta_top1']:+.2f}", f"{result['delta_top5']:+.2f}", "", "", ""
    )
    console.print(table)
    print_environment(result["environment"])
    _print_notes(notes)
    finish_gates(gates, as_json)


def _print_notes(notes: list[str | None]) -> None:
    for note in notes:
        if note:
            click.echo(note, err=True)


def _gate_values(result: dict[str, Any]) -> dict[str, float | None]:
    """What the gates compare: top-1 points lost against the base, model/base throughput, and
    the model's GMACs."""
    if "base" not in result:
        return {"gmacs": result.get("gmacs")}
    base, model = result["base"], result["compressed"]
    paired = result.get("speedup")  # median of the paired per-round ratios
    return {
        "acc_drop": base["top1"] - model["top1"],
        "speedup": paired["median"] if paired else None,
        "gmacs": model["gmacs"],
    }
