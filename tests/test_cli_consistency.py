"""One command line, consistent across its commands: the same options take the same values, help
offers only what a command accepts, outputs are checked before any work, and what is printed
reads as what happened (tokens per block, the fine-tune's images/s and its resume line)."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner
from torch.utils.data import Dataset

from tests.models import FIXTURES
from tests.test_finetune import _config, _data, _models
from vitcompress.cli.main import cli
from vitcompress.cli.model_commands import tokens_text
from vitcompress.cli.options import AMP_DTYPES, timing_from_options
from vitcompress.errors import UserError
from vitcompress.training import metrics as finetune_metrics
from vitcompress.training.run_directory import MetricsLog
from vitcompress.workflows.finetune import finetune

MHA = f"{FIXTURES}:mha_vit"
MODEL_COMMANDS = ("inspect", "bench", "apply", "eval", "finetune", "export", "search", "visualize")


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def _params(command: str) -> dict[str, click.Parameter]:
    return {param.name: param for param in cli.commands[command].params}


def _help(command: str) -> str:
    result = run(command, "--help")
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def _model_help(command: str) -> str:
    param = _params(command)["model_spec"]
    assert isinstance(param, click.Option)
    return param.help or ""


@pytest.mark.parametrize("command", [c for c in MODEL_COMMANDS if c not in ("visualize",)])
def test_model_help_names_every_form_the_command_loads(command):
    text = _model_help(command)
    for form in ("timm name", "hf-hub:", "file.py:factory", "module:factory", "save_pretrained"):
        assert form in text, (command, text)
    # search refuses a compressed model, so its help does not offer one; the others take one.
    assert ("compressed model directory" in text) == (command != "search"), (command, text)


def test_visualize_offers_only_a_compressed_model():
    assert _model_help("visualize") == "a compressed model directory."


def test_every_plan_command_has_one_default_variant():
    defaults = {c: _params(c)["variant"].default for c in ("apply", "finetune")}
    assert defaults == {"apply": "etps", "finetune": "etps"}


@pytest.mark.parametrize("command", ["bench", "apply", "eval", "search", "finetune"])
def test_amp_takes_bf16_or_fp16_in_every_command(command):
    amp = _params(command)["amp"]
    assert isinstance(amp.type, click.Choice) and list(amp.type.choices) == ["bf16", "fp16"]
    assert "--amp [bf16|fp16]" in _help(command)


def _timing(**given):
    values = dict(
        batch_size=4,
        device="cuda",
        dtype="float32",
        warmup=1,
        runs=2,
        bench_seconds=1.0,
        use_compile=False,
        compile_mode=None,
        fused_kernels=False,
        amp=None,
        no_throughput=False,
    )
    return timing_from_options(**{**values, **given})


def test_amp_autocasts_float32_models_to_the_dtype_named():
    for amp, dtype in AMP_DTYPES.items():
        timing = _timing(amp=amp)
        assert timing.amp and timing.dtype == dtype
    assert not _timing().amp and _timing().dtype == "float32"
    # The older spelling, a bare --amp with --dtype, still means the same.
    legacy = _timing(amp="in-dtype", dtype="bfloat16")
    assert legacy.amp and legacy.dtype == "bfloat16"
    with pytest.raises(UserError, match="contradicts it"):
        _timing(amp="bf16", dtype="float16")


def test_a_bare_amp_without_a_dtype_is_one_line(monkeypatch):
    monkeypatch.setattr("vitcompress.cli.options.check_device", lambda device: device)  # a GPU
    result = run("bench", "--model", MHA, "--amp", "--dtype", "float32", "--device", "cuda")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: --amp autocasts to bf16 or fp16: write --amp bf16 or --amp fp16"
    ]


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["--device", "foo"],
            "error: --device foo: not a device name (cpu, cuda, cuda:1, mps ...)",
        ),
        (
            ["--amp", "bf16"],
            "error: --amp times models under CUDA's autocast: it needs --device cuda, not cpu",
        ),
    ],
)
@pytest.mark.parametrize("command", ["bench", "apply"])
def test_a_device_or_amp_this_machine_cannot_run_is_one_line_before_loading(
    monkeypatch, command, args, line
):
    loads = []
    monkeypatch.setattr("vitcompress.workflows.inputs.ModelRequest.load", loads.append)
    result = run(command, "--model", MHA, *args)
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [line]
    assert not loads


def test_a_cuda_device_on_a_machine_without_one_is_one_line(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    result = run("eval", "--model", MHA, "--data", "fashion-mnist", "--device", "cuda:0")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: --device cuda:0: this machine has no CUDA GPU torch can use"
    ]


@pytest.mark.parametrize("command", ["eval", "finetune"])
def test_workers_has_one_name(command):
    params = _params(command)
    assert "workers" in params and "num_workers" not in params
    assert "--workers" in _help(command) and "--num-workers" not in _help(command)


def test_search_uses_the_group_progress_option_only():
    assert not any("--progress" in getattr(p, "opts", []) for p in cli.commands["search"].params)
    assert "--progress" in [opt for p in cli.params for opt in getattr(p, "opts", [])]


def test_a_text_file_as_model_is_told_it_is_not_a_model(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model\n")
    line = run("inspect", "--model", str(notes)).stderr.strip()
    assert line.startswith(f"error: '{notes}' is a file but not a model") and "hf-hub" not in line
    hub = run("inspect", "--model", "facebook/no-such-vit").stderr
    assert "for a Hugging Face Hub model write hf-hub:facebook/no-such-vit" in hub


@pytest.mark.parametrize(
    "args",
    [
        ["apply", "--out", "{blocked}/art"],
        ["bench", "--batch-sizes", "1,2", "--plot", "{blocked}/sweep.png"],
        ["export", "--format", "onnx", "--out", "{blocked}/m.onnx"],
        ["search", "--data", "fashion-mnist", "--max-gmacs-ratio", "0.6", "--out", "{blocked}/s"],
        ["finetune", "--data", "fashion-mnist", "--out", "{blocked}/ft"],
        ["visualize", "--image", "x.png", "--out", "{blocked}/v.png"],
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path, args):
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a file where a folder is needed: no one can write below it
    # The model does not exist: refused for the output first means no loading, let alone timing.
    args = [a.replace("{blocked}", str(blocked)) for a in args]
    result = run(args[0], "--model", "deit_smal", *args[1:])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{blocked} is a file, not a folder" in lines[0], lines


@pytest.mark.parametrize(
    ("args", "said"),
    [(["apply", "--out"], "--out is empty; name a folder"),
     (["export", "--format", "onnx", "--out"], "--out is empty; name a file")],
)  # fmt: skip
def test_an_empty_output_is_refused_not_taken_as_the_current_folder(args, said):
    result = run(args[0], "--model", "deit_smal", *args[1:], "")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: {said}"]


def test_report_checks_its_outputs_first(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    result = run("report", str(tmp_path / "missing.json"), "--out-md", str(blocked / "t.md"))
    assert result.exit_code == 2 and "is a file, not a folder" in result.stderr


def test_tokens_per_block_shows_a_reduction_only_where_it_happens():
    assert tokens_text([197] * 5, [197, 197, 139, 139, 97]) == "197 197 197→139 139 139→97"
    # ToMe reduces in every block from its first location.
    assert tokens_text([10] * 4, [10, 8, 6, 4]) == "10 10→8 8→6 6→4"
    # A pyramid's new stage starts from the base's count, which is no reduction.
    assert tokens_text([64, 64, 16, 16], [64, 44, 16, 11]) == "64 64→44 16 16→11"


class _TimedLoading(Dataset):
    """Each image costs fake seconds of loading, unevenly (1, 2 or 3), on the run's clock."""

    def __init__(self, inner: Dataset, clock: list[float]) -> None:
        self.inner, self.clock, self.calls = inner, clock, 0

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]

    def __getitem__(self, index: int):
        self.calls += 1
        self.clock[0] += 1 + self.calls % 3
        return self.inner[index]


def test_the_logged_rate_covers_the_interval_since_the_last_log_line(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(finetune_metrics, "_clock", lambda: clock[0])
    written: list[tuple[dict, float]] = []
    write = MetricsLog.write

    def write_and_time(self, record):
        written.append((dict(record), clock[0]))
        write(self, record)

    monkeypatch.setattr(MetricsLog, "write", write_and_time)
    student, teacher = _models()
    data = _TimedLoading(_data(), clock)
    batch = 2
    finetune(student, teacher, data, None, tmp_path / "run", _config(batch_size=batch, log_every=3))
    steps = [(r, t) for r, t in written if r["type"] == "step"]
    assert [r["step"] for r, _ in steps] == [1, 3, 6, 9, 12, 15]
    for (record, at), (before, since) in zip(written[1:], written, strict=False):
        if record["type"] != "step":
            continue
        images = (record["step"] - before["step"]) * batch
        # images over the wall time since the previous line, loading included
        assert record["img_per_s"] == pytest.approx(images / (at - since)), record
    # Uneven loading: a window of several steps is not its last step's rate.
    assert len({round(r["img_per_s"], 6) for r, _ in steps}) > 1


def test_search_table_shows_percentages_and_names_the_plan(capsys):
    from vitcompress.cli import search_command

    row = {
        "variant": "etps",
        "locs": [1, 2],
        "keep": [0.7, 0.7],
        "gmacs": 0.5,
        "macs_ratio": 0.6,
        "kl": 0.01,
        "agreement": 0.875,
        "accuracy": 0.5,
    }
    data = {
        "model": "m",
        "base_gmacs": 1.0,
        "budget": {"gmacs": 0.6, "asked": "0.6 of the GMACs"},
        "strategy": "exhaustive",
        "scored": 1,
        "from_cache": 0,
        "space": {"budget_matched": 1, "left_out": {}},
        "pareto": [row],
        "best": row,
        "paper_default": None,
        "macs_check": {"sample": [1], "max_relative_error": 0.0},
        "files": {"recipe": "out/plan.yaml", "json": "out/search.json"},
    }
    search_command._print_table(data)
    text = capsys.readouterr().out
    assert "agree (%)" in text and "top-1 (%)" in text and "note" in text
    assert "87.50" in text and "50.00" in text and "0.8750" not in text
    assert "plan: out/plan.yaml" in text and "recipe:" not in text


def test_apply_prints_its_results_when_saving_fails(tmp_path, monkeypatch):
    import errno

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_model", no_space)
    result = run(
        "apply", "--model", MHA, "--keep", "0.7", "--no-throughput", "--json",
        "--out", str(tmp_path / "art"),
    )  # fmt: skip
    assert result.exit_code == 2
    assert json.loads(result.stdout)["compressed"]["macs"] > 0  # measured and shown
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0]
