"""A HuggingFace save_pretrained directory as --model: weights that do not fit it exactly are
refused in one line (transformers' own load report is not shown), another weights file given
with --checkpoint is read as transformers reads the directory's own, and the evaluation
transform resizes and crops as the directory's image processor does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

pytest.importorskip("transformers")

from tests.fixtures import hf_models  # noqa: E402
from vitcompress.cli.main import cli  # noqa: E402
from vitcompress.data.config import resolve_data_config  # noqa: E402
from vitcompress.data.transforms import AugmentConfig, build_transform  # noqa: E402
from vitcompress.loading import ModelLoadError, load_base_model  # noqa: E402


def _save(tmp_path: Path, name: str, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    model, _ = hf_models.build("hf_vit", seed=seed)
    directory = tmp_path / name
    model.save_pretrained(directory)
    return directory, model


def _rewrite_weights(directory: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    weights = directory / "model.safetensors"
    state = edit(load_file(str(weights)))
    save_file(state, str(weights), metadata={"format": "pt"})


def _one_line_refusal(directory: Path, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        load_base_model(str(directory))
    result = CliRunner().invoke(cli, ["inspect", "--model", str(directory)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and match.split(" ")[0] in lines[0], result.output


def _layer_key(directory: Path, layer: int) -> str:
    """A weight of layer ``layer`` in the file's own layout, and the file's first layer's."""
    from safetensors.torch import load_file

    first = next(k for k in load_file(str(directory / "model.safetensors")) if ".0." in k)
    return first.replace(".0.", f".{layer}.", 1)


@pytest.mark.parametrize(
    "key",
    [
        "layer past the end",  # a config with fewer layers than its weights
        "parameter of a module the model has",  # a bias its config turned off
    ],
)
def test_weights_that_would_change_the_model_are_refused_naming_them(tmp_path, key):
    directory, model = _save(tmp_path, "extra")
    if key == "layer past the end":
        name = _layer_key(directory, model.config.num_hidden_layers)
    else:
        name = _layer_key(directory, 0).rsplit(".", 1)[0] + ".extra_bias"
    _rewrite_weights(directory, lambda state: {**state, name: torch.zeros(3)})
    # transformers would skip the key with a warning: the base would silently be another model.
    # Named as the model names it (transformers renames the file's layout).
    shown = r"\S*\.4\." if key == "layer past the end" else r"\S*\.extra_bias"
    _one_line_refusal(directory, rf"1 unexpected \({shown}")


def test_weights_of_a_part_the_model_does_not_build_load_with_a_warning(tmp_path):
    # Hub checkpoints of ViT carry a pooler that ViTForImageClassification does not build.
    directory, model = _save(tmp_path, "pooler")
    _rewrite_weights(directory, lambda state: {**state, "vit.pooler.dense.weight": torch.ones(3)})
    with pytest.warns(UserWarning, match=r"1 weights .* not used \(vit.pooler.dense.weight\)"):
        loaded = load_base_model(str(directory))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded.model(x), model(pixel_values=x).logits)


def test_weights_of_another_shape_are_refused_in_one_line_naming_the_shapes(tmp_path):
    directory, _ = _save(tmp_path, "other-labels")
    config = json.loads((directory / "config.json").read_text())
    config["id2label"] = {str(i): f"c{i}" for i in range(3)}
    config["label2id"] = {f"c{i}": i for i in range(3)}
    (directory / "config.json").write_text(json.dumps(config))
    _one_line_refusal(directory, r"classifier.weight \(checkpoint \[10, 64\] vs model \[3, 64\]\)")


def test_a_checkpoint_saved_by_save_pretrained_loads_as_the_directory_would(tmp_path):
    directory, _ = _save(tmp_path, "base", seed=0)
    other_dir, other = _save(tmp_path, "other", seed=1)
    loaded = load_base_model(str(directory), checkpoint=other_dir / "model.safetensors")
    assert loaded.source.checkpoint == str((other_dir / "model.safetensors").resolve())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded.model(x), other(pixel_values=x).logits)


def test_a_training_checkpoint_of_the_model_loads_unwrapped(tmp_path):
    directory, _ = _save(tmp_path, "base", seed=0)
    _, other = _save(tmp_path, "other", seed=1)
    path = tmp_path / "train.pth"
    state = {f"module.{k}": v for k, v in other.state_dict().items()}
    torch.save({"model": state, "epoch": 3}, path)
    loaded = load_base_model(str(directory), checkpoint=path)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded.model(x), other(pixel_values=x).logits)


def test_a_checkpoint_of_another_model_is_refused_naming_the_keys(tmp_path):
    directory, _ = _save(tmp_path, "base")
    path = tmp_path / "other.pth"
    torch.save({"blocks.0.weight": torch.zeros(2)}, path)
    with pytest.raises(ModelLoadError, match=r"other.pth do not fit .* missing or mismatched"):
        load_base_model(str(directory), checkpoint=path)


def _processor(name: str):
    import transformers as hf

    if name == "vit":  # resized to 224 x 224, aspect ratio not kept, no crop
        return hf.ViTImageProcessor()
    if name == "deit":  # resized to 256 x 256, centre 224 cropped
        return hf.DeiTImageProcessor()
    if name == "bit":  # shorter side to 256, centre 224 cropped (DINOv2's)
        return hf.BitImageProcessor(size={"shortest_edge": 256}, crop_size=224)
    return hf.ConvNextImageProcessor(size={"shortest_edge": 224}, crop_pct=0.875)  # CvT's


@pytest.mark.parametrize("name", ["vit", "deit", "bit", "convnext"])
def test_the_evaluation_transform_resizes_and_crops_as_the_image_processor(tmp_path, name):
    directory, _ = _save(tmp_path, name)
    processor = _processor(name)
    processor.save_pretrained(directory)
    rng = np.random.default_rng(0)
    # A smooth, wide image: where the two resize or crop differently, most pixels differ.
    small = rng.integers(0, 255, (30, 42, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((420, 300), Image.BICUBIC)
    expected = processor(image, return_tensors="pt")["pixel_values"][0]

    loaded = load_base_model(str(directory))
    config = resolve_data_config(loaded.model, 3)
    transform = build_transform(
        tuple(expected.shape),
        False,
        AugmentConfig(),
        config.mean,
        config.std,
        config.crop_pct,
        config.interpolation,
        config.crop_mode,
    )
    ours = transform(image)
    assert ours.shape == expected.shape
    # Both resize with PIL; only the rounding to 8 bits on the way may differ.
    assert float((ours - expected).abs().mean()) < 1e-3
