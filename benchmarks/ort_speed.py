"""Exported speed: compressed models and their base as ONNX files, timed in onnxruntime against
the same models in eager PyTorch, all interleaved in one process (paired ratios, 95% intervals).

The question: does the gather/scatter graph keep its speed-up when a deployer runs the exported
file? Each variant compresses deit_small at the paper's setting (blocks 3,6,9, keep 0.7) with
random weights (speed does not depend on them), is exported with a static batch, checked against
PyTorch, and timed with the base in both runtimes.

    nice python benchmarks/ort_speed.py --batch-size 16 --runs 6 --json-out ort.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import timm

import vitcompress
from vitcompress.workflows.export import export_model
from vitcompress.workflows.export_bench import RUNTIMES, bench_exported

INPUT_SIZE = (3, 224, 224)
VARIANTS = ("dtps", "etps", "dynamicvit", "evit")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deit_small_patch16_224")
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--locs", type=lambda s: [int(v) for v in s.split(",")], default=[3, 6, 9])
    p.add_argument("--keep", type=float, default=0.7)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--seconds", type=float, default=None, help="time budget of the timing")
    p.add_argument("--out-dir", default=None, help="where the ONNX files go (default: a temp dir)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.out_dir or tmp)
        base = timm.create_model(args.model, pretrained=False).eval()
        models = {"base": base} | {
            variant: vitcompress.compress(
                base, variant, keep=args.keep, locs=args.locs, input_size=INPUT_SIZE
            ).eval()
            for variant in args.variants
        }
        files, exports = {}, {}
        for name, model in models.items():
            files[name] = out_dir / f"{args.model}.{name}.onnx"
            exports[name] = export_model(
                model, INPUT_SIZE, "onnx", files[name], batch_size=args.batch_size
            )
            print(
                f"exported {name}: max |diff| {exports[name]['max_abs_diff']:.1e}", file=sys.stderr
            )
        result = bench_exported(
            models,
            files,
            INPUT_SIZE,
            reference="base",
            batch_size=args.batch_size,
            warmup=args.warmup,
            runs=args.runs,
            seconds=args.seconds,
        )
    env = result["environment"]
    print(
        f"\n### Exported speed: {args.model}, blocks {','.join(map(str, args.locs))}, keep "
        f"{args.keep}, batch {args.batch_size}\n\n{env['device_name']}, {env['threads']} threads, "
        f"torch {env['torch']}, onnxruntime {env['onnxruntime']}; {env['runs']} paired rounds "
        f"after {env['warmup']} warm-up; 1-min load {', '.join(f'{v:.1f}' for v in env['loadavg_1min'])}.\n"
    )
    print(
        "| model | PyTorch img/s | ORT img/s | speed-up, PyTorch [95% CI] "
        "| speed-up, ORT [95% CI] | ORT / PyTorch [95% CI] |"
    )
    print("|---|---:|---:|---|---|---|")

    def text(ratio: dict[str, Any] | None) -> str:
        if ratio is None:
            return "-"
        low, high = ratio["ci95"] or (float("nan"), float("nan"))
        return f"{ratio['median']:.3f} [{low:.3f}, {high:.3f}]"

    for name in models:
        speedups = [result["speedup"][runtime].get(name) for runtime in RUNTIMES]
        print(
            f"| {name} | {result['throughput']['pytorch'][name]:.2f} "
            f"| {result['throughput']['onnxruntime'][name]:.2f} | {text(speedups[0])} "
            f"| {text(speedups[1])} | {text(result['onnxruntime_vs_pytorch'][name])} |"
        )
    for warning in result["warnings"]:
        print(f"\nwarning: {warning}")
    if args.json_out:
        payload = {"command": " ".join(sys.argv), "exports": exports} | result
        Path(args.json_out).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
