"""The fused select -> gather -> squeeze op against the method's ops, one call at a time.

Times ``vitcompress.kernels.select_squeeze`` and ``select_squeeze_reference`` (what the reducers
run without the kernel) on the same inputs, interleaved, and prints the median of each and their
ratio per shape. ``--clock thread`` (default) measures the calling thread's CPU time, which other
processes on a busy machine do not inflate; ``--clock wall`` measures elapsed time.

Example::

    python benchmarks/kernel_speed.py --threads 1 --calls 200
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from vitcompress.kernels import select_squeeze, select_squeeze_reference

# (batch, tokens with the cls token, kept): DeiT-S at the paper's 3 locations, keep 0.7, and
# batch 1 and 128 at the first.
SHAPES = [(16, 197, 137), (16, 138, 96), (16, 97, 67), (1, 197, 137), (128, 197, 137)]


def timed(call: Callable[[], object], clock: Callable[[], float]) -> float:
    started = clock()
    call()
    return clock() - started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=100, help="timed calls of each per shape")
    p.add_argument("--dim", type=int, default=384, help="channels (DeiT-S: 384)")
    p.add_argument("--clock", choices=("thread", "wall"), default="thread")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    rows = []
    print("| batch | tokens | kept | squeeze | fused ms | method ms | method / fused |")
    print("|---:|---:|---:|:---:|---:|---:|---:|")
    for batch, tokens, kept in SHAPES:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(batch, tokens, args.dim, generator=generator)
        scores = torch.randn(batch, tokens - 1, generator=generator)
        for squeeze in (True, False):
            fused = functools.partial(select_squeeze, x, scores, 1, kept, squeeze)
            method = functools.partial(select_squeeze_reference, x, scores, 1, kept, squeeze)
            got, want = fused(), method()
            assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], atol=1e-5)
            a, b = [], []
            with torch.inference_mode():
                for _ in range(5):  # warm-up
                    fused(), method()
                for _ in range(args.calls):
                    a.append(timed(fused, clock))
                    b.append(timed(method, clock))
            row = {
                "batch": batch,
                "tokens": tokens,
                "kept": kept,
                "squeeze": squeeze,
                "fused_ms": 1e3 * statistics.median(a),
                "method_ms": 1e3 * statistics.median(b),
            }
            rows.append(row)
            print(
                f"| {batch} | {tokens} | {kept} | {'yes' if squeeze else 'no'} "
                f"| {row['fused_ms']:.3f} | {row['method_ms']:.3f} "
                f"| {row['method_ms'] / row['fused_ms']:.2f} |",
                flush=True,
            )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {"command": " ".join(sys.argv), "args": vars(args), "rows": rows}, f, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
