"""Each model is evaluated and fine-tuned with its own preprocessing (issue 15): the data config
from options, an artifact's record, the model's data_config attribute or timm's pretrained_cfg."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from click.testing import CliRunner
from PIL import Image

import vitcompress
from tests.models import FIXTURES
from vitcompress.artifacts.artifact import read_meta
from vitcompress.cli.main import cli
from vitcompress.data import DataConfig, DataError, build_dataset, resolve_data_config
from vitcompress.data.config import stated_data_config
from vitcompress.loading import load_base_model

IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]

# A model that answers class 1 when the mean of its (normalised) input is positive, else class 0:
# which class a gray image gets depends on nothing but the normalisation it was fed.
MEAN_SIGN = """
import torch
from torch import nn

from tests.fixtures.inhouse import mha_vit


class MeanSign(nn.Module):
    default_input_size = (3, 8, 8)

    def forward(self, x):
        m = x.mean(dim=(1, 2, 3))
        return torch.stack([-m, m], dim=1)


def stated():
    model = MeanSign()
    model.data_config = {"mean": 0.5, "std": [0.5, 0.5, 0.5], "interpolation": "bilinear"}
    return model


def unstated():
    return MeanSign()


def misspelt():
    model = MeanSign()
    model.data_config = {"meen": 0.5}
    return model


def stated_vit(**kwargs):
    model = mha_vit(**kwargs)
    model.data_config = {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25],
                         "interpolation": "bilinear", "crop_pct": 0.95}
    return model
"""


def run(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def ok_json(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "mean_sign.py"
    path.write_text(MEAN_SIGN)
    return path


@pytest.fixture(scope="module")
def gray_folder(tmp_path_factory) -> Path:
    """Class a: gray 120 (0.47: below 0.5, above ImageNet's mean on average); class b: gray 200.

    Fed with mean = std = 0.5, MeanSign gets both right (100%); with ImageNet's statistics it
    calls class a's images b (50%).
    """
    root = tmp_path_factory.mktemp("gray")
    for split in ("train", "val"):
        for name, level in (("a", 120), ("b", 200)):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(4):
                Image.fromarray(np.full((8, 8, 3), level, np.uint8)).save(folder / f"{i}.png")
    return root


def test_eval_feeds_the_model_the_mean_its_config_states(factory, gray_folder):
    stated = ok_json(
        run(
            "eval",
            "--model",
            f"{factory}:stated",
            "--data",
            gray_folder,
            "--no-throughput",
            "--json",
        )
    )
    assert stated["data_config"]["mean"] == [0.5, 0.5, 0.5]
    assert stated["data_config"]["std"] == [0.5, 0.5, 0.5]
    assert stated["data_config"]["interpolation"] == "bilinear"
    assert stated["data_config_sources"]["mean"] == "the model's data_config attribute"
    assert stated["top1"] == 100.0  # the 0.5 was used, not only reported
    assert (
        "note:"
        not in run(
            "eval",
            "--model",
            f"{factory}:stated",
            "--data",
            gray_folder,
            "--no-throughput",
            "--json",
        ).stderr
    )

    unstated = run(
        "eval", "--model", f"{factory}:unstated", "--data", gray_folder, "--no-throughput", "--json"
    )
    data = ok_json(unstated)
    assert data["data_config"]["mean"] == pytest.approx(IMAGENET_MEAN)
    assert data["data_config"]["interpolation"] == "bicubic" and data["top1"] == 50.0
    [note] = unstated.stderr.strip().splitlines()
    assert note.startswith(f"note: {factory}:unstated states no mean/std/interpolation")
    assert "--mean/--std/--interpolation/--crop-pct" in note

    # Options override what the model states, and the defaults.
    given = ok_json(
        run(
            "eval",
            "--model",
            f"{factory}:unstated",
            "--data",
            gray_folder,
            "--mean",
            "0.5",
            "--std",
            "inception",
            "--no-throughput",
            "--json",
        )
    )
    assert given["top1"] == 100.0 and given["data_config"]["std"] == [0.5, 0.5, 0.5]
    assert given["data_config_sources"]["mean"] == "--mean"
    overridden = ok_json(
        run(
            "eval",
            "--model",
            f"{factory}:stated",
            "--data",
            gray_folder,
            "--mean",
            "imagenet",
            "--std",
            "imagenet",
            "--no-throughput",
            "--json",
        )
    )
    assert overridden["top1"] == 50.0


def test_timm_models_bring_their_pretrained_cfg(gray_folder):
    small = [
        "--model-arg",
        "img_size=8",
        "--model-arg",
        "patch_size=4",
        "--model-arg",
        "depth=1",
        "--model-arg",
        "embed_dim=16",
        "--model-arg",
        "num_heads=2",
        "--model-arg",
        "num_classes=2",
        "--data",
        gray_folder,
        "--no-throughput",
        "--json",
    ]
    vit = ok_json(run("eval", "--model", "vit_small_patch16_224", *small))
    assert vit["data_config"] == {
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
        "interpolation": "bicubic",
        "crop_pct": 0.9,
        "crop_mode": "center",
    }
    assert vit["data_config_sources"]["crop_pct"] == "the model's pretrained_cfg (timm)"
    deit = ok_json(run("eval", "--model", "deit_tiny_patch16_224", *small))
    timm_says = timm.data.resolve_model_data_config(timm.create_model("deit_tiny_patch16_224"))
    assert deit["data_config"] == {
        "mean": pytest.approx(IMAGENET_MEAN),
        "std": pytest.approx(IMAGENET_STD),
        **{k: timm_says[k] for k in ("interpolation", "crop_pct", "crop_mode")},
    }


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--mean", "0.5,x"], "--mean '0.5,x' is not a comma list of numbers"),
        (["--std", "0.5,0,0.5"], "std [0.5, 0.0, 0.5] must be positive"),
        (["--mean", "0.5,0.5"], "mean has 2 values (--mean) but the model takes 3 channels"),
        (["--model", "{factory}:misspelt"], "the model's data_config attribute: unknown key meen"),
    ],
)
def test_bad_data_configs_are_one_line_exit_2(factory, gray_folder, args, expected):
    args = [a.format(factory=factory) for a in args]
    model = [] if "--model" in args else ["--model", f"{factory}:stated"]
    result = run("eval", *model, *args, "--data", gray_folder, "--no-throughput")
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and expected in line, line


def test_build_dataset_applies_interpolation_and_crop(gray_folder, tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "noise"
    for split in ("train", "val"):
        (folder / split / "a").mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(
            folder / split / "a" / "0.png"
        )
    image = Image.open(folder / "val" / "a" / "0.png").convert("RGB")

    def first(config: DataConfig) -> torch.Tensor:
        return build_dataset(str(folder), "val", (3, 16, 16), data_config=config)[0][0]

    def expected(resized: Image.Image) -> torch.Tensor:
        x = torch.from_numpy(np.asarray(resized).copy()).permute(2, 0, 1).float() / 255
        return (x - 0.5) / 0.5

    half = dict(mean=(0.5,) * 3, std=(0.5,) * 3)
    squash = image.resize((16, 16), Image.BILINEAR)  # crop 1.0: resize only
    assert torch.allclose(
        first(DataConfig(**half, interpolation="bilinear", crop_pct=1.0)),
        expected(squash),
        atol=1e-6,
    )
    # crop 0.8: resized to 20, then the center 16
    cropped = image.resize((20, 20), Image.BICUBIC).crop((2, 2, 18, 18))
    dataset = build_dataset(
        str(folder), "val", (3, 16, 16), data_config=DataConfig(**half, crop_pct=0.8)
    )
    assert torch.allclose(dataset[0][0], expected(cropped), atol=1e-6)
    assert dataset.data_config.crop_pct == 0.8
    # Nobody states a crop: these 20-px images are larger than the input, so timm's 0.875.
    assert build_dataset(str(folder), "val", (3, 16, 16)).data_config.crop_pct == 0.875
    assert build_dataset(str(gray_folder), "val", (3, 8, 8)).data_config.crop_pct == 1.0


def test_a_one_channel_model_averages_a_stated_rgb_config_but_not_a_given_one():
    model = torch.nn.Identity()
    model.pretrained_cfg = {"mean": IMAGENET_MEAN, "std": IMAGENET_STD}
    config = resolve_data_config(model, channels=1)
    assert config.mean == pytest.approx((sum(IMAGENET_MEAN) / 3,))
    assert "averaged over RGB" in config.sources["mean"]
    with pytest.raises(DataError, match=r"mean has 3 values \(--mean\) but the model takes 1"):
        resolve_data_config(model, channels=1, overrides={"mean": tuple(IMAGENET_MEAN)})


def test_evaluate_warns_when_the_set_is_not_normalised_as_the_model_states(factory, gray_folder):
    """From Python, a bare build_dataset brings ImageNet's statistics whatever the model: the
    score is wrong (50% here, 100% on the model's own 0.5/0.5) and evaluate says why, once;
    a set built for the model, one whose mean/std the caller chose, and a model that states
    nothing are scored without a word."""
    from vitcompress.data import model_dataset
    from vitcompress.loading import load_base_model
    from vitcompress.training.evaluate import evaluate, spread_subset

    stated = load_base_model(f"{factory}:stated").model
    bare = build_dataset(str(gray_folder), "val", (3, 8, 8))
    with pytest.warns(UserWarning) as caught:
        wrong = evaluate(stated, spread_subset(bare, 4))  # read through a Subset too
    assert wrong["top1"] == 50.0
    assert len(caught) == 1
    assert str(caught[0].message).startswith(
        "the images are normalised with mean (0.485, 0.456, 0.406) where the model's "
        "data_config attribute states (0.5, 0.5, 0.5); std (0.229, 0.224, 0.225) where"
    )

    import warnings

    own, _ = model_dataset(stated, str(gray_folder), "val", (3, 8, 8))
    chosen = build_dataset(str(gray_folder), "val", (3, 8, 8), mean=IMAGENET_MEAN)
    unstated = load_base_model(f"{factory}:unstated").model
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert evaluate(stated, own)["top1"] == 100.0
        evaluate(unstated, bare)
        # The chosen mean is the caller's; the std still defaulted and still differs.
        with pytest.raises(UserWarning, match=r"^the images are normalised with std \("):
            evaluate(stated, chosen)


# ---------------------------------------------------------------------------------------------
# Artifacts


VIT_ARGS = [
    "--model-arg",
    "depth=2",
    "--model-arg",
    "dim=32",
    "--model-arg",
    "heads=2",
    "--model-arg",
    "num_classes=2",
]


def test_an_artifact_keeps_its_config_across_save_and_load(factory, tmp_path):
    out = tmp_path / "art"
    result = run(
        "apply",
        "--model",
        f"{factory}:stated_vit",
        *VIT_ARGS,
        "--variant",
        "etps",
        "--keep",
        "0.5",
        "--no-throughput",
        "--out",
        out,
    )
    assert result.exit_code == 0, result.output
    stated = {"mean": [0.5] * 3, "std": [0.25] * 3, "interpolation": "bilinear", "crop_pct": 0.95}
    assert read_meta(out)["data_config"] == stated
    loaded = vitcompress.load(out)
    config = resolve_data_config(loaded, channels=3)
    assert config.to_json() == {**stated, "crop_mode": "center"}
    assert config.sources["mean"] == f"{out}/vitcompress.json"
    vitcompress.save(loaded, tmp_path / "again")
    assert read_meta(tmp_path / "again")["data_config"] == stated
    again = vitcompress.load(tmp_path / "again")
    assert stated_data_config(again)[0] == {
        k: tuple(v) if isinstance(v, list) else v for k, v in stated.items()
    }


FINETUNE_RECIPE = """\
model: {model}
model_arg: {{depth: 2, dim: 32, heads: 2, num_classes: 2}}
checkpoint: {checkpoint}
variant: etps
keep: 0.5
locs: [1]
data: {data}
augment: none
epochs: 1
batch_size: 4
lr: 0.001
warmup_epochs: 0
mean: [0.5, 0.5, 0.5]
std: 0.5
interpolation: bilinear
crop_pct: 1.0
"""


def _image_folder(root: Path) -> Path:
    rng = np.random.default_rng(1)
    for split in ("train", "val"):
        for c, name in enumerate(("a", "b")):
            (root / split / name).mkdir(parents=True)
            for i in range(4):
                pixels = rng.integers(0, 100, (32, 32, 3), dtype=np.uint8) + 120 * c
                Image.fromarray(pixels.astype(np.uint8)).save(root / split / name / f"{i}.png")
    return root


def test_weights_from_a_fine_tuned_artifact_bring_the_config_they_were_trained_with(tmp_path):
    """docs/finetune.md's first run: a base trained by finetune at eTPS keep 1, compressed from
    its model.safetensors. Those weights were trained at the recipe's 0.5/0.5, bilinear, crop
    1; the model (it states nothing) would get ImageNet's defaults. The compressed model records
    the weights' config, and eval --base source feeds the rebuilt base the same."""
    from safetensors.torch import save_file

    mha = f"{FIXTURES}:mha_vit"
    args = {"depth": 2, "dim": 32, "heads": 2, "num_classes": 2}
    init = tmp_path / "init.safetensors"
    save_file(load_base_model(mha, args).model.state_dict(), str(init))
    data = _image_folder(tmp_path / "data")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        FINETUNE_RECIPE.format(model=mha, checkpoint=init, data=data).replace(
            "keep: 0.5", "keep: 1"
        )
    )
    trained = tmp_path / "fm_base"
    ok_json(run("finetune", "--recipe", recipe, "--out", trained, "--json"))
    used = read_meta(trained)["finetune"]["data_config"]
    assert used["mean"] == [0.5] * 3 and used["crop_pct"] == 1.0

    weights = trained / "model.safetensors"
    model_args = [a for k, v in args.items() for a in ("--model-arg", f"{k}={v}")]
    out = tmp_path / "fm_dtps"
    ok_json(
        run("apply", "--model", mha, *model_args, "--checkpoint", weights, "--variant", "dtps",
            "--keep", "0.5", "--no-throughput", "--out", out, "--json")
    )  # fmt: skip
    assert read_meta(out)["data_config"] == used

    evaluated = ok_json(
        run("eval", "--model", out, "--data", data, "--base", "source", "--no-throughput", "--json")
    )
    assert evaluated["data_config"] == used
    assert evaluated["base"]["data_config"] == used
    assert evaluated["base"]["data_config_sources"]["mean"] == (
        f"{trained}/vitcompress.json, the artifact whose weights were loaded"
    )
    # The same weights copied out of their artifact are only a checkpoint: the defaults again.
    loose = tmp_path / "loose.safetensors"
    loose.write_bytes(weights.read_bytes())
    bare = ok_json(
        run("eval", "--model", mha, *model_args, "--checkpoint", loose, "--data", data,
            "--no-throughput", "--json")
    )  # fmt: skip
    assert bare["data_config"]["mean"] == pytest.approx(IMAGENET_MEAN)


def test_finetune_records_the_config_it_trained_with_and_eval_uses_it(tmp_path):
    from safetensors.torch import save_file

    mha = f"{FIXTURES}:mha_vit"
    base = load_base_model(mha, {"depth": 2, "dim": 32, "heads": 2, "num_classes": 2}).model
    checkpoint = tmp_path / "base.safetensors"
    save_file(base.state_dict(), str(checkpoint))
    data = _image_folder(tmp_path / "data")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(FINETUNE_RECIPE.format(model=mha, checkpoint=checkpoint, data=data))
    out = tmp_path / "ft"
    result = run("finetune", "--recipe", recipe, "--out", out, "--json")
    summary = ok_json(result)
    used = {
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "crop_mode": "center",
    }
    assert summary["data_config"] == used  # finetune's metrics name it
    [start] = [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["type"] == "start"
    ]
    assert start["data_config"] == used and start["step"] == 0
    assert {"mean", "std", "interpolation", "crop_pct"} <= set(summary["from_recipe"])
    assert "note:" not in result.stderr  # the recipe stated everything
    meta = read_meta(out)
    assert meta["data_config"] == used and meta["finetune"]["data_config"] == used

    evaluated = ok_json(
        run("eval", "--model", out, "--data", data, "--base", "source", "--no-throughput", "--json")
    )
    assert evaluated["data_config"] == used
    assert evaluated["data_config_sources"]["mean"] == f"{out}/vitcompress.json"
    # The base is fed its own config: it states none, so the defaults, and a note says so.
    assert evaluated["base"]["data_config"]["mean"] == pytest.approx(IMAGENET_MEAN)
    assert evaluated["base"]["data_config"]["interpolation"] == "bicubic"

    # Written before the config was recorded: finetune's only normalisation then, ImageNet's.
    for record in (meta, meta["finetune"]):
        record.pop("data_config")
    (out / "vitcompress.json").write_text(json.dumps(meta))
    legacy = run("eval", "--model", out, "--data", data, "--no-throughput", "--json")
    assert ok_json(legacy)["data_config"]["mean"] == pytest.approx(IMAGENET_MEAN)
    assert "no data_config recorded" in ok_json(legacy)["data_config_sources"]["mean"]
    assert legacy.stderr.startswith(f"note: {out} states no mean/std/interpolation")


# ---------------------------------------------------------------------------------------------
# A model trained elsewhere with its own preprocessing, on real images (Fashion-MNIST)


FASHION = Path("/usr/share/datasets/fashion-mnist")
TRAINED_ELSEWHERE = """
from tests.fixtures.inhouse import mha_vit


def fmnist_vit():
    return mha_vit(dim=32, depth=2, heads=2, num_classes=10, image_size=32, patch=4)
"""


def own_preprocessing(images: np.ndarray) -> torch.Tensor:
    """The owner's pipeline, written without vitcompress: bilinear resize of the 28-px image to
    32x32, pixels / 255, (x - 0.5) / 0.5, the gray channel repeated for the RGB stem."""
    resized = np.stack(
        [np.asarray(Image.fromarray(image).resize((32, 32), Image.BILINEAR)) for image in images]
    )
    x = torch.from_numpy(resized).float().div(255).sub(0.5).div(0.5)
    return x[:, None].expand(-1, 3, -1, -1).contiguous()


@pytest.mark.skipif(
    not (FASHION / "t10k-images-idx3-ubyte.gz").exists(),
    reason="package dataset-fashion-mnist not installed",
)
def test_a_model_trained_with_its_own_normalisation_scores_the_same_through_eval(tmp_path):
    from safetensors.torch import save_file

    from vitcompress.data.datasets import load_fashion_mnist

    factory = tmp_path / "trained_elsewhere.py"
    factory.write_text(TRAINED_ELSEWHERE)
    spec = f"{factory}:fmnist_vit"
    torch.manual_seed(0)
    model = load_base_model(spec).model.train()
    images, labels = load_fashion_mnist("train")
    x, y = own_preprocessing(images[:6000]), torch.from_numpy(labels[:6000].astype(np.int64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        for batch in torch.randperm(len(y), generator=generator).split(100):
            loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    checkpoint = tmp_path / "trained.safetensors"
    save_file(model.state_dict(), str(checkpoint))

    # A plain PyTorch loop over the 10000 test images, in eval's batches of 250.
    model.eval()
    test_images, test_labels = load_fashion_mnist("val")
    with torch.no_grad():
        predicted = torch.cat(
            [model(chunk).argmax(-1) for chunk in own_preprocessing(test_images).split(250)]
        )
    plain_top1 = (
        100.0
        * (predicted == torch.from_numpy(test_labels.astype(np.int64))).sum().item()
        / len(test_labels)
    )
    assert plain_top1 > 60  # trained: the comparison below means something

    common = [
        "eval",
        "--model",
        spec,
        "--checkpoint",
        checkpoint,
        "--data",
        "fashion-mnist",
        "--batch-size",
        "250",
        "--no-throughput",
        "--json",
    ]
    own = ok_json(run(*common, "--mean", "0.5", "--std", "0.5", "--interpolation", "bilinear"))
    assert own["images"] == 10000 and own["top1"] == plain_top1
    assert own["data_config"] == {
        "mean": [0.5] * 3,
        "std": [0.5] * 3,
        "interpolation": "bilinear",
        "crop_pct": 1.0,
        "crop_mode": "center",
    }
    # Without the options: ImageNet's statistics, a lower score, and a note that says why.
    defaults = run(*common)
    assert ok_json(defaults)["top1"] < plain_top1 - 5
    assert defaults.stderr.startswith(f"note: {spec} states no mean/std/interpolation")
