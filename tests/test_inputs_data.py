"""The tensors a model is measured on: timm's own evaluation transform for every crop mode and
input shape, small images resized whole to a non-square input, and images 8-bit RGB cannot hold
refused instead of clipped."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.data import create_transform
from timm.data import resolve_data_config as timm_data_config
from torchvision.datasets import ImageFolder
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as tf

from vitcompress.data import AugmentConfig, DataConfig, DataError, build_dataset, model_dataset
from vitcompress.data.datasets import load_fashion_mnist
from vitcompress.loading.input_size import default_input_size


def _pixels(height: int, width: int, channels: int, seed: int) -> np.ndarray:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """val/ with photos larger and smaller than the inputs, wide and tall, in RGB, RGBA,
    grayscale, palette (with transparency) and JPEG."""
    root = tmp_path_factory.mktemp("images")
    for label, cls in enumerate(("a", "b")):
        d = root / "val" / cls
        d.mkdir(parents=True)
        seed = 10 * label
        Image.fromarray(_pixels(150, 200, 3, seed)).save(d / "0photo.png")
        Image.fromarray(_pixels(37, 90, 3, seed + 1)).save(d / "1wide.png")
        Image.fromarray(_pixels(90, 37, 3, seed + 2)).save(d / "2tall.png")
        Image.fromarray(_pixels(50, 60, 4, seed + 3)).save(d / "3rgba.png")
        Image.fromarray(_pixels(40, 40, 1, seed + 4)).save(d / "4gray.png")
        palette = Image.fromarray(_pixels(64, 64, 3, seed + 5)).convert("P")
        palette.save(d / "5palette.png", transparency=0)
        Image.fromarray(_pixels(90, 91, 3, seed + 6)).save(d / "6photo.jpg")
        Image.fromarray(_pixels(10, 10, 3, seed + 7)).save(d / "7tiny.png")
    return root


TIMM_CASES = {
    "center-0.9": dict(img_size=48),
    "non-square": dict(img_size=(32, 48)),
    "squash-1.0": dict(img_size=48, pretrained_cfg_overlay=dict(crop_mode="squash", crop_pct=1.0)),
    "squash-tall": dict(img_size=(48, 32), pretrained_cfg_overlay=dict(crop_mode="squash")),
    "border": dict(img_size=(32, 48), pretrained_cfg_overlay=dict(crop_mode="border")),
    "bilinear-1.0": dict(
        img_size=32,
        pretrained_cfg_overlay=dict(interpolation="bilinear", crop_pct=1.0, mean=(0.3,) * 3),
    ),
}


@pytest.mark.parametrize("kwargs", list(TIMM_CASES.values()), ids=list(TIMM_CASES))
def test_a_timm_model_gets_exactly_timms_own_evaluation_tensors(folder, kwargs):
    model = timm.create_model("vit_tiny_patch16_224", depth=1, num_classes=2, **kwargs)
    size = default_input_size(model)
    ours, _ = model_dataset(model, str(folder), "val", size)
    reference = ImageFolder(
        str(folder / "val"),
        transform=create_transform(**timm_data_config({"input_size": size}, model=model)),
        loader=lambda path: Image.open(path).convert("RGB"),
    )
    assert len(ours) == len(reference) == 16
    for index in range(len(reference)):
        (mine, label), (theirs, expected_label) = ours[index], reference[index]
        assert label == expected_label
        assert mine.shape == (3, *size[1:])
        assert torch.equal(mine, theirs), reference.samples[index][0]


def _plain_resize(image: Image.Image, height: int, width: int, mean: float, std: float):
    resized = tf.resize(image, [height, width], InterpolationMode.BICUBIC)
    return (tf.to_tensor(resized) - mean) / std


@pytest.mark.parametrize("size", [(1, 32, 64), (1, 64, 32), (1, 48, 48)])
def test_fashion_mnist_is_resized_whole_to_any_input_shape(size):
    dataset = build_dataset("fashion-mnist", "val", size)
    images, _ = load_fashion_mnist("val")
    mean, std = dataset.data_config.mean[0], dataset.data_config.std[0]
    for index in (0, 7):
        expected = _plain_resize(Image.fromarray(images[index]), *size[1:], mean, std)
        assert torch.allclose(dataset[index][0], expected, atol=1e-6)


def test_small_folder_images_are_resized_whole_to_a_non_square_input(tmp_path):
    d = tmp_path / "val" / "a"
    d.mkdir(parents=True)
    image = Image.fromarray(_pixels(20, 24, 3, 0))
    image.save(d / "x.png")
    dataset = build_dataset(
        str(tmp_path), "val", (3, 32, 64), augment=AugmentConfig.none(), data_config=DataConfig()
    )
    mean = torch.tensor(dataset.data_config.mean).view(3, 1, 1)
    std = torch.tensor(dataset.data_config.std).view(3, 1, 1)
    expected = _plain_resize(image, 32, 64, mean, std)
    assert torch.allclose(dataset[0][0], expected, atol=1e-6)
    # A stated center without a crop_pct is resized whole too; a stated border is kept.
    for stated, used in (("center", "squash"), ("border", "border")):
        config = DataConfig(crop_mode=stated, sources={"crop_mode": "the model"})
        built = build_dataset(str(tmp_path), "val", (3, 32, 64), data_config=config)
        assert built.data_config.crop_mode == used
        assert built.data_config.crop_pct == 1.0


def _one_image_folder(root: Path, image: Image.Image, name: str = "x.png") -> Path:
    d = root / "val" / "a"
    d.mkdir(parents=True)
    image.save(d / name)
    return d / name


@pytest.mark.parametrize(
    "image",
    [
        pytest.param(lambda: Image.fromarray(np.full((16, 16), 4000, np.uint16)), id="16-bit"),
        pytest.param(
            lambda: Image.fromarray(np.linspace(0, 1, 256, dtype=np.float32).reshape(16, 16)),
            id="float-0-1",
        ),
    ],
)
@pytest.mark.parametrize("channels", [1, 3])
def test_an_image_8_bits_cannot_hold_is_refused_not_clipped(tmp_path, image, channels):
    path = _one_image_folder(tmp_path, image(), "x.tif")
    dataset = build_dataset(str(tmp_path), "val", (channels, 16, 16), data_config=DataConfig())
    with pytest.raises(DataError, match="8 bits") as caught:
        dataset[0]
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_a_16_bit_image_of_8_bit_values_reads_as_its_8_bit_twin(tmp_path):
    values = _pixels(16, 16, 1, 3)
    _one_image_folder(tmp_path / "wide", Image.fromarray(values.astype(np.uint16)))
    _one_image_folder(tmp_path / "narrow", Image.fromarray(values))
    sets = [
        build_dataset(str(tmp_path / name), "val", (3, 16, 16), data_config=DataConfig())
        for name in ("wide", "narrow")
    ]
    assert torch.equal(sets[0][0][0], sets[1][0][0])


def test_an_image_too_large_for_pil_is_one_line(tmp_path, monkeypatch):
    path = _one_image_folder(tmp_path, Image.fromarray(_pixels(64, 64, 3, 0)))
    dataset = build_dataset(str(tmp_path), "val", (3, 16, 16), data_config=DataConfig())
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 64 * 64 // 4)  # a bomb above twice this
    with pytest.raises(DataError, match="cannot read image") as caught:
        dataset[0]
    assert str(path) in str(caught.value)
