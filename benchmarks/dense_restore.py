"""How close the restored dense outputs come to the base's, per model, method and restore rule.

On random *sharpened* weights (``tests/test_dense_outputs.py``'s :func:`sharpen`: queries and
keys 3x, LayerScale gammas 1, residual branches scaled so that the blocks move the tokens), at
keep 0.7 (``--keep``), for every method and every restore rule it allows
(``get_variant(name).fuse.restore_rules``; the default is marked ``*``):

- the dense models of ``tests/test_dense_outputs.py`` (timm ViT without pooling, timm DINOv2's
  ``forward_features``, HF ``Dinov2Model`` with and without ``output_hidden_states``, the zoo's
  Segmenter, the in-house Conv3d video ViT): the median per-token cosine to the base's output
  (per pixel for the Segmenter's logits; the smallest over the outputs where there are several),
  and the Segmenter's per-pixel argmax agreement;
- the zoo's hybrid classifiers ``pvt_tiny`` and ``cvt_13`` at 64 px, whose grid ops and stage
  exits read restored tokens: top-1 agreement with the base and the median logit cosine;
- MACs relative to the base (``vitcompress.measure.count_macs``, batch 1).

The weights, the inputs and the predictors' random init come from ``--seed``: a run is
deterministic for a given thread count (``--threads``). Writes a markdown table (``--md-out``) and
the rows as JSON (``--json-out``).

Example (70 s on one thread of a shared 2-core machine)::

    nice python benchmarks/dense_restore.py --threads 1 --md-out benchmarks/cache/dense_restore.md
    python benchmarks/dense_restore.py --models timm-vit,segmenter --methods etps,tome
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import vitcompress.zoo  # noqa: E402, F401  registers the Segmenter, PVT and CvT
from tests.test_dense_outputs import (  # noqa: E402
    MODELS,
    argmax_agreement,
    block_cosine,
    median_cosine,
    outputs,
    sharpen,
)
from vitcompress.api import compress  # noqa: E402
from vitcompress.measure import count_macs  # noqa: E402
from vitcompress.variants import get_variant  # noqa: E402

METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")
# The hybrid classifiers: (timm name, constructor arguments, input size, batch).
HYBRIDS: dict[str, tuple[str, dict[str, Any], tuple[int, ...], int]] = {
    "pvt_tiny": ("pvt_tiny", {"img_size": 64, "num_classes": 10}, (3, 64, 64), 32),
    "cvt_13": ("cvt_13", {"num_classes": 10}, (3, 64, 64), 32),
}


def build(name: str, seed: int) -> tuple[nn.Module, tuple[int, ...], Tensor, str]:
    """The sharpened model, its input size, an input batch, and its kind (tokens, pixels,
    logits)."""
    torch.manual_seed(seed)
    if name in HYBRIDS:
        spec, kwargs, size, batch = HYBRIDS[name]
        model = sharpen(timm.create_model(spec, **kwargs))
        kind = "logits"
    else:
        spec = MODELS[name]
        model = sharpen(spec.build(), branch=spec.branch)
        size, batch = spec.input_size, spec.batch
        kind = "pixels" if spec.pixels else "tokens"
    x = torch.randn(batch, *size, generator=torch.Generator().manual_seed(seed + 1))
    return model, size, x, kind


def blocks_moved(model: nn.Module, x: Tensor, name: str) -> float | None:
    """How much the blocks move the tokens (:func:`block_cosine`); ``None`` for the hybrids
    (several stages)."""
    if name not in MODELS:
        return None
    return block_cosine(model, x, MODELS[name].blocks)


def measure(out: list[Tensor], base: list[Tensor], kind: str) -> tuple[float | None, float | None]:
    """(median cosine, agreement): per token, per pixel (+ argmax agreement) or per image's
    logits (+ top-1 agreement)."""
    if [o.shape for o in out] != [b.shape for b in base]:
        return None, None
    if kind == "logits":
        cosine = F.cosine_similarity(out[0], base[0], dim=-1).median().item()
        return cosine, (out[0].argmax(-1) == base[0].argmax(-1)).float().mean().item()
    pixels = kind == "pixels"
    cosine = min(median_cosine(o, b, pixels) for o, b in zip(out, base, strict=True))
    return cosine, argmax_agreement(out[0], base[0]) if pixels else None


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows, models = [], []
    for name in args.models:
        model, size, x, kind = build(name, args.seed)
        with torch.no_grad():
            base = outputs(model(x))
        base_macs = count_macs(model, size)
        models.append(
            {
                "model": name,
                "input": size,
                "batch": x.shape[0],
                "kind": kind,
                "block_cosine": blocks_moved(model, x, name),
                "base_gmacs": base_macs / 1e9,
            }
        )
        for method in args.methods:
            variant = get_variant(method)
            for rule in variant.fuse.restore_rules:
                row: dict[str, Any] = {
                    "model": name,
                    "method": method,
                    "rule": rule,
                    "default": rule == variant.restore_rule,
                }
                start = time.perf_counter()
                torch.manual_seed(args.seed)  # the predictors' random init
                try:
                    reduced = compress(
                        model,
                        variant=method,
                        keep=args.keep,
                        input_size=size,
                        variant_args={"restore": rule},
                    ).eval()
                except Exception as error:  # a refusal is a result: the table says why
                    row["refused"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
                else:
                    with torch.no_grad():
                        out = outputs(reduced(x))
                    row["cosine"], row["agreement"] = measure(out, base, kind)
                    row["macs_ratio"] = count_macs(reduced, size) / base_macs
                row["seconds"] = round(time.perf_counter() - start, 1)
                rows.append(row)
                print(_line(row), file=sys.stderr, flush=True)
    return rows, models


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _line(row: dict[str, Any]) -> str:
    rule = row["rule"] + ("*" if row["default"] else "")
    if "refused" in row:
        return f"{row['model']} {row['method']} {rule}: refused ({row['refused'][:100]})"
    return (
        f"{row['model']} {row['method']} {rule}: cos {_number(row['cosine'])} agree "
        f"{_number(row['agreement'])} macs {_number(row['macs_ratio'], 2)} ({row['seconds']} s)"
    )


def markdown(rows: list[dict[str, Any]], models: list[dict[str, Any]], args) -> str:
    lines = [
        f"Dense outputs restored at keep {args.keep} (seed {args.seed}, "
        f"{torch.get_num_threads()} thread(s), torch {torch.__version__}, timm {timm.__version__})."
        " Random sharpened weights; `*` the method's default rule. Cosine: median per token "
        "(per pixel for the Segmenter, per image's logits for the hybrids; the smallest over "
        "the outputs where there are several). Agreement: per-pixel argmax (Segmenter), top-1 "
        "(hybrids). MACs: relative to the base.",
        "",
        "| model | input | batch | block cosine | base GMACs |",
        "|---|---|---|---|---|",
    ]
    for m in models:
        lines.append(
            f"| {m['model']} | {'x'.join(map(str, m['input']))} | {m['batch']} | "
            f"{_number(m['block_cosine'])} | {m['base_gmacs']:.4f} |"
        )
    lines += [
        "",
        "| model | method | rule | cosine | agreement | MACs |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        rule = row["rule"] + ("*" if row["default"] else "")
        if "refused" in row:
            reason = row["refused"].replace("|", "/")[:120]
            lines.append(f"| {row['model']} | {row['method']} | {rule} | refused: {reason} | | |")
            continue
        lines.append(
            f"| {row['model']} | {row['method']} | {rule} | {_number(row['cosine'])} | "
            f"{_number(row['agreement'])} | {_number(row['macs_ratio'], 2)} |"
        )
    measured = [r for r in rows if r.get("cosine") is not None]
    if measured:
        lines += ["", "Median over models of the cosine, per method and rule:", ""]
        lines += ["| method | rule | median cosine | models |", "|---|---|---|---|"]
        for method in args.methods:
            for rule in get_variant(method).fuse.restore_rules:
                values = [
                    r["cosine"] for r in measured if r["method"] == method and r["rule"] == rule
                ]
                if values:
                    lines.append(
                        f"| {method} | {rule} | {statistics.median(values):.3f} | {len(values)} |"
                    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default=",".join([*MODELS, *HYBRIDS]),
        help=f"comma list (default: all): {', '.join([*MODELS, *HYBRIDS])}",
    )
    parser.add_argument("--methods", default=",".join(METHODS), help="comma list")
    parser.add_argument("--keep", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads")
    parser.add_argument("--md-out", type=Path, help="write the markdown table here")
    parser.add_argument("--json-out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS and m not in HYBRIDS]
    if unknown:
        parser.error(f"unknown models: {', '.join(unknown)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, models = run(args)
    table = markdown(rows, models, args)
    print(table)
    if args.md_out:
        args.md_out.parent.mkdir(parents=True, exist_ok=True)
        args.md_out.write_text(table)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"keep": args.keep, "seed": args.seed, "models": models, "rows": rows}
        args.json_out.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
