"""Timing replayed from CUDA graphs (vitcompress/measure/cuda_graphs.py, `--cuda-graphs`): the
check a capture must pass (within the tolerance or the eager forward's own nondeterminism, on
the captured input and on another), the capture run against a stand-in for CUDA's graphs on the
CPU, the command line's refusals and its option reaching the timing, and on a GPU a real
capture."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from tests.models import FIXTURES
from vitcompress.cli.main import cli
from vitcompress.cli.options import timing_from_options
from vitcompress.errors import UserError
from vitcompress.measure import measure_throughput
from vitcompress.measure.cuda_graphs import (
    NONDETERMINISM_MARGIN,
    CudaGraphed,
    GraphCaptureError,
    capture_pass,
    replay_agrees,
)
from vitcompress.measure.models import TimingOptions

MHA = f"{FIXTURES}:mha_vit"


# ------------------------------------------------------------------------------------------------
# The comparison
# ------------------------------------------------------------------------------------------------


def _noisy(eager: torch.Tensor, noise: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return eager + noise * (2 * torch.rand(eager.shape, generator=generator) - 1)


def test_a_replay_within_the_tolerance_agrees() -> None:
    eager = torch.linspace(-4, 4, 1000)
    agrees, why = replay_agrees(eager + 0.05, [eager, eager.clone()])  # 2e-2 * 4 = 0.08
    assert agrees, why
    agrees, why = replay_agrees(eager + 0.2, [eager, eager.clone()])
    assert not agrees
    assert "differs from the eager forward by 0.2 " in why
    assert "eager forwards of the same input differ among themselves by 0" in why


def test_a_replay_within_the_forwards_own_nondeterminism_agrees() -> None:
    # Atomics in another order: two eager runs differ by up to ~0.3, beyond the tolerance (0.08),
    # and the replay, one more such run, differs from the last as much.
    eager = torch.linspace(-4, 4, 1000)
    runs = [_noisy(eager, 0.15, 0), _noisy(eager, 0.15, 1)]
    replay = _noisy(eager, 0.15, 2)
    agrees, why = replay_agrees(replay, runs)
    assert agrees, why
    # The same replay against runs that happened to agree exactly is refused: the spread is
    # what the eager runs show, not what they might.
    assert not replay_agrees(replay, [runs[1], runs[1].clone()])[0]


def test_a_real_difference_is_refused_with_both_numbers() -> None:
    eager = torch.linspace(-4, 4, 1000)
    runs = [_noisy(eager, 0.15, 0), _noisy(eager, 0.15, 1)]
    spread = (runs[0] - runs[1]).abs().max().item()
    error = NONDETERMINISM_MARGIN * spread + 0.2
    replay = runs[1].clone()
    replay[500] += error  # one logit wrong: a stale buffer, a frozen value
    agrees, why = replay_agrees(replay, runs)
    assert not agrees
    assert f"differs from the eager forward by {error:.3g}" in why
    assert f"differ among themselves by {spread:.3g}" in why


def test_nan_shape_and_one_run() -> None:
    eager = torch.ones(4, 10)
    broken = eager.clone()
    broken[0, 0] = float("nan")
    assert not replay_agrees(broken, [eager, eager])[0]  # a NaN where eager has none
    assert replay_agrees(broken, [broken.clone(), broken.clone()])[0]  # NaN in both alike
    agrees, why = replay_agrees(torch.ones(4, 11), [eager])
    assert not agrees and "shape (4, 11)" in why and "(4, 10)" in why
    agrees, why = replay_agrees(eager + 1, [eager])
    assert not agrees and "among themselves" not in why  # one run shows no spread
    with pytest.raises(ValueError, match="at least one eager run"):
        replay_agrees(eager, [])


# ------------------------------------------------------------------------------------------------
# The capture, against a stand-in for CUDA's graphs on the CPU
# ------------------------------------------------------------------------------------------------


class _FakeGraph:
    """What a CUDA graph does, on the CPU: the work recorded while capturing, run again from
    the same tensors on each replay."""

    capturing: _FakeGraph | None = None

    def __init__(self) -> None:
        self.work: list[Callable[[], None]] = []

    def replay(self) -> None:
        # A replay's kernels write the graph's memory directly, past autograd's checks (an
        # inference tensor captured as output is rewritten outside inference mode too).
        with torch.inference_mode():
            for work in self.work:
                work()


@contextlib.contextmanager
def _fake_capture(graph: _FakeGraph):
    _FakeGraph.capturing = graph
    try:
        yield
    finally:
        _FakeGraph.capturing = None


class _Recorded(nn.Module):
    """A linear layer whose work a fake capture records: reading the input tensor given (or,
    ``frozen``, a copy of it taken at capture time: a capture that froze a value)."""

    def __init__(self, frozen: bool = False, noise: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.frozen = frozen
        self.noise = noise  # run-to-run nondeterminism of every forward, replayed or not

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.noise * torch.rand(x.shape[0], 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.compute(x)
        graph = _FakeGraph.capturing
        if graph is not None:
            source = x.clone() if self.frozen else x
            graph.work.append(lambda: out.copy_(self.compute(source)))
        return out


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    class Stream:
        def __init__(self, device: object = None) -> None:
            pass

        def wait_stream(self, other: object) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _fake_capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())


def test_a_faithful_capture_replays_the_forward_on_new_inputs(fake_cuda: None) -> None:
    model = _Recorded().eval()
    wrapped = CudaGraphed(model)
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.inference_mode():
        first = wrapped(x).clone()
        second = wrapped(y).clone()
        torch.testing.assert_close(first, model(x))
        torch.testing.assert_close(second, model(y))
        assert len(wrapped.graphs) == 1
        wrapped(torch.randn(5, 8))  # another shape, another graph
    assert len(wrapped.graphs) == 2


def test_a_capture_that_froze_its_input_is_refused_on_another_input(fake_cuda: None) -> None:
    wrapped = CudaGraphed(_Recorded(frozen=True).eval())
    with torch.inference_mode(), pytest.raises(GraphCaptureError, match="^on another input, "):
        wrapped(torch.randn(3, 8))


def test_a_nondeterministic_forward_is_captured(fake_cuda: None) -> None:
    torch.manual_seed(0)
    # Noise of 0.5 on outputs of about 1: beyond the tolerance, within the runs' own spread.
    wrapped = CudaGraphed(_Recorded(noise=0.5).eval())
    with torch.inference_mode():
        wrapped(torch.randn(64, 8))
    # Frozen as well, the noise does not hide a stale input: another input's outputs differ by
    # far more than the runs do among themselves.
    wrapped = CudaGraphed(_Recorded(frozen=True, noise=0.01).eval())
    with torch.inference_mode(), pytest.raises(GraphCaptureError, match="among themselves"):
        wrapped(10 * torch.randn(64, 8))


def test_a_graph_captured_under_inference_mode_replays_under_no_grad(fake_cuda: None) -> None:
    # Its static input is written by every call: an inference tensor (a clone made under
    # inference_mode) would refuse that write outside inference mode.
    model = _Recorded().eval()
    wrapped = CudaGraphed(model)
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.inference_mode():
        wrapped(x)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(y).clone(), model(y))
    with torch.inference_mode():
        torch.testing.assert_close(wrapped(x).clone(), model(x))
    assert len(wrapped.graphs) == 1


def test_a_graphed_forward_refuses_to_run_with_grad(fake_cuda: None) -> None:
    with pytest.raises(RuntimeError, match="inference only"):
        CudaGraphed(_Recorded())(torch.randn(2, 8))


def test_a_forward_that_cannot_be_captured_is_one_line_naming_the_model() -> None:
    def fails() -> None:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
        finally:
            raise RuntimeError("capture_end failed: the capture was invalidated")

    with pytest.raises(GraphCaptureError) as caught:
        capture_pass("compressed", fails)
    assert str(caught.value) == (
        "compressed: its forward cannot be timed from a CUDA graph (--cuda-graphs): "
        "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    )
    assert isinstance(caught.value, UserError)


def test_running_out_of_memory_while_capturing_stays_itself() -> None:
    # The capture's end fails after the forward ran out of memory inside it: the reason is
    # the memory, said as torch says it, not a capture that cannot be timed.
    def fails() -> None:
        try:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        finally:
            raise RuntimeError("capture_end failed: the capture was invalidated")

    with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate 2.00 GiB"):
        capture_pass("compressed", fails)


def test_measure_throughput_graphs_only_on_cuda_and_not_compiled() -> None:
    model = {"model": nn.Linear(4, 4)}
    with pytest.raises(ValueError, match="needs a CUDA device and no compile"):
        measure_throughput(model, (1, 2, 2), batch_size=1, runs=1, cuda_graphs=True)


# ------------------------------------------------------------------------------------------------
# The command line
# ------------------------------------------------------------------------------------------------


def _run(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.mark.parametrize("command", ["bench", "apply"])
def test_cuda_graphs_on_the_cpu_is_one_line(command: str) -> None:
    result = _run(command, "--model", MHA, "--device", "cpu", "--cuda-graphs")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: --cuda-graphs replays CUDA graphs: it needs --device cuda, not cpu"
    ]


def test_cuda_graphs_with_compile_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vitcompress.cli.options.check_device", lambda device: device)  # a GPU
    result = _run("bench", "--model", MHA, "--device", "cuda", "--cuda-graphs", "--compile")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: --cuda-graphs and --compile: choose one (--compile-mode reduce-overhead is "
        "inductor's own CUDA graphs)"
    ]


def test_cuda_graphs_with_no_throughput_is_one_line() -> None:
    result = _run("bench", "--model", MHA, "--cuda-graphs", "--no-throughput")
    assert result.exit_code == 2, result.output
    assert "--cuda-graphs: it sets how models are timed" in result.stderr


@pytest.mark.parametrize("command", ["bench", "apply"])
def test_cuda_graphs_reaches_the_timing(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("vitcompress.cli.options.check_device", lambda device: device)  # a GPU
    seen = []

    def measure(self: TimingOptions, models: dict, input_size: tuple, **extra: object) -> None:
        seen.append(self.throughput_arguments(**extra))
        raise UserError("stopped before timing")

    monkeypatch.setattr(TimingOptions, "measure", measure)
    result = _run(command, "--model", MHA, "--device", "cuda", "--cuda-graphs")
    assert result.stderr.strip().splitlines() == ["error: stopped before timing"], result.output
    assert seen and seen[0]["cuda_graphs"] is True and seen[0]["compile"] is False
    assert seen[0]["device"] == "cuda"


def test_the_option_folds_into_timing_options() -> None:
    values = dict(
        batch_size=4, device="cuda", dtype="float32", warmup=1, runs=2, bench_seconds=1.0,
        use_compile=False, compile_mode=None, fused_kernels=False, amp=None, no_throughput=False,
    )  # fmt: skip
    timing = timing_from_options(**values, cuda_graphs=True)
    assert timing is not None and timing.cuda_graphs
    assert timing.throughput_arguments()["cuda_graphs"] is True
    plain = timing_from_options(**values)
    assert plain is not None and not plain.cuda_graphs
    with pytest.raises(UserError, match="needs --device cuda, not cpu"):
        timing_from_options(**{**values, "device": "cpu"}, cuda_graphs=True)


# ------------------------------------------------------------------------------------------------
# On a GPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_a_tiny_vit_replayed_from_a_graph_equals_its_eager_forward() -> None:
    import timm

    model = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10
    )
    model = model.cuda().eval()
    wrapped = CudaGraphed(model)
    x, y = torch.randn(2, 3, 32, 32, device="cuda"), torch.randn(2, 3, 32, 32, device="cuda")
    with torch.inference_mode():
        wrapped(x)
        for batch in (x, y):
            # the same kernels; a cuBLAS workspace of its own may pick another algorithm
            torch.testing.assert_close(wrapped(batch).clone(), model(batch), atol=1e-4, rtol=1e-4)
        with torch.autocast("cuda", torch.bfloat16):
            replayed = wrapped(x).clone()  # another graph: under autocast
        with torch.autocast("cuda", torch.bfloat16):  # a new autocast region, no stale cache
            torch.testing.assert_close(wrapped(x).float(), replayed.float())
            torch.testing.assert_close(replayed.float(), model(x).float(), atol=0.05, rtol=0.05)
    assert len(wrapped.graphs) == 2
    report = measure_throughput(
        {"model": model}, (3, 32, 32), batch_size=2, device="cuda", runs=2, cuda_graphs=True
    )
    assert report.environment["cuda_graphs"] is True
    assert set(report.environment["capture_seconds"]) == {"model"}


def test_the_environment_line_names_the_timing_mode() -> None:
    from vitcompress.cli.app import timing_mode

    assert timing_mode({"cuda_graphs": True, "compile": False}) == ", CUDA graphs"
    compiled = {"compile": True, "compile_options": {"mode": "reduce-overhead"}}
    assert timing_mode(compiled) == ", torch.compile (reduce-overhead)"
    assert timing_mode({"compile": True, "compile_options": {}}) == ", torch.compile"
    assert timing_mode({"compile": False, "cuda_graphs": False}) == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
@pytest.mark.parametrize("method", ["dtps", "tome"])
def test_compressed_models_are_timed_from_graphs_under_autocast(method: str) -> None:
    # dTPS and ToMe fuse with scatter_add, whose atomics make eager runs differ among themselves.
    import timm

    import vitcompress

    base = timm.create_model(
        "vit_tiny_patch16_224", img_size=32, patch_size=8, depth=3, num_classes=10
    ).eval()
    compressed = vitcompress.compress(base, method, keep=0.7, locs=[1], input_size=(3, 32, 32))
    models = {"base": base.cuda(), "compressed": compressed.eval().cuda()}
    report = measure_throughput(
        models, (3, 32, 32), batch_size=8, device="cuda", dtype=torch.bfloat16, amp=True,
        runs=2, cuda_graphs=True,
    )  # fmt: skip
    assert set(report.environment["capture_seconds"]) == {"base", "compressed"}
