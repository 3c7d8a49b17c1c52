"""Two CPU processes under torchrun, as the multi-process fine-tuning tests run them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(target: list[str], timeout: float, processes: int = 2) -> str:
    """Run ``torchrun --standalone --nproc_per_node N TARGET...`` and return its stdout.

    torchrun sets RANK/WORLD_SIZE/MASTER_* and ACCELERATE_USE_CPU selects gloo, as `accelerate
    launch` does on GPUs (`accelerate launch --cpu` would need MPI for two ranks). --standalone:
    a local rendezvous on a free port, so concurrent runs cannot collide. A new session lets a
    timeout kill the workers with the launcher instead of leaving them behind. ``target``: a
    script and its arguments, or ``["-m", module, ...]``.
    """
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "ACCELERATE_USE_CPU": "true",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.Popen(
        [*command, "--nproc_per_node", str(processes), *target],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert proc.returncode == 0, stderr[-4000:]
    return stdout
