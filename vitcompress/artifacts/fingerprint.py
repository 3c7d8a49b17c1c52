"""What identifies a compressed model beyond its weights: the model map summary, the state-dict
shapes, and its eval-mode output on a fixed input. An artifact records this at save time; loading
checks the rebuilt model against it, so a base that no longer builds the same (another timm
version, an edited model file, a missing constructor argument) is refused instead of returned.

The fixed input comes from Python's ``random.Random``, whose ``random()`` sequence Python
guarantees across versions, so the input does not change with torch's generator. The output is
kept as a SHA-256 of its float32 bytes (identical on the machine that saved it) and as a short
random projection (a sketch) compared within ``RTOL``: other CPUs, thread counts and libraries
round the last bits differently, and that must not make a good artifact unloadable.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from vitcompress.model_copy import copy_model

INPUT_SEED = 0
SKETCH_SEED = 1
INPUT_BATCH = 2
SKETCH_ROWS = 16
SKETCH_FOLD = 4096  # longer outputs are folded to this many values before the projection
RTOL = 1e-4  # relative L2 difference of the sketch tolerated on load
SAVE_RTOL = 1e-5  # same process, same weights: only reduction order may differ
_SHOW = 3


class FingerprintError(ValueError):
    """A model whose output cannot be fingerprinted, or a malformed recorded fingerprint."""


def fixed_input(input_size: tuple[int, ...]) -> Tensor:
    """``(INPUT_BATCH, *input_size)`` values uniform in [-2, 2), the same on every machine."""
    rng = random.Random(INPUT_SEED)
    count = INPUT_BATCH * math.prod(input_size)
    values = torch.tensor([rng.random() for _ in range(count)], dtype=torch.float64)
    return (values * 4 - 2).to(torch.float32).reshape(INPUT_BATCH, *input_size)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode for the duration, then every submodule's own mode back (they may differ)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for key in sorted(value, key=str) for t in _tensors(value[key])]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


def eval_output(model: nn.Module, input_size: tuple[int, ...]) -> Tensor:
    """The model's eval-mode output on :func:`fixed_input`, flattened to one float32 vector.

    The model runs on the CPU (a copy if it lives elsewhere) with torch's generator seeded, so
    that ``--policy random`` selects the same tokens each time; its modes are restored.
    """
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if devices - {torch.device("cpu")}:
        model = copy_model(model).cpu()
    with eval_mode(model), torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(INPUT_SEED)
        output = model(fixed_input(input_size))
    tensors = _tensors(output)
    if not tensors:
        raise FingerprintError(f"the model returned {type(output).__name__}, which holds no tensor")
    flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
    if not bool(torch.isfinite(flat).all()):
        raise FingerprintError("the model's output on a fixed input is not finite (NaN or inf)")
    return flat


def _sketch(flat: Tensor) -> list[float]:
    if flat.numel() > SKETCH_FOLD:
        padded = torch.cat([flat, flat.new_zeros(-flat.numel() % SKETCH_FOLD)])
        flat = padded.reshape(-1, SKETCH_FOLD).sum(0)
    rng = random.Random(SKETCH_SEED)
    rows = (
        torch.tensor(
            [rng.random() for _ in range(SKETCH_ROWS * flat.numel())], dtype=torch.float64
        ).reshape(SKETCH_ROWS, -1)
        * 2
        - 1
    )
    return (rows @ flat.double() / math.sqrt(flat.numel())).tolist()


def relative_difference(a: Tensor, b: Tensor) -> float:
    """``|a - b| / |b|`` in L2 (``|a - b|`` where ``b`` is zero)."""
    a, b = a.double(), b.double()
    norm = float(b.norm())
    return float((a - b).norm()) / (norm if norm > 0 else 1.0)


def map_summary(model_map: Mapping[str, Any]) -> dict[str, Any]:
    """What a model map says about the model's size: blocks, tokens, widths and heads."""
    blocks = model_map["blocks"]
    return {
        "input_size": list(model_map["input_size"]),
        "blocks": len(blocks),
        "tokens": [b["tokens"] for b in blocks],
        "dims": [b["dim"] for b in blocks],
        "heads": [b["heads"] for b in blocks],
        "prefix_tokens": model_map["prefix_tokens"],
        "grid": list(model_map["grid"]),
    }


def state_shapes(model: nn.Module) -> dict[str, list[int]]:
    return {key: list(value.shape) for key, value in model.state_dict().items()}


def map_differences(recorded: Mapping[str, Any], rebuilt: Mapping[str, Any]) -> list[str]:
    """``"blocks: 8 saved, 6 rebuilt"`` for each field of :func:`map_summary` that differs."""
    return [
        f"{key}: {recorded.get(key)} saved, {rebuilt.get(key)} rebuilt"
        for key in recorded.keys() | rebuilt.keys()
        if recorded.get(key) != rebuilt.get(key)
    ]


def shape_differences(
    recorded: Mapping[str, list[int]], rebuilt: Mapping[str, list[int]]
) -> list[str]:
    """Missing keys, unexpected keys and differing shapes, a few of each."""
    missing = [k for k in recorded if k not in rebuilt]
    unexpected = [k for k in rebuilt if k not in recorded]
    reshaped = [
        f"{k} {list(recorded[k])} saved, {list(rebuilt[k])} rebuilt"
        for k in recorded
        if k in rebuilt and list(recorded[k]) != list(rebuilt[k])
    ]
    problems = []
    for what, keys in (
        ("weights the rebuilt model lacks", missing),
        ("weights only the rebuilt model has", unexpected),
        ("shapes differ", reshaped),
    ):
        if keys:
            more = f" and {len(keys) - _SHOW} more" if len(keys) > _SHOW else ""
            problems.append(f"{what} ({len(keys)}): {', '.join(keys[:_SHOW])}{more}")
    return problems


@dataclass
class Fingerprint:
    model_map: dict[str, Any]
    state_dict: dict[str, list[int]]
    output_shape: list[int]
    output_sha256: str
    output_sketch: list[float]

    @classmethod
    def of(
        cls,
        model: nn.Module,
        model_map: Mapping[str, Any],
        input_size: tuple[int, ...],
        output: Tensor | None = None,
    ) -> Fingerprint:
        """Fingerprint ``model`` (its eval output may be given if already computed)."""
        flat = eval_output(model, input_size) if output is None else output
        return cls(
            model_map=map_summary(model_map),
            state_dict=state_shapes(model),
            output_shape=[flat.numel()],
            output_sha256=hashlib.sha256(flat.contiguous().numpy().tobytes()).hexdigest(),
            output_sketch=_sketch(flat),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "model_map": self.model_map,
            "state_dict": self.state_dict,
            "output": {
                "input": f"uniform [-2, 2) from random.Random({INPUT_SEED}), batch "
                f"{INPUT_BATCH}, eval mode, CPU float32",
                "numel": self.output_shape[0],
                "sha256": self.output_sha256,
                "sketch": self.output_sketch,
            },
        }

    @classmethod
    def from_json(cls, data: Any) -> Fingerprint:
        try:
            output = data["output"]
            fingerprint = cls(
                model_map=dict(data["model_map"]),
                state_dict={str(k): [int(d) for d in v] for k, v in data["state_dict"].items()},
                output_shape=[int(output["numel"])],
                output_sha256=str(output["sha256"]),
                output_sketch=[float(v) for v in output["sketch"]],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise FingerprintError(f"malformed fingerprint ({type(e).__name__}: {e})") from e
        if len(fingerprint.output_sketch) != SKETCH_ROWS:
            raise FingerprintError(
                f"malformed fingerprint: the sketch has "
                f"{len(fingerprint.output_sketch)} values, not {SKETCH_ROWS}"
            )
        return fingerprint

    def output_difference(self, model: nn.Module, input_size: tuple[int, ...]) -> str | None:
        """Why ``model``'s output does not match the recorded one, or None if it does: the same
        bytes, or a sketch within ``RTOL``."""
        flat = eval_output(model, input_size)
        if flat.numel() != self.output_shape[0]:
            return f"output has {flat.numel()} values, {self.output_shape[0]} saved"
        if hashlib.sha256(flat.contiguous().numpy().tobytes()).hexdigest() == self.output_sha256:
            return None
        difference = relative_difference(
            torch.tensor(_sketch(flat)), torch.tensor(self.output_sketch)
        )
        if difference <= RTOL:
            return None
        return (
            f"its output on the fixed input differs from the saved one (relative "
            f"difference {difference:.2g}, tolerance {RTOL:g})"
        )
