"""--fsdp: two CPU processes (gloo) under torchrun shard the model with FSDP2; the artifact is
the whole model and matches the same run under DDP; a SIGTERM on one process saves a whole
checkpoint, and the resumed run ends with the uninterrupted run's weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vitcompress
from tests.test_finetune import _config, _data, _fresh_accelerate_state, _models  # noqa: F401
from tests.torchrun import torchrun
from vitcompress.training.checkpoint import find_latest, load_checkpoint
from vitcompress.workflows.finetune import FinetuneError, finetune

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, os, signal, sys
from pathlib import Path
sys.path.insert(0, {root!r})
from accelerate.state import AcceleratorState, GradientState
from tests.test_finetune import _models, _data, _config
from vitcompress.training.sharding import local_and_global_sizes
from vitcompress.workflows.finetune import FinetuneInterrupted, finetune

out, rank = Path(sys.argv[1]), int(os.environ["RANK"])

def run(name, on_step=None, **config):
    try:
        return finetune(*_models(), _data(), _data(8), out / name, _config(epochs=2, **config),
                        on_step=on_step)
    finally:  # Accelerate's process-wide state, for the next run in this process
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

sizes = []
run("ddp")
run("fsdp", on_step=lambda step, model: sizes.append(local_and_global_sizes(model)), fsdp=True)

def sigterm_on_rank0(step, model):
    if step == 3 and rank == 0:
        os.kill(os.getpid(), signal.SIGTERM)

try:
    run("resumed", on_step=sigterm_on_rank0, fsdp=True)
    interrupted = None
except FinetuneInterrupted as e:
    interrupted = str(e)
run("resumed", fsdp=True, resume=True)
(out / f"rank{{rank}}.json").write_text(json.dumps({{"sizes": sizes, "interrupted": interrupted}}))
"""


def _torchrun(tmp_path: Path, script: str) -> None:
    path = tmp_path / "fsdp_run.py"
    path.write_text(script)
    torchrun([str(path), str(tmp_path / "out")], timeout=400)


def test_fsdp_shards_during_training_and_writes_the_ddp_runs_model(tmp_path):
    _torchrun(tmp_path, SCRIPT.format(root=str(ROOT)))
    out = tmp_path / "out"
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    # Each process held about half of the parameters at every step, never the whole model.
    for report in reports:
        assert len(report["sizes"]) == 4
        for held, total in report["sizes"]:
            assert held < 0.6 * total
    assert sum(r["sizes"][0][0] for r in reports) == reports[0]["sizes"][0][1]

    ddp = vitcompress.load(out / "ddp").state_dict()
    fsdp = vitcompress.load(out / "fsdp").state_dict()
    initial = _models()[0].model.state_dict()
    assert set(fsdp) == set(ddp)
    assert any(not torch.equal(fsdp[k], initial[k]) for k in fsdp)  # it trained
    for key in ddp:  # the same run; only the order of the gradient sums differs
        assert torch.allclose(fsdp[key], ddp[key], rtol=1e-4, atol=1e-6), key
    meta = json.loads((out / "fsdp" / "vitcompress.json").read_text())["finetune"]
    assert meta["fsdp"] is True and meta["processes"] == 2 and meta["steps"] == 4

    # SIGTERM on process 0 at step 3: both stopped there and saved the whole state.
    assert reports[0]["interrupted"].startswith("interrupted (SIGTERM): step 3 saved in")
    assert reports[1]["interrupted"].startswith(
        "interrupted (another process was signalled): step 3 saved in"
    )
    resumed = vitcompress.load(out / "resumed").state_dict()
    for key in fsdp:
        assert torch.equal(resumed[key], fsdp[key]), key
    state = load_checkpoint(find_latest(out / "resumed" / "checkpoints"))
    assert state["sharding"] == "fsdp2" and state["global_step"] == 4
    assert {k: v.shape for k, v in state["model"].items()} == {k: v.shape for k, v in fsdp.items()}
    assert set(state["optimizer"]["state"]) <= set(fsdp)  # keyed by name, whole tensors
    assert all(
        s["exp_avg"].shape == fsdp[name].shape for name, s in state["optimizer"]["state"].items()
    )


def test_fsdp_with_one_process_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(FinetuneError, match="^--fsdp needs several processes"):
        finetune(*_models(), _data(), None, tmp_path / "run", _config(fsdp=True))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_checkpoint_is_resumed_only_with_the_sharding_it_was_written_with(tmp_path):
    out = tmp_path / "run"
    finetune(*_models(), _data(), None, out, _config(epochs=1))
    path = find_latest(out / "checkpoints")
    state = load_checkpoint(path)
    state["sharding"] = "fsdp2"  # what a --fsdp run writes
    torch.save(state, path)
    with pytest.raises(FinetuneError, match="written by a run with --fsdp; resume it with --fsdp"):
        finetune(*_models(), _data(), None, out, _config(epochs=2, resume=True))


def test_cli_fsdp_in_one_process_is_a_one_line_usage_error(tmp_path):
    from click.testing import CliRunner

    from tests.test_finetune import _image_folder
    from tests.test_finetune_progress import _cli_args
    from vitcompress.cli.main import cli

    data = _image_folder(tmp_path / "data")
    result = CliRunner().invoke(cli, _cli_args(data, tmp_path / "run", "--fsdp"))
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        "error: --fsdp needs several processes (start them with torchrun or accelerate launch); "
        "one process trains without it"
    ]
