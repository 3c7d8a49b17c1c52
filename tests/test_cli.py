"""Every command through click's CliRunner, and the console script once as a real subprocess."""

import json
import subprocess
import sys
import warnings

import pytest
import torch
from click.testing import CliRunner

from tests.models import FIXTURES
from vitcompress.cli.main import cli

# The first-check subset (pytest -m quick, README): the CLI, bad input and measurement.
pytestmark = pytest.mark.quick

MHA = f"{FIXTURES}:mha_vit"
EINSUM = f"{FIXTURES}:einsum_vit"
FAST = ["--batch-size", "4", "--warmup", "1", "--runs", "2"]


def run(*args):
    result = CliRunner().invoke(cli, list(args))
    return result


def test_inspect_json_on_an_inhouse_model():
    result = run("inspect", "--model", EINSUM, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["prefix_tokens"] == 0 and data["grid"] == [8, 8]
    assert [b["attention"] for b in data["blocks"]] == ["einsum_softmax"] * 4
    assert {"index", "path", "tokens", "dim", "heads", "attention", "grid_ops"} <= set(
        data["blocks"][0]
    )


def test_inspect_table_and_model_args():
    result = run("inspect", "--model", MHA, "--model-arg", "depth=2", "--model-arg", "dim=32")
    assert result.exit_code == 0, result.output
    assert "multihead_attention" in result.output and "layers.1" in result.output
    assert "layers.2" not in result.output


def test_bench_json():
    result = run("bench", "--model", MHA, *FAST, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["params"] == sum(
        p.numel()
        for p in __import__("tests.fixtures.inhouse", fromlist=["x"]).mha_vit().parameters()
    )
    assert data["macs"] > 0 and data["throughput"] > 0
    assert data["environment"]["batch_size"] == 4


def test_apply_writes_an_artifact_every_command_loads(tmp_path):
    out = tmp_path / "mha_dtps"
    result = run(
        "apply",
        "--model",
        MHA,
        "--variant",
        "dtps",
        "--keep",
        "0.5",
        "--locs",
        "1,2",
        "--out",
        str(out),
        *FAST,
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["tokens_per_block"] == [65, 33, 17, 17]
    assert data["tokens_leaving_block"] == [65, 33, 17, 17]  # dTPS reduces before its blocks
    assert data["compressed"]["macs"] < data["base"]["macs"]
    assert data["compressed"]["params"] > data["base"]["params"]  # the predictors
    assert data["base"]["throughput"] > 0 and data["compressed"]["throughput"] > 0
    assert (out / "model.safetensors").is_file() and (out / "vitcompress.json").is_file()

    bench = run("bench", "--model", str(out), "--no-throughput", "--json")
    assert bench.exit_code == 0, bench.output
    assert json.loads(bench.output)["macs"] == data["compressed"]["macs"]
    inspect = run("inspect", "--model", str(out), "--json")
    assert inspect.exit_code == 0, inspect.output


def test_apply_table_output():
    result = run(
        "apply", "--model", EINSUM, "--variant", "evit", "--keep", "0.5", "--no-throughput"
    )
    assert result.exit_code == 0, result.output
    # default locations 1, 2, 3; EViT keeps ceil(0.5 n) and adds its fused token
    text = " ".join(result.output.split())
    # each reduction shows at its own block (inside it, for EViT), from the tokens the block
    # before handed on to what the block hands on: the last location's too
    assert "tokens per block: 64 64→33 33→18 18→10" in text


def test_tokens_per_block_shows_each_reduction_at_the_block_that_makes_it():
    from vitcompress.cli.model_commands import tokens_text

    base = [197] * 5
    # Before blocks 1 and 3 (dTPS): the blocks take fewer tokens in.
    before = [197, 138, 138, 97, 97]
    assert tokens_text(base, before, before) == "197 197→138 138 138→97 97"
    # Inside blocks 1 and 3 (eTPS): they take 197 and 139 in and hand on fewer; the entering
    # counts alone would put each arrow one block late.
    entering, leaving = [197, 197, 139, 139, 98], [197, 139, 139, 98, 98]
    assert tokens_text(base, entering, leaving) == "197 197→139 139 139→98 98"
    # ToMe from block 3: the last block's merge shows too.
    assert tokens_text(base, [197] * 4 + [183], [197] * 3 + [183, 169]) == (
        "197 197 197 197→183 183→169"
    )
    # A pyramid's new stage starts from the base's count; an unknown output (None, a windowed
    # block) falls back to the tokens entering.
    assert tokens_text([784, 784, 196], [784, 548, 137], [784, None, 137]) == "784 784→548 196→137"
    # Blocks that each form a stage (a position table added before every block): the tokens
    # are restored between them, so each reduction starts again from the base's count.
    stages = [0, 1, 2, 3]
    assert tokens_text([65] * 4, [65] * 4, [65, 46, 46, 46], stages) == "65 65→46 65→46 65→46"


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "--model", "deit_smal"], "closest: deit_small_patch16_224"),
        (["apply", "--model", MHA, "--keep", "1.5", "--no-throughput"], "--keep must be in (0, 1]"),
        (["apply", "--model", MHA, "--keep", "abc", "--no-throughput"], "--keep must be a number"),
        (["apply", "--model", MHA, "--locs", "9", "--no-throughput"], "out of range"),
        (["apply", "--model", MHA, "--locs", "2,1", "--no-throughput"], "strictly increasing"),
        (["apply", "--model", MHA, "--locs", "1,1", "--no-throughput"], "strictly increasing"),
        (["inspect", "--model", f"{FIXTURES}:nope"], "nope"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert message in lines[0]
    assert "Traceback" not in result.output


def test_a_checkpoint_for_another_model_fails_cleanly(tmp_path):
    from tests.fixtures.inhouse import einsum_vit

    path = tmp_path / "other.pt"
    torch.save(einsum_vit().state_dict(), path)
    result = run("inspect", "--model", MHA, "--checkpoint", str(path))
    assert result.exit_code == 2
    assert "does not fit" in result.output and "Traceback" not in result.output


def test_console_script_runs_as_a_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "vitcompress.cli.main", "inspect", "--model", EINSUM, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["blocks"][0]["attention"] == "einsum_softmax"
    bad = subprocess.run(
        [sys.executable, "-m", "vitcompress.cli.main", "inspect", "--model", "deit_smal"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown model")
    assert "Traceback" not in bad.stderr


def test_help_lists_only_the_gates_a_command_accepts():
    bench = run("bench", "--help").output
    assert "--max-gmacs" in bench and "--bench-seconds" in bench
    assert "--min-speedup" not in bench and "--max-acc-drop" not in bench
    apply = run("apply", "--help").output
    assert "--min-speedup" in apply and "--max-acc-drop" not in apply
    evaluate = run("eval", "--help").output
    assert all(flag in evaluate for flag in ("--min-speedup", "--max-acc-drop", "--max-gmacs"))


def test_apply_speedup_is_the_paired_median_with_its_interval(tmp_path):
    result = run(
        "apply",
        "--model",
        MHA,
        "--variant",
        "etps",
        "--keep",
        "0.5",
        "--batch-size",
        "2",
        "--warmup",
        "1",
        "--runs",
        "6",
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["speedup_pairs"] == 6 and data["environment"]["runs"] == 6
    low, high = data["speedup_ci95"]
    assert low <= data["speedup"] <= high
    assert data["speedup_ratio_of_medians"] == pytest.approx(
        data["compressed"]["throughput"] / data["base"]["throughput"]
    )
    table = run(
        "apply",
        "--model",
        MHA,
        "--variant",
        "etps",
        "--keep",
        "0.5",
        "--batch-size",
        "2",
        "--warmup",
        "0",
        "--runs",
        "2",
    )
    # One story: the ratio row divides the medians printed above it, and the paired speed-up from
    # 2 rounds says it has no interval instead of standing bare beside the rates.
    assert table.exit_code == 0, table.output
    rows = {line.split()[0]: line.split() for line in table.output.splitlines() if line.strip()}
    base_rate, compressed_rate = float(rows["base"][-1]), float(rows["compressed"][-1])
    assert rows["ratio"][-1].endswith("x")
    assert float(rows["ratio"][-1][:-1]) == pytest.approx(compressed_rate / base_rate, abs=0.06)
    assert "throughput: each model's median over 2 rounds" in table.output
    assert "from 2 rounds: too few for a 95% interval (it needs 5" in table.output


def test_bench_seconds_bounds_the_timing_and_warns_on_stderr():
    result = run(
        "bench",
        "--model",
        MHA,
        "--batch-size",
        "2",
        "--warmup",
        "0",
        "--runs",
        "100000",
        "--bench-seconds",
        "0.2",
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)  # stdout stays pure JSON
    assert 1 <= data["environment"]["runs"] < 100000
    assert data["environment"]["warnings"] == [
        line.removeprefix("warning: ") for line in result.stderr.splitlines()
    ]
    assert "0.2 s budget" in result.stderr


def test_a_busy_machine_is_warned_about_on_stderr(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setattr("vitcompress.measure.throughput.load_average", lambda: threads + 3.0)
    result = run("bench", "--model", MHA, *FAST, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["environment"]["loadavg_1min"] == [threads + 3.0] * 2
    # The timer fits its threads to the free cores (none here: 1 thread) and says so too.
    choice = json.loads(result.stdout)["environment"]["thread_choice"]
    load_line, *threads_lines = result.stderr.splitlines()
    assert load_line.startswith(
        "warning: the 1-minute load average was "
        f"{threads + 3.0:.1f} with {choice['threads']} torch threads"
    )
    fewer = choice["threads"] < choice["asked"]
    assert [line.startswith("warning: timed with ") for line in threads_lines] == [True] * fewer


def test_progress_goes_to_stderr_only_when_asked_off_a_terminal(tmp_path):
    quiet = run("apply", "--model", MHA, "--variant", "etps", *FAST, "--json")
    assert quiet.exit_code == 0 and quiet.stderr == ""  # not a terminal: nothing by default
    plain = run(
        "--progress", "plain", "apply", "--model", MHA, "--variant", "etps", *FAST, "--json"
    )
    assert plain.exit_code == 0, plain.output
    json.loads(plain.stdout)
    steps = [line for line in plain.stderr.splitlines() if not line.startswith("  ")]
    assert steps == [
        f"loading {MHA} ...",
        f"compressing {MHA} with etps ...",
        "counting MACs of base ...",
        "counting MACs of compressed ...",
        "timing base and compressed (batch 4, at most 60 s) ...",
    ]
    rounds = [line.strip() for line in plain.stderr.splitlines() if line.startswith("  ")]
    assert rounds[0].startswith("warm-up round 1/1") and rounds[-1].startswith("timed round 2/2")


def test_the_spinner_shows_each_step_on_a_terminal():
    import io

    from rich.console import Console

    from vitcompress.cli.status import ConsoleStatus
    from vitcompress.status import detail, reporting, step, warn

    screen = io.StringIO()
    status = ConsoleStatus(Console(file=screen, force_terminal=True, width=100), "auto")
    with reporting(status), step("counting MACs of base"):
        detail("timed round 1/3")
        warn("careful")
    assert status.spinner is None  # stopped with the last step
    text = screen.getvalue()
    assert "counting MACs of base" in text and "timed round 1/3" in text and "careful" in text


PYRAMID = f"{FIXTURES}:tiny_pyramid"


def test_inspect_off_a_terminal_cuts_nothing(monkeypatch):
    from vitcompress.cli.app import console

    monkeypatch.setattr(console, "width", 80)
    result = run("inspect", "--model", PYRAMID)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"{PYRAMID}  input (3, 64, 64)")  # the header on one line
    data = json.loads(run("inspect", "--model", PYRAMID, "--json").output)
    for block in data["blocks"]:
        [row] = [line for line in lines if f" {block['path']} " in line]
        for op in block["grid_ops"]:
            assert f"{op['kind']} {op['path']} {op['grid'][0]}x{op['grid'][1]}" in row


def test_inspect_on_a_narrow_terminal_folds_instead_of_cutting(monkeypatch):
    from vitcompress.cli.app import console

    monkeypatch.setattr(console, "width", 70)
    monkeypatch.setattr(console, "_force_terminal", True)
    monkeypatch.setattr(console, "_color_system", None)
    result = run("inspect", "--model", PYRAMID)
    assert result.exit_code == 0, result.output
    assert "…" not in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 70
    cells = "".join(
        line.split("│")[1].strip() for line in result.output.splitlines() if line.count("│") >= 7
    )
    assert "pyramid.0.blocks.0" in cells  # folded over two lines, every character kept


@pytest.mark.parametrize(
    "stages, cls, text",
    [
        ([1], True, "prefix tokens 1 (cls)"),
        ([0], False, "prefix tokens 0"),
        ([4], False, "prefix tokens 4 (no cls)"),
        ([0, 0, 1], True, "prefix tokens per stage 0, 0, 1 (cls)"),  # CvT
    ],
)
def test_inspect_says_which_prefix_tokens_there_are(stages, cls, text):
    from vitcompress.cli.model_commands import prefix_text

    model_map = {"stages": [{"prefix_tokens": n} for n in stages], "cls_token": cls}
    assert prefix_text(model_map) == text


def test_inspect_of_a_pyramid_claims_no_cls():
    result = run("inspect", "--model", PYRAMID)
    header = result.output.splitlines()[0]
    assert "prefix tokens 0  grid" in header and "cls" not in header


TINY_VIT = [
    arg
    for key, value in dict(img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=2).items()
    for arg in ("--model-arg", f"{key}={value}")
]


@pytest.mark.parametrize("plan, warned", [(("dtps", "0.99"), True), (("etps", "0.5"), False)])
def test_apply_warns_when_the_compressed_model_is_no_cheaper(plan, warned, caplog):
    """dTPS keeping 15 of 16 tokens pays its predictor for one token: more MACs than the base."""
    variant, keep = plan
    result = run(
        "apply",
        "--model",
        "vit_tiny_patch16_224",
        *TINY_VIT,
        "--variant",
        variant,
        "--keep",
        keep,
        "--no-throughput",
        "--json",
    )
    assert result.exit_code == 0, result.output
    ratio = json.loads(result.stdout)["macs_ratio"]
    assert (ratio >= 1.0) is warned
    message = f"the compressed model needs {ratio:.3f} of the base's GMACs"
    assert (message in caplog.text) is warned


ENCODER_SOURCE = """
import warnings

import torch
from torch import nn


class EncoderViT(nn.Module):
    # Pre-norm layers: torch's nested-tensor fast path cannot take them, and says so when built.
    default_input_size = (3, 32, 32)

    def __init__(self, dim=32, depth=2, num_classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 8, 8)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, 0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], dim=1)
        return self.head(self.encoder(tokens)[:, 0])


def encoder_vit():
    warnings.warn("the factory's own warning")
    return EncoderViT()
"""


def test_torchs_nested_tensor_notice_is_silenced_and_nothing_else(tmp_path):
    path = tmp_path / "encoder_vit.py"
    path.write_text(ENCODER_SOURCE)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        # torch itself still warns: the silencing is vitcompress's, around its model loading.
        torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(32, 4, norm_first=True), 1)
        assert ["enable_nested_tensor is True" in str(w.message) for w in seen] == [True]
        seen.clear()
        result = run("apply", "--model", f"{path}:encoder_vit", "--keep", "0.5", "--no-throughput")
    assert result.exit_code == 0, result.output
    messages = [str(w.message) for w in seen]
    assert not [m for m in messages if "enable_nested_tensor" in m], messages
    assert "the factory's own warning" in messages
