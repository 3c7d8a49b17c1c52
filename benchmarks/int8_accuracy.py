"""int8 ONNX files of compressed models: what quantization costs in accuracy, how often it changes
the predicted class, and what it buys in onnxruntime speed.

On the Fashion-MNIST base of docs/results.md "Choosing a method" (90.29%) and each of the five
methods at keep 0.7 (ToMe at the MMACs of keep 0.7, r = 8, as the table has it), compressed
without fine-tuning (the fine-tuned models of that table are not kept on disk), every step goes
through the command line, as a user runs it:

1. ``apply`` compresses the base (the locations of the table's runs);
2. ``export --format onnx`` writes the float32 file, ``--quantize int8`` the dynamic int8 one and
   ``--quantize int8-static --data fashion-mnist --calibration-images 256`` the static one, all at
   batch 32; each command's seconds are kept, with the file sizes;
3. ``eval --model FILE.onnx`` scores each file on the 10,000 test images, the float32 file against
   the PyTorch model it was exported from and each int8 file against the float32 file (argmax
   agreement);
4. the three files of a model are timed in onnxruntime, one thread, batch 32, interleaved round by
   round in this process (paired ratios over float32 with their 95% intervals).

deit_small (random weights) at 224 x 224 is timed the same way (step 4; no accuracy: its
weights are random), for what int8 does to a model of ImageNet size.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/int8_accuracy.py

Results: ``benchmarks/results/int8/int8.json`` (and one JSON per model); the page is
docs/results-int8.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import timm
from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's vitcompress, also where it is not installed
CHOOSING = ROOT / "benchmarks" / "results" / "choosing"
BASE_WEIGHTS = CHOOSING / "base.safetensors"
RESULTS = ROOT / "benchmarks" / "results" / "int8"
# The base of fashion_mnist_repro.py, built as its record says it was trained.
SPEC = "vit_small_patch16_224"
MODEL_ARGS: dict[str, Any] = json.loads((CHOOSING / "base.json").read_text())["settings"][
    "model_args"
]
# What the base was trained and scored with (build_dataset without a data config): ImageNet's
# mean and std averaged over RGB for one channel, bicubic, Fashion-MNIST never cropped. The timm
# name alone would state its pretrained_cfg's 0.5 / 0.5 and crop 0.9 instead.
DATA_CONFIG: dict[str, Any] = {
    "mean": [sum(IMAGENET_DEFAULT_MEAN) / 3],
    "std": [sum(IMAGENET_DEFAULT_STD) / 3],
    "interpolation": "bicubic",
    "crop_pct": 1.0,
}
METHODS = ("dynamicvit", "evit", "dtps", "etps", "tome")
KEEP = 0.7
MODES = ("fp32", "int8", "int8-static")
FILE_NAMES = {"fp32": "fp32.onnx", "int8": "int8.onnx", "int8-static": "int8-static.onnx"}
BATCH = 32
DEIT = "deit_small_patch16_224"


def fashion_mnist_base() -> Any:
    """The base's architecture stating the preprocessing it was trained with (``--model
    benchmarks/int8_accuracy.py:fashion_mnist_base --checkpoint base.safetensors``)."""
    model = timm.create_model(SPEC, pretrained=False, **MODEL_ARGS)
    model.data_config = dict(DATA_CONFIG)
    return model


def fashion_mnist_base_trained() -> Any:
    """The base with its trained weights: a spec with no options, what ``eval --reference``
    takes."""
    from safetensors.torch import load_file

    model = fashion_mnist_base()
    model.load_state_dict(load_file(str(BASE_WEIGHTS)))
    return model


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default=str(Path("~/.cache/vitcompress/int8").expanduser()),
                   help="artifacts and ONNX files; a step whose output is there is not redone")  # fmt: skip
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--methods", type=lambda s: [m for m in s.split(",") if m],
                   default=["base", *METHODS])  # fmt: skip
    p.add_argument("--modes", type=lambda s: s.split(","), default=list(MODES))
    p.add_argument("--val-images", type=int, default=None, help="default: all 10,000")
    p.add_argument("--calibration-images", type=int, default=256)
    p.add_argument("--runs", type=int, default=20, help="timed rounds per model")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--deit-methods", type=lambda s: [m for m in s.split(",") if m],
                   default=["base", "etps"], help="deit_small models timed ('' for none)")  # fmt: skip
    p.add_argument("--deit-runs", type=int, default=6)
    p.add_argument("--finetuned", action="store_true",
                   help="fine-tune each method (two epochs, as the table's runs) before export; "
                   "artifacts in WORK/finetuned, results in OUT_DIR/finetuned")  # fmt: skip
    p.add_argument("--tables", action="store_true",
                   help="only write table.md again from the int8.json in --out-dir")  # fmt: skip
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# The command line, as a user runs it


def cli(*args: str) -> tuple[dict[str, Any] | None, float]:
    """``vitcompress ARGS`` in a subprocess (one thread): its ``--json`` output (None without
    ``--json``) and its wall seconds. A failure stops the benchmark with the command's error."""
    command = [sys.executable, "-m", "vitcompress.cli.main", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): vitcompress {' '.join(args)}\n"
                         f"{done.stderr.strip()}")  # fmt: skip
    return (json.loads(done.stdout) if "--json" in args else None), seconds


def cached(path: Path, make: Any, *args: Any) -> dict[str, Any]:
    """The JSON at ``path``, made by ``make(*args)`` when it is not there yet."""
    if path.is_file():
        return json.loads(path.read_text())
    value = make(*args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")
    return value


def tome_r_and_locs() -> tuple[int, list[int]]:
    """ToMe's r at keep 0.7's MMACs and the locations of the table's runs (from its seed-0 run)."""
    run = json.loads((CHOOSING / "runs" / f"tome_keep{KEEP}_seed0.json").read_text())
    return int(run["matched"]["tome_r"]), [int(v) for v in run["settings"]["locs"]]


def base_model_options() -> list[str]:
    return ["--model", f"{Path(__file__).resolve()}:fashion_mnist_base",
            "--checkpoint", str(BASE_WEIGHTS)]  # fmt: skip


def apply(options: list[str], artifact: Path) -> dict[str, Any]:
    """``apply OPTIONS --out ARTIFACT``: its seconds."""
    _, seconds = cli("apply", *options, "--out", str(artifact), "--no-throughput")
    return {"apply_seconds": seconds}


def finetune(options: list[str], artifact: Path) -> dict[str, Any]:
    """``finetune OPTIONS --out ARTIFACT`` as the "Choosing a method" runs were fine-tuned (two
    epochs, lr 5e-4, 0.2 warm-up epochs, batch 128, seed 0): its seconds and validation top-1."""
    settings = ["--data", "fashion-mnist", "--epochs", "2", "--lr", "5e-4", "--warmup-epochs",
                "0.2", "--batch-size", "128", "--seed", "0", "--log-every", "100"]  # fmt: skip
    result, seconds = cli("finetune", *options, *settings, "--out", str(artifact), "--json")
    assert result is not None
    return {"apply_seconds": seconds, "finetune": result}


def compress(method: str, work: Path, finetuned: bool = False) -> dict[str, Any]:
    """``apply`` of ``method`` to the base (its artifact in ``work/method``), or ``finetune``
    with ``finetuned``: the model options export takes, the spec ``eval --reference`` takes, and
    the command's seconds."""
    if method == "base":
        trained = f"{Path(__file__).resolve()}:fashion_mnist_base_trained"
        return {"model": base_model_options(), "reference": trained, "apply_seconds": 0.0}
    artifact = work / method
    r, locs = tome_r_and_locs()
    plan = ["--variant", "tome", "--variant-arg", f"r={r}"] if method == "tome" else [
        "--variant", method, "--keep", str(KEEP)]  # fmt: skip

    options = [*base_model_options(), *plan, "--locs", ",".join(map(str, locs))]
    if finetuned:
        made = cached(work / f"{method}.finetune.json", finetune, options, artifact)
    else:
        made = cached(work / f"{method}.apply.json", apply, options, artifact)
    return {"model": ["--model", str(artifact)], "reference": str(artifact), **made}


def export(model: list[str], mode: str, out: Path, data: list[str], calibration: int) -> dict:
    """``export`` of ``model`` as ``mode`` to ``out`` at batch 32: the command's seconds and JSON."""
    quantize = [] if mode == "fp32" else ["--quantize", mode]
    if mode == "int8-static":
        quantize += [*data, "--calibration-images", str(calibration)]
    result, seconds = cli("export", *model, "--format", "onnx", "--out", str(out),
                          "--batch-size", str(BATCH), *quantize, "--json")  # fmt: skip
    return {"seconds": seconds, "bytes": out.stat().st_size, "export": result}


def data_config_options() -> list[str]:
    """The preprocessing stated on the command line, for files that record none."""
    return [
        "--mean", ",".join(map(str, DATA_CONFIG["mean"])),
        "--std", ",".join(map(str, DATA_CONFIG["std"])),
        "--interpolation", DATA_CONFIG["interpolation"],
        "--crop-pct", str(DATA_CONFIG["crop_pct"]),
    ]  # fmt: skip


def evaluate(path: Path, reference: str, data: list[str], images: int | None) -> dict[str, Any]:
    bounded = ["--val-images", str(images)] if images else []
    result, seconds = cli("eval", "--model", str(path), *data, *bounded, "--reference", reference,
                          *data_config_options(), "--batch-size", str(BATCH), "--json")  # fmt: skip
    assert result is not None
    return {**result, "eval_seconds": seconds}


# ---------------------------------------------------------------------------------------------
# Speed: the files of one model, interleaved


def time_files(files: dict[str, Path], input_size: tuple[int, ...], warmup: int, runs: int) -> dict:
    """Images/s of each file in onnxruntime (one thread, batch 32, the same random batch),
    interleaved round by round; each int8 file's paired ratio over float32."""
    import torch

    from vitcompress.measure import measure_callables
    from vitcompress.measure.onnx_runtime import onnx_runner

    batch = torch.randn((BATCH, *input_size), generator=torch.Generator().manual_seed(0))
    runners = {mode: onnx_runner(path, batch, threads=1) for mode, path in files.items()}
    report = measure_callables(runners, BATCH, warmup=warmup, runs=runs)
    result: dict[str, Any] = {
        "img_per_s": {mode: report.results[mode].median for mode in files},
        "samples": {mode: report.results[mode].samples for mode in files},
        "environment": report.environment,
        "warnings": report.warnings,
    }
    if "fp32" in files:
        result["speedup_over_fp32"] = {
            mode: report.paired(mode, "fp32").to_json() for mode in files if mode != "fp32"
        }
    return result


def disagreements_by_margin(files: dict[str, Path], images: int | None) -> dict[str, Any]:
    """Where the int8 files' disagreements with float32 fall: how many are among the tenth of
    the test images on which the float32 file's top-2 logit margin is smallest, and the
    agreement on the other nine tenths (a diagnostic: eval itself gives the overall agreement)."""
    import torch

    from vitcompress.data import AugmentConfig, build_dataset
    from vitcompress.data.config import DataConfig
    from vitcompress.measure.onnx_eval import OnnxClassifier, read_onnx_facts
    from vitcompress.training.evaluate import spread_subset

    config = DataConfig(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in DATA_CONFIG.items()}
    )
    dataset = build_dataset("fashion-mnist", "val", (1, 28, 28), AugmentConfig.none(),
                            data_config=config)  # fmt: skip
    dataset = spread_subset(dataset, images)
    batch = torch.stack([dataset[i][0] for i in range(len(dataset))])
    logits = {
        mode: OnnxClassifier(read_onnx_facts(path), threads=1)(batch)
        for mode, path in files.items()
    }
    top2 = logits["fp32"].topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    low = margin <= margin.quantile(0.1)
    predicted = logits["fp32"].argmax(-1)
    result: dict[str, Any] = {"images": len(dataset), "lowest_margin_images": int(low.sum())}
    for mode, values in logits.items():
        if mode == "fp32":
            continue
        differ = values.argmax(-1) != predicted
        result[mode] = {
            "disagreements": int(differ.sum()),
            "in_lowest_margin_tenth": int((differ & low).sum()),
            "agreement_outside_it": 100.0 * (1 - float((differ & ~low).sum()) / int((~low).sum())),
        }
    return result


# ---------------------------------------------------------------------------------------------
# The two parts


def fashion_mnist_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    data = ["--data", "fashion-mnist"]
    rows: dict[str, Any] = {}
    for method in args.methods:
        folder = work / "files" / method
        folder.mkdir(parents=True, exist_ok=True)
        made = compress(method, work, args.finetuned)
        row: dict[str, Any] = {"apply_seconds": made["apply_seconds"], "modes": {}}
        for mode in args.modes:
            path = folder / FILE_NAMES[mode]
            record = cached(
                folder / f"{mode}.export.json",
                export, made["model"], mode, path, data, args.calibration_images,
            )  # fmt: skip
            # The float32 file against the PyTorch model it came from; int8 against float32.
            reference = str(folder / "fp32.onnx")
            if mode == "fp32":
                reference = made["reference"]
            scored = cached(
                folder / f"{mode}.eval.json", evaluate, path, reference, data, args.val_images
            )
            row["modes"][mode] = {
                "top1": scored["top1"],
                "agreement": scored.get("agreement"),
                "reference": scored.get("reference", {}).get("spec"),
                "reference_top1": scored.get("reference", {}).get("top1"),
                "images": scored["images"],
                "bytes": record["bytes"],
                "export_seconds": record["seconds"],
                "eval_seconds": scored["eval_seconds"],
            }
            print(f"{method} {mode}: top-1 {scored['top1']:.2f}%, agreement "
                  f"{scored.get('agreement')}, {record['bytes'] / 1e6:.2f} MB", flush=True)  # fmt: skip
        files = {mode: folder / FILE_NAMES[mode] for mode in args.modes}
        if "fp32" in files and len(files) > 1:
            name = "margins_" + "_".join(m for m in args.modes if m != "fp32") + ".json"
            row["margins"] = cached(folder / name, disagreements_by_margin, files, args.val_images)
        row["speed"] = time_files(files, (1, 28, 28), args.warmup, args.runs)
        print(f"{method} speed: {row['speed']['img_per_s']}", flush=True)
        rows[method] = row
        (Path(args.out_dir) / f"fmnist_{method}.json").write_text(json.dumps(row, indent=2) + "\n")
    return rows


def deit_part(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """deit_small at 224, random weights: the three files of each model timed (calibrated on
    Fashion-MNIST brought to 3 x 224 x 224: ranges, not accuracy, are what it sets here)."""
    data = ["--data", "fashion-mnist"]
    rows: dict[str, Any] = {}
    for method in args.deit_methods:
        folder = work / "deit" / method
        folder.mkdir(parents=True, exist_ok=True)
        model = ["--model", DEIT]
        apply_seconds = 0.0
        if method != "base":
            artifact = work / "deit" / f"{method}.artifact"

            plan = ["--variant", method, "--keep", str(KEEP)]
            made = cached(folder / "apply.json", apply, [*model, *plan], artifact)
            apply_seconds = made["apply_seconds"]
            model = ["--model", str(artifact)]
        row: dict[str, Any] = {"apply_seconds": apply_seconds, "modes": {}}
        for mode in args.modes:
            path = folder / FILE_NAMES[mode]
            record = cached(
                folder / f"{mode}.export.json",
                export, model, mode, path, data, args.calibration_images,
            )  # fmt: skip
            row["modes"][mode] = {"bytes": record["bytes"], "export_seconds": record["seconds"]}
        files = {mode: folder / FILE_NAMES[mode] for mode in args.modes}
        row["speed"] = time_files(files, (3, 224, 224), 1, args.deit_runs)
        print(f"deit_small {method} speed: {row['speed']['img_per_s']}", flush=True)
        rows[method] = row
        (Path(args.out_dir) / f"deit_{method}.json").write_text(json.dumps(row, indent=2) + "\n")
    return rows


def _speed_cell(row: dict[str, Any], mode: str) -> str:
    speed = row["speed"]
    shown = f"{speed['img_per_s'][mode]:.0f}"
    paired = speed.get("speedup_over_fp32", {}).get(mode)
    if paired:
        low_high = paired.get("ci95")
        interval = f" [{low_high[0]:.2f}, {low_high[1]:.2f}]" if low_high else ""
        shown += f" ({paired['median']:.2f}×{interval})"
    return shown


def _size_and_cost(row: dict[str, Any], mode: str) -> str:
    made = row["modes"][mode]
    return f"{made['bytes'] / 1e6:.2f} MB | {row['apply_seconds'] + made['export_seconds']:.0f}"


def tables(result: dict[str, Any]) -> str:
    """The page's tables (markdown) from ``int8.json``."""
    lines = [
        "| model | file | top-1 (%) | Δ top-1 vs fp32 | agreement with fp32 (%) | "
        "img/s (× fp32) | size | seconds to make |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, row in result["fashion_mnist"].items():
        fp32 = row["modes"].get("fp32")
        for mode, scored in row["modes"].items():
            delta = (
                "" if mode == "fp32" or fp32 is None else f"{scored['top1'] - fp32['top1']:+.2f}"
            )
            agreement = scored["agreement"]
            agreement_text = f"{agreement:.2f}" + (" (vs PyTorch)" if mode == "fp32" else "")
            lines.append(
                f"| {method} | {mode} | {scored['top1']:.2f} | {delta} | {agreement_text} | "
                f"{_speed_cell(row, mode)} | {_size_and_cost(row, mode)} |"
            )
    if result.get("deit_small"):
        lines += [
            "",
            "| deit_small (random weights, 224) | file | img/s (× fp32) | size | seconds to make |",
            "|---|---|---|---|---|",
        ]
        for method, row in result["deit_small"].items():
            for mode in row["modes"]:
                lines.append(
                    f"| {method} | {mode} | {_speed_cell(row, mode)} | {_size_and_cost(row, mode)} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    if args.finetuned:
        out = Path(args.out_dir) / "finetuned"
        args.out_dir = str(out)
    if args.tables:
        (out / "table.md").write_text(tables(json.loads((out / "int8.json").read_text())))
        return 0
    work = Path(args.work) / ("finetuned" if args.finetuned else "")
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = {
        "command": "OMP_NUM_THREADS=1 nice -n 10 python benchmarks/int8_accuracy.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip(),
        # Files of the package that differed from that commit while this ran (a shared tree).
        "uncommitted": subprocess.run(
            ["git", "status", "--short", "--", "vitcompress"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.split("\n"),
        "keep": KEEP,
        "finetuned": args.finetuned,
        "batch": BATCH,
        "calibration_images": args.calibration_images,
        "data_config": DATA_CONFIG,
        "fashion_mnist": fashion_mnist_part(args, work),
        "deit_small": deit_part(args, work),
    }
    result["seconds"] = time.perf_counter() - started
    (Path(args.out_dir) / "int8.json").write_text(json.dumps(result, indent=2) + "\n")
    (Path(args.out_dir) / "table.md").write_text(tables(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
