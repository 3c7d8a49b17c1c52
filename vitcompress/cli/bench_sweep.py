"""``bench --batch-sizes``: the batch sweep's table, JSON and plot."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from vitcompress.cli.app import console, emit_json, fmt_throughput, print_environment
from vitcompress.loading import LoadedModel
from vitcompress.measure import verdict
from vitcompress.workflows.batch_sweep import plot_sweep, sweep_batch_sizes
from vitcompress.workflows.measure_models import TimingOptions, base_for_timing
from vitcompress.workflows.status import step

BASE, COMPRESSED, MODEL = "base", "compressed", "model"


def run_sweep(
    loaded: LoadedModel,
    model_spec: str,
    batch_sizes: list[int],
    timing: TimingOptions,
    plot: str | None,
    as_json: bool,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Sweep ``loaded`` (against its recorded base when it is a compressed model directory) over
    ``batch_sizes``, print the table or JSON, write the plot; returns the JSON printed."""
    with step("loading the base of the model, if it is a compressed model directory"):
        base = base_for_timing(loaded)
    models = (
        {BASE: base.model, COMPRESSED: loaded.model} if base is not None else {MODEL: loaded.model}
    )
    sweep = sweep_batch_sizes(
        models,
        loaded.input_size,
        batch_sizes,
        timing,
        reference=BASE if base is not None else None,
    )
    result = {"model": model_spec, **extra, **sweep.to_json()}
    if plot is not None:
        result["plot"] = str(plot_sweep(sweep, plot, f"{model_spec}: throughput by batch size"))
    if as_json:
        emit_json(result)
        return result
    table = Table(show_edge=False)
    table.add_column("batch", justify="right")
    for name in models:
        table.add_column(f"{name} (img/s)", justify="right")
    if base is not None:
        table.add_column("speed-up [95% CI]")
        table.add_column("faster (95% CI)")
    for point in sweep.points:
        cells = [str(point.batch_size)] + [fmt_throughput(point.throughput[n]) for n in models]
        if base is not None:
            ratio = point.speedup[COMPRESSED]
            cells += [
                ratio.text(),
                # Too few pairs for an interval: the median alone cannot say.
                verdict(ratio.interval, 1.0) if ratio.interval is not None else "undecided",
            ]
        table.add_row(*cells)
    console.print(table)
    if base is not None:
        crossing = sweep.crossover(COMPRESSED)
        console.print(
            f"compression pays from batch {crossing} on (of those swept)"
            if crossing is not None
            else "compression does not pay at the largest batch swept",
            highlight=False,
        )
    else:
        console.print(
            "one model swept: pass a compressed model directory to compare it with its base",
            style="dim",
        )
    if plot is not None:
        console.print(f"plot: {result['plot']}")
    sizes = ",".join(str(point.batch_size) for point in sweep.points)
    print_environment(sweep.environment | {"batch_size": sizes})
    return result
