"""The host share of a timed batch on an asynchronous device: how much of the batch's time the
forward took to return (to issue its kernels) before the closing synchronisation. A model whose
share is high is bound by the host's launches, and its img/s follows the CPU's speed
(benchmarks/results/h200_bf16_spread.md). Timed here on a fake clock that the runner and the
synchronisation advance, so each share is known exactly."""

from __future__ import annotations

import pytest
import timm
import torch

from vitcompress.measure import measure_throughput
from vitcompress.measure import throughput as throughput_module
from vitcompress.measure.throughput import HOST_BOUND_SHARE, _interleave, _Schedule
from vitcompress.measure.throughput_report import ModelThroughput


class FakeClock:
    """``time.perf_counter`` that moves only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(throughput_module.time, "perf_counter", fake)
    monkeypatch.setattr(throughput_module, "load_average", lambda: None)
    return fake


def test_each_batch_records_the_share_its_launch_took(clock: FakeClock) -> None:
    # "launch-bound" returns after 9 of its 10 ms, "gpu-bound" after 1 of 10: the wait is the
    # synchronisation's, which finishes the work still running on the device.
    pending = {"time": 0.0}

    def runner(launch: float, device: float):
        def run() -> None:
            clock.advance(launch)
            pending["time"] = device

        return run

    def synchronize() -> None:
        clock.advance(pending["time"])
        pending["time"] = 0.0

    runners = {"launch-bound": runner(0.009, 0.001), "gpu-bound": runner(0.001, 0.009)}
    rounds = _interleave(runners, _Schedule(4, 1, 5, None), synchronize, asynchronous=True)

    assert rounds.host_shares["launch-bound"] == pytest.approx([0.9] * 5)
    assert rounds.host_shares["gpu-bound"] == pytest.approx([0.1] * 5)
    # Both take 10 ms a batch of 4: the share separates what the rate alone cannot.
    assert rounds.samples["launch-bound"] == pytest.approx([400.0] * 5)
    assert rounds.samples["gpu-bound"] == pytest.approx([400.0] * 5)
    report = rounds.report({}, [])
    assert report.results["launch-bound"].host_share == pytest.approx(0.9)
    assert report.to_json()["results"]["gpu-bound"]["host_share"] == pytest.approx(0.1)

    warnings = throughput_module.host_bound_warnings(rounds.host_shares)
    assert len(warnings) == 1
    assert warnings[0].startswith("launch-bound is host-bound: issuing its kernels took 90%")


def test_no_share_where_the_forward_returns_with_the_work_done(clock: FakeClock) -> None:
    def run() -> None:
        clock.advance(0.01)

    rounds = _interleave({"cpu": run}, _Schedule(2, 0, 3, None), lambda: None)
    assert rounds.host_shares == {}
    assert rounds.report({}, []).results["cpu"].host_share is None


def test_the_warning_threshold_is_the_median_share() -> None:
    just_below = [HOST_BOUND_SHARE - 0.01] * 3 + [0.99]  # one slow launch is not a verdict
    assert throughput_module.host_bound_warnings({"a": just_below}) == []
    assert len(throughput_module.host_bound_warnings({"a": [HOST_BOUND_SHARE + 0.01] * 3})) == 1
    assert ModelThroughput(samples=[1.0], host_shares=[0.2, 0.4]).host_share == pytest.approx(0.3)


def test_a_cpu_measurement_has_no_host_share_and_no_host_warning() -> None:
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=4
    )
    report = measure_throughput({"m": model}, (3, 32, 32), batch_size=2, warmup=0, runs=2)
    assert report.results["m"].host_share is None
    assert not any("host-bound" in warning for warning in report.warnings)
