"""Test-wide settings that make results independent of the environment and of test order."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

# rich reads these when the CLI's consoles are created (at import): colour codes or a narrow
# terminal would split the numbers the CLI tests look for.
os.environ.pop("FORCE_COLOR", None)
os.environ["COLUMNS"] = "200"


@pytest.fixture(autouse=True)
def _seed_every_generator() -> None:
    """Each test starts from the same state of all three generators (timm's augmentations draw
    from Python's, some data code from NumPy's), whichever tests ran before it."""
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Throughput timing warns on stderr when the machine is busy; how busy the test machine is
    must not change what the CLI prints. Tests of the warning set the load themselves."""
    monkeypatch.setattr("vitcompress.measure.throughput.load_average", lambda: 0.0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models: on a busy machine two threads spend their time waiting for each other. A
    module takes it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
