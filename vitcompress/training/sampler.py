"""Where a training run stands, and a shuffle that a resumed run repeats exactly."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler


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
