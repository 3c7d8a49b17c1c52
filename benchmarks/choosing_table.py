"""The seeded comparison of the five methods: one table with 95% intervals, the paper's claims
with verdicts, one interleaved timing, and a plot with error bars (issue 25's table).

It reads the runs that ``fashion_mnist_repro.py --seeds S`` caches in ``--cache/runs`` (one
``METHOD_keepK_seedS.json`` per run, the fine-tuned model beside it) and trains nothing. For each
(method, keep) it gives the mean over the seeds found, with a Student-t 95% interval, of: top-1
before fine-tuning (training-free), after fine-tuning, and under a random policy, and the drop
from the second to the third. Differences between methods use Welch's interval
(``seed_stats.py``). A verdict is "held" when the interval of the claimed difference lies wholly
on the claimed side of zero, "contradicted" when wholly on the other, "not shown" otherwise.

Throughput: the base and one model per (method, keep) (the first seed's: every seed has the same
architecture and keep) are timed interleaved in this process, and the ratio to the base is given.

Example (the run in docs/results-accuracy.md)::

    python benchmarks/choosing_table.py --cache ~/.cache/vitcompress/fmnist_choosing \\
        --md-out benchmarks/results/choosing/table.md --json-out \\
        benchmarks/results/choosing/table.json --plot docs/img/fmnist_choosing.png --threads 1
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fashion_mnist_repro as repro  # noqa: E402 - the runs' base, its input size, the methods
from seed_stats import Estimate, combination_interval, mean_interval  # noqa: E402

from vitcompress.api import load  # noqa: E402
from vitcompress.measure import count_macs, count_params, measure_throughput  # noqa: E402

RUN_NAME = re.compile(r"^(?P<method>[a-z]+)_keep(?P<keep>[0-9.]+)_seed(?P<seed>\d+)\.json$")


def collect_runs(runs_dir: Path, base_sha256: str | None = None) -> dict[tuple[str, float], list]:
    """The seeded runs in ``runs_dir``, grouped by (method, keep) and sorted by seed. Runs with
    extra settings (``--variant-arg``: another name) or of another base are left out."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(runs_dir.glob("*.json")):
        match = RUN_NAME.match(path.name)
        if match is None:
            continue
        run = json.loads(path.read_text())
        if base_sha256 is not None and run.get("base_sha256") != base_sha256:
            continue
        run["run"] = path.stem
        groups[(match["method"], float(match["keep"]))].append(run)
    for runs in groups.values():
        runs.sort(key=lambda run: run["seed"])
    return dict(groups)


def summarise(groups: dict[tuple[str, float], list]) -> list[dict[str, Any]]:
    """One row per (method, keep): means with intervals over the seeds."""
    rows = []
    for (method, keep), runs in sorted(
        groups.items(), key=lambda item: (-item[0][1], repro.METHODS.index(item[0][0]))
    ):
        row: dict[str, Any] = {
            "method": method,
            "keep": keep,
            "seeds": [run["seed"] for run in runs],
            "macs": runs[0]["macs"],
            "params": runs[0]["params"],
            "top1_before": mean_interval([run["top1_before"] for run in runs]),
            "top1": mean_interval([run["top1"] for run in runs]),
            "top1_random": None,
            "random_drop": None,
        }
        if runs[0].get("matched"):
            row["tome_r"] = runs[0]["matched"]["tome_r"]
        if all(run["top1_random"] is not None for run in runs):
            row["top1_random"] = mean_interval([run["top1_random"] for run in runs])
            row["random_drop"] = mean_interval([run["top1"] - run["top1_random"] for run in runs])
        rows.append(row)
    return rows


def _verdict(estimate: Estimate, claimed_sign: int) -> str:
    if estimate.n < 2:  # one seed: an interval of width zero says nothing about noise
        return "one seed: not judged"
    side = estimate.excludes_zero()
    return (
        "held" if side == claimed_sign else "contradicted" if side == -claimed_sign else "not shown"
    )


def claims(groups: dict[tuple[str, float], list]) -> list[dict[str, Any]]:
    """The paper's three claims, each difference with its interval and verdict."""

    def values(method: str, keep: float, field: str) -> list[float] | None:
        runs = groups.get((method, keep))
        if not runs:
            return None
        if field == "random_drop":
            if any(run["top1_random"] is None for run in runs):
                return None
            return [run["top1"] - run["top1_random"] for run in runs]
        return [run[field] for run in runs]

    keeps = sorted({keep for _, keep in groups}, reverse=True)
    out: list[dict[str, Any]] = []

    def claim(text: str, keep: Any, weighted: list, claimed_sign: int) -> None:
        """Add the claim where every group it compares has runs."""
        if all(values for _, values in weighted):
            estimate = combination_interval(weighted)
            verdict = _verdict(estimate, claimed_sign)
            out.append({"claim": text, "keep": keep, "difference": estimate, "verdict": verdict})

    for tps, baseline in repro.TPS_OF.items():
        for keep in keeps:
            claim(
                f"{tps} > {baseline}, top-1 after fine-tuning",
                keep,
                [(1.0, values(tps, keep, "top1")), (-1.0, values(baseline, keep, "top1"))],
                +1,
            )
        # The paper claims the widening for dTPS over DynamicViT only (its Fig. 5):
        # (tps - baseline) at the lower keep minus at the higher.
        if tps == "dtps" and len(keeps) == 2:
            high, low = keeps
            claim(
                f"{tps} - {baseline} widens from keep {high} to {low}",
                f"{low} vs {high}",
                [
                    (1.0, values(tps, low, "top1")),
                    (-1.0, values(baseline, low, "top1")),
                    (-1.0, values(tps, high, "top1")),
                    (1.0, values(baseline, high, "top1")),
                ],
                +1,
            )
        for keep in keeps:  # a smaller drop: the TPS drop minus the baseline's below zero
            claim(
                f"{tps} drops less than {baseline} under a random policy",
                keep,
                [
                    (1.0, values(tps, keep, "random_drop")),
                    (-1.0, values(baseline, keep, "random_drop")),
                ],
                -1,
            )
    return out


def time_models(
    cache: Path, rows: list[dict[str, Any]], groups: dict, batch: int, runs: int
) -> dict[str, float]:
    """Images/s of the base and of each (method, keep)'s first-seed model, interleaved."""
    models = {"base": repro.load_base(cache / "base.safetensors").model}
    for row in rows:
        first = groups[(row["method"], row["keep"])][0]
        models[f"{row['method']}_keep{row['keep']}"] = load(cache / "runs" / first["run"])
    report = measure_throughput(models, repro.INPUT_SIZE, batch_size=batch, runs=runs)
    return {name: result.median for name, result in report.results.items()}


def markdown(
    base: dict[str, Any], rows: list[dict[str, Any]], verdicts: list[dict], speed: dict | None
) -> str:
    lines = [
        f"Base: {base['top1']:.2f}% top-1, {base['macs'] / 1e6:.2f} MMACs, "
        f"{base['params'] / 1e3:.1f}k params"
        + (f", {speed['base']:.0f} img/s" if speed else "")
        + ". Each cell: the mean over the seeds [95% interval, Student t].",
        "",
        "| method | keep | seeds | MMACs | params | img/s (× base) | top-1 before FT | "
        "top-1 after FT | top-1 random policy | drop under random |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        method, keep = row["method"], f"{row['keep']}"
        if "tome_r" in row:
            method, keep = f"tome (r = {row['tome_r']})", f"MMACs of {row['keep']}"
        name = f"{row['method']}_keep{row['keep']}"
        speed_cell = f"{speed[name]:.0f} ({speed[name] / speed['base']:.2f}×)" if speed else "—"
        random_cells = (
            f"{row['top1_random'].cell()} | {row['random_drop'].cell()}"
            if row["top1_random"] is not None
            else "— | —"
        )
        lines.append(
            f"| {method} | {keep} | {len(row['seeds'])} | {row['macs'] / 1e6:.2f} | "
            f"{row['params'] / 1e3:.1f}k | {speed_cell} | {row['top1_before'].cell()} | "
            f"{row['top1'].cell()} | {random_cells} |"
        )
    lines += [
        "",
        "| claim | keep | difference [95% interval, Welch] | verdict |",
        "|---|---|---|---|",
    ]
    for item in verdicts:
        lines.append(
            f"| {item['claim']} | {item['keep']} | {item['difference'].signed_cell()} | "
            f"{item['verdict']} |"
        )
    return "\n".join(lines) + "\n"


def plot(base: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    """Top-1 after fine-tuning against MMACs, with the intervals as error bars; ToMe also
    without fine-tuning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))

    def series(method: str, field: str, label: str, hollow: bool = False) -> None:
        points = sorted(
            ((r["macs"] / 1e6, r[field]) for r in rows if r["method"] == method),
            key=lambda point: point[0],
        )
        if not points:
            return
        color, marker, line = repro.PLOT_STYLES[method]
        ax.errorbar(
            [x for x, _ in points],
            [e.mean for _, e in points],
            yerr=[[e.mean - e.low for _, e in points], [e.high - e.mean for _, e in points]],
            fmt=(":" if hollow else line),
            color=color,
            marker=marker,
            markerfacecolor="none" if hollow else color,
            capsize=3,
            label=label,
        )

    for method in repro.METHODS:
        series(method, "top1", method)
    series("tome", "top1_before", "tome, no fine-tuning", hollow=True)
    repro.finish_plot(
        fig, ax, base, "Top-1 after equal fine-tuning: mean and 95% interval over seeds", path
    )


def _estimate_json(value: Any) -> Any:
    """``json.dumps``'s ``default``: an interval as mean, ci95 and n."""
    if isinstance(value, Estimate):
        return {"mean": value.mean, "ci95": [value.low, value.high], "n": value.n}
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", type=Path, required=True, help="fashion_mnist_repro.py's --cache")
    p.add_argument("--no-timing", action="store_true", help="skip the interleaved timing")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--throughput-runs", type=int, default=15)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--md-out", type=Path)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base_path = args.cache / "base.safetensors"
    if not base_path.is_file():
        p.error(f"no base in {args.cache}: run fashion_mnist_repro.py --cache {args.cache} first")
    base_record = repro._base_record(base_path)
    groups = collect_runs(args.cache / "runs", base_record["sha256"])
    if not groups:
        p.error(f"no seeded runs of this base in {args.cache / 'runs'}")
    base_model = repro.load_base(base_path).model
    base = {
        "top1": base_record["top1"],
        "macs": count_macs(base_model, repro.INPUT_SIZE),
        "params": count_params(base_model),
    }
    rows = summarise(groups)
    verdicts = claims(groups)
    speed = None
    if not args.no_timing:
        print("timing the base and one model per row, interleaved ...", flush=True)
        speed = time_models(args.cache, rows, groups, args.batch, args.throughput_runs)
    table = markdown(base, rows, verdicts, speed)
    print(table)
    if args.md_out:
        args.md_out.parent.mkdir(parents=True, exist_ok=True)
        args.md_out.write_text(table)
    if args.plot:
        plot(base, rows, args.plot)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        data = {"base": base, "rows": rows, "claims": verdicts, "img_per_s": speed}
        args.json_out.write_text(
            json.dumps({**data, "command": " ".join(sys.argv)}, indent=2, default=_estimate_json)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
