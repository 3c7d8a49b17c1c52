"""The fused ops against the method's ops, one call at a time.

Times ``vitcompress.kernels.select_squeeze`` and ``select_squeeze_reference`` (what the reducers
run without the kernel) on the same inputs, interleaved, and prints the median of each and their
ratio per shape; ``--op tome`` times ``tome_merge`` against ``tome_merge_reference`` instead
(DeiT-S's blocks with r = 13: 197, 184, ... tokens, head-mean keys of width 64). ``--clock thread`` (default) measures the calling thread's CPU time, which other
processes on a busy machine do not inflate; ``--clock wall`` measures elapsed time.
``--device cuda`` runs both on the GPU (the Triton kernels against the method's ops), each call
timed by the wall clock between two synchronisations.

Example::

    python benchmarks/kernel_speed.py --threads 1 --calls 200
    python benchmarks/kernel_speed.py --op tome --threads 1 --calls 200
    python benchmarks/kernel_speed.py --device cuda --calls 200 --json-out select_cuda.json
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

from vitcompress.kernels import (
    select_squeeze,
    select_squeeze_reference,
    tome_merge,
    tome_merge_reference,
)

# (batch, tokens with the cls token, kept): DeiT-S at the paper's 3 locations, keep 0.7, and
# batch 1 and 128 at the first.
SHAPES = [(16, 197, 137), (16, 138, 96), (16, 97, 67), (1, 197, 137), (128, 197, 137)]
# (batch, tokens, r): DeiT-S with ToMe r = 13 at its first, fifth and ninth block, and batch 1.
TOME_SHAPES = [(16, 197, 13), (16, 145, 13), (16, 93, 13), (1, 197, 13)]
TOME_METRIC = 64  # DeiT-S's head width: the metric is the keys' mean over heads


def timed(call: Callable[[], object], clock: Callable[[], float]) -> float:
    started = clock()
    call()
    return clock() - started


def synchronised(call: Callable[[], object]) -> Callable[[], object]:
    """``call`` followed by a CUDA synchronisation, so that the wall clock sees its kernels end
    (the one before it is the previous call's)."""

    def run() -> object:
        result = call()
        torch.cuda.synchronize()
        return result

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--calls", type=int, default=100, help="timed calls of each per shape")
    p.add_argument("--dim", type=int, default=384, help="channels (DeiT-S: 384)")
    p.add_argument("--clock", choices=("thread", "wall"), default="thread")
    p.add_argument("--op", choices=("select_squeeze", "tome"), default="select_squeeze")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the Triton kernels)")
    p.add_argument("--json-out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.device != "cpu":
        torch.cuda.synchronize()
        clock = time.perf_counter  # the host's CPU time does not see the GPU's work
    rows = tome_rows(args, clock) if args.op == "tome" else select_rows(args, clock)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {"command": " ".join(sys.argv), "args": vars(args), "rows": rows}, f, indent=2
            )
    return 0


def interleaved(
    fused: Callable[[], object], method: Callable[[], object], calls: int, clock
) -> tuple[float, float]:
    """Median ms of each, timed in turns after a warm-up."""
    a, b = [], []
    with torch.inference_mode():
        for _ in range(5):  # warm-up
            fused(), method()
        for _ in range(calls):
            a.append(timed(fused, clock))
            b.append(timed(method, clock))
    return 1e3 * statistics.median(a), 1e3 * statistics.median(b)


def tome_rows(args: argparse.Namespace, clock) -> list[dict]:
    rows = []
    print("| batch | tokens | r | fused ms | method ms | method / fused |")
    print("|---:|---:|---:|---:|---:|---:|")
    for batch, tokens, r in TOME_SHAPES:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(batch, tokens, args.dim, generator=generator)
        metric = torch.randn(batch, tokens, TOME_METRIC, generator=generator)
        sizes = torch.randint(1, 4, (batch, tokens), generator=generator).float()
        x, metric, sizes = (t.to(args.device) for t in (x, metric, sizes))
        fused = functools.partial(tome_merge, x, metric, sizes, r, 1)
        method = functools.partial(tome_merge_reference, x, metric, sizes, r, 1)
        if args.device != "cpu":
            fused, method = synchronised(fused), synchronised(method)
        got, want = fused(), method()
        assert torch.equal(got[2], want[2]) and torch.allclose(got[0], want[0], atol=1e-5)
        fused_ms, method_ms = interleaved(fused, method, args.calls, clock)
        row = {"batch": batch, "tokens": tokens, "r": r, "fused_ms": fused_ms}
        row["method_ms"] = method_ms
        rows.append(row)
        print(
            f"| {batch} | {tokens} | {r} | {fused_ms:.3f} | {method_ms:.3f} "
            f"| {method_ms / fused_ms:.2f} |",
            flush=True,
        )
    return rows


def select_rows(args: argparse.Namespace, clock) -> list[dict]:
    rows = []
    print("| batch | tokens | kept | squeeze | fused ms | method ms | method / fused |")
    print("|---:|---:|---:|:---:|---:|---:|---:|")
    for batch, tokens, kept in SHAPES:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(batch, tokens, args.dim, generator=generator)
        scores = torch.randn(batch, tokens - 1, generator=generator)
        x, scores = x.to(args.device), scores.to(args.device)
        for squeeze in (True, False):
            fused = functools.partial(select_squeeze, x, scores, 1, kept, squeeze)
            method = functools.partial(select_squeeze_reference, x, scores, 1, kept, squeeze)
            if args.device != "cpu":
                fused, method = synchronised(fused), synchronised(method)
            got, want = fused(), method()
            assert torch.equal(got[1], want[1]) and torch.allclose(got[0], want[0], atol=1e-5)
            fused_ms, method_ms = interleaved(fused, method, args.calls, clock)
            row = {
                "batch": batch,
                "tokens": tokens,
                "kept": kept,
                "squeeze": squeeze,
                "fused_ms": fused_ms,
                "method_ms": method_ms,
            }
            rows.append(row)
            print(
                f"| {batch} | {tokens} | {kept} | {'yes' if squeeze else 'no'} "
                f"| {row['fused_ms']:.3f} | {row['method_ms']:.3f} "
                f"| {row['method_ms'] / row['fused_ms']:.2f} |",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    sys.exit(main())
