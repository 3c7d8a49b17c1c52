"""Segmentation: the generated Fashion-MNIST set, mIoU, the Segmenter in the zoo, `eval --task
segmentation`, the per-pixel fine-tune, and the refusal of a task the data does not have."""

from __future__ import annotations

import json
from contextlib import nullcontext

import numpy as np
import pytest
import timm
import torch
from click.testing import CliRunner
from torch.utils.data import Subset, TensorDataset

from tests.test_data import write_idx
from vitcompress.api import compress_loaded
from vitcompress.cli.main import cli
from vitcompress.data import AugmentConfig, DataError, build_dataset, dataset_task
from vitcompress.data.datasets import FASHION_MNIST_CLASSES
from vitcompress.data.segmentation import (
    GARMENT,
    GARMENTS,
    SEG_MEAN,
    SEG_STD,
    THRESHOLD,
    FashionMnistSegmentation,
)
from vitcompress.loading import load_base_model
from vitcompress.training.evaluate import (
    confusion_matrix,
    evaluate_miou,
    evaluate_segmentation,
    segmentation_scores,
)
from vitcompress.training.losses import pixel_kl_distillation
from vitcompress.workflows.finetune import FinetuneConfig, finetune
from vitcompress.zoo.segmenter import FMNIST_SEG_MEAN, FMNIST_SEG_STD

SEGMENTER = "segmenter_tiny_fmnist"
# A small Segmenter on 32x32 canvases: a 4x4 grid of 8-pixel patches.
TINY_ARGS = dict(img_size=32, depth=2, embed_dim=32, num_heads=2)
TINY_CLI = [
    "--model",
    SEGMENTER,
    *("--model-arg", "img_size=32", "--model-arg", "depth=2", "--model-arg", "embed_dim=32"),
    *("--input-size", "1,32,32"),
]


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    """Accelerate keeps process-wide singletons; each run starts from a clean one on the CPU."""
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _garments(count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Garment-like images: a bright block (value 100-250) with a faint rim (value 10, below the
    threshold), at a different place in each image, and labels 0-9."""
    rng = np.random.default_rng(seed)
    images = np.zeros((count, GARMENT, GARMENT), dtype=np.uint8)
    for i in range(count):
        top, left = rng.integers(0, 14, 2)
        images[i, top : top + 14, left : left + 14] = 10
        images[i, top + 2 : top + 12, left + 2 : left + 12] = rng.integers(100, 251)
    return images, rng.integers(0, 10, count).astype(np.uint8)


@pytest.fixture(scope="module")
def idx_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fm")
    write_idx(folder, "train", *_garments(12, 1))
    write_idx(folder, "t10k", *_garments(6, 2), gz=True)
    return folder


def _segmentation_set(split: str = "train", **kwargs) -> FashionMnistSegmentation:
    images, labels = _garments(12 if split == "train" else 6, 1 if split == "train" else 2)
    return FashionMnistSegmentation(images, labels, FASHION_MNIST_CLASSES, split, **kwargs)


# ---------------------------------------------------------------------------------------------
# The set


def test_the_set_is_deterministic_and_its_labels_are_the_painted_garments():
    a, b = _segmentation_set(length=20), _segmentation_set(length=20)
    assert a.classes[0] == "background" and a.classes[1:] == FASHION_MNIST_CLASSES
    counts = set()
    for index in (19, 0, 7):  # any order gives the same sample
        image, label = a[index]
        again, label_again = b[index]
        assert torch.equal(image, again) and torch.equal(label, label_again)
        assert image.shape == (1, 64, 64) and image.dtype == torch.float32
        assert label.shape == (64, 64) and label.dtype == torch.long
        # Painted by hand from the layout, in order: the last garment above the threshold wins.
        layout = a.layout(index)
        counts.add(len(layout))
        expected = np.zeros((64, 64), dtype=np.int64)
        canvas = np.zeros((64, 64), dtype=np.uint8)
        for image_index, top, left in layout:
            assert 0 <= top <= 64 - GARMENT and 0 <= left <= 64 - GARMENT
            garment = a.images[image_index]
            for y, x in zip(*np.nonzero(garment > THRESHOLD), strict=True):
                expected[top + y, left + x] = 1 + int(a.garment_labels[image_index])
                canvas[top + y, left + x] = garment[y, x]
        assert np.array_equal(label.numpy(), expected)
        assert np.array_equal(a.canvas(index)[0], canvas)
        # A pixel is a garment exactly where the canvas is brighter than the threshold.
        assert np.array_equal(label.numpy() > 0, canvas > THRESHOLD)
        # Normalised with the set's statistics.
        restored = (image * torch.tensor(SEG_STD) + torch.tensor(SEG_MEAN)) * 255
        assert torch.allclose(restored[0], torch.from_numpy(canvas).float(), atol=1e-3)
    assert all(GARMENTS[0] <= c <= GARMENTS[1] for c in counts)
    assert not torch.equal(a[0][1], a[1][1])
    other_seed = _segmentation_set(length=20, seed=1)
    assert not torch.equal(a[0][1], other_seed[0][1])
    assert len({len(a.layout(i)) for i in range(20)}) > 1  # 2 to 4 garments, not always one count


def test_the_set_through_build_dataset(idx_dir):
    train = build_dataset(
        "fashion-mnist-seg", "train", (3, 32, 32), data_dir=str(idx_dir), mean=[0.5], std=[0.25]
    )
    val = build_dataset(
        "fashion-mnist-seg", "val", (1, 40, 48), data_dir=str(idx_dir), augment=AugmentConfig.none()
    )
    assert (
        dataset_task(train) == "segmentation" and dataset_task(Subset(val, [0])) == "segmentation"
    )
    assert len(train) == 20_000 and len(val) == 2_000
    image, label = train[3]
    assert (
        image.shape == (3, 32, 32) and torch.equal(image[0], image[2]) and label.shape == (32, 32)
    )
    image, label = val[5]
    assert image.shape == (1, 40, 48) and label.shape == (40, 48)
    # The val split draws from the test images only (their classes here: those of t10k).
    test_labels = set((1 + _garments(6, 2)[1]).tolist())
    assert set(label.unique().tolist()) - {0} <= test_labels
    assert val.data_config.crop_pct == 1.0
    with pytest.raises(DataError, match="smaller than one 28x28 garment"):
        build_dataset("fashion-mnist-seg", "val", (1, 16, 16), data_dir=str(idx_dir))


def test_the_train_split_flips_image_and_labels_together():
    flipping = _segmentation_set(length=4, hflip=1.0)
    plain = _segmentation_set(length=4)
    image, label = flipping[2]
    assert torch.equal(image, plain[2][0].flip(-1)) and torch.equal(label, plain[2][1].flip(-1))


def test_the_zoo_states_the_sets_statistics():
    assert FMNIST_SEG_MEAN == SEG_MEAN and FMNIST_SEG_STD == SEG_STD


# ---------------------------------------------------------------------------------------------
# mIoU


def test_miou_on_a_hand_made_confusion():
    # Classes 0-3; class 3 is neither labelled nor predicted; class 2 is predicted, never labelled.
    labels = torch.tensor([[0, 0, 0, 1], [1, 1, 255, 0]])  # 255: ignored
    predicted = torch.tensor([[0, 0, 1, 1], [1, 2, 3, 0]])
    confusion = confusion_matrix(predicted, labels, 4)
    assert confusion.tolist() == [
        [3, 1, 0, 0],  # label 0: 3 right, 1 taken for 1
        [0, 2, 1, 0],  # label 1: 2 right, 1 taken for 2
        [0, 0, 0, 0],
        [0, 0, 0, 0],
    ]
    scores = segmentation_scores(confusion)
    # IoU: 0 -> 3 / (4 + 3 - 3) = 3/4; 1 -> 2 / (3 + 3 - 2) = 1/2; 2 -> 0 / 1 = 0; 3 absent.
    assert scores["iou"][:3] == pytest.approx([75.0, 50.0, 0.0]) and scores["iou"][3] is None
    assert scores["miou"] == pytest.approx(100 * (0.75 + 0.5 + 0.0) / 3)
    assert scores["pixel_acc"] == pytest.approx(100 * 5 / 7) and scores["pixels"] == 7


class _Oracle(torch.nn.Module):
    """Per-pixel logits that are the one-hot labels of a fixed set of samples (looked up by
    the image), so its scores are known."""

    def __init__(self, dataset, classes: int) -> None:
        super().__init__()
        self.images = torch.stack([dataset[i][0] for i in range(len(dataset))])
        labels = torch.stack([dataset[i][1] for i in range(len(dataset))])
        self.logits = torch.nn.functional.one_hot(labels, classes).permute(0, 3, 1, 2).float()

    def forward(self, x):
        index = (x[:, None] == self.images[None]).flatten(2).all(-1).float().argmax(1)
        return self.logits[index]


def test_evaluate_segmentation_scores_a_perfect_and_a_wrong_model():
    dataset = _segmentation_set("val", length=6)
    oracle = _Oracle(dataset, 11)
    result = evaluate_segmentation(oracle, dataset, batch_size=4)
    assert result["miou"] == 100.0 and result["pixel_acc"] == 100.0 and result["images"] == 6
    background = lambda x: torch.zeros(x.shape[0], 11, *x.shape[-2:]).index_fill_(  # noqa: E731
        1, torch.tensor([0]), 1.0
    )
    wrong = evaluate_segmentation(_Lambda(background), dataset)
    confusion = sum(
        confusion_matrix(torch.zeros_like(dataset[i][1]), dataset[i][1], 11) for i in range(6)
    )
    assert wrong["miou"] == pytest.approx(segmentation_scores(confusion)["miou"])
    # The multi-process path (one process here) agrees.
    accelerator = _OneProcess()
    loader = torch.utils.data.DataLoader(dataset, batch_size=4)
    assert evaluate_miou(oracle, loader, accelerator, 11) == 1.0


class _Lambda(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _OneProcess:
    def autocast(self):
        return nullcontext()

    def gather_for_metrics(self, values):
        return values


def test_evaluate_segmentation_refuses_a_classifier():
    dataset = _segmentation_set("val", length=2)
    classifier = _Lambda(lambda x: torch.zeros(x.shape[0], 11))
    with pytest.raises(DataError, match=r"returns \(2, 11\), not per-pixel logits"):
        evaluate_segmentation(classifier, dataset)


# ---------------------------------------------------------------------------------------------
# The zoo model


def test_segmenter_output_is_per_pixel_logits_at_the_input_size():
    model = timm.create_model(SEGMENTER).eval()
    assert model.pretrained_cfg["input_size"] == (1, 64, 64)
    assert model.pretrained_cfg["mean"] == SEG_MEAN and model.pretrained_cfg["std"] == SEG_STD
    with torch.no_grad():
        assert model(torch.randn(2, 1, 64, 64)).shape == (2, 11, 64, 64)
    small = timm.create_model(SEGMENTER, **TINY_ARGS, num_classes=5).eval()
    with torch.no_grad():
        assert small(torch.randn(3, 1, 32, 32)).shape == (3, 5, 32, 32)
    assert sum(p.numel() for p in model.parameters()) < 300_000


# ---------------------------------------------------------------------------------------------
# The CLI: eval --task segmentation, and the refusals


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_eval_task_segmentation_on_a_tiny_model(idx_dir, tmp_path):
    torch.manual_seed(0)
    model = timm.create_model(SEGMENTER, **TINY_ARGS)
    checkpoint = tmp_path / "tiny.pt"
    torch.save(model.state_dict(), checkpoint)
    data = ["--data", "fashion-mnist-seg", "--data-dir", idx_dir]
    result = run(
        "eval", *TINY_CLI, "--checkpoint", checkpoint, *data, "--task", "segmentation",
        "--batch-size", "256", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["task"] == "segmentation" and report["images"] == 2_000
    assert "top1" not in report and len(report["iou"]) == 11
    assert 0 <= report["miou"] <= 100 and 0 <= report["pixel_acc"] <= 100
    assert report["data_config"]["mean"] == list(SEG_MEAN)  # what the zoo model states
    # The table, with the same numbers.
    table = run(
        "eval", *TINY_CLI, "--checkpoint", checkpoint, *data, "--task", "segmentation",
        "--batch-size", "256",
    )  # fmt: skip
    assert table.exit_code == 0, table.output
    assert "mIoU (%)" in table.output and "pixel acc (%)" in table.output
    assert f"{report['miou']:.2f}" in table.output
    assert f"{report['pixel_acc']:.2f}" in table.output


def test_a_task_the_data_does_not_have_is_refused_in_one_line(idx_dir):
    classification = run(
        "eval", *TINY_CLI, "--data", "fashion-mnist", "--data-dir", idx_dir,
        "--task", "segmentation",
    )  # fmt: skip
    assert classification.exit_code == 2
    lines = classification.output.strip().splitlines()
    assert len(lines) == 1 and "--task segmentation needs per-pixel labels" in lines[0]
    assert "Traceback" not in classification.output
    segmentation = run("eval", *TINY_CLI, "--data", "fashion-mnist-seg", "--data-dir", idx_dir)
    assert segmentation.exit_code == 2
    lines = segmentation.output.strip().splitlines()
    assert len(lines) == 1 and "is a segmentation set" in lines[0]


def test_finetune_refuses_segmentation_on_classification_data(tmp_path):
    base = load_base_model(SEGMENTER, TINY_ARGS, input_size=(1, 32, 32))
    student = compress_loaded(base, "etps", keep=0.5, locs=[1])
    images = TensorDataset(torch.randn(8, 1, 32, 32), torch.zeros(8, dtype=torch.long))
    config = FinetuneConfig(task="segmentation", max_steps=1, batch_size=4)
    with pytest.raises(DataError, match="needs per-pixel labels"):
        finetune(student, None, images, None, tmp_path / "out", config)
    assert not (tmp_path / "out" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------
# Fine-tuning


def test_pixel_distillation_is_the_mean_kl_per_pixel():
    student, teacher = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4)
    assert float(pixel_kl_distillation(teacher, teacher)) == pytest.approx(0.0, abs=1e-6)
    p_teacher = teacher.softmax(1)
    by_hand = (p_teacher * (p_teacher.log() - student.log_softmax(1))).sum(1).mean()
    assert float(pixel_kl_distillation(student, teacher)) == pytest.approx(float(by_hand), rel=1e-5)


def test_segmentation_finetune_of_a_learned_predictor_runs_with_finite_losses(tmp_path):
    torch.manual_seed(0)
    base = load_base_model(SEGMENTER, TINY_ARGS, input_size=(1, 32, 32))
    teacher = load_base_model(SEGMENTER, TINY_ARGS, input_size=(1, 32, 32)).model
    teacher.load_state_dict(base.model.state_dict())
    student = compress_loaded(base, "dtps", keep=0.5, locs=[1])
    train = _segmentation_set(size=(32, 32), length=8, hflip=0.5)
    val = _segmentation_set("val", size=(32, 32), length=4)
    config = FinetuneConfig(
        task="segmentation", max_steps=2, batch_size=4, lr=1e-3, warmup_epochs=0, log_every=1
    )
    summary = finetune(student, teacher, train, val, tmp_path / "ft", config)
    assert summary["steps"] == 2 and summary["task"] == "segmentation"
    assert 0.0 <= summary["val_miou"] <= 1.0 and summary["val_top1"] is None
    records = [
        json.loads(line) for line in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()
    ]
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) == 2
    for record in steps:
        # Per-pixel CE, the learned predictor's ratio loss, per-pixel KL to the teacher.
        assert {"ce", "ratio", "distill"} <= set(record)
        assert all(np.isfinite(record[k]) for k in ("loss", "ce", "ratio", "distill"))
    assert (tmp_path / "ft" / "model.safetensors").is_file()


def test_finetune_cli_task_segmentation(idx_dir, tmp_path):
    out = tmp_path / "ft"
    result = run(
        "finetune", *TINY_CLI, "--variant", "etps", "--keep", "0.5", "--locs", "1",
        "--data", "fashion-mnist-seg", "--data-dir", idx_dir, "--task", "segmentation",
        "--max-steps", "2", "--batch-size", "200", "--warmup-epochs", "0", "--out", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "val mIoU (%)" in result.output
    summary = json.loads((out / "vitcompress.json").read_text())["finetune"]
    assert summary["task"] == "segmentation" and summary["val_miou"] is not None
    assert summary["data"] == "fashion-mnist-seg"
