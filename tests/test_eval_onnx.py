"""``vitcompress eval --model FILE.onnx``: an exported file evaluated in onnxruntime counts what the
PyTorch model counts on the same images, agreement with a reference is the share of equal
argmaxes, and what cannot be evaluated is refused in one line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from vitcompress.cli.main import cli
from vitcompress.data import AugmentConfig, build_dataset
from vitcompress.data.config import DataConfig
from vitcompress.loading import load_base_model
from vitcompress.measure.onnx_eval import (
    PREPROCESSING_KEY,
    OnnxClassifier,
    preprocessing_props,
    read_onnx_facts,
)

# A tiny timm ViT (32 px, 4 px patches: 64 tokens) with its queries and keys scaled, so that
# attention is far from uniform and a token kept at the wrong place would change the logits; it
# states a preprocessing of its own, not the defaults, so a file read with another one shows it.
FACTORY = """
import timm
import torch


def make(seed=0, num_classes=2):
    torch.manual_seed(seed)
    model = timm.create_model(
        "vit_small_patch16_224", img_size=32, patch_size=4, num_classes=num_classes,
        embed_dim=32, depth=2, num_heads=2,
    )
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * 32] *= 3.0
        # Predictions that vary from image to image: the head reads the features' departure
        # from their mean over random coarse patterns (else one class wins everywhere).
        model.head.weight.normal_(std=1.0)
        cells = torch.rand(32, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
        images = cells.repeat_interleave(8, dim=2).repeat_interleave(8, dim=3) * 3 - 1.5
        features = model.forward_head(model.forward_features(images), pre_logits=True)
        model.head.bias.copy_(-model.head.weight @ features.mean(0))
    model.data_config = {"mean": [0.2, 0.3, 0.4], "std": [0.5, 0.4, 0.3],
                         "interpolation": "bilinear", "crop_pct": 0.8}
    return model
"""
STATED = {"mean": [0.2, 0.3, 0.4], "std": [0.5, 0.4, 0.3], "interpolation": "bilinear"}


def stated_images(work: Path) -> torch.Tensor:
    """The val images brought as the model states (what the tests record in the files)."""
    config = DataConfig(mean=(0.2, 0.3, 0.4), std=(0.5, 0.4, 0.3), interpolation="bilinear",
                        crop_pct=0.8)  # fmt: skip
    dataset = build_dataset(str(work / "imgs"), "val", (3, 32, 32), AugmentConfig.none(),
                            data_config=config)  # fmt: skip
    return torch.stack([dataset[i][0] for i in range(len(dataset))])


def pytorch_logits(work: Path, images: torch.Tensor) -> torch.Tensor:
    model = load_base_model(f"{work / 'tiny_vit.py'}:make").model.eval()
    with torch.no_grad():
        return model(images)


def write_noise_folder(root: Path, classes: int = 2, per_class: int = 7) -> None:
    """root/{train,val}/<class>/<i>.png of random coarse patterns (14 val images: short last batches):
    the random model's predicted class then varies from image to image, so that predictions
    taken out of order would show."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(classes):
            folder = root / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(per_class):
                cells = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)  # coarse: 10 px cells
                pixels = cells.repeat(10, axis=0).repeat(10, axis=1)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eval_onnx")
    (root / "tiny_vit.py").write_text(FACTORY)
    write_noise_folder(root / "imgs")
    return root


def spec(work: Path, *args: str) -> list[str]:
    return ["--model", f"{work / 'tiny_vit.py'}:make", *args]


def export(work: Path, name: str, *options: str, model: list[str] | None = None) -> Path:
    out = work / name
    result = run("export", *(model or spec(work)), "--format", "onnx", "--out", str(out), *options)
    assert result.exit_code == 0, result.output
    return out


def record(path: Path, fields: dict) -> None:
    model = onnx.load(str(path))
    onnx.helper.set_model_props(model, preprocessing_props(fields))
    onnx.save(model, str(path))


def strip_record(path: Path) -> None:
    """A file as written before export recorded preprocessing (or by another exporter)."""
    model = onnx.load(str(path))
    del model.metadata_props[:]
    onnx.save(model, str(path))


def eval_json(*args: str) -> dict:
    result = run("eval", *args, "--batch-size", "3", "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def pytorch_eval(work: Path, *model: str) -> dict:
    return eval_json(*(model or spec(work)), "--data", str(work / "imgs"), "--no-throughput")


# ---------------------------------------------------------------------------------------------
# The same numbers as PyTorch


def test_a_fixed_batch_file_scores_what_the_pytorch_model_scores(work):
    # Exported at batch 4, evaluated in batches of 3: chunks, and a padded last chunk.
    path = export(work, "fixed.onnx", "--batch-size", "4")
    data = ["--data", str(work / "imgs")]
    got = eval_json("--model", str(path), *data, "--reference", f"{work / 'tiny_vit.py'}:make")
    expected = pytorch_eval(work)
    assert got["images"] == expected["images"] == 14
    assert got["top1"] == expected["top1"] and got["top5"] == expected["top5"]
    assert got["data_config"] == expected["data_config"]  # the reference's, crop included
    assert got["data_config"]["crop_pct"] == 0.8
    assert got["reference"]["runtime"] == "pytorch"
    assert got["reference"]["top1"] == expected["top1"]
    assert got["agreement"] == 100.0 and got["reference"]["disagreements"] == 0
    # Image by image: 6 images are a chunk of 4 and a padded one of 2, in order.
    images = stated_images(work)[:6]
    got_logits = OnnxClassifier(read_onnx_facts(path))(images)
    assert torch.allclose(got_logits, pytorch_logits(work, images), atol=1e-4)


def test_the_preprocessing_recorded_in_the_file_is_the_one_used(work):
    path = export(work, "recorded.onnx", "--dynamic-batch")
    record(path, {**STATED, "crop_pct": 0.8, "crop_mode": "center"})
    got = eval_json("--model", str(path), "--data", str(work / "imgs"))
    assert got["file_batch"] is None
    assert got["data_config_sources"]["mean"].endswith(f"(metadata_props {PREPROCESSING_KEY})")
    expected = pytorch_eval(work)
    assert (got["top1"], got["top5"]) == (expected["top1"], expected["top5"])
    assert got["data_config"] == expected["data_config"]
    # The logits of each image are the PyTorch model's on the image brought the recorded way.
    images = stated_images(work)
    got_logits = OnnxClassifier(read_onnx_facts(path))(images)
    assert torch.allclose(got_logits, pytorch_logits(work, images), atol=1e-4)


def test_a_compressed_model_scores_in_onnx_what_its_artifact_scores(work):
    artifact = work / "evit"
    result = run("apply", *spec(work), "--variant", "evit", "--keep", "0.7", "--out",
                 str(artifact), "--no-throughput")  # fmt: skip
    assert result.exit_code == 0, result.output
    path = export(work, "evit.onnx", "--batch-size", "5", model=["--model", str(artifact)])
    data = ["--data", str(work / "imgs")]
    got = eval_json("--model", str(path), *data, "--reference", str(artifact))
    expected = pytorch_eval(work, "--model", str(artifact))
    assert (got["top1"], got["top5"]) == (expected["top1"], expected["top5"])
    assert got["agreement"] == 100.0


# ---------------------------------------------------------------------------------------------
# Agreement


def test_agreement_is_the_share_of_images_whose_argmax_is_the_references(work):
    ours = export(work, "seed0.onnx", "--dynamic-batch")
    theirs = export(work, "seed1.onnx", "--dynamic-batch",
                    model=spec(work, "--model-arg", "seed=1", "--model-arg", "num_classes=2"))  # fmt: skip
    for path in (ours, theirs):
        record(path, {**STATED, "crop_pct": 0.8})
    got = eval_json("--model", str(ours), "--data", str(work / "imgs"), "--reference", str(theirs))
    images = stated_images(work)
    predicted = [OnnxClassifier(read_onnx_facts(p))(images).argmax(-1) for p in (ours, theirs)]
    differ = int((predicted[0] != predicted[1]).sum())
    assert 0 < differ < 14  # the two models differ on some images, not all
    assert got["reference"]["runtime"] == "onnxruntime"
    assert got["reference"]["disagreements"] == differ
    assert got["agreement"] == pytest.approx(100.0 * (14 - differ) / 14)


# ---------------------------------------------------------------------------------------------
# Refusals: one line, exit 2


def refused(*args: str) -> str:
    result = run("eval", *args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    return lines[0]


def test_a_file_that_is_not_onnx_is_refused(work):
    fake = work / "notes.onnx"
    fake.write_text("these are not the weights you are looking for\n" * 20)
    line = refused("--model", str(fake), "--data", str(work / "imgs"))
    assert "is not an ONNX file" in line


def test_a_missing_file_is_refused(work):
    line = refused("--model", str(work / "absent.onnx"), "--data", str(work / "imgs"))
    assert "no such file" in line


def test_a_file_without_recorded_preprocessing_and_no_reference_is_refused(work):
    path = export(work, "bare.onnx", "--dynamic-batch")
    strip_record(path)
    line = refused("--model", str(path), "--data", str(work / "imgs"))
    assert "records no preprocessing" in line and "--reference" in line
    # The options that say it all stand in for the record.
    got = eval_json("--model", str(path), "--data", str(work / "imgs"), "--mean", "0.2,0.3,0.4",
                    "--std", "0.5,0.4,0.3", "--interpolation", "bilinear", "--crop-pct", "0.8")  # fmt: skip
    assert got["top1"] == pytorch_eval(work)["top1"]


def test_a_class_count_other_than_the_datas_is_refused(work):
    path = export(work, "three.onnx", model=spec(work, "--model-arg", "num_classes=3"))
    record(path, STATED)
    line = refused("--model", str(path), "--data", str(work / "imgs"))
    assert "predicts 3 classes but the data has 2" in line


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--base", "vit_tiny_patch16_224"], "use --reference"),
        (["--model-arg", "seed=1"], "drop --model-arg"),
        (["--max-acc-drop", "1"], "drop them"),
        (
            ["--runs", "3", "--compile"],
            "is scored, not timed (export --bench times it): drop --runs, --compile",
        ),
    ],
)
def test_options_an_onnx_file_has_no_use_for_are_refused(work, extra, expected):
    path = export(work, "opts.onnx", "--dynamic-batch")
    record(path, STATED)
    assert expected in refused("--model", str(path), "--data", str(work / "imgs"), *extra)


def test_reference_without_an_onnx_model_is_refused(work):
    line = refused(*spec(work), "--data", str(work / "imgs"), "--reference", "x.onnx")
    assert "--reference compares an ONNX --model" in line


# ---------------------------------------------------------------------------------------------
# An int8 file against its float32 file


def test_an_int8_file_is_scored_against_its_float32_file(work):
    fp32 = export(work, "q.fp32.onnx", "--batch-size", "4")
    int8 = export(work, "q.int8.onnx", "--batch-size", "4", "--quantize", "int8")
    options = ["--mean", "0.2,0.3,0.4", "--std", "0.5,0.4,0.3", "--interpolation", "bilinear",
               "--crop-pct", "0.8"]  # fmt: skip
    got = eval_json("--model", str(int8), "--data", str(work / "imgs"), "--reference", str(fp32),
                    *options)  # fmt: skip
    images = stated_images(work)
    predicted = [OnnxClassifier(read_onnx_facts(p))(images).argmax(-1) for p in (int8, fp32)]
    correct = torch.tensor([label for _, label in build_dataset(
        str(work / "imgs"), "val", (3, 32, 32), AugmentConfig.none(),
        data_config=DataConfig(mean=(0.2, 0.3, 0.4), std=(0.5, 0.4, 0.3),
                               interpolation="bilinear", crop_pct=0.8))])  # fmt: skip
    assert got["top1"] == pytest.approx(100.0 * float((predicted[0] == correct).float().mean()))
    assert got["reference"]["top1"] == pytest.approx(pytorch_eval(work)["top1"])
    differ = int((predicted[0] != predicted[1]).sum())
    assert got["reference"]["disagreements"] == differ
    # Both files take the preprocessing the options state; the reference the file's own.
    assert got["data_config_sources"]["mean"] == "--mean"
    assert got["reference"]["data_config"] == got["data_config"]


# ---------------------------------------------------------------------------------------------
# A half-precision file, and what padding a fixed batch's last chunk changes


def test_a_float16_file_is_fed_at_its_input_type(work):
    from vitcompress.workflows.export import HALF_RTOL

    path = export(work, "half.onnx", "--batch-size", "4", "--dtype", "float16")
    images = stated_images(work)
    classifier = OnnxClassifier(read_onnx_facts(path))
    assert classifier.input_type == "tensor(float16)"
    logits = classifier(images)  # 14 images: chunks of 4, the last one padded
    want = pytorch_logits(work, images)
    assert logits.dtype == torch.float32 and logits.shape == want.shape
    scale = max(1.0, float(want.abs().max()))
    assert float((logits - want).abs().max()) <= HALF_RTOL["float16"] * scale
    # Padding is exact at float16: each image alone (three zero images beside it) gives the same.
    alone = torch.cat([classifier(images[i : i + 1]) for i in range(len(images))])
    assert torch.equal(logits, alone)
    # The command: scored on the same images as the PyTorch model, same predictions.
    got = eval_json("--model", str(path), "--data", str(work / "imgs"),
                    "--reference", f"{work / 'tiny_vit.py'}:make")  # fmt: skip
    assert got["images"] == 14 and got["reference"]["runtime"] == "pytorch"
    assert got["reference"]["disagreements"] == int((logits.argmax(-1) != want.argmax(-1)).sum())


def test_padding_is_exact_for_float32_and_not_for_dynamic_int8(work):
    """docs/usage.md: a dynamic int8 file takes one activation scale for the whole batch, so the
    zero images padding a short chunk change its logits; a float32 file's do not."""
    fp32 = export(work, "pad.fp32.onnx", "--batch-size", "4")
    int8 = export(work, "pad.int8.onnx", "--batch-size", "4", "--quantize", "int8")
    images = stated_images(work)[:7]  # a chunk of 4, then 3 and one zero image
    moved = {}
    for name, path in (("fp32", fp32), ("int8", int8)):
        classifier = OnnxClassifier(read_onnx_facts(path))
        chunked = classifier(images)
        alone = torch.cat([classifier(images[i : i + 1]) for i in range(len(images))])
        moved[name] = float((chunked - alone).abs().max())
    assert moved["fp32"] == 0.0
    assert moved["int8"] > 0.0
