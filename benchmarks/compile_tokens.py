"""Inductor's gain on one transformer block, by token count.

Does ``torch.compile`` speed up a block of 138 or 97 tokens as much as one of 197, and would
padding a pruned token count to a multiple of 8 or 16 help it? One block of the model (random
weights: speed does not depend on them) is timed eager and compiled (inductor, ``fullgraph``,
static shapes) at each token count, the two interleaved call by call; each count gets its own
compiled graph. The first count is timed twice (first and last) so that a warm-up effect on the
first shapes shows as a difference between the two.

Example::

    python benchmarks/compile_tokens.py --tokens 197,200,208,138,136,144,97,96,104,68,64,72
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import timm
import torch


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def time_block(block: torch.nn.Module, x: torch.Tensor, calls: int, warmup: int) -> dict[str, Any]:
    """Eager and compiled ``block`` on ``x``, interleaved call by call (medians in ms)."""
    torch._dynamo.reset()  # one static graph per token count, not a recompiled dynamic one
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    start = time.perf_counter()
    compiled(x)
    compile_s = time.perf_counter() - start
    for _ in range(warmup):
        block(x)
        compiled(x)
    eager_s, compiled_s = [], []
    for _ in range(calls):
        start = time.perf_counter()
        block(x)
        eager_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiled(x)
        compiled_s.append(time.perf_counter() - start)
    gains = [e / c for e, c in zip(eager_s, compiled_s, strict=True)]
    return {
        "tokens": x.shape[1],
        "eager_ms": 1e3 * statistics.median(eager_s),
        "compiled_ms": 1e3 * statistics.median(compiled_s),
        "gain_paired_median": statistics.median(gains),
        "compile_s": compile_s,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deit_small_patch16_224")
    p.add_argument("--block", type=int, default=0, help="which of the model's blocks")
    p.add_argument("--tokens", type=ints, default=[197, 200, 208, 138, 136, 144, 97, 96, 104])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--calls", type=int, default=15, help="timed calls per token count")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = timm.create_model(args.model, pretrained=False).eval()
    block = model.blocks[args.block]
    width = model.embed_dim
    rows = []
    print("| tokens | eager ms | compiled ms | gain (paired median) |")
    print("|---:|---:|---:|---:|")
    with torch.inference_mode():
        for tokens in [*args.tokens, args.tokens[0]]:
            x = torch.randn(args.batch_size, tokens, width)
            row = time_block(block, x, args.calls, args.warmup)
            rows.append(row)
            print(
                f"| {tokens} | {row['eager_ms']:.2f} | {row['compiled_ms']:.2f} "
                f"| {row['gain_paired_median']:.3f} |",
                flush=True,
            )
    if args.json_out:
        out = {
            "command": " ".join(sys.argv),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "batch_size": args.batch_size,
            "rows": rows,
        }
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
