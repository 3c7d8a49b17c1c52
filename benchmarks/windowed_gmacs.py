"""GMACs at keep 0.7 against the base for the windowed families (docs/results-windowed.md).

For each model: ``count_macs(compress(model, method, keep=[0.7]), size) / count_macs(model,
size)`` at its default locations (every windowed block), randomly initialised (the count does
not depend on the weights). A method the tool refuses on the model is reported with its one-line
reason. One process, one thread; the largest (SAM-B at 1024 px) needs about 8 GB.

With ``--keep-for-gmacs-ratio R`` it reports instead, per method, the largest keep (in steps of
0.01) whose compressed model costs at most R of the base's GMACs, and that cost
(``vitcompress.measure.keep_fit.compress_within_gmacs``).

Example (the run in docs/results-windowed.md, "GMACs at keep 0.7, by family")::

    python benchmarks/windowed_gmacs.py --json-out benchmarks/results/windowed/gmacs.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import timm
import torch
from torch import nn

from vitcompress import compress
from vitcompress.errors import UserError
from vitcompress.measure import count_macs
from vitcompress.measure.keep_fit import compress_within_gmacs

HF_SAM = "transformers SamVisionEncoder"
HF_TIMESFORMER = "transformers TimesformerModel"


class _FeatureMap(nn.Module):
    """transformers' SAM vision encoder, returning its feature map."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        from transformers import SamVisionConfig
        from transformers.models.sam.modeling_sam import SamVisionEncoder

        self.encoder = SamVisionEncoder(SamVisionConfig(**config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x).last_hidden_state


class _VideoTokens(nn.Module):
    """transformers' TimeSformer, (T, C, H, W) videos in, its last hidden state out."""

    def __init__(self, config: dict) -> None:
        super().__init__()
        from transformers import TimesformerConfig, TimesformerModel

        self.model = TimesformerModel(TimesformerConfig(**config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).last_hidden_state


def build(spec: str, kwargs: dict) -> nn.Module:
    if spec == HF_SAM:
        return _FeatureMap(kwargs)
    if spec == HF_TIMESFORMER:
        return _VideoTokens(kwargs)
    return timm.create_model(spec, pretrained=False, **kwargs)


# name -> (timm model, or HF_SAM, input side, its kwargs)
MODELS: dict[str, tuple[str, int, dict]] = {
    "swin": ("swin_tiny_patch4_window7_224", 224, {}),
    "maxvit": ("maxvit_pico_rw_256", 256, {}),
    "tiny_vit": ("tiny_vit_5m_224", 224, {}),
    "davit": ("davit_tiny", 224, {}),
    "gcvit": ("gcvit_xxtiny", 224, {}),
    "nest": ("nest_tiny", 224, {}),
    "samvit448": ("samvit_base_patch16", 448, {"img_size": 448}),
    "samvit1024": ("samvit_base_patch16", 1024, {}),
    "sam2_hiera": ("sam2_hiera_tiny", 224, {}),
    "volo": ("volo_d1_224", 224, {}),
    "hiera": ("hiera_tiny_224", 224, {}),
    "mvitv2": ("mvitv2_tiny", 224, {}),
    # transformers' SAM vision encoder (ViT-B: SamVisionConfig's defaults) at 448 px, as timm's
    # samvit448: a 28 x 28 grid in 2 x 2 windows of 14, and 4 global blocks.
    "hf_sam448": (HF_SAM, 448, {"image_size": 448}),
    "hf_sam1024": (HF_SAM, 1024, {}),  # its native size: windows of 14 padded to 70 x 70
    # transformers' TimeSformer-B (TimesformerConfig's defaults) on 8 frames at 224 px.
    "hf_timesformer": (HF_TIMESFORMER, 224, {"num_frames": 8}),
}
METHODS = ("dtps", "etps", "evit", "tome")


def measure(
    name: str,
    methods: list[str],
    carry_windows: bool = False,
    carry_branches: bool = True,
    gmacs_ratio: float | None = None,
    locs: list[int] | None = None,
) -> dict:
    spec, side, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = build(spec, kwargs).eval()
    size = (3, side, side) if spec != HF_TIMESFORMER else (kwargs["num_frames"], 3, side, side)
    base = count_macs(model, size)
    row: dict = {
        "model": spec,
        "side": side,
        "base_gmacs": base / 1e9,
        "carry_windows": carry_windows,
        "carry_branches": carry_branches,
        **({"keep_for_gmacs_ratio": gmacs_ratio} if gmacs_ratio is not None else {}),
        **({"locs": locs} if locs is not None else {}),
    }
    settings = {
        **({"carry_windows": True} if carry_windows else {}),
        **({} if carry_branches else {"carry_branches": False}),
    }
    for method in methods:
        started = time.perf_counter()
        try:
            compressed = (
                compress(
                    model,
                    method,
                    keep=[0.7] * (len(locs) if locs else 1),
                    locs=locs,
                    input_size=size,
                    variant_args=settings or None,
                )
                if gmacs_ratio is None
                else compress_within_gmacs(
                    model,
                    method,
                    gmacs_ratio,
                    locs=locs,
                    input_size=size,
                    variant_args=settings or None,
                )
            )
        except UserError as refusal:
            row[method] = {"refused": str(refusal)}
        else:
            row[method] = {"ratio": count_macs(compressed, size) / base}
            fit = getattr(compressed, "vitcompress_keep_fit", None)
            if fit is not None:
                row[method]["keep"] = fit["keep"]
                row[method]["next_ratio"] = fit["next_cost"]
            del compressed
        row[method]["seconds"] = time.perf_counter() - started
        print(name, method, row[method], flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--models", default=",".join(MODELS), help="comma-separated, of: " + ",".join(MODELS)
    )
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--json-out", type=Path)
    p.add_argument(
        "--carry-windows",
        action="store_true",
        help="every method with carry_windows=True (the default locations then change too)",
    )
    p.add_argument(
        "--no-carry-branches",
        action="store_true",
        help="every method with carry_branches=False (the per-token branches after a windowed "
        "location, DaViT's channel MLPs, run on every token)",
    )
    p.add_argument(
        "--keep-for-gmacs-ratio",
        type=float,
        default=None,
        metavar="R",
        help="report the largest keep within R of the base's GMACs instead of keep 0.7's cost",
    )
    p.add_argument(
        "--locs",
        default=None,
        help="comma-separated block indices, the same for every model and method (default: each "
        "method's own default locations)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    locs = [int(b) for b in args.locs.split(",")] if args.locs else None
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    rows = {
        name: measure(
            name,
            args.methods.split(","),
            args.carry_windows,
            not args.no_carry_branches,
            args.keep_for_gmacs_ratio,
            locs,
        )
        for name in args.models.split(",")
    }
    print("| model | px | base GMACs | " + " | ".join(args.methods.split(",")) + " |")
    print("|---|---|---|" + "---|" * len(args.methods.split(",")))
    for row in rows.values():
        cells = [
            (
                "refused"
                if "ratio" not in row[m]
                else f"keep {row[m]['keep']:g}: {row[m]['ratio']:.3f}"
                if "keep" in row[m]
                else f"{row[m]['ratio']:.3f}"
            )
            for m in args.methods.split(",")
        ]
        print(
            f"| {row['model']} | {row['side']} | {row['base_gmacs']:.2f} | "
            + " | ".join(cells)
            + " |"
        )
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(
            json.dumps({"rows": rows, "command": " ".join(sys.argv)}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
