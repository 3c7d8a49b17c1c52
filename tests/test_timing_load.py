"""Timing under load: the thread count is chosen so as not to oversubscribe the free cores, a
starvation check retimes at 1 thread when the chosen threads were starved, and the result says
which happened. The load average, the CPUs and the timings are injected: nothing here depends on
how busy the machine running the tests is, or on how fast it is."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from tests.fixtures import inhouse
from vitcompress.measure import throughput
from vitcompress.measure.throughput import (
    STARVATION_FACTOR,
    ThreadChoice,
    _Rounds,
    _Schedule,
    choose_threads,
    measure_callables,
    measure_throughput,
)

INPUT = (3, 8, 8)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch asks for 2 threads (the tests run with OMP_NUM_THREADS=1), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def machine(monkeypatch: pytest.MonkeyPatch, cpus: int, loads: list[float], own: float = 0.0):
    """A machine of ``cpus`` CPUs whose load average reads ``loads`` in turn (the last repeats)."""
    readings = iter(loads)
    last = [loads[-1]]

    def load() -> float:
        last[0] = next(readings, last[0])
        return last[0]

    monkeypatch.setattr(throughput, "load_average", load)
    monkeypatch.setattr(throughput, "available_cpus", lambda: cpus)
    monkeypatch.setattr(throughput, "own_load", lambda: own)


def timings(monkeypatch: pytest.MonkeyPatch, rate_at: Mapping[int, float]) -> list[int]:
    """Every timed batch runs at ``rate_at[threads]`` images/s, the threads being torch's count
    when the batch runs. Returns the thread counts of the timing passes, in order."""
    passes: list[int] = []

    def interleave(
        runners: Mapping[str, Callable[[], Any]],
        schedule: _Schedule,
        synchronize: Callable[[], None],
        load_before: float | None = None,
        asynchronous: bool = False,
    ) -> _Rounds:
        threads = torch.get_num_threads()
        passes.append(threads)
        for run in runners.values():
            run()  # the runner really runs, at the threads set
        loads = [load_before if load_before is not None else throughput.load_average()]
        loads.append(throughput.load_average())
        samples = {name: [rate_at[threads]] * schedule.runs for name in runners}
        return _Rounds(samples, schedule, schedule.warmup, schedule.runs, 0.0, loads)

    monkeypatch.setattr(throughput, "_interleave", interleave)
    return passes


class ThreadRecorder(nn.Module):
    """Records torch's thread count at every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 2)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.get_num_threads())
        return self.linear(x.mean(dim=(1, 2)).repeat(1, 3)[:, :8])


# --------------------------------------------------------------------------------------------------
# The choice itself
@pytest.mark.parametrize(
    "asked,cpus,load,own,threads,reason",
    [
        (2, 2, 0.1, 0.0, 2, "fits"),  # a quiet machine: torch's count
        (2, 2, 3.5, 0.0, 1, "load"),  # the machine: load 3-4 on 2 cores
        (2, 2, 0.6, 0.0, 1, "load"),  # over half a core taken: a thread would share it
        (2, 2, 0.4, 0.0, 2, "fits"),  # under half a core taken
        (2, 2, 1.4, 1.0, 2, "fits"),  # most of the load is this process's own loading
        (8, 16, 10.0, 0.0, 6, "load"),
        (1, 2, 0.0, 0.0, 1, "fits"),  # never more than torch asks for
        (4, 4, 40.0, 0.0, 1, "load"),  # never fewer than 1
    ],
)
def test_choose_threads(
    asked: int, cpus: int, load: float, own: float, threads: int, reason: str
) -> None:
    choice = choose_threads(asked, cpus, load, own)
    assert (choice.threads, choice.reason) == (threads, reason)
    assert choice.free == pytest.approx(cpus - max(0.0, load - own))


def test_without_a_load_average_torch_count_is_kept() -> None:
    choice = choose_threads(4, 4, None)
    assert (choice.threads, choice.reason, choice.free) == (4, "no-load", None)


# --------------------------------------------------------------------------------------------------
# measure_throughput: the chosen threads are the ones the model runs with, and are reported
def test_a_loaded_machine_times_with_fewer_threads(
    monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    machine(monkeypatch, cpus=2, loads=[3.5])
    passes = timings(monkeypatch, {1: 28.0, 2: 0.7})
    model = ThreadRecorder()
    report = measure_throughput({"m": model}, INPUT, batch_size=1, warmup=0, runs=3)
    assert set(model.seen) == {1} and passes == [1]  # no starvation check at 1 thread
    env = json.loads(json.dumps(report.to_json()))["environment"]
    assert env["threads"] == 1
    assert env["thread_choice"]["reason"] == "load" and env["thread_choice"]["asked"] == 2
    assert env["thread_choice"]["starvation"] is None
    assert any("1 thread of 2 (load 3.5 on 2 CPUs" in w for w in report.warnings)
    assert torch.get_num_threads() == 2  # restored


def test_starved_threads_are_retimed_at_one_thread(
    monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    # Quiet when timing began (2 threads chosen), full by the end: 1 thread 40x faster.
    machine(monkeypatch, cpus=2, loads=[0.2, 4.0])
    passes = timings(monkeypatch, {1: 28.0, 2: 0.7})
    report = measure_throughput(
        {"base": ThreadRecorder(), "small": ThreadRecorder()}, INPUT, warmup=1, runs=4
    )
    assert passes == [2, 1, 1]  # timed, checked, retimed
    choice = report.environment["thread_choice"]
    assert choice["reason"] == "starved" and choice["threads"] == 1
    assert choice["starvation"] == {
        "model": "base",
        "threads": 2,
        "rate": 0.7,
        "one_thread_rate": 28.0,
        "starved": True,
    }
    # The reported numbers are the 1-thread retime's, and the report says why.
    assert report.results["base"].samples == [28.0] * 4
    assert report.environment["threads"] == 1
    assert any("starved" in w and "timed again at 1" in w for w in report.warnings)


def test_a_check_that_passes_keeps_the_timing(
    monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    machine(monkeypatch, cpus=2, loads=[0.2, 4.0])
    # 1 thread faster, but not STARVATION_FACTOR times: noise, not starvation.
    passes = timings(monkeypatch, {1: 9.0 * STARVATION_FACTOR, 2: 10.0})
    report = measure_throughput({"m": ThreadRecorder()}, INPUT, warmup=0, runs=3)
    assert passes == [2, 1]
    choice = report.environment["thread_choice"]
    assert choice["reason"] == "fits" and choice["threads"] == 2
    assert choice["starvation"]["starved"] is False
    assert report.results["m"].samples == [10.0] * 3


def test_no_check_when_the_machine_stayed_free(
    monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    machine(monkeypatch, cpus=2, loads=[0.2, 1.9])
    passes = timings(monkeypatch, {1: 28.0, 2: 0.7})  # would fail the check, were it run
    report = measure_throughput({"m": ThreadRecorder()}, INPUT, warmup=0, runs=3)
    assert passes == [2] and report.environment["thread_choice"]["starvation"] is None


def test_fixed_threads_are_used_as_given(
    monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    machine(monkeypatch, cpus=2, loads=[3.5, 4.0])
    passes = timings(monkeypatch, {1: 28.0, 2: 0.7})
    model = ThreadRecorder()
    report = measure_throughput({"m": model}, INPUT, warmup=0, runs=2, threads=2)
    assert set(model.seen) == {2} and passes == [2]  # no choice, no check
    assert report.environment["thread_choice"]["reason"] == "fixed"
    with pytest.raises(ValueError, match="threads"):
        measure_throughput({"m": model}, INPUT, threads=0)


def test_measure_callables_runs_at_the_callers_choice(
    monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    machine(monkeypatch, cpus=2, loads=[3.5])
    timings(monkeypatch, {1: 5.0, 2: 0.5})
    seen: list[int] = []
    choice = throughput.thread_choice()
    assert (choice.threads, choice.reason) == (1, "load")
    report = measure_callables(
        {"r": lambda: seen.append(torch.get_num_threads())}, 1, runs=2, threads=choice
    )
    assert seen == [1] and report.environment["thread_choice"]["reason"] == "load"


def test_bench_exported_builds_sessions_with_the_chosen_threads(
    monkeypatch: pytest.MonkeyPatch, two_threads: None, tmp_path: Any
) -> None:
    from vitcompress.workflows import export_bench
    from vitcompress.workflows.export import export_model

    machine(monkeypatch, cpus=2, loads=[3.5])
    timings(monkeypatch, {1: 5.0, 2: 0.5})
    made: list[int | None] = []
    real = export_bench.onnx_runner

    def runner(path: Any, batch: torch.Tensor, threads: int | None = None) -> Callable[[], Any]:
        made.append(threads)
        return real(path, batch, threads)

    monkeypatch.setattr(export_bench, "onnx_runner", runner)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4)).eval()
    files = {}
    for name in ("base", "other"):
        files[name] = tmp_path / f"{name}.onnx"
        export_model(model, INPUT, "onnx", files[name], batch_size=2)
    result = export_bench.bench_exported(
        {"base": model, "other": model}, files, INPUT, "base", batch_size=2, warmup=0, runs=2
    )
    assert made == [1, 1]
    assert result["environment"]["thread_choice"]["reason"] == "load"


# --------------------------------------------------------------------------------------------------
# The rendered report says which threads were used, and why
@pytest.mark.parametrize(
    "choice,expected",
    [
        (ThreadChoice(2, 2, 3.5, 0.0, 1, "load"), "1 thread of 2 (load 3.5 on 2 CPUs"),
        (ThreadChoice(2, 2, 0.1, 0.0, 2, "fits"), "2 threads"),
        (
            ThreadChoice(
                2,
                2,
                0.2,
                0.0,
                1,
                "starved",
                throughput.StarvationCheck("base", 2, 0.7, 28.0, True),
            ),
            "base ran 40.0x faster at 1 thread than at 2",
        ),
    ],
)
def test_environment_line_names_the_choice(choice: ThreadChoice, expected: str) -> None:
    from vitcompress.cli import app

    env = {"device": "cpu", "dtype": "float32", "batch_size": 1, "torch": "x", "threads": 1}
    env["thread_choice"] = json.loads(json.dumps(choice.to_json()))
    assert ThreadChoice.from_json(env["thread_choice"]) == choice
    with app.console.capture() as captured:
        app.print_environment(env)
    assert expected in " ".join(captured.get().split())


def test_bench_command_json_reports_the_choice(
    monkeypatch: pytest.MonkeyPatch, two_threads: None
) -> None:
    from vitcompress.cli.main import cli

    machine(monkeypatch, cpus=2, loads=[3.5])
    timings(monkeypatch, {1: 28.0, 2: 0.7})
    result = CliRunner().invoke(
        cli,
        ["bench", "--model", f"{inhouse.__file__}:mha_vit", "--model-arg", "depth=2"]
        + ["--batch-size", "1", "--warmup", "0", "--runs", "2", "--json"],
    )
    assert result.exit_code == 0, result.output
    env = json.loads(result.stdout)["environment"]
    assert env["threads"] == 1 and env["thread_choice"]["reason"] == "load"
