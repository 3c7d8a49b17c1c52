"""Throughput of compressed Swin-T against Swin-T: every method at each keep, timed interleaved.

All models (the base and each method at each keep, at the default locations: every windowed
block) are timed round-robin in this one process with ``vitcompress.measure.measure_throughput``
(its thread choice fits the free cores), so noise hits them alike; each compressed model's
throughput over the base's is taken round by round (paired ratios), as a median with a bootstrap
95% interval. GMACs are counted on the graph. Random weights: speed does not depend on them.

    python benchmarks/windowed_speed.py --json-out benchmarks/results/windowed/speed_cpu.json
    python benchmarks/windowed_speed.py --device cuda --batch-size 64   # where a GPU is lent
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import timm
import torch

from vitcompress import compress
from vitcompress.measure import count_macs, measure_throughput

METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="swin_tiny_patch4_window7_224")
    p.add_argument("--size", type=int, default=224, help="image side")
    p.add_argument("--keeps", default="0.7,0.5")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--runs", type=int, default=8, help="timed batches per model")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="default: chosen for the load")
    p.add_argument("--json-out", type=Path)
    p.add_argument(
        "--carry-windows",
        action="store_true",
        help="also time each method with carry_windows=True (its own default locations)",
    )
    p.add_argument(
        "--without-branches",
        action="store_true",
        help="also time each method with carry_branches=False (DaViT's channel MLPs on every "
        "token)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = (3, args.size, args.size)
    torch.manual_seed(0)
    base = timm.create_model(args.model).eval()
    models: dict[str, torch.nn.Module] = {"base": base}
    macs = {"base": count_macs(base, size)}
    for keep in (float(k) for k in args.keeps.split(",")):
        for method in args.methods.split(","):
            settings = {"": None}
            if args.carry_windows:
                settings["+carry"] = {"carry_windows": True}
            if args.without_branches:
                settings["-branches"] = {"carry_branches": False}
            for suffix, variant_args in settings.items():
                name = f"{method}@{keep:g}{suffix}"
                models[name] = compress(
                    base, method, keep=[keep], input_size=size, variant_args=variant_args
                ).eval()
                macs[name] = count_macs(models[name], size)
    report = measure_throughput(
        models,
        size,
        batch_size=args.batch_size,
        device=args.device,
        warmup=args.warmup,
        runs=args.runs,
        threads=args.threads,
    )
    rows: list[dict[str, Any]] = []
    print(f"{args.model} at {args.size}px, batch {args.batch_size}, {args.device}")
    print(f"{'model':<20} {'GMACs':>7} {'ratio':>6} {'img/s':>8}  paired speed-up")
    for name in models:
        paired = report.paired(name, "base") if name != "base" else None
        row = {
            "model": name,
            "gmacs": macs[name] / 1e9,
            "macs_ratio": macs[name] / macs["base"],
            "img_per_s": report.results[name].median,
            "paired_speedup": paired.to_json() if paired is not None else None,
        }
        rows.append(row)
        print(
            f"{name:<20} {row['gmacs']:>7.3f} {row['macs_ratio']:>6.3f} "
            f"{row['img_per_s']:>8.2f}  {paired.text() if paired else '-'}"
        )
    for warning in report.warnings:
        print(f"warning: {warning}")
    if args.json_out is not None:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(
            json.dumps(
                {
                    "command": " ".join(["python", *sys.argv]),
                    "model": args.model,
                    "size": args.size,
                    "batch_size": args.batch_size,
                    "rows": rows,
                    "environment": report.environment,
                    "warnings": report.warnings,
                },
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
