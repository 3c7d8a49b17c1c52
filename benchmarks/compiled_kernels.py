"""How many kernels one compiled forward runs, per method: a CPU proxy for issue 40.

On a GPU at batch 1-8, CUDA graphs or not, a compressed ViT's time follows the number of kernels
it launches (docs/results-speed-gpu.md, "The ladder (run 8)"). Does ``torch.compile`` (inductor)
fuse the ops a method adds, so that a compressed model runs no more kernels than its base? This
compiles a random-init ``deit_small_patch16_224`` (eval, batch 1, float32) and each method on it
with ``torch.compile(model, fullgraph=True, dynamic=False)`` (inductor, its default mode), on the
CPU, with a fresh inductor cache directory and no FX graph cache (every model is lowered and its
code generated afresh; a C++ kernel whose source an earlier model of the run generated is reused,
not rebuilt), and counts what the generated ``call`` function runs:

- ``cpp_calls``: calls of the generated C++ kernels (``cpp_fused_*``). On the CPU inductor writes
  consecutive fused nodes into one C++ function until the next extern call, so this can count
  fewer kernels than a GPU backend would launch;
- ``node_groups``: the fused scheduler nodes inductor generated code for (one ``codegen_node``
  each; a CPU outer-loop fusion, e.g. a layer norm's statistics and its output, counts once):
  one GPU kernel each where the GPU backend fuses alike. It can count more than a GPU would: the
  CPU backend sometimes leaves a residual add apart from the layer norm that reads it, and copies
  the patch embedding's input and weight to its convolution's layout;
- ``extern_calls``: calls of library kernels (``extern_kernels.*``: matmuls, ``bmm``,
  convolution) and fallback ops (``torch.ops.*``: SDPA, ``sort``, the fused custom ops), by name
  in ``extern_names``;
- ``kernels`` = node_groups + extern_calls; ``kernels_cpu`` = cpp_calls + extern_calls (what the
  CPU wrapper calls).

``torch._inductor.metrics.generated_kernel_count`` is recorded too (``inductor_metric``), but on
the CPU it is not a kernel count: it also counts code inductor generates and throws away
(outer-loop fusion tried, then the plain loops), e.g. 10 for tests/test_compiled_kernels.py's
model, whose code has 3 C++ kernels.

What a CPU count cannot show: on CUDA inductor lowers a sort of at most 512 elements to a Triton
kernel (``ir.Sort``), which may fuse with its neighbours, where the CPU calls ``aten.sort``; and
a fused custom op, one call here, runs several kernels on CUDA (its Triton implementation also
calls ``torch.sort`` and ``torch.bmm``).

Which path compiles: the reducers' default switch (``fused_kernel=None``) takes the method's own
ops under a compiler's trace (``vitcompress.kernels.kernel_runs``: ``torch.compiler.is_compiling``),
so inductor sees and fuses the method's ops; ``--fused`` also compiles each method with
``enable_fused_kernels(model, True)``, where the custom op (``vitcompress::select_squeeze``,
``vitcompress::tome_merge``) is kept as one opaque call. The compiled output is checked against
the eager one. For comparison the eager forward's ops are counted with ``tests/op_count.py``'s
``count_ops`` (views excluded), both on the eager default path (the fused C++ kernels where they
build) and on the method's ops.

Models: the base; dTPS, eTPS, DynamicViT and EViT at keep 0.7 at blocks 3, 6, 9; ToMe with
``variant_args={"r": 13}`` (it merges in every block from block 3). Per location = (compressed -
base) / locations (ToMe: per merging block, as ``tests/op_count.py``). Where launching is the
bound, base kernels / compressed kernels is the batch-1 speed-up to expect.

On a GPU (``--device cuda``, ``--bf16`` for bf16 autocast as the GPU ladder runs) the same code
counts inductor's Triton launches (``triton_calls``: ``triton_*.run(``) and its extern calls:
``kernels`` = triton_calls + extern_calls, the launches of one forward, with a sort made a
Triton kernel where inductor does so; ``benchmarks/gpu_checks.sh PARTS=compiled-kernels``.

Example (one thread; 9-60 s of compilation per model, about 7 minutes in all, on a shared 2-core
machine)::

    OMP_NUM_THREADS=1 python benchmarks/compiled_kernels.py --fused \\
        --json-out benchmarks/results/cpu_compiled_kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config as inductor_config
from torch import nn
from torch._inductor import metrics as inductor_metrics
from torch._inductor.codegen.cpp import CppScheduling, OuterLoopFusedSchedulerNode
from torch._inductor.utils import run_and_get_code

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.op_count import count_ops  # noqa: E402

MODEL = "deit_small_patch16_224"
LOCATIONS = [3, 6, 9]
KEEP = 0.7
TOME_R = 13
METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")
FUSED_METHODS = ("dtps", "etps", "dynamicvit", "tome")  # the reducers with a fused op
SWITCH = {None: "default", True: "fused", False: "method"}  # the reducers' fused_kernel


def fresh_inductor_cache() -> str:
    """A new, empty inductor cache directory for this process (read by inductor at each use):
    no compiled graph or kernel from an earlier run is found there."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="vitcompress-inductor-")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


# ---------------------------------------------------------------------------------------------
# Counting the generated code


class NodeGroups:
    """Counts ``CppScheduling.codegen_node`` calls (one per fused scheduler node) while active."""

    def __init__(self) -> None:
        self.groups = 0
        self.outer_loop = 0
        self._original = CppScheduling.codegen_node

    def __enter__(self) -> NodeGroups:
        original = self._original
        counter = self

        def codegen_node(scheduling: CppScheduling, node: Any) -> Any:
            counter.groups += 1
            counter.outer_loop += isinstance(node, OuterLoopFusedSchedulerNode)
            return original(scheduling, node)

        CppScheduling.codegen_node = codegen_node
        return self

    def __exit__(self, *exc: object) -> None:
        CppScheduling.codegen_node = self._original


_CALL_START = re.compile(r"^    def call\(self, args\):$|^def call\(args\):$", re.M)
_CPP_CALL = re.compile(r"^\s+(cpp_\w+)\(", re.M)
# A generated Triton kernel's launch in CUDA code: ``triton_poi_fused_add_0.run(..., stream=...)``.
_TRITON_CALL = re.compile(r"^\s+(triton_\w+)\.run\(", re.M)
_EXTERN_CALL = re.compile(r"\bextern_kernels\.(\w+)\(")
_OP_CALL = re.compile(
    r"\b(?:torch\.ops\.)?(aten|prims|vitcompress|quantized|mkldnn|mkl)\.(\w+)\.(\w+)\("
)


def call_body(code: str) -> str:
    """The body of the generated module's ``call`` (what runs per forward)."""
    match = _CALL_START.search(code)
    if match is None:
        raise ValueError("no call function in the generated code")
    body = []
    indent = len(match.group(0)) - len(match.group(0).lstrip())
    for line in code[match.end() :].splitlines()[1:]:
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        body.append(line)
    return "\n".join(body)


def count_calls(code: str) -> dict[str, Any]:
    """The kernel calls in one generated module's ``call``: C++ kernels, Triton launches (CUDA)
    and extern calls."""
    body = "\n".join(
        line for line in call_body(code).splitlines() if not line.strip().startswith("#")
    )
    cpp = _CPP_CALL.findall(body)
    extern: Counter[str] = Counter()
    for name in _EXTERN_CALL.findall(body):
        extern[f"extern_kernels.{name}"] += 1
    for namespace, name, _overload in _OP_CALL.findall(body):
        extern[f"{namespace}.{name}"] += 1
    triton = _TRITON_CALL.findall(body)
    return {"cpp_calls": len(cpp), "triton_calls": len(triton), "extern": extern}


# ---------------------------------------------------------------------------------------------
# The models


def build(method: str | None, fused: bool | None) -> nn.Module:
    """deit_small (random init, eval), ``method`` applied as tests/op_count.py applies it."""
    import timm

    import vitcompress
    from vitcompress.kernels import enable_fused_kernels

    torch.manual_seed(0)
    model = timm.create_model(MODEL, pretrained=False).eval()
    if method == "tome":
        model = vitcompress.compress(model, "tome", variant_args={"r": TOME_R})
    elif method is not None:
        model = vitcompress.compress(model, method, keep=KEEP, locs=LOCATIONS)
    if method is not None and fused is not None:
        enable_fused_kernels(model, fused)
    return model.eval()


def locations(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if hasattr(m, "restore_rule"))


def compiled_counts(
    model: nn.Module, x: torch.Tensor, dump: Path | None = None, bf16: bool = False
) -> dict[str, Any]:
    """Compile ``model`` afresh and count the kernels of its generated code (written to
    ``dump``, one file per graph, where given); ``bf16``: under CUDA's bf16 autocast."""
    torch._dynamo.reset()
    inductor_metrics.reset()
    cuda = x.device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16)
    with torch.inference_mode(), autocast:
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, dynamic=False)
        started = time.perf_counter()
        # No FX graph cache: every model is lowered and its code generated afresh.
        no_cache = inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False)
        with no_cache, NodeGroups() as groups:
            out, codes = run_and_get_code(compiled, x)
        compile_s = time.perf_counter() - started
        again = compiled(x)
    if not bf16:  # bf16 rounds differently compiled and eager; its difference is recorded
        tolerance = 1e-3 if cuda else 1e-4
        torch.testing.assert_close(out, eager, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(again, eager, atol=tolerance, rtol=tolerance)
    cpp_calls = triton_calls = 0
    extern: Counter[str] = Counter()
    for index, code in enumerate(codes):
        if dump is not None:
            dump.parent.mkdir(parents=True, exist_ok=True)
            dump.with_name(f"{dump.name}_{index}.py").write_text(code)
        counted = count_calls(code)
        cpp_calls += counted["cpp_calls"]
        triton_calls += counted["triton_calls"]
        extern += counted["extern"]
    extern_calls = sum(extern.values())
    record = {
        "device": x.device.type,
        "dtype": "bf16 autocast" if bf16 else "float32",
        "graphs": len(codes),
        "node_groups": groups.groups,
        "outer_loop_fused": groups.outer_loop,
        "cpp_calls": cpp_calls,
        "triton_calls": triton_calls,
        "extern_calls": extern_calls,
        # On CUDA each generated kernel is launched by name: the launches are the count.
        "kernels": (triton_calls if cuda else groups.groups) + extern_calls,
        "kernels_cpu": None if cuda else cpp_calls + extern_calls,
        "inductor_metric": inductor_metrics.generated_kernel_count,
        "extern_names": dict(sorted(extern.items())),
        "custom_op_compiled": any(name.startswith("vitcompress.") for name in extern),
        "max_abs_diff": float((out.float() - eager.float()).abs().max()),
        "compile_s": round(compile_s, 1),
    }
    torch._dynamo.reset()
    return record


def eager_ops(model: nn.Module, method: str | None, x: torch.Tensor) -> dict[str, int]:
    """The eager forward's ops (tests/op_count.py), default path and method's ops."""
    from vitcompress.kernels import enable_fused_kernels

    default = sum(count_ops(model, x).values())
    if method is None or method not in FUSED_METHODS:
        return {"eager_ops": default, "eager_ops_method": default}
    settings = [m.fused_kernel for m in model.modules() if hasattr(m, "fused_kernel")]
    enable_fused_kernels(model, False)
    method_ops = sum(count_ops(model, x).values())
    modules = [m for m in model.modules() if hasattr(m, "fused_kernel")]
    for module, setting in zip(modules, settings, strict=True):
        module.fused_kernel = setting
    return {"eager_ops": default, "eager_ops_method": method_ops}


def measure(
    method: str | None, fused: bool | None, dump_dir: str | None, device: str, bf16: bool
) -> dict[str, Any]:
    model = build(method, fused).to(device)
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(1)).to(device)
    record: dict[str, Any] = {
        "method": method or "base",
        "fused_switch": fused,
        "locations": locations(model) if method is not None else 0,
    }
    name = f"{method or 'base'}_{SWITCH[fused]}"
    dump = Path(dump_dir) / name if dump_dir else None
    record.update(compiled_counts(model, x, dump, bf16))
    record.update(eager_ops(model, method, x))
    return record


# ---------------------------------------------------------------------------------------------
# The table


def derive(records: list[dict[str, Any]]) -> None:
    """Per location added kernels and base / compressed, against the base record (in place)."""
    base = next(r for r in records if r["method"] == "base")
    for record in records:
        if record is base:
            continue
        where = record["locations"]
        for key in ("kernels", "kernels_cpu", "eager_ops", "eager_ops_method"):
            if record[key] is None:
                continue
            record[f"{key}_added_per_location"] = round((record[key] - base[key]) / where, 2)
            record[f"{key}_ratio"] = round(base[key] / record[key], 3)


def table(records: list[dict[str, Any]]) -> str:
    head = (
        "| model | switch | node groups | cpp / triton calls | extern | kernels | per loc. | base/comp. "
        "| eager ops (default / method's) | per loc. | base/comp. |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    rows = [head]
    for r in records:
        switch = SWITCH[r["fused_switch"]]
        per = r.get("kernels_added_per_location", "")
        ratio = r.get("kernels_ratio", "")
        eager_per = r.get("eager_ops_added_per_location", "")
        eager_ratio = r.get("eager_ops_ratio", "")
        rows.append(
            f"| {r['method']} | {switch} | {r['node_groups']} | "
            f"{r['cpp_calls']} / {r['triton_calls']} | "
            f"{r['extern_calls']} | {r['kernels']} | {per} | {ratio} | "
            f"{r['eager_ops']} / {r['eager_ops_method']} | {eager_per} | {eager_ratio} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated")
    parser.add_argument(
        "--fused",
        action="store_true",
        help="also compile dtps, etps, dynamicvit and tome with enable_fused_kernels(model, True)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: Triton launches counted")
    parser.add_argument("--bf16", action="store_true", help="under bf16 autocast (CUDA)")
    parser.add_argument("--dump-dir", help="write each model's generated code here")
    parser.add_argument("--json-out", default="benchmarks/results/cpu_compiled_kernels.json")
    args = parser.parse_args(argv)
    if args.bf16 and not args.device.startswith("cuda"):
        parser.error("--bf16 is CUDA's autocast: it needs --device cuda")
    torch.set_num_threads(args.threads)
    cache = fresh_inductor_cache()
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods: {', '.join(unknown)}")

    runs: list[tuple[str | None, bool | None]] = [(None, None)]
    runs += [(m, None) for m in methods]
    if args.fused:
        runs += [(m, True) for m in methods if m in FUSED_METHODS]
    import timm

    environment = {
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "torch": torch.__version__,
        "timm": timm.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "threads": args.threads,
        "model": MODEL,
        "batch": 1,
        "device": args.device,
        "dtype": "bf16 autocast" if args.bf16 else "float32",
        "compile": "torch.compile(model, fullgraph=True, dynamic=False), inductor default mode",
        "inductor_cache": f"fresh TORCHINDUCTOR_CACHE_DIR ({cache}), fx_graph_cache off",
        "keep": KEEP,
        "locations": LOCATIONS,
        "tome_r": TOME_R,
    }
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    for method, fused in runs:
        record = measure(method, fused, args.dump_dir, args.device, args.bf16)
        print(
            f"{record['method']:11s} switch={fused!s:5s} node_groups={record['node_groups']} "
            f"cpp_calls={record['cpp_calls']} triton={record['triton_calls']} "
            f"extern={record['extern_calls']} "
            f"kernels={record['kernels']} eager_ops={record['eager_ops']}/"
            f"{record['eager_ops_method']} compile={record['compile_s']}s",
            flush=True,
        )
        records.append(record)
        derive(records)
        # Written after every model: a run stopped by a time limit keeps what it counted.
        out.write_text(json.dumps({**environment, "records": records}, indent=2) + "\n")
    print(table(records))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
