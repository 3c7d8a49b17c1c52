"""Ctrl-C is one line (``error: interrupted``) and exit code 130 whenever it comes: while the
command line is still importing torch, while click reads the options or closes, and after the
command has ended, during the interpreter's shutdown (its ``atexit`` callbacks).

A real SIGINT is sent to a real process stopped at a known point: a driver on ``python -c`` stalls
the first import of torch, or registers the last ``atexit`` callback, and touches a file when it is
there (no timing guesses: the signal is sent once the process is known to wait there).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from vitcompress.cli.app import VitcompressGroup
from vitcompress.cli.main import cli
from vitcompress.cli.status import ConsoleStatus

ROOT = Path(__file__).resolve().parents[1]

# argv: the gate file, where to stop ("import" or "exit"), the entry ("script": what the console
# script runs; "module": python -m vitcompress.cli.main), then the command's arguments.
DRIVER = """
import atexit, importlib.abc, pathlib, runpy, sys, time

gate, point, entry, *args = sys.argv[1:]


def stop_here():
    pathlib.Path(gate).touch()
    time.sleep(120)


class StallTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname == "torch":
            sys.meta_path.remove(self)
            stop_here()
        return None


if point == "import":
    sys.meta_path.insert(0, StallTorch())
else:
    atexit.register(stop_here)  # registered first, so it runs last: after the command's end
sys.argv = ["vitcompress", *args]
if entry == "script":
    from vitcompress.cli.main import main

    sys.exit(main())
runpy.run_module("vitcompress.cli.main", run_name="__main__", alter_sys=True)
"""


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_at(tmp_path: Path, point: str, entry: str, *args: str) -> tuple[int, str, str]:
    gate = tmp_path / "stopped"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(gate), point, entry, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As a terminal starts a command: Ctrl-C delivered. A test run started in the background
        # (no job control) ignores SIGINT, and a child inherits that, never interrupted.
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.monotonic() + 120
        while not gate.exists():
            if proc.poll() is not None:
                raise AssertionError(f"ended before the stop: {proc.communicate()}")
            if time.monotonic() > deadline:
                raise AssertionError("never reached the stop")
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, stdout, stderr


@pytest.mark.parametrize("entry", ["script", "module"])
def test_ctrl_c_while_torch_imports_is_one_line_and_130(tmp_path: Path, entry: str) -> None:
    code, stdout, stderr = _interrupt_at(tmp_path, "import", entry, "--help")
    assert (code, stdout, stderr) == (130, "", "error: interrupted\n")


def test_ctrl_c_during_shutdown_after_the_command_is_one_line_and_130(tmp_path: Path) -> None:
    code, stdout, stderr = _interrupt_at(tmp_path, "exit", "script", "variants", "--json")
    assert (code, stderr) == (130, "error: interrupted\n")
    assert '"name": "etps"' in stdout  # the command's whole output came first


def test_ctrl_c_while_the_options_are_read_is_one_line_and_130(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(VitcompressGroup, "parse_args", interrupted)
    result = CliRunner().invoke(cli, ["variants"])
    assert (result.exit_code, result.output) == (130, "error: interrupted\n")


def test_ctrl_c_while_the_group_closes_is_one_line_and_130(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def interrupted(self: ConsoleStatus) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ConsoleStatus, "close", interrupted)
    result = CliRunner().invoke(cli, ["variants", "--json"])
    assert result.exit_code == 130
    assert result.output.endswith("}\nerror: interrupted\n")  # after the command's output


def test_import_vitcompress_keeps_its_names_and_registers_the_zoo_with_timm() -> None:
    """The public names are imported on first use; the zoo's models are in timm's registry
    whether timm is imported after ``import vitcompress`` or before it."""
    check = """
import vitcompress
api = vitcompress.api  # a subpackage, as after the imports the package once ran at once
from vitcompress import __version__, compress, load, map_model, save
import timm
assert (compress, load, map_model, save) == (api.compress, api.load, api.map_model, api.save)
assert vitcompress.save is api.save
assert set(vitcompress.__all__) <= set(dir(vitcompress))
assert not hasattr(vitcompress, "no_such_name")
assert timm.is_model("pvt_tiny") and timm.is_model("segmenter_tiny_fmnist"), "zoo"
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for first in ("", "import timm\n"):
        done = subprocess.run(
            [sys.executable, "-c", first + check], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
