"""Tests for ``vitcompress.loading``: every way of naming a model, weights, input sizes, errors."""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import vitcompress.api
from vitcompress.cli.options import parse_input_size, parse_model_args
from vitcompress.loading import (
    LoadedModel,
    ModelLoadError,
    ModelSource,
    default_input_size,
    load_base_model,
    load_checkpoint,
    timm_hub,
)

TIMM_NAME = "vit_tiny_patch16_224"
TINY = {
    "img_size": 32,
    "patch_size": 8,
    "depth": 2,
    "embed_dim": 64,
    "num_heads": 2,
    "num_classes": 10,
}

FACTORY_SOURCE = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Tiny(nn.Module):
        def __init__(self, width: int = 4) -> None:
            super().__init__()
            self.fc = nn.Linear(width, 2)

        def forward(self, x):
            return self.fc(x.flatten(1))


    def build(width=4, scale=1.0, shape=(1, 1), bias=True, name="relu", **rest):
        model = Tiny(width)
        # Kept so the test can check how each argument arrived.
        model.received = dict(width=width, scale=scale, shape=shape, bias=bias, name=name, **rest)
        model.default_input_size = (1, 2, width // 2)
        return model


    def build_unsized():
        return Tiny()


    def not_a_model(**kwargs):
        return {"oops": kwargs}


    def broken():
        raise ValueError("boom\\nsecond line")


    NOT_CALLABLE = 3
    """
)


def assert_one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text
    return text


@pytest.fixture
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny_models.py"
    path.write_text(FACTORY_SOURCE)
    return path


def tiny_vit(**overrides: object) -> nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model(TIMM_NAME, **{**TINY, **overrides})


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


# --------------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------------


def test_parse_model_args_literals_and_strings() -> None:
    args = parse_model_args(
        ["depth=2", "drop=0.1", "img_size=(32, 32)", "flag=True", "act=gelu", "name='a b'", "x="]
    )
    assert args == {
        "depth": 2,
        "drop": 0.1,
        "img_size": (32, 32),
        "flag": True,
        "act": "gelu",
        "name": "a b",
        "x": "",
    }
    assert type(args["depth"]) is int and type(args["flag"]) is bool
    assert parse_model_args([]) == {}


@pytest.mark.parametrize("pairs", [["depth"], ["=3"], ["my-arg=1"], ["a=1", "a=2"]])
def test_parse_model_args_errors(pairs: list[str]) -> None:
    with pytest.raises(ModelLoadError) as info:
        parse_model_args(pairs)
    assert_one_line(info.value)


def test_parse_input_size() -> None:
    assert parse_input_size("3,224,224") == (3, 224, 224)
    assert parse_input_size(" 1, 32,48 ") == (1, 32, 48)


# "3,224,224,1" is no longer malformed: a video model's input has four dims (tests/test_video.py).
@pytest.mark.parametrize(
    "text", ["", "224", "3,224", "3,224,224,1,", "a,b,c", "3,0,224", "3x224x224"]
)
def test_parse_input_size_errors(text: str) -> None:
    with pytest.raises(ModelLoadError, match="C,H,W") as info:
        parse_input_size(text)
    assert_one_line(info.value)


# --------------------------------------------------------------------------------------------------
# timm names
# --------------------------------------------------------------------------------------------------


def test_timm_model_with_args() -> None:
    loaded = load_base_model(TIMM_NAME, model_args=TINY)
    assert isinstance(loaded, LoadedModel)
    assert not loaded.model.training
    assert loaded.input_size == (3, 32, 32)
    out = loaded.model(torch.randn(1, *loaded.input_size))
    assert out.shape == (1, 10)
    assert loaded.source == ModelSource(TIMM_NAME, TINY, None, False)


@pytest.mark.parametrize(
    ("typo", "expected"),
    [
        ("vit_tiny_patch16_22", TIMM_NAME),
        ("vit_tinny_patch16_224", TIMM_NAME),
        ("deit_smal", "deit_small_patch16_224"),
    ],
)
def test_unknown_timm_name_suggests_close_names(typo: str, expected: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_base_model(typo)
    text = assert_one_line(info.value)
    assert text.startswith(f"unknown model '{typo}'; closest: ")
    assert expected in text.split("closest: ")[1].split(", ")


def test_unknown_timm_name_without_any_suggestion() -> None:
    with pytest.raises(ModelLoadError, match="unknown model 'qqqqqqqq'") as info:
        load_base_model("qqqqqqqq")
    assert_one_line(info.value)


def test_bad_timm_kwargs_are_reported() -> None:
    with pytest.raises(ModelLoadError, match=f"could not build timm model '{TIMM_NAME}'") as info:
        load_base_model(TIMM_NAME, model_args={**TINY, "no_such_option": 1})
    assert "no_such_option" in assert_one_line(info.value)


def _empty_hub_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub.constants

    # Weights a developer happens to have cached must not make the download "succeed".
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "torch_hub"))


def test_pretrained_offline_fails_cleanly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub.constants

    _empty_hub_cache(monkeypatch, tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The hub client reads the variable once at import, which has already happened.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        load_base_model(TIMM_NAME, pretrained=True)
    assert time.monotonic() - start < 30
    text = assert_one_line(info.value)
    assert text.startswith(f"could not download pretrained weights for {TIMM_NAME}: ")
    assert "HF_HUB_OFFLINE" in text
    assert text.endswith("use --checkpoint FILE to load local weights")


def test_pretrained_unreachable_host_fails_fast(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import huggingface_hub.constants

    _empty_hub_cache(monkeypatch, tmp_path)

    # Without the reachability probe the hub client retries with back-off for about a minute.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://huggingface.co")
    # No proxy, whatever this machine's environment says; NO_PROXY alone must not stop the probe.
    monkeypatch.setattr(timm_hub.urllib.request, "getproxies", lambda: {"no": "localhost"})
    probed: list[tuple[str, int]] = []

    def refuse(address: tuple[str, int], timeout: float | None = None) -> None:
        probed.append(address)
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(timm_hub.socket, "create_connection", refuse)
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as info:
        load_base_model(TIMM_NAME, pretrained=True)
    assert time.monotonic() - start < 20
    assert probed and probed[0][1] == 443
    text = assert_one_line(info.value)
    assert text.startswith(f"could not download pretrained weights for {TIMM_NAME}: cannot reach ")
    assert "--checkpoint FILE" in text
    # The hub client is back in online mode afterwards.
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_pretrained_only_for_timm_names(factory_file: Path) -> None:
    with pytest.raises(ModelLoadError, match="--pretrained only applies to timm") as info:
        load_base_model(f"{factory_file}:build", pretrained=True)
    assert_one_line(info.value)


# --------------------------------------------------------------------------------------------------
# file.py:factory and module:factory
# --------------------------------------------------------------------------------------------------


def test_file_factory_with_parsed_args(factory_file: Path) -> None:
    path_before = list(sys.path)
    modules_before = set(sys.modules)
    args = parse_model_args(
        ["width=6", "scale=0.5", "shape=(2, 3)", "bias=False", "name=gelu", "extra=[1, 'x']"]
    )
    loaded = load_base_model(f"{factory_file}:build", model_args=args)
    assert loaded.model.received == {
        "width": 6,
        "scale": 0.5,
        "shape": (2, 3),
        "bias": False,
        "name": "gelu",
        "extra": [1, "x"],
    }
    assert not loaded.model.training
    assert loaded.input_size == (1, 2, 3)  # from the model's default_input_size attribute
    assert loaded.source.spec == f"{factory_file.resolve()}:build"
    # The file's folder was only on sys.path while importing; the module has a private name.
    assert sys.path == path_before
    assert "tiny_models" not in sys.modules
    assert any(name.startswith("_vitcompress_user_") for name in set(sys.modules) - modules_before)


def test_file_factory_imports_a_sibling_module(tmp_path: Path) -> None:
    (tmp_path / "sibling_helper.py").write_text("WIDTH = 5\n")
    (tmp_path / "net.py").write_text(
        "from torch import nn\n"
        "import sibling_helper\n"
        "def build():\n"
        "    return nn.Linear(sibling_helper.WIDTH, 1)\n"
    )
    loaded = load_base_model(f"{tmp_path / 'net.py'}:build", input_size=(1, 1, 5))
    assert loaded.model.in_features == 5
    assert str(tmp_path) not in sys.path
    sys.modules.pop("sibling_helper", None)


def test_two_files_with_the_same_name_do_not_clash(tmp_path: Path) -> None:
    for width in (3, 4):
        folder = tmp_path / f"v{width}"
        folder.mkdir()
        (folder / "model.py").write_text(
            f"from torch import nn\ndef build():\n    return nn.Linear({width}, 1)\n"
        )
    a = load_base_model(f"{tmp_path / 'v3' / 'model.py'}:build", input_size=(1, 1, 3)).model
    b = load_base_model(f"{tmp_path / 'v4' / 'model.py'}:build", input_size=(1, 1, 4)).model
    assert (a.in_features, b.in_features) == (3, 4)


def test_module_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "vc_test_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(FACTORY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("vc_test_pkg", "vc_test_pkg.models"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    loaded = load_base_model("vc_test_pkg.models:build", model_args={"width": 8})
    assert loaded.model.received["width"] == 8
    assert loaded.input_size == (1, 2, 4)
    assert loaded.source.spec == "vc_test_pkg.models:build"


def test_missing_module_is_reported() -> None:
    with pytest.raises(ModelLoadError, match="no module named 'vc_no_such_pkg'") as info:
        load_base_model("vc_no_such_pkg.models:build")
    assert_one_line(info.value)


def test_factory_returning_a_non_module(factory_file: Path) -> None:
    with pytest.raises(
        ModelLoadError, match=r"returned builtins\.dict, not a torch\.nn\.Module"
    ) as info:
        load_base_model(f"{factory_file}:not_a_model", model_args={"a": 1})
    assert_one_line(info.value)


def test_factory_that_raises(factory_file: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_base_model(f"{factory_file}:broken")
    text = assert_one_line(info.value)
    assert "factory" in text and "broken" in text and text.endswith("ValueError: boom")


def test_factory_with_unexpected_args(factory_file: Path) -> None:
    with pytest.raises(ModelLoadError, match="failed: TypeError") as info:
        load_base_model(f"{factory_file}:build_unsized", model_args={"depth": 2})
    assert_one_line(info.value)


def test_missing_factory_lists_what_the_file_defines(factory_file: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_base_model(f"{factory_file}:biuld")
    text = assert_one_line(info.value)
    assert "no attribute 'biuld'" in text and "build" in text and "Tiny" in text


def test_non_callable_factory(factory_file: Path) -> None:
    with pytest.raises(ModelLoadError, match="is a int, not a callable"):
        load_base_model(f"{factory_file}:NOT_CALLABLE")


def test_missing_file_and_broken_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found") as info:
        load_base_model(f"{tmp_path / 'absent.py'}:build")
    assert_one_line(info.value)

    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ndef build(:\n")
    with pytest.raises(ModelLoadError, match="could not import .*SyntaxError") as info:
        load_base_model(f"{bad}:build")
    assert_one_line(info.value)


def test_file_without_factory_is_explained(factory_file: Path) -> None:
    with pytest.raises(ModelLoadError, match="no factory"):
        load_base_model(str(factory_file))


def test_empty_spec() -> None:
    with pytest.raises(ModelLoadError, match="no model given"):
        load_base_model(" ")


def test_plain_directory_is_not_an_artifact(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="without vitcompress.json"):
        load_base_model(str(tmp_path))


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


def test_safetensors_checkpoint_reproduces_weights(tmp_path: Path) -> None:
    original = tiny_vit()
    path = tmp_path / "weights.safetensors"
    save_file(original.state_dict(), str(path))

    torch.manual_seed(123)  # a different random init, so a no-op load would be noticed
    loaded = load_base_model(TIMM_NAME, model_args=TINY, checkpoint=str(path))
    assert_same_weights(loaded.model, original)
    assert loaded.source.checkpoint == str(path.resolve())


def test_wrapped_torch_checkpoint_reproduces_weights(tmp_path: Path) -> None:
    original = tiny_vit()
    path = tmp_path / "train.pth"
    # A DDP training checkpoint: nested under "model", keys prefixed with "module.".
    state = {f"module.{k}": v for k, v in original.state_dict().items()}
    torch.save({"model": state, "epoch": 7, "optimizer": {"lr": 0.1}}, path)

    torch.manual_seed(123)
    loaded = load_base_model(TIMM_NAME, model_args=TINY, checkpoint=path)
    assert_same_weights(loaded.model, original)


def test_compiled_ema_checkpoint(tmp_path: Path) -> None:
    original = tiny_vit()
    path = tmp_path / "ema.pt"
    state = {f"_orig_mod.{k}": v for k, v in original.state_dict().items()}
    torch.save({"state_dict_ema": state, "step": 10}, path)
    model = tiny_vit()
    torch.nn.init.zeros_(model.head.weight)
    load_checkpoint(model, path)
    assert_same_weights(model, original)


@pytest.mark.parametrize("prefix", ["_orig_mod.module.", "module._orig_mod."])
def test_nested_wrapper_prefixes_in_either_order(tmp_path: Path, prefix: str) -> None:
    # DDP around a compiled model, or a compiled DDP model: both wrappers' prefixes are peeled.
    original = tiny_vit()
    path = tmp_path / "wrapped.pt"
    torch.save({f"{prefix}{k}": v for k, v in original.state_dict().items()}, path)
    model = tiny_vit()
    torch.nn.init.zeros_(model.head.weight)
    load_checkpoint(model, path)
    assert_same_weights(model, original)


def test_timm_training_checkpoint_with_args_namespace(tmp_path: Path) -> None:
    original = tiny_vit()
    path = tmp_path / "checkpoint.pth.tar"
    torch.save(
        {"state_dict": original.state_dict(), "args": argparse.Namespace(lr=0.1), "epoch": 1},
        path,
    )
    model = tiny_vit(num_classes=10)
    torch.nn.init.zeros_(model.head.weight)
    load_checkpoint(model, path)
    assert_same_weights(model, original)


def test_checkpoint_with_missing_and_unexpected_keys(tmp_path: Path) -> None:
    state = tiny_vit().state_dict()
    del state["head.bias"]
    state["extra.weight"] = torch.zeros(3)
    path = tmp_path / "bad.safetensors"
    save_file(state, str(path))

    with pytest.raises(ModelLoadError) as info:
        load_base_model(TIMM_NAME, model_args=TINY, checkpoint=path)
    text = assert_one_line(info.value)
    assert f"checkpoint {path} does not fit model {TIMM_NAME}" in text
    assert "missing keys (1): head.bias" in text
    assert "unexpected keys (1): extra.weight" in text


def test_checkpoint_with_wrong_shapes(tmp_path: Path) -> None:
    path = tmp_path / "ten_classes.pth"
    torch.save(tiny_vit().state_dict(), path)
    with pytest.raises(ModelLoadError) as info:
        load_base_model(TIMM_NAME, model_args={**TINY, "num_classes": 5}, checkpoint=path)
    text = assert_one_line(info.value)
    assert "shape mismatch (2)" in text
    assert "head.weight (checkpoint [10, 64] vs model [5, 64])" in text
    assert "missing" not in text and "unexpected" not in text


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_truncated_checkpoint(tmp_path: Path, suffix: str) -> None:
    full = tmp_path / f"full{suffix}"
    state = tiny_vit().state_dict()
    if suffix == ".pth":
        torch.save(state, full)
    else:
        save_file(state, str(full))
    data = full.read_bytes()
    cut = tmp_path / f"cut{suffix}"
    cut.write_bytes(data[: len(data) // 2])

    with pytest.raises(ModelLoadError, match="truncated") as info:
        load_base_model(TIMM_NAME, model_args=TINY, checkpoint=cut)
    assert_one_line(info.value)


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all"])
def test_garbage_checkpoint(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "junk.bin"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="truncated or corrupt") as info:
        load_checkpoint(tiny_vit(), path)
    assert_one_line(info.value)


def test_missing_checkpoint_fails_before_building(tmp_path: Path, factory_file: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_base_model(f"{factory_file}:broken", checkpoint=tmp_path / "absent.pth")


class _Payload:
    """Unpickling this creates a marker file: stands in for arbitrary code in a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (Path.touch, (self.marker,))


def test_pickled_objects_are_refused_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    path = tmp_path / "evil.pth"
    torch.save({"model": tiny_vit().state_dict(), "hook": _Payload(marker)}, path)

    with pytest.raises(ModelLoadError) as info:
        load_base_model(TIMM_NAME, model_args=TINY, checkpoint=path)
    text = assert_one_line(info.value)
    assert "contains pickled Python objects (" in text
    assert not marker.exists()

    # The payload is real: a plain unpickle would have run it.
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_a_torchscript_file_is_named_as_such_in_one_line(tmp_path: Path, recwarn) -> None:
    """torch.load said "truncated or corrupt", with its own warning and its advice to load
    with weights_only=False (which can run code) around it."""
    import warnings

    path = tmp_path / "model.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script's deprecation
        torch.jit.script(tiny_vit().eval()).save(str(path))
    recwarn.clear()
    with pytest.raises(ModelLoadError) as info:
        load_base_model(TIMM_NAME, model_args=TINY, checkpoint=path)
    text = assert_one_line(info.value)
    assert "is a TorchScript program" in text and "weights_only" not in text
    assert not [w for w in recwarn if "TorchScript" in str(w.message)]


def test_checkpoint_without_weights(tmp_path: Path) -> None:
    path = tmp_path / "meta.pth"
    torch.save({"epoch": 3, "metric": 0.5}, path)
    with pytest.raises(ModelLoadError, match="holds no weights: a dict with keys epoch, metric"):
        load_checkpoint(tiny_vit(), path)

    path = tmp_path / "list.pth"
    torch.save([torch.zeros(1)], path)
    with pytest.raises(ModelLoadError, match="holds a list"):
        load_checkpoint(tiny_vit(), path)


# --------------------------------------------------------------------------------------------------
# Input size
# --------------------------------------------------------------------------------------------------


def test_input_size_from_timm_config() -> None:
    import timm

    full = timm.create_model(TIMM_NAME)
    assert default_input_size(full) == (3, 224, 224)
    # The config still says 224 when the model is built for 32; the patch embedding wins.
    small = tiny_vit()
    assert small.pretrained_cfg["input_size"] == (3, 224, 224)
    assert default_input_size(small) == (3, 32, 32)


def test_input_size_override() -> None:
    # A model that takes other sizes (dynamic_img_size) gets the size it is given.
    dynamic = {**TINY, "dynamic_img_size": True}
    loaded = load_base_model(TIMM_NAME, model_args=dynamic, input_size=(3, 48, 48))
    assert loaded.input_size == (3, 48, 48)
    with pytest.raises(ModelLoadError, match="three positive integers"):
        load_base_model(TIMM_NAME, model_args=TINY, input_size=(3, 48))


def test_user_model_without_input_size_needs_the_option(factory_file: Path) -> None:
    with pytest.raises(ModelLoadError, match="--input-size") as info:
        load_base_model(f"{factory_file}:build_unsized")
    assert_one_line(info.value)
    loaded = load_base_model(f"{factory_file}:build_unsized", input_size=parse_input_size("1,2,2"))
    assert loaded.input_size == (1, 2, 2)


def test_default_input_size_attribute() -> None:
    assert default_input_size(nn.Linear(2, 2)) is None
    model = nn.Linear(2, 2)
    model.input_size = (3, 64, 64)
    assert default_input_size(model) == (3, 64, 64)
    model.input_size = "3,64,64"  # not a size: ignored rather than misread
    assert default_input_size(model) is None


def test_default_input_size_from_a_patch_embedding() -> None:
    from timm.layers import PatchEmbed

    model = nn.Module()
    model.patch_embed = PatchEmbed(img_size=40, patch_size=8, in_chans=1, embed_dim=8)
    assert default_input_size(model) == (1, 40, 40)
    model.default_input_size = (1, 48, 48)  # the model's own word beats inference
    assert default_input_size(model) == (1, 48, 48)


# --------------------------------------------------------------------------------------------------
# ModelSource and artifacts
# --------------------------------------------------------------------------------------------------


def test_model_source_json_round_trip() -> None:
    source = ModelSource(
        spec=TIMM_NAME,
        model_args={
            "img_size": (32, 32),
            "depth": 2,
            "act": "gelu",
            "ids": {1, 2},
            "sizes": [1, (2, 3)],
        },
        checkpoint="/tmp/w.safetensors",
        pretrained=False,
    )
    data = json.loads(json.dumps(source.to_json()))
    back = ModelSource.from_json(data)
    assert back == source
    assert isinstance(back.model_args["img_size"], tuple)
    assert data["model_args"]["depth"] == 2  # plain values stay readable


def test_model_source_rejects_what_it_cannot_record() -> None:
    with pytest.raises(ModelLoadError, match="cannot be recorded"):
        ModelSource("x", {"layer": nn.ReLU}).to_json()
    with pytest.raises(ModelLoadError):
        ModelSource.from_json({"model_args": {}})
    with pytest.raises(ModelLoadError):
        ModelSource.from_json({"spec": "x", "pretrained": "yes"})


def test_artifact_directory_is_for_the_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # vitcompress.api decides that a spec is an artifact; loading builds only base models and
    # says where to go instead of treating the directory as a model file or a timm name.
    (tmp_path / "vitcompress.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="is a compressed model; load it with vitcompress"):
        load_base_model(str(tmp_path))
    calls: list[str] = []

    def fake_load_artifact(spec: str) -> LoadedModel:
        calls.append(spec)
        # Runs on any image size, so that another --input-size is taken.
        model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 2)).train()
        return LoadedModel(model, ModelSource(TIMM_NAME, TINY, None, False), (3, 32, 32))

    monkeypatch.setattr(vitcompress.api, "load_artifact", fake_load_artifact)

    loaded = vitcompress.api.load_model(str(tmp_path))
    assert calls == [str(tmp_path)]
    assert loaded.input_size == (3, 32, 32) and not loaded.model.training
    assert vitcompress.api.load_model(str(tmp_path), input_size=(3, 64, 64)).input_size == (
        3,
        64,
        64,
    )
    with pytest.raises(ModelLoadError, match="does not run on --input-size 1,64,64"):
        vitcompress.api.load_model(str(tmp_path), input_size=(1, 64, 64))
    with pytest.raises(ModelLoadError, match="three positive integers"):
        vitcompress.api.load_model(str(tmp_path), input_size=(3, 64))

    with pytest.raises(ModelLoadError, match="drop --checkpoint"):
        vitcompress.api.load_model(str(tmp_path), checkpoint="w.pth")
    # Base models go to loading, as they are.
    assert vitcompress.api.load_model(TIMM_NAME, TINY).input_size == (3, 32, 32)


def test_errors_pickle_like_normal_exceptions() -> None:
    # Worker processes send exceptions back pickled.
    error = pickle.loads(pickle.dumps(ModelLoadError("one line")))
    assert isinstance(error, ModelLoadError) and str(error) == "one line"


@pytest.mark.parametrize(
    "given,named",
    [
        ({"model_args": {"depth": 2}}, "drop model arguments"),
        ({"checkpoint": "w.safetensors", "pretrained": True}, "drop --checkpoint, --pretrained"),
    ],
)
def test_a_compressed_model_refuses_what_it_fixes(tmp_path: Path, given: dict, named: str) -> None:
    # Refused before the artifact is read: a directory with only its marker file is enough.
    (tmp_path / "vitcompress.json").write_text("{}")
    with pytest.raises(ModelLoadError) as raised:
        vitcompress.api.load_model(str(tmp_path), **given)
    assert str(raised.value).endswith(named)
