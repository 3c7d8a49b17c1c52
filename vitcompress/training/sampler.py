"""Where a training run stands, a shuffle that a resumed run repeats exactly, and the run's
loaders built on it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from vitcompress.training.config import FinetuneConfig
from vitcompress.training.run_directory import FinetuneError


class EpochSampler(Sampler[int]):
    """A shuffle that depends only on (seed, epoch), so a resumed run sees the same order.

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
        return iter(torch.randperm(self.size, generator=generator).tolist())

    def __len__(self) -> int:
        return self.size


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
        train_set,
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
