"""Fine-tuning: losses, optimizer groups, a full run, exact resume, divergence, DDP, the CLI."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn
from torch.utils.data import TensorDataset

import vitcompress
from tests.torchrun import torchrun
from vitcompress.api import compress_loaded
from vitcompress.cli.main import cli
from vitcompress.loading import load_base_model
from vitcompress.training.checkpoint import find_latest, list_checkpoints, load_checkpoint
from vitcompress.training.losses import (
    DistillationTaps,
    FinetuneLoss,
    LossWeights,
    kl_distillation,
    pair_by_position,
    ratio_loss,
    token_distillation,
)
from vitcompress.training.optim import RunLength, cosine_with_warmup, default_lr, param_groups
from vitcompress.workflows.finetune import (
    FinetuneConfig,
    FinetuneError,
    FinetuneProgress,
    TrainingDiverged,
    finetune,
)

ROOT = Path(__file__).resolve().parents[1]
TINY = "vit_small_patch16_224"
TINY_ARGS = dict(img_size=32, patch_size=8, depth=4, embed_dim=32, num_heads=2, num_classes=2)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    """Accelerate keeps process-wide singletons; each run here starts from a clean one, on the
    CPU even where a GPU is present (the resume test needs bit-identical runs, and CUDA's
    scatter backward is not deterministic)."""
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _models(variant: str = "dtps"):
    torch.manual_seed(0)
    base = load_base_model(TINY, TINY_ARGS)
    return compress_loaded(base, variant, keep=0.5, locs=[1, 2]), base.model


def _data(n: int = 16) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=generator)
    y = (x[:, 0].mean((1, 2)) > 0).long()
    return TensorDataset(x, y)


def _config(**kwargs) -> FinetuneConfig:
    defaults = dict(
        epochs=2,
        batch_size=4,
        lr=1e-3,
        warmup_epochs=1,
        log_every=1,
        mixup=dict(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=2, label_smoothing=0.1),
    )
    return FinetuneConfig(**{**defaults, **kwargs})


# --------------------------------------------------------------------------------------------
# Losses and optimizer


def test_ratio_loss_matches_hand_computation():
    # Two locations, batch 2, one prefix column, N0 = 4.
    m1 = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float)
    m2 = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.float)
    # location 1 (rho .5): shares .5, 1 -> (0^2 + .5^2)/2 = .125
    # location 2 (rho .25): shares .25, .5 -> (0 + .25^2)/2 = .03125
    expected = (0.125 + 0.03125) / 2
    assert ratio_loss([m1, m2], [0.5, 0.25], [1, 1]).item() == pytest.approx(expected)


def test_kl_and_token_distillation_match_hand_computation():
    student = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    teacher = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    p, q = teacher.softmax(-1), student.softmax(-1)
    expected = (p * (p.log() - q.log())).sum() / 2  # KL(teacher || student), batchmean
    assert kl_distillation(student, teacher).item() == pytest.approx(expected.item(), rel=1e-6)

    s = torch.zeros(1, 3, 2)
    t = torch.tensor([[[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]])
    keep = torch.tensor([[True, False, True]])
    assert token_distillation(s, t, keep).item() == pytest.approx((1 + 1 + 9 + 9) / 4)


def test_pair_by_position_gathers_the_teachers_tokens_and_skips_the_fused_one():
    teacher = torch.arange(2 * 4 * 1, dtype=torch.float).reshape(2, 4, 1)  # token i of image b
    student = torch.zeros(2, 3, 1)
    positions = torch.tensor([[2, 0, -1], [3, 1, 2]])
    paired, on_grid = pair_by_position(student, teacher, positions)
    assert paired.squeeze(-1).tolist() == [[2.0, 0.0, 0.0], [7.0, 5.0, 6.0]]
    assert on_grid.tolist() == [[True, True, False], [True, True, True]]
    assert pair_by_position(student, teacher, None) is None
    assert pair_by_position(student, teacher, positions[:, :2]) is None  # not the student's
    assert pair_by_position(student, teacher, positions + 2) is None  # off the teacher's grid


@pytest.mark.parametrize("variant", ["evit", "etps"])
def test_token_distillation_pairs_dropped_tokens_by_grid_position(variant):
    """EViT at the last block with the teacher's own weights: the kept tokens skip nothing the
    teacher does after the attention (the MLP and final norm act per token), so paired by grid
    position they equal the teacher's exactly and the term is 0. Pairing by order would not be,
    because the kept tokens come in score order. eTPS's hosts absorb donors, so its term is > 0."""
    torch.manual_seed(0)
    base = load_base_model(TINY, TINY_ARGS)
    student = compress_loaded(base, variant, keep=0.5, locs=[3]).model.train()
    teacher = base.model.eval()
    taps = DistillationTaps(student, teacher, token_distill=True)
    try:
        criterion = FinetuneLoss(taps, LossWeights(0.0, 0.0, 1.0), mixup=False, smoothing=0.0)
        images = torch.randn(3, 3, 32, 32)
        taps.reset()
        logits = student(images)
        teacher_logits = teacher(images)
        _, parts = criterion(logits, torch.tensor([0, 1, 0]), teacher_logits)
        positions = taps.captured.positions
        assert positions is not None and positions.shape[1] == 8 + (variant == "evit")
        assert not torch.equal(positions[:, :8], positions[:, :8].sort(dim=1).values)
    finally:
        taps.remove()
    if variant == "evit":
        assert parts["token_distill"] == pytest.approx(0.0, abs=1e-10)
    else:
        assert parts["token_distill"] > 1e-6


@pytest.mark.parametrize("variant", ["dtps", "etps"])
def test_token_distillation_on_a_hybrid_pruned_before_its_last_stage(variant):
    """PVT: a location in stage 2 only; the last stage's grid is whole again and its cls token
    appears there. The stage-2 keep mask and prefix count must not be applied to those tokens."""
    import vitcompress.zoo  # noqa: F401 - registers pvt_tiny

    torch.manual_seed(0)
    base = load_base_model("pvt_tiny", {"num_classes": 2, "img_size": 64}, input_size=(3, 64, 64))
    student = compress_loaded(base, variant, keep=0.5, locs=[2]).model.train()
    teacher = base.model.eval()
    taps = DistillationTaps(student, teacher, token_distill=True)
    try:
        assert taps.final_prefix == 1 and taps.reducers[-1].prefix_tokens == 0
        criterion = FinetuneLoss(taps, LossWeights(0.0, 0.0, 1.0), mixup=False, smoothing=0.0)
        taps.reset()
        images = torch.randn(2, 3, 64, 64)
        logits, teacher_logits = student(images), teacher(images)
        _, parts = criterion(logits, torch.tensor([0, 1]), teacher_logits)
        student_tokens, teacher_tokens = taps.captured.student_tokens, taps.captured.teacher_tokens
    finally:
        taps.remove()
    expected = token_distillation(student_tokens[:, 1:].detach(), teacher_tokens[:, 1:], None)
    assert parts["token_distill"] == pytest.approx(expected.item(), rel=1e-6)


def test_no_weight_decay_on_norms_biases_positions_and_prefix_tokens():
    student, _ = _models()
    decay, no_decay = param_groups(student.model, 0.05)
    names = {id(p): n for n, p in student.model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert {"pos_embed", "cls_token", "norm.weight", "norm.bias", "head.bias"} <= skipped
    assert "head.weight" in decayed and "blocks.0.attn.qkv.weight" in decayed
    assert all(student.model.get_parameter(n).ndim >= 2 for n in decayed)
    assert default_lr(256, accumulation=2, world_size=2) == pytest.approx(2.5e-4)
    assert cosine_with_warmup(0, 10, 2) == 0.5 and cosine_with_warmup(9, 10, 2) > 0


def test_a_runs_length_counts_optimizer_steps_and_warns_when_warm_up_spans_it() -> None:
    # 10 batches at accum 3: 4 steps per epoch (the last one short), 2 epochs: 8 steps.
    length = RunLength.of(10, FinetuneConfig(epochs=2, accum=3, warmup_epochs=1))
    assert (length.steps_per_epoch, length.total_steps, length.epochs) == (4, 8, 2)
    assert length.warmup_steps == 4 and length.warning() is None
    capped = RunLength.of(10, FinetuneConfig(epochs=30, accum=3, max_steps=5, warmup_epochs=2))
    assert (capped.total_steps, capped.epochs, capped.warmup_steps) == (5, 2, 8)
    assert "warm-up (8 steps) is as long as the run (5 steps)" in (capped.warning() or "")


# --------------------------------------------------------------------------------------------
# Runs


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_two_epoch_run_writes_a_loadable_artifact(tmp_path):
    student, teacher = _models()
    before = _state(student.model)
    result = finetune(student, teacher, _data(), _data(8), tmp_path / "run", _config())
    assert result["steps"] == 8 and len(result["history"]) == 2
    loaded = vitcompress.load(tmp_path / "run")
    after = loaded.state_dict()
    assert set(after) == set(before)
    assert any(not torch.equal(after[k], before[k]) for k in before)
    lines = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in lines if r["type"] == "step"]
    assert len(steps) == 8 and {"ce", "ratio", "distill", "token_distill"} <= set(steps[0])
    assert [r["epoch"] for r in lines if r["type"] == "epoch"] == [0, 1]
    meta = json.loads((tmp_path / "run" / "vitcompress.json").read_text())
    assert meta["finetune"]["steps"] == 8
    assert not hasattr(student.model, "vitcompress_token_tap")  # the tap is taken out again


def test_ema_weights_are_written_as_their_own_artifact(tmp_path):
    student, teacher = _models()
    result = finetune(student, teacher, _data(), _data(8), tmp_path / "run", _config(ema_decay=0.5))
    assert all("val_top1_ema" in epoch for epoch in result["history"])
    trained = vitcompress.load(tmp_path / "run").state_dict()
    ema = vitcompress.load(tmp_path / "run" / "ema").state_dict()
    assert set(ema) == set(trained)
    # An average of the trajectory, not the last weights and not the first.
    initial = _models()[0].model.state_dict()
    changed = [k for k in trained if not torch.equal(trained[k], initial[k])]
    assert changed and all(not torch.equal(ema[k], trained[k]) for k in changed)
    assert all(not torch.equal(ema[k], initial[k]) for k in changed)


def test_resume_mid_epoch_gives_the_same_weights(tmp_path):
    student, teacher = _models()
    finetune(student, teacher, _data(), None, tmp_path / "a", _config(accum=2, epochs=3))
    uninterrupted = _state(student.model)

    student, teacher = _models()

    def stop(step: int, model: nn.Module) -> None:
        if step == 3:  # mid-way through the second epoch (2 steps per epoch)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune(
            student,
            teacher,
            _data(),
            None,
            tmp_path / "b",
            _config(accum=2, epochs=3),
            on_step=stop,
        )
    assert load_checkpoint(find_latest(tmp_path / "b" / "checkpoints"))["global_step"] == 3
    student, teacher = _models()
    finetune(
        student, teacher, _data(), None, tmp_path / "b", _config(accum=2, epochs=3, resume=True)
    )
    resumed = vitcompress.load(tmp_path / "b").state_dict()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key


def _stop_at(stop_step: int):
    """An ``on_step`` that interrupts the run once step ``stop_step`` is done."""

    def stop(step: int, model: nn.Module) -> None:
        if step == stop_step:
            raise KeyboardInterrupt

    return stop


class _Augmented(torch.utils.data.Dataset):
    """``_data()`` with a random augmentation drawn from torch, numpy and Python's ``random``,
    as timm's transforms do."""

    def __init__(self) -> None:
        self.data = _data()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        import random

        import numpy as np

        x, y = self.data[index]
        shift = float(np.random.uniform(-1, 1)) + random.random()
        return x + 0.5 * torch.randn_like(x) + shift, y


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_gives_the_same_weights_with_random_augmentation(tmp_path, workers):
    # The loader fetches (and augments) one batch ahead of the step, so a checkpoint's RNG state
    # alone cannot replay the next batch's augmentation; each draw is seeded instead.
    config = dict(epochs=2, warmup_epochs=0, mixup=None, num_workers=workers)
    student, teacher = _models()
    finetune(student, teacher, _Augmented(), None, tmp_path / "a", _config(**config))
    uninterrupted = _state(student.model)

    student, teacher = _models()
    with pytest.raises(KeyboardInterrupt):
        finetune(
            student,
            teacher,
            _Augmented(),
            None,
            tmp_path / "b",
            _config(**config),
            on_step=_stop_at(2),  # mid-way through the first epoch (4 steps per epoch)
        )
    student, teacher = _models()
    finetune(student, teacher, _Augmented(), None, tmp_path / "b", _config(**config, resume=True))
    resumed = vitcompress.load(tmp_path / "b").state_dict()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key


def test_a_resume_that_asks_for_other_settings_is_refused_and_the_same_ones_pass(tmp_path):
    # The optimizer and schedule come back from the checkpoint: a changed --lr or --batch-size
    # would be ignored while the artifact recorded it.

    student, teacher = _models()
    with pytest.raises(KeyboardInterrupt):
        finetune(student, teacher, _data(), None, tmp_path / "b", _config(), on_step=_stop_at(1))
    checkpoint = find_latest(tmp_path / "b" / "checkpoints")
    with pytest.raises(FinetuneError) as refused:
        finetune(*_models(), _data(), None, tmp_path / "b", _config(lr=5e-2, resume=True))
    assert str(refused.value) == (
        f"{checkpoint} was written with --lr 0.001; this run asks for --lr 0.05: resume with "
        "the same options, or fine-tune into a new --out"
    )
    with pytest.raises(FinetuneError, match="--batch-size 4, --ema-decay None; .* --batch-size 2"):
        finetune(
            *_models(),
            _data(),
            None,
            tmp_path / "b",
            _config(batch_size=2, ema_decay=0.9, resume=True),
        )
    assert find_latest(tmp_path / "b" / "checkpoints") == checkpoint  # nothing written
    # A longer run is not another trajectory: --epochs may change.
    finetune(*_models(), _data(), None, tmp_path / "b", _config(epochs=3, resume=True))


def test_an_unreadable_or_foreign_checkpoint_is_refused_in_one_line(tmp_path):
    from vitcompress.training.checkpoint import CheckpointError

    student, teacher = _models()
    with pytest.raises(KeyboardInterrupt):
        finetune(
            student,
            teacher,
            _data(),
            None,
            tmp_path / "b",
            _config(save_every=1),
            on_step=_stop_at(3),
        )
    older, newest = list_checkpoints(tmp_path / "b" / "checkpoints")
    whole = newest.read_bytes()
    newest.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError) as unreadable:
        finetune(*_models(), _data(), None, tmp_path / "b", _config(resume=True))
    assert str(unreadable.value).startswith(f"{newest} cannot be read (")
    assert str(unreadable.value).endswith(f": move it away to resume from {older.name}")
    assert "\n" not in str(unreadable.value)

    newest.write_bytes(whole)
    torch.manual_seed(0)
    wider = load_base_model(TINY, {**TINY_ARGS, "embed_dim": 48})
    other = compress_loaded(wider, "dtps", keep=0.5, locs=[1, 2])
    with pytest.raises(CheckpointError, match=r"holds another model's weights \(\d+ of another"):
        finetune(other, wider.model, _data(), None, tmp_path / "b", _config(resume=True))
    assert list_checkpoints(tmp_path / "b" / "checkpoints") == [older, newest]  # nothing lost


class _Recorder(FinetuneProgress):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def start(self, epochs: int, steps_per_epoch: int, total_steps: int | None = None) -> None:
        self.calls.append(("start", epochs, steps_per_epoch))

    def start_epoch(self, epoch: int, steps_done: int) -> None:
        self.calls.append(("epoch", epoch, steps_done))

    def step(self, record: dict) -> None:
        self.calls.append(("step", record["step"]))

    def epoch_done(self, summary: dict) -> None:
        self.calls.append(("done", summary["epoch"], "val_top1" in summary))

    def stop(self) -> None:
        self.calls.append(("stop",))


def test_progress_hears_every_epoch_and_step_also_when_interrupted_and_resumed(tmp_path):
    def interrupt(step: int, model: nn.Module) -> None:
        if step == 3:
            raise KeyboardInterrupt

    first, second = _Recorder(), _Recorder()
    student, teacher = _models()
    with pytest.raises(KeyboardInterrupt):  # 4 batches per epoch, accum 2: 2 steps per epoch
        finetune(
            student,
            teacher,
            _data(),
            _data(8),
            tmp_path / "run",
            _config(accum=2),
            on_step=interrupt,
            progress=first,
        )
    assert first.calls == [
        ("start", 2, 2),
        ("epoch", 0, 0),
        ("step", 1),
        ("step", 2),
        ("done", 0, True),
        ("epoch", 1, 0),
        ("step", 3),
        ("stop",),
    ]
    student, teacher = _models()
    finetune(
        student,
        teacher,
        _data(),
        _data(8),
        tmp_path / "run",
        _config(accum=2, resume=True),
        progress=second,
    )
    assert second.calls == [
        ("start", 2, 2),
        ("epoch", 1, 1),
        ("step", 4),
        ("done", 1, True),
        ("stop",),
    ]


def test_rich_progress_renders_epoch_step_loss_and_accuracy(monkeypatch):
    import io

    from rich.console import Console

    import vitcompress.cli.progress as progress_module

    buffer = io.StringIO()
    monkeypatch.setattr(
        progress_module,
        "console",
        Console(file=buffer, force_terminal=True, width=200, color_system=None),
    )
    bar = progress_module.RichProgress()
    bar.start(2, 4)
    bar.start_epoch(1, 1)
    bar.step({"step": 6, "loss": 0.5, "lr": 1e-4, "img_per_s": 250.0})
    bar.epoch_done({"epoch": 1, "train_loss": 0.25, "val_top1": 0.5})
    bar.stop()
    text = buffer.getvalue()
    assert "epoch 2/2" in text and "2/4" in text
    assert "step 6 loss 0.5000 lr 1.00e-04 250 img/s" in text
    assert "epoch 2: train loss 0.2500, val top-1 50.00%" in text


class _Labelled(TensorDataset):
    def __init__(self, data: TensorDataset, classes: list[str]) -> None:
        super().__init__(*data.tensors)
        self.classes = classes


def test_a_head_that_cannot_fit_the_data_is_refused_before_training(tmp_path):
    student, teacher = _models()  # two outputs
    out = tmp_path / "run"
    with pytest.raises(
        FinetuneError,
        match=r"predicts 2 classes but the data has 3.*"
        r"num_classes=3",
    ):
        finetune(
            student, teacher, _Labelled(_data(), ["a", "b", "c"]), None, out, _config(mixup=None)
        )
    assert not out.exists()
    # A larger head fits hard labels, but not mixup's one-column-per-class targets.
    with pytest.raises(FinetuneError, match=r"predicts 2 classes but the data has 1.*mixup"):
        finetune(student, teacher, _Labelled(_data(), ["a"]), None, out, _config())
    # Matching classes train.
    finetune(student, teacher, _Labelled(_data(), ["a", "b"]), None, out, _config(epochs=1))
    assert (out / "vitcompress.json").is_file()


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path):
    student, teacher = _models()

    def poison(step: int, model: nn.Module) -> None:
        if step == 2:
            with torch.no_grad():
                model.get_parameter("head.weight").fill_(math.inf)

    with pytest.raises(TrainingDiverged, match="step 3"):
        finetune(
            student, teacher, _data(), None, tmp_path / "run", _config(save_every=1), on_step=poison
        )
    latest = find_latest(tmp_path / "run" / "checkpoints")
    state = load_checkpoint(latest)
    assert state["global_step"] == 2
    # The checkpoint was written before the poisoning callback ran, so its weights are finite.
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert not (tmp_path / "run" / "vitcompress.json").exists()


DDP_SCRIPT = """
import os, sys, torch
sys.path.insert(0, {root!r})
from tests.test_finetune import _models, _data, _config
from vitcompress.workflows.finetune import finetune
out = sys.argv[1]
student, teacher = _models()
finetune(student, teacher, _data(), _data(8), out, _config(epochs=1))
torch.save(student.model.state_dict(), os.path.join(out + "-dump", f"rank{{os.environ['RANK']}}.pt"))
"""


def test_two_processes_end_with_identical_weights(tmp_path):
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT.format(root=str(ROOT)))
    (tmp_path / "out-dump").mkdir()
    torchrun([str(script), str(tmp_path / "out")], timeout=240)
    rank0 = torch.load(tmp_path / "out-dump" / "rank0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "out-dump" / "rank1.pt", weights_only=True)
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    meta = json.loads((tmp_path / "out" / "vitcompress.json").read_text())
    assert meta["finetune"]["processes"] == 2 and meta["finetune"]["steps"] == 2
    saved = vitcompress.load(tmp_path / "out").state_dict()
    assert all(torch.equal(saved[k], rank0[k]) for k in rank0)


# --------------------------------------------------------------------------------------------
# CLI


def _image_folder(root: Path, val_labels: tuple[str, ...] = ("a", "b")) -> Path:
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for split, count, labels in (("train", 4, ("a", "b")), ("val", 2, val_labels)):
        for label in labels:
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = (torch.rand(32, 32, 3, generator=generator) * 255).to(torch.uint8)
                Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")
    return root


@pytest.mark.parametrize(
    "val_labels, named",
    [(("a", "c"), "validation lacks 'b', validation has 'c'"), (("b", "a0"), "lacks 'a'")],
)
def test_validation_classes_that_are_not_the_trainings_are_refused_before_training(
    tmp_path, val_labels, named
):
    # A folder missing from one split shifts every label after it: validation would score the
    # trained model near chance, or fail only after the first epoch.
    data = _image_folder(tmp_path / "data", val_labels)
    out = tmp_path / "run"
    args = ["finetune", "--model", TINY, "--variant", "dtps", "--keep", "0.5", "--locs", "1"]
    for key, value in TINY_ARGS.items():
        args += ["--model-arg", f"{key}={value}"]
    args += ["--data", str(data), "--augment", "none", "--epochs", "1", "--batch-size", "4"]
    result = CliRunner().invoke(cli, [*args, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert named in result.output and "different classes" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_an_unreadable_validation_image_keeps_the_epochs_training(tmp_path):
    # Validation runs after the epoch: a bad image there must not throw the epoch away.
    args = ["finetune", "--model", TINY, "--variant", "dtps", "--keep", "0.5", "--locs", "1"]
    for key, value in TINY_ARGS.items():
        args += ["--model-arg", f"{key}={value}"]
    args += ["--augment", "none", "--epochs", "1", "--batch-size", "4", "--warmup-epochs", "0"]
    data = _image_folder(tmp_path / "data")
    whole = CliRunner().invoke(cli, [*args, "--data", str(data), "--out", str(tmp_path / "a")])
    assert whole.exit_code == 0, whole.output
    bad = _image_folder(tmp_path / "bad")
    image = bad / "val" / "b" / "1.png"
    image.write_bytes(b"not an image")
    out = tmp_path / "b"
    failed = CliRunner().invoke(cli, [*args, "--data", str(bad), "--out", str(out)])
    assert failed.exit_code == 2
    saved = out / "checkpoints" / "step-00000002.pt"
    assert (
        failed.output.strip()
        .splitlines()[-1]
        .endswith(f"the training up to step 2 is saved in {saved}: continue with --resume")
    )
    assert str(image) in failed.output
    image.write_bytes((data / "val" / "b" / "1.png").read_bytes())
    resumed = CliRunner().invoke(cli, [*args, "--data", str(bad), "--out", str(out), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    expected = vitcompress.load(tmp_path / "a").state_dict()
    got = vitcompress.load(out).state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_cli_with_a_recipe_and_an_override(tmp_path):
    data = _image_folder(tmp_path / "data")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        textwrap.dedent(f"""\
        model: {TINY}
        model_arg: {{img_size: 32, patch_size: 8, depth: 4, embed_dim: 32, num_heads: 2,
                    num_classes: 2}}
        variant: dtps
        keep: 0.5
        locs: [1, 2]
        data: {data}
        augment: none
        epochs: 3
        batch_size: 4
        lr: 0.001
        warmup_epochs: 0
        """)
    )
    out = tmp_path / "run"
    result = CliRunner().invoke(
        cli, ["finetune", "--recipe", str(recipe), "--epochs", "1", "--out", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{") :])
    assert summary["epochs"] == 1  # the command line wins over the recipe
    assert summary["steps"] == 2 and summary["variant"] == "dtps" and summary["locs"] == [1, 2]
    assert "epochs" not in summary["from_recipe"] and "batch_size" in summary["from_recipe"]
    model = vitcompress.load(out)
    assert model.vitcompress_plan["keep"] == [0.5, 0.5]
    with torch.no_grad():
        assert model(torch.randn(1, 3, 32, 32)).shape == (1, 2)

    # Fine-tuning the artifact again: the teacher comes from the artifact's base source.
    again = CliRunner().invoke(
        cli,
        [
            "finetune",
            "--model",
            str(out),
            "--data",
            str(data),
            "--augment",
            "none",
            "--epochs",
            "1",
            "--batch-size",
            "4",
            "--out",
            str(tmp_path / "again"),
            "--json",
        ],
    )
    assert again.exit_code == 0, again.output
    # An output that holds checkpoints is not overwritten without --resume.
    refused = CliRunner().invoke(cli, ["finetune", "--recipe", str(recipe), "--out", str(out)])
    assert refused.exit_code == 2 and "--resume" in refused.output
