"""The compatibility matrix: the smallest model of every timm ViT-like family (plus the zoo), built
with random weights at a small size, and for each variant whether it maps, is exact at keep 1 with
sharpened weights, cuts GMACs at keep 0.7, trains one step and exports to ONNX, or is refused.
Rows whose output is the token grid itself (``DENSE``: dense outputs and video) compare whole
outputs instead of logits: shape and per-token cosine at keep 0.7, a loss on the output.

    nice -n 10 python benchmarks/compat_matrix.py            # the full matrix (~30 min, 2 cores)
    python benchmarks/compat_matrix.py --families deit,beit  # a subset (writes nothing by default)

Writes ``benchmarks/results/compat_matrix.json`` and ``docs/compatibility.md`` (full runs only,
unless ``--json``/``--doc`` are given). Each family runs in its own process (a crash or a hang
inside native code cannot take the run down) and each cell is bounded in time by a timer signal.

Only the public API is used: ``vitcompress.compress``, ``vitcompress.map_model``,
``vitcompress.measure.count_macs`` and the export workflow's ``export_model``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

import vitcompress
from vitcompress.cli.app import USER_ERRORS
from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.naming import RewrittenModelError
from vitcompress.measure import count_macs
from vitcompress.search.cost import profile, relative_error
from vitcompress.workflows.export import export_model

ROOT = Path(__file__).resolve().parent.parent
JSON_OUT = ROOT / "benchmarks" / "results" / "compat_matrix.json"
DOC_OUT = ROOT / "docs" / "compatibility.md"

VARIANTS = ("dtps", "etps", "dynamicvit", "evit")
REDUCED_KEEP = 0.7
# Keep 1 only re-sorts tokens: float rounding of a re-sort stays far below this share of the
# logits' scale (~1e-6), a position table read with another token's row (the silent bug) far
# above it (~1e-2 with sharpened weights).
EXACT_TOLERANCE = 1e-4
# The search ranks candidates by analytic MACs: they must agree with the counted ones.
ANALYTIC_TOLERANCE = 0.01
CELL_SECONDS = 120.0
BUILD_SECONDS = 120.0
SEED = 0

# A ViT's small configuration (tests/models.py's SMALL): 8x8 patches, 4 blocks, width 64.
SMALL_VIT = dict(img_size=32, patch_size=4, depth=4, embed_dim=64, num_heads=2)
# Families whose small configuration needs more than the generic tries below.
# (constructor arguments, image side)
FAMILY_TRIES: dict[str, list[tuple[dict[str, Any], int]]] = {
    "samvit": [
        (
            dict(
                img_size=64,
                patch_size=8,
                window_size=4,
                depth=2,
                embed_dim=64,
                num_heads=2,
                global_attn_indexes=(1,),
            ),
            64,
        )
    ],
    # Swin-T's width and windows (7 x 7; a small width or window makes the window attention's
    # own products and the keep count's rounding weigh more than at any real size), three stages
    # at 112 pixels: 16, 4 and 1 windows.
    "swin": [
        (
            dict(
                img_size=112,
                window_size=7,
                embed_dim=96,
                depths=(1, 1, 2),
                num_heads=(3, 6, 12),
            ),
            112,
        )
    ],
    # Windows that divide their grid: a padded window refuses a predictor (docs/windowed.md,
    # "Padded windows"); DaViT's and TinyViT's own windows pad at 64 pixels.
    "davit": [(dict(window_size=4), 128)],
    "tiny_vit": [(dict(window_sizes=(4, 4, 4, 2)), 64)],
    # Windows of 16 tokens: at 64 pixels their partitions hold 4, where EViT, whose fused token
    # replaces the pruned ones, removes none at keep 0.7.
    "maxvit": [(dict(img_size=128), 128)],
    "swinv2_cr": [(dict(img_size=128), 128)],
    "hiera": [(dict(img_size=128), 128)],
    "cait": [(dict(SMALL_VIT, depth_token_only=1), 32)],
    "pvt_v2": [(dict(depths=(1, 1, 1, 1)), 64)],
}
# Then, in order, the first that builds and runs wins: the small ViT, a 64-pixel image (as a
# constructor argument, or only as the input where the model takes none), the model's default.
GENERIC_TRIES: list[tuple[dict[str, Any], int | None]] = [
    (SMALL_VIT, 32),
    (dict(img_size=64), 64),
    ({}, 64),
    ({}, None),
]
NUM_CLASSES = 10

# Size words in timm names, smallest first; a trailing number is dropped first ("s18" -> "s").
SIZE_WORDS = [
    "atto",
    "femto",
    "pico",
    "nano",
    "xx",
    "xxs",
    "xxtiny",
    "ti",
    "t",
    "tiny",
    "x",
    "xs",
    "xtiny",
    "xsmall",
    "s",
    "small",
    "m",
    "medium",
    "mediumd",
    "betwixt",
    "b",
    "base",
    "l",
    "large",
    "h",
    "huge",
    "g",
    "giant",
    "gigantic",
]


@dataclass(frozen=True)
class Family:
    name: str
    pattern: str  # a regular expression over timm model names
    module: str | None = None  # timm's defining module, where the name alone is ambiguous


# Ordered: a model belongs to the first family it matches. "Sequencer-like" families (token
# mixers without attention) are in the matrix on purpose: their row must be a refusal.
FAMILIES: list[Family] = [
    Family("vit_rope_mixed", r"_rope_mixed"),
    Family("vit_rope", r"^vit_.*_rope"),
    Family("dinov3", r"_dinov3"),
    Family("dinov2", r"_dinov2$"),
    Family("vit_pe", r"^vit_pe_core_"),
    Family("vit_parallel", r"_18x2_"),
    Family("vit_pwee", r"^vit_pwee_"),
    Family("vit_diff", r"^vit_d(wee|pwee|little)_"),
    Family("vit_reg", r"^vit_.*_reg\d", "vision_transformer"),
    Family("vit_clip", r"^vit_.*_clip_", "vision_transformer"),
    Family("vit_siglip", r"^vit_.*_siglip", "vision_transformer"),
    Family("vit_gap", r"^vit_.*_gap_\d+$", "vision_transformer"),
    Family("vit", r"^vit_(tiny|small|base|large|huge)_patch\d+_\d+$", "vision_transformer"),
    Family("vit_hybrid", r".", "vision_transformer_hybrid"),
    Family("vit_relpos", r"^vit_relpos_"),
    Family("vit_srelpos", r"^vit_srelpos_"),
    Family("flexivit", r"^flexivit_"),
    Family("naflexvit", r"^naflexvit_"),
    Family("aimv2", r"^aimv2_"),
    Family("beit3", r"^beit3_"),
    Family("deit", r"^deit_"),
    Family("deit3", r"^deit3_"),
    Family("beit", r"^beit_"),
    Family("beitv2", r"^beitv2_"),
    Family("eva02", r"^eva02_"),
    Family("samvit", r"^samvit_"),
    Family("cait", r"^cait_"),
    Family("xcit", r"^xcit_"),
    Family("levit", r"^levit_\d+s?$"),
    Family("efficientformer", r"^efficientformer_"),
    Family("efficientformerv2", r"^efficientformerv2_"),
    Family("pvt_v2", r"^pvt_v2_"),
    Family("twins_pcpvt", r"^twins_pcpvt_"),
    Family("twins_svt", r"^twins_svt_"),
    Family("swin", r"^swin_(tiny|small|base|large)_patch"),
    Family("swinv2", r"^swinv2_(?!cr_)"),
    Family("swinv2_cr", r"^swinv2_cr_"),
    Family("maxvit", r"^maxvit_"),
    Family("coatnet", r"^coatnet_"),
    Family("hiera", r".", "hiera"),
    Family("sam2_hiera", r".", "hieradet_sam2"),
    Family("mvitv2", r"^mvitv2_"),
    Family("crossvit", r"^crossvit_"),
    Family("tnt", r"^tnt_"),
    Family("volo", r"^volo_"),
    Family("coat", r"^coat_"),
    Family("convit", r"^convit_"),
    Family("pit", r"^pit_"),
    Family("nest", r"^nest_"),
    Family("gcvit", r"^gcvit_"),
    Family("davit", r"^davit_"),
    Family("tiny_vit", r"^tiny_vit_"),
    Family("efficientvit_mit", r"^efficientvit_(b|l)\d"),
    Family("efficientvit_msra", r"^efficientvit_m\d"),
    Family("mobilevit", r"^mobilevit_"),
    Family("edgenext", r"^edgenext_"),
    Family("fastvit", r"^fastvit_"),
    Family("nextvit", r"^nextvit_"),
    Family("visformer", r"^visformer_"),
    Family("vitamin", r"^vitamin_"),
    Family("qwen3_vit", r"^qwen3_vit_"),
    Family("gemma4_vit", r"^gemma4_vit_"),
    Family("deepseek_vit", r"^deepseek_vit_"),
    Family("botnet", r"^botnet"),
    Family("caformer", r"^caformer_"),
    # Token mixers without attention: the tool must say it finds no attention, in one line.
    Family("sequencer", r"^sequencer2d_"),
    Family("mlp_mixer", r"^mixer_"),
    Family("resmlp", r"^resmlp_"),
    Family("gmlp", r"^gmlp_"),
    Family("poolformer", r"^poolformer_"),
    Family("convmixer", r"^convmixer_"),
]
# Families timm lacks, registered into timm by vitcompress.
ZOO = {"pvt (zoo)": "pvt_tiny", "cvt (zoo)": "cvt_13"}
# HuggingFace transformers classes, built from tiny configs (tests/fixtures/hf_models.py) and
# wrapped so that images go in and logits come out; rows only where transformers is installed.
HF_CLASSES = {
    "hf_vit": "ViTForImageClassification",
    "hf_deit": "DeiTForImageClassificationWithTeacher",
    "hf_dinov2": "Dinov2ForImageClassification",
    "hf_pvt": "PvtForImageClassification",
    "hf_pvt_v2": "PvtV2ForImageClassification",
    "hf_cvt": "CvtForImageClassification",
    "hf_swin": "SwinForImageClassification",
    "hf_swinv2": "Swinv2ForImageClassification",
}
# Models whose output is the token grid itself (tokens, or per-pixel logits) and video token
# grids (tests/fixtures/dense_models.py): their cells compare whole outputs, not logits. The
# values name the model each row builds; the hf rows only where transformers is installed.
DENSE = {
    "dense_vit": "vit_tiny_patch16_224",
    "dense_dinov2": "vit_small_patch14_dinov2",
    "dense_hf_dinov2": "Dinov2Model",
    "dense_segmenter": "segmenter_tiny_fmnist",
    "video_conv3d": "VideoViT",
    "video_hf_videomae": "VideoMAEModel",
    "dense_hf_sam": "SamVisionEncoder",
    "video_hf_timesformer": "TimesformerModel",
}
DENSE_HF = ("dense_hf_dinov2", "video_hf_videomae", "dense_hf_sam", "video_hf_timesformer")


# ---------------------------------------------------------------------------------------------
# Choosing and building the models


def size_rank(name: str) -> tuple[int, int, int, int, str]:
    """A cheap order by size from the name alone: the size word (tiny before base), then the
    lowest input resolution, then the first number (a width or depth: ``levit_128``), then the
    shortest name (the plain variant before its offshoots)."""
    words = [re.sub(r"(?<=[a-z])\d+$", "", w) for w in re.split(r"[_.]", name)]
    ranks = [SIZE_WORDS.index(w) for w in words if w in SIZE_WORDS]
    numbers = [int(n) for n in re.findall(r"(?<![a-z])(\d+)(?=_|$)", name)]
    resolution = max([n for n in numbers if n >= 160], default=0)
    first = numbers[0] if numbers else 0
    return (min(ranks) if ranks else len(SIZE_WORDS), resolution, first, len(name), name)


def family_models() -> list[tuple[str, str | None]]:
    """``(family, smallest model)`` for every family; ``None`` where this timm has none."""
    from timm.models import _registry

    names = [n for n in timm.list_models() if not n.startswith("test_")]
    taken: set[str] = set()
    chosen: list[tuple[str, str | None]] = []
    for family in FAMILIES:
        members = [
            n
            for n in names
            if n not in taken
            and re.search(family.pattern, n)
            and (family.module is None or _registry._model_to_module.get(n) == family.module)
        ]
        taken.update(members)
        chosen.append((family.name, min(members, key=size_rank) if members else None))
    chosen.extend(ZOO.items())
    has_transformers = importlib.util.find_spec("transformers") is not None
    if has_transformers:
        chosen.extend(HF_CLASSES.items())
    chosen.extend((f, m) for f, m in DENSE.items() if has_transformers or f not in DENSE_HF)
    return chosen


def build_hf(family: str) -> tuple[nn.Module, tuple[int, int, int], dict[str, Any]]:
    """A transformers class's tiny model, wrapped to return logits, with its own sharpening
    (transformers' query/key names, Dinov2's LayerScale, Swin's relative-position tables)
    applied."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.fixtures import hf_models

    model, input_size = hf_models.build(family, seed=SEED)
    wrapped = hf_models.sharpen(hf_models.Logits(model))
    return wrapped, input_size, {"transformers": HF_CLASSES[family]}


def build_dense(family: str) -> tuple[nn.Module, tuple[int, ...], dict[str, Any]]:
    """A dense-output or video row's model (tests/fixtures/dense_models.py), sharpened as the
    matrix sharpens timm models, and the transformers ones by transformers' names too."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.fixtures import dense_models, hf_models

    model, input_size = dense_models.build(family, seed=SEED)
    sharpen(model)
    if family in DENSE_HF:
        hf_models.sharpen(model)
    return model, input_size, {"fixture": f"tests/fixtures/dense_models.py:{family}"}


class CellTimeout(BaseException):  # noqa: N818 - not an Exception: nothing may swallow it
    """A cell ran past its time; a BaseException so the tool's own fallbacks cannot catch it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`CellTimeout` in the main thread after ``seconds`` (a real timer signal)."""

    def expire(signum: int, frame: Any) -> None:
        raise CellTimeout(f"timeout after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class AlreadyOneLine(Exception):  # noqa: N818 - carries a line already written, type included
    """An error recorded earlier, passed on as its line."""


def one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if isinstance(error, (*USER_ERRORS, AlreadyOneLine)):
        return text or type(error).__name__
    return f"{type(error).__name__}: {text}".rstrip(": ")


def seeded_input(input_size: tuple[int, int, int], batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, *input_size, generator=torch.Generator().manual_seed(SEED + 1))


def build_small(
    family: str, model_name: str
) -> tuple[nn.Module, tuple[int, int, int], dict[str, Any]]:
    """The model at the first small configuration that builds and runs, in eval mode."""
    failures = []
    for kwargs, side in FAMILY_TRIES.get(family, []) + GENERIC_TRIES:
        torch.manual_seed(SEED)
        try:
            model = timm.create_model(model_name, num_classes=NUM_CLASSES, **kwargs).eval()
            input_size = (3, side, side) if side else tuple(model.pretrained_cfg["input_size"])
            with torch.no_grad():
                model(seeded_input(input_size))
        except Exception as e:  # noqa: BLE001 - a configuration this model does not take
            failures.append(one_line(e))
            continue
        return model, input_size, kwargs
    raise RuntimeError(f"no configuration builds and runs: {failures[-1]}")


def sharpen(model: nn.Module) -> nn.Module:
    """Weights under which a position table matters (random weights give near-uniform attention,
    where even a wrongly ordered table changes the logits by ~1e-7 only): relative-position
    parameters from N(0, 1) (ConViT's positional projection and gates too), query/key projections
    x3, LayerScale 1."""
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 2)
            if (
                "rel_pos" in name
                or "relative_position" in name
                or "attention_biases" in name
                or "pos_bias" in name
                or name.endswith(("pos_proj.weight", "gating_param"))  # ConViT's GPSA
            ):
                param.copy_(torch.randn(param.shape, generator=generator))
            elif name.endswith("qkv.weight") and param.shape[0] % 3 == 0:
                param[: 2 * param.shape[0] // 3] *= 3.0  # the q and k rows of a fused projection
            elif name.endswith(
                ("q_proj.weight", "k_proj.weight", ".q.weight", ".k.weight", ".qk.weight")
            ):
                param *= 3.0
            elif name.endswith("kv.weight") and param.shape[0] % 2 == 0:
                param[: param.shape[0] // 2] *= 3.0  # the k rows of a fused k/v projection
            elif leaf[-1] in ("gamma", "gamma_1", "gamma_2", "gamma1", "gamma2") or (
                len(leaf) > 1 and leaf[-2].startswith("ls") and leaf[-1] == "gamma"
            ):
                param.fill_(1.0)
    return model.eval()


# ---------------------------------------------------------------------------------------------
# One row


def _logits(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the model returns {type(output).__name__}, not logits")


def _outputs(output: Any) -> list[torch.Tensor]:
    """Every tensor of a dense output: the tensor itself, or those of a tuple, list or dict (a
    transformers ModelOutput is a dict)."""
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, dict) else output
    tensors = [t for t in values if isinstance(t, torch.Tensor)]
    if not isinstance(output, (tuple, list, dict)) or not tensors:
        raise TypeError(f"the model returns {type(output).__name__}, not tensors")
    return tensors


def _shapes(tensors: list[torch.Tensor]) -> list[list[int]]:
    return [list(t.shape) for t in tensors]


def _check_shapes(tensors: list[torch.Tensor], base: list[torch.Tensor], keep: float) -> None:
    if _shapes(tensors) != _shapes(base):
        shapes, base_shapes = _shapes(tensors), _shapes(base)
        raise ValueError(f"keep {keep:g} gives outputs of shape {shapes}, the base {base_shapes}")


def _dense_max_diff(tensors: list[torch.Tensor], base: list[torch.Tensor]) -> float:
    _check_shapes(tensors, base, 1.0)
    return max(_max_diff(t, b) for t, b in zip(tensors, base, strict=True))


def _token_vectors(t: torch.Tensor) -> torch.Tensor:
    """One row per token: (B, N, D) tokens by their last axis; a channels-first map (B, C, H, W)
    or (B, C, T, H, W) by its channel axis, one row per pixel; a (B, D) output per sample."""
    if t.dim() >= 4:
        t = t.movedim(1, -1)
    return t.float().reshape(-1, t.shape[-1])


def _dense_output(model: nn.Module, x: torch.Tensor, base: list[torch.Tensor]) -> dict[str, Any]:
    """The reduced model's output against the base's: its shapes (an error unless they are the
    base's) and the median (and lowest) cosine between each token's vector and the base's."""
    with torch.no_grad():
        tensors = _outputs(model.eval()(x))
    _check_shapes(tensors, base, REDUCED_KEEP)
    cosines = torch.cat(
        [
            nn.functional.cosine_similarity(_token_vectors(t), _token_vectors(b), dim=-1)
            for t, b in zip(tensors, base, strict=True)
        ]
    )
    return {
        "output_shape": _shapes(tensors),
        "token_cosine": round(float(cosines.median()), 4),
        "token_cosine_min": round(float(cosines.min()), 4),
    }


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def _train_step(model: nn.Module, x: torch.Tensor, dense: bool = False) -> dict[str, Any]:
    """One step of the variant's training path: train-mode forward, cross-entropy (a dense
    output: the mean of its squares), backward."""
    model.train()
    if dense:
        tensors = _outputs(model(x))
        loss = sum(t.float().pow(2).mean() for t in tensors) / len(tensors)
    else:
        logits = _logits(model(x))
        labels = torch.arange(x.shape[0]) % logits.shape[-1]
        loss = nn.functional.cross_entropy(logits.float(), labels)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    with_grad = [g for g in grads if g is not None]
    finite = math.isfinite(float(loss.detach())) and all(
        bool(torch.isfinite(g).all()) for g in with_grad
    )
    model.eval()
    return {
        "ok": finite and bool(with_grad),
        "loss": float(loss.detach()),
        "params_with_grad": f"{len(with_grad)}/{len(grads)}",
    }


def variant_cell(
    model: nn.Module,
    input_size: tuple[int, int, int],
    variant: str,
    base_logits: torch.Tensor | list[torch.Tensor],
    base_macs: int | str,
    x: torch.Tensor,
    dense: bool = False,
    cost: Any = None,
) -> dict[str, Any]:
    """Every column of one variant; the first refusal ends the cell, a raw error only its step.
    ``base_macs`` is the base's MAC count, or the line saying why it could not be counted.
    ``cost``: the search's cost model of the base (``vitcompress.search.cost.profile``), whose
    analytic MACs of the plan must agree with the counted ones within 1% (``None``: not searched,
    as windowed models are not).
    ``dense``: ``base_logits`` is the list of the base's output tensors (``_outputs``), and the
    whole outputs are compared: keep 1 on every tensor, keep 0.7 on shape and token cosine."""
    cell: dict[str, Any] = {"status": None, "line": None}
    errors: list[str] = []

    def compressed(keep: float) -> nn.Module | None:
        try:
            return vitcompress.compress(model, variant, keep=keep, input_size=input_size)
        except RewrittenModelError as e:  # the rewrite's bug as much as the model's: an error
            errors.append(f"compress keep {keep:g}: {one_line(e)}")
        except USER_ERRORS as e:
            cell.update(status="refused", line=one_line(e))
        except Exception as e:  # noqa: BLE001 - a raw error is a bug: recorded, never hidden
            errors.append(f"compress keep {keep:g}: {one_line(e)}")
        return None

    same = compressed(1.0)
    if cell["status"] == "refused":
        return cell
    if same is not None:
        try:
            with torch.no_grad():
                if dense:
                    diff = _dense_max_diff(_outputs(same.eval()(x)), base_logits)
                    scale = max(float(b.abs().max()) for b in base_logits)
                else:
                    diff = _max_diff(_logits(same.eval()(x)), base_logits)
                    scale = float(base_logits.abs().max())
            # Relative: some heads are initialised near zero (BEiT's logits are ~1e-4 here).
            relative = diff / max(scale, 1e-30)
            cell.update(
                keep1_max_diff=diff, keep1_relative_diff=relative, exact=relative <= EXACT_TOLERANCE
            )
        except Exception as e:  # noqa: BLE001
            errors.append(f"keep 1 forward: {one_line(e)}")
        del same
    reduced = compressed(REDUCED_KEEP)
    if cell["status"] == "refused":
        return cell
    if reduced is not None:
        if dense:
            try:
                cell.update(_dense_output(reduced, x, base_logits))
            except Exception as e:  # noqa: BLE001
                errors.append(f"output: {one_line(e)}")
        counted: dict[str, int] = {}

        def gmac_ratio() -> float:
            counted["macs"] = count_macs(reduced, input_size)
            return _ratio(counted["macs"], base_macs)

        steps = (
            ("gmac_ratio", gmac_ratio),
            ("analytic_error", lambda: _analytic_error(cost, reduced, counted.get("macs"))),
            ("train", lambda: _train_step(reduced, x, dense=dense)),
            ("onnx", lambda: _onnx(reduced, input_size, base=model)),
        )
        for key, step in steps:
            try:
                cell[key] = step()
            except Exception as e:  # noqa: BLE001
                errors.append(f"{key}: {one_line(e)}")
        if isinstance(cell.get("train"), dict) and not cell["train"]["ok"]:
            errors.append(f"train: loss {cell['train']['loss']} or its gradients not finite")
        if isinstance(cell.get("onnx"), dict) and cell["onnx"]["ok"] is False:
            errors.append(f"onnx: {cell['onnx']['line']}")
        if isinstance(cell.get("gmac_ratio"), float) and not cell["gmac_ratio"] < 1.0:
            errors.append(
                f"gmac_ratio: keep {REDUCED_KEEP} does not cut MACs ({cell['gmac_ratio']})"
            )
    if cell.get("exact") is False:
        cell.update(
            status="wrong",
            line=f"keep 1 changes the {'output' if dense else 'logits'} by "
            f"{cell['keep1_relative_diff']:.2g} of their scale with no error",
        )
    elif errors:
        cell.update(status="error", line=errors[0])
    else:
        cell["status"] = "ok"
    if errors:
        cell["errors"] = errors
    return cell


def _analytic_error(cost: Any, model: nn.Module, counted: int | None) -> float | None:
    """The relative error of the search's analytic MACs for ``model``'s plan against the counted
    ones; ``None`` where the search does not cover the model or the method."""
    info = compression_info(model)
    if cost is None or counted is None or info is None or not info.plan.method.searchable:
        return None
    return round(relative_error(cost.macs(info.plan), counted), 6)


def _ratio(macs: int, base_macs: int | str) -> float:
    if isinstance(base_macs, str):
        raise AlreadyOneLine(base_macs)
    return round(macs / base_macs, 4)


def _onnx(
    model: nn.Module, input_size: tuple[int, int, int], base: nn.Module | None = None
) -> dict[str, Any]:
    """The compressed model's ONNX export. Where it fails and the uncompressed ``base`` fails to
    export too, the failure is the model family's, not the compression's: ``ok`` is None."""
    with tempfile.TemporaryDirectory() as directory:
        try:
            result = export_model(model, input_size, "onnx", Path(directory) / "model.onnx")
        except Exception as e:  # noqa: BLE001 - export failures are this column's result
            line = one_line(e)
            if base is not None:
                try:
                    export_model(base, input_size, "onnx", Path(directory) / "base.onnx")
                except Exception as base_error:  # noqa: BLE001
                    return {"ok": None, "line": f"the base model does not export either: "
                            f"{one_line(base_error)}"}  # fmt: skip
            return {"ok": False, "line": line}
    return {"ok": True, "max_abs_diff": result["max_abs_diff"]}


def matrix_row(
    family: str,
    model_name: str,
    cell_seconds: float = CELL_SECONDS,
    variants: tuple[str, ...] = VARIANTS,
) -> dict[str, Any]:
    """One family's row: build small, sharpen, map, then each variant's cell within
    ``cell_seconds``."""
    row: dict[str, Any] = {"family": family, "model": model_name}
    start = time.monotonic()
    try:
        with time_limit(BUILD_SECONDS):
            if family in HF_CLASSES:
                model, input_size, kwargs = build_hf(family)
            elif family in DENSE:
                model, input_size, kwargs = build_dense(family)
            else:
                model, input_size, kwargs = build_small(family, model_name)
                sharpen(model)
            x = seeded_input(input_size)
            with torch.no_grad():
                output = model(x)
            base_logits = _outputs(output) if family in DENSE else _logits(output)
    except CellTimeout as e:
        row["build"] = {"status": "timeout", "line": str(e)}
        return _finish(row, variants, "timeout", str(e), start)
    except Exception as e:  # noqa: BLE001
        row["build"] = {"status": "error", "line": one_line(e)}
        return _finish(row, variants, "error", f"build: {one_line(e)}", start)
    row["build"] = {
        "status": "ok",
        "kwargs": {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()},
        "input_size": list(input_size),
        "params": sum(p.numel() for p in model.parameters()),
    }
    if family in DENSE:
        row["build"]["output_shape"] = _shapes(base_logits)
    try:
        with time_limit(cell_seconds):
            typed_map = vitcompress.map_model(model, input_size)
            model_map = typed_map.to_json()
    except CellTimeout as e:
        row["maps"] = {"status": "timeout", "line": str(e)}
        return _finish(row, variants, "timeout", str(e), start)
    except USER_ERRORS as e:
        row["maps"] = {"status": "refused", "line": one_line(e)}
        return _finish(row, variants, "refused", one_line(e), start)
    except Exception as e:  # noqa: BLE001
        row["maps"] = {"status": "error", "line": one_line(e)}
        return _finish(row, variants, "error", f"map: {one_line(e)}", start)
    row["maps"] = {
        "status": "ok",
        "capture": model_map["capture"],
        "blocks": len(model_map["blocks"]),
        "stages": len(model_map["stages"]),
        "prefix_tokens": model_map["prefix_tokens"],
    }
    # The base's MACs apart from the map: a failure there is the MAC column's, not the map's.
    try:
        with time_limit(cell_seconds):
            base_macs: int | str = count_macs(model, input_size)
        row["maps"]["base_macs"] = base_macs
    except CellTimeout as e:
        base_macs = f"base MACs: {e}"
    except Exception as e:  # noqa: BLE001
        base_macs = f"base MACs: {one_line(e)}"
    cost = None  # the search's cost model, where the search covers the model
    if not any(block.windows is not None for block in typed_map.blocks):
        try:
            with time_limit(cell_seconds):
                cost = profile(model, typed_map)
        except Exception as e:  # noqa: BLE001 - the cells then say nothing of it
            row["maps"]["cost_model"] = one_line(e)
    row["variants"] = {}
    for variant in variants:
        try:
            with time_limit(cell_seconds):
                row["variants"][variant] = variant_cell(
                    model,
                    input_size,
                    variant,
                    base_logits,
                    base_macs,
                    x,
                    dense=family in DENSE,
                    cost=cost,
                )
        except CellTimeout as e:
            row["variants"][variant] = {"status": "timeout", "line": str(e)}
    row["seconds"] = round(time.monotonic() - start, 1)
    return row


def _finish(
    row: dict[str, Any], variants: tuple[str, ...], status: str, line: str, start: float
) -> dict[str, Any]:
    row["variants"] = {v: {"status": status, "line": line} for v in variants}
    row["seconds"] = round(time.monotonic() - start, 1)
    return row


# ---------------------------------------------------------------------------------------------
# The whole matrix: each row in a child process


def run_row_process(family: str, model_name: str, cell_seconds: float) -> dict[str, Any]:
    """``matrix_row`` in a child process, bounded by the sum of its cells' limits."""
    limit = BUILD_SECONDS + cell_seconds * (len(VARIANTS) + 1) + 60
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--row",
        family,
        model_name,
        "--cell-seconds",
        str(cell_seconds),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, cwd=ROOT)
    except subprocess.TimeoutExpired:
        line = f"timeout: the row ran past {limit:g} s"
        return _finish({"family": family, "model": model_name}, VARIANTS, "timeout", line, 0.0)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = [line for line in done.stderr.splitlines() if line.strip()][-1:] or [""]
    line = f"the row's process exited with code {done.returncode}: {tail[0].strip()}"
    return _finish({"family": family, "model": model_name}, VARIANTS, "error", line, 0.0)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    statuses = {
        row["family"]: {v: row["variants"][v]["status"] for v in VARIANTS}
        for row in rows
        if row.get("model")
    }
    all_ok = [f for f, s in statuses.items() if set(s.values()) == {"ok"}]
    some_ok = [f for f, s in statuses.items() if "ok" in s.values() and f not in all_ok]
    refused = {
        row["family"]: _refusal(row)
        for row in rows
        if row.get("model") and set(statuses[row["family"]].values()) == {"refused"}
    }
    failing = [
        {
            "family": row["family"],
            "model": row["model"],
            "variant": v,
            "status": cell["status"],
            "line": cell.get("line"),
        }
        for row in rows
        if row.get("model")
        for v, cell in row["variants"].items()
        if cell["status"] in ("error", "wrong", "timeout")
    ]
    by_reason: dict[str, list[str]] = {}
    for family, line in refused.items():
        by_reason.setdefault(refusal_reason(line), []).append(family)
    # The compressed models are right; the search's cost model of them is not: said apart.
    search_off: dict[str, float] = {}
    for row in rows:
        errors = [
            cell["analytic_error"]
            for cell in row.get("variants", {}).values()
            if isinstance(cell.get("analytic_error"), float)
        ]
        if errors and max(errors) > ANALYTIC_TOLERANCE:
            search_off[row["family"]] = max(errors)
    return {
        "search_macs_off": search_off,
        "families": len(statuses),
        "absent": [r["family"] for r in rows if not r.get("model")],
        "working_all_variants": all_ok,
        "working_some_variants": some_ok,
        "refused": refused,
        "refused_by_reason": by_reason,
        "failing": failing,
        "failing_families": sorted({f["family"] for f in failing}),
        "wrong_logits": sorted({f["family"] for f in failing if f["status"] == "wrong"}),
    }


def _refusal(row: dict[str, Any]) -> str:
    lines = [cell["line"] for cell in row["variants"].values() if cell.get("line")]
    return lines[0] if lines else ""


REASONS = [
    ("windowed attention", "windowed attention"),
    ("attention over its whole grid", "attention over its whole grid"),
    ("cross-covariance attention over channels", "cross-covariance attention over channels"),
    ("position table", "position table after the reduction"),
    ("reads the last stage's tokens by position", "head reads tokens by position"),
    ("parallel block", "parallel block"),
    ("no transformer block found", "no transformer block found"),
    ("class-attention", "class-attention blocks only"),
    ("does not run on input", "input size"),
    ("no 2-D patch grid", "no 2-D patch grid"),
    ("reach the next stage", "a stage's tokens leave it other than through its grid"),
    ("image-derived token sets", "two image-derived token sets (multi-branch)"),
]


def refusal_reason(line: str) -> str:
    for needle, reason in REASONS:
        if needle in line:
            return reason
    return line.split(":")[0][:60]


# ---------------------------------------------------------------------------------------------
# The document


def cell_text(cell: dict[str, Any]) -> str:
    status = cell["status"]
    if status == "ok":
        no_onnx = isinstance(cell.get("onnx"), dict) and cell["onnx"]["ok"] is None
        cosine = f" cos {cell['token_cosine']:.3f}" if "token_cosine" in cell else ""
        error = cell.get("analytic_error")
        search = (
            f" (search MACs {error:.1%} off)"
            if isinstance(error, float) and error > ANALYTIC_TOLERANCE
            else ""
        )
        return f"ok {cell['gmac_ratio']:.2f}{cosine}" + (" (no ONNX)" if no_onnx else "") + search
    if status == "wrong":
        return f"**WRONG** Δ{cell['keep1_relative_diff']:.0e}"
    if status == "error":
        step = (cell.get("line") or "").split(":")[0]
        return f"**error** ({step})"
    return status


def render_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    summary = meta["summary"]
    out = [
        "# Compatibility matrix",
        "",
        "Generated by `benchmarks/compat_matrix.py`; do not edit by hand. Command:",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
        f"Generated {meta['date']} with timm {meta['timm']}, torch {meta['torch']}, vitcompress "
        f"{meta['vitcompress']}, on {meta['machine']} ({meta['minutes']:.0f} min).",
        *[
            f"Rows {', '.join(m['families'])} regenerated {m['date']} with torch {m['torch']}: "
            f"`{m['command']}`."
            for m in meta.get("merged", [])
        ],
        "",
        "Every family is the smallest timm model of that family by a name rule (the size word, "
        "then the shortest name), built with random weights at a small size where the model "
        "takes one (`img_size=32, patch_size=4, depth=4, embed_dim=64, num_heads=2`, else "
        "`img_size=64`, else its default; the JSON records which), with weights sharpened so "
        "that a position table matters: relative-position tables from N(0, 1), query/key "
        "weights x3, LayerScale 1. The `hf_*` rows are HuggingFace transformers classes "
        "built from tiny configs (`tests/fixtures/hf_models.py`: 32x32 or 64x64 images, 4 "
        "blocks or CvT's 1+2+3; Swin and Swinv2 56x56, 2+2 blocks in windows of 7) and wrapped "
        "to return `.logits`, sharpened the same way by transformers' parameter names. Per "
        "variant:",
        "",
        f"- **ok r**: compresses at keep 1 with logits within {EXACT_TOLERANCE:g} of the base "
        "(relative to the largest base logit, eval mode, a seeded batch of 2), keep "
        f"{REDUCED_KEEP} has GMAC ratio r < 1 (`vitcompress.measure.count_macs`), one training "
        "step (train mode, cross-entropy, backward) gives a finite loss and finite gradients, "
        "and the ONNX export (`vitcompress.workflows.export.export_model`, checked with "
        "onnxruntime) matches PyTorch;",
        "- **(search MACs x% off)**: the compressed model is right, but `vitcompress search`'s "
        "analytic MACs of its keep-0.7 plan (`vitcompress.search.cost.profile`) are more than "
        f"{ANALYTIC_TOLERANCE:.0%} off the counted ones, so the search would rank it by a wrong "
        "cost (windowed models, which the search refuses, are not checked; rows regenerated "
        "before this check have no such note);",
        "- **(no ONNX)**: all of the above but ONNX, which fails for the uncompressed base "
        "model too (the family does not export; its line is below);",
        "- **refused**: the tool refuses in one line (the line is below);",
        "- **WRONG**: keep 1 changes the logits without an error (a silently wrong model);",
        "- **error (step)**: a raw error in that step, or a compressed model that fails on one "
        "example image when it is made (the tool refuses it, but the cause may be the rewrite's): "
        "a bug (listed below);",
        f"- **timeout**: the cell ran past {meta['cell_seconds']:g} s.",
        "",
        "## Summary",
        "",
        f"- Families in the matrix: {summary['families']}",
        f"- Working for all four variants: {len(summary['working_all_variants'])} "
        f"({', '.join(summary['working_all_variants']) or 'none'})",
        f"- Working for some variants: {len(summary['working_some_variants'])} "
        f"({', '.join(summary['working_some_variants']) or 'none'})",
        f"- Refused: {len(summary['refused'])}",
    ]
    for reason, families in sorted(summary["refused_by_reason"].items()):
        out.append(f"  - {reason}: {len(families)} ({', '.join(families)})")
    off = summary.get("search_macs_off", {})
    out.append(
        f"- Working, but the search's analytic MACs more than {ANALYTIC_TOLERANCE:.0%} off the "
        f"counted ones: {len(off)}"
        + (
            " (" + ", ".join(f"{family} {error:.1%}" for family, error in off.items()) + ")"
            if off
            else ""
        )
    )
    out.append(
        f"- Failing with a raw error, a wrong model or a timeout (bugs): "
        f"{len(summary['failing_families'])} "
        f"({', '.join(summary['failing_families']) or 'none'})"
    )
    if summary["wrong_logits"]:
        out.append(f"- **Wrong logits without an error**: {', '.join(summary['wrong_logits'])}")
    if summary["absent"]:
        out.append(f"- Not in this timm: {', '.join(summary['absent'])}")
    out += [
        "",
        "## Matrix",
        "",
        "| family | model | size | maps | " + " | ".join(VARIANTS) + " |",
        "|---|---|---|---|" + "---|" * len(VARIANTS),
    ]
    for row in rows:
        if not row.get("model") or row["family"] in DENSE:
            continue
        build = row.get("build", {})
        size = "x".join(map(str, build.get("input_size", [])[1:])) or "-"
        maps = _maps_text(row)
        cells = " | ".join(cell_text(row["variants"][v]) for v in VARIANTS)
        out.append(f"| {row['family']} | `{row['model']}` | {size} | {maps} | {cells} |")
    dense = [row for row in rows if row.get("model") and row["family"] in DENSE]
    if dense:
        out += [
            "",
            "## Dense outputs and video",
            "",
            "Models whose output is the token grid itself, so that a compressed model must give "
            "back every token in the base's order (`tests/fixtures/dense_models.py`, built and "
            "sharpened as above, width 64 and 4 blocks): a timm ViT without head or pooling, "
            "timm DINOv2's `forward_features`, transformers' `Dinov2Model` (`last_hidden_state`), "
            "the zoo's Segmenter (per-pixel logits, (B, classes, H, W)), and video token grids: "
            "an in-house Conv3d tubelet ViT returning its tokens, transformers' "
            "`VideoMAEModel` and `TimesformerModel` (`last_hidden_state`, input (T, C, H, W)); "
            "and transformers' SAM vision encoder (its neck's (B, 32, 8, 8) feature map, its "
            "weights drawn anew: transformers initialises it near zero). Here a cell compares "
            "whole outputs, not logits: keep 1 must match every output tensor within "
            f"{EXACT_TOLERANCE:g} of its scale; at keep {REDUCED_KEEP} the output must have the "
            "base's shape (else an error), and **ok r cos c** gives the GMAC ratio r and the "
            "median per-token cosine c to the base's output (per token over the feature axis; per "
            "pixel over the class axis for a (B, C, H, W) output; random weights, so only a "
            "rough sign of how much the reduction changes); the training step's loss is the mean "
            "of the output's squares; ONNX as above.",
            "",
            "| family | model | input | output | maps | " + " | ".join(VARIANTS) + " |",
            "|---|---|---|---|---|" + "---|" * len(VARIANTS),
        ]
        for row in dense:
            build = row.get("build", {})
            size = "x".join(map(str, build.get("input_size", []))) or "-"
            shape = ", ".join("x".join(map(str, s[1:])) for s in build.get("output_shape", []))
            cells = " | ".join(cell_text(row["variants"][v]) for v in VARIANTS)
            out.append(
                f"| {row['family']} | `{row['model']}` | {size} | {shape or '-'} | "
                f"{_maps_text(row)} | {cells} |"
            )
    out += ["", "## Refusals", "", "| family | line |", "|---|---|"]
    for family, line in summary["refused"].items():
        out.append(f"| {family} | {_md(line)} |")
    partial = [
        (row["family"], v, cell["line"])
        for row in rows
        if row.get("model")
        for v, cell in row["variants"].items()
        if cell["status"] == "refused" and row["family"] not in summary["refused"]
    ]
    if partial:
        out += [
            "",
            "Refused for some variants only:",
            "",
            "| family | variant | line |",
            "|---|---|---|",
        ]
        out += [f"| {f} | {v} | {_md(line)} |" for f, v, line in partial]
    no_onnx = [
        (row["family"], v, cell["onnx"]["line"])
        for row in rows
        if row.get("model")
        for v, cell in row["variants"].items()
        if isinstance(cell.get("onnx"), dict) and cell["onnx"]["ok"] is None
    ]
    if no_onnx:
        out += [
            "",
            "No ONNX export, because the uncompressed model does not export either:",
            "",
            "| family | variant | line |",
            "|---|---|---|",
        ]
        out += [f"| {f} | {v} | {_md(line)} |" for f, v, line in no_onnx]
    out += ["", "## Failures (bugs)", ""]
    if summary["failing"]:
        out += ["| family | model | variant | status | line |", "|---|---|---|---|---|"]
        out += [
            f"| {f['family']} | `{f['model']}` | {f['variant']} | {f['status']} | "
            f"{_md(f['line'] or '')} |"
            for f in summary["failing"]
        ]
    else:
        out.append("None.")
    out += [
        "",
        "Raw numbers (keep-1 differences, GMAC ratios, losses, ONNX differences, the "
        "configuration each model was built with): `benchmarks/results/compat_matrix.json`.",
        "",
    ]
    return "\n".join(out)


def merge_rows(
    path: Path, rows: list[dict[str, Any]], order: list[str], command: str
) -> dict[str, Any]:
    """The matrix in ``path`` with ``rows`` in place of their families' old rows (new families
    in the order of ``order``), its summary recomputed, and the run noted in ``meta.merged``."""
    matrix = json.loads(path.read_text())
    fresh = {row["family"]: row for row in rows}
    kept = [row for row in matrix["rows"] if row["family"] not in fresh]
    everything = kept + rows
    position = {family: i for i, family in enumerate(order)}
    everything.sort(key=lambda row: position.get(row["family"], len(position)))
    meta = matrix["meta"]
    meta["summary"] = summarise(everything)
    meta.setdefault("merged", []).append(
        {
            "families": [row["family"] for row in rows],
            "date": datetime.date.today().isoformat(),
            "command": command,
            "torch": torch.__version__,
            "timm": timm.__version__,
        }
    )
    return {"meta": meta, "rows": everything}


def _maps_text(row: dict[str, Any]) -> str:
    maps = row.get("maps", {}).get("status", row.get("build", {}).get("status", "-"))
    return f"ok ({row['maps']['blocks']} blocks)" if maps == "ok" else maps


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma list of families (default: all)")
    parser.add_argument("--cell-seconds", type=float, default=CELL_SECONDS)
    parser.add_argument(
        "--json", type=Path, help=f"default {JSON_OUT.relative_to(ROOT)} for a full run"
    )
    parser.add_argument(
        "--doc", type=Path, help=f"default {DOC_OUT.relative_to(ROOT)} for a full run"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help=f"with --families: put the rows run into {JSON_OUT.relative_to(ROOT)} and "
        f"{DOC_OUT.relative_to(ROOT)} in place of their old rows (the rest are kept)",
    )
    parser.add_argument("--list", action="store_true", help="print the families and models")
    parser.add_argument("--row", nargs=2, metavar=("FAMILY", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(matrix_row(*args.row, cell_seconds=args.cell_seconds)), flush=True)
        return 0
    chosen = family_models()
    if args.families:
        wanted = args.families.split(",")
        unknown = sorted(set(wanted) - {f for f, _ in chosen})
        if unknown:
            print(f"error: unknown families {', '.join(unknown)}", file=sys.stderr)
            return 2
        chosen = [(f, m) for f, m in chosen if f in wanted]
    if args.list:
        for family, model in chosen:
            print(f"{family:20} {model}")
        return 0
    full = not args.families
    json_out = args.json or (JSON_OUT if full else None)
    doc_out = args.doc or (DOC_OUT if full else None)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    for family, model in chosen:
        if model is None:
            rows.append({"family": family, "model": None})
            continue
        row = run_row_process(family, model, args.cell_seconds)
        rows.append(row)
        print(
            f"{family:20} {model:40} "
            + " ".join(f"{v}={row['variants'][v]['status']}" for v in VARIANTS)
            + f"  ({row.get('seconds', '?')} s)",
            file=sys.stderr,
            flush=True,
        )
    command = "nice -n 10 python " + " ".join(
        shlex.quote(a) for a in ["benchmarks/compat_matrix.py", *(argv or sys.argv[1:])]
    )
    if args.merge:
        if full:
            print("error: --merge needs --families", file=sys.stderr)
            return 2
        merged = merge_rows(JSON_OUT, rows, [f for f, _ in family_models()], command)
        JSON_OUT.write_text(json.dumps(merged, indent=1) + "\n")
        DOC_OUT.write_text(render_markdown(merged["rows"], merged["meta"]))
        print(json.dumps(merged["meta"]["summary"], indent=1), file=sys.stderr)
        return 0
    meta = {
        "command": "nice -n 10 python "
        + " ".join(
            shlex.quote(a) for a in ["benchmarks/compat_matrix.py", *(argv or sys.argv[1:])]
        ),
        "date": datetime.date.today().isoformat(),
        "timm": timm.__version__,
        "torch": torch.__version__,
        "vitcompress": vitcompress.__version__,
        "machine": f"{torch.get_num_threads()} CPU threads",
        "minutes": (time.monotonic() - started) / 60,
        "cell_seconds": args.cell_seconds,
        "summary": summarise(rows),
    }
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    if doc_out:
        doc_out.write_text(render_markdown(rows, meta))
    print(json.dumps(meta["summary"], indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
