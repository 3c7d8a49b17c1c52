"""Tests of vitcompress.measure: parameter count, MACs in the papers' convention, throughput."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vitcompress.measure import (
    RoundProgress,
    ThroughputReport,
    count_macs,
    count_params,
    environment,
    macs_by_module,
    measure_throughput,
    paired_ratio,
)

# The first-check subset (pytest -m quick, README): the CLI, bad input and measurement.
pytestmark = pytest.mark.quick

# --------------------------------------------------------------------------------------------------
# A tiny hand-written ViT whose MACs can be written down by hand
# --------------------------------------------------------------------------------------------------

IMG, PATCH, IN_CH, DIM, HEADS, MLP, DEPTH, CLASSES = 32, 8, 3, 32, 2, 64, 2, 10


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, use_sdpa: bool) -> None:
        super().__init__()
        self.heads = heads
        self.use_sdpa = use_sdpa
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        if self.use_sdpa:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            attn = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
            out = attn.softmax(dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, use_sdpa: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = Attention(DIM, HEADS, use_sdpa)
        self.norm2 = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, MLP)
        self.fc2 = nn.Linear(MLP, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyViT(nn.Module):
    def __init__(self, use_sdpa: bool = True) -> None:
        super().__init__()
        tokens = (IMG // PATCH) ** 2 + 1
        self.patch_embed = nn.Conv2d(IN_CH, DIM, PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, DIM))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, DIM) * 0.02)
        self.blocks = nn.Sequential(*[Block(use_sdpa) for _ in range(DEPTH)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def analytic_macs() -> tuple[int, int]:
    """(matmul/conv MACs, LayerNorm ops) of TinyViT at batch 1, by hand."""
    patches = (IMG // PATCH) ** 2
    n = patches + 1  # + class token
    patch_embed = patches * (IN_CH * PATCH * PATCH) * DIM
    qkv = n * DIM * 3 * DIM
    q_kt = HEADS * n * n * (DIM // HEADS)  # per head: (n x d) @ (d x n)
    attn_v = HEADS * n * n * (DIM // HEADS)  # per head: (n x n) @ (n x d)
    proj = n * DIM * DIM
    fc1 = n * DIM * MLP
    fc2 = n * MLP * DIM
    head = DIM * CLASSES  # class token only
    matmuls = patch_embed + DEPTH * (qkv + q_kt + attn_v + proj + fc1 + fc2) + head
    # fvcore's convention: 5 ops per element for an affine LayerNorm; two per block + final norm.
    layer_norms = (2 * DEPTH + 1) * 5 * n * DIM
    return matmuls, layer_norms


INPUT = (IN_CH, IMG, IMG)


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


def test_params_deit_tiny_exact() -> None:
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False)
    # timm reports params as the plain sum over model.parameters(); 5,717,416 is also what the
    # architecture gives by hand (patch embed, cls/pos, 12 blocks, final norm, 1000-class head).
    assert count_params(model) == sum(p.numel() for p in model.parameters()) == 5_717_416


def test_params_shared_counted_once() -> None:
    a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    b.weight = a.weight
    assert count_params(nn.Sequential(a, b)) == 16


# --------------------------------------------------------------------------------------------------
# MACs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "gmacs"),
    [("deit_tiny_patch16_224", 1.26), ("deit_small_patch16_224", 4.61)],
)
def test_macs_deit_match_papers(name: str, gmacs: float) -> None:
    model = timm.create_model(name, pretrained=False)
    assert count_macs(model, (3, 224, 224)) / 1e9 == pytest.approx(gmacs, rel=0.01)


def test_macs_tiny_vit_analytic() -> None:
    matmuls, layer_norms = analytic_macs()
    assert count_macs(TinyViT(use_sdpa=False), INPUT) == matmuls + layer_norms


def test_sdpa_counted_like_explicit_attention() -> None:
    torch.manual_seed(0)
    sdpa, explicit = TinyViT(use_sdpa=True), TinyViT(use_sdpa=False)
    assert count_macs(sdpa, INPUT) == count_macs(explicit, INPUT) == sum(analytic_macs())


def test_sdpa_cpu_kernel_has_formula() -> None:
    # Guards against the equality above passing only because SDPA fell back to bmm: on CPU the
    # fused kernel must run and be counted (2 FLOPs per MAC, both products).
    q = torch.randn(1, 2, 5, 8)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, q, q)
    counts = counter.get_flop_counts()["Global"]
    assert counts == {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: 2 * 2 * (2 * 5 * 5 * 8)
    }


def test_macs_by_module() -> None:
    model = TinyViT()
    per_module = macs_by_module(model, INPUT)
    n = (IMG // PATCH) ** 2 + 1
    assert per_module[""] == count_macs(model, INPUT)
    assert per_module["blocks.0.norm1"] == 5 * n * DIM
    assert per_module["blocks.0.fc1"] == n * DIM * MLP
    assert per_module["head"] == DIM * CLASSES
    assert list(per_module)[0] == ""


def test_macs_data_dependent_forward() -> None:
    class KeepTopK(nn.Module):
        """Keeps the k tokens with the largest norm: topk + gather + index scatter, run eagerly."""

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(DIM, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tokens = x.flatten(1).reshape(1, -1, DIM)  # (1, 3 * IMG * IMG / DIM, DIM)
            idx = tokens.norm(dim=-1).topk(4, dim=1).indices
            kept = tokens.gather(1, idx.unsqueeze(-1).expand(-1, -1, DIM))
            out = torch.zeros_like(tokens)
            out[:, idx[0]] = self.fc(kept)
            return out

    assert count_macs(KeepTopK(), INPUT) == 4 * DIM * DIM


def test_training_flags_restored() -> None:
    model = TinyViT().train()
    model.blocks[0].attn.eval()  # mixed flags must survive, not just the root's
    before = {name: m.training for name, m in model.named_modules()}
    count_macs(model, INPUT)
    macs_by_module(model, INPUT)
    measure_throughput({"m": model}, INPUT, batch_size=2, warmup=0, runs=1)
    assert {name: m.training for name, m in model.named_modules()} == before


# --------------------------------------------------------------------------------------------------
# Throughput
# --------------------------------------------------------------------------------------------------


class Logged(nn.Module):
    def __init__(self, name: str, log: list[str], inner: nn.Module) -> None:
        super().__init__()
        self.name, self.log, self.inner = name, log, inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(self.name)
        return self.inner(x)


def test_throughput_interleaved_and_report() -> None:
    log: list[str] = []
    models = {"a": Logged("a", log, TinyViT()), "b": Logged("b", log, TinyViT(use_sdpa=False))}
    report = measure_throughput(models, INPUT, batch_size=4, warmup=2, runs=5)

    assert isinstance(report, ThroughputReport)
    for result in report.results.values():
        assert len(result.samples) == 5
        assert all(s > 0 for s in result.samples)
        assert result.min <= result.median <= result.max
    # Round-robin: warm-up and timed batches alternate between the models.
    assert log == ["a", "b"] * (2 + 5)
    assert report.ratio("a", "b") == pytest.approx(
        report.results["a"].median / report.results["b"].median
    )

    data = json.loads(json.dumps(report.to_json()))
    env = data["environment"]
    for key in ("device", "device_name", "dtype", "threads", "torch", "batch_size"):
        assert key in env
    assert env["batch_size"] == 4
    assert env["threads"] == torch.get_num_threads()
    assert env["torch"] == torch.__version__
    assert env["dtype"] == "float32"
    assert set(data["results"]) == {"a", "b"}
    assert len(data["results"]["a"]["samples"]) == 5


def test_throughput_amp_rejected_on_cpu() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        measure_throughput({"m": TinyViT()}, INPUT, amp=True, dtype=torch.bfloat16)


def test_environment_fields() -> None:
    env = environment()
    assert env["device"] == "cpu" and env["threads"] >= 1 and env["device_name"]


# --------------------------------------------------------------------------------------------------
# Paired ratios, time budget, load warning
# --------------------------------------------------------------------------------------------------


def test_paired_ratio_cancels_a_slow_spell_that_medians_do_not() -> None:
    # A is twice as fast as B in every round. A slow spell of the machine began during round 4,
    # after A's batch and before B's: the ratio of medians says A is slower, the pairs do not.
    a = [10.0, 10.0, 10.0, 4.0, 4.0, 4.0, 4.0]
    b = [5.0, 5.0, 5.0, 5.0, 2.0, 2.0, 2.0]
    assert statistics.median(a) / statistics.median(b) == pytest.approx(0.8)
    paired = paired_ratio(a, b)
    assert paired.median == pytest.approx(2.0) and paired.pairs == 7
    assert paired.interval == pytest.approx((2.0, 2.0))


def test_a_paired_ratio_without_an_interval_says_so_and_is_never_bare() -> None:
    # The finding: 3 rounds printed "1.11x" beside rates whose own ratio was below 1.
    few = paired_ratio([5.4, 8.0, 5.6], [5.8, 7.0, 5.0])
    assert few.interval is None
    assert few.text() == f"{few.median:.2f}x (3 rounds, no interval)"
    line = few.summary(statistics.median([5.4, 8.0, 5.6]) / statistics.median([5.8, 7.0, 5.0]))
    assert line.startswith(f"speed-up {few.median:.2f}x from 3 rounds: too few for a 95% interval")
    assert "neither it nor the ratio of the medians is a measured difference" in line
    # The rates' own ratio (0.97x) lies below 1 and the pairs' median (1.12x) above: said so.
    assert "the ratio of the medians (0.97x) lies on the other side of 1" in line


def test_a_paired_summary_names_its_statistic_and_interval() -> None:
    a = [10.0, 10.0, 10.0, 4.0, 4.0, 4.0, 4.0]
    b = [5.0, 5.0, 5.0, 5.0, 2.0, 2.0, 2.0]
    paired = paired_ratio(a, b)
    line = paired.summary(statistics.median(a) / statistics.median(b))
    assert line.startswith("speed-up 2.00x: the median of 7 per-round ratios")
    assert "95% interval [2.00, 2.00]" in line and "(0.80x) lies on the other side of 1" in line
    # Medians on the same side of 1 as the pairs: nothing to reconcile.
    assert "other side" not in paired.summary(1.5) and "other side" not in paired.summary()


def test_paired_ratio_interval_needs_enough_pairs_and_brackets_the_median() -> None:
    few = paired_ratio([2.0, 3.0], [1.0, 1.0])
    assert few.interval is None and few.pairs == 2 and few.to_json()["ci95"] is None
    noisy = paired_ratio([1.0 + 0.1 * (i % 4) for i in range(12)], [1.0] * 12)
    low, high = noisy.interval
    assert low <= noisy.median <= high and low < high
    assert noisy.to_json() == {"median": noisy.median, "ci95": [low, high], "pairs": 12}
    with pytest.raises(ValueError, match="equal lengths"):
        paired_ratio([1.0], [1.0, 2.0])


class Sleepy(nn.Module):
    """A model whose forward takes a while whatever the machine: for budgets."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.lin = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.lin(x.mean(dim=(2, 3)))


def test_time_budget_stops_the_rounds_and_says_so() -> None:
    rounds: list[RoundProgress] = []
    report = measure_throughput(
        {"a": Sleepy(0.02), "b": Sleepy(0.02)},
        INPUT,
        batch_size=1,
        warmup=50,
        runs=1000,
        time_budget=0.3,
        on_round=rounds.append,
    )
    env = report.environment
    timed = len(report.results["a"].samples)
    assert 1 <= timed < 1000 and env["runs"] == timed and env["runs_requested"] == 1000
    assert 1 <= env["warmup"] < 50 and env["time_budget_s"] == 0.3
    assert [r.warmup for r in rounds] == [True] * env["warmup"] + [False] * timed
    assert [r.done for r in rounds if not r.warmup] == list(range(1, timed + 1))
    [warning] = report.warnings
    assert "0.3 s budget" in warning and f"{timed} of 1000 timed rounds" in warning


def test_a_spent_budget_still_times_one_round() -> None:
    report = measure_throughput(
        {"m": Sleepy(0.01)}, INPUT, batch_size=1, warmup=3, runs=5, time_budget=1e-9
    )
    assert report.environment["warmup"] == 1 and len(report.results["m"].samples) == 1
    with pytest.raises(ValueError, match="time_budget"):
        measure_throughput({"m": Sleepy(0.0)}, INPUT, time_budget=0)


def test_busy_machine_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    threads = torch.get_num_threads()
    loads = iter([threads + 0.5, threads + 2.0])
    monkeypatch.setattr("vitcompress.measure.throughput.load_average", lambda: next(loads))
    report = measure_throughput({"m": TinyViT()}, INPUT, batch_size=2, warmup=0, runs=1)
    # The timer fits its threads to the free cores (fewer under this load) and says so too.
    chosen = report.environment["thread_choice"]["threads"]
    warning, *thread_lines = report.warnings
    assert f"load average was {threads + 2.0:.1f} with {chosen} torch threads" in warning
    assert all("thread" in line for line in thread_lines)
    assert report.environment["loadavg_1min"] == [threads + 0.5, threads + 2.0]
    monkeypatch.setattr("vitcompress.measure.throughput.load_average", lambda: float(threads))
    # Equal to the threads timed with (fixed here, so no choice lowers them) is not more.
    quiet = measure_throughput(
        {"m": TinyViT()}, INPUT, batch_size=2, warmup=0, runs=1, threads=threads
    )
    assert quiet.warnings == []


def test_macs_of_a_model_that_feeds_a_parameter_to_a_module():
    """CaiT hands its class-token parameter to the class-attention blocks as it is; counting
    used to fail there ("Expected gradient function to be set"). Gradient flags are restored."""
    import timm

    from tests.models import SMALL
    from vitcompress.measure import count_macs

    model = timm.create_model("cait_xxs24_224", **{**SMALL, "depth": 2})
    model.pos_embed.requires_grad_(False)  # a mixed set of flags, to see each one restored
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    macs = count_macs(model, (3, 32, 32))
    assert {name: p.requires_grad for name, p in model.named_parameters()} == flags
    for param in model.parameters():  # frozen by hand, the count has always worked
        param.requires_grad_(False)
    assert macs == count_macs(model, (3, 32, 32)) > 0
