"""``bench --batch-sizes``: the batch sweep's table."""

from __future__ import annotations

from rich.table import Table

from vitcompress.cli.app import console, fmt_throughput, print_environment
from vitcompress.measure import verdict
from vitcompress.workflows.bench import COMPRESSED, SweepResult


def print_sweep(result: SweepResult) -> None:
    """The sweep as a table: images/s of each model at each batch size and, against a base, the
    paired speed-up and whether the compressed model is faster; then the crossover batch."""
    sweep, compared = result.sweep, result.compared
    table = Table(show_edge=False)
    table.add_column("batch", justify="right")
    for name in result.models:
        table.add_column(f"{name} (img/s)", justify="right")
    if compared:
        table.add_column("speed-up [95% CI]")
        table.add_column("faster (95% CI)")
    for point in sweep.points:
        cells = [str(point.batch_size)]
        cells += [fmt_throughput(point.throughput[n]) for n in result.models]
        if compared:
            ratio = point.speedup[COMPRESSED]
            cells += [
                ratio.text(),
                # Too few pairs for an interval: the median alone cannot say.
                verdict(ratio.interval, 1.0) if ratio.interval is not None else "undecided",
            ]
        table.add_row(*cells)
    console.print(table)
    if compared:
        crossing = sweep.crossover(COMPRESSED)
        unconfirmed = sweep.unconfirmed(COMPRESSED)
        console.print(
            (
                f"compression pays from batch {crossing} on (of those swept, by the median)"
                + (
                    f"; not shown at 95% at batch{'es' if len(unconfirmed) > 1 else ''} "
                    f"{', '.join(map(str, unconfirmed))}: time more --runs"
                    if unconfirmed
                    else ""
                )
            )
            if crossing is not None
            else "compression does not pay at the largest batch swept",
            highlight=False,
        )
    else:
        console.print(
            "one model swept: pass a compressed model directory to compare it with its base",
            style="dim",
        )
    if result.plot is not None:
        console.print(f"plot: {result.plot}")
    sizes = ",".join(str(point.batch_size) for point in sweep.points)
    print_environment(sweep.environment | {"batch_size": sizes})
