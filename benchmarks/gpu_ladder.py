"""The GPU ladder: every method against its base and against ideal slicing, across model sizes,
batch sizes, fp32 and bf16 autocast, eager, compiled (inductor, CUDA graphs) and graphed (each
model's eager forward captured in a CUDA graph by ``torch.cuda.graph``, no compiler: seconds, where
compiling a cell's 11 models took longer than a lease), in two fresh processes.

Ladder models (random weights: throughput does not depend on them): deit_tiny, deit_small,
vit_base_patch16_224, vit_large_patch16_224, DINOv2-B features (``vit_base_patch14_dinov2``,
``global_pool=""``, at 224 px to fit the time budget) and swin_tiny. Every method at keep 0.7,
at the default locations (the paper's for a ViT, every windowed block for Swin); ToMe at the
GMACs of dTPS at keep 0.7 (``--keep-for-gmacs-ratio``'s fit). Each cell (model, dtype, batch,
mode) times the base, every compressed model and, for a plain ViT, every compressed model's
*ideal slicing* (the same timm model whose blocks merely slice the residual stream to the
compressed model's token counts at the same places: ``benchmarks/tps_speed.py``'s idealised
model, the counts read off the compressed model by hooks on ``attn.qkv`` and ``mlp.fc1``), all
interleaved in one ``measure_throughput`` call. Swin has no ideal model (``of_ideal`` null).

The ladder runs in ``--processes`` fresh processes (default 2); the first runs cells in priority
order until its ``--budget-seconds`` would be overrun (each cell's cost estimated from the cells
before it, in GMACs timed), the others run the same cells, and each record is the median of the
processes' values, with every process's value kept. Output: a JSON list of records
``{model, method, dtype, batch, mode, img_per_s, base_img_per_s, speedup_vs_base, of_ideal, ...}``.
A compiled or graphed cell times each method with the base and its ideal model alone, so that a
run stopped part-way keeps the methods done. Each process writes its records after every cell
and ``--deadline-seconds`` stops a process that would overrun it, so a lease's time limit still
leaves a JSON of what was timed. ``--fused`` switches every compressed model to the fused kernels
(Triton on CUDA), ``--method-ops`` every one to the method's ops; by default each takes its
default path (on CUDA since run 8: the kernels for dTPS, eTPS and ToMe, the method's ops for
DynamicViT and EViT). Each record's ``kernels`` says which (``default``, ``fused``, ``method``;
``method`` for EViT under ``--fused``: it has no kernel).

    python benchmarks/gpu_ladder.py --device cuda --run h200          # the ladder, 2 processes
    python benchmarks/gpu_ladder.py --device cpu --tiny --run cpu-smoke --budget-seconds 60
    python benchmarks/gpu_ladder.py --device cuda --plan-only         # the cells and estimate
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tps_speed import SlicedBlock  # noqa: E402

import vitcompress  # noqa: E402
from vitcompress.kernels import enable_fused_kernels  # noqa: E402
from vitcompress.measure import count_macs, measure_throughput, paired_ratio  # noqa: E402
from vitcompress.measure.cuda_graphs import CudaGraphed  # noqa: E402
from vitcompress.measure.keep_fit import ATTRIBUTE as KEEP_FIT  # noqa: E402
from vitcompress.measure.keep_fit import compress_within_gmacs  # noqa: E402

METHODS = ("dtps", "dynamicvit", "etps", "evit", "tome")
MODELS = ("deit_tiny", "deit_small", "vit_base", "vit_large", "dinov2_base", "swin_tiny")
TIMM = {
    "deit_tiny": ("deit_tiny_patch16_224", {}),
    "deit_small": ("deit_small_patch16_224", {}),
    "vit_base": ("vit_base_patch16_224", {}),
    "vit_large": ("vit_large_patch16_224", {}),
    "dinov2_base": (
        "vit_base_patch14_dinov2",
        {"img_size": 224, "global_pool": "", "num_classes": 0},
    ),
    "swin_tiny": ("swin_tiny_patch4_window7_224", {}),
}
# --tiny: the same families small enough for a CPU smoke run.
TINY_VIT = dict(img_size=32, patch_size=4, depth=4, embed_dim=64, num_heads=2, num_classes=10)
TINY = {
    "dinov2_base": dict(img_size=28, patch_size=4, depth=4, embed_dim=64, num_heads=2),
    "swin_tiny": dict(img_size=56, embed_dim=32, depths=(2, 2), num_heads=(2, 4), num_classes=10),
}
AMP = {"fp32": None, "bf16": torch.bfloat16}
MODES = ("eager", "compiled", "graphed")
BASE, KEEP = "base", 0.7
# Sustained throughput assumed for a cell's first estimate before any cell was timed (GMAC/s of
# eager ViT inference: H200 bf16 ~ 250 TFLOP/s, fp32 ~ 50; a CPU a few hundred GFLOP/s). Once a
# cell has been timed its measured rate replaces it.
ASSUMED_GMACS_PER_S = {"cuda": {"fp32": 25_000.0, "bf16": 120_000.0}, "cpu": {"fp32": 30.0}}
COMPILE_SECONDS = {"cuda": 20.0, "cpu": 40.0}  # inductor per model and shape, assumed at first


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--modes", default="eager,compiled", help="of eager, compiled, graphed")
    p.add_argument("--compile-mode", default="reduce-overhead")
    p.add_argument("--compile-backend", default="inductor", help="eager: a smoke run's capture")
    p.add_argument("--kept-multiple", type=int, default=None, help="round kept counts (8)")
    p.add_argument("--fused", action="store_true", help="the fused kernels, not the method's ops")
    p.add_argument("--method-ops", action="store_true", help="the method's ops, not the kernels")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--budget-seconds", type=float, default=140.0, help="the first process's")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument(
        "--deadline-seconds",
        type=float,
        default=None,
        help="stop any process past this many seconds from the start; keep what it timed",
    )
    p.add_argument("--tiny", action="store_true", help="small models (a CPU smoke run)")
    p.add_argument("--run", default=time.strftime("%Y%m%d-%H%M%S"))
    p.add_argument(
        "--json-out", default=None, help="default benchmarks/results/gpu/ladder-RUN.json"
    )
    p.add_argument("--plan-only", action="store_true", help="print the cells and the estimate")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # records file of a process
    p.add_argument("--cells", default=None, help=argparse.SUPPRESS)  # the cells to run, JSON
    p.add_argument("--fits", default=None, help=argparse.SUPPRESS)  # ToMe's fitted keeps, JSON
    args = p.parse_args(argv)
    if args.device.startswith("cpu") and "bf16" in args.dtypes.split(","):
        args.dtypes = "fp32"  # autocast to bf16 is timed on CUDA only (measure_throughput)
    unknown = set(csv(args.modes)) - set(MODES)
    if unknown:
        p.error(f"--modes: {', '.join(sorted(unknown))} is not one of {', '.join(MODES)}")
    if "graphed" in csv(args.modes) and not args.device.startswith("cuda"):
        p.error("--modes graphed captures CUDA graphs: it needs --device cuda")
    if args.fused and args.method_ops:
        p.error("--fused and --method-ops: choose one")
    return args


def csv(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


def ladder_cells(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The cells in priority order: the cheap modes (eager, graphed) before compiled, bf16 before
    fp32, the batches where compression is in question (64, 256, then 8, 1) first, smaller
    models first; eager and graphed side by side for each model, so that a budget that ends
    early still has both of a model; ViT-L last of all at 256, where it costs the most."""
    models, dtypes = csv(args.models), csv(args.dtypes)
    batches = sorted(map(int, csv(args.batches)), key=lambda b: (b < 64, -b if b < 64 else b))
    modes = csv(args.modes)
    stages = [[m for m in modes if m != "compiled"], [m for m in modes if m == "compiled"]]
    cells = []
    for stage in stages:
        for dtype in dtypes:
            for batch in batches:
                for model in models:
                    for mode in stage:
                        cells.append({"model": model, "dtype": dtype, "batch": batch, "mode": mode})
    return cells


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------


def build_base(name: str, tiny: bool) -> tuple[nn.Module, tuple[int, ...]]:
    import timm

    timm_name, extra = TIMM[name]
    if tiny:
        extra = {**extra, **TINY.get(name, TINY_VIT)}
    torch.manual_seed(0)
    model = timm.create_model(timm_name, **extra).eval()
    pixels = extra.get("img_size", 224)
    return model, (3, pixels, pixels)


def attention_and_mlp_tokens(model: nn.Module, base: nn.Module, size: tuple[int, ...]) -> list:
    """(tokens entering ``attn.qkv``, tokens entering ``mlp.fc1``) of each of ``base``'s blocks,
    in ``model`` (its compressed form), read by forward pre-hooks on a batch of 1."""
    seen: dict[str, int] = {}
    handles = []
    names = [n for n, _ in base.named_modules() if n.endswith((".attn.qkv", ".mlp.fc1"))]
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:  # a SlicedBlock holds the block: blocks.3.block.attn.qkv
            index, rest = name.split(".", 2)[1:]
            module = model.get_submodule(f"blocks.{index}.block.{rest}")

        def hook(_module: nn.Module, inputs: tuple, name: str = name) -> None:
            seen[name] = inputs[0].shape[1]

        handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            model(torch.randn(1, *size, device=next(model.parameters()).device))
    finally:
        for handle in handles:
            handle.remove()
    depth = len(base.blocks)
    return [(seen[f"blocks.{i}.attn.qkv"], seen[f"blocks.{i}.mlp.fc1"]) for i in range(depth)]


def ideal_slicing(base: nn.Module, counts: list[tuple[int, int]]) -> nn.Module:
    """A copy of the plain ViT ``base`` whose blocks slice the residual stream to ``counts``
    (tokens entering each block's attention and MLP): before a block where its attention sees
    fewer tokens than the block before gave, after the attention residual where its MLP does."""
    model = copy.deepcopy(base)
    prefix = model.num_prefix_tokens
    present = counts[0][0]
    for index, (attention, mlp) in enumerate(counts):
        before = attention - prefix if attention < present else None
        after = mlp - prefix if mlp < attention else None
        if before is not None or after is not None:
            model.blocks[index] = SlicedBlock(model.blocks[index], prefix, before, after)
        present = mlp
    return model.eval()


def build_models(name: str, methods: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """The base, each method's compressed model and (plain ViTs) its ideal slicing, on the device;
    with each model's GMACs."""
    began = time.perf_counter()
    base, size = build_base(name, args.tiny)
    variant_args = {"kept_multiple": args.kept_multiple} if args.kept_multiple else None
    models: dict[str, nn.Module] = {BASE: base}
    fits = json.loads(Path(args.fits).read_text()) if args.fits and Path(args.fits).exists() else {}
    for method in methods:
        if method == "tome" and name in fits:  # the keep an earlier process fitted (seconds each)
            models[method] = vitcompress.compress(
                base, "tome", keep=fits[name], input_size=size, variant_args=variant_args
            )
        elif method == "tome":  # at dTPS's GMACs (keep 0.7), as --keep-for-gmacs-ratio fits it
            reference = vitcompress.compress(base, "dtps", keep=KEEP, input_size=size)
            ratio = count_macs(reference, size) / count_macs(base, size)
            models[method] = compress_within_gmacs(
                base, "tome", ratio, input_size=size, variant_args=variant_args
            )
            if args.fits:
                fits[name] = getattr(models[method], KEEP_FIT)["keep"]
                Path(args.fits).write_text(json.dumps(fits))
        else:
            models[method] = vitcompress.compress(
                base, method, keep=KEEP, input_size=size, variant_args=variant_args
            )
    vanilla = hasattr(base, "blocks") and hasattr(base, "num_prefix_tokens")
    ideals: dict[str, str] = {}
    if vanilla:
        for method in methods:
            counts = attention_and_mlp_tokens(models[method].eval(), base, size)
            models[f"{method}-ideal"] = ideal_slicing(base, counts)
            ideals[method] = f"{method}-ideal"
    gmacs = {key: count_macs(model, size) / 1e9 for key, model in models.items()}
    device = torch.device(args.device)
    for model in models.values():
        model.to(device).eval()
    fused = {m: enable_fused_kernels(models[m]) > 0 for m in methods} if args.fused else {}
    for method in methods if args.method_ops else ():
        enable_fused_kernels(models[method], False)
    print(
        f"built {name}: {len(models)} models in {time.perf_counter() - began:.1f} s"
        + (f", fused kernels in {sorted(m for m, on in fused.items() if on)}" if fused else ""),
        flush=True,
    )
    return {"models": models, "size": size, "gmacs": gmacs, "ideals": ideals, "fused": fused}


# ------------------------------------------------------------------------------------------------
# One process: cells until the budget would be overrun
# ------------------------------------------------------------------------------------------------


def cell_cost(cell: dict, built: dict, args: argparse.Namespace, rate: dict) -> float:
    """Seconds a cell is expected to take: its GMACs timed at the rate measured so far (or the
    assumed one), plus compilation of every model when compiled."""
    device = torch.device(args.device).type
    batches = (args.warmup + args.runs + (1 if cell["mode"] == "compiled" else 0)) * cell["batch"]
    gmacs = sum(built["gmacs"].values()) * batches
    per_s = rate.get(cell["dtype"]) or ASSUMED_GMACS_PER_S[device].get(cell["dtype"], 1.0)
    assumed = COMPILE_SECONDS[device] if args.compile_backend == "inductor" else 1.0
    compile_s = rate.get("compile", assumed) if cell["mode"] == "compiled" else 0.0
    return gmacs / per_s + compile_s * len(built["models"])


def compile_options(args: argparse.Namespace) -> dict[str, Any]:
    """torch.compile's options: static shapes (a graph per batch), one graph, the serving mode
    (inductor only; ``--compile-backend eager`` checks the compiled path's capture in a smoke
    run, where inductor's code generation on a CPU would take minutes per model)."""
    options: dict[str, Any] = {"fullgraph": True, "dynamic": False}
    if args.compile_backend == "inductor":
        return options | {"mode": args.compile_mode}
    return options | {"backend": args.compile_backend}


def capture_graphs(cell: dict, group: dict[str, nn.Module], built: dict, args) -> dict:
    """``group``'s models wrapped in :class:`CudaGraphed` and captured at the cell's batch, dtype
    and autocast state (before timing, so that a model whose forward cannot be captured is left
    out with one line instead of ending the cell)."""
    amp = AMP[cell["dtype"]]
    x = torch.randn(cell["batch"], *built["size"], device=args.device)
    graphed = {}
    for name, model in group.items():
        wrapped = CudaGraphed(model)
        try:
            autocast = torch.autocast("cuda", amp) if amp else contextlib.nullcontext()
            with torch.inference_mode(), autocast:
                wrapped(x)
        except Exception as error:  # noqa: BLE001 -- reported, the cell goes on without it
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            print(
                f"graphed {cell} {name}: not captured: {type(error).__name__}: {first}", flush=True
            )
            continue
        graphed[name] = wrapped
    return graphed


def groups_of(cell: dict, built: dict) -> list[dict[str, nn.Module]]:
    """The models timed together: every model of the cell at once when eager (one interleaved
    measurement); compiled or graphed, each method with the base and its ideal model alone, so
    that a run stopped part-way keeps the methods done (the base is compiled again each time,
    from inductor's cache)."""
    models = built["models"]
    if cell["mode"] == "eager":
        return [models]
    groups = []
    for method in models:
        if method == BASE or method.endswith("-ideal"):
            continue
        names = [BASE, method] + ([built["ideals"][method]] if method in built["ideals"] else [])
        groups.append({name: models[name] for name in names})
    return groups


def kernel_path(method: str, built: dict, args: argparse.Namespace) -> str:
    """The path ``method``'s reducers took: ``fused`` where ``--fused`` switched a kernel on,
    ``method`` where ``--method-ops`` switched them off or ``--fused`` found no kernel to switch
    on (EViT's), ``default`` otherwise (each reducer's own default on the device)."""
    if args.fused:
        return "fused" if built["fused"].get(method, False) else "method"
    return "method" if args.method_ops else "default"


def time_group(
    cell: dict, group: dict[str, nn.Module], built: dict, args: argparse.Namespace
) -> tuple[list[dict], dict]:
    """One group of a cell timed: the records of its methods, and what the timing took."""
    compiled = cell["mode"] == "compiled"
    amp = AMP[cell["dtype"]]
    if compiled:
        torch._dynamo.reset()  # one static graph per batch and dtype; no stale cache entries
    if cell["mode"] == "graphed":
        group = capture_graphs(cell, group, built, args)
        if BASE not in group:
            return [], {"compile_seconds": 0.0, "timing": 0.0}
    report = measure_throughput(
        group,
        built["size"],
        batch_size=cell["batch"],
        device=args.device,
        dtype=amp or torch.float32,
        amp=amp is not None,
        warmup=args.warmup,
        runs=args.runs,
        compile=compiled,
        compile_options=compile_options(args) if compiled else None,
    )
    samples = {name: result.samples for name, result in report.results.items()}
    records = []
    for method in group:
        if method == BASE or method.endswith("-ideal"):
            continue
        ideal = built["ideals"].get(method)
        ideal = ideal if ideal in group else None
        records.append(
            {
                **cell,
                "method": method,
                "img_per_s": report.results[method].median,
                "base_img_per_s": report.results[BASE].median,
                "speedup_vs_base": paired_ratio(samples[method], samples[BASE]).median,
                "of_ideal": None
                if ideal is None
                else paired_ratio(samples[method], samples[ideal]).median,
                "ideal_img_per_s": None if ideal is None else report.results[ideal].median,
                # The share of each batch spent issuing kernels (CUDA; null on the CPU): near 1,
                # the number measures the host's launch rate (h200_bf16_spread.md).
                "host_share": report.results[method].host_share,
                "base_host_share": report.results[BASE].host_share,
                "gmacs": built["gmacs"][method],
                "base_gmacs": built["gmacs"][BASE],
                "kept_multiple": args.kept_multiple,
                "fused": built["fused"].get(method, False),
                "kernels": kernel_path(method, built, args),
                "compile": compile_options(args) if compiled else None,
                "compiled_graphs": report.environment["compiled_graphs"].get(method),
                "compile_seconds": report.environment["compile_seconds"].get(method),
                "warnings": list(report.warnings),
            }
        )
    env = report.environment
    return records, {
        "compile_seconds": sum(env["compile_seconds"].values()),
        "timing": env["seconds"],
    }


def worker(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    torch._dynamo.config.cache_size_limit = 64  # base and ideal models share timm's forward
    cells = json.loads(Path(args.cells).read_text()) if args.cells else ladder_cells(args)
    budgeted = args.cells is None
    methods = csv(args.methods)
    built: dict[str, dict] = {}
    rate: dict[str, float] = {}
    records: list[dict] = []
    for cell in cells:
        if cell["model"] not in built:
            if budgeted and time.perf_counter() - started > 0.7 * args.budget_seconds:
                print(f"skip {cell}: no new model is built after 70% of the budget", flush=True)
                continue
            built[cell["model"]] = build_models(cell["model"], methods, args)
        models = built[cell["model"]]
        expected = cell_cost(cell, models, args, rate)
        spent = time.perf_counter() - started
        # A later process runs the first one's cells, within a fifth more time (the first
        # process's compilation is in inductor's on-disk cache by then); cells it cannot reach
        # keep one process's value, which the docs do not quote.
        if not budgeted and spent > 1.2 * args.budget_seconds:
            print(f"skip {cell}: past 1.2 x the budget", flush=True)
            continue
        if budgeted and spent + expected > args.budget_seconds:
            print(
                f"skip {cell}: {expected:.0f} s expected, {spent:.0f} of {args.budget_seconds:.0f} s spent",
                flush=True,
            )
            continue
        begun = time.perf_counter()
        batches = (args.warmup + args.runs) * cell["batch"]
        for group in groups_of(cell, models):
            group_begun = time.perf_counter()
            group_records, took = time_group(cell, group, models, args)
            if took["timing"] > 0:
                timed = sum(models["gmacs"][name] for name in group)
                rate[cell["dtype"]] = timed * batches / took["timing"]
            if cell["mode"] == "compiled":
                rate["compile"] = took["compile_seconds"] / len(group)
            seconds = time.perf_counter() - group_begun
            records += [r | {"cell_seconds": seconds} for r in group_records]
            write_records(Path(args.worker), records)  # a process stopped later keeps these
            if len(group) < len(models["models"]):
                print(f"{cell} {'+'.join(group)}: {seconds:.1f} s", flush=True)
        print(f"{cell}: {time.perf_counter() - begun:.1f} s (expected {expected:.1f})", flush=True)
    write_records(Path(args.worker), records)
    return 0


def write_records(path: Path, records: list[dict]) -> None:
    """Whole or not at all: a process stopped while writing leaves the previous file."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(records))
    partial.replace(path)


# ------------------------------------------------------------------------------------------------
# The ladder: processes, medians, the JSON
# ------------------------------------------------------------------------------------------------

PER_PROCESS = (
    "img_per_s",
    "base_img_per_s",
    "speedup_vs_base",
    "of_ideal",
    "ideal_img_per_s",
    "host_share",
    "base_host_share",
    "compile_seconds",
)
KEY = ("model", "method", "dtype", "batch", "mode")


def combine(runs: list[list[dict]]) -> list[dict]:
    """One record per cell and method: the median of the processes' values, each kept."""
    by_key: dict[tuple, list[dict]] = {}
    for records in runs:
        for record in records:
            by_key.setdefault(tuple(record[k] for k in KEY), []).append(record)
    combined = []
    for group in by_key.values():
        record = dict(group[0])
        for field in PER_PROCESS:
            values = [r.get(field) for r in group]
            record[f"{field}_processes"] = values
            record[field] = None if None in values else statistics.median(values)
        record["processes"] = len(group)
        record["warnings"] = sorted({w for r in group for w in r["warnings"]})
        record.pop("cell_seconds", None)
        combined.append(record)
    return combined


def environment(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device_name": name, "torch": torch.__version__, "run": args.run}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    if args.plan_only:
        for cell in ladder_cells(args):
            print(json.dumps(cell))
        return 0
    out = Path(args.json_out or f"benchmarks/results/gpu/ladder-{args.run}.json")
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    runs: list[list[dict]] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        cells_file = Path(folder, "cells.json")
        for index in range(args.processes):
            records_file = Path(folder, f"records-{index}.json")
            command = [sys.executable, __file__, *passed, "--worker", str(records_file)]
            command += ["--fits", str(Path(folder, "fits.json"))]  # ToMe's fit, done once
            if index > 0:  # the cells the first process ran, the same in every later one
                command += ["--cells", str(cells_file)]
            began = time.perf_counter()
            left = (
                None if args.deadline_seconds is None else args.deadline_seconds - (began - start)
            )
            if left is not None and left <= 0:
                print(f"process {index + 1}: not started, past the deadline", flush=True)
                break
            try:
                subprocess.run(command, check=True, timeout=left)
            except subprocess.TimeoutExpired:  # killed; its records so far are in its file
                print(f"process {index + 1}: stopped at the deadline", flush=True)
            records = json.loads(records_file.read_text()) if records_file.exists() else []
            print(
                f"process {index + 1}: {len(records)} records, {time.perf_counter() - began:.0f} s",
                flush=True,
            )
            runs.append(records)
            if index == 0:
                cells = list(
                    {
                        tuple(r[k] for k in ("model", "dtype", "batch", "mode")): None
                        for r in records
                    }
                )
                cells_file.write_text(
                    json.dumps(
                        [
                            dict(zip(("model", "dtype", "batch", "mode"), c, strict=True))
                            for c in cells
                        ]
                    )
                )
    env = environment(args)
    combined = [record | env for record in combine(runs)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(combined, indent=1) + "\n")
    print(f"{len(combined)} records from {len(runs)} processes -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
