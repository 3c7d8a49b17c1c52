"""How low a reduction within windows can take each windowed family's GMACs at keep 0.7
(docs/results-windowed.md, "How low keep 0.7 can go").

A method here reduces inside the blocks the analysis maps (their windows' attention and MLP);
everything else (MBConv, convolutional stems, DaViT's channel-attention blocks, patch merging,
the blocks left whole) runs in full. This counts, per module (``macs_by_module``, random weights),
the MACs of the mapped blocks and of their attention's token-by-token products, and gives the
ratio to the base if every mapped block ran entirely on 0.7 of its tokens: 0.7 of its linear
MACs and 0.49 of its attention products. No method reaches it (eTPS, EViT and ToMe run the
attention of a location whole; a predictor runs its own MACs), so a family whose floor is above
0.85 cannot get under 0.85 by reducing its windowed blocks alone. With the per-token branches
after those blocks (``Block.per_token_after``: DaViT's channel blocks' MLPs, which take the
blocks' choice by default, ``carry_branches``) on 0.7 of their tokens too:
``floor_at_keep_0.7_carrying``.

Example (the run in docs/results-windowed.md)::

    python benchmarks/windowed_floor.py --json-out benchmarks/results/windowed/floor.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import timm
import torch
from torch import nn

from vitcompress import map_model
from vitcompress.measure.macs import macs_by_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from windowed_gmacs import MODELS  # noqa: E402

KEEP = 0.7


def attention_products(per_module: dict[str, int], model: nn.Module, path: str) -> int:
    """The MACs an attention module spends outside its linear layers: q k^T and the weighted
    sum of the values (with any small ops its children do not count). ``path`` is the core's
    (Swin's is its ``softmax`` module, which counts nothing): the first module up from it that
    counts anything is the attention."""
    while per_module.get(path, 0) == 0 and "." in path:
        path = path.rsplit(".", 1)[0]
    attention = model.get_submodule(path)
    inside = sum(
        per_module.get(f"{path}.{name}", 0)
        for name, child in attention.named_children()
        if isinstance(child, nn.Module)
    )
    return per_module.get(path, 0) - inside


def branch_modules(path: str) -> list[str]:
    """``a.b.{c,d}`` -> ``[a.b.c, a.b.d]`` (how the model map names a per-token branch)."""
    if not path.endswith("}") or "{" not in path:
        return [path]
    common, names = path[:-1].split("{")
    return [common + name for name in names.split(",")]


def floor(name: str) -> dict:
    spec, side, kwargs = MODELS[name]
    torch.manual_seed(0)
    model = timm.create_model(spec, pretrained=False, **kwargs).eval()
    size = (3, side, side)
    per_module = macs_by_module(model, size)
    total = per_module[""]
    blocks = map_model(model, size).blocks
    in_blocks = sum(per_module.get(block.path, 0) for block in blocks)
    # The per-token branches a carried choice reduces too (DaViT's channel blocks' MLPs).
    branches = sum(
        per_module.get(path, 0)
        for block in blocks
        for branch in block.per_token_after
        for path in branch_modules(branch.path)
    )
    products = sum(attention_products(per_module, model, block.attention.path) for block in blocks)
    linear = in_blocks - products
    row = {
        "model": spec,
        "side": side,
        "base_gmacs": total / 1e9,
        "mapped_blocks": len(blocks),
        "mapped_share": in_blocks / total,
        "attention_products_share": products / total,
        "floor_at_keep_0.7": (total - (1 - KEEP) * linear - (1 - KEEP**2) * products) / total,
        "per_token_branches_share": branches / total,
        "floor_at_keep_0.7_carrying": (
            total - (1 - KEEP) * (linear + branches) - (1 - KEEP**2) * products
        )
        / total,
    }
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--models",
        default="swin,maxvit,tiny_vit,davit,gcvit,nest,samvit448,sam2_hiera,volo,hiera",
        help="comma-separated, of: " + ",".join(MODELS),
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = [floor(name) for name in args.models.split(",")]
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
