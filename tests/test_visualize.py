"""`vitcompress visualize`: kept positions and TPS hosts per location, drawn over an image."""

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

import vitcompress
import vitcompress.cli.report_command  # noqa: F401 - registers report and visualize
from tests.fixtures import inhouse
from tests.models import FIXTURES, SMALL, timm_small
from vitcompress.cli.main import cli
from vitcompress.loading import ModelSource
from vitcompress.method import cosine_similarity
from vitcompress.method.squeeze import SELF_WEIGHT
from vitcompress.workflows.visualize import load_image, record_locations

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """A 48x40 picture (not the model's size: visualize resizes it)."""
    rows, cols = np.mgrid[0:40, 0:48]
    pixels = np.stack([cols * 5, rows * 6, ((rows // 10 + cols // 12) % 2) * 200], axis=-1)
    path = tmp_path_factory.mktemp("img") / "picture.png"
    Image.fromarray(pixels.astype(np.uint8)).save(path)
    return path


def _save(model, directory, spec, model_args=None):
    vitcompress.save(model, directory, source=ModelSource(spec=spec, model_args=model_args or {}))
    return directory


def test_visualize_a_compressed_vit(tmp_path, image):
    torch.manual_seed(0)
    model = timm_small("vit_small_patch16_224").eval()
    compressed = vitcompress.compress(model, "dtps", keep=0.5, locs=[1, 2], input_size=(3, 32, 32))
    art = _save(compressed, tmp_path / "art", "vit_small_patch16_224", dict(SMALL))
    out = tmp_path / "vis.png"
    result = run("visualize", "--model", art, "--image", image, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    locations = json.loads(result.output)["locations"]
    # 8x8 patches; dtps keeps int(64 * 0.5**s) after location s
    assert [len(loc["kept"]) for loc in locations] == [32, 16]
    assert [len(loc["present"]) for loc in locations] == [64, 32]
    for loc in locations:
        assert loc["grid"] == [8, 8] and loc["stage"] == 0
        donors = sorted(d for ds in loc["hosts"].values() for d in ds)
        assert donors == sorted(loc["pruned"])  # every pruned token has exactly one host
        assert sorted(map(int, loc["hosts"])) == sorted(loc["kept"])
    assert set(locations[1]["present"]) == set(locations[0]["kept"])
    assert out.read_bytes()[:8] == PNG_SIGNATURE and out.stat().st_size > 1000


def test_visualize_a_model_whose_output_is_its_tokens(tmp_path, image):
    # A features model has no class to name in the title; its kept tokens are drawn the same.
    torch.manual_seed(0)
    model = timm_small("vit_small_patch16_224").eval()
    compressed = vitcompress.compress(
        model, "etps", keep=0.5, locs=[1], input_size=(3, 32, 32), entry="forward_features"
    )
    art = _save(compressed, tmp_path / "art", "vit_small_patch16_224", dict(SMALL))
    out = tmp_path / "vis.png"
    result = run("visualize", "--model", art, "--image", image, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    assert [len(loc["kept"]) for loc in json.loads(result.output)["locations"]] == [32]
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_visualize_the_inhouse_pyramid(tmp_path, image):
    torch.manual_seed(0)
    compressed = vitcompress.compress(
        inhouse.tiny_pyramid().eval(), "dtps", keep=0.5, input_size=(3, 64, 64)
    )
    art = _save(compressed, tmp_path / "pyr", f"{FIXTURES}:tiny_pyramid")
    out = tmp_path / "pyr.png"
    result = run("visualize", "--model", art, "--image", image, "--out", out)
    assert result.exit_code == 0, result.output
    assert "block 1 (stage 1, grid 8x8): 32/64 kept" in result.output
    assert "block 3 (stage 2, grid 4x4): 8/16 kept" in result.output
    assert out.read_bytes()[:8] == PNG_SIGNATURE and out.stat().st_size > 1000


@pytest.mark.parametrize("variant", ["etps", "evit", "dynamicvit"])
def test_recorded_counts_per_variant(image, variant):
    torch.manual_seed(0)
    model = vitcompress.compress(
        inhouse.mha_vit().eval(), variant, keep=0.5, locs=[1, 2], input_size=(3, 32, 32)
    )
    _, tensor = load_image(image, (3, 32, 32))
    records, logits = record_locations(model, tensor)
    assert logits.shape == (1, 10)
    first, second = records
    if variant == "dynamicvit":
        assert [len(r.kept) for r in records] == [32, 16] and not first.hosts
    elif variant == "etps":
        assert [len(r.kept) for r in records] == [32, 16] and first.hosts
    else:  # EViT: ceil(0.5 * n) of the n present, its fused token among them at the next one
        assert len(first.kept) == 32 and first.fused_token and not first.hosts
        fused_kept_before = math.ceil(33 * 0.5)
        assert len(second.kept) in (fused_kept_before, fused_kept_before - 1)
        assert second.fused_token
    assert set(second.present) <= set(first.kept)


def test_recorded_hosts_reproduce_the_squeezed_tokens(image):
    """Fusing each host with the recorded donors gives the reducer's own output tokens."""
    torch.manual_seed(0)
    model = vitcompress.compress(
        inhouse.mha_vit().eval(), "etps", keep=0.5, locs=[1], input_size=(3, 32, 32)
    )
    seen = {}
    model.tps.get_submodule("0").register_forward_hook(
        lambda m, args, out: seen.update(x=args[0], out=out[0], positions=out[2])
    )
    _, tensor = load_image(image, (3, 32, 32))
    (record,), _ = record_locations(model, tensor)
    patches, produced = seen["x"][0, 1:], seen["out"][0, 1:]
    for slot, host in enumerate(seen["positions"][0].tolist()):
        donors = record.hosts[host]
        if not donors:
            torch.testing.assert_close(produced[slot], patches[host])
            continue
        weights = cosine_similarity(patches[donors][None], patches[host][None, None])[0, :, 0]
        weights = weights.exp()
        expected = (SELF_WEIGHT * patches[host] + (weights[:, None] * patches[donors]).sum(0)) / (
            SELF_WEIGHT + weights.sum()
        )
        torch.testing.assert_close(produced[slot], expected, atol=1e-5, rtol=1e-5)


def test_unreadable_image_is_one_line_and_exit_2(tmp_path):
    torch.manual_seed(0)
    compressed = vitcompress.compress(
        inhouse.mha_vit().eval(), "etps", keep=0.5, input_size=(3, 32, 32)
    )
    art = _save(compressed, tmp_path / "art", f"{FIXTURES}:mha_vit")
    bad = tmp_path / "not_an_image.png"
    bad.write_text("hello")
    for path in (bad, tmp_path / "missing.png"):
        result = run("visualize", "--model", art, "--image", path, "--out", tmp_path / "o.png")
        assert result.exit_code == 2
        assert result.output.startswith("error: cannot read image")
        assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "o.png").exists()


def test_an_uncompressed_model_is_refused(tmp_path, image):
    result = run(
        "visualize", "--model", f"{FIXTURES}:mha_vit", "--image", image, "--out", tmp_path / "o.png"
    )
    assert result.exit_code == 2 and "not compressed" in result.output


@pytest.mark.parametrize(
    "variant, expected",
    [
        (
            "dtps",
            [
                "host: a kept token that pruned tokens are squeezed into (outlined)",
                "pruned here, squeezed into the host of its colour",
                "kept, no tokens squeezed into it (grey image)",
                "pruned at an earlier location (blank)",
            ],
        ),
        (
            "evit",
            [
                "kept (image shown)",
                "pruned at this location (faint)",
                "pruned at an earlier location (blank)",
                "+1: EViT's fused token of the pruned ones (no cell)",
            ],
        ),
    ],
)
def test_the_picture_has_a_legend_of_what_it_shows(tmp_path, image, monkeypatch, variant, expected):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    legends: list[list[str]] = []
    original = Figure.legend

    def recording(self, *args, **kwargs):
        legends.append(list(kwargs["labels"]))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "legend", recording)
    torch.manual_seed(0)
    compressed = vitcompress.compress(
        inhouse.mha_vit().eval(), variant, keep=0.5, locs=[1, 2], input_size=(3, 32, 32)
    )
    art = _save(compressed, tmp_path / "art", f"{FIXTURES}:mha_vit")
    result = run("visualize", "--model", art, "--image", image, "--out", tmp_path / "v.png")
    assert result.exit_code == 0, result.output
    assert legends == [expected]


def test_the_image_is_fed_with_the_models_own_data_config(image):
    """visualize normalises and resizes as eval does for this model, not with ImageNet's values."""
    from PIL import Image

    from vitcompress.data import DataConfig

    half = DataConfig(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), interpolation="bilinear")
    _, tensor = load_image(image, (3, 32, 32), half)
    with Image.open(image) as opened:
        resized = opened.convert("RGB").resize((32, 32), Image.Resampling.BILINEAR)
    pixels = torch.from_numpy(np.asarray(resized, dtype=np.float32).copy())
    expected = (pixels.permute(2, 0, 1) / 255.0 - 0.5) / 0.5
    torch.testing.assert_close(tensor[0], expected)
    _, default = load_image(image, (3, 32, 32))  # no config: ImageNet's, as before
    assert not torch.allclose(default, tensor)


def test_visualize_offers_no_option_a_compressed_model_directory_refuses():
    # The directory fixes factory, weights and entry: these options could only be refused.
    from vitcompress.cli.main import cli

    help_text = CliRunner().invoke(cli, ["visualize", "--help"]).output
    for option in ("--model-arg", "--checkpoint", "--pretrained", "--entry"):
        assert option not in help_text
    assert "--model SPEC" in help_text and "--input-size" in help_text
