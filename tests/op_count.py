"""Counting the ATen ops one eval forward dispatches: what a reduction location adds.

At small batches on a GPU every dispatched op is a kernel launch, so the ops a method adds per
location are its launch overhead. The rule (docs/results-speed-cpu.md, "Ops per location
(CPU)"):

- one forward under ``torch.inference_mode()``, on the CPU, the model in eval mode;
- every op that reaches the dispatcher's Python mode counts once (a custom op registered through
  ``torch.library`` with its own kernel is one op, as it is one kernel), except views: an op
  whose schema returns an alias of an input without writing it (``OpOverload.is_view``:
  ``view``, ``t``, ``slice``, ``expand``, ``unsqueeze``, ``select``, ``transpose``, ``detach``,
  ``_unsafe_view``, ...), which launches nothing. ``aten.to``'s schema may alias too, but where
  it changes the dtype or the device it copies (``.float()``, autocast's casts): counted then;
- per location = (ops of the compressed model - ops of its base, on the same input) / locations.
  The blocks after a location run fewer tokens, not fewer ops, so the difference is what the
  method adds. ToMe acts in every block from its first, so its figure is per block.

``python -m tests.op_count`` prints the figures of docs/results-speed-cpu.md's table.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def is_view(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` only makes an alias of an input (its schema's first return aliases an
    input and is not written): such an op moves no data and launches no kernel."""
    return bool(getattr(func, "is_view", False))


def _copied(args: tuple, out: object) -> bool:
    """Whether a view-schema op made new data (``aten.to`` to another dtype or device): its
    result does not share its first input's storage."""
    source = args[0] if args else None
    if not isinstance(source, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    return out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched while it is active, views left out (``counts`` by op name)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if not is_view(func) or _copied(args, out):
            self.counts[str(func.overloadpacket)] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def compiled_targets(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The call targets of the graph ``torch.compile(model, fullgraph=True)`` captures on ``x``
    (under inference mode), after checking that the compiled output equals the eager one: which
    ops a compiler sees, a custom op as one call."""
    targets: list[str] = []

    def backend(graph_module: torch.fx.GraphModule, example_inputs: list) -> object:
        targets.extend(str(node.target) for node in graph_module.graph.nodes)
        return graph_module.forward

    torch._dynamo.reset()
    try:
        with torch.inference_mode():
            compiled = torch.compile(model, fullgraph=True, backend=backend)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()
    return targets


def count_ops(model: nn.Module, x: torch.Tensor, autocast: bool = False) -> Counter[str]:
    """The ops (views excluded) one eval forward of ``model`` on ``x`` dispatches; ``autocast``:
    under CPU bfloat16 autocast (its casts counted: each is a kernel)."""
    model.eval()
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with amp, torch.inference_mode(), OpCounter() as counter:
        model(x)
    return counter.counts


def ops_added(
    compressed: nn.Module, base: nn.Module, x: torch.Tensor, autocast: bool = False
) -> int:
    """Ops the compressed model dispatches beyond its base's, on the same input."""
    added = sum(count_ops(compressed, x, autocast).values())
    return added - sum(count_ops(base, x, autocast).values())


# The configuration: deit_small, blocks 3, 6, 9, keep 0.7; ToMe r = 13 in every block.
DEIT_SMALL = "deit_small_patch16_224"
LOCATIONS = [3, 6, 9]
KEEP = 0.7
TOME_R = 13
METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")


def deit_small_ops_per_location(
    method: str, fused: bool | None = None, autocast: bool = False
) -> float:
    """Ops ``method`` adds per location (ToMe: per block it merges in) to a random-init
    deit_small, batch 1. ``fused``: switch the fused kernels on or off (``None``: as
    ``compress`` leaves them, the default eval path); ``autocast``: both models under CPU
    bfloat16 autocast."""
    import timm

    import vitcompress
    from vitcompress.kernels import enable_fused_kernels

    torch.manual_seed(0)
    base = timm.create_model(DEIT_SMALL, pretrained=False).eval()
    if method == "tome":
        model = vitcompress.compress(base, "tome", variant_args={"r": TOME_R})
    else:
        model = vitcompress.compress(base, method, keep=KEEP, locs=LOCATIONS)
    if fused is not None:
        enable_fused_kernels(model, fused)
    locations = sum(1 for m in model.modules() if hasattr(m, "restore_rule"))
    x = torch.randn(1, 3, 224, 224)
    return ops_added(model, base, x, autocast) / locations


def deit_small_forward_ops(method: str | None, fused: bool = False) -> int:
    """Every op one eval forward dispatches (views excluded) of deit_small (``method`` None) or
    of it compressed as the GPU ladder compresses it (benchmarks/gpu_ladder.py: keep 0.7 at the
    default locations, ToMe at dTPS's GMACs), batch 1; ``fused``: the fused kernels (each custom
    op one kernel) instead of the method's ops (on CUDA the default for dtps, etps and ToMe).
    Where every op is a launch and launching is the bound (a GPU at small batches), base ops /
    compressed ops is the speed-up to expect."""
    import timm

    import vitcompress
    from vitcompress.kernels import enable_fused_kernels
    from vitcompress.measure import count_macs
    from vitcompress.measure.keep_fit import compress_within_gmacs

    torch.manual_seed(0)
    size = (3, 224, 224)
    model = timm.create_model(DEIT_SMALL, pretrained=False).eval()
    if method == "tome":
        base = model
        reference = vitcompress.compress(base, "dtps", keep=KEEP, input_size=size)
        ratio = count_macs(reference, size) / count_macs(base, size)
        model = compress_within_gmacs(base, "tome", ratio, input_size=size)
    elif method is not None:
        model = vitcompress.compress(model, method, keep=KEEP, input_size=size)
    if method is not None:
        enable_fused_kernels(model, fused)
    return sum(count_ops(model, torch.randn(1, *size)).values())


def main() -> None:
    print("ops per location (ToMe: per block), default path")
    for method in METHODS:
        print(f"{method:11s} {deit_small_ops_per_location(method):6.1f}")
    base = deit_small_forward_ops(None)
    print(f"ops per forward, as the GPU ladder compresses: base {base}; method ops / fused")
    for method in METHODS:
        ops = [deit_small_forward_ops(method, fused) for fused in (False, True)]
        ratios = " / ".join(f"{base / n:.2f}" for n in ops)
        print(f"{method:11s} {ops[0]:4d} / {ops[1]:4d}   base / compressed {ratios}")


if __name__ == "__main__":
    main()
