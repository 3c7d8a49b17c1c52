"""Token reduction on a dense task: semantic segmentation on the generated Fashion-MNIST set.

1. **Data.** ``fashion-mnist-seg`` (``vitcompress.data.segmentation``): 64x64 canvases with 2-4
   overlapping garments, a label per pixel (background + the 10 Fashion-MNIST classes), generated
   per index from the seed (nothing stored). ``--train-size`` canvases drawn from the training
   images, ``--test-size`` from the test images.
2. **Base.** ``segmenter_tiny_fmnist`` (vitcompress's zoo: a ViT with patch 8, width 64, depth 6,
   2 heads, and Segmenter's linear decoder, whose per-patch logits are put back on the 8x8 grid and
   upsampled to 64x64) is trained from scratch with per-pixel cross-entropy and cached in
   ``--cache`` (``base.safetensors`` and ``base.json``); a later run with the same settings reuses
   it.
3. **Compression.** For each method (dtps, etps, dynamicvit, evit, tome) and keep rate (0.7, 0.5,
   at the model's default locations) the base is compressed with
   ``vitcompress.api.compress_loaded``; ToMe at the MACs of the other methods' rows at that keep,
   by its own ``r`` (``fashion_mnist_repro``'s matching). mIoU is measured training-free, then
   after a short fine-tune with ``vitcompress.workflows.finetune.finetune`` (``task=
   "segmentation"``: per-pixel cross-entropy + 0.5 x per-pixel KL to the frozen base + the ratio
   loss for the learned predictors + token distillation). GMACs are counted on the graph.

A compressed model must give the decoder every patch token in the base's order. Where the rewrite
does not restore the reduced tokens to the full grid in order, the training-free mIoU shows it.

Outputs: a markdown table (``--md-out``), the results as JSON (``--json-out``) and a PNG plot of
mIoU against GMACs (``--plot``). Each (method, keep) run is cached under ``--cache/runs`` (an
interrupted fine-tune continues from its checkpoint); ``--fresh`` discards them.

Example::

    python benchmarks/dense_segmentation.py --threads 1 --md-out benchmarks/cache/seg.md \\
        --json-out benchmarks/cache/seg.json --plot benchmarks/cache/seg.png
    python benchmarks/dense_segmentation.py --methods etps,tome --keeps 0.7   # a subset
    python benchmarks/dense_segmentation.py --base-only                      # the base alone
"""

from __future__ import annotations

import argparse
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
from torch.utils.data import DataLoader, Dataset, Subset

from vitcompress.api import compress_loaded, map_model
from vitcompress.compilation.placement import default_locs
from vitcompress.data import build_dataset, resolve_data_config
from vitcompress.data.segmentation import FASHION_MNIST_SEG
from vitcompress.data.transforms import AugmentConfig
from vitcompress.loading import LoadedModel, load_base_model
from vitcompress.measure import count_macs, count_params
from vitcompress.training.evaluate import evaluate_segmentation
from vitcompress.training.optim import build_optimizer, build_scheduler
from vitcompress.workflows.finetune import FinetuneConfig, finetune

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fashion_mnist_repro import MATCHED, write_json  # noqa: E402

SPEC = "segmenter_tiny_fmnist"
MODEL_ARGS: dict[str, Any] = {}  # the registered defaults: 64x64 gray, patch 8, width 64, depth 6
INPUT_SIZE = (1, 64, 64)
METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")
STYLES = {
    "dtps": ("tab:red", "o", "-"),
    "dynamicvit": ("tab:red", "s", "--"),
    "etps": ("tab:blue", "o", "-"),
    "evit": ("tab:blue", "s", "--"),
    "tome": ("tab:green", "^", "-."),
}


# --------------------------------------------------------------------------------------------------
# Data and base
# --------------------------------------------------------------------------------------------------


def load_base(path: Path | None = None) -> LoadedModel:
    """The Segmenter, with the cached weights at ``path`` when given."""
    loaded = load_base_model(SPEC, MODEL_ARGS, input_size=INPUT_SIZE)
    if path is not None:
        loaded.model.load_state_dict(load_file(str(path)))
    return loaded


def datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset]:
    """(train, test): the generated set brought to the model as it states (its mean/std); the
    train split with the set's default augmentation (a horizontal flip of image and labels)."""
    config = resolve_data_config(load_base().model, INPUT_SIZE[0])
    train = build_dataset(
        FASHION_MNIST_SEG, "train", INPUT_SIZE, data_dir=args.data_dir, data_config=config
    )
    test = build_dataset(
        FASHION_MNIST_SEG,
        "val",
        INPUT_SIZE,
        augment=AugmentConfig.none(),
        data_dir=args.data_dir,
        data_config=config,
    )
    return Subset(train, range(args.train_size)), Subset(test, range(args.test_size))


def scores(model: torch.nn.Module, test_set: Dataset) -> dict[str, Any]:
    result = evaluate_segmentation(model, test_set, batch_size=256)
    return {"miou": result["miou"], "pixel_acc": result["pixel_acc"], "iou": result["iou"]}


def base_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a cached base must have been trained with to be reused."""
    names = ("batch", "seed", "train_size", "test_size", "base_epochs", "base_lr", "base_warmup")
    return {"spec": SPEC, "model_args": MODEL_ARGS, **{n: getattr(args, n) for n in names}}


def train_base(
    train_set: Dataset, test_set: Dataset, args: argparse.Namespace, path: Path
) -> dict[str, Any]:
    """From scratch: per-pixel cross-entropy, AdamW, one cosine cycle after a linear warm-up of
    ``--base-warmup`` epochs."""
    torch.manual_seed(args.seed)
    model = load_base().model.train()
    generator = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(
        train_set, batch_size=args.batch, shuffle=True, drop_last=True, generator=generator
    )
    optimizer = build_optimizer(model, args.base_lr, weight_decay=0.05)
    warmup = round(args.base_warmup * len(loader))
    scheduler = build_scheduler(optimizer, len(loader) * args.base_epochs, warmup)
    history = []
    started = time.perf_counter()
    for epoch in range(args.base_epochs):
        model.train()
        total = 0.0
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += float(loss.detach())
        measured = scores(model, test_set)
        history.append(
            {
                "epoch": epoch + 1,
                "loss": total / len(loader),
                "miou": measured["miou"],
                "pixel_acc": measured["pixel_acc"],
                "seconds": time.perf_counter() - started,
            }
        )
        print(
            f"base epoch {epoch + 1}/{args.base_epochs}: loss {total / len(loader):.4f}, test "
            f"mIoU {measured['miou']:.2f}%, pixel acc {measured['pixel_acc']:.2f}% "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    info = {
        "settings": base_settings(args),
        "miou": history[-1]["miou"],
        "pixel_acc": history[-1]["pixel_acc"],
        "seconds": time.perf_counter() - started,
        "threads": torch.get_num_threads(),
        "history": history,
    }
    path.with_suffix(".json").write_text(json.dumps(info, indent=2))
    return base_record(path)


def base_record(path: Path) -> dict[str, Any]:
    info = json.loads(path.with_suffix(".json").read_text())
    info["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return info


# --------------------------------------------------------------------------------------------------
# Compress, measure, fine-tune
# --------------------------------------------------------------------------------------------------


def matched_r(base_path: Path, keep: float, methods: list[str], locs: list[int]) -> dict[str, Any]:
    """ToMe's r whose MACs (before training) come nearest to the mean of the other methods' at
    ``keep``: ``fashion_mnist_repro.matched_r``'s search, on this model."""
    others = [m for m in methods if m != MATCHED] or [m for m in METHODS if m != MATCHED]

    def macs(variant: str, **how: Any) -> int:
        model = compress_loaded(load_base(base_path), variant=variant, locs=locs, **how).model
        return count_macs(model, INPUT_SIZE)

    target = statistics.mean(macs(m, keep=keep) for m in others)
    patch = load_base().model.patch_size
    patches = (INPUT_SIZE[1] // patch) * (INPUT_SIZE[2] // patch)
    low, high = 0, patches // 2
    while low < high:  # the first r at or below the target (MACs fall as r grows)
        middle = (low + high) // 2
        if macs(MATCHED, variant_args={"r": middle}) <= target:
            high = middle
        else:
            low = middle + 1
    candidates = [(r, macs(MATCHED, variant_args={"r": r})) for r in sorted({max(low - 1, 0), low})]
    best = min(candidates, key=lambda item: (abs(item[1] - target), item[0]))
    return {"tome_r": best[0], "macs": best[1], "macs_target": target, "macs_of": others}


def run_settings(args: argparse.Namespace, locs: list[int]) -> dict[str, Any]:
    names = ("batch", "seed", "ft_size", "test_size", "ft_epochs", "ft_lr", "ft_warmup")
    return {"locs": locs, **{n: getattr(args, n) for n in names}}


def run_one(
    method: str,
    keep: float,
    base_path: Path,
    base_sha256: str,
    train_set: Dataset,
    test_set: Dataset,
    args: argparse.Namespace,
    locs: list[int],
    runs_dir: Path,
    matched: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Compress, measure training-free, fine-tune, measure again; cached per (method, keep)
    for the same base and settings."""
    name = f"{method}_keep{keep}"
    result_path, out = runs_dir / f"{name}.json", runs_dir / name
    settings = run_settings(args, locs)
    how: dict[str, Any] = {"keep": keep}
    if matched is not None:
        settings["tome_r"] = matched["tome_r"]
        how = {"variant_args": {"r": matched["tome_r"]}}
    if result_path.is_file():
        cached = json.loads(result_path.read_text())
        if cached.get("base_sha256") == base_sha256 and cached.get("settings") == settings:
            print(f"{name}: cached", flush=True)
            return cached
    teacher = load_base(base_path)
    torch.manual_seed(args.seed)  # the predictor's initial weights: the same in any run order
    student = compress_loaded(load_base(base_path), variant=method, locs=locs, **how)
    model = student.model
    before = scores(model, test_set)
    print(f"{name}: training-free mIoU {before['miou']:.2f}%", flush=True)
    resume = (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step-*.pt"))
    if not resume:
        shutil.rmtree(out, ignore_errors=True)
    config = FinetuneConfig(
        task="segmentation",
        epochs=args.ft_epochs,
        batch_size=args.batch,
        lr=args.ft_lr,
        warmup_epochs=args.ft_warmup,
        seed=args.seed,
        log_every=50,
        keep_checkpoints=1,
        save_every=100,
        resume=resume,
    )
    started = time.perf_counter()
    ft_set = Subset(train_set, range(min(args.ft_size or len(train_set), len(train_set))))
    summary = finetune(student, teacher.model, ft_set, None, out, config)
    seconds = time.perf_counter() - started
    model = student.model.eval()
    after = scores(model, test_set)
    result = {
        "method": method,
        "keep": keep,
        "miou_free": before["miou"],
        "pixel_acc_free": before["pixel_acc"],
        "miou": after["miou"],
        "pixel_acc": after["pixel_acc"],
        "iou": after["iou"],
        **({"matched": matched} if matched else {}),
        "finetune_seconds": seconds,
        "steps": summary["steps"],
        "params": count_params(model),
        "macs": count_macs(model, INPUT_SIZE),
        "base_sha256": base_sha256,
        "settings": settings,
    }
    result_path.write_text(json.dumps(result, indent=2))
    print(
        f"{name}: mIoU {before['miou']:.2f}% training-free -> {after['miou']:.2f}% after "
        f"fine-tuning, {result['macs'] / 1e9:.4f} GMACs ({seconds:.0f} s)",
        flush=True,
    )
    return result


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def rule_table(
    base_path: Path, test_set: Dataset, args: argparse.Namespace, locs: list[int]
) -> str:
    """Training-free mIoU (%) of each method under each restore rule it allows, at each keep:
    which rule brings the removed tokens back best on a trained model."""
    from vitcompress.variants import get_variant

    methods = args.methods.split(",")
    keeps = [float(k) for k in args.keeps.split(",")]
    rules = ("delta", "host", "value", "zero")
    lines = [
        "| keep | method | " + " | ".join(rules) + " |",
        "|---|---|" + "---|" * len(rules),
    ]
    for keep in keeps:
        for method in methods:
            allowed = get_variant(method).fuse.restore_rules
            default = get_variant(method).restore_rule
            matched = matched_r(base_path, keep, methods, locs) if method == MATCHED else None
            cells = []
            for rule in rules:
                if rule not in allowed:
                    cells.append("-")
                    continue
                args_ = {"restore": rule}
                how: dict[str, Any] = {"keep": keep}
                if matched is not None:
                    how = {}
                    args_["r"] = matched["tome_r"]
                torch.manual_seed(args.seed)  # the predictor's initial weights, as run_one's
                model = compress_loaded(
                    load_base(base_path), variant=method, locs=locs, variant_args=args_, **how
                ).model.eval()
                miou = scores(model, test_set)["miou"]
                cells.append(f"**{miou:.2f}**" if rule == default else f"{miou:.2f}")
                print(f"{method} keep {keep:g} restore={rule}: mIoU {miou:.2f}%", flush=True)
            lines.append(f"| {keep:g} | {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown(base: dict[str, Any], results: list[dict[str, Any]], locs: list[int]) -> str:
    lines = [
        f"Base {SPEC}: mIoU {base['miou']:.2f}%, pixel accuracy {base['pixel_acc']:.2f}%, "
        f"{base['macs'] / 1e9:.4f} GMACs, {base['params'] / 1e3:.1f}k params. "
        f"Locations {','.join(map(str, locs))}.",
        "",
        "| method | keep | GMACs | params | mIoU training-free | mIoU after FT | Δ vs base "
        "| pixel acc after FT |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        method, keep = r["method"], str(r["keep"])
        if r.get("matched"):
            method = f"{method} (r = {r['matched']['tome_r']})"
            keep = f"GMACs of {r['keep']}"
        lines.append(
            f"| {method} | {keep} | {r['macs'] / 1e9:.4f} | {r['params'] / 1e3:.1f}k | "
            f"{r['miou_free']:.2f} | {r['miou']:.2f} | {r['miou'] - base['miou']:+.2f} | "
            f"{r['pixel_acc']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(base: dict[str, Any], results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for method in METHODS:
        rows = sorted((r for r in results if r["method"] == method), key=lambda r: r["macs"])
        if not rows:
            continue
        color, marker, line = STYLES[method]
        gmacs = [r["macs"] / 1e9 for r in rows]
        ax.plot(gmacs, [r["miou"] for r in rows], line, color=color, marker=marker, label=method)
        ax.plot(
            gmacs,
            [r["miou_free"] for r in rows],
            ":",
            color=color,
            marker=marker,
            markerfacecolor="none",
            alpha=0.6,
        )
        for r, x in zip(rows, gmacs, strict=True):
            ax.annotate(
                str(r["keep"]), (x, r["miou"]), textcoords="offset points", xytext=(4, -10),
                fontsize=7, color=color,
            )  # fmt: skip
    ax.scatter(
        [base["macs"] / 1e9], [base["miou"]], color="black", marker="*", s=90, zorder=3,
        label="base (no reduction)",
    )  # fmt: skip
    ax.plot([], [], ":", color="gray", marker="o", markerfacecolor="none", label="training-free")
    ax.set_xlabel("GMACs per image")
    ax.set_ylabel(f"{FASHION_MNIST_SEG} test mIoU (%)")
    ax.set_title("mIoU against compute (keep rate beside each point)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=Path("benchmarks/cache/dense_segmentation"))
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST IDX folder")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--keeps", default="0.7,0.5")
    p.add_argument("--locs", default=None, help="default: the model's default locations")
    p.add_argument("--train-size", type=int, default=20_000, help="generated training canvases")
    p.add_argument("--test-size", type=int, default=2_000, help="generated test canvases")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--base-epochs", type=int, default=3)
    p.add_argument("--base-lr", type=float, default=3e-3)
    p.add_argument("--base-warmup", type=float, default=0.1, help="warm-up, in epochs")
    p.add_argument(
        "--ft-size",
        type=int,
        default=0,
        help="fine-tune on the first N training canvases (0: all of --train-size)",
    )
    p.add_argument("--ft-epochs", type=int, default=1)
    p.add_argument("--ft-lr", type=float, default=5e-4)
    p.add_argument("--ft-warmup", type=float, default=0.1, help="warm-up, in epochs")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-only", action="store_true", help="train (or reuse) the base; stop")
    p.add_argument("--fresh", action="store_true", help="discard the cached (method, keep) runs")
    p.add_argument(
        "--rules",
        action="store_true",
        help="instead of fine-tuning: the training-free mIoU of every restore rule each method "
        "allows (--variant-arg restore=...), at each keep, as a table",
    )
    p.add_argument("--md-out", type=Path)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {', '.join(sorted(unknown))} (choose from {', '.join(METHODS)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cache: Path = args.cache
    runs_dir = cache / "runs"
    if args.fresh:
        shutil.rmtree(runs_dir, ignore_errors=True)
    runs_dir.mkdir(parents=True, exist_ok=True)
    train_set, test_set = datasets(args)

    base_path = cache / "base.safetensors"
    info = base_record(base_path) if base_path.is_file() else None
    if info is not None and info.get("settings") != base_settings(args):
        print("base: the cached one was trained with other settings; training anew", flush=True)
        info = None
    if info is None:
        info = train_base(train_set, test_set, args, base_path)
    else:
        print(f"base: cached (mIoU {info['miou']:.2f}%, {info['seconds']:.0f} s)", flush=True)
    base = load_base(base_path)
    measured = scores(base.model, test_set)
    base_row = {
        **measured,
        "params": count_params(base.model),
        "macs": count_macs(base.model, INPUT_SIZE),
        "train": info,
    }
    print(
        f"base: mIoU {measured['miou']:.2f}%, pixel acc {measured['pixel_acc']:.2f}%, "
        f"{base_row['macs'] / 1e9:.4f} GMACs",
        flush=True,
    )
    locs = (
        [int(v) for v in args.locs.split(",")]
        if args.locs
        else default_locs(map_model(base.model, INPUT_SIZE))
    )
    results: list[dict[str, Any]] = []
    if args.rules:
        table = rule_table(base_path, test_set, args, locs)
        print(table)
        if args.md_out:
            args.md_out.parent.mkdir(parents=True, exist_ok=True)
            args.md_out.write_text(table)
        return 0
    if not args.base_only:
        methods = args.methods.split(",")
        for keep in (float(k) for k in args.keeps.split(",")):
            for method in methods:
                matched = matched_r(base_path, keep, methods, locs) if method == MATCHED else None
                result = run_one(
                    method,
                    keep,
                    base_path,
                    info["sha256"],
                    train_set,
                    test_set,
                    args,
                    locs,
                    runs_dir,
                    matched,
                )
                results.append(result)
    table = markdown(base_row, results, locs)
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
            {"base": base_row, "locs": locs, "results": results, "config": config},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
