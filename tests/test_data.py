"""The data pipeline: ImageFolder trees and Fashion-MNIST IDX files, transforms and errors."""

import gzip
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitcompress.data import AugmentConfig, DataError, build_dataset, num_classes
from vitcompress.data.datasets import DEBIAN_FASHION_MNIST
from vitcompress.data.transforms import build_transform


def write_image_folder(
    root: Path, classes=("cat", "dog"), per_class: int = 3, size: int = 40
) -> Path:
    """root/{train,val}/<class>/<i>.png with a distinct colour per class."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 60, (size, size, 3), dtype=np.uint8) + 120 * c
                Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.png")
    return root


def write_idx(
    folder: Path, prefix: str, images: np.ndarray, labels: np.ndarray, gz: bool = False
) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    image_bytes = struct.pack(">IIII", 0x803, *images.shape) + images.astype(np.uint8).tobytes()
    label_bytes = struct.pack(">II", 0x801, len(labels)) + labels.astype(np.uint8).tobytes()
    for name, raw in (
        (f"{prefix}-images-idx3-ubyte", image_bytes),
        (f"{prefix}-labels-idx1-ubyte", label_bytes),
    ):
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(raw))
        else:
            (folder / name).write_bytes(raw)


@pytest.fixture
def image_folder(tmp_path):
    return write_image_folder(tmp_path / "imgs")


@pytest.fixture
def idx_dir(tmp_path):
    rng = np.random.default_rng(1)
    folder = tmp_path / "fm"
    write_idx(folder, "train", rng.integers(0, 256, (5, 28, 28)), np.array([0, 1, 2, 3, 9]))
    write_idx(folder, "t10k", rng.integers(0, 256, (3, 28, 28)), np.array([7, 8, 9]), gz=True)
    return folder


@pytest.mark.parametrize("size", [(3, 32, 32), (3, 64, 64), (1, 28, 28)])
def test_image_folder_shapes_and_labels(image_folder, size):
    for split in ("train", "val"):
        ds = build_dataset(str(image_folder), split, size, augment=AugmentConfig.deit())
        assert ds.classes == ["cat", "dog"] and num_classes(ds) == 2 and len(ds) == 6
        labels = []
        for i in range(len(ds)):
            x, y = ds[i]
            assert x.shape == size and x.dtype == torch.float32 and isinstance(y, int)
            labels.append(y)
        assert labels == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("size", [(3, 32, 32), (3, 64, 64), (1, 28, 28)])
def test_fashion_mnist_from_data_dir(idx_dir, size):
    train = build_dataset("fashion-mnist", "train", size, data_dir=str(idx_dir))
    val = build_dataset("fashion-mnist", "val", size, data_dir=str(idx_dir))
    assert (len(train), len(val)) == (5, 3) and num_classes(train) == 10
    assert train.classes[9] == "Ankle boot"
    assert [train[i][1] for i in range(5)] == [0, 1, 2, 3, 9]
    assert [val[i][1] for i in range(3)] == [7, 8, 9]
    x, _ = val[0]
    assert x.shape == size and x.dtype == torch.float32
    if size[0] == 3:  # the gray channel is repeated for RGB models (then normalised per channel)
        mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
        raw = x * std[:, None, None] + mean[:, None, None]
        assert torch.allclose(raw[0], raw[1], atol=1e-5) and torch.allclose(
            raw[1], raw[2], atol=1e-5
        )


def test_val_is_the_exact_image_when_sizes_match(idx_dir):
    """28 -> 28 with crop_pct 1.0: no resize, no crop; only normalisation."""
    from vitcompress.data.datasets import read_idx

    pixels = read_idx(idx_dir / "t10k-images-idx3-ubyte.gz", ndim=3)[0]
    x, _ = build_dataset(
        "fashion-mnist", "val", (1, 28, 28), data_dir=str(idx_dir), mean=[0.0], std=[1.0]
    )[0]
    assert torch.allclose(x[0], torch.from_numpy(pixels.astype(np.float32) / 255), atol=1e-6)


def test_train_augment_is_random_and_val_deterministic(image_folder, idx_dir):
    torch.manual_seed(0)
    train = build_dataset(str(image_folder), "train", (3, 32, 32), augment=AugmentConfig.deit())
    val = build_dataset(str(image_folder), "val", (3, 32, 32), augment=AugmentConfig.deit())
    assert not torch.equal(train[0][0], train[0][0])
    assert torch.equal(val[0][0], val[0][0])
    light = build_dataset(
        "fashion-mnist", "train", (1, 32, 32), data_dir=str(idx_dir), augment=AugmentConfig.light()
    )
    assert not all(torch.equal(light[0][0], light[0][0]) for _ in range(5))
    # none(): the train split gets the evaluation transform
    off = build_dataset(
        "fashion-mnist", "train", (3, 32, 32), data_dir=str(idx_dir), augment=AugmentConfig.none()
    )
    assert torch.equal(off[1][0], off[1][0])


def test_deit_augment_survives_grayscale_models(idx_dir):
    """RandAugment, erasing and crops on 1-channel 28-px images, many draws."""
    torch.manual_seed(0)
    random.seed(0)  # timm's RandAugment draws from Python's generator
    ds = build_dataset(
        "fashion-mnist", "train", (1, 32, 32), data_dir=str(idx_dir), augment=AugmentConfig.deit()
    )
    for _ in range(10):
        for i in range(len(ds)):
            assert ds[i][0].shape == (1, 32, 32)


def test_presets():
    assert AugmentConfig.light().mixup_args(10) is None
    assert AugmentConfig.none().mixup_args(10) is None
    args = AugmentConfig.deit().mixup_args(10)
    assert args["mixup_alpha"] == 0.8 and args["cutmix_alpha"] == 1.0
    assert args["label_smoothing"] == 0.1 and args["num_classes"] == 10
    from timm.data import Mixup

    Mixup(**args)  # timm accepts the keyword set
    light = AugmentConfig.light()
    assert (light.rand_augment, light.random_erasing, light.crop_scale, light.hflip) == (
        None,
        0.0,
        (0.8, 1.0),
        0.5,
    )


def _error(**kwargs) -> str:
    with pytest.raises(DataError) as info:
        build_dataset(**{"split": "val", "input_size": (3, 32, 32), **kwargs})
    message = str(info.value)
    assert "\n" not in message
    return message


def test_image_folder_errors(tmp_path, image_folder):
    assert "does not exist" in _error(data=str(tmp_path / "nope"))
    (tmp_path / "only_train" / "train" / "a").mkdir(parents=True)
    message = _error(data=str(tmp_path / "only_train"))
    assert "no val/ folder" in message and "train/" in message
    (tmp_path / "empty" / "val").mkdir(parents=True)
    assert "no images in class folders" in _error(data=str(tmp_path / "empty"))
    (tmp_path / "noimg" / "val" / "a").mkdir(parents=True)
    assert "no images in class folders" in _error(data=str(tmp_path / "noimg"))
    (tmp_path / "file.txt").write_text("x")
    assert "is a file" in _error(data=str(tmp_path / "file.txt"))
    assert "unknown split" in _error(data=str(image_folder), split="test")
    assert "1- or 3-channel" in _error(data=str(image_folder), input_size=(4, 32, 32))
    assert "mean has 2 values" in _error(data=str(image_folder), mean=(0.5, 0.5))


def test_corrupt_image_names_the_file(image_folder):
    bad = image_folder / "val" / "cat" / "0.png"
    bad.write_bytes(b"not a png")
    ds = build_dataset(str(image_folder), "val", (3, 32, 32))
    with pytest.raises(DataError, match="0.png"):
        ds[0]


def test_idx_errors(tmp_path, idx_dir):
    def fm_error(folder, split="train"):
        return _error(data="fashion-mnist", split=split, data_dir=str(folder))

    assert "is not a folder" in fm_error(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    assert "train-images-idx3-ubyte (or train-images-idx3-ubyte.gz) missing" in fm_error(
        tmp_path / "empty"
    )
    images = idx_dir / "train-images-idx3-ubyte"
    raw = images.read_bytes()
    images.write_bytes(raw[:-10])
    assert "train-images-idx3-ubyte has" in fm_error(idx_dir) and "expected" in fm_error(idx_dir)
    images.write_bytes(struct.pack(">I", 0x801) + raw[4:])
    assert "magic number 0x00000801, expected 0x00000803" in fm_error(idx_dir)
    images.write_bytes(raw)
    (idx_dir / "train-labels-idx1-ubyte").write_bytes(struct.pack(">IIB", 0x801, 1, 0))
    assert "5 images but" in fm_error(idx_dir)
    (idx_dir / "t10k-images-idx3-ubyte.gz").write_bytes(b"garbage")
    assert "cannot read IDX file" in fm_error(idx_dir, split="val")


@pytest.mark.skipif(
    not (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte.gz").exists()
    and not (DEBIAN_FASHION_MNIST / "train-images-idx3-ubyte").exists(),
    reason="package dataset-fashion-mnist not installed",
)
def test_real_fashion_mnist_from_the_debian_package():
    train = build_dataset("fashion-mnist", "train", (3, 32, 32), data_dir=str(DEBIAN_FASHION_MNIST))
    val = build_dataset("fashion-mnist", "val", (3, 32, 32))  # found without --data-dir
    assert (len(train), len(val)) == (60000, 10000)
    assert num_classes(train) == num_classes(val) == 10
    assert sorted(set(val.targets.tolist())) == list(range(10))
    assert val[0][0].shape == (3, 32, 32)


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_strongest_posterize_gives_black_not_an_error(mode):
    """timm's RandAugment reaches 0 bits kept at magnitude 10, which Pillow >= 12 refuses;
    the training transform must answer it with TensorFlow's black image."""
    from timm.data.auto_augment import RandAugment

    transform = build_transform(
        (len(mode), 32, 32),
        True,
        AugmentConfig.deit(),
        mean=(0.5,) * len(mode),
        std=(0.5,) * len(mode),
    )
    rand_augment = next(t for t in transform.transforms if isinstance(t, RandAugment))
    posterize = next(op for op in rand_augment.ops if op.name == "PosterizeIncreasing")
    posterize.prob, posterize.magnitude, posterize.magnitude_std = 1.0, 10, 0
    image = Image.fromarray(np.full((32, 32, len(mode)), 200, np.uint8).squeeze())
    assert posterize(image).getextrema() in ((0, 0), ((0, 0),) * 3)
    posterize.magnitude = 5  # 2 bits kept: 200 -> 192, as Pillow computes it
    assert posterize(image).getextrema() in ((192, 192), ((192, 192),) * 3)
