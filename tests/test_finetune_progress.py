"""Visible progress without a terminal, --max-steps, the warm-up warning, and a real SIGTERM
to the ``vitcompress finetune`` command synchronised on its log lines."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import vitcompress
from tests.test_finetune import (  # noqa: F401
    TINY,
    TINY_ARGS,
    _config,
    _data,
    _fresh_accelerate_state,
    _image_folder,
    _models,
)
from tests.torchrun import torchrun
from vitcompress.api import compress_loaded
from vitcompress.cli.main import cli
from vitcompress.cli.progress import LogLines
from vitcompress.loading import load_base_model
from vitcompress.training.checkpoint import find_latest, load_checkpoint
from vitcompress.workflows.finetune import finetune

ROOT = Path(__file__).resolve().parents[1]
MODEL_ARGS = [
    "--model-arg",
    "img_size=32",
    "--model-arg",
    "patch_size=8",
    "--model-arg",
    "depth=4",
    "--model-arg",
    "embed_dim=32",
    "--model-arg",
    "num_heads=2",
    "--model-arg",
    "num_classes=2",
]


def test_log_lines_every_n_steps_with_the_windowed_rate_and_one_per_epoch():
    stream = io.StringIO()
    lines = LogLines(every=2, stream=stream)
    lines.start(2, 3, total_steps=5)
    lines.start_epoch(0, 0)
    # The run puts the rate since its last logged step on every record (RateWindow).
    # Under 10 img/s the rate keeps three digits: a slow CPU run must not read "0 img/s".
    for step, speed in ((1, 100.0), (2, 90.0), (3, 50.0), (4, 0.4321), (5, 25.0)):
        lines.step(
            {"step": step, "epoch": (step - 1) // 3, "loss": 0.5, "lr": 1e-3, "img_per_s": speed}
        )
    lines.note("resumed from step 3 (epoch 2) of runs/ft")
    lines.epoch_done(
        {"epoch": 1, "step": 5, "train_loss": 0.25, "lr": 0.0, "img_per_s": 40.0, "val_top1": 0.5}
    )
    assert stream.getvalue().splitlines() == [
        "step 1/5 (epoch 1/2): loss 0.5000, lr 1.00e-03, 100 img/s",
        "step 2/5 (epoch 1/2): loss 0.5000, lr 1.00e-03, 90 img/s",
        "step 4/5 (epoch 2/2): loss 0.5000, lr 1.00e-03, 0.432 img/s",
        "step 5/5 (epoch 2/2): loss 0.5000, lr 1.00e-03, 25 img/s",  # the last step always
        "resumed from step 3 (epoch 2) of runs/ft",
        "epoch 2/2 done at step 5: train loss 0.2500, lr 0.00e+00, 40 img/s, val top-1 50.00%",
    ]


def test_max_steps_ends_the_run_and_sizes_the_schedule(tmp_path):
    student, teacher = _models()  # 16 images, batch 4: 4 steps per epoch
    result = finetune(
        student,
        teacher,
        _data(),
        None,
        tmp_path / "run",
        _config(epochs=30, max_steps=5, warmup_epochs=0.25),
    )
    assert result["steps"] == 5 and result["epochs"] == 2
    assert [(e["epoch"], e["step"]) for e in result["history"]] == [(0, 4), (1, 5)]
    records = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    lrs = [r["lr"] for r in records if r["type"] == "step"]
    assert lrs[0] == pytest.approx(1e-3)  # after the one warm-up step: the peak
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)  # the cosine ends at step 5, not 120
    state = load_checkpoint(find_latest(tmp_path / "run" / "checkpoints"))
    assert (state["epoch"], state["batches_done"], state["global_step"]) == (1, 1, 5)


def test_a_warm_up_as_long_as_the_run_is_warned(tmp_path, caplog):
    student, teacher = _models()
    with caplog.at_level(logging.WARNING, logger="vitcompress.workflows.finetune"):
        finetune(
            student, teacher, _data(), None, tmp_path / "run", _config(epochs=1, warmup_epochs=1)
        )
    assert "warm-up (4 steps) is as long as the run (4 steps)" in caplog.text


def _cli_args(data: Path, out: Path, *extra: str, model: Path | None = None) -> list[str]:
    spec = (
        ["--model", str(model)]
        if model
        else ["--model", TINY, *MODEL_ARGS, "--variant", "dtps", "--keep", "0.5", "--locs", "1,2"]
    )
    return [
        "finetune",
        *spec,
        "--data",
        str(data),
        "--augment",
        "none",
        "--batch-size",
        "2",
        "--lr",
        "0.001",
        "--warmup-epochs",
        "0",
        "--out",
        str(out),
        *extra,
    ]


def test_cli_without_a_terminal_prints_log_lines(tmp_path):
    data = _image_folder(tmp_path / "data")  # 8 training images: 4 steps per epoch
    result = CliRunner().invoke(
        cli, _cli_args(data, tmp_path / "run", "--max-steps", "3", "--log-every", "2")
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith(("step", "epoch"))]
    assert [line.split(":")[0] for line in lines] == [
        "step 1/3 (epoch 1/1)",
        "step 2/3 (epoch 1/1)",
        "step 3/3 (epoch 1/1)",
        "epoch 1/1 done at step 3",
    ]
    assert re.search(r"loss \d\.\d{4}, lr \d\.\d\de-\d\d, [\d.]+ img/s$", lines[1])
    assert "val top-1" in lines[-1]


def _compressed_artifact(folder: Path) -> Path:
    """A compressed model whose weights, predictor and teacher all come from files, so that
    runs in different processes start alike (a random base is drawn anew in each process)."""
    torch.manual_seed(0)
    base = load_base_model(TINY, TINY_ARGS)
    folder.mkdir()
    torch.save(base.model.state_dict(), folder / "base.pt")
    loaded = load_base_model(TINY, TINY_ARGS, checkpoint=str(folder / "base.pt"))
    student = compress_loaded(loaded, "dtps", keep=0.5, locs=[1, 2])
    return vitcompress.save(student.model, folder / "compressed")


def test_cli_sigterm_on_a_log_line_then_resume_gives_the_same_weights(tmp_path):
    data = _image_folder(tmp_path / "data")
    model = _compressed_artifact(tmp_path / "model")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "ACCELERATE_USE_CPU": "true",
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
    }
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vitcompress.cli.main",
            *_cli_args(data, out, "--epochs", "2", "--log-every", "1", model=model),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    try:
        for line in proc.stderr:  # the run goes on while the signal travels: any point is fair
            seen.append(line)
            if line.startswith("step 2/8"):
                proc.send_signal(signal.SIGTERM)
                break
        _, rest = proc.communicate(timeout=60)
    except BaseException:
        proc.kill()
        raise
    assert proc.returncode == 130, "".join(seen) + rest
    last = rest.strip().splitlines()[-1]
    saved = re.fullmatch(
        r"error: interrupted \(SIGTERM\): step (\d+) saved in (\S+); "
        r"continue with --resume",
        last,
    )
    assert saved is not None, last
    assert 2 <= int(saved.group(1)) < 8 and Path(saved.group(2)).is_file()

    resumed = CliRunner().invoke(
        cli, _cli_args(data, out, "--epochs", "2", "--resume", model=model)
    )
    assert resumed.exit_code == 0, resumed.output
    # The resumed run says where it picked up (the step the interrupted run saved).
    assert f"resumed from step {saved.group(1)} (epoch " in resumed.stderr
    assert f" of {out}" in resumed.stderr
    whole = CliRunner().invoke(
        cli, _cli_args(data, tmp_path / "whole", "--epochs", "2", model=model)
    )
    assert whole.exit_code == 0, whole.output
    a, b = vitcompress.load(out).state_dict(), vitcompress.load(tmp_path / "whole").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize("kind", ["FSDP", "DEEPSPEED"])
def test_sharded_training_is_refused_in_one_line(kind):
    from accelerate.utils import DistributedType

    from vitcompress.workflows.finetune import FinetuneError, _check_distributed

    class Launched:  # what Accelerate reports under `accelerate launch` with that plugin
        distributed_type = getattr(DistributedType, kind)

    with pytest.raises(FinetuneError, match=f"^{kind} is not supported by finetune"):
        _check_distributed(Launched())
    Launched.distributed_type = DistributedType.MULTI_CPU
    _check_distributed(Launched())  # DDP on CPU (the two-process test) goes on


def test_seed_also_draws_the_random_base_and_the_predictor(tmp_path):
    """--seed decides the weights drawn before training too: two runs of a base without weights
    with one seed end equal, and another seed starts elsewhere."""
    from safetensors.torch import load_file

    data = _image_folder(tmp_path / "data")
    weights = {}
    for name, seed in (("a", "3"), ("b", "3"), ("c", "4")):
        torch.manual_seed(int(seed) + 100)  # what the process drew before must not matter
        result = CliRunner().invoke(
            cli, _cli_args(data, tmp_path / name, "--max-steps", "1", "--seed", seed)
        )
        assert result.exit_code == 0, result.output
        weights[name] = load_file(str(tmp_path / name / "model.safetensors"))
    assert weights["a"].keys() == weights["c"].keys()
    assert all(torch.equal(weights["a"][k], weights["b"][k]) for k in weights["a"])
    predictor = [k for k in weights["a"] if "predictor" in k]
    assert predictor and not all(torch.equal(weights["a"][k], weights["c"][k]) for k in predictor)


def test_two_processes_print_one_json_summary(tmp_path):
    """Under torchrun only the main process prints the summary: --json stays one document."""
    data = _image_folder(tmp_path / "data")
    args = _cli_args(data, tmp_path / "run", "--max-steps", "1", "--json")
    stdout = torchrun(["-m", "vitcompress.cli.main", *args], timeout=240)
    summary = json.loads(stdout)  # one document: a second one would make this fail
    assert summary["steps"] == 1 and summary["processes"] == 2
