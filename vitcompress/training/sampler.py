"""Where a training run stands, a shuffle and augmentation that a resumed run repeats exactly,
and the run's loaders built on them."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from vitcompress.training.config import FinetuneConfig
from vitcompress.training.run_directory import FinetuneError


class EpochSampler(Sampler[int]):
    """A shuffle that depends only on (seed, epoch), so a resumed run sees the same order.

    It yields draws, ``epoch * size + index``, which ``SeededDraws`` turns back into the index
    and into the seed of that image's augmentation.

    The epoch is set with ``start_epoch`` rather than ``set_epoch`` on purpose: Accelerate calls
    ``set_epoch`` with its own iteration counter, which restarts at 0 after a resume.
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = seed
        self.epoch = 0

    def start_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        offset = self.epoch * self.size
        return iter((torch.randperm(self.size, generator=generator) + offset).tolist())

    def __len__(self) -> int:
        return self.size


class SeededDraws(Dataset):
    """The training set, each image's random augmentation seeded by (run seed, draw).

    Without it, augmentation draws from the process's RNGs, and Accelerate's loader fetches
    (and so augments) one batch ahead of the step: the RNG state a checkpoint saves is already
    past the next batch's draws, and a resumed run augments that batch differently. Seeded per
    draw, an image's augmentation depends neither on when it is fetched nor on the worker that
    fetches it, and the process's RNGs are left as they were (for dropout, mixup, Gumbel noise).
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.size = len(dataset)  # type: ignore[arg-type]
        self.seed = seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, draw: int) -> Any:
        seed = (self.seed * 1_000_003 + draw) % 2**63
        states = random.getstate(), np.random.get_state(), torch.get_rng_state()
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.default_generator.manual_seed(seed)  # the CPU's only: CUDA's is the step's
        try:
            return self.dataset[draw % self.size]
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.set_rng_state(states[2])


@dataclass
class TrainPosition:
    """A point between optimizer steps, as a checkpoint records it."""

    epoch: int = 0
    batches_done: int = 0  # batches of this process finished in ``epoch`` (at a step boundary)
    global_step: int = 0


def training_loaders(
    train_set: Dataset, val_set: Dataset | None, config: FinetuneConfig
) -> tuple[EpochSampler, DataLoader, DataLoader | None]:
    """The run's sampler, its training loader (whole batches only; refused in one line when the
    set is smaller than one batch) and the validation loader, if there is a validation set."""
    sampler = EpochSampler(len(train_set), config.seed)  # type: ignore[arg-type]
    train_loader = DataLoader(
        SeededDraws(train_set, config.seed),
        batch_size=config.batch_size,
        sampler=sampler,
        num_workers=config.num_workers,
        drop_last=True,
        generator=torch.Generator().manual_seed(config.seed),
    )
    if len(train_loader) == 0:
        raise FinetuneError(
            f"the training set ({len(train_set)} images) is smaller "  # type: ignore[arg-type]
            f"than one batch ({config.batch_size})"
        )
    val_loader = None
    if val_set is not None:
        val_loader = DataLoader(
            val_set, batch_size=config.batch_size, num_workers=config.num_workers
        )
    return sampler, train_loader, val_loader
