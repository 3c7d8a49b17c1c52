"""A head that fits the data: a 1000-class model fine-tuned on 10 classes gets a new head (found on
the compressed graph, recorded so the artifact rebuilds it), ``--keep-head`` refuses instead, the
teacher's logits are used only where they predict the data's classes, and validation is bounded
by ``--val-images``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import vitcompress
from tests.test_data import write_idx
from tests.test_finetune import TINY, _fresh_accelerate_state  # noqa: F401
from vitcompress.api import compress_loaded
from vitcompress.cli.main import cli
from vitcompress.data import build_dataset
from vitcompress.loading import load_base_model
from vitcompress.training.config import FinetuneConfig
from vitcompress.training.head import HeadError, classifier_heads, fit_head, model_outputs
from vitcompress.workflows.finetune import fit_head_and_teacher
from vitcompress.workflows.inputs import ModelRequest

# timm's default head: 1000 classes.
WIDE_ARGS = dict(img_size=32, patch_size=8, depth=4, embed_dim=32, num_heads=2)
WIDE_CLI = [arg for key, value in WIDE_ARGS.items() for arg in ("--model-arg", f"{key}={value}")]


def _student(name: str = TINY, **extra):
    torch.manual_seed(0)
    base = load_base_model(name, {**WIDE_ARGS, **extra})
    return compress_loaded(base, "etps", keep=0.7, locs=[1, 2]), base.model


def test_the_graphs_head_is_replaced_and_the_rest_kept():
    student, _ = _student()
    before = {k: v.clone() for k, v in student.model.state_dict().items()}
    image = torch.randn(3, 32, 32)
    assert classifier_heads(student.model, 1000) == ["head"]
    fitted, change = fit_head(student, 10, image, keep_head=False)
    assert change is not None and (change.names, change.before, change.after) == (
        ("head",),
        1000,
        10,
    )
    assert model_outputs(fitted.model, image) == 10
    after = fitted.model.state_dict()
    assert after["head.weight"].shape == (10, 32) and after["head.bias"].shape == (10,)
    assert all(torch.equal(after[k], v) for k, v in before.items() if not k.startswith("head."))
    # No base weights exist for the new head: the source names none.
    assert fitted.source.model_args == {**WIDE_ARGS, "num_classes": 10}
    assert fitted.source.checkpoint is None and not fitted.source.pretrained
    # A model that already fits is left alone.
    same, none = fit_head(fitted, 10, image, keep_head=False)
    assert none is None and same.model is fitted.model


def test_a_replaced_head_survives_save_and_load(tmp_path):
    student, _ = _student()
    fitted, _ = fit_head(student, 10, torch.randn(3, 32, 32), keep_head=False)
    with torch.no_grad():  # a head that matters: not near zero
        fitted.model.head.weight.normal_(0, 1)
    vitcompress.save(fitted.model, tmp_path / "art")  # the source the head change recorded
    loaded = vitcompress.load(tmp_path / "art")
    images = torch.randn(2, 3, 32, 32)
    fitted.model.eval()
    with torch.no_grad():
        expected, got = fitted.model(images), loaded(images)
    assert got.shape == (2, 10)
    torch.testing.assert_close(got, expected)


def test_both_heads_of_a_distilled_deit_are_replaced():
    student, _ = _student("deit_tiny_distilled_patch16_224")
    image = torch.randn(3, 32, 32)
    fitted, change = fit_head(student, 10, image, keep_head=False)
    assert change is not None and change.names == ("head", "head_dist")
    assert model_outputs(fitted.model, image) == 10


def test_keep_head_refuses_a_mismatch_in_one_line():
    student, _ = _student()
    with pytest.raises(HeadError, match=r"predicts 1000 classes but the data has 10.*--keep-head"):
        fit_head(student, 10, torch.randn(3, 32, 32), keep_head=True)


def test_a_source_that_cannot_build_another_head_is_refused(tmp_path):
    factory = tmp_path / "fixed.py"
    factory.write_text(
        f"import timm\n\n\ndef vit():\n    return timm.create_model({TINY!r}, **{WIDE_ARGS!r})\n"
    )
    torch.manual_seed(0)
    base = load_base_model(f"{factory}:vit")
    student = compress_loaded(base, "etps", keep=0.7, locs=[1, 2])
    with pytest.raises(HeadError, match=r"does not build with num_classes=10"):
        fit_head(student, 10, torch.randn(3, 32, 32), keep_head=False)


def test_the_base_teaches_tokens_only_and_a_teacher_must_predict_the_datas_classes(tmp_path):
    data = _blocks(tmp_path / "idx", 20, 10)
    train = build_dataset("fashion-mnist", "train", (3, 32, 32), data_dir=str(data))
    student, base = _student()
    fitted, teacher, config = fit_head_and_teacher(student, base, train, FinetuneConfig())
    assert teacher is base and config.distill_weight == 0.0 and config.token_distill_weight > 0
    given = ModelRequest(TINY, {**WIDE_ARGS, "num_classes": 10})
    student, base = _student()
    _, teacher, config = fit_head_and_teacher(student, base, train, FinetuneConfig(), False, given)
    assert teacher is not base and config.distill_weight == 0.5
    wrong = ModelRequest(TINY, WIDE_ARGS)
    student, base = _student()
    with pytest.raises(HeadError, match=r"--teacher .* predicts 1000 classes but the data has 10"):
        fit_head_and_teacher(student, base, train, FinetuneConfig(), False, wrong)


# --------------------------------------------------------------------------------------------
# The command, on Fashion-MNIST-shaped data


def _blocks(folder: Path, per_class: int, val_per_class: int) -> Path:
    """IDX files of 28x28 images whose class is where a bright 7x7 block sits (one cell of a
    4x4 grid for each of 10 classes), on noise: learnable in a few dozen steps."""
    rng = np.random.default_rng(0)

    def split(count: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.repeat(np.arange(10), count)
        rng.shuffle(labels)
        images = rng.integers(0, 60, (len(labels), 28, 28))
        for image, label in zip(images, labels, strict=True):
            row, column = divmod(int(label), 4)
            image[row * 7 : row * 7 + 7, column * 7 : column * 7 + 7] = 250
        return images, labels

    write_idx(folder, "train", *split(per_class))
    write_idx(folder, "t10k", *split(val_per_class))
    return folder


def run(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_the_issues_run_replaces_the_head_and_bounds_validation(tmp_path):
    for command in ("finetune", "eval"):
        assert "--val-images" in run(command, "--help").output
    data = _blocks(tmp_path / "idx", 4, 10)  # 100 validation images
    fashion = ["--data", "fashion-mnist", "--data-dir", data]
    art = tmp_path / "x"
    applied = run("apply", "--model", TINY, *WIDE_CLI, "--variant", "etps", "--no-throughput",
                  "--out", art)  # fmt: skip
    assert applied.exit_code == 0, applied.output
    # eval refuses the 1000-class model on 10 classes in one line.
    refused = run("eval", "--model", art, *fashion, "--no-throughput")
    assert refused.exit_code == 2
    [line] = refused.output.strip().splitlines()
    assert "predicts 1000 classes but the data has 10" in line
    common = ["--max-steps", 3, "--batch-size", 8, "--warmup-epochs", 0, "--val-images", 16]
    kept = run("finetune", "--model", art, *fashion, *common, "--keep-head", "--out",
               tmp_path / "kept")  # fmt: skip
    assert kept.exit_code == 2
    [line] = kept.output.strip().splitlines()
    assert "--keep-head keeps its head" in line and not (tmp_path / "kept").exists()

    out = tmp_path / "ft_x"
    result = run("finetune", "--model", art, *fashion, *common, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    assert "its head (head) is replaced by a new 10-class one" in result.stderr
    assert "logit distillation is off" in result.stderr
    assert "validating 16 images" in result.stderr
    summary = json.loads(result.stdout)
    assert summary["val_images"] == 16 and summary["loss_weights"]["distill"] == 0.0
    # The artifact rebuilds the new head; eval scores it on the same 16 images.
    assert json.loads((out / "vitcompress.json").read_text())["source"]["model_args"] == {
        **WIDE_ARGS,
        "num_classes": 10,
    }
    evaluated = run("eval", "--model", out, *fashion, "--val-images", 16, "--no-throughput",
                    "--json", "--batch-size", 8)  # fmt: skip
    assert evaluated.exit_code == 0, evaluated.output
    scores = json.loads(evaluated.stdout)
    assert scores["images"] == 16
    assert scores["top1"] == pytest.approx(100 * summary["val_top1"])


def test_a_1000_class_model_fine_tuned_on_10_classes_beats_chance(tmp_path):
    data = _blocks(tmp_path / "idx", 100, 10)  # 1000 training images, 100 validation images
    result = run(
        "finetune", "--model", TINY, *WIDE_CLI, "--variant", "etps", "--data", "fashion-mnist",
        "--data-dir", data, "--augment", "none", "--max-steps", 150, "--batch-size", 16,
        "--lr", "0.001", "--warmup-epochs", 0.1, "--out", tmp_path / "ft", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    # Chance is 10% (the base's head has 1000 classes and a random new one guesses); 150 steps
    # from random weights scored 0.90 when this was written.
    assert summary["val_top1"] > 0.4, summary["history"]


# --------------------------------------------------------------------------------------------
# Bars and lines


def _rich(monkeypatch):
    import io

    from rich.console import Console

    import vitcompress.cli.progress as progress_module

    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=200, color_system=None)
    monkeypatch.setattr(progress_module, "console", console)
    return progress_module, buffer


def test_the_training_bar_counts_max_steps_and_validation_has_its_own(monkeypatch):
    progress_module, buffer = _rich(monkeypatch)
    bar = progress_module.RichProgress()
    bar.start(1, 937, total_steps=3)  # --max-steps 3 in an epoch of 937 steps
    bar.start_epoch(0, 0)
    assert bar.bar is not None
    [task] = bar.bar.tasks
    assert task.total == 3
    bar.step({"step": 1, "loss": 0.5, "lr": 1e-4, "img_per_s": 25.0})
    validation = bar.evaluation()
    validation.start(512)
    evaluating = bar.bar.tasks[-1]
    assert evaluating.description == "validating" and evaluating.total == 512
    validation.advance(8)
    assert evaluating.completed == 8
    validation.stop()
    assert [t.id for t in bar.bar.tasks] == [task.id]  # the validation bar goes, training stays
    bar.stop()
    assert "1/3" in buffer.getvalue()


def test_a_resumed_whole_run_bar_starts_at_the_global_step(monkeypatch):
    progress_module, _ = _rich(monkeypatch)
    bar = progress_module.RichProgress()
    bar.start(3, 4, total_steps=10)  # epochs of 4 steps, the third cut at step 10
    bar.start_epoch(1, 2)  # resumed two steps into the second epoch
    assert bar.bar is not None
    [task] = bar.bar.tasks
    assert (task.total, task.completed, task.description) == (10, 6, "epoch 2/3")
    bar.start_epoch(2, 0)
    assert bar.bar.tasks == [task] and task.description == "epoch 3/3"
    bar.stop()
    # Whole epochs keep one bar per epoch.
    bar.start(2, 4, total_steps=8)
    bar.start_epoch(1, 1)
    [task] = bar.bar.tasks
    assert (task.total, task.completed) == (4, 1)
    bar.stop()


def test_an_evaluation_bar_of_its_own(monkeypatch):
    progress_module, buffer = _rich(monkeypatch)
    bar = progress_module.RichEvalProgress("evaluating runs/x")
    bar.start(20)
    bar.advance(8)
    bar.advance(12)
    bar.stop()
    assert "evaluating runs/x" in buffer.getvalue() and "20/20" in buffer.getvalue()


def test_validation_is_announced_in_log_lines_and_bounded_by_val_images(tmp_path):
    import io

    from tests.test_finetune import _config, _data, _models
    from vitcompress.cli.progress import LogLines
    from vitcompress.workflows.finetune import finetune

    stream = io.StringIO()
    lines = LogLines(every=100, stream=stream)
    student, teacher = _models()
    data = _data()  # 16 images
    finetune(
        student,
        teacher,
        data,
        data,
        tmp_path / "run",
        _config(epochs=1, mixup=None, val_images=5),
        progress=lines,
    )
    assert "validating 5 images" in stream.getvalue().splitlines()
    full = io.StringIO()
    finetune(
        student,
        teacher,
        data,
        data,
        tmp_path / "again",
        _config(epochs=1, mixup=None),
        progress=LogLines(every=100, stream=full),
    )
    assert "validating 16 images" in full.getvalue().splitlines()


def test_a_run_with_a_replaced_head_resumes(tmp_path):
    # The resumed run replaces the head again, then the checkpoint gives it its trained weights.
    data = _blocks(tmp_path / "idx", 4, 2)
    args = ["finetune", "--model", TINY, *WIDE_CLI, "--variant", "etps", "--data",
            "fashion-mnist", "--data-dir", data, "--batch-size", 8, "--lr", "0.001",
            "--warmup-epochs", 0, "--out", tmp_path / "ft", "--json"]  # fmt: skip
    first = run(*args, "--max-steps", 2)
    assert first.exit_code == 0, first.output
    resumed = run(*args, "--max-steps", 4, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.stdout)["steps"] == 4
    model = vitcompress.load(tmp_path / "ft")
    with torch.no_grad():
        assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)


def test_the_cli_teacher_keeps_logit_distillation(tmp_path):
    data = _blocks(tmp_path / "idx", 2, 1)
    args = ["finetune", "--model", TINY, *WIDE_CLI, "--variant", "etps", "--data",
            "fashion-mnist", "--data-dir", data, "--batch-size", 8, "--max-steps", 1,
            "--warmup-epochs", 0, "--json"]  # fmt: skip
    teacher = [
        "--teacher",
        TINY,
        *[a.replace("--model-arg", "--teacher-model-arg") for a in WIDE_CLI],
    ]
    result = run(*args, *teacher, "--teacher-model-arg", "num_classes=10", "--out", tmp_path / "a")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["loss_weights"]["distill"] == 0.5
    assert "logit distillation is off" not in result.stderr
    wrong = run(*args, *teacher, "--out", tmp_path / "b")  # the teacher's 1000 classes
    assert wrong.exit_code == 2
    [line] = wrong.output.strip().splitlines()
    assert "--teacher" in line and "predicts 1000 classes but the data has 10" in line
    alone = run(*args, "--teacher-checkpoint", tmp_path / "w.pt", "--out", tmp_path / "c")
    assert alone.exit_code == 2 and "need --teacher" in alone.output
