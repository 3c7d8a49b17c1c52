"""`evaluate` and `vitcompress eval` on a tiny in-house ViT and a synthetic ImageFolder."""

import json

import pytest
import torch
from click.testing import CliRunner

from tests.models import FIXTURES
from tests.test_data import write_image_folder
from vitcompress.cli.main import cli
from vitcompress.data import AugmentConfig, DataError, build_dataset
from vitcompress.loading import load_model
from vitcompress.workflows.evaluate import evaluate

EINSUM = f"{FIXTURES}:einsum_vit"
MHA = f"{FIXTURES}:mha_vit"
FAST = ["--batch-size", "4", "--warmup", "1", "--runs", "2"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("data") / "imgs", per_class=5)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model(EINSUM, {"num_classes": 2}).model


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
    one_output = load_model(EINSUM, {"num_classes": 1}).model
    with pytest.raises(DataError, match="predicts 1 classes but the data has 2"):
        evaluate(one_output, dataset)


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_eval_cli_json(folder, model):
    result = run("eval", "--model", EINSUM, "--model-arg", "num_classes=2", "--data", str(folder),
                 "--batch-size", "4", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["images"] == 10 and data["top5"] == 100.0 and 0 <= data["top1"] <= 100
    assert data["input_size"] == [3, 32, 32]


def test_eval_cli_table(folder):
    result = run("eval", "--model", EINSUM, "--model-arg", "num_classes=2", "--data", str(folder),
                 "--no-throughput")
    assert result.exit_code == 0, result.output
    assert "top-1" in result.output and "10 images" in result.output


def test_eval_cli_against_a_base(folder):
    result = run("eval", "--model", EINSUM, "--model-arg", "num_classes=2", "--data", str(folder),
                 "--base", MHA, *FAST, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["delta_top1"] == pytest.approx(data["top1"] - data["base"]["top1"])
    assert data["delta_top5"] == pytest.approx(data["top5"] - data["base"]["top5"])
    assert data["compressed"]["top1"] == data["top1"]
    for key in ("base", "compressed"):
        assert data[key]["throughput"] > 0 and data[key]["gmacs"] > 0
    assert data["base"]["spec"] == MHA and data["environment"]["batch_size"] == 4
    table = run("eval", "--model", EINSUM, "--model-arg", "num_classes=2", "--data", str(folder),
                "--base", MHA, "--no-throughput")
    assert table.exit_code == 0, table.output
    assert "delta" in table.output and "GMACs" in table.output


def test_eval_cli_missing_data_is_one_line_exit_2(tmp_path):
    result = CliRunner().invoke(cli, ["eval", "--model", EINSUM, "--data",
                                      str(tmp_path / "nope")])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: data folder") and "does not exist" in \
        lines[0]
