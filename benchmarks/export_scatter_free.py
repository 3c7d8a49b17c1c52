"""Scatter-free exports: the three forms of the index sums in dTPS/eTPS's squeeze and ToMe's merge
(``scatter``, ``one-hot``, ``segment``; vitcompress/method/squeeze.py), timed in onnxruntime on
the CPU, and in eager PyTorch.

TensorRT's parser runs ``ScatterElements`` only without a reduction, so the ``scatter_add`` form
does not deploy there; ``one-hot`` (a product with the one-hot of the index) and ``segment``
(sorted rows, differences of a running sum) have no scatter. Two levels are timed, each form of
each method interleaved round by round (medians of paired per-round ratios against the scatter
form, 95% bootstrap intervals):

- ``models``: deit_small compressed at keep 0.7 (dTPS/eTPS at blocks 3,6,9, ToMe in every block
  from block 3), exported once per form and batch (static batch), checked against PyTorch;
- ``fuse``: the squeeze and the merge alone at the first location's sizes, exported the same way.

Both in onnxruntime (one intra-op thread) and, for the forms' eager cost, in PyTorch (one
thread). Run it on one thread (``OMP_NUM_THREADS=1``); the machine's load is recorded.

    OMP_NUM_THREADS=1 nice python benchmarks/export_scatter_free.py --rounds 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import vitcompress
from vitcompress.measure.onnx_runtime import onnx_session, onnxruntime_version
from vitcompress.measure.paired import paired_ratio
from vitcompress.method.merge import bipartite_soft_matching, merge_tokens
from vitcompress.method.squeeze import SCATTER, SUM_FORMS, index_sum_form, squeeze
from vitcompress.workflows.export import DEFAULT_OPSET, export_model
from vitcompress.workflows.onnx_symbolics import onnx_symbolics

INPUT_SIZE = (3, 224, 224)
VARIANTS = ("dtps", "etps", "tome")
RESULTS = Path(__file__).resolve().parent / "results" / "export_scatter_free"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="deit_small_patch16_224")
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    p.add_argument("--keep", type=float, default=0.7)
    p.add_argument("--batch-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8])
    p.add_argument("--rounds", type=int, default=12, help="timed rounds after one warm-up")
    p.add_argument("--fuse-calls", type=int, default=50, help="calls per round of a fuse alone")
    p.add_argument("--no-eager-models", action="store_true", help="skip eager whole models")
    p.add_argument("--json-out", default=str(RESULTS / "cpu_deit_small.json"))
    return p.parse_args(argv)


class _Squeeze(nn.Module):
    """The squeeze alone, as the reducer calls it (a prefix token, hosts, donors)."""

    def __init__(self, prefix: int) -> None:
        super().__init__()
        self.prefix = prefix

    def forward(self, x: Tensor, donors: Tensor) -> Tensor:
        return squeeze(x[:, self.prefix :], donors, x[:, : self.prefix])


class _Merge(nn.Module):
    """ToMe's matching and merge alone (cls protected, sizes all one, as in its first block)."""

    def __init__(self, r: int) -> None:
        super().__init__()
        self.r = r

    def forward(self, x: Tensor) -> Tensor:
        matching = bipartite_soft_matching(x, self.r, protected=1)
        return merge_tokens(x, torch.ones(x.shape[:2]), matching)[0]


def _export_onnx(module: nn.Module, inputs: tuple[Tensor, ...], path: Path) -> None:
    """As ``export`` writes a model (its symbolics: the stable sort as TopK), without its check."""
    names = [f"in{i}" for i in range(len(inputs))]
    with onnx_symbolics(DEFAULT_OPSET):
        torch.onnx.export(
            module, inputs, str(path), dynamo=False, opset_version=DEFAULT_OPSET, input_names=names
        )


def _ort_runner(path: Path, inputs: tuple[Tensor, ...]) -> Callable[[], Any]:
    session = onnx_session(path, threads=1)
    feed = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)}
    return lambda: session.run(None, feed)


def _eager_runner(module: nn.Module, inputs: tuple[Tensor, ...], form: str) -> Callable[[], Any]:
    def run() -> Any:
        with index_sum_form(form), torch.inference_mode():
            return module(*inputs)

    return run


def _time(runners: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, list]:
    """Seconds per call of each runner, per round; every round runs each runner ``calls`` times,
    in an order rotated by one each round (no runner always follows the same one)."""
    names = list(runners)
    for name in names:  # warm-up round
        runners[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for k in range(rounds):
        for name in names[k % len(names) :] + names[: k % len(names)]:
            start = time.perf_counter()
            for _ in range(calls):
                runners[name]()
            samples[name].append((time.perf_counter() - start) / calls)
        print(f"  round {k + 1}/{rounds}", file=sys.stderr)
    return samples


def _summary(samples: dict[str, list[float]], key: Callable[[str], str]) -> dict[str, Any]:
    """Median ms per call of each runner, and its speed against the same runner's scatter form
    (``key`` maps a runner's name to its scatter form's): > 1 is faster than the scatter."""
    out: dict[str, Any] = {}
    for name, seconds in samples.items():
        reference = key(name)
        # paired_ratio divides throughputs: the scatter's seconds over this form's.
        ratio = paired_ratio(samples[reference], seconds) if reference != name else None
        out[name] = {
            "median_ms": round(1000 * statistics.median(seconds), 4),
            "speed_vs_scatter": None
            if ratio is None
            else {
                "median": round(ratio.median, 4),
                "ci95": None if ratio.low is None else [round(ratio.low, 4), round(ratio.high, 4)],
                "pairs": ratio.pairs,
            },
        }
    return out


def _scatter_of(name: str) -> str:
    runtime, method, form = name.split(":")
    return f"{runtime}:{method}:{SCATTER}"


def _fuse_runners(
    model: nn.Module, batch: int, tmp: Path, r: int, kept: int, pruned: int
) -> dict[str, Callable[[], Any]]:
    dim = model.embed_dim
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(batch, 1 + kept, dim, generator=generator)
    donors = torch.randn(batch, pruned, dim, generator=generator)
    sequence = torch.randn(batch, 1 + kept + pruned, dim, generator=generator)
    cases = {"squeeze": (_Squeeze(1), (tokens, donors)), "merge": (_Merge(r), (sequence,))}
    runners: dict[str, Callable[[], Any]] = {}
    for method, (module, inputs) in cases.items():
        for form in SUM_FORMS:
            path = tmp / f"fuse.{method}.{form}.b{batch}.onnx"
            with index_sum_form(form):
                _export_onnx(module, inputs, path)
            runners[f"onnxruntime:{method}:{form}"] = _ort_runner(path, inputs)
            runners[f"pytorch:{method}:{form}"] = _eager_runner(module, inputs, form)
    return runners


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    import timm

    base = timm.create_model(args.model, pretrained=False).eval()
    locs = {"dtps": [3, 6, 9], "etps": [3, 6, 9], "tome": [3]}
    models = {
        v: vitcompress.compress(base, v, args.keep, locs[v], INPUT_SIZE).eval()
        for v in args.variants
    }
    from vitcompress.modules.reducers import MergeReducer

    merge_r = next(m.r for m in models["tome"].modules() if isinstance(m, MergeReducer))
    patches = (INPUT_SIZE[1] // 16) * (INPUT_SIZE[2] // 16)
    kept = int(patches * args.keep)  # dTPS's first location
    result: dict[str, Any] = {
        "command": "OMP_NUM_THREADS="
        + os.environ.get("OMP_NUM_THREADS", "?")
        + " python "
        + " ".join(sys.argv),
        "model": args.model,
        "keep": args.keep,
        "locations": {v: locs[v] for v in args.variants},
        "fuse_sizes": {"squeeze": [1 + kept, patches - kept], "merge": [1 + patches, merge_r]},
        "environment": {
            "torch": torch.__version__,
            "onnxruntime": onnxruntime_version(),
            "threads": 1,
            "cpus": os.cpu_count(),
            "loadavg_before": os.getloadavg(),
        },
        "exports": {},
        "batches": {},
    }
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        for batch in args.batch_sizes:
            runners: dict[str, Callable[[], Any]] = {}
            example = (torch.randn(batch, *INPUT_SIZE, generator=torch.Generator().manual_seed(1)),)
            for variant, model in models.items():
                for form in SUM_FORMS:
                    path = tmp / f"{variant}.{form}.b{batch}.onnx"
                    with index_sum_form(form):
                        info = export_model(model, INPUT_SIZE, "onnx", path, batch_size=batch)
                    result["exports"][f"{variant}:{form}:b{batch}"] = info["max_abs_diff"]
                    runners[f"onnxruntime:{variant}:{form}"] = _ort_runner(path, example)
                    if not args.no_eager_models and form != "segment":
                        runners[f"pytorch:{variant}:{form}"] = _eager_runner(model, example, form)
            print(f"batch {batch}: whole models", file=sys.stderr)
            model_samples = _time(runners, args.rounds, 1)
            print(f"batch {batch}: the fuses alone", file=sys.stderr)
            fuse = _fuse_runners(base, batch, tmp, merge_r, kept, patches - kept)
            fuse_samples = _time(fuse, args.rounds, args.fuse_calls)
            result["batches"][str(batch)] = {
                "models": _summary(model_samples, _scatter_of),
                "fuse": _summary(fuse_samples, _scatter_of),
                "samples_s": {"models": model_samples, "fuse": fuse_samples},
            }
    result["environment"]["loadavg_after"] = os.getloadavg()
    out = Path(args.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for batch, levels in result["batches"].items():
        for level in ("models", "fuse"):
            print(f"\nbatch {batch}, {level}: median ms, speed vs scatter [95% CI]")
            for name, row in levels[level].items():
                ratio = row["speed_vs_scatter"]
                text = "" if ratio is None else f"{ratio['median']:.3f} {ratio['ci95']}"
                print(f"  {name:32s} {row['median_ms']:10.3f}  {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
