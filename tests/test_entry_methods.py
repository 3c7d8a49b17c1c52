"""The base's own methods on a compressed model, and ``compress(..., entry=...)``.

A small timm DINOv2 (``vit_small_patch14_dinov2`` at 28 px, patch 4, width 64, depth 6) with
sharpened random weights (``sharpen`` of ``test_dense_outputs``: q/k x3, LayerScale 1, residual
branches x3; DINOv2's LayerScale of 1e-5 would otherwise hide every error), for every method:

- ``forward_features`` of a compressed model equals the base's at keep 1 and has its shape at 0.7;
- at 0.7 it keeps the tokens the forward keeps: ``forward_head(forward_features(x))`` is the
  compressed forward's output, which fresh predictors or another scoring would break;
- it runs on the compressed model's own tensors: gradients reach its predictors, a change of its
  weights changes the features, a dtype conversion and a deepcopy carry it along;
- ``compress(..., entry="forward_features")`` and ``--entry`` compress the method itself, and an
  artifact rebuilds it; what cannot run is one line naming the method.
"""

from __future__ import annotations

import copy
import json

import pytest
import safetensors.torch
import timm
import torch
from click.testing import CliRunner
from torch import Tensor, nn

from tests.test_dense_outputs import sharpen
from vitcompress.api import compress, load, load_model, save
from vitcompress.cli.main import cli
from vitcompress.compilation.entries import EntryError, entry_view

METHODS = ("dtps", "etps", "dynamicvit", "evit", "tome")
INPUT_SIZE = (3, 28, 28)
DINOV2_ARGS = dict(img_size=28, patch_size=4, embed_dim=64, depth=6, num_heads=2, num_classes=10)


def small_dinov2() -> nn.Module:
    torch.manual_seed(0)
    return sharpen(timm.create_model("vit_small_patch14_dinov2", **DINOV2_ARGS), branch=3.0)


@pytest.fixture(scope="module")
def base() -> nn.Module:
    return small_dinov2()


@pytest.fixture(scope="module")
def image() -> Tensor:
    return torch.randn(4, *INPUT_SIZE, generator=torch.Generator().manual_seed(1))


def compressed(model: nn.Module, method: str, keep: float, **kwargs) -> nn.Module:
    torch.manual_seed(0)  # the predictors' init
    return compress(model, variant=method, keep=keep, input_size=INPUT_SIZE, **kwargs).eval()


def flat(out) -> list[Tensor]:
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in flat(item)]
    return [out]


@pytest.mark.parametrize("method", METHODS)
def test_forward_features_is_the_bases_at_keep_one_and_keeps_its_shape(base, image, method):
    with torch.no_grad():
        expected = base.forward_features(image)
        exact = compressed(base, method, 1.0).forward_features(image)
        reduced = compressed(base, method, 0.7).forward_features(image)
    torch.testing.assert_close(exact, expected, atol=1e-5, rtol=0)
    assert reduced.shape == expected.shape
    assert not torch.allclose(reduced, expected, atol=1e-3)  # tokens were dropped


@pytest.mark.parametrize("method", METHODS)
def test_the_features_keep_the_tokens_the_forward_keeps(base, image, method):
    """The features run the same reducers, predictors and scoring as the forward: the base's
    head on them gives the compressed forward's logits."""
    small = compressed(base, method, 0.7)
    with torch.no_grad():
        logits = small(image)
        from_features = small.forward_head(small.forward_features(image))
    torch.testing.assert_close(from_features, logits, atol=1e-5, rtol=0)
    assert small.forward_head(small.forward_features(image), pre_logits=True).shape == (4, 64)


def test_the_features_run_on_the_compressed_models_own_weights(base, image):
    small = compressed(base, "dtps", 0.7).train()
    small.forward_features(image).pow(2).mean().backward()
    grads = {n: p.grad for n, p in small.named_parameters() if "predictor" in n}
    assert grads and all(g is not None for g in grads.values())
    assert sum(g.abs().sum().item() for g in grads.values()) > 0
    small.eval()
    with torch.no_grad():
        before = small.forward_features(image)
        small.get_parameter("blocks.5.mlp.fc2.weight").mul_(2.0)
        after = small.forward_features(image)
    assert not torch.allclose(before, after, atol=1e-3)


def test_a_converted_and_a_copied_model_answer_on_their_own_tensors(base, image):
    small = compressed(base, "etps", 1.0)
    with torch.no_grad():
        expected = copy.deepcopy(base).double().forward_features(image.double())
        small.forward_features(image)  # compiled before the conversion
        small.double()
        torch.testing.assert_close(small.forward_features(image.double()), expected)
        twin = copy.deepcopy(small)
        twin.get_parameter("norm.weight").zero_()
        torch.testing.assert_close(small.forward_features(image.double()), expected)
        assert twin.forward_features(image.double()).abs().max() <= twin.norm.bias.abs().max()


@pytest.mark.parametrize("method", ["dtps", "tome"])
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("forward_intermediates", {}),
        ("forward_intermediates", {"indices": 2, "intermediates_only": True}),
        ("get_intermediate_layers", {"n": 2, "reshape": True, "return_prefix_tokens": True}),
    ],
)
def test_intermediate_outputs_are_the_bases(base, image, method, name, kwargs):
    with torch.no_grad():
        expected = flat(getattr(base, name)(image, **kwargs))
        exact = flat(getattr(compressed(base, method, 1.0), name)(image, **kwargs))
        reduced = flat(getattr(compressed(base, method, 0.7), name)(image, **kwargs))
    assert [t.shape for t in reduced] == [t.shape for t in expected]
    for got, want in zip(exact, expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_only_the_bases_methods_are_there(base):
    small = compressed(base, "etps", 0.7)
    assert hasattr(small, "forward_features") and hasattr(small, "forward_intermediates")
    assert not hasattr(small, "get_image_features")  # an HF method this timm base lacks
    with pytest.raises(AttributeError, match="get_image_features"):
        small.get_image_features  # noqa: B018


def test_what_cannot_run_is_one_line_naming_the_method(base, image):
    small = compressed(base, "etps", 0.7)
    # Stopping after block 0 leaves the plan's later locations without a block.
    with pytest.raises(EntryError, match="forward_intermediates") as refused:
        small.forward_intermediates(image, indices=[0], stop_early=True, intermediates_only=True)
    assert "\n" not in str(refused.value) and "entry='forward_intermediates'" in str(refused.value)
    with pytest.raises(EntryError, match="plain arguments"):
        small.forward_intermediates(image, indices=torch.tensor([1]))
    with pytest.raises(EntryError, match="has no method blocks"):
        compress(base, "etps", 0.7, input_size=INPUT_SIZE, entry="blocks")
    with pytest.raises(EntryError, match="has no method nope") as refused:
        compress(base, "etps", 0.7, input_size=INPUT_SIZE, entry="nope")
    # The examples are the model's own methods, never the one it lacks.
    assert "e.g. forward_features, forward_head, forward_intermediates" in str(refused.value)
    with pytest.raises(EntryError, match="has no method forward_features") as refused:
        entry_view(torch.nn.Linear(2, 2), "forward_features")
    assert "e.g." not in str(refused.value) and "none named forward_*" in str(refused.value)


@pytest.mark.parametrize("method", METHODS)
def test_entry_compresses_the_method_itself(base, image, method):
    with torch.no_grad():
        expected = base.forward_features(image)
        exact = compressed(base, method, 1.0, entry="forward_features")
        reduced = compressed(base, method, 0.7, entry="forward_features")
        torch.testing.assert_close(exact(image), expected, atol=1e-5, rtol=0)
        assert reduced(image).shape == expected.shape
        torch.testing.assert_close(reduced.forward_features(image), reduced(image))
    assert type(reduced).__name__ == "VisionTransformer"
    # The base's parameter names: a base checkpoint loads into the compressed model.
    names = {n for n, _ in reduced.named_parameters() if not n.startswith("tps")}
    assert names <= {n for n, _ in base.named_parameters()}


def test_an_artifact_rebuilds_its_entry(tmp_path, image):
    loaded = load_model("vit_small_patch14_dinov2", DINOV2_ARGS, entry="forward_features")
    sharpen(loaded.model, branch=3.0)
    small = compressed(loaded.model, "dtps", 0.7)
    save(small, tmp_path / "features", source=loaded.source)
    assert json.loads((tmp_path / "features" / "vitcompress.json").read_text())["entry"] == (
        "forward_features"
    )
    back = load(tmp_path / "features")
    with torch.no_grad():
        torch.testing.assert_close(back(image), small(image))
        assert back(image).shape == (4, 50, 64)


def test_a_loaded_forward_model_answers_with_its_saved_predictors(tmp_path, base, image):
    loaded = load_model("vit_small_patch14_dinov2", DINOV2_ARGS)
    sharpen(loaded.model, branch=3.0)
    small = compressed(loaded.model, "dynamicvit", 0.7)
    save(small, tmp_path / "logits", source=loaded.source)
    back = load(tmp_path / "logits")
    with torch.no_grad():
        torch.testing.assert_close(back.forward_features(image), small.forward_features(image))


def test_the_command_line_entry(tmp_path):
    args = [f"--model-arg={k}={v}" for k, v in DINOV2_ARGS.items() if k != "depth"]
    common = ["--model", "vit_small_patch14_dinov2", *args, "--model-arg=depth=4"]
    runner = CliRunner()
    out = tmp_path / "a"
    result = runner.invoke(
        cli,
        ["apply", *common, "--entry", "forward_features", "--variant", "tome", "--keep", "0.7"]
        + ["--no-throughput", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert "the model's output (50, 64)" in result.output  # restored for the features
    assert json.loads((out / "vitcompress.json").read_text())["entry"] == "forward_features"
    refused = runner.invoke(cli, ["inspect", *common, "--entry", "nope"])
    assert refused.exit_code != 0
    assert "has no method nope" in refused.output
    assert len(refused.output.strip().splitlines()) == 1


def test_the_base_rebuilt_from_an_entry_artifact_runs_the_same_entry(tmp_path, image):
    # Compressing again, timing and distilling against the recorded base compare like with like:
    # the base's features, not its logits.
    from vitcompress.artifacts.base import load_artifact_base
    from vitcompress.measure.models import base_for_timing
    from vitcompress.workflows.apply import base_to_compress
    from vitcompress.workflows.finetune import student_and_teacher

    torch.manual_seed(0)
    weights = tmp_path / "base.safetensors"
    base = load_model("vit_small_patch14_dinov2", DINOV2_ARGS, entry="forward_features")
    safetensors.torch.save_file(base.model.state_dict(), str(weights))
    loaded = load_model(
        "vit_small_patch14_dinov2", DINOV2_ARGS, checkpoint=weights, entry="forward_features"
    )
    save(compressed(loaded.model, "etps", 0.7), tmp_path / "features", source=loaded.source)
    artifact = load_model(str(tmp_path / "features"))
    with torch.no_grad():
        expected = base.model.forward_features(image)
        for rebuilt in (
            load_artifact_base(tmp_path / "features").model,
            base_to_compress(artifact).model,
            base_for_timing(artifact).model,
            student_and_teacher(artifact, "etps", None, None, "score")[1],
        ):
            torch.testing.assert_close(rebuilt(image), expected)
    again = compress(base_to_compress(artifact).model, "etps", keep=0.5, input_size=INPUT_SIZE)
    assert again.eval()(image).shape == (4, 50, 64)


def _image_embeddings(out) -> Tensor:
    """HF's ``get_image_features``: a tensor, or (newer transformers) an output whose
    ``pooler_output`` is it; a compressed graph gives that output as a dict."""
    return out if isinstance(out, Tensor) else out["pooler_output"]


def test_hf_get_image_features_as_the_entry(image):
    from transformers import CLIPConfig, CLIPModel

    vision = dict(image_size=28, patch_size=4, hidden_size=64, intermediate_size=128)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = CLIPConfig(
        text_config=text,
        vision_config={**vision, "num_hidden_layers": 4, "num_attention_heads": 2},
        projection_dim=16,
    )
    torch.manual_seed(0)
    clip = sharpen(CLIPModel(config))
    with torch.no_grad():
        expected = _image_embeddings(clip.get_image_features(image))
        exact = compressed(clip, "etps", 1.0, entry="get_image_features")
        reduced = compressed(clip, "etps", 0.7, entry="get_image_features")
        torch.testing.assert_close(_image_embeddings(exact(image)), expected, atol=1e-5, rtol=0)
        by_name = _image_embeddings(reduced.get_image_features(pixel_values=image))
        torch.testing.assert_close(by_name, _image_embeddings(reduced(image)))
    assert by_name.shape == expected.shape
    assert not hasattr(reduced, "forward_features")
