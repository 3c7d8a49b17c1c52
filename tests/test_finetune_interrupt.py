"""Interrupt safety: real SIGINT/SIGTERM sent to a real fine-tuning process at chosen points
(inside a forward, while loading a batch, inside evaluation) leave a checkpoint of the last
completed optimizer step, and a resumed run ends with bitwise the weights of an uninterrupted one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import vitcompress
from tests.test_finetune import _config, _data, _fresh_accelerate_state, _models  # noqa: F401
from vitcompress.training import interrupt
from vitcompress.training.checkpoint import find_latest, load_checkpoint
from vitcompress.training.interrupt import ForcedStop, StopSignals
from vitcompress.workflows.finetune import finetune

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "fixtures" / "finetune_driver.py"
SAVED = re.compile(r"step (\d+) saved in (\S+); continue with --resume")
_references: dict[tuple[int, int], dict[str, torch.Tensor]] = {}


def _uninterrupted(accum: int, epochs: int) -> dict[str, torch.Tensor]:
    """The weights of the same run without an interrupt (computed once per setting)."""
    key = (accum, epochs)
    if key not in _references:
        student, teacher = _models()
        finetune(
            student,
            teacher,
            _data(),
            _data(8),
            Path(os.environ["VITC_REF_DIR"]) / f"ref-{accum}-{epochs}",
            _config(accum=accum, epochs=epochs),
        )
        _references[key] = {k: v.detach().clone() for k, v in student.model.state_dict().items()}
    return _references[key]


@pytest.fixture(autouse=True)
def _reference_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("VITC_REF_DIR", str(tmp_path_factory.getbasetemp() / "references"))


def _start(tmp_path: Path, point: str, at: int, accum: int = 1, epochs: int = 2):
    gates = tmp_path / "gates"
    gates.mkdir()
    # The same thread count as this process, so its arithmetic matches the reference run's.
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            str(DRIVER),
            str(tmp_path / "run"),
            str(gates),
            point,
            str(at),
            "--accum",
            str(accum),
            "--epochs",
            str(epochs),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, gates


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 180) -> None:
    # Generous: a loaded 2-core machine took over 60 s to import and build before its first gate.
    deadline = time.monotonic() + seconds
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before {path.name}: {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {path.name} after {seconds} s")
        time.sleep(0.02)


def _finish(proc: subprocess.Popen) -> str:
    try:
        _, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return stderr


def _interrupt_then_resume(
    tmp_path: Path, point: str, at: int, sig: signal.Signals, accum: int, expected_step: int
) -> None:
    proc, gates = _start(tmp_path, point, at, accum)
    _wait_for(gates / "ready", proc)
    proc.send_signal(sig)
    (gates / "go").touch()
    stderr = _finish(proc)
    assert proc.returncode == 130, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: interrupted ({sig.name})"), stderr
    saved = SAVED.search(lines[0])
    assert saved is not None, lines[0]
    checkpoint = Path(saved.group(2))
    assert int(saved.group(1)) == expected_step
    assert checkpoint == find_latest(tmp_path / "run" / "checkpoints")
    assert load_checkpoint(checkpoint)["global_step"] == expected_step
    assert not [p for p in checkpoint.parent.iterdir() if p.name.startswith(".tmp")]

    student, teacher = _models()
    finetune(
        student, teacher, _data(), _data(8), tmp_path / "run", _config(accum=accum, resume=True)
    )
    resumed = vitcompress.load(tmp_path / "run").state_dict()
    for key, value in _uninterrupted(accum, 2).items():
        assert torch.equal(resumed[key], value), key


def test_sigint_inside_a_forward_saves_the_step_before_it(tmp_path):
    # accum 2, 4 batches per epoch: the 3rd forward opens step 2, which cannot complete without
    # its second batch; the run stops before fetching more and saves step 1.
    _interrupt_then_resume(tmp_path, "forward", 3, signal.SIGINT, accum=2, expected_step=1)


def test_sigterm_while_loading_a_batch_saves_the_last_step(tmp_path):
    # batch 4: the 13th image fetched is the first of the 4th batch. Accelerate's loader reads
    # one batch ahead, so that happens as the 3rd batch is handed over, before step 3 runs.
    _interrupt_then_resume(tmp_path, "data", 13, signal.SIGTERM, accum=1, expected_step=2)


def test_sigterm_inside_evaluation_saves_the_epochs_last_step(tmp_path):
    # Evaluation redoes from the start on resume; the epoch's 4 steps are kept.
    _interrupt_then_resume(tmp_path, "eval", 1, signal.SIGTERM, accum=1, expected_step=4)


def test_a_second_signal_stops_at_once_without_a_checkpoint(tmp_path, monkeypatch):
    proc, gates = _start(tmp_path, "forward", 2)  # held in step 2's forward, never released
    _wait_for(gates / "ready", proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)  # at once: the same request delivered twice (torchrun)
    time.sleep(interrupt.FORCE_AFTER_S + 0.3)  # the rule under test is a delay, not a sync
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    stderr = _finish(proc)
    assert proc.returncode == 130, stderr
    assert "stopped at once" in stderr and "no checkpoint written, nothing to resume" in stderr
    assert find_latest(tmp_path / "run" / "checkpoints") is None


def test_stop_signals_flag_then_force_and_restore_the_handlers(monkeypatch):
    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(interrupt, "FORCE_AFTER_S", 0.0)
    with StopSignals() as signals:
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == "SIGTERM" and not signals.forced
        with pytest.raises(ForcedStop):
            os.kill(os.getpid(), signal.SIGINT)
        assert signals.forced
    assert signal.getsignal(signal.SIGTERM) is before
    with StopSignals() as signals, pytest.raises(KeyboardInterrupt):
        with signals.immediate():
            os.kill(os.getpid(), signal.SIGTERM)
    with StopSignals() as signals:
        signals.request("elsewhere")
        with pytest.raises(KeyboardInterrupt), signals.immediate():
            pass  # a request made before the region is honoured on entry
        assert not signals._immediate  # and the refused entry leaves the mode as it was


def test_checkpoints_and_the_artifact_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        student, teacher = _models()
        finetune(student, teacher, _data(), None, tmp_path / "run", _config(epochs=1))
    finally:
        os.umask(old)
    run = tmp_path / "run"
    files = [
        find_latest(run / "checkpoints"),
        run / "model.safetensors",
        run / "vitcompress.json",
        run / "metrics.jsonl",
    ]
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {
        p.name: "0o644" for p in files
    }
