"""Datasets: an ImageNet-layout folder tree, or Fashion-MNIST read from its IDX files."""

from __future__ import annotations

import gzip
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from timm.data.constants import DEFAULT_CROP_PCT
from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder

from vitcompress.data.config import DEFAULTS_SOURCE, DataConfig, resolve_data_config
from vitcompress.data.segmentation import (
    FASHION_MNIST_SEG,
    FashionMnistSegmentation,
    is_segmentation_data,
)
from vitcompress.data.transforms import (
    AugmentConfig,
    DataError,
    build_transform,
    check_input_size,
)

FASHION_MNIST = "fashion-mnist"
FASHION_MNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]
# Where the Debian/Ubuntu package `dataset-fashion-mnist` installs the (gzipped) IDX files.
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
CACHE_DIR = Path("~/.cache/vitcompress").expanduser()
SPLITS = ("train", "val")
_IDX_PREFIX = {"train": "train", "val": "t10k"}  # Fashion-MNIST's test set is our val split
_IDX_UBYTE = 0x08  # element type code for unsigned bytes in the IDX header


def build_dataset(
    data: str,
    split: str,
    input_size: tuple[int, int, int],
    augment: AugmentConfig | None = None,
    data_dir: str | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    data_config: DataConfig | None = None,
) -> Dataset:
    """A dataset of ``(normalised float tensor (C, H, W), int label)`` with ``.classes``,
    ``.data_config``, the config its images are brought to the model with, and ``.augment``, the
    preset its train split is augmented with (batch-level mixup and smoothing are the trainer's).

    ``data`` is an ImageFolder tree with ``train/`` and ``val/`` or the word ``fashion-mnist``;
    ``fashion-mnist-seg`` is the generated segmentation set (``vitcompress.data.segmentation``:
    per-pixel labels (H, W) instead of an int, canvases at the input size, ``.task``).
    ``augment`` only applies to the train split; None means the data's default preset
    (``light()`` for Fashion-MNIST, ``deit()`` for folders). A preset with nothing random
    (``none()``) gives the train split the deterministic evaluation transform.
    ``data_config`` (from ``resolve_data_config``) sets normalisation, interpolation and crop;
    without it, ``mean``/``std`` (default ImageNet's) with bicubic. A config without a
    ``crop_pct`` gets the one the images' size calls for (see ``_crop_for``).
    """
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
    size = check_input_size(input_size)
    config = _config_for(size[0], mean, std, data_config)
    train = split == "train"
    if is_segmentation_data(data):
        return _segmentation_set(split, size, augment, data_dir, config)
    if data.strip().lower() in (FASHION_MNIST, "fashion_mnist", "fashionmnist"):
        augment = augment or AugmentConfig.light()
        images, labels = load_fashion_mnist(split, data_dir)
        if config.crop_pct is None:
            # Resized to any input size, a 28-px image has no border to spare.
            config = _uncropped(config, size, "Fashion-MNIST images are not cropped")
        dataset = IdxDataset(
            images,
            labels,
            FASHION_MNIST_CLASSES,
            _transform(size, train, augment, config),
            channels=size[0],
        )
        dataset.data_config = config
        dataset.augment = augment
        return dataset
    augment = augment or AugmentConfig.deit()
    dataset = _image_folder(data, split, size, train, augment, config)
    dataset.augment = augment
    return dataset


def model_dataset(
    model: torch.nn.Module,
    data: str,
    split: str,
    input_size: tuple[int, int, int],
    data_dir: str | None = None,
    overrides: dict | None = None,
) -> tuple[Dataset, DataConfig]:
    """``data``'s ``split`` without augmentation, brought to ``model`` as it expects its images
    (its own mean/std, resize and crop, ``overrides`` from ``data_overrides`` on top), and the
    config resolved for it."""
    config = resolve_data_config(model, input_size[0], overrides)
    dataset = build_dataset(
        data,
        split,
        input_size,
        augment=AugmentConfig.none(),
        data_dir=data_dir,
        data_config=config,
    )
    return dataset, config


def _config_for(
    channels: int,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
    data_config: DataConfig | None,
) -> DataConfig:
    if data_config is not None:
        if mean is not None or std is not None:
            raise ValueError("pass mean and std inside data_config, not beside it")
        return data_config.for_channels(channels)
    given = {
        name: tuple(float(v) for v in values)
        for name, values in (("mean", mean), ("std", std))
        if values is not None
    }
    sources = {name: "build_dataset argument" for name in given}
    return DataConfig(**given, sources=sources, explicit=frozenset(given)).for_channels(channels)


def _transform(
    size: tuple[int, int, int], train: bool, augment: AugmentConfig, config: DataConfig
) -> Callable[[Image.Image], torch.Tensor]:
    return build_transform(
        size,
        train,
        augment,
        config.mean,
        config.std,
        crop_pct=config.crop_pct,
        interpolation=config.interpolation,
        crop_mode=config.crop_mode,
    )


def _segmentation_set(
    split: str,
    size: tuple[int, int, int],
    augment: AugmentConfig | None,
    data_dir: str | None,
    config: DataConfig,
) -> Dataset:
    """The generated segmentation set at the input size, normalised by ``config``'s mean/std
    (there is nothing to resize or crop); of an augmentation preset only the flip applies."""
    augment = augment or replace(AugmentConfig.none(), hflip=0.5)
    images, labels = load_fashion_mnist(split, data_dir)
    config = config.with_field(
        "crop_pct", 1.0, f"{DEFAULTS_SOURCE}: {FASHION_MNIST_SEG} canvases are not cropped"
    )
    dataset = FashionMnistSegmentation(
        images,
        labels,
        FASHION_MNIST_CLASSES,
        split,
        size=size[1:],
        channels=size[0],
        mean=config.mean,
        std=config.std,
        hflip=augment.hflip if split == "train" else 0.0,
    )
    dataset.data_config = config
    dataset.augment = augment
    return dataset


def class_names(dataset: Dataset) -> list[str] | None:
    """The class names of a dataset from ``build_dataset`` (also through a ``Subset``), label
    order; None for a plain dataset without ``.classes``."""
    while not hasattr(dataset, "classes") and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    classes = getattr(dataset, "classes", None)
    return None if classes is None else [str(name) for name in classes]


def num_classes(dataset: Dataset) -> int:
    """Number of classes of a dataset from ``build_dataset`` (also through a ``Subset``)."""
    classes = class_names(dataset)
    if classes is None:
        raise DataError(f"{type(dataset).__name__} has no .classes: cannot tell its class count")
    return len(classes)


# ---------------------------------------------------------------------------------------------
# ImageFolder


def _image_folder(
    data: str,
    split: str,
    size: tuple[int, int, int],
    train: bool,
    augment: AugmentConfig,
    config: DataConfig,
) -> Dataset:
    root = Path(data).expanduser()
    expected = "expected an ImageNet-style folder with train/ and val/, or 'fashion-mnist'"
    if not root.exists():
        raise DataError(f"data folder {data} does not exist ({expected})")
    if not root.is_dir():
        raise DataError(f"data {data} is a file, not a folder ({expected})")
    split_dir = root / split
    if not split_dir.is_dir():
        found = sorted(p.name for p in root.iterdir() if p.is_dir())[:5]
        raise DataError(
            f"data folder {data} has no {split}/ folder ({expected}; "
            f"found {', '.join(found) + '/' if found else 'no subfolders'})"
        )
    mode = "RGB" if size[0] == 3 else "L"
    if config.crop_pct is None:
        config = _crop_for(split_dir, size, config)
    try:
        dataset = ImageFolder(
            str(split_dir),
            transform=_transform(size, train, augment, config),
            loader=_ImageLoader(mode),
        )
    except FileNotFoundError as e:
        # torchvision says "Couldn't find any class folder" or "Found no valid file".
        raise DataError(
            f"{split_dir}: no images in class folders ({expected}: "
            f"{split}/<class>/<image>; torchvision: {str(e).splitlines()[0]})"
        ) from e
    dataset.data_config = config
    return dataset


class _ImageLoader:
    """PIL loader into the model's mode; a file PIL cannot read is a DataError naming it.

    A class, not a closure, so DataLoader workers can pickle it.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __call__(self, path: str) -> Image.Image:
        try:
            with Image.open(path) as img:
                if img.mode in _WIDE_MODES:
                    _check_fits_8_bits(img, path)
                return img.convert(self.mode)
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
            raise DataError(f"cannot read image {path}: {e}") from e


# Integer and float pixels: PIL clips them to 0-255 on conversion, so a 16-bit image (values up
# to 65535) comes out nearly all white and a float one in [0, 1] nearly all black.
_WIDE_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N", "F")


def _check_fits_8_bits(img: Image.Image, path: str) -> None:
    """An image of ``_WIDE_MODES`` is converted only when that is exact: every value an integer
    in 0-255 (a 16-bit file holding 8-bit values); anything else would silently become another
    image, so it is refused."""
    low, high = img.getextrema()
    integral = img.mode != "F" or bool(np.all(np.mod(np.asarray(img), 1) == 0))
    if low < 0 or high > 255 or not integral:
        kind = "float" if img.mode == "F" else f"{img.mode} integer"
        raise DataError(
            f"image {path} has {kind} pixels from {low:g} to {high:g}, which 8-bit RGB/L "
            f"cannot hold exactly (PIL would clip them); convert the images to 8 bits first"
        )


def _crop_for(split_dir: Path, size: tuple[int, int, int], config: DataConfig) -> DataConfig:
    """The crop nobody stated, from the first readable image: images no larger than the input
    (CIFAR-sized folders) must not lose a border to the center crop that suits ImageNet photos,
    which get timm's default crop."""
    for class_dir in sorted(p for p in split_dir.iterdir() if p.is_dir()):
        for file in sorted(class_dir.iterdir()):
            try:
                with Image.open(file) as img:  # reads the header only
                    width, height = img.size
            except (UnidentifiedImageError, OSError):
                continue
            if width <= size[2] or height <= size[1]:
                return _uncropped(
                    config,
                    size,
                    f"images ({width}x{height}) no larger than the input are not cropped",
                )
            return config.with_field(
                "crop_pct",
                DEFAULT_CROP_PCT,
                f"{DEFAULTS_SOURCE}: timm's crop for images ({width}x"
                f"{height}) larger than the input",
            )
    return config  # no readable image; ImageFolder reports the folder


def _uncropped(config: DataConfig, size: tuple[int, int, int], why: str) -> DataConfig:
    """``config`` resizing the whole image to the input, ``why`` being the reason.

    crop_pct 1.0 does that for a square input. For an H != W input timm's center mode would
    scale the image to cover it and crop away the excess (half of a square image for a 32x64
    input), so center becomes squash: a plain resize to H x W, as the training split's random
    resized crop also stretches the image to the input's shape. A stated center counts as
    well (an ONNX file records the default crop mode along with what its model states): with
    no crop_pct stated, the crop is the images' to choose; border and squash keep the image
    whole already.
    """
    config = config.with_field("crop_pct", 1.0, f"{DEFAULTS_SOURCE}: {why}")
    if size[1] != size[2] and config.crop_mode == "center":
        config = config.with_field(
            "crop_mode", "squash", f"{DEFAULTS_SOURCE}: {why} (resized to the non-square input)"
        )
    return config


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST


class IdxDataset(Dataset):
    """Grayscale uint8 images held in memory (60000x28x28 is 47 MB) with their labels."""

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        classes: list[str],
        transform: Callable[[Image.Image], torch.Tensor],
        channels: int,
    ) -> None:
        self.images = images
        self.targets = labels.astype(np.int64)
        self.classes = list(classes)
        self.transform = transform
        self.channels = channels

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = Image.fromarray(self.images[index])  # uint8 (H, W): mode "L"
        if self.channels == 3:
            image = image.convert("RGB")  # repeat the gray channel for RGB models
        return self.transform(image), int(self.targets[index])


def load_fashion_mnist(split: str, data_dir: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (N, 28, 28), labels uint8 (N,)) of one split.

    From ``data_dir`` when given (nothing else is tried: the user said where), else from the
    Debian package's folder, else from torchvision's download into ~/.cache/vitcompress.
    """
    prefix = _IDX_PREFIX[split]
    if data_dir is not None:
        folder = Path(data_dir).expanduser()
        if not folder.is_dir():
            raise DataError(
                f"--data-dir {data_dir} is not a folder (expected the Fashion-MNIST "
                f"IDX files {prefix}-images-idx3-ubyte[.gz] and "
                f"{prefix}-labels-idx1-ubyte[.gz])"
            )
        return _read_split(folder, prefix)
    cached = CACHE_DIR / "FashionMNIST" / "raw"
    for folder in (DEBIAN_FASHION_MNIST, cached):
        if _find_idx(folder, f"{prefix}-images-idx3-ubyte") is not None:
            return _read_split(folder, prefix)
    _download(cached.parent.parent)
    return _read_split(cached, prefix)


def _download(root: Path) -> None:
    try:
        from torchvision.datasets import FashionMNIST

        for train in (True, False):
            FashionMNIST(str(root), train=train, download=True)
    except Exception as e:  # any network or filesystem failure means the same to the user
        raise DataError(
            f"Fashion-MNIST not found in {DEBIAN_FASHION_MNIST} or {root} and the download "
            f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); install "
            f"the package dataset-fashion-mnist or pass --data-dir with the IDX files"
        ) from e


def _read_split(folder: Path, prefix: str) -> tuple[np.ndarray, np.ndarray]:
    images_name, labels_name = f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"
    images_path, labels_path = _find_idx(folder, images_name), _find_idx(folder, labels_name)
    for name, path in ((images_name, images_path), (labels_name, labels_path)):
        if path is None:
            raise DataError(f"Fashion-MNIST file {name} (or {name}.gz) missing in {folder}")
    images = read_idx(images_path, ndim=3)  # type: ignore[arg-type]
    labels = read_idx(labels_path, ndim=1)  # type: ignore[arg-type]
    if len(images) != len(labels):
        raise DataError(
            f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels"
        )
    if labels.size and int(labels.max()) >= len(FASHION_MNIST_CLASSES):
        raise DataError(
            f"{labels_path}: label {int(labels.max())} is not a Fashion-MNIST class "
            f"(expected 0-{len(FASHION_MNIST_CLASSES) - 1})"
        )
    return images, labels


def _find_idx(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def read_idx(path: str | os.PathLike, ndim: int) -> np.ndarray:
    """An IDX file of unsigned bytes (plain or gzipped) with ``ndim`` dimensions, validated."""
    path = Path(path)
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # includes gzip.BadGzipFile and truncated archives
        raise DataError(f"cannot read IDX file {path}: {e}") from e
    # Header: two zero bytes, the element type, the number of dimensions, then each size as a
    # big-endian uint32 (http://yann.lecun.com/exdb/mnist/).
    if len(raw) < 4:
        raise DataError(f"IDX file {path} is truncated ({len(raw)} bytes)")
    zero, dtype, dims = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype != _IDX_UBYTE or dims != ndim:
        raise DataError(
            f"IDX file {path} has magic number 0x{struct.unpack('>I', raw[:4])[0]:08x}"
            f", expected 0x{0x800 + ndim:08x} (unsigned bytes, {ndim} dimensions)"
        )
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"IDX file {path} is truncated (header incomplete)")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = int(np.prod(shape)) + header
    if len(raw) != expected:
        raise DataError(
            f"IDX file {path} has {len(raw)} bytes, expected {expected} for shape "
            f"{'x'.join(map(str, shape))}"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)
