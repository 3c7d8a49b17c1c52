"""int8 ONNX: which quantized form runs fastest in onnxruntime here, and how far a keep-1 model
quantized is from its quantized base.

``forms``: the float32 files ``export --quantize int8 --bench`` leaves (``NAME.fp32.onnx`` and
``NAME.base.fp32.onnx``) quantized dynamically in three forms (weights int8 per channel, the
default; uint8 per channel; int8 per tensor), the base and the compressed model alike, and all
timed interleaved in onnxruntime with the float32 files (paired ratios over the float32 base).

    nice python benchmarks/ort_int8.py forms --fp32 exports/m.fp32.onnx --batch-size 8

``keep-one``: deit_small (random weights, query and key weights x3 so attention is far from
uniform) and its eTPS/dTPS at keep 1, exported and quantized alike; the largest logit difference
of the int8 compressed file to the int8 base, against the quantizer's own error (int8 base to
float32 base), on random batches.

    nice python benchmarks/ort_int8.py keep-one --batch-size 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import timm
import torch

import vitcompress
from vitcompress.measure.onnx_runtime import onnx_session
from vitcompress.workflows.export import export_model
from vitcompress.workflows.export_bench import bench_exported
from vitcompress.workflows.onnx_quantize import inserted_module_scopes, quantize_onnx_file

INPUT_SIZE = (3, 224, 224)
# name: (weight type, per channel)
FORMS = {"s8-channel": ("int8", True), "u8-channel": ("uint8", True), "s8-tensor": ("int8", False)}


def forms(args: argparse.Namespace) -> dict[str, Any]:
    compressed = Path(args.fp32)
    base = compressed.with_name(compressed.name.replace(".fp32", ".base.fp32"))
    files = {"base": base, "compressed": compressed}
    with tempfile.TemporaryDirectory() as tmp:
        for form, (weight_type, per_channel) in FORMS.items():
            for name, source in (("base", base), ("compressed", compressed)):
                files[f"{name}.{form}"] = Path(tmp) / f"{name}.{form}.onnx"
                quantize_onnx_file(
                    source,
                    files[f"{name}.{form}"],
                    "int8",
                    per_channel=per_channel,
                    weight_type=weight_type,
                )  # the reducers' nodes: MatMulConstBOnly keeps their products float here
        timed = bench_exported(
            {},
            files,
            INPUT_SIZE,
            "base",
            batch_size=args.batch_size,
            warmup=args.warmup,
            runs=args.runs,
            also_paired=[(f"compressed.{form}", f"base.{form}") for form in FORMS],
        )
    speedup = timed["speedup"]["onnxruntime"]
    for name in files:
        ratio = speedup.get(name)
        text = "1" if ratio is None else f"{ratio['median']:.2f}x {ratio['ci95']}"
        print(f"{name:24s} {timed['throughput']['onnxruntime'][name]:7.2f} img/s  {text}")
    for pair, ratio in timed["paired"].items():
        print(f"{pair:36s} {ratio['median']:.2f}x {ratio['ci95']}")
    print(timed["environment"]["thread_choice"], timed["environment"]["loadavg_1min"])
    return timed


def keep_one(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    base = timm.create_model("deit_small_patch16_224", pretrained=False).eval()
    with torch.no_grad():
        for block in base.blocks:
            block.attn.qkv.weight[: 2 * block.attn.qkv.in_features] *= 3.0
    models = {"base": base} | {
        method: vitcompress.compress(base, method, 1.0, [3, 6, 9], INPUT_SIZE).eval()
        for method in ("etps", "dtps")
    }
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(args.batch_size, *INPUT_SIZE, generator=generator) for _ in range(3)]
    logits: dict[str, list[np.ndarray]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in models.items():
            fp32, int8 = Path(tmp) / f"{name}.fp32.onnx", Path(tmp) / f"{name}.onnx"
            export_model(model, INPUT_SIZE, "onnx", fp32, batch_size=args.batch_size)
            quantize_onnx_file(fp32, int8, "int8", inserted_module_scopes(model))
            for kind, path in (("fp32", fp32), ("int8", int8)):
                session = onnx_session(path)
                logits[f"{name}.{kind}"] = [
                    session.run(None, {"image": b.numpy()})[0] for b in batches
                ]

    def diff(a: str, b: str) -> float:
        return max(float(np.abs(x - y).max()) for x, y in zip(logits[a], logits[b], strict=True))

    result = {
        "quantizer_error": diff("base.int8", "base.fp32"),
        "logit_scale": max(float(np.abs(x).max()) for x in logits["base.fp32"]),
    }
    for method in ("etps", "dtps"):
        result[f"{method}: int8 to int8 base"] = diff(f"{method}.int8", "base.int8")
        result[f"{method}: fp32 to fp32 base"] = diff(f"{method}.fp32", "base.fp32")
    print(json.dumps(result, indent=1))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("forms")
    p.add_argument("--fp32", required=True, help="NAME.fp32.onnx from export --quantize --bench")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=10)
    p = sub.add_parser("keep-one")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    result = forms(args) if args.command == "forms" else keep_one(args)
    if getattr(args, "json_out", None):
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
