"""Render a ladder's JSON (``benchmarks/gpu_ladder.py``) into the docs: a table between the
markers ``<!-- ladder:RUN:start -->`` and ``<!-- ladder:RUN:end -->`` of a Markdown file (added
at its end the first time), and a plot of the speed-ups by batch size.

    python benchmarks/gpu_ladder_report.py benchmarks/results/gpu/ladder-h200.json \\
        --doc docs/serving.md --plot docs/img/gpu_ladder-h200.png

Every figure is the median of the processes the ladder ran (at least two fresh ones); the table
says how many.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ORDER = ("deit_tiny", "deit_small", "vit_base", "vit_large", "dinov2_base", "swin_tiny")


def _group(records: list[dict]) -> dict[tuple, dict[int, dict]]:
    rows: dict[tuple, dict[int, dict]] = {}
    for r in records:
        key = (r["model"], r["dtype"], r["mode"], r["method"])
        rows.setdefault(key, {})[r["batch"]] = r
    rank = {name: i for i, name in enumerate(ORDER)}
    return dict(sorted(rows.items(), key=lambda kv: (rank.get(kv[0][0], 99), *kv[0][1:])))


def table(records: list[dict], per_process: bool = False) -> str:
    """One row per model, dtype, mode and method; per batch: the speed-up over the base and,
    in parentheses, the share of ideal slicing's throughput (the medians); with
    ``per_process``, every process's speed-up instead, in the order the processes ran."""
    batches = sorted({r["batch"] for r in records})
    head = "| model | dtype | mode | method | GMACs ratio | " + " | ".join(
        f"batch {b}" for b in batches
    )
    lines = [head + " |", "|---|---|---|---|---:|" + "---:|" * len(batches)]
    for (model, dtype, mode, method), by_batch in _group(records).items():
        any_record = next(iter(by_batch.values()))
        ratio = any_record["gmacs"] / any_record["base_gmacs"]
        cells = []
        for b in batches:
            r = by_batch.get(b)
            if r is None or r["speedup_vs_base"] is None:
                cells.append("-")
                continue
            if per_process:
                cells.append(" / ".join(f"{v:.2f}" for v in r["speedup_vs_base_processes"]))
                continue
            ideal = "" if r["of_ideal"] is None else f" ({r['of_ideal']:.2f})"
            cells.append(f"{r['speedup_vs_base']:.2f}x{ideal}")
        lines.append(
            f"| {model} | {dtype} | {mode} | {method} | {ratio:.3f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def section(records: list[dict], source: str, plot: str | None) -> str:
    env = records[0]
    processes = sorted({r["processes"] for r in records})
    text = [
        f"Run `{env['run']}` on {env['device_name']} (torch {env['torch']}), from `{source}`: "
        f"speed-up over the base (paired rounds, median of {'/'.join(map(str, processes))} fresh "
        "processes) and, in parentheses, the compressed model's throughput over ideal slicing's "
        "(none for Swin, which has no ideal model). Compiled: "
        + json.dumps(next((r["compile"] for r in records if r.get("compile")), None))
        + ".",
        "",
        table(records),
        "",
        "Each process's speed-up over the base, in the order the processes ran (the medians "
        "above are of these):",
        "",
        table(records, per_process=True),
    ]
    if plot:
        text += ["", f"![speed-up by batch size]({plot})"]
    return "\n".join(text)


def write_section(doc: Path, run: str, body: str) -> None:
    start, end = f"<!-- ladder:{run}:start -->", f"<!-- ladder:{run}:end -->"
    text = doc.read_text() if doc.exists() else ""
    block = f"{start}\n{body}\n{end}"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def plot_ladder(records: list[dict], path: Path) -> Path:
    """Speed-up over the base by batch size: a panel per model and dtype, a line per method and
    mode (compiled dashed), the break-even line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in ORDER if any(r["model"] == m for r in records)]
    models += sorted({r["model"] for r in records} - set(models))
    dtypes = sorted({r["dtype"] for r in records})
    figure, axes = plt.subplots(
        len(dtypes), len(models), figsize=(3.2 * len(models), 2.8 * len(dtypes)), squeeze=False
    )
    for row, dtype in enumerate(dtypes):
        for col, model in enumerate(models):
            ax = axes[row][col]
            for (m, d, mode, method), by_batch in _group(records).items():
                if (m, d) != (model, dtype):
                    continue
                sizes = sorted(b for b, r in by_batch.items() if r["speedup_vs_base"] is not None)
                ax.plot(
                    sizes,
                    [by_batch[b]["speedup_vs_base"] for b in sizes],
                    "o-" if mode == "eager" else "s--",
                    label=f"{method} {mode}",
                    markersize=3,
                )
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{model}, {dtype}", fontsize=9)
            ax.grid(True, alpha=0.3)
            if col == 0:
                ax.set_ylabel("speed-up over base")
            if row == len(dtypes) - 1:
                ax.set_xlabel("batch")
    axes[0][-1].legend(fontsize=6)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("json", help="a ladder's records (benchmarks/results/gpu/ladder-RUN.json)")
    p.add_argument("--doc", default="docs/serving.md")
    p.add_argument("--plot", default=None, help="PNG to write (its path is linked in the doc)")
    args = p.parse_args(argv)
    every: list[dict[str, Any]] = json.loads(Path(args.json).read_text())
    # Only figures with a median over two fresh processes or more are quoted.
    records = [r for r in every if r["processes"] >= 2]
    if not records:
        raise SystemExit(f"{args.json}: no record timed in two processes or more")
    if len(records) < len(every):
        print(f"{len(every) - len(records)} records timed in one process only are left out")
    doc = Path(args.doc)
    link = None
    if args.plot:
        written = plot_ladder(records, Path(args.plot))
        link = os.path.relpath(written.resolve(), doc.resolve().parent)
    write_section(doc, records[0]["run"], section(records, args.json, link))
    print(f"{args.doc}: ladder {records[0]['run']} ({len(records)} records)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
