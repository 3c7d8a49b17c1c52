"""A CPU-scale reproduction of the paper's comparison (its Fig. 5 and Table 6) on Fashion-MNIST.

1. **Base.** A small timm ViT (6 blocks, width 64, 2 heads, MLP ratio 2, 4x4 patches on the
   28x28 grayscale images: 49 patch tokens + cls) is trained from scratch on the 60,000 training
   images and cached in ``--cache`` (``base.safetensors``); a later run reuses it.
   ``--base-model swin`` takes a small Swin instead (width 32, MLP ratio 4, 2 + 2 blocks, 2x2 patches: a
   14 x 14 grid in four 7 x 7 windows, shifted in every other block, then one 7 x 7 window),
   where every method reduces within the windows of every block (docs/windowed.md).
2. **Fine-tuning.** For each method (dynamicvit, evit, dtps, etps) and each keep rate (0.7 and
   0.5, at the model's default three locations) the base is compressed and fine-tuned with
   ``vitcompress.workflows.finetune.finetune`` (the same code as ``vitcompress finetune``): the
   base is the frozen teacher; soft cross-entropy + 2 x ratio loss (dtps, dynamicvit) + 0.5 x KL
   + 0.5 x token distillation; the same epochs, batch, lr and seed for every run.
   **ToMe** (``tome``) runs beside them at the MMACs of each keep rate's rows: its native ``r``
   (tokens merged in every block from the first location) is the one whose MMACs come nearest
   to the mean of the other methods' at that keep (counted on the compressed graphs before any
   training); its row has top-1 without fine-tuning (ToMe's selling point) and after the same
   fine-tuning budget (no ratio loss: it learns no predictor). It has no random policy.
3. **Evaluation** on the 10,000 test images: top-1 before and after fine-tuning; top-1 with the
   scores replaced by a random selection (``policy = "random"``, ``--random-repeats`` draws, their
   mean), the paper's Table 6; GMACs and parameters counted on the graph; throughput of all models
   at batch ``--batch`` timed interleaved in one process.

Outputs: a markdown table (``--md-out``), a PNG plot of top-1 against GMACs (``--plot``) and the
raw results (``--json-out``). Each fine-tuning run's result is cached under ``--cache/runs``, so an
interrupted reproduction continues where it stopped; ``--fresh`` starts over.

Augmentation: both training phases see the images through vitcompress's Fashion-MNIST pipeline
(deterministic transform, computed once) followed by a random 28x28 crop of the image padded by
2 pixels and a horizontal flip, applied to tensors: the light preset's intent, at a fraction of the
per-image PIL cost, which would otherwise be a fifth of this machine's time per epoch.

Example (the run recorded in docs/results-accuracy.md)::

    python benchmarks/fashion_mnist_repro.py --md-out benchmarks/cache/fmnist.md \\
        --plot docs/img/fmnist_acc_vs_gmacs.png --json-out benchmarks/cache/fmnist.json
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader, Dataset

from vitcompress.api import compress_loaded, load, map_model
from vitcompress.compilation.placement import default_locs
from vitcompress.data.datasets import FASHION_MNIST_CLASSES, build_dataset
from vitcompress.data.transforms import AugmentConfig
from vitcompress.loading import LoadedModel, load_base_model
from vitcompress.measure import count_macs, count_params, measure_throughput
from vitcompress.training.evaluate import evaluate
from vitcompress.training.optim import build_optimizer, build_scheduler
from vitcompress.variants.registry import COMMON_SETTINGS
from vitcompress.workflows.finetune import FinetuneConfig, finetune

SPEC = "vit_small_patch16_224"
MODEL_ARGS: dict[str, Any] = dict(
    img_size=28,
    patch_size=4,
    in_chans=1,
    num_classes=10,
    embed_dim=64,
    depth=6,
    num_heads=2,
    mlp_ratio=2.0,
)
INPUT_SIZE = (1, 28, 28)
# ``--base-model``: the ViT above, or a small Swin (2x2 patches: a 14 x 14 grid in four 7 x 7
# windows, shifted in every other block, then a 7 x 7 grid in one window), for windowed blocks.
BASE_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "vit": (SPEC, MODEL_ARGS),
    "swin": (
        "swin_tiny_patch4_window7_224",
        dict(
            img_size=28,
            patch_size=2,
            in_chans=1,
            num_classes=10,
            embed_dim=32,
            depths=(2, 2),
            num_heads=(2, 4),
            window_size=7,
            mlp_ratio=4.0,
        ),
    ),
    # A small DaViT: its 4 x 4 stem makes a 7 x 7 grid, attended as one 7 x 7 window by its
    # spatial blocks, each followed by a channel-attention block (whose MLP takes the spatial
    # block's choice: carry_branches, on by default).
    "davit": (
        "davit_tiny",
        dict(
            in_chans=1,
            num_classes=10,
            embed_dims=(48,),
            depths=(4,),
            num_heads=(3,),
            window_size=7,
        ),
    ),
}
METHODS = ("dynamicvit", "evit", "dtps", "etps", "tome")
MATCHED = "tome"  # compressed at the MMACs of the other methods' rows, by its own r
TPS_OF = {"dtps": "dynamicvit", "etps": "evit"}  # each TPS variant and the baseline it extends
# The plots' colour, marker and line per method: a TPS variant and its baseline share a colour.
PLOT_STYLES = {
    "dtps": ("tab:red", "o", "-"),
    "dynamicvit": ("tab:red", "s", "--"),
    "etps": ("tab:blue", "o", "-"),
    "evit": ("tab:blue", "s", "--"),
    "tome": ("tab:green", "^", "-."),
}


# --------------------------------------------------------------------------------------------------
# Data: the library's transform once, then cheap tensor augmentation per image
# --------------------------------------------------------------------------------------------------


class TensorImages(Dataset):
    """Pre-transformed images (N, C, H, W) with labels; ``pad`` > 0 adds a random crop of the
    image padded by ``pad`` pixels and a horizontal flip (a training set)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, pad: int = 0) -> None:
        self.images = images
        self.labels = labels
        self.pad = pad
        self.classes = list(FASHION_MNIST_CLASSES)
        # The background after normalisation: the padding must look like the image's border.
        self.fill = float(images.amin())

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.pad:
            height, width = image.shape[-2:]
            padded = F.pad(image, (self.pad,) * 4, value=self.fill)
            top, left = torch.randint(0, 2 * self.pad + 1, (2,)).tolist()
            image = padded[:, top : top + height, left : left + width]
            if torch.rand(()) < 0.5:
                image = image.flip(-1)
        return image, int(self.labels[index])


def tensor_split(
    split: str, data_dir: str | None, cache: Path
) -> tuple[torch.Tensor, torch.Tensor]:
    path = cache / f"fmnist_{split}.pt"
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        return saved["images"], saved["labels"]
    dataset = build_dataset(
        "fashion-mnist", split, INPUT_SIZE, augment=AugmentConfig.none(), data_dir=data_dir
    )
    images = torch.stack([dataset[i][0] for i in range(len(dataset))])
    labels = torch.as_tensor(dataset.targets)
    torch.save({"images": images, "labels": labels}, path)
    return images, labels


# --------------------------------------------------------------------------------------------------
# Base model: trained from scratch, cached
# --------------------------------------------------------------------------------------------------


def train_base(
    train_set: Dataset,
    test_set: Dataset,
    args: argparse.Namespace,
    path: Path,
    epochs: int,
    lr: float,
    info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One cosine cycle (1 warm-up epoch) of ``epochs`` at peak ``lr``: from scratch when ``info``
    is None, else a warm restart from the weights at ``path`` (whose record ``info`` is)."""
    cycle = len(info["cycles"]) if info else 0
    torch.manual_seed(args.seed + cycle)
    if info is None:
        model = load_base_model(SPEC, MODEL_ARGS, input_size=INPUT_SIZE).model
    else:
        model = load_base(path).model
    model.train()
    generator = torch.Generator().manual_seed(args.seed + cycle)
    loader = DataLoader(
        train_set, batch_size=args.batch, shuffle=True, drop_last=True, generator=generator
    )
    optimizer = build_optimizer(model, lr, weight_decay=0.05)
    scheduler = build_scheduler(optimizer, len(loader) * epochs, len(loader))
    history = []
    started = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        total = 0.0
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels, label_smoothing=0.1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += float(loss.detach())
        top1 = evaluate(model, test_set, batch_size=256)["top1"]
        history.append(
            {
                "epoch": epoch + 1,
                "loss": total / len(loader),
                "top1": top1,
                "seconds": time.perf_counter() - started,
            }
        )
        print(
            f"base cycle {cycle + 1}, epoch {epoch + 1}/{epochs}: loss "
            f"{total / len(loader):.4f}, test top-1 {top1:.2f}% "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    cycles = (info["cycles"] if info else []) + [
        {"epochs": epochs, "lr": lr, "seconds": time.perf_counter() - started, "history": history}
    ]
    info = {
        "settings": base_settings(args),
        "epochs": sum(c["epochs"] for c in cycles),
        "top1": history[-1]["top1"],
        "seconds": sum(c["seconds"] for c in cycles),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "cycles": cycles,
    }
    path.with_suffix(".json").write_text(json.dumps(info, indent=2))
    return info


def base_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a cached base must have been trained with to be reused."""
    return {
        "model_args": MODEL_ARGS,
        **{
            name: getattr(args, name)
            for name in (
                "batch",
                "seed",
                "limit_train",
                "base_epochs",
                "base_lr",
                "base_extra_epochs",
            )
        },
    }


def run_settings(args: argparse.Namespace, method: str, seed: int) -> dict[str, Any]:
    """What a cached fine-tuning result must have been made with to be reused."""
    settings = {
        "locs": list(args.locs),
        "seed": seed,
        **{
            name: getattr(args, name)
            for name in (
                "batch",
                "limit_train",
                "ft_epochs",
                "ft_lr",
                "ft_warmup",
                "random_repeats",
            )
        },
    }
    if method in ("etps", "evit"):
        # Token distillation reaches these since it pairs tokens by grid position; results
        # fine-tuned without it are not reused.
        settings["token_distill"] = "paired by grid position"
    else:
        # The predictor is initialised from --seed, not from whatever earlier runs in this
        # process left in the generator; results made the old way are not reused.
        settings["predictor_init_seed"] = seed
    return settings


def matched_r(
    base_path: Path,
    keep: float,
    methods: list[str],
    locs: list[int],
    variant_args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """ToMe's r whose MMACs (before training) come nearest to the mean of ``methods``' at
    ``keep``, with both counts; every method made with ``variant_args`` (ToMe with the ones
    every method takes, ``COMMON_SETTINGS``: ``carry_windows``)."""
    others = [m for m in methods if m != MATCHED] or [m for m in METHODS if m != MATCHED]
    target = statistics.mean(
        count_macs(
            compress_loaded(
                load_base(base_path), variant=m, keep=keep, locs=locs, variant_args=variant_args
            ).model,
            INPUT_SIZE,
        )
        for m in others
    )
    # The most tokens a block sees (the grid's, or a window's): r merges at most half of them.
    patches = max(
        block.tokens for block in map_model(load_base(base_path).model, INPUT_SIZE).blocks
    )

    def macs_at(r: int) -> int:
        model = compress_loaded(
            load_base(base_path),
            variant=MATCHED,
            variant_args={**common_settings(variant_args), "r": r},
            locs=locs,
        ).model
        return count_macs(model, INPUT_SIZE)

    # MACs fall as r grows (more merged, earlier): the first r at or below the target, found by
    # bisection, or the one before it, whichever is nearer (ties to the smaller r).
    low, high = 0, patches // 2
    while low < high:
        middle = (low + high) // 2
        if macs_at(middle) <= target:
            high = middle
        else:
            low = middle + 1
    candidates = [(r, macs_at(r)) for r in sorted({max(low - 1, 0), low})]
    best = min(candidates, key=lambda item: (abs(item[1] - target), item[0]))
    return {"tome_r": best[0], "macs": best[1], "macs_target": target, "macs_of": others}


def common_settings(variant_args: dict[str, Any] | None) -> dict[str, Any]:
    """The settings in ``variant_args`` that every method takes (ToMe runs with these only)."""
    return {k: v for k, v in (variant_args or {}).items() if k in COMMON_SETTINGS}


def _base_record(path: Path) -> dict[str, Any]:
    info = json.loads(path.with_suffix(".json").read_text())
    info["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return info


def load_base(path: Path) -> LoadedModel:
    loaded = load_base_model(SPEC, MODEL_ARGS, input_size=INPUT_SIZE)
    loaded.model.load_state_dict(load_file(str(path)))
    return loaded


# --------------------------------------------------------------------------------------------------
# Compress, fine-tune, evaluate
# --------------------------------------------------------------------------------------------------


def set_policy(model: nn.Module, policy: str) -> int:
    """Switch every reducer of ``model`` to ``policy``; the number of reducers switched."""
    reducers = [m for m in model.modules() if hasattr(m, "policy")]
    for reducer in reducers:
        reducer.policy = policy
    return len(reducers)


def random_policy_top1(model: nn.Module, test_set: Dataset, repeats: int) -> list[float]:
    if not set_policy(model, "random"):
        raise RuntimeError("no reducer found to switch to the random policy")
    try:
        results = []
        for draw in range(repeats):
            torch.manual_seed(1000 + draw)
            results.append(evaluate(model, test_set, batch_size=256)["top1"])
        return results
    finally:
        set_policy(model, "score")


def run_name(method: str, keep: float, seed: int, args: argparse.Namespace) -> str:
    """A run's cache name: ``dtps_keep0.7``, with ``_seed1`` when ``--seeds`` names the seeds
    (even one: processes that share a cache, one seed each, must not share a run's folder)."""
    settings = "".join(f"_{key}{value}" for key, value in sorted(args.variant_args.items()))
    return f"{method}_keep{keep}{settings}" + (f"_seed{seed}" if args.seeds_given else "")


def run_one(
    method: str,
    keep: float,
    base_path: Path,
    base_sha256: str,
    train_set: Dataset,
    test_set: Dataset,
    args: argparse.Namespace,
    runs_dir: Path,
    matched: dict[str, Any] | None = None,
    seed: int = 0,
) -> tuple[dict[str, Any], nn.Module]:
    """Compress the base, fine-tune with ``seed``, evaluate; a cached result counts only for the
    same base and settings. ``matched``: ToMe's r for this keep's MMACs (:func:`matched_r`)."""
    name = run_name(method, keep, seed, args)
    result_path = runs_dir / f"{name}.json"
    out = runs_dir / name
    settings = run_settings(args, method, seed)
    how: Any = keep
    variant_args = dict(args.variant_args) or None
    if variant_args:
        settings["variant_args"] = variant_args  # the cache's key, only where given
    if matched is not None:
        settings["tome_r"] = matched["tome_r"]  # the cache's key, as earlier runs wrote it
        how, variant_args = None, {**common_settings(variant_args), "r": matched["tome_r"]}
    if result_path.is_file():
        cached = json.loads(result_path.read_text())
        if cached.get("base_sha256") == base_sha256 and cached.get("settings") == settings:
            print(f"{name}: cached", flush=True)
            return {"run": name, **cached}, load(out)
    teacher = load_base(base_path)
    torch.manual_seed(seed)  # the predictor's initial weights: the same in any run order
    student = compress_loaded(
        load_base(base_path), variant=method, keep=how, locs=args.locs, variant_args=variant_args
    )
    before = evaluate(student.model, test_set, batch_size=256)["top1"]
    # An interrupted run (a session ending mid-run) continues from its last checkpoint; the
    # loop is deterministic across a resume on CPU, so the result is the uninterrupted one's.
    resume = (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step-*.pt"))
    if not resume:
        shutil.rmtree(out, ignore_errors=True)
    config = FinetuneConfig(
        epochs=args.ft_epochs,
        batch_size=args.batch,
        lr=args.ft_lr,
        warmup_epochs=args.ft_warmup,
        seed=seed,
        smoothing=0.1,
        log_every=50,
        keep_checkpoints=1,
        save_every=100,  # a session may end by SIGKILL: lose at most 100 steps
        resume=resume,
    )
    started = time.perf_counter()
    summary = finetune(student, teacher.model, train_set, None, out, config)
    seconds = time.perf_counter() - started
    model = student.model.eval()
    after = evaluate(model, test_set, batch_size=256)["top1"]
    # ToMe merges by similarity alone: there is no score to replace by a random one.
    randoms = [] if matched else random_policy_top1(model, test_set, args.random_repeats)
    result = {
        "run": name,
        "method": method,
        "keep": keep,
        "seed": seed,
        "top1_before": before,
        "top1": after,
        "top1_random": statistics.mean(randoms) if randoms else None,
        "top1_random_draws": randoms,
        **({"matched": matched} if matched else {}),
        "finetune_seconds": seconds,
        "steps": summary["steps"],
        "params": count_params(model),
        "macs": count_macs(model, INPUT_SIZE),
        "base_sha256": base_sha256,
        "settings": settings,
    }
    result_path.write_text(json.dumps(result, indent=2))
    random_text = (
        f"random policy {result['top1_random']:.2f}%" if randoms else f"r = {matched['tome_r']}"
    )
    print(
        f"{name}: top-1 {before:.2f}% -> {after:.2f}% after fine-tuning, {random_text} "
        f"({seconds:.0f} s)",
        flush=True,
    )
    return result, model


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def markdown(
    base: dict[str, Any], results: list[dict[str, Any]], speed: dict[str, float], locs: list[int]
) -> str:
    lines = [
        f"Base: {base['top1']:.2f}% top-1, {base['macs'] / 1e6:.2f} MMACs, "
        f"{base['params'] / 1e3:.1f}k params, {speed['base']:.0f} img/s. "
        f"Locations {','.join(map(str, locs))}.",
        "",
        "| method | keep | MMACs | params | img/s (× base) | top-1 before FT | top-1 | "
        "Δ vs base | top-1 random policy | Δ random policy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        name = r.get("run", f"{r['method']}_keep{r['keep']}")  # older caches have no "run"
        method, keep = r["method"], str(r["keep"])
        if r.get("settings", {}).get("variant_args"):
            method += " " + ", ".join(f"{k}={v}" for k, v in r["settings"]["variant_args"].items())
        if r.get("matched"):  # ToMe: its r, at the MMACs of the keep's other rows
            method = f"{method} (r = {r['matched']['tome_r']})"
            keep = f"MMACs of {r['keep']}"
        random_cells = (
            f"{r['top1_random']:.2f} | {r['top1_random'] - r['top1']:+.2f}"
            if r["top1_random"] is not None
            else "— | —"
        )
        lines.append(
            f"| {method} | {keep} | {r['macs'] / 1e6:.2f} | {r['params'] / 1e3:.1f}k | "
            f"{speed[name]:.0f} ({speed[name] / speed['base']:.2f}×) | {r['top1_before']:.2f} | "
            f"{r['top1']:.2f} | {r['top1'] - base['top1']:+.2f} | {random_cells} |"
        )
    lines += [
        "",
        "| keep | dtps − dynamicvit | etps − evit | Δ random dtps / dynamicvit | "
        "Δ random etps / evit |",
        "|---|---|---|---|---|",
    ]
    by = {(r["method"], r["keep"]): r for r in results}
    for keep in sorted({r["keep"] for r in results}, reverse=True):
        cells = []
        for tps, baseline in TPS_OF.items():
            a, b = by.get((tps, keep)), by.get((baseline, keep))
            cells.append(f"{a['top1'] - b['top1']:+.2f}" if a and b else "—")
        for tps, baseline in TPS_OF.items():
            a, b = by.get((tps, keep)), by.get((baseline, keep))
            cells.append(
                f"{a['top1_random'] - a['top1']:+.2f} / {b['top1_random'] - b['top1']:+.2f}"
                if a and b
                else "—"
            )
        lines.append(f"| {keep} | " + " | ".join(cells) + " |")
    tome = [r for r in results if r.get("matched")]
    if tome:
        lines += [
            "",
            "| MMACs of keep | tome r | tome MMACs | tome top-1 without FT | tome top-1 after FT "
            "| best other top-1 after FT |",
            "|---|---|---|---|---|---|",
        ]
        for r in tome:
            others = [o for o in results if o["keep"] == r["keep"] and not o.get("matched")]
            best = max(others, key=lambda o: o["top1"]) if others else None
            lines.append(
                f"| {r['keep']} | {r['matched']['tome_r']} | {r['macs'] / 1e6:.2f} "
                f"(target {r['matched']['macs_target'] / 1e6:.2f}) | {r['top1_before']:.2f} | "
                f"{r['top1']:.2f} | "
                + (f"{best['top1']:.2f} ({best['method']}) |" if best else "— |")
            )
    return "\n".join(lines) + "\n"


def plot(base: dict[str, Any], results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    styles = PLOT_STYLES
    for method in METHODS:
        points = sorted(
            (r["macs"] / 1e6, r["top1"], r["keep"]) for r in results if r["method"] == method
        )
        if not points:
            continue
        color, marker, line = styles[method]
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            line,
            color=color,
            marker=marker,
            label=method,
        )
        for x, y, keep in points:
            ax.annotate(
                f"{keep}",
                (x, y),
                textcoords="offset points",
                xytext=(4, -10),
                fontsize=7,
                color=color,
            )
    unfinetuned = sorted((r["macs"] / 1e6, r["top1_before"]) for r in results if r.get("matched"))
    if unfinetuned:  # ToMe's selling point: no training at all
        ax.plot(
            [p[0] for p in unfinetuned],
            [p[1] for p in unfinetuned],
            ":",
            color="tab:green",
            marker="^",
            markerfacecolor="none",
            label="tome, no fine-tuning",
        )
    finish_plot(
        fig,
        ax,
        base,
        "Top-1 against compute after equal fine-tuning (keep rate beside each point)",
        path,
    )


def finish_plot(fig: Any, ax: Any, base: dict[str, Any], title: str, path: Path) -> None:
    """The base as a star, the axes, the legend; saved to ``path`` and closed."""
    import matplotlib.pyplot as plt

    ax.scatter(
        [base["macs"] / 1e6],
        [base["top1"]],
        color="black",
        marker="*",
        s=90,
        zorder=3,
        label="base (no pruning)",
    )
    ax.set_xlabel("MMACs per image")
    ax.set_ylabel("Fashion-MNIST test top-1 (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=Path("benchmarks/cache/fashion_mnist"))
    p.add_argument(
        "--data-dir",
        default=None,
        help="Fashion-MNIST IDX folder (default: the Debian package's, else a download)",
    )
    p.add_argument(
        "--base-model",
        choices=sorted(BASE_MODELS),
        default="vit",
        help="the base: the small ViT, or a small Swin (windowed attention)",
    )
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument(
        "--variant-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the methods run (a Python literal; e.g. window_sizes=True with "
        "--methods dtps), repeatable; part of each run's cache name",
    )
    p.add_argument("--keeps", default="0.7,0.5")
    p.add_argument("--locs", default=None, help="default: the model's default three locations")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--base-epochs", type=int, default=18)
    p.add_argument("--base-lr", type=float, default=2e-3)
    p.add_argument(
        "--base-target",
        type=float,
        default=90.0,
        help="test top-1 (%%) the base must reach; below it, warm restarts follow",
    )
    p.add_argument("--base-cycles", type=int, default=3, help="at most this many cosine cycles")
    p.add_argument(
        "--base-extra-epochs",
        type=int,
        default=8,
        help="epochs of each warm restart (peak lr: --base-lr / 2)",
    )
    p.add_argument("--ft-epochs", type=float, default=2)
    p.add_argument("--ft-lr", type=float, default=5e-4)
    p.add_argument("--ft-warmup", type=float, default=0.2, help="warm-up, in epochs")
    p.add_argument("--random-repeats", type=int, default=5)
    p.add_argument("--throughput-runs", type=int, default=15)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0, help="the base's training seed")
    p.add_argument(
        "--seeds",
        default=None,
        help="fine-tuning seeds, comma-separated (default: --seed); with several, each run is "
        "cached as METHOD_keepK_seedS and the runs' results go to --json-out without the table",
    )
    p.add_argument(
        "--limit-train",
        type=int,
        default=0,
        help="use the first N training images only (a smoke run)",
    )
    p.add_argument("--fresh", action="store_true", help="discard the cached fine-tuning runs")
    p.add_argument("--md-out", type=Path)
    p.add_argument("--plot", type=Path)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    if args.ft_epochs != int(args.ft_epochs):
        p.error("--ft-epochs must be a whole number")
    args.ft_epochs = int(args.ft_epochs)
    args.seeds_given = bool(args.seeds)
    try:
        args.variant_args = {
            key: ast.literal_eval(value)
            for key, value in (item.split("=", 1) for item in args.variant_arg)
        }
    except (ValueError, SyntaxError):
        p.error(f"--variant-arg takes KEY=VALUE with a Python literal, got {args.variant_arg}")
    args.seeds = [int(v) for v in args.seeds.split(",")] if args.seeds else [args.seed]
    return args


def write_json(path: Path, data: dict[str, Any]) -> None:
    """The results with the command that made them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**data, "command": " ".join(sys.argv)}, indent=2))


def main(argv: list[str] | None = None) -> int:
    global SPEC, MODEL_ARGS  # the chosen base, read by every step below
    args = parse_args(argv)
    SPEC, MODEL_ARGS = BASE_MODELS[args.base_model]
    if args.threads:
        torch.set_num_threads(args.threads)
    cache: Path = args.cache
    runs_dir = cache / "runs"
    if args.fresh:
        shutil.rmtree(runs_dir, ignore_errors=True)
    runs_dir.mkdir(parents=True, exist_ok=True)

    train_images, train_labels = tensor_split("train", args.data_dir, cache)
    test_images, test_labels = tensor_split("val", args.data_dir, cache)  # the test split
    if args.limit_train:
        train_images, train_labels = (
            train_images[: args.limit_train],
            train_labels[: args.limit_train],
        )
    train_set = TensorImages(train_images, train_labels, pad=2)
    test_set = TensorImages(test_images, test_labels)

    base_path = cache / "base.safetensors"
    base_info = _base_record(base_path) if base_path.is_file() else None
    # As the record reads back from JSON (a Swin's depths tuple is a list there).
    settings = json.loads(json.dumps(base_settings(args)))
    if base_info is not None and base_info.get("settings") != settings:
        print("base: the cached one was trained with other settings; training anew", flush=True)
        base_info = None
    if base_info is not None:
        print(f"base: cached ({base_info['top1']:.2f}% top-1)", flush=True)
    else:
        base_info = train_base(train_set, test_set, args, base_path, args.base_epochs, args.base_lr)
    # Warm restarts until the base reaches the target (a cosine cycle ends in a flat minimum;
    # a new cycle at a lower peak lr continues from it).
    while base_info["top1"] < args.base_target and len(base_info["cycles"]) < args.base_cycles:
        base_info = train_base(
            train_set,
            test_set,
            args,
            base_path,
            args.base_extra_epochs,
            args.base_lr / 2,
            base_info,
        )
    if base_info["top1"] < args.base_target:
        print(
            f"warning: the base reached {base_info['top1']:.2f}%, below the "
            f"{args.base_target}% target, after {len(base_info['cycles'])} cycles",
            flush=True,
        )
    base = load_base(base_path)
    locs = (
        [int(v) for v in args.locs.split(",")]
        if args.locs
        else default_locs(
            map_model(base.model, INPUT_SIZE),
            bool(args.variant_args.get("carry_windows")),  # a run's first block only
        )
    )
    args.locs = locs
    base_row = {
        "top1": evaluate(base.model, test_set, batch_size=256)["top1"],
        "params": count_params(base.model),
        "macs": count_macs(base.model, INPUT_SIZE),
        "train": base_info,
    }

    results, models = [], {"base": base.model}
    methods = args.methods.split(",")
    # Seed-major: every (method, keep) gets a first seed before any gets a second, so an
    # interrupted multi-seed run has the whole table at fewer seeds rather than half of it.
    matches: dict[float, dict[str, Any]] = {}
    for seed in args.seeds:
        for keep in (float(k) for k in args.keeps.split(",")):
            for method in methods:
                matched = None
                if method == MATCHED:
                    if keep not in matches:
                        matches[keep] = matched_r(
                            base_path, keep, methods, locs, dict(args.variant_args) or None
                        )
                    matched = matches[keep]
                result, model = run_one(
                    method,
                    keep,
                    base_path,
                    base_info["sha256"],
                    train_set,
                    test_set,
                    args,
                    runs_dir,
                    matched,
                    seed,
                )
                results.append(result)
                models[run_name(method, keep, seed, args)] = model
    if args.seeds_given:
        # The table with intervals is built from these runs by the caller; one interleaved
        # timing of 30 models would be noise, so none is taken here.
        if args.json_out:
            write_json(args.json_out, {"base": base_row, "locs": locs, "results": results})
        return 0

    print("timing all models, interleaved ...", flush=True)
    report = measure_throughput(
        models, INPUT_SIZE, batch_size=args.batch, runs=args.throughput_runs
    )
    speed = {name: r.median for name, r in report.results.items()}
    table = markdown(base_row, results, speed, locs)
    print(table)
    if args.md_out:
        args.md_out.parent.mkdir(parents=True, exist_ok=True)
        args.md_out.write_text(table)
    if args.plot:
        plot(base_row, results, args.plot)
    if args.json_out:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        write_json(
            args.json_out,
            {
                "base": base_row,
                "locs": locs,
                "results": results,
                "throughput": report.to_json(),
                "config": config,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
