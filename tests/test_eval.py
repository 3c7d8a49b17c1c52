"""`evaluate` and `vitcompress eval` on a tiny in-house ViT and a synthetic ImageFolder."""

import json

import pytest
import torch
from click.testing import CliRunner

from tests.models import FIXTURES
from tests.test_data import write_image_folder
from vitcompress.cli.main import cli
from vitcompress.data import AugmentConfig, DataError, build_dataset
from vitcompress.loading import load_base_model
from vitcompress.training.evaluate import EvalProgress, evaluate, spread_subset

EINSUM = f"{FIXTURES}:einsum_vit"
MHA = f"{FIXTURES}:mha_vit"
FAST = ["--batch-size", "4", "--warmup", "1", "--runs", "2"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("data") / "imgs", per_class=5)


@pytest.fixture(scope="module")
def folder3(tmp_path_factory):
    """Three classes, two images each: what the 3-class checkpoints below are evaluated on."""
    root = tmp_path_factory.mktemp("data3") / "imgs"
    return write_image_folder(root, classes=("cat", "dog", "fox"), per_class=2)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_base_model(EINSUM, {"num_classes": 2}).model


def test_evaluate_matches_the_models_own_predictions(folder, model):
    dataset = build_dataset(str(folder), "val", (3, 32, 32), augment=AugmentConfig.none())
    model.train()
    result = evaluate(model, dataset, batch_size=3)  # 10 images: a short last batch
    assert model.training  # mode restored
    model.eval()
    with torch.no_grad():
        images = torch.stack([dataset[i][0] for i in range(len(dataset))])
        labels = torch.tensor([dataset[i][1] for i in range(len(dataset))])
        # In evaluate's batches of 3: other batch sizes take other BLAS paths, and a near-tie
        # between the two classes could flip.
        predicted = torch.cat([model(chunk) for chunk in images.split(3)]).argmax(dim=-1)
    assert result["images"] == 10
    assert result["top1"] == 100.0 * (predicted == labels).sum().item() / 10
    assert result["top5"] == 100.0  # top-k clipped to the 2 classes


def test_evaluate_rejects_a_model_with_too_few_outputs(folder):
    dataset = build_dataset(str(folder), "val", (3, 32, 32))
    one_output = load_base_model(EINSUM, {"num_classes": 1}).model
    with pytest.raises(DataError, match="predicts 1 classes but the data has 2"):
        evaluate(one_output, dataset)


class _PerToken(torch.nn.Module):
    """Class scores for every one of 4 tokens: (B, 4, 2), not (B, classes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(2)[:, :2].mT.unflatten(1, (4, -1)).mean(2)  # (B, 4, 2)
        return tokens


def test_evaluate_refuses_an_output_that_is_not_class_scores(folder):
    """Read as classes, (B, 4, 2) scored 100% at top-1 and 400% at top-5 when the batch was
    the token count (its topk broadcast against the labels), and failed in torch otherwise."""
    dataset = build_dataset(str(folder), "val", (3, 32, 32))
    for batch in (4, 3):
        with pytest.raises(DataError, match=r"^the model returns \(\d, 4, 2\) for \d images, not"):
            evaluate(_PerToken(), dataset, batch_size=batch)


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_eval_cli_json(folder, model):
    result = run(
        "eval",
        "--model",
        EINSUM,
        "--model-arg",
        "num_classes=2",
        "--data",
        str(folder),
        "--batch-size",
        "4",
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["images"] == 10 and data["top5"] == 100.0 and 0 <= data["top1"] <= 100
    assert data["input_size"] == [3, 32, 32]


def test_eval_cli_table(folder):
    result = run(
        "eval",
        "--model",
        EINSUM,
        "--model-arg",
        "num_classes=2",
        "--data",
        str(folder),
        "--no-throughput",
    )
    assert result.exit_code == 0, result.output
    assert "top-1" in result.output and "10 images" in result.output


def test_eval_cli_against_a_base(folder):
    result = run(
        "eval",
        "--model",
        EINSUM,
        "--model-arg",
        "num_classes=2",
        "--data",
        str(folder),
        "--base",
        MHA,
        "--base-model-arg",
        "num_classes=2",
        *FAST,
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["delta_top1"] == pytest.approx(data["top1"] - data["base"]["top1"])
    assert data["delta_top5"] == pytest.approx(data["top5"] - data["base"]["top5"])
    assert data["compressed"]["top1"] == data["top1"]
    for key in ("base", "compressed"):
        assert data[key]["throughput"] > 0 and data[key]["gmacs"] > 0
    assert data["base"]["spec"] == MHA and data["environment"]["batch_size"] == 4
    table = run(
        "eval",
        "--model",
        EINSUM,
        "--model-arg",
        "num_classes=2",
        "--data",
        str(folder),
        "--base",
        MHA,
        "--base-model-arg",
        "num_classes=2",
        "--no-throughput",
    )
    assert table.exit_code == 0, table.output
    assert "delta" in table.output and "GMACs" in table.output


def test_eval_cli_missing_data_is_one_line_exit_2(tmp_path):
    result = CliRunner().invoke(cli, ["eval", "--model", EINSUM, "--data", str(tmp_path / "nope")])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("error: data folder")
        and "does not exist" in lines[0]
    )


def _always_class_2(tmp_path):
    """A 3-class checkpoint whose head always answers class 2: on the 3-class data (two images a
    class), top-1 is exactly a third with these weights, whatever the images."""
    from safetensors.torch import save_file

    model = load_base_model(EINSUM, {"num_classes": 3}).model
    state = {k: v.clone() for k, v in model.state_dict().items()}
    head = [k for k in state if k.endswith("bias") and state[k].shape == (3,)][-1]
    state[head.replace("bias", "weight")].zero_()
    state[head] = torch.tensor([-50.0, -50.0, 50.0])
    path = tmp_path / "base.safetensors"
    save_file(state, str(path))
    return path, state


def _artifact(tmp_path, checkpoint):
    out = tmp_path / "compressed"
    result = run(
        "apply",
        "--model",
        EINSUM,
        "--model-arg",
        "num_classes=3",
        "--checkpoint",
        str(checkpoint),
        "--variant",
        "etps",
        "--keep",
        "0.7",
        "--no-throughput",
        "--out",
        str(out),
    )
    assert result.exit_code == 0, result.output
    return out


def test_eval_base_source_rebuilds_the_artifacts_base_with_its_weights(folder3, tmp_path):
    from vitcompress.artifacts.base import load_artifact_base

    checkpoint, state = _always_class_2(tmp_path)
    artifact = _artifact(tmp_path, checkpoint)
    base = load_artifact_base(artifact).model
    assert all(torch.equal(base.state_dict()[k], v) for k, v in state.items())
    result = run(
        "eval",
        "--model",
        str(artifact),
        "--data",
        str(folder3),
        "--base",
        "source",
        "--no-throughput",
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    # the weights, not a random base
    assert data["base"]["top1"] == pytest.approx(100 / 3) and data["top1"] == data["base"]["top1"]
    assert data["base"]["params"] == sum(v.numel() for v in state.values())
    # The same base given explicitly, with its own arguments and weights.
    explicit = run(
        "eval",
        "--model",
        str(artifact),
        "--data",
        str(folder3),
        "--base",
        EINSUM,
        "--base-model-arg",
        "num_classes=3",
        "--base-checkpoint",
        str(checkpoint),
        "--no-throughput",
        "--json",
    )
    assert explicit.exit_code == 0, explicit.output
    assert data["base"]["spec"] == EINSUM  # what "source" stood for
    assert data["base"]["weights"] == str(checkpoint.resolve())
    assert json.loads(explicit.stdout)["base"] == data["base"] | {"weights": str(checkpoint)}


def test_artifact_saved_again_keeps_its_base_weights(tmp_path):
    import vitcompress
    from vitcompress.artifacts.artifact import read_meta

    checkpoint, _ = _always_class_2(tmp_path)
    artifact = _artifact(tmp_path, checkpoint)
    assert read_meta(artifact)["base_weights"] == str(checkpoint.resolve())
    vitcompress.save(vitcompress.load(artifact), tmp_path / "again")
    assert read_meta(tmp_path / "again")["base_weights"] == str(checkpoint.resolve())


@pytest.mark.parametrize(
    "case",
    [
        "not an artifact",
        "no base weights",
        "weights gone",
        "weights changed",
        "options with source",
        "options with an artifact base",
        "options without base",
    ],
)
def test_eval_base_refusals_are_one_line_exit_2(folder3, tmp_path, case):
    checkpoint, _ = _always_class_2(tmp_path)
    if case == "not an artifact":
        args = ["--model", EINSUM, "--model-arg", "num_classes=3", "--base", "source"]
        expected = "needs --model to be a compressed"
    elif case == "no base weights":
        out = tmp_path / "random"
        three = ["--model-arg", "num_classes=3"]
        applied = run("apply", "--model", EINSUM, *three, "--no-throughput", "--out", str(out))
        assert applied.exit_code == 0
        args, expected = ["--model", str(out), "--base", "source"], "records no base weights"
    elif case == "weights gone":
        artifact = _artifact(tmp_path, checkpoint)
        checkpoint.unlink()
        args, expected = ["--model", str(artifact), "--base", "source"], "are not there"
    elif case == "weights changed":  # overwritten after the save: another base, not that one
        artifact = _artifact(tmp_path, checkpoint)
        from safetensors.torch import load_file, save_file

        state = load_file(str(checkpoint))
        state[next(iter(state))].add_(1.0)
        save_file(state, str(checkpoint))
        args, expected = ["--model", str(artifact), "--base", "source"], "changed since the"
    elif case == "options with source":
        artifact = _artifact(tmp_path, checkpoint)
        args = ["--model", str(artifact), "--base", "source", "--base-checkpoint", str(checkpoint)]
        expected = "drop --base-checkpoint"
    elif case == "options with an artifact base":
        artifact = _artifact(tmp_path, checkpoint)
        args = ["--model", str(artifact), "--base", str(artifact), "--base-model-arg", "depth=2"]
        expected = (
            "is a compressed model that fixes its architecture and weights; drop --base-model-arg"
        )
    else:
        args = ["--model", EINSUM, "--base-pretrained"]
        expected = "--base-pretrained needs --base"
    result = run("eval", *args, "--data", str(folder3), "--no-throughput")
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: ") and expected in line


def test_eval_refuses_a_head_with_more_classes_than_the_data_in_one_line(folder):
    # 10 outputs on 2 classes: scoring it would count its 8 extra classes as wrong answers.
    result = run("eval", "--model", EINSUM, "--data", str(folder), "--no-throughput")
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: the model predicts 10 classes but the data has 2")
    assert "num_classes=2" in line
    # The library function still scores a larger head unless asked to refuse it.
    dataset = build_dataset(str(folder), "val", (3, 32, 32))
    ten = load_base_model(EINSUM).model
    assert evaluate(ten, dataset)["images"] == 10
    with pytest.raises(DataError, match="predicts 10 classes but the data has 2"):
        evaluate(ten, dataset, exact_head=True)


def test_spread_subset_takes_evenly_spaced_images_from_every_class(folder):
    dataset = build_dataset(str(folder), "val", (3, 32, 32))  # 5 cats then 5 dogs
    subset = spread_subset(dataset, 4)
    assert subset.indices == [0, 2, 5, 7]
    assert [dataset[i][1] for i in subset.indices] == [0, 0, 1, 1]
    assert spread_subset(dataset, 10) is dataset and spread_subset(dataset, None) is dataset


class _Recorder(EvalProgress):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def start(self, images: int) -> None:
        self.events.append(("start", images))

    def advance(self, images: int) -> None:
        self.events.append(("advance", images))

    def stop(self) -> None:
        self.events.append(("stop", 0))


def test_evaluation_reports_its_images_as_they_are_done(folder, model):
    dataset = build_dataset(str(folder), "val", (3, 32, 32))
    recorder = _Recorder()
    evaluate(model, spread_subset(dataset, 7), batch_size=3, progress=recorder)
    assert recorder.events == [
        ("start", 7),
        ("advance", 3),
        ("advance", 3),
        ("advance", 1),
        ("stop", 0),
    ]


def test_eval_cli_val_images_scores_that_many_images_spread_over_the_split(folder, tmp_path):
    from safetensors.torch import save_file

    from vitcompress.workflows.inputs import DataRequest

    torch.manual_seed(1)
    model = load_base_model(EINSUM, {"num_classes": 2}).model
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    args = ["--model", EINSUM, "--model-arg", "num_classes=2", "--data", str(folder)]
    args += ["--checkpoint", str(tmp_path / "w.safetensors"), "--batch-size", "3"]
    result = run("eval", *args, "--val-images", "4", "--no-throughput", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["images"] == 4
    dataset, _ = DataRequest(str(folder)).for_model(model, (3, 32, 32))
    expected = evaluate(model, spread_subset(dataset, 4), batch_size=3)
    assert data["top1"] == expected["top1"] and data["top5"] == expected["top5"]


def test_a_base_whose_head_does_not_fit_the_data_is_named(folder):
    two = ["--model-arg", "num_classes=2"]
    result = run("eval", "--model", EINSUM, *two, "--data", str(folder), "--base", MHA,
                 "--no-throughput")  # fmt: skip
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"error: --base {MHA}: the model predicts 10 classes but the data has 2")


TINY_TIMM = [
    *("--model-arg", "img_size=32", "--model-arg", "patch_size=4"),
    *("--model-arg", "depth=2", "--model-arg", "num_classes=2"),
]


def test_an_untrained_timm_model_is_said_to_be_one(folder, tmp_path):
    """A timm model loaded without --pretrained or --checkpoint, or an artifact compressed from
    one and never fine-tuned, scores at chance: eval says so in one note (for the model and for
    the base); with weights given, nothing is said."""
    from safetensors.torch import save_file

    spec = "vit_tiny_patch16_224"
    note = "has random weights (no --pretrained, --checkpoint or fine-tuning)"
    untrained = run("eval", "--model", spec, *TINY_TIMM, "--data", str(folder), "--no-throughput")
    assert untrained.exit_code == 0, untrained.output
    assert f"note: {spec} {note}" in untrained.stderr

    args = {"img_size": 32, "patch_size": 4, "depth": 2, "num_classes": 2}
    checkpoint = tmp_path / "trained.safetensors"
    save_file(load_base_model(spec, args).model.state_dict(), str(checkpoint))
    given = ["--checkpoint", str(checkpoint), "--data", str(folder), "--no-throughput"]
    weighted = run("eval", "--model", spec, *TINY_TIMM, *given)
    assert weighted.exit_code == 0, weighted.output
    assert note not in weighted.stderr

    out = tmp_path / "compressed"
    apply = ["apply", "--model", spec, *TINY_TIMM, "--variant", "evit", "--keep", "0.7"]
    assert run(*apply, "--no-throughput", "--out", str(out)).exit_code == 0
    base_args = [arg.replace("--model-arg", "--base-model-arg") for arg in TINY_TIMM]
    both = run("eval", "--model", str(out), "--data", str(folder), "--base", spec, *base_args)
    assert both.exit_code == 0, both.output
    assert f"note: {out} {note}" in both.stderr and f"note: the base {spec} {note}" in both.stderr
    trained_out = tmp_path / "compressed_trained"
    assert (
        run(
            *apply, "--checkpoint", str(checkpoint), "--no-throughput", "--out", str(trained_out)
        ).exit_code
        == 0
    )
    assert (
        note
        not in run(
            "eval", "--model", str(trained_out), "--data", str(folder), "--no-throughput"
        ).stderr
    )
