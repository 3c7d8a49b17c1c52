"""A Fashion-MNIST segmentation set, generated from the images on the fly (nothing is stored).

Each sample is a canvas (64x64 by default: the model's input size) holding 2 to 4 Fashion-MNIST
garments (28x28) at random integer offsets, which may overlap and may touch the border. Garments
are painted in order: a garment's pixel brighter than ``THRESHOLD`` replaces what is below it,
its fainter pixels leave it as it is. The label of a pixel is 0 for background and 1 + the
Fashion-MNIST class of the garment painted last on it (11 classes), so a pixel is labelled a
garment exactly where the canvas is brighter than ``THRESHOLD``.

A sample is a function of ``(seed, split, index)`` alone (NumPy's PCG64 seeded with those three
numbers): the same on every machine, in any order, with any number of workers. The train split
draws from Fashion-MNIST's 60,000 training images, the val split from its 10,000 test images.

The canvases are normalised with the model's data config like every other set; ``SEG_MEAN`` and
``SEG_STD`` are the canvases' own pixel statistics (the ``segmenter_*`` zoo models state them).
Augmentation: only a preset's horizontal flip applies (to the image and its labels together);
crops, RandAugment, erasing and mixup would have to move or mix the labels alongside.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from vitcompress.data.transforms import DataError

FASHION_MNIST_SEG = "fashion-mnist-seg"
_NAMES = (FASHION_MNIST_SEG, "fashion_mnist_seg", "fashionmnist-seg", "fashionmnist_seg")
CLASSIFICATION, SEGMENTATION = "classification", "segmentation"
TASKS = (CLASSIFICATION, SEGMENTATION)
BACKGROUND = "background"
CANVAS = 64  # the default canvas side
GARMENT = 28  # a Fashion-MNIST image's side
GARMENTS = (2, 4)  # fewest and most garments per canvas
THRESHOLD = 25  # of 255: a garment's pixel above it paints the canvas and the label
# Per-split sample counts (the set is generated, so any count is possible; these are the
# defaults of ``build_dataset``).
LENGTHS = {"train": 20_000, "val": 2_000}
_SPLIT_CODE = {"train": 0, "val": 1}
# Pixel statistics of the canvases in [0, 1] (the first 2,000 of the train split, seed 0).
SEG_MEAN = (0.1368,)
SEG_STD = (0.2836,)


def is_segmentation_data(data: str) -> bool:
    """``data`` names the generated segmentation set."""
    return data.strip().lower() in _NAMES


class FashionMnistSegmentation(Dataset):
    """``(image float (C, H, W), label long (H, W))`` pairs of one split, generated per index.

    ``images``/``labels``: the Fashion-MNIST split drawn from (uint8 (N, 28, 28), (N,));
    ``garment_classes``: its class names. ``size``: the canvas (H, W); ``channels``: 1, or 3
    (the gray canvas repeated). ``mean``/``std`` normalise the canvas (one value per channel).
    ``hflip``: the probability of a horizontal flip of image and labels (drawn from torch's
    generator; 0 for evaluation).
    """

    task = SEGMENTATION

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        garment_classes: Sequence[str],
        split: str,
        size: tuple[int, int] = (CANVAS, CANVAS),
        channels: int = 1,
        mean: Sequence[float] = SEG_MEAN,
        std: Sequence[float] = SEG_STD,
        seed: int = 0,
        length: int | None = None,
        hflip: float = 0.0,
    ) -> None:
        if split not in _SPLIT_CODE:
            raise DataError(f"unknown split {split!r}: expected one of {', '.join(_SPLIT_CODE)}")
        height, width = (int(v) for v in size)
        if min(height, width) < GARMENT:
            raise DataError(
                f"{FASHION_MNIST_SEG}: the canvas {height}x{width} is smaller than one "
                f"{GARMENT}x{GARMENT} garment (use an input size of at least {GARMENT})"
            )
        if len(images) == 0:
            raise DataError(f"{FASHION_MNIST_SEG}: no Fashion-MNIST images to draw from")
        self.images = images
        self.garment_labels = labels.astype(np.int64)
        self.classes = [BACKGROUND, *garment_classes]
        self.split = split
        self.size = (height, width)
        self.channels = channels
        self.mean = torch.tensor([float(v) for v in mean]).view(-1, 1, 1)
        self.std = torch.tensor([float(v) for v in std]).view(-1, 1, 1)
        if len(self.mean) != channels or len(self.std) != channels:
            raise DataError(
                f"{FASHION_MNIST_SEG}: mean/std have {len(self.mean)}/{len(self.std)} values "
                f"for {channels} channels"
            )
        self.seed = int(seed)
        self.length = LENGTHS[split] if length is None else int(length)
        self.hflip = float(hflip)

    def __len__(self) -> int:
        return self.length

    def layout(self, index: int) -> list[tuple[int, int, int]]:
        """The garments of sample ``index`` in painting order: (image index, top, left)."""
        if not 0 <= index < self.length:
            raise IndexError(f"sample {index} of a set of {self.length}")
        rng = np.random.default_rng([self.seed, _SPLIT_CODE[self.split], index])
        count = int(rng.integers(GARMENTS[0], GARMENTS[1] + 1))
        height, width = self.size
        return [
            (
                int(rng.integers(0, len(self.images))),
                int(rng.integers(0, height - GARMENT + 1)),
                int(rng.integers(0, width - GARMENT + 1)),
            )
            for _ in range(count)
        ]

    def canvas(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``index`` before normalisation: (canvas uint8 (H, W), labels int64 (H, W))."""
        canvas = np.zeros(self.size, dtype=np.uint8)
        target = np.zeros(self.size, dtype=np.int64)
        for image_index, top, left in self.layout(index):
            garment = self.images[image_index]
            painted = garment > THRESHOLD
            window = (slice(top, top + GARMENT), slice(left, left + GARMENT))
            canvas[window][painted] = garment[painted]
            target[window][painted] = 1 + int(self.garment_labels[image_index])
        return canvas, target

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        canvas, target = self.canvas(index)
        image = torch.from_numpy(canvas).float().div_(255).unsqueeze(0)
        label = torch.from_numpy(target)
        if self.hflip > 0 and float(torch.rand(())) < self.hflip:
            image, label = image.flip(-1), label.flip(-1)
        image = (image.expand(self.channels, -1, -1) - self.mean) / self.std
        return image, label


def dataset_task(dataset: Dataset) -> str:
    """``segmentation`` for a set of per-pixel labels, ``classification`` otherwise (also
    through a ``Subset``)."""
    while not hasattr(dataset, "task") and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    return getattr(dataset, "task", CLASSIFICATION)


def check_task(dataset: Dataset, task: str, data: str | None = None) -> None:
    """Refuse, in one line, a task the data cannot be scored on."""
    if task not in TASKS:
        raise DataError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")
    has = dataset_task(dataset)
    if has == task:
        return
    name = f"data {data}" if data else "the data"
    if task == SEGMENTATION:
        raise DataError(
            f"--task segmentation needs per-pixel labels, but {name} is a classification set "
            f"(one label per image); use --data {FASHION_MNIST_SEG}, or --task classification"
        )
    raise DataError(f"{name} is a segmentation set (per-pixel labels): pass --task segmentation")
