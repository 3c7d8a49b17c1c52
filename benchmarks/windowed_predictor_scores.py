"""Which tokens a windowed predictor method keeps, and what that costs: the Fashion-MNIST Swin
base (``fashion_mnist_repro.py --base-model swin``, cached) compressed with dTPS or DynamicViT
at keep 0.7 in all four blocks, no fine-tuning, each block's predictor scores replaced by a
policy:

- ``predictor``: the (untrained) predictor's own scores;
- ``random``: uniform random scores (3 draws);
- ``attention``: the attention each token receives within its window, from the base block's own
  query/key weights, relative-position bias and shift mask (eTPS's score, given to dTPS).

Run with and without dTPS's ``window_sizes`` setting (each kept key weighed by the tokens
squeezed into it). A choice by score that is worse than a random one, on a base that never saw a
reduction, shows what the reduced window attention does to a systematic choice.

    python benchmarks/windowed_predictor_scores.py --images 1000 \\
        --json-out benchmarks/results/windowed/fmnist_swin/predictor_scores.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fashion_mnist_repro as repro  # noqa: E402

from vitcompress.api import compress_loaded  # noqa: E402
from vitcompress.loading import load_base_model  # noqa: E402
from vitcompress.method.score import received_attention_score  # noqa: E402

LOCS = [0, 1, 2, 3]
POLICIES = ("predictor", "random", "attention")
SETTINGS = [
    ("dtps", {}),
    ("dtps", {"window_sizes": True}),
    ("dynamicvit", {}),
]


def load_swin(cache: Path):
    loaded = load_base_model(*repro.BASE_MODELS["swin"], input_size=repro.INPUT_SIZE)
    loaded.model.load_state_dict(load_file(cache / "base.safetensors"))
    loaded.model.eval()
    return loaded


def window_attention_score(block: nn.Module, windows: Tensor) -> Tensor:
    """(B * windows, N): the attention each window token receives, with the block's own bias
    and (shifted blocks) mask, averaged over heads and queries."""
    attn = block.attn
    rows, n, _ = windows.shape
    q, k, _ = attn.qkv(windows).reshape(rows, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    bias = attn._get_rel_pos_bias()
    mask = block.attn_mask
    if mask is not None:
        count = mask.shape[0]
        bias = bias.unsqueeze(0) + mask.unsqueeze(1).unsqueeze(0)
        bias = bias.expand(rows // count, -1, -1, -1, -1).reshape(rows, attn.num_heads, n, n)
    return received_attention_score(q, k, 0, scale=attn.scale, bias=bias)


def with_policy(model: nn.Module, blocks: list[nn.Module], policy: list[str]) -> None:
    """Replace each reducer's scores by its block's policy."""
    for index, block in enumerate(blocks):
        predictor = getattr(model.tps, str(index)).predictor
        own = predictor.__class__.keep_score.__get__(predictor)

        def keep_score(tokens: Tensor, own=own, block=block, rule=policy[index]) -> Tensor:
            if rule == "predictor":
                return own(tokens)
            if rule == "random":
                return torch.rand(tokens.shape[:2])
            return window_attention_score(block, tokens)

        predictor.keep_score = keep_score


@torch.inference_mode()
def top1(model: nn.Module, images: Tensor, labels: Tensor, batch: int = 250) -> float:
    correct = 0
    for start in range(0, len(images), batch):
        logits = model(images[start : start + batch])
        correct += (logits.argmax(-1) == labels[start : start + batch]).sum().item()
    return 100.0 * correct / len(images)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache/vitcompress/fmnist_swin")
    p.add_argument("--images", type=int, default=1000, help="the first N test images")
    p.add_argument("--draws", type=int, default=3, help="random draws")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    data = torch.load(args.cache / "fmnist_val.pt", weights_only=True)
    images, labels = data["images"][: args.images], data["labels"][: args.images]
    reference = load_swin(args.cache).model
    blocks = [block for layer in reference.layers for block in layer.blocks]
    results: list[dict[str, Any]] = [{"setting": "base", "top1": top1(reference, images, labels)}]
    print(f"base: {results[0]['top1']:.2f}%", flush=True)
    for method, settings in SETTINGS:
        torch.manual_seed(0)
        model = compress_loaded(
            load_swin(args.cache), variant=method, keep=0.7, locs=LOCS, variant_args=settings
        ).model.eval()
        for rule in POLICIES:
            with_policy(model, blocks, [rule] * len(LOCS))
            draws = []
            for draw in range(args.draws if rule == "random" else 1):
                torch.manual_seed(1000 + draw)
                draws.append(top1(model, images, labels))
            row = {
                "method": method,
                "settings": settings,
                "policy": rule,
                "top1": statistics.mean(draws),
                "draws": draws,
            }
            results.append(row)
            print(f"{method} {settings or ''} {rule}: {row['top1']:.2f}% {draws}", flush=True)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/windowed_predictor_scores.py " + " ".join(sys.argv[1:])
        args.json_out.write_text(
            json.dumps({"command": command, "images": args.images, "results": results}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
