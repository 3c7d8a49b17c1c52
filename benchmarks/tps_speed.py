"""Throughput benchmarks for token pruning & squeezing (TPS).

Two parts, each timed with ``vitcompress.measure.measure_throughput`` (all models of a part
interleaved round-robin in this one process, so machine noise hits them alike):

``--part overhead``
    deit_small_patch16_224, locations 3,6,9, keep 0.7. For each variant (dtps, etps, dynamicvit,
    evit) the compressed model is timed against an *idealised* model that only slices the
    residual stream to the same token counts at the same places: no scoring, no predictor, no
    matching, no fusing. Their ratio is the throughput the selection + squeezing machinery keeps;
    the target is >= 0.95 for every variant. The compressed model runs the default eval path: the
    fused kernel where it builds (dtps, dynamicvit, etps; ``--method-ops`` adds a twin on the
    method's ATen ops, ``NAME+method``). The verdict is taken on the batch-by-batch paired
    ratios with a bootstrap 95% interval of their median: yes, no or undecided.

``--part headline``
    dtps on deit_small at blocks 2,4,6,8 with keep 0.5 against plain deit_tiny_patch16_224
    (paper, RTX 2080Ti: 1745 vs 1686 img/s), with plain deit_small for reference.

Random-initialised weights are used (no download): throughput does not depend on the weights.

Examples::

    python benchmarks/tps_speed.py --part overhead --json-out overhead.json
    python benchmarks/tps_speed.py --part headline --rounds 3 --runs 7
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import timm
import torch
from torch import nn

import vitcompress
from vitcompress.compilation.metadata import compression_info
from vitcompress.kernels import enable_fused_kernels
from vitcompress.measure import (
    bootstrap_median_ci,
    count_macs,
    count_params,
    measure_throughput,
    verdict,
)
from vitcompress.measure import paired_ratios as pair_samples

INPUT_SIZE = (3, 224, 224)
VARIANTS = ("dtps", "etps", "dynamicvit", "evit")
PREDICTOR_VARIANTS = ("dtps", "dynamicvit")  # drop before the block, int(N0 * rho**s) kept
FUSABLE = ("dtps", "dynamicvit", "etps")  # the variants the fused kernel serves (not EViT)
TARGET = 0.95
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# --------------------------------------------------------------------------------------------------
# The idealised model: plain slicing of the residual stream
# --------------------------------------------------------------------------------------------------


def keep_first(x: torch.Tensor, prefix: int, tokens: int) -> torch.Tensor:
    """The prefix tokens and the first ``tokens`` non-prefix tokens of ``x`` (B, N, C)."""
    return torch.cat([x[:, :prefix], x[:, prefix : prefix + tokens]], dim=1)


class SlicedBlock(nn.Module):
    """A timm ``Block`` that slices tokens before it (``before``) or after its attention residual
    add (``after_attn``), i.e. where dTPS/DynamicViT and eTPS/EViT reduce tokens."""

    def __init__(
        self,
        block: nn.Module,
        prefix: int,
        before: int | None = None,
        after_attn: int | None = None,
    ) -> None:
        super().__init__()
        self.block = block
        self.prefix = prefix
        self.before = before
        self.after_attn = after_attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.block
        if self.before is not None:
            x = keep_first(x, self.prefix, self.before)
        x = x + b.drop_path1(b.ls1(b.attn(b.norm1(x))))
        if self.after_attn is not None:
            x = keep_first(x, self.prefix, self.after_attn)
        return x + b.drop_path2(b.ls2(b.mlp(b.norm2(x))))


def token_schedule(variant: str, patch_tokens: int, keep: float, locs: Sequence[int]) -> list[int]:
    """Non-prefix tokens present after each location, by the rules of the variants.

    dTPS/DynamicViT: ``int(N0 * rho**s)``. eTPS/EViT: ``ceil(rho * n)`` of the ``n`` tokens present;
    EViT adds one fused token whenever something was pruned.
    """
    counts: list[int] = []
    n = patch_tokens
    for step in range(1, len(locs) + 1):
        if variant in PREDICTOR_VARIANTS:
            n = max(1, min(patch_tokens, int(patch_tokens * keep**step)))
        else:
            k = max(1, min(n, math.ceil(keep * n)))
            n = k + 1 if variant == "evit" and k < n else k
        counts.append(n)
    return counts


def idealised(base: nn.Module, variant: str, keep: float, locs: Sequence[int]) -> nn.Module:
    """A copy of ``base`` whose blocks at ``locs`` merely slice to the variant's token counts."""
    model = copy.deepcopy(base)
    prefix = model.num_prefix_tokens
    patch_tokens = model.patch_embed.num_patches
    for block_index, count in zip(
        locs, token_schedule(variant, patch_tokens, keep, locs), strict=True
    ):
        where = "before" if variant in PREDICTOR_VARIANTS else "after_attn"
        model.blocks[block_index] = SlicedBlock(model.blocks[block_index], prefix, **{where: count})
    return model.eval()


# --------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------


def _block(model: nn.Module, index: int) -> nn.Module:
    block = model.get_submodule(f"blocks.{index}")
    return block.block if isinstance(block, SlicedBlock) else block


def tokens_per_block(model: nn.Module, depth: int) -> list[tuple[int, int]]:
    """(tokens entering attention, tokens entering the MLP) of every block, on a batch of 2.

    Read from forward pre-hooks on ``attn.qkv`` and ``mlp.fc1``, which are real submodule calls in
    both the eager timm model and the compressed ``GraphModule``.
    """
    seen: dict[str, int] = {}
    handles = []
    for i in range(depth):
        for name in (f"blocks.{i}.attn.qkv", f"blocks.{i}.mlp.fc1"):
            module = _block(model, i).get_submodule(name.split(".", 2)[2])

            def hook(_module: nn.Module, args: tuple[Any, ...], name: str = name) -> None:
                seen[name] = args[0].shape[1]

            handles.append(module.register_forward_pre_hook(hook))
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            model(torch.randn(2, *INPUT_SIZE))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return [(seen[f"blocks.{i}.attn.qkv"], seen[f"blocks.{i}.mlp.fc1"]) for i in range(depth)]


# --------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------


COMPILED = "@compiled"  # suffix of a model's compiled twin when eager and compiled are timed
FUSED = "+fused"  # suffix of a compressed model whose reducers use the fused C++ kernel
METHOD = "+method"  # suffix of a compressed model whose reducers run the method's ATen ops


def with_compiled(models: dict[str, nn.Module], args: argparse.Namespace) -> dict[str, nn.Module]:
    """``models``, plus a compiled twin of each (``NAME@compiled``) with ``--compile --eager-too``;
    with ``--compile`` alone the names stay and every model is compiled."""
    if not (args.compile and args.eager_too):
        return models
    return models | {name + COMPILED: model for name, model in models.items()}


def compile_setting(models: dict[str, nn.Module], args: argparse.Namespace) -> bool | list[str]:
    if not args.compile:
        return False
    return [name for name in models if name.endswith(COMPILED)] if args.eager_too else True


def timed_rounds(
    models: dict[str, nn.Module], args: argparse.Namespace, log: Callable[[str], None]
) -> tuple[dict[str, list[float]], list[dict]]:
    """``args.rounds`` calls of ``measure_throughput`` over all models, the order rotated each
    round. Returns the pooled samples per model and the per-round reports.

    Compiled models are compiled alike: ``torch.compile(fullgraph=True)`` with inductor (and
    ``--compile-mode``); fullgraph makes a graph break an error instead of a slower model."""
    names = list(models)
    compile = compile_setting(models, args)
    options = {"fullgraph": True} | ({"mode": args.compile_mode} if args.compile_mode else {})
    pooled: dict[str, list[float]] = {name: [] for name in names}
    reports = []
    for r in range(args.rounds):
        load_before = os.getloadavg()[0]
        order = names[r % len(names) :] + names[: r % len(names)]
        report = measure_throughput(
            {name: models[name] for name in order},
            INPUT_SIZE,
            batch_size=args.batch_size,
            warmup=args.warmup,
            runs=args.runs,
            device=args.device,
            dtype=DTYPES[args.amp or "fp32"],
            amp=args.amp is not None,
            compile=compile,
            compile_options=options if compile else None,
        )
        if compile and r == 0:
            seconds = report.environment["compile_seconds"]
            log("  compiled: " + ", ".join(f"{n} {t:.0f} s" for n, t in seconds.items()))
        for name in names:
            pooled[name].extend(report.results[name].samples)
        reports.append(report.to_json() | {"loadavg_1min": [load_before, os.getloadavg()[0]]})
        log(
            f"  round {r + 1}/{args.rounds} (1-min load {load_before:.1f} -> "
            f"{os.getloadavg()[0]:.1f}): "
            + ", ".join(f"{name} {report.results[name].median:.2f}" for name in names)
            + " img/s"
        )
    return pooled, reports


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def round_ratios(reports: list[dict], a: str, b: str) -> list[float]:
    return [rep["results"][a]["median"] / rep["results"][b]["median"] for rep in reports]


def paired_ratios(reports: list[dict], a: str, b: str) -> list[float]:
    """``a``'s img/s over ``b``'s for each timed batch index of each round.

    ``measure_throughput`` runs one batch of every model per sweep, so the two batches of a pair
    ran seconds apart: a slow spell of the machine hits both, which pooled medians taken over
    minutes cannot cancel.
    """
    return [
        ratio
        for rep in reports
        for ratio in pair_samples(rep["results"][a]["samples"], rep["results"][b]["samples"])
    ]


def speedup_kept(reports: list[dict], name: str, base: str) -> list[float]:
    """Per sweep index, ``name``'s compiled speed-up over the compiled base divided by its eager
    speed-up over the eager base: the four batches of one index ran within one sweep, seconds
    apart, so a slow spell of the machine cancels as in :func:`paired_ratios`."""
    compiled = paired_ratios(reports, name + COMPILED, base + COMPILED)
    eager = paired_ratios(reports, name, base)
    return [c / e for c, e in zip(compiled, eager, strict=True)]


def machine_line(env: dict[str, Any]) -> str:
    return (
        f"{env['device_name']} ({env['device']}), {env['threads']} threads "
        f"({env['cpu_count']} CPUs), torch {env['torch']}, batch {env['batch_size']}, "
        f"{env['dtype']}, warmup {env['warmup']} + {env['runs']} runs per round"
    )


def gmacs(model: nn.Module) -> float:
    return count_macs(model, INPUT_SIZE) / 1e9


# --------------------------------------------------------------------------------------------------
# Parts
# --------------------------------------------------------------------------------------------------


def part_overhead(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    locs = args.locs
    torch.manual_seed(args.seed)  # every process times the same weights
    base = timm.create_model(args.model, pretrained=False).eval()
    depth = len(base.blocks)
    models: dict[str, nn.Module] = {}
    info: dict[str, dict[str, Any]] = {}
    if args.with_base:
        models[args.model] = base
    for variant in args.variants:
        compressed = vitcompress.compress(
            base, variant=variant, keep=args.keep, locs=locs, input_size=INPUT_SIZE
        ).eval()
        ideal = idealised(base, variant, args.keep, locs)
        got, want = tokens_per_block(compressed, depth), tokens_per_block(ideal, depth)
        if got != want:
            raise SystemExit(
                f"{variant}: token counts differ from the idealised model:\n"
                f"  compressed {got}\n  idealised  {want}"
            )
        plan_tokens = [loc.keep_tokens for loc in compression_info(compressed).plan.locations]
        if variant in PREDICTOR_VARIANTS:
            schedule = token_schedule(variant, base.patch_embed.num_patches, args.keep, locs)
            assert plan_tokens == schedule, (plan_tokens, schedule)
        macs_c, macs_i = gmacs(compressed), gmacs(ideal)
        info[variant] = {
            "tokens_per_block": [list(t) for t in got],
            "gmacs_compressed": macs_c,
            "gmacs_idealised": macs_i,
            "params_compressed": count_params(compressed),
            "params_idealised": count_params(ideal),
        }
        log(
            f"{variant}: tokens (attn, mlp) per block {got} - same in both; GMACs compressed "
            f"{macs_c:.4f} vs idealised {macs_i:.4f} (+{100 * (macs_c / macs_i - 1):.2f}%)"
        )
        models[variant] = compressed
        models[f"{variant}-ideal"] = ideal
        if args.fused and variant in FUSABLE:
            # The same weights, select -> gather -> squeeze as one op (vitcompress.kernels).
            fused = copy.deepcopy(compressed)
            enable_fused_kernels(fused)
            with torch.inference_mode():
                probe = torch.randn(2, *INPUT_SIZE)
                difference = (fused(probe) - compressed(probe)).abs().max().item()
            if difference > 1e-4:
                raise SystemExit(f"{variant}: the fused kernel changes the logits by {difference}")
            models[variant + FUSED] = fused
            info[variant + FUSED] = info[variant]
        if args.method_ops and variant in FUSABLE:
            # The same weights on the method's ops, where the default takes the fused kernel.
            method_ops = copy.deepcopy(compressed)
            enable_fused_kernels(method_ops, False)
            models[variant + METHOD] = method_ops
            info[variant + METHOD] = info[variant]

    pooled, reports = timed_rounds(with_compiled(models, args), args, log)
    env = reports[-1]["environment"]
    modes = [""] + ([COMPILED] if args.compile and args.eager_too else [])
    rows = []
    twins = [(args.fused, FUSED), (args.method_ops, METHOD)]
    rows_of = [*args.variants] + [
        v + suffix for on, suffix in twins for v in args.variants if on and v in FUSABLE
    ]
    for mode in modes:
        for variant in rows_of:
            plain = variant.removesuffix(FUSED).removesuffix(METHOD)
            name, ideal_name = variant + mode, f"{plain}-ideal{mode}"
            c, i = median(pooled[name]), median(pooled[ideal_name])
            pairs = paired_ratios(reports, name, ideal_name)
            interval = bootstrap_median_ci(pairs)
            row = {
                "variant": variant,
                "compiled": args.compile and (mode == COMPILED or not args.eager_too),
                "compressed": c,
                "idealised": i,
                "ratio": c / i,
                "round_ratios": round_ratios(reports, name, ideal_name),
                "paired_median": median(pairs),
                "paired_ci95": list(interval),
                "verdict": verdict(interval, TARGET),
                "meets_target": verdict(interval, TARGET) == "yes",
                **info[variant],
            }
            if args.with_base:
                # The speed-up over the uncompressed model timed in the same rounds, alike.
                vs_base = paired_ratios(reports, name, args.model + mode)
                row["vs_base_paired_median"] = median(vs_base)
                row["vs_base_paired_ci95"] = list(bootstrap_median_ci(vs_base))
                if mode == COMPILED:
                    # Does compiling keep the speed-up? Per sweep, the compiled speed-up over the
                    # compiled base divided by the eager one over the eager base: >= 1 when it does.
                    kept = speedup_kept(reports, variant, args.model)
                    row["speedup_kept_paired_median"] = median(kept)
                    row["speedup_kept_paired_ci95"] = list(bootstrap_median_ci(kept))
                    row["speedup_kept_verdict"] = verdict(bootstrap_median_ci(kept), 1.0)
            rows.append(row)
    base_row = median(pooled[args.model]) if args.with_base else None

    print(
        f"\n### TPS overhead vs idealised slicing ({args.model}, locs "
        f"{','.join(map(str, locs))}, keep {args.keep})\n"
    )
    print(
        f"Machine: {machine_line(env)}; {args.rounds} rounds, medians over all "
        f"{args.rounds * args.runs} timed batches per model.\n"
    )
    print(
        "| variant | compiled | GMACs compressed | GMACs idealised | compressed img/s "
        f"| idealised img/s | ratio of medians | paired ratio, median [95% CI] | >= {TARGET:.0%} "
        "| vs base, paired [95% CI] |"
    )
    print("|---|:---:|---:|---:|---:|---:|---:|---|:---:|---|")
    for row in rows:
        low, high = row["paired_ci95"]
        vs_base = (
            "{:.3f} [{:.3f}, {:.3f}]".format(
                row["vs_base_paired_median"], *row["vs_base_paired_ci95"]
            )
            if "vs_base_paired_median" in row
            else "-"
        )
        print(
            f"| {row['variant']} | {'yes' if row['compiled'] else 'no'} "
            f"| {row['gmacs_compressed']:.3f} | {row['gmacs_idealised']:.3f} "
            f"| {row['compressed']:.2f} | {row['idealised']:.2f} | {row['ratio']:.3f} "
            f"| {row['paired_median']:.3f} [{low:.3f}, {high:.3f}] | {row['verdict']} "
            f"| {vs_base} |"
        )
    print(
        "\nThe verdict uses the paired ratios (one batch of each model per sweep) and the "
        "bootstrap interval of their median: 'yes' when all of it is at or above the target, "
        "'no' when all of it is below, else 'undecided'."
    )
    kept_rows = [row for row in rows if "speedup_kept_paired_median" in row]
    if kept_rows:
        print(
            "\nSpeed-up kept by compiling (per sweep: the compiled speed-up over the compiled "
            "base / the eager one over the eager base; >= 1 when compiling keeps it):"
        )
        for row in kept_rows:
            low, high = row["speedup_kept_paired_ci95"]
            print(
                f"- {row['variant']}: {row['speedup_kept_paired_median']:.3f} "
                f"[{low:.3f}, {high:.3f}], >= 1: {row['speedup_kept_verdict']}"
            )
    if base_row is not None:
        print(f"\nUncompressed {args.model}: {gmacs(base):.3f} GMACs, {base_row:.2f} img/s.")
        if COMPILED in modes:
            compiled_base = median(pooled[args.model + COMPILED])
            print(f"Uncompressed {args.model}, compiled: {compiled_base:.2f} img/s.")
    return {
        "model": args.model,
        "locs": locs,
        "keep": args.keep,
        "target": TARGET,
        "rows": rows,
        "base_img_s": base_row,
        "environment": env,
        "rounds": reports,
    }


def part_headline(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    torch.manual_seed(args.seed)  # every process times the same weights
    small = timm.create_model("deit_small_patch16_224", pretrained=False).eval()
    tiny = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    dtps = vitcompress.compress(
        small,
        variant="dtps",
        keep=args.headline_keep,
        locs=args.headline_locs,
        input_size=INPUT_SIZE,
    ).eval()
    names = {"deit_small+dtps": dtps, "deit_tiny": tiny, "deit_small": small}
    macs = {name: gmacs(model) for name, model in names.items()}
    keep_tokens = [loc.keep_tokens for loc in compression_info(dtps).plan.locations]
    log(
        f"dtps keep_tokens per location: {keep_tokens}; GMACs: "
        + ", ".join(f"{name} {value:.3f}" for name, value in macs.items())
        + f"; dtps/deit_small = {macs['deit_small+dtps'] / macs['deit_small']:.1%}"
    )

    pooled, reports = timed_rounds(with_compiled(names, args), args, log)
    env = reports[-1]["environment"]
    med = {name: median(values) for name, values in pooled.items()}
    ratio = med["deit_small+dtps"] / med["deit_tiny"]
    compiled_ratio = (
        med["deit_small+dtps" + COMPILED] / med["deit_tiny" + COMPILED]
        if "deit_tiny" + COMPILED in med
        else None
    )
    per_round = round_ratios(reports, "deit_small+dtps", "deit_tiny")

    print(
        f"\n### Headline: DeiT-S + dTPS (locs {','.join(map(str, args.headline_locs))}, keep "
        f"{args.headline_keep}) vs DeiT-T\n"
    )
    print(
        f"Machine: {machine_line(env)}; {args.rounds} rounds, medians over all "
        f"{args.rounds * args.runs} timed batches per model.\n"
    )
    print("| model | GMACs | params (M) | img/s | vs deit_tiny |")
    print("|---|---:|---:|---:|---:|")
    for name, model in names.items():
        print(
            f"| {name} | {macs[name]:.3f} | {count_params(model) / 1e6:.2f} | {med[name]:.2f} "
            f"| {med[name] / med['deit_tiny']:.3f} |"
        )
    print(
        f"\ndeit_small+dtps / deit_tiny = {ratio:.3f} (per round: "
        f"{', '.join(f'{r:.3f}' for r in per_round)}); paper (RTX 2080Ti): 1745 / 1686 = 1.035. "
        f"dtps GMACs = {macs['deit_small+dtps'] / macs['deit_small']:.1%} of deit_small."
    )
    if compiled_ratio is not None:
        print(
            f"Compiled alike (same rounds): deit_small+dtps / deit_tiny = {compiled_ratio:.3f} "
            f"({med['deit_small+dtps' + COMPILED]:.2f} vs {med['deit_tiny' + COMPILED]:.2f} img/s)."
        )
    return {
        "locs": args.headline_locs,
        "keep": args.headline_keep,
        "keep_tokens": keep_tokens,
        "gmacs": macs,
        "img_s": med,
        "ratio_dtps_vs_tiny": ratio,
        "ratio_dtps_vs_tiny_compiled": compiled_ratio,
        "round_ratios": per_round,
        "environment": env,
        "rounds": reports,
    }


def reducer_time_share(model: nn.Module, x: torch.Tensor, runs: int) -> dict[str, float]:
    """Wall time per batch (ms) of the whole forward and of every token reducer (``tps.*``) and
    its predictor, measured with forward hooks over ``runs`` batches (no profiler attached)."""
    spent: dict[str, float] = {}
    started: dict[str, float] = {}
    handles = []
    tps = getattr(model, "tps", None)
    watched = (
        []
        if tps is None
        else [
            (f"tps.{n}", m)
            for n, m in tps.named_modules()
            if n and ("." not in n or n.endswith(".predictor"))  # the reducers and their predictors
        ]
    )
    for name, module in watched:

        def pre(_m: nn.Module, _a: Any, name: str = name) -> None:
            started[name] = time.perf_counter()

        def post(_m: nn.Module, _a: Any, _o: Any, name: str = name) -> None:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started[name]

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            for _ in range(runs):
                model(x)
            total = time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()
    return {"forward": 1e3 * total / runs} | {k: 1e3 * v / runs for k, v in spent.items()}


def profile(args: argparse.Namespace, variant: str) -> None:
    """Where one variant's compressed model spends time that its idealised model does not: wall
    time inside the token reducers, then the top ops by self CPU time of both (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.manual_seed(args.seed)
    base = timm.create_model(args.model, pretrained=False).eval()
    models = {
        variant: vitcompress.compress(
            base, variant=variant, keep=args.keep, locs=args.locs, input_size=INPUT_SIZE
        ).eval(),
        f"{variant}-ideal": idealised(base, variant, args.keep, args.locs),
    }
    x = torch.randn(args.batch_size, *INPUT_SIZE)
    with torch.inference_mode():
        for _ in range(args.warmup):
            for model in models.values():
                model(x)
    times = {name: reducer_time_share(model, x, args.runs) for name, model in models.items()}
    print(f"\n### {variant}: wall time per batch of {args.batch_size} (ms, mean of {args.runs})\n")
    for name, parts in times.items():
        total = parts.pop("forward")
        print(
            f"{name}: forward {total:.1f} ms"
            + "".join(f"; {k} {v:.2f} ms ({v / total:.1%})" for k, v in parts.items())
        )
    for name, model in models.items():
        with torch.inference_mode(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.runs):
                model(x)
        print(f"\n### profile: {name} ({args.runs} batches of {args.batch_size})\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


# --------------------------------------------------------------------------------------------------


def ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--part", choices=("overhead", "headline", "all"), default="all")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=2, help="warm-up batches per model per round")
    p.add_argument("--runs", type=int, default=7, help="timed batches per model per round")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="measure_throughput calls per part (model order rotated each round)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ...")
    p.add_argument("--seed", type=int, default=0,
                   help="torch.manual_seed before the models are built: fresh processes time "
                   "the same weights (the reducers' matches depend on them)")  # fmt: skip
    p.add_argument(
        "--amp",
        choices=("bf16", "fp16"),
        default=None,
        help="autocast in this dtype (CUDA only); default: float32",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile(fullgraph=True) every model alike (inductor)",
    )
    p.add_argument(
        "--eager-too",
        action="store_true",
        help="with --compile: time each model eager and compiled, interleaved in the same rounds "
        "(the compiled twin is NAME@compiled)",
    )
    p.add_argument(
        "--fused",
        action="store_true",
        help="overhead part: also time each dtps/dynamicvit/etps model with its reducers on the "
        "fused C++ kernel (NAME+fused; vitcompress.kernels), against the same sliced model",
    )
    p.add_argument(
        "--method-ops",
        action="store_true",
        help="overhead part: also time each dtps/dynamicvit/etps model on the method's ATen ops "
        "(NAME+method), where the default eval path takes the fused kernel where it builds",
    )
    p.add_argument(
        "--compile-mode",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        default=None,
        help="torch.compile mode (default: torch's)",
    )
    p.add_argument("--model", default="deit_small_patch16_224", help="overhead part: base model")
    p.add_argument(
        "--variants",
        type=lambda s: s.split(","),
        default=list(VARIANTS),
        help="overhead part: comma list of variants",
    )
    p.add_argument("--locs", type=ints, default=[3, 6, 9], help="overhead part: locations")
    p.add_argument("--keep", type=float, default=0.7, help="overhead part: keep ratio")
    p.add_argument(
        "--base",
        dest="with_base",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="overhead part: also time the uncompressed model",
    )
    p.add_argument("--headline-locs", type=ints, default=[2, 4, 6, 8])
    p.add_argument("--headline-keep", type=float, default=0.5)
    p.add_argument(
        "--profile",
        metavar="VARIANT",
        choices=VARIANTS,
        default=None,
        help="instead of timing, profile VARIANT's compressed and idealised models "
        "(overhead settings) with torch.profiler",
    )
    p.add_argument("--top", type=int, default=25, help="--profile: ops listed per model")
    p.add_argument("--json-out", default=None, help="write all numbers and samples as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    if args.eager_too and not args.compile:
        p.error("--eager-too times each model eager and compiled: it needs --compile")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def log(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    if args.profile:
        profile(args, args.profile)
        return 0
    out: dict[str, Any] = {"command": " ".join(sys.argv)}
    if args.part in ("overhead", "all"):
        out["overhead"] = part_overhead(args, log)
    if args.part in ("headline", "all"):
        out["headline"] = part_headline(args, log)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
        log(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
