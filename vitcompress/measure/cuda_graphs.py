"""A model's forward replayed from CUDA graphs (``torch.cuda.graph``; no compiler).

On a GPU an eager forward issues every kernel from Python: at the batches where a compressed
ViT's reducers add many small kernels, the host's launch rate, not the GPU, sets its img/s. A
CUDA graph records the forward's kernels once and replays them in one launch, which takes seconds
to capture where ``torch.compile(mode="reduce-overhead")`` compiles for minutes.

A capture is checked before it is trusted. The replay must agree with the eager forward on the
input it was captured with and on another input (a capture that froze a value read at capture
time fails there), within a tolerance or within the eager forward's own run-to-run spread: a
forward that adds with atomics (``scatter_add``'s CUDA kernel, in the squeeze and merge fuses)
differs between two eager runs on one input, and its replay may differ from either by as much
(:func:`replay_agrees`). A capture that disagrees, or a forward that cannot be captured (one that
reads a value back to the host), is a :class:`GraphCaptureError` naming the model.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from vitcompress.errors import UserError

__all__ = [
    "NONDETERMINISM_MARGIN",
    "CudaGraphed",
    "GraphCaptureError",
    "capture_pass",
    "replay_agrees",
]

# A replay agrees with the eager forward when they differ by at most this share of the eager
# output's largest magnitude, plus the floor (the same kernels on the same input: bf16 rounding
# of a different reduction order at most).
RELATIVE_TOLERANCE = 2e-2
ABSOLUTE_TOLERANCE = 1e-4
# ... or by at most this multiple of the largest difference between eager runs on that input.
# The replay is one more draw of the same nondeterministic sums, so its difference from an eager
# run is distributed as the eager runs' differences among themselves; each is a maximum over the
# whole output (thousands of elements), which varies little from draw to draw, but two or three
# eager runs see only one to three such draws: twice the largest leaves room for that, while a
# wrong capture (a stale buffer, a frozen value) differs at the scale of the output itself.
NONDETERMINISM_MARGIN = 2.0
# Eager calls before a capture (lazy initialisation, the allocator's and libraries' warm-up);
# the last EAGER_KEPT of them are the eager runs a replay is compared with.
WARMUP_CALLS = 3
EAGER_KEPT = 2


class GraphCaptureError(UserError):
    """A model's forward cannot be replayed from a CUDA graph, or its replay disagrees with it."""


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of two outputs (NaN where both are NaN counts as equal;
    where one is, as infinite)."""
    a, b = a.detach().float().reshape(-1), b.detach().float().reshape(-1)
    if a.numel() == 0:
        return 0.0
    difference = (a - b).abs()
    difference = torch.where(a.isnan() & b.isnan(), torch.zeros_like(difference), difference)
    return difference.nan_to_num(nan=float("inf")).max().item()


def replay_agrees(replay: torch.Tensor, eager_runs: Sequence[torch.Tensor]) -> tuple[bool, str]:
    """Whether a replayed output agrees with the eager runs of the same input, and why.

    It agrees when its difference from the last eager run is within :data:`RELATIVE_TOLERANCE`
    of that run's largest magnitude (plus :data:`ABSOLUTE_TOLERANCE`), or within
    :data:`NONDETERMINISM_MARGIN` times the largest difference between any two eager runs (the
    forward's own nondeterminism). The line gives both differences.
    """
    if not eager_runs:
        raise ValueError("replay_agrees needs at least one eager run")
    last = eager_runs[-1]
    if replay.shape != last.shape:
        return False, (
            f"the replayed graph gives an output of shape {tuple(replay.shape)}, the eager "
            f"forward one of {tuple(last.shape)}"
        )
    error = _max_difference(replay, last)
    spread = max(
        (_max_difference(a, b) for a, b in itertools.combinations(eager_runs, 2)), default=0.0
    )
    scale = last.detach().float().abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    tolerance = RELATIVE_TOLERANCE * (scale.max().item() if scale.numel() else 0.0)
    agrees = error <= tolerance + ABSOLUTE_TOLERANCE or error <= NONDETERMINISM_MARGIN * spread
    runs = len(eager_runs)
    return agrees, (
        f"the replayed graph differs from the eager forward by {error:.3g} (tolerance "
        f"{tolerance + ABSOLUTE_TOLERANCE:.3g}); {runs} eager forwards of the same input differ "
        f"among themselves by {spread:.3g}"
        if runs > 1
        else f"the replayed graph differs from the eager forward by {error:.3g} (tolerance "
        f"{tolerance + ABSOLUTE_TOLERANCE:.3g})"
    )


def _flat(output: Any) -> torch.Tensor:
    """A forward's tensors, flattened into one new float32 tensor (a copy: a graph's output is
    overwritten by its next replay)."""
    leaves = [leaf for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor)]
    if not leaves:
        raise GraphCaptureError(f"its forward returns no tensor ({type(output).__name__})")
    return torch.cat([leaf.detach().float().reshape(-1) for leaf in leaves])


class CudaGraphed(nn.Module):
    """``module``'s eager forward replayed from a CUDA graph: one graph per input shape, dtype
    and autocast state, captured on the first call with that key after :data:`WARMUP_CALLS`
    warm-up calls on a side stream, then checked (:meth:`capture`). Each call copies its input
    into the graph's static input and replays; the output is the graph's static output,
    overwritten by the next call (clone what is kept). Inference only: calls run under
    ``torch.inference_mode()`` or ``torch.no_grad()``, either after a capture under the other."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, Any]] = {}

    def forward(self, x: torch.Tensor) -> Any:
        if torch.is_grad_enabled():
            raise RuntimeError("a CUDA-graphed forward is inference only: call it without grad")
        autocast = torch.is_autocast_enabled("cuda")
        key = (tuple(x.shape), x.dtype, x.device, autocast) + (
            (torch.get_autocast_dtype("cuda"),) if autocast else ()
        )
        if key not in self.graphs:
            self.graphs[key] = self.capture(x)
        graph, static_input, static_output = self.graphs[key]
        static_input.copy_(x)
        graph.replay()
        return static_output

    def capture(self, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, Any]:
        """Warm up, capture and check a graph of the forward on ``x``'s shape: the replay on
        ``x`` against the last eager warm-up runs, then on another random input against eager
        runs of that input (:func:`replay_agrees`); :class:`GraphCaptureError` if either
        disagrees. Under autocast, autocast's weight cache (used under ``torch.no_grad()``, not
        under ``torch.inference_mode()``) is off for all of it: a cast weight cached while
        capturing would be freed when the caller's autocast region ends, and the graph would read
        memory reused since."""
        no_cache = (
            torch.autocast("cuda", torch.get_autocast_dtype("cuda"), cache_enabled=False)
            if torch.is_autocast_enabled("cuda")
            else contextlib.nullcontext()
        )
        with no_cache, torch.cuda.device(x.device):
            # A normal tensor, not an inference one (``x.clone()`` under inference mode): later
            # calls copy into it, and an inference tensor refuses an in-place update outside
            # inference mode (a graph captured under inference_mode, called under no_grad).
            with torch.inference_mode(False), torch.no_grad():
                static_input = x.clone()
            side = torch.cuda.Stream(device=x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            eager = []
            with torch.cuda.stream(side):
                for _ in range(WARMUP_CALLS):
                    eager.append(_flat(self.module(static_input)))
            torch.cuda.current_stream(x.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_output = self.module(static_input)
            self._check(graph, static_output, eager[-EAGER_KEPT:], "the captured input")
            other = torch.randn_like(static_input)
            static_input.copy_(other)
            eager = [_flat(self.module(other)) for _ in range(EAGER_KEPT)]
            self._check(graph, static_output, eager, "another input")
        return graph, static_input, static_output

    @staticmethod
    def _check(
        graph: torch.cuda.CUDAGraph, output: Any, eager: list[torch.Tensor], which: str
    ) -> None:
        graph.replay()
        torch.cuda.synchronize()
        agrees, why = replay_agrees(_flat(output), eager)
        if not agrees:
            raise GraphCaptureError(f"on {which}, {why}")


def capture_pass(name: str, run: Callable[[], Any]) -> float:
    """Seconds of a CUDA-graphed model's first call (``run``: its warm-up, capture and check,
    outside any timing). A forward that cannot be captured or whose replay disagrees is one
    :class:`GraphCaptureError` naming ``name`` and the reason (running out of GPU memory stays
    itself)."""
    began = time.perf_counter()
    try:
        run()
        torch.cuda.synchronize()
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as error:  # noqa: BLE001 -- any failure to capture becomes one line
        # A failure inside the capture is followed by ending the capture, which fails too: the
        # first error is the reason.
        while isinstance(error.__context__, Exception) and not isinstance(error, GraphCaptureError):
            error = error.__context__
        if isinstance(error, torch.cuda.OutOfMemoryError):  # under the capture's own failure
            raise error from None
        lines = str(error).strip().splitlines()
        reason = lines[0] if lines else type(error).__name__
        if not isinstance(error, GraphCaptureError):
            reason = f"{type(error).__name__}: {reason}"
        raise GraphCaptureError(
            f"{name}: its forward cannot be timed from a CUDA graph (--cuda-graphs): {reason}"
        ) from None
    return time.perf_counter() - began
