"""Artifacts rebuild exactly the model that was saved, or refuse with one line."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest
import timm
import torch
from safetensors.torch import save_file

import vitcompress
from vitcompress.artifacts.artifact import ArtifactError, read_meta
from vitcompress.artifacts.fingerprint import fixed_input
from vitcompress.loading import ModelLoadError, ModelSource, load_base_model

NAME = "vit_tiny_patch16_224"
TINY = {
    "img_size": 32,
    "patch_size": 8,
    "depth": 2,
    "embed_dim": 64,
    "num_heads": 2,
    "num_classes": 10,
}

FACTORY = textwrap.dedent(
    """
    import timm


    def build(depth=6, act="gelu"):
        return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=depth,
                                 embed_dim=64, num_heads=2, num_classes=10, act_layer=act)
    """
)


def tiny(**overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(NAME, **{**TINY, **overrides}).eval()


def outputs_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return torch.equal(a.eval()(x), b.eval()(x))


def assert_nothing_written(parent: Path, target: Path) -> None:
    assert not target.exists()
    assert [p.name for p in parent.iterdir() if p.name.startswith(".")] == []


def one_line(error: BaseException) -> str:
    text = str(error)
    assert text and "\n" not in text
    return text


# --------------------------------------------------------------------------------------------------
# Saving: what the API cannot see is required, not guessed
# --------------------------------------------------------------------------------------------------


def test_an_argument_the_model_does_not_show_is_required(tmp_path: Path) -> None:
    # act_layer leaves no trace the API can read: saved as it was, it came back with GELU.
    compressed = vitcompress.compress(tiny(act_layer="relu"), "etps", keep=0.5, locs=[1])
    with pytest.raises(ArtifactError) as info:
        vitcompress.save(compressed, tmp_path / "art")
    message = one_line(info.value)
    assert "eval output on a fixed input differs" in message
    assert "ModelSource('vit_tiny_patch16_224', model_args=" in message
    assert "--model-arg" in message
    assert_nothing_written(tmp_path, tmp_path / "art")

    source = ModelSource(NAME, model_args={**TINY, "act_layer": "relu"})
    vitcompress.save(compressed, tmp_path / "art", source=source)
    assert outputs_equal(vitcompress.load(tmp_path / "art"), compressed)


def test_a_refused_save_keeps_the_artifact_already_there(tmp_path: Path) -> None:
    good = vitcompress.compress(tiny(), "etps", keep=0.5, locs=[1])
    vitcompress.save(good, tmp_path / "art")
    before = (tmp_path / "art" / "model.safetensors").read_bytes()
    bad = vitcompress.compress(tiny(act_layer="relu"), "etps", keep=0.5, locs=[1])
    with pytest.raises(ArtifactError):
        vitcompress.save(bad, tmp_path / "art")
    assert (tmp_path / "art" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_what_a_timm_model_shows_is_recorded(tmp_path: Path) -> None:
    # Built for 32x32 (and depth 2, width 64): loading used to fail on the 224 config size.
    compressed = vitcompress.compress(tiny(), "dtps", keep=0.5, locs=[1])
    with torch.no_grad():
        for p in compressed.tps.parameters():
            p.add_(0.1)  # weights that differ from a fresh build
    vitcompress.save(compressed, tmp_path / "art")
    args = read_meta(tmp_path / "art")["source"]["model_args"]
    assert args["num_classes"] == 10 and args["depth"] == 2 and args["embed_dim"] == 64
    assert args["img_size"] == {"__literal__": "(32, 32)"}
    assert outputs_equal(vitcompress.load(tmp_path / "art"), compressed)


def test_a_factory_default_that_is_not_the_models_is_named(tmp_path: Path) -> None:
    factory = tmp_path / "my_vit.py"
    factory.write_text(FACTORY)
    loaded = load_base_model(f"{factory}:build", {"depth": 8})
    compressed = vitcompress.compress(loaded.model, "dtps", keep=0.5, locs=[6])
    with pytest.raises(ArtifactError) as info:
        vitcompress.save(compressed, tmp_path / "art", source=f"{factory}:build")
    message = one_line(info.value)
    assert "blocks: 8 saved, 6 rebuilt" in message and "--locs" not in message
    assert_nothing_written(tmp_path, tmp_path / "art")
    # The source load_model recorded has the arguments: saved without naming it, it rebuilds.
    compressed = vitcompress.api.compress_loaded(loaded, "dtps", keep=0.5, locs=[6]).model
    vitcompress.save(compressed, tmp_path / "art")
    assert outputs_equal(vitcompress.load(tmp_path / "art"), compressed)


def test_random_policy_artifacts_are_verified_with_the_same_draw(tmp_path: Path) -> None:
    compressed = vitcompress.compress(tiny(), "etps", keep=0.5, locs=[1], policy="random")
    vitcompress.save(compressed, tmp_path / "art")
    assert read_meta(tmp_path / "art")["plan"]["policy"] == "random"
    vitcompress.load(tmp_path / "art")


# --------------------------------------------------------------------------------------------------
# Loading: the fingerprint
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def factory_artifact(tmp_path: Path) -> tuple[Path, Path]:
    factory = tmp_path / "my_vit.py"
    factory.write_text(FACTORY)
    loaded = load_base_model(f"{factory}:build", {"depth": 4})
    compressed = vitcompress.api.compress_loaded(loaded, "dtps", keep=0.5, locs=[2]).model
    vitcompress.save(compressed, tmp_path / "art")
    return factory, tmp_path / "art"


def test_the_fingerprint_is_recorded(factory_artifact: tuple[Path, Path]) -> None:
    _, art = factory_artifact
    fingerprint = read_meta(art)["fingerprint"]
    assert fingerprint["model_map"]["blocks"] == 4
    assert fingerprint["model_map"]["tokens"] == [17, 17, 17, 17]
    assert fingerprint["state_dict"]["pos_embed"] == [1, 17, 64]
    assert len(fingerprint["output"]["sketch"]) == 16 and fingerprint["output"]["numel"] == 20
    assert len(fingerprint["output"]["sha256"]) == 64


def test_a_base_that_now_builds_another_model_is_refused(
    factory_artifact: tuple[Path, Path],
) -> None:
    factory, art = factory_artifact
    # Same shapes, other activation: the file changed after the artifact was written.
    factory.write_text(FACTORY.replace('act="gelu"', 'act="relu"'))
    with pytest.raises(ArtifactError) as info:
        vitcompress.load(art)
    message = one_line(info.value)
    assert message.startswith(f"{art} does not rebuild the model that was saved")
    assert "output on the fixed input differs" in message


def test_a_base_with_other_blocks_is_refused_by_the_model_map(
    factory_artifact: tuple[Path, Path],
) -> None:
    factory, art = factory_artifact
    factory.write_text(FACTORY.replace("img_size=32, patch_size=8", "img_size=32, patch_size=4"))
    with pytest.raises(ArtifactError) as info:
        vitcompress.load(art)
    message = one_line(info.value)
    assert (
        str(art) in message
        and "tokens: [17, 17, 17, 17] saved, [65, 65, 65, 65] rebuilt" in message
        and "--locs" not in message
    )


def test_a_tampered_fingerprint_is_refused(factory_artifact: tuple[Path, Path]) -> None:
    _, art = factory_artifact
    meta = json.loads((art / "vitcompress.json").read_text())
    meta["fingerprint"]["output"]["sketch"][0] += 1.0
    meta["fingerprint"]["output"]["sha256"] = "0" * 64
    (art / "vitcompress.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="differs from the saved one"):
        vitcompress.load(art)
    meta["fingerprint"]["state_dict"]["pos_embed"] = [1, 5, 64]
    (art / "vitcompress.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match=r"pos_embed \[1, 5, 64\] saved, \[1, 17, 64\]"):
        vitcompress.load(art)
    meta["fingerprint"] = {"output": 3}
    (art / "vitcompress.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match="malformed fingerprint"):
        vitcompress.load(art)


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda meta: meta.pop("source"), "its source is not an object"),
        (lambda meta: meta.update(input_size=32), "input_size is not"),
        (lambda meta: meta.update(input_size=[3, 32]), "input_size is not"),
    ],
)
def test_a_damaged_record_is_one_line(
    factory_artifact: tuple[Path, Path], damage, expected: str
) -> None:
    _, art = factory_artifact
    meta = json.loads((art / "vitcompress.json").read_text())
    damage(meta)
    (art / "vitcompress.json").write_text(json.dumps(meta))
    with pytest.raises(ArtifactError, match=expected) as error:
        vitcompress.load(art)
    one_line(error.value)


def test_saving_as_the_root_is_refused_and_dot_saves_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = vitcompress.compress(tiny(), "etps", keep=0.7, input_size=(3, 32, 32))
    with pytest.raises(ArtifactError, match="name a folder inside it"):
        vitcompress.save(model, "/", source=ModelSource(NAME, model_args=TINY))
    target = tmp_path / "here"
    target.mkdir()
    monkeypatch.chdir(target)  # "." used to fail with a raw ValueError (no name to stage beside)
    assert vitcompress.save(model, ".", source=ModelSource(NAME, model_args=TINY)) == target
    assert outputs_equal(vitcompress.load(target), model)
    assert [p.name for p in tmp_path.iterdir()] == ["here"]  # no staging folder left beside it


def test_weights_of_another_shape_are_named(factory_artifact: tuple[Path, Path]) -> None:
    _, art = factory_artifact
    meta = json.loads((art / "vitcompress.json").read_text())
    del meta["fingerprint"]
    (art / "vitcompress.json").write_text(json.dumps(meta))
    state = vitcompress.load(art).state_dict()
    state = {k: v.clone() for k, v in state.items()}
    state["pos_embed"] = torch.zeros(1, 5, 64)
    save_file(state, str(art / "model.safetensors"))
    with pytest.raises(ArtifactError, match=r"pos_embed \[1, 5, 64\] saved, \[1, 17, 64\]"):
        vitcompress.load(art)


def test_an_artifact_without_fingerprint_loads_with_a_warning(
    factory_artifact: tuple[Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    _, art = factory_artifact
    expected = vitcompress.load(art)
    meta = json.loads((art / "vitcompress.json").read_text())
    del meta["fingerprint"]
    (art / "vitcompress.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="vitcompress.artifacts.artifact"):
        again = vitcompress.load(art)
    assert f"{art} was written before artifacts carried a fingerprint" in caplog.text
    assert "cannot be verified" in caplog.text
    assert outputs_equal(again, expected)


def test_fixed_input_does_not_depend_on_torchs_generator() -> None:
    torch.manual_seed(123)
    first = fixed_input((3, 4, 4))
    torch.manual_seed(456)
    assert torch.equal(first, fixed_input((3, 4, 4)))
    assert first.shape == (2, 3, 4, 4) and -2 <= float(first.min()) < float(first.max()) < 2


# --------------------------------------------------------------------------------------------------
# A model that does not run on its input is the user's error
# --------------------------------------------------------------------------------------------------


def test_a_wrong_input_size_is_a_user_error() -> None:
    with pytest.raises(ModelLoadError) as info:
        load_base_model(NAME, TINY, input_size=(3, 48, 48))
    message = one_line(info.value)
    assert "does not run on --input-size 3,48,48" in message and "3,32,32" in message
    with pytest.raises(ModelLoadError, match="does not run on input 3,48,48"):
        vitcompress.compress(tiny(), "etps", keep=0.5, input_size=(3, 48, 48))


def test_a_factory_that_returns_no_image_model_is_a_user_error(tmp_path: Path) -> None:
    factory = tmp_path / "not_vit.py"
    factory.write_text(
        "from torch import nn\n\ndef build():\n    m = nn.Linear(10, 10)\n"
        "    m.default_input_size = (3, 32, 32)\n    return m\n"
    )
    with pytest.raises(ModelLoadError, match="does not run on its input size 3,32,32"):
        load_base_model(f"{factory}:build")


def test_compressing_a_compressed_model_is_refused() -> None:
    compressed = vitcompress.compress(tiny(), "etps", keep=0.5, locs=[1])
    with pytest.raises(ModelLoadError, match="already compressed"):
        vitcompress.compress(compressed, "dtps", keep=0.5, locs=[1])


def test_a_model_in_another_dtype_is_refused(tmp_path: Path) -> None:
    # Loading rebuilds in float32: a bfloat16 model would come back as another model.
    compressed = vitcompress.compress(tiny(), "etps", keep=0.5, locs=[1]).to(torch.bfloat16)
    with pytest.raises(ArtifactError, match=r"is torch.bfloat16 .*model.float\(\)"):
        vitcompress.save(compressed, tmp_path / "art")
    assert_nothing_written(tmp_path, tmp_path / "art")
