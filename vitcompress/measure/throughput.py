"""Inference throughput (images/s), measured so that models can be compared fairly.

Speed-ups of a pruned model over its base are only meaningful when both were timed under the same
conditions. So all models of one call are timed in one process on one fixed input batch, and the
timed runs are interleaved round-robin (one batch of each model per round): a burst of machine
noise (thermal throttling, a background job) then hits every model alike instead of whichever
happened to be timed at that moment. Each model reports the median of its runs, which ignores the
odd outlier, plus all samples so the spread can be judged; :meth:`ThroughputReport.paired` turns
two models' samples into a speed-up with a 95% interval (:mod:`.paired`).

Two things make a number untrustworthy, and both are reported in ``ThroughputReport.warnings``
rather than hidden: other work on the machine (the 1-minute load average above the threads torch
uses, read before and after timing), and a time budget that ended the timing before all runs.

Other work on the machine does worse than add noise when torch's threads outnumber the free
cores: an OpenMP barrier waits for its slowest thread, so one thread that shares a core with
another process stalls all of them (deit_tiny at batch 1 on 2 cores at load 3-4: 0.7 img/s with 2
threads, 28 img/s with 1). So on the CPU the thread count is chosen (:func:`choose_threads`): as
many as torch would use, but no more than the cores the load average leaves free. When the
machine still filled up during timing, a starvation check times the first model at 1 thread; if
that is more than :data:`STARVATION_FACTOR` times faster, the threads were starved and every model
is timed again at 1 thread. ``environment["thread_choice"]`` says which of these happened.

The results (:mod:`.throughput_report`) and the thread decisions (:mod:`.threads`) live in their own
modules; their names are re-exported here. The functions that read the machine stay here, beside
the timing that calls them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vitcompress.model_copy import copy_model

from .cuda_graphs import CudaGraphed, capture_pass
from .macs import _same_device
from .threads import STARVATION_FACTOR, StarvationCheck, ThreadChoice, choose_threads, load_warning
from .throughput_report import ModelThroughput, RoundProgress, ThroughputReport, environment

__all__ = [
    "STARVATION_FACTOR",
    "ModelThroughput",
    "RoundProgress",
    "StarvationCheck",
    "ThreadChoice",
    "ThroughputReport",
    "available_cpus",
    "choose_threads",
    "environment",
    "load_average",
    "load_warning",
    "measure_callables",
    "measure_throughput",
    "own_load",
    "thread_choice",
    "torch_threads",
]

# Timed batches of the starvation check (after one warm-up batch).
STARVATION_RUNS = 3


def load_average() -> float | None:
    """The 1-minute load average, or None where the system has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def available_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS has one (a container or
    ``taskset`` may allow fewer than the machine has), else ``os.cpu_count()``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def own_load() -> float:
    """An estimate of this process's own share of the 1-minute load average, in busy threads.

    The load average counts this process too: loading the model and counting its MACs just
    before timing raise it, and read as other work they would take cores from the timing. The
    load is an average decaying with a 1-minute constant, so the estimate is the process's mean
    busy threads since it started (CPU seconds over wall seconds) weighted by the part of that
    average its lifetime fills. 0 where the start time cannot be read (not Linux): the choice
    then errs towards fewer threads, which costs speed, never honesty.
    """
    try:
        with open("/proc/self/stat") as f:
            # Field 22 (after the parenthesised name, which may hold spaces) is the start time in
            # clock ticks since boot.
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            age = float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0
    if age <= 0:
        return 0.0
    times = os.times()
    busy = (times.user + times.system) / age
    return busy * (1 - math.exp(-age / 60))


def thread_choice(threads: int | None = None) -> ThreadChoice:
    """The threads to time with now: ``threads`` when given (``fixed``), else
    :func:`choose_threads` from torch's count, this process's CPUs and the load average."""
    asked = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        return ThreadChoice(asked, available_cpus(), load_average(), 0.0, threads, "fixed")
    return choose_threads(asked, available_cpus(), load_average(), own_load())


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads set to ``threads`` inside, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _synchronize(device: torch.device) -> None:
    # CUDA kernels run asynchronously; without a sync the clock would measure only the launches.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prepare(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The model on ``device``/``dtype``, copying it only when a conversion is needed.

    ``Module.to`` works in place, and a measurement should not move or cast the caller's model.
    """
    tensors = [*model.parameters(), *model.buffers()]
    needs_move = any(not _same_device(t.device, device) for t in tensors)
    needs_cast = any(t.is_floating_point() and t.dtype != dtype for t in tensors)
    if needs_move or needs_cast:
        model = copy_model(model).to(device=device, dtype=dtype)
    return model


@contextlib.contextmanager
def training_flags_kept(models: Iterable[nn.Module]) -> Iterator[None]:
    """Every module's ``training`` flag as it was on entry, put back on exit (also on an
    error)."""
    flags = [(module, module.training) for model in models for module in model.modules()]
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


def _check_request(
    models: Mapping[str, nn.Module],
    input_size: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    amp: bool,
) -> None:
    """One line for what cannot be timed: no models, an input without channels and a grid,
    autocast off CUDA or to a dtype it does not cast to."""
    if not models:
        raise ValueError("no models to time")
    if len(input_size) < 3:
        raise ValueError(
            "input_size must be (channels, height, width) or of higher rank (a video's "
            f"(channels, frames, height, width)), got {tuple(input_size)}"
        )
    if amp:
        if device.type != "cuda":
            raise ValueError(f"amp=True is only supported on CUDA, not on {device.type}")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"amp=True needs dtype float16 or bfloat16, got {dtype}")


def _runnable(
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    compile_options: Mapping[str, Any] | None,
    compiled: bool,
    cuda_graphs: bool = False,
) -> nn.Module:
    """The model as it is timed: on ``device`` in ``dtype`` (a copy where it is not), in eval
    mode, wrapped by ``torch.compile`` where ``compiled``, or replayed from CUDA graphs."""
    prepared = _prepare(model, device, dtype).eval()
    if cuda_graphs:
        return CudaGraphed(prepared)
    if not compiled:
        return prepared
    return torch.compile(prepared, **dict(compile_options or {}))  # type: ignore[return-value]


def _graph_break_warnings(compiled_graphs: Mapping[str, int]) -> list[str]:
    """A line for each compiled model that dynamo broke into more than one graph."""
    return [
        f"{name} compiled into {graphs} graphs: dynamo broke the graph "
        f"{graphs - 1} time{'s' if graphs > 2 else ''}, so part of it runs eagerly between them"
        for name, graphs in compiled_graphs.items()
        if graphs > 1
    ]


def measure_throughput(
    models: Mapping[str, nn.Module],
    input_size: tuple[int, ...],
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    warmup: int = 3,
    runs: int = 10,
    compile: bool | Collection[str] = False,
    amp: bool = False,
    time_budget: float | None = None,
    on_round: Callable[[RoundProgress], None] | None = None,
    compile_options: Mapping[str, Any] | None = None,
    threads: int | None = None,
    cuda_graphs: bool = False,
) -> ThroughputReport:
    """Images/s of each model in inference mode, timed interleaved in this process.

    ``input_size`` is the input without the batch dim: ``(channels, height, width)``, or of
    higher rank (a video model's). Without ``amp`` the models run in ``dtype``
    (a copy is made if a model is not already on ``device`` in ``dtype``); with ``amp`` they stay
    in float32 under ``torch.autocast(dtype=dtype)``, which is only offered on CUDA. Training
    flags are restored afterwards.

    ``compile`` wraps every model (``True``) or the models so named (a collection of names) with
    ``torch.compile(**compile_options)``. Each compiled model is run once before warm-up, outside
    the time budget: its compilation time (``environment["compile_seconds"]``) and the graphs
    dynamo made of it (``environment["compiled_graphs"]``; more than one means graph breaks, which
    is also a warning; 0 means dynamo reused the graph of an identical model compiled earlier in
    this process) are recorded, and nothing of it is timed.

    ``cuda_graphs`` (CUDA only, not with ``compile``) times every model replayed from CUDA graphs
    (:class:`~.cuda_graphs.CudaGraphed`), each captured and checked once before warm-up, outside
    the budget (``environment["capture_seconds"]``); a forward that cannot be captured, or whose
    replay disagrees with it, is a :class:`~.cuda_graphs.GraphCaptureError` naming the model.

    ``time_budget`` (seconds) bounds warm-up and timing together: no round starts once it is
    spent, but one warm-up round (when ``warmup`` > 0) and one timed round always run, so a round
    may overshoot it. ``on_round`` is called after every round, for progress displays.

    ``threads``: torch's intra-op threads while timing on the CPU. None (the default) chooses
    them (:func:`choose_threads`: torch's count, but no more than the free cores) and, when the
    machine was full while timing, checks for starvation (the first model timed at 1 thread more
    than :data:`STARVATION_FACTOR` times faster), timing everything again at 1 thread if it
    fails; a number fixes them and checks nothing. ``environment["thread_choice"]`` says which.
    """
    device = torch.device(device)
    _check_request(models, input_size, device, dtype, amp)
    schedule = _Schedule(batch_size, warmup, runs, time_budget, on_round)
    compiled_names = _compiled_names(compile, models)
    if cuda_graphs and (device.type != "cuda" or compiled_names):
        raise ValueError("cuda_graphs=True needs a CUDA device and no compile")
    # Under autocast weights and input stay float32 and the autocast casts per op.
    run_dtype = torch.float32 if amp else dtype
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((batch_size, *input_size), generator=generator).to(device, run_dtype)

    def forward(model: nn.Module) -> None:
        if amp:
            with torch.autocast(device_type=device.type, dtype=dtype):
                model(x)
        else:
            model(x)

    compile_seconds: dict[str, float] = {}
    compiled_graphs: dict[str, int] = {}
    capture_seconds: dict[str, float] = {}
    # On a GPU the CPU threads only launch kernels: the count is torch's, and nothing is checked.
    choice = thread_choice(threads if device.type == "cpu" else torch.get_num_threads())
    # eval() changes the caller's models wherever no copy is needed: their flags are put back.
    with training_flags_kept(models.values()):
        runnable = {
            name: _runnable(
                model, device, run_dtype, compile_options, name in compiled_names, cuda_graphs
            )
            for name, model in models.items()
        }
        runners = {name: functools.partial(forward, model) for name, model in runnable.items()}
        with torch.inference_mode(), torch_threads(choice.threads):
            # Compilation first, each model on its own and outside the budget: minutes of
            # code generation must neither be timed nor eat the rounds that are.
            for name in compiled_names:
                compile_seconds[name], compiled_graphs[name] = _compile_pass(
                    lambda model=runnable[name]: forward(model), device
                )
            for name in runnable if cuda_graphs else ():
                capture_seconds[name] = capture_pass(name, runners[name])
            rounds = _interleave(
                runners,
                schedule,
                lambda: _synchronize(device),
                load_before=choice.load,
                asynchronous=device.type == "cuda",
            )
            if threads is None and device.type == "cpu":
                choice, rounds = _check_starvation(choice, rounds, runners, schedule)

    warnings = _graph_break_warnings(compiled_graphs) + host_bound_warnings(rounds.host_shares)
    return rounds.report(
        environment(device, dtype, batch_size)
        | {
            "input_size": list(input_size),
            "compile": bool(compiled_names),
            "compiled_models": list(compiled_names),
            "compile_options": dict(compile_options or {}) if compiled_names else None,
            "compile_seconds": compile_seconds,
            "compiled_graphs": compiled_graphs,
            "cuda_graphs": cuda_graphs,
            "capture_seconds": capture_seconds,
            "amp": amp,
            "threads": choice.threads,
            "thread_choice": choice.to_json(),
        },
        warnings + _thread_warnings(choice),
        threads=choice.threads,
    )


# A batch whose forward takes longer to return than this share of its time is bound by the
# host's kernel launches: the GPU waits for them, and its img/s follows the CPU's speed (the bf16
# headline's spread between processes, benchmarks/results/h200_bf16_spread.md).
HOST_BOUND_SHARE = 0.8


def host_bound_warnings(host_shares: Mapping[str, list[float]]) -> list[str]:
    """One line per model whose median host share is above :data:`HOST_BOUND_SHARE`."""
    lines = []
    for name, shares in host_shares.items():
        share = statistics.median(shares) if shares else 0.0
        if share > HOST_BOUND_SHARE:
            lines.append(
                f"{name} is host-bound: issuing its kernels took {share:.0%} of each batch's "
                "time, so its img/s measures how fast the CPU launches them more than the GPU; "
                "compare models with --cuda-graphs (each batch one launch) or at a larger batch"
            )
    return lines


def _thread_warnings(choice: ThreadChoice) -> list[str]:
    """What the report must say about the threads: fewer than torch would use, or a retime."""
    if choice.reason in ("load", "starved"):
        return [f"timed with {choice.text()}"]
    return []


def _check_starvation(
    choice: ThreadChoice,
    rounds: _Rounds,
    runners: Mapping[str, Callable[[], Any]],
    schedule: _Schedule,
) -> tuple[ThreadChoice, _Rounds]:
    """After timing at ``choice.threads``: when more than 1 thread ran and the load average seen
    while timing says the machine was full (this process's threads and others' work over its
    CPUs), time the first model at 1 thread. Starved (:data:`STARVATION_FACTOR`): time every
    model again at 1 thread, and return that. Otherwise the timing stands, with the check."""
    seen = [load for load in rounds.loads if load is not None]
    if choice.threads <= 1 or not seen or max(seen) <= choice.cpus:
        return choice, rounds
    name, run = next(iter(runners.items()))
    rate = statistics.median(rounds.samples[name])
    with torch_threads(1):
        probe_schedule = _Schedule(schedule.batch_size, 1, STARVATION_RUNS, None)
        probe = _interleave({name: run}, probe_schedule, lambda: None)
    one_thread_rate = statistics.median(probe.samples[name])
    check = StarvationCheck(
        name, choice.threads, rate, one_thread_rate, one_thread_rate > STARVATION_FACTOR * rate
    )
    if not check.starved:
        return dataclasses.replace(choice, starvation=check), rounds
    with torch_threads(1):
        retimed = _interleave(runners, schedule, lambda: None)
    return dataclasses.replace(choice, threads=1, reason="starved", starvation=check), retimed


def measure_callables(
    runners: Mapping[str, Callable[[], Any]],
    batch_size: int,
    warmup: int = 3,
    runs: int = 10,
    time_budget: float | None = None,
    on_round: Callable[[RoundProgress], None] | None = None,
    extra_environment: Mapping[str, Any] | None = None,
    threads: ThreadChoice | None = None,
) -> ThroughputReport:
    """Images/s of each runner, a call that processes one batch of ``batch_size`` images on the
    CPU (an onnxruntime session, say), timed interleaved like :func:`measure_throughput`.

    ``threads``: the choice the runners were built with (:func:`thread_choice`; an onnxruntime
    session's threads are fixed when it is made, so the caller chooses before making them);
    torch runs at ``threads.threads`` while timing, and the choice is recorded. There is no
    starvation check: the runners cannot be re-threaded. None: torch's count as it is."""
    if not runners:
        raise ValueError("no runners to time")
    schedule = _Schedule(batch_size, warmup, runs, time_budget, on_round)
    if threads is None:
        count = torch.get_num_threads()
        threads = ThreadChoice(count, available_cpus(), load_average(), 0.0, count, "fixed")
    with torch_threads(threads.threads):
        rounds = _interleave(runners, schedule, lambda: None, load_before=threads.load)
    return rounds.report(
        environment("cpu", torch.float32, batch_size)
        | {"threads": threads.threads, "thread_choice": threads.to_json()}
        | dict(extra_environment or {}),
        _thread_warnings(threads),
        threads=threads.threads,
    )


@dataclass(frozen=True)
class _Schedule:
    """What to time: rounds of one batch of ``batch_size`` images per runner, ``warmup`` rounds
    then ``runs`` timed ones, within ``time_budget`` seconds (None: no bound); ``on_round`` is
    told of each round."""

    batch_size: int
    warmup: int
    runs: int
    time_budget: float | None
    on_round: Callable[[RoundProgress], None] | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.runs < 1 or self.warmup < 0:
            raise ValueError("batch_size and runs must be >= 1 and warmup >= 0")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ValueError(f"time_budget must be > 0 seconds, got {self.time_budget}")


@dataclass
class _Rounds:
    """What :func:`_interleave` timed of its schedule, and how far it got."""

    samples: dict[str, list[float]]
    schedule: _Schedule
    warmed: int
    timed: int
    seconds: float
    loads: list[float | None]
    # Per model and timed batch, the share of its time spent before the forward returned (only
    # where the device runs asynchronously: see ``ModelThroughput``).
    host_shares: dict[str, list[float]] = dataclasses.field(default_factory=dict)

    @property
    def warmup(self) -> int:
        return self.schedule.warmup

    @property
    def runs(self) -> int:
        return self.schedule.runs

    @property
    def time_budget(self) -> float | None:
        return self.schedule.time_budget

    def report(
        self, env: dict[str, Any], warnings: list[str], threads: int | None = None
    ) -> ThroughputReport:
        """The report, with the load and budget warnings added to ``warnings`` (``threads``: those
        timing ran with, default torch's count now)."""
        threads = torch.get_num_threads() if threads is None else threads
        warnings = [w for w in (load_warning(self.loads, threads),) if w] + list(warnings)
        if self.timed < self.runs or self.warmed < self.warmup:
            warnings.append(
                f"timing stopped at the {self.time_budget:g} s budget after {self.warmed} of "
                f"{self.warmup} warm-up and {self.timed} of {self.runs} timed rounds; raise "
                "the budget (--bench-seconds) for a tighter interval"
            )
        return ThroughputReport(
            results={
                name: ModelThroughput(samples=v, host_shares=self.host_shares.get(name, []))
                for name, v in self.samples.items()
            },
            environment=env
            | {
                "warmup": self.warmed,
                "runs": self.timed,
                "warmup_requested": self.warmup,
                "runs_requested": self.runs,
                "time_budget_s": self.time_budget,
                "seconds": self.seconds,
                "loadavg_1min": self.loads,
            },
            warnings=warnings,
        )


def _interleave(
    runners: Mapping[str, Callable[[], Any]],
    schedule: _Schedule,
    synchronize: Callable[[], None],
    load_before: float | None = None,
    asynchronous: bool = False,
) -> _Rounds:
    """Warm-up rounds, then timed rounds, each one batch of every runner in turn.
    ``load_before``: the load average already read for the thread choice (else read here).
    ``asynchronous``: the runners return before their work is done (CUDA): each batch's host
    share is recorded too."""
    batch_size, warmup, runs = schedule.batch_size, schedule.warmup, schedule.runs
    time_budget, on_round = schedule.time_budget, schedule.on_round
    samples: dict[str, list[float]] = {name: [] for name in runners}
    host_shares: dict[str, list[float]] = {name: [] for name in runners} if asynchronous else {}
    loads = [load_before if load_before is not None else load_average()]
    began = time.perf_counter()

    def spent() -> bool:
        return time_budget is not None and time.perf_counter() - began >= time_budget

    def report_round(warm: bool, done: int, total: int) -> None:
        if on_round is not None:
            on_round(
                RoundProgress(
                    warmup=warm,
                    done=done,
                    total=total,
                    elapsed=time.perf_counter() - began,
                    budget=time_budget,
                )
            )

    warmed = timed = 0
    # Warm-up round-robin as well, so every runner leaves warm-up with the same caches and
    # allocator state, and one-off costs (cuDNN autotuning, first-call allocation) stay out.
    while warmed < warmup and not (warmed and spent()):
        for run in runners.values():
            run()
        warmed += 1
        report_round(True, warmed, warmup)
    synchronize()
    while timed < runs and not (timed and spent()):
        for name, run in runners.items():
            synchronize()
            start = time.perf_counter()
            run()
            issued = time.perf_counter()
            synchronize()
            seconds = time.perf_counter() - start
            samples[name].append(batch_size / seconds)
            if asynchronous:
                host_shares[name].append((issued - start) / seconds)
        timed += 1
        report_round(False, timed, runs)
    loads.append(load_average())
    seconds = time.perf_counter() - began
    return _Rounds(samples, schedule, warmed, timed, seconds, loads, host_shares)


def _compiled_names(compile: bool | Collection[str], models: Mapping[str, nn.Module]) -> list[str]:
    """The names of the models to compile, in the models' order."""
    if isinstance(compile, bool):
        return list(models) if compile else []
    if isinstance(compile, str):
        raise TypeError("compile takes a bool or a collection of model names, not a string")
    unknown = set(compile) - set(models)
    if unknown:
        raise ValueError(f"compile names models that are not timed: {sorted(unknown)}")
    return [name for name in models if name in compile]


def _compile_pass(run: Callable[[], None], device: torch.device) -> tuple[float, int]:
    """Seconds of a compiled model's first call (compilation and one batch), and the graphs dynamo
    made during it (``unique_graphs`` is a process-wide counter: read before and after)."""
    from torch._dynamo.utils import counters

    graphs_before = int(counters["stats"]["unique_graphs"])
    start = time.perf_counter()
    run()
    _synchronize(device)
    return time.perf_counter() - start, int(counters["stats"]["unique_graphs"]) - graphs_before
