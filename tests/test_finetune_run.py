"""The run object's parts alone: a checkpoint's content, what resume restores, and a summary
whose history covers the whole run across a resume (the same numbers as an uninterrupted run)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.test_finetune import _config, _data, _fresh_accelerate_state, _models  # noqa: F401
from vitcompress.training.checkpoint import find_latest, load_checkpoint
from vitcompress.training.interrupt import StopSignals
from vitcompress.training.metrics import EpochTotals
from vitcompress.training.sampler import TrainPosition
from vitcompress.workflows.finetune import FinetuneRun, finetune


def _run(out, **config) -> FinetuneRun:
    student, teacher = _models()
    return FinetuneRun(student, teacher, _data(), _data(8), out, _config(**config), StopSignals())


def _stop_at(step_to_stop: int):
    def stop(step: int, model: nn.Module) -> None:
        if step == step_to_stop:
            raise KeyboardInterrupt

    return stop


def test_checkpoint_holds_the_boundary_then_the_next_epochs_start(tmp_path):
    run = _run(tmp_path / "run", accum=2)  # 4 batches per epoch: 2 steps
    assert run.setup() is None
    try:
        summary = run.train_one_epoch(0)
        assert (summary["epoch"], summary["step"]) == (0, 2)
        state = load_checkpoint(run.checkpoint())
        assert (state["epoch"], state["batches_done"], state["global_step"]) == (0, 4, 2)
        assert state["epoch_totals"]["batches"] == 4 and state["epoch_totals"]["images"] == 16
        assert state["epoch_totals"]["loss_sum"] / 4 == pytest.approx(summary["train_loss"])
        assert state["history"] == []  # the epoch is not over before its evaluation
        model = run.raw_model.state_dict()
        assert set(state["model"]) == set(model)
        assert all(torch.equal(state["model"][k], model[k]) for k in model)
        assert state["scheduler"]["last_epoch"] == 2
        assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {2}
        assert torch.equal(state["rng"][0]["torch"], run.boundary_rng["torch"])

        run.end_epoch(summary)  # evaluates, records the epoch, saves the next epoch's start
        state = load_checkpoint(find_latest(tmp_path / "run" / "checkpoints"))
        assert (state["epoch"], state["batches_done"], state["global_step"]) == (1, 0, 2)
        assert state["epoch_totals"] == {"loss_sum": 0.0, "batches": 0, "images": 0, "seconds": 0.0}
        assert [h["epoch"] for h in state["history"]] == [0]
        assert 0 <= state["history"][0]["val_top1"] <= 1
    finally:
        run.taps.remove()


def test_a_resumed_run_restores_its_place_and_reports_the_whole_run(tmp_path):
    whole = finetune(*_models(), _data(), _data(8), tmp_path / "whole", _config(accum=2, epochs=3))
    with pytest.raises(KeyboardInterrupt):  # step 3: inside the second epoch, after 2 batches
        finetune(
            *_models(),
            _data(),
            _data(8),
            tmp_path / "run",
            _config(accum=2, epochs=3),
            on_step=_stop_at(3),
        )
    saved = load_checkpoint(find_latest(tmp_path / "run" / "checkpoints"))

    run = _run(tmp_path / "run", accum=2, epochs=3, resume=True)
    path = run.setup()
    try:
        assert path == find_latest(tmp_path / "run" / "checkpoints")
        run.resume(path)
        assert run.position == TrainPosition(1, 2, 3) == run.boundary
        assert torch.equal(torch.get_rng_state(), saved["rng"][0]["torch"])
        assert run.start_totals == EpochTotals(**saved["epoch_totals"])
        assert run.start_totals.batches == 2
        assert [h["epoch"] for h in run.history] == [0]
        assert run.scheduler.last_epoch == 3
        weights = run.raw_model.state_dict()
        assert all(torch.equal(weights[k], v) for k, v in saved["model"].items())
        run.train()
    finally:
        run.taps.remove()
    resumed = run.summary()
    assert resumed["steps"] == whole["steps"] == 6
    # Every epoch, with the numbers of the uninterrupted run (the resumed epoch's train loss
    # covers its batches before the interrupt too); images/s is a timing and differs.
    drop = ("img_per_s",)
    assert [{k: v for k, v in h.items() if k not in drop} for h in resumed["history"]] == [
        {k: v for k, v in h.items() if k not in drop} for h in whole["history"]
    ]
    assert resumed["val_top1"] == whole["val_top1"]


def test_an_epoch_cut_by_max_steps_and_continued_is_reported_once(tmp_path):
    out = tmp_path / "run"  # 4 steps per epoch
    first = finetune(*_models(), _data(), None, out, _config(epochs=30, max_steps=5))
    assert [(h["epoch"], h["step"]) for h in first["history"]] == [(0, 4), (1, 5)]
    longer = finetune(*_models(), _data(), None, out, _config(epochs=30, max_steps=7, resume=True))
    assert [(h["epoch"], h["step"]) for h in longer["history"]] == [(0, 4), (1, 7)]
    assert longer["history"][0] == first["history"][0]
