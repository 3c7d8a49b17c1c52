"""Export (ONNX, TorchScript, ExportedProgram) and ``torch.compile(fullgraph=True)`` of compressed
models: a compatibility matrix over families x variants x formats, and the ``export`` command.

``VITCOMPRESS_WRITE_MATRIX=1 pytest tests/test_export.py -m 'slow or not slow'`` rewrites the table in
docs/export.md from the results of a full run (the default run skips the slow families).
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import timm
import torch
from click.testing import CliRunner
from torch import nn

import vitcompress
import vitcompress.cli.export_command  # noqa: F401 - registers ``export`` on the group
import vitcompress.zoo  # noqa: F401 - registers pvt_* and cvt_*
from tests.fixtures import inhouse
from tests.models import SMALL, timm_small
from vitcompress.cli.app import cli
from vitcompress.loading import ModelSource
from vitcompress.workflows.export import (
    ATOL,
    FORMATS,
    SUFFIXES,
    ExportError,
    compile_check,
    export_model,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "export.md"
START, END = "<!-- matrix:start -->", "<!-- matrix:end -->"
BATCH = 2

FAMILIES: dict[str, tuple[Callable[[], nn.Module], tuple[int, int, int]]] = {
    "timm vit (32px, depth 4)": (lambda: timm_small("vit_small_patch16_224"), (3, 32, 32)),
    "in-house pyramid (64px)": (inhouse.tiny_pyramid, (3, 64, 64)),
    "timm deit distilled (32px, depth 4)": (
        lambda: timm_small("deit_tiny_distilled_patch16_224"),
        (3, 32, 32),
    ),
    "in-house nn.MultiheadAttention vit": (inhouse.mha_vit, (3, 32, 32)),
    "timm pvt_v2_b0 (64px)": (lambda: timm.create_model("pvt_v2_b0", num_classes=10), (3, 64, 64)),
    "zoo pvt_tiny (64px)": (
        lambda: timm.create_model("pvt_tiny", num_classes=10, img_size=64),
        (3, 64, 64),
    ),
    "zoo cvt_13 (64px)": (
        lambda: timm.create_model("cvt_13", num_classes=10, img_size=64),
        (3, 64, 64),
    ),
}
# The first two run in every test run; the rest complete the matrix with `pytest -m slow`.
FAST_FAMILIES = ("timm vit (32px, depth 4)", "in-house pyramid (64px)")
VARIANTS = ("dtps", "etps", "dynamicvit", "evit")
CHECKS = (*FORMATS, "compile")
# (family, variant, check) -> why it cannot work yet. Empty: every combination passes.
XFAIL: dict[tuple[str, str, str], str] = {}

RESULTS: dict[tuple[str, str, str], str] = {}


@functools.cache
def _compressed(family: str, variant: str) -> tuple[nn.Module, tuple[int, int, int]]:
    factory, size = FAMILIES[family]
    torch.manual_seed(0)
    return vitcompress.compress(factory(), variant, 0.7, None, size).eval(), size


def _cases() -> Iterator[pytest.param]:
    for family in FAMILIES:
        for variant in VARIANTS:
            for check in CHECKS:
                reason = XFAIL.get((family, variant, check))
                marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
                if family not in FAST_FAMILIES:
                    marks.append(pytest.mark.slow)
                key = family.split("(")[0].strip().replace(" ", "_")
                yield pytest.param(
                    family, variant, check, marks=marks, id=f"{key}-{variant}-{check}"
                )


@pytest.fixture(scope="module", autouse=True)
def _write_matrix() -> Iterator[None]:
    yield
    if os.environ.get("VITCOMPRESS_WRITE_MATRIX") != "1":
        return
    expected = len(FAMILIES) * len(VARIANTS) * len(CHECKS)
    if len(RESULTS) != expected:
        warnings.warn(f"matrix not written: {len(RESULTS)} of {expected} cases ran", stacklevel=1)
        return
    header = ["model", "variant", *CHECKS[:-1], "compile (fullgraph)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for family in FAMILIES:
        for variant in VARIANTS:
            cells = [RESULTS[family, variant, check] for check in CHECKS]
            lines.append("| " + " | ".join([family, variant, *cells]) + " |")
    import onnxruntime

    lines += [
        "",
        f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, batch "
        f"{BATCH}, keep 0.7 at the default locations; cells: max |diff| to PyTorch "
        f"(tolerance {ATOL:g}); compile: graphs compiled over two batches (backend "
        f"`eager`).",
    ]
    text = DOC.read_text()
    block = f"{START}\n" + "\n".join(lines) + f"\n{END}"
    DOC.write_text(
        re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    )


@pytest.mark.parametrize("family,variant,check", list(_cases()))
def test_matrix(family: str, variant: str, check: str, tmp_path: Path) -> None:
    model, size = _compressed(family, variant)
    key = (family, variant, check)
    try:
        if check == "compile":
            result = compile_check(model, size, BATCH)
            assert not result["graph_break"], result["reason"]
            assert result["recompiles"] == 0, f"{result['frames']} graphs for one input shape"
            assert result["max_abs_diff"] <= ATOL
            cell = f"pass ({result['frames']} graph, {result['recompiles']} recompiles)"
        else:
            result = export_model(
                model, size, check, tmp_path / f"model{SUFFIXES[check]}", batch_size=BATCH
            )
            assert result["checked"] and result["max_abs_diff"] <= ATOL
            assert result.get("static_shapes", True), "the ONNX graph has symbolic dimensions"
            cell = f"pass ({result['max_abs_diff']:.1e})"
    except Exception as e:
        RESULTS[key] = f"fails: {XFAIL.get(key) or str(e).splitlines()[0]}"
        raise
    RESULTS[key] = cell


def test_export_restores_each_module_mode(tmp_path: Path) -> None:
    model, size = _compressed("timm vit (32px, depth 4)", "etps")
    first, second = (model.get_submodule(f"blocks.{i}") for i in (0, 1))
    model.train()
    first.eval()
    try:
        export_model(model, size, "torchscript", tmp_path / "m.pt", batch_size=BATCH)
        assert model.training and not first.training and second.training
    finally:
        model.eval()


def test_export_rejects_directory_and_bad_batch(tmp_path: Path) -> None:
    model, size = _compressed("timm vit (32px, depth 4)", "etps")
    with pytest.raises(ExportError, match="is a directory"):
        export_model(model, size, "torchscript", tmp_path)
    with pytest.raises(ExportError, match="batch size"):
        export_model(model, size, "torchscript", tmp_path / "m.pt", batch_size=0)
    with pytest.raises(ExportError, match="unknown export format"):
        export_model(model, size, "tflite", tmp_path / "m.tflite")


def test_cli_exports_an_artifact(tmp_path: Path) -> None:
    model, size = _compressed("timm vit (32px, depth 4)", "dtps")
    artifact = tmp_path / "artifact"
    vitcompress.save(
        model,
        artifact,
        source=ModelSource(spec="vit_small_patch16_224", model_args=dict(SMALL)),
        input_size=size,
    )
    out = tmp_path / "sub" / "model.onnx"
    result = CliRunner().invoke(
        cli,
        [
            "export",
            "--model",
            str(artifact),
            "--format",
            "onnx",
            "--out",
            str(out),
            "--batch-size",
            "2",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert out.is_file() and data["input_shape"] == [2, *size] and data["batch"] == "fixed"
    assert data["static_shapes"] and data["max_abs_diff"] <= ATOL


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--model", "no_such_model_xyz", "--format", "torchscript", "--out", "{tmp}/m.pt"],
            "no_such_model_xyz",
        ),
        (
            ["--model", "{fixtures}:tiny_pyramid", "--format", "torchscript", "--out", "{tmp}"],
            "is a directory",
        ),
        # A suffix of another format: the file would be misnamed (and a user's replaced).
        (
            [
                "--model",
                "{fixtures}:tiny_pyramid",
                "--format",
                "torchscript",
                "--out",
                "{tmp}/m.onnx",
            ],
            "the suffix of onnx files but --format is torchscript: name it m.pt",
        ),
        (
            ["--model", "{fixtures}:tiny_pyramid", "--format", "onnx", "--out", "{tmp}/m.pt2"],
            "the suffix of exported-program files but --format is onnx: name it m.onnx",
        ),
    ],
)
def test_cli_user_errors_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    fixtures = Path(inhouse.__file__)
    args = [a.format(tmp=tmp_path, fixtures=fixtures) for a in args]
    result = CliRunner().invoke(cli, ["export", *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]
