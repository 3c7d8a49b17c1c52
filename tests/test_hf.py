"""HuggingFace transformers models (ViT, DeiT, Dinov2, PVT, PVTv2, CvT, Swin, Swinv2 from
their configs): they map, compress with every variant, are exact at keep 1 with sharpened
weights, cost fewer MACs at keep 0.7 and train; a save_pretrained directory works as --model,
through save and load."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")

import vitcompress  # noqa: E402
from tests.fixtures import hf_models  # noqa: E402
from vitcompress.api import compress_loaded  # noqa: E402
from vitcompress.artifacts.artifact import ArtifactError  # noqa: E402
from vitcompress.artifacts.base import load_artifact_base  # noqa: E402
from vitcompress.cli.main import cli  # noqa: E402
from vitcompress.compilation.rewrite import REDUCER_PREFIX  # noqa: E402
from vitcompress.loading import ModelLoadError, load_base_model  # noqa: E402
from vitcompress.measure import count_macs  # noqa: E402

VARIANTS = ("dtps", "etps", "dynamicvit", "evit")
# One variant per class in the default suite (every variant twice over); the rest is slow.
FAST = {
    ("hf_vit", "dtps"),
    ("hf_deit", "etps"),
    ("hf_dinov2", "dynamicvit"),
    ("hf_pvt", "evit"),
    ("hf_pvt_v2", "dtps"),
    ("hf_cvt", "etps"),
    ("hf_swin", "dtps"),
    ("hf_swinv2", "evit"),
}
BLOCKS = {
    "hf_vit": 4,
    "hf_deit": 4,
    "hf_dinov2": 4,
    "hf_pvt": 4,
    "hf_pvt_v2": 4,
    "hf_cvt": 6,
    "hf_swin": 4,
    "hf_swinv2": 4,
}
CASES = [
    pytest.param(name, variant, marks=() if (name, variant) in FAST else pytest.mark.slow)
    for name in hf_models.BUILDERS
    for variant in VARIANTS
]


def _wrapped(name: str):
    model, size = hf_models.build(name)
    return hf_models.sharpen(hf_models.Logits(model)), size


@pytest.mark.parametrize("name", list(hf_models.BUILDERS))
def test_every_class_maps_with_all_its_blocks(name):
    model, size = _wrapped(name)
    model_map = vitcompress.map_model(model, size)
    assert len(model_map.blocks) == BLOCKS[name]
    assert model_map.capture in ("symbolic_trace", "guarded_trace")


@pytest.mark.parametrize(("name", "variant"), CASES)
def test_exact_at_keep_one_cheaper_at_keep_0_7_and_trains(name, variant):
    model, size = _wrapped(name)
    x = torch.randn(2, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(x)
        same = vitcompress.compress(model, variant, keep=1.0, input_size=size).eval()(x)
    assert float((same - base).abs().max()) <= 1e-4 * float(base.abs().max())

    reduced = vitcompress.compress(model, variant, keep=0.7, input_size=size)
    assert count_macs(reduced, size) < count_macs(model, size)
    reduced.train()
    logits = reduced(x)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1]))
    loss.backward()
    assert math.isfinite(float(loss.detach()))
    grads = {n: p.grad for n, p in reduced.named_parameters() if p.grad is not None}
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads.values())
    if variant in ("dtps", "dynamicvit"):  # the predictors learn through the training path
        predictor = [g for n, g in grads.items() if n.startswith(f"{REDUCER_PREFIX}.")]
        assert predictor and any(float(g.abs().sum()) > 0 for g in predictor)


@pytest.fixture
def hf_dir(tmp_path):
    """A tiny HF ViT saved with save_pretrained, with its image processor's mean/std."""
    model, _ = hf_models.build("hf_vit")
    directory = tmp_path / "hf-vit"
    model.save_pretrained(directory)
    processor = {"image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.2, 0.2], "resample": 2}
    (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    return directory, model


def test_a_save_pretrained_directory_loads_with_its_weights_size_and_preprocessing(hf_dir):
    directory, original = hf_dir
    loaded = load_base_model(str(directory))
    assert loaded.input_size == (3, 32, 32)  # the config's image_size and num_channels
    assert loaded.source.spec == str(directory.resolve())
    assert loaded.source.checkpoint == str(directory.resolve() / "model.safetensors")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded.model(x), original(pixel_values=x).logits)
    assert loaded.model.data_config == {
        "mean": [0.5, 0.4, 0.3],
        "std": [0.2, 0.2, 0.2],
        "interpolation": "bilinear",
    }


def test_apply_on_a_directory_saves_an_artifact_that_records_it_and_rebuilds(hf_dir, tmp_path):
    directory, _ = hf_dir
    out = tmp_path / "compressed"
    result = CliRunner().invoke(
        cli,
        [
            "apply",
            "--model",
            str(directory),
            "--variant",
            "etps",
            "--keep",
            "0.7",
            "--no-throughput",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "vitcompress.json").read_text())
    assert meta["source"]["spec"] == str(directory.resolve())
    assert meta["base_weights"] == str(directory.resolve() / "model.safetensors")
    assert len(meta["base_weights_sha256"]) == 64
    assert meta["data_config"]["mean"] == [0.5, 0.4, 0.3]

    model = vitcompress.load(out)
    base = load_artifact_base(out).model
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert model(x).shape == (2, hf_models.NUM_LABELS)
        assert base(x).shape == (2, hf_models.NUM_LABELS)

    # Weights changed in the directory after the save: the base is no longer the one compressed.
    changed, _ = hf_models.build("hf_vit", seed=1)
    changed.save_pretrained(directory)
    with pytest.raises(ArtifactError, match="changed since the artifact was saved"):
        load_artifact_base(out)


def test_finetune_one_step_trains_the_predictors_of_an_hf_model(hf_dir, tmp_path, monkeypatch):
    from torch.utils.data import TensorDataset

    from vitcompress.workflows.finetune import FinetuneConfig, finetune

    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    directory, _ = hf_dir
    base = load_base_model(str(directory))
    student = compress_loaded(base, "dtps", keep=0.7)
    before = {
        n: p.detach().clone()
        for n, p in student.model.named_parameters()
        if n.startswith(f"{REDUCER_PREFIX}.")
    }
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(x, torch.tensor([0, 1, 2, 3]))
    config = FinetuneConfig(epochs=1, batch_size=4, lr=1e-3, warmup_epochs=0, log_every=1)
    result = finetune(student, base.model, data, None, tmp_path / "run", config)
    try:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    except ImportError:
        pass
    assert result["steps"] == 1
    steps = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["type"] == "step"
    ]
    assert steps and math.isfinite(steps[0]["loss"])
    after = dict(student.model.named_parameters())
    assert before and any(not torch.equal(after[n].detach(), v) for n, v in before.items())


def test_weights_that_do_not_cover_the_model_are_refused_not_randomly_initialised(tmp_path):
    from safetensors.torch import load_file, save_file

    model, _ = hf_models.build("hf_vit")
    directory = tmp_path / "hf-vit"
    model.save_pretrained(directory)
    weights = directory / "model.safetensors"
    state = {k: v for k, v in load_file(str(weights)).items() if "classifier" not in k}
    save_file(state, str(weights), metadata={"format": "pt"})
    # transformers would start the classifier from random values, with a warning only.
    with pytest.raises(ModelLoadError, match="2 missing or mismatched .*classifier"):
        load_base_model(str(directory))


@pytest.mark.parametrize("variant", ["etps", "dtps"])
def test_dinov2_with_registers_maps_its_registers_as_prefix_tokens(variant):
    # Its embedding splits the cls token off and joins it again around the registers
    # (cat([x[:, :1], registers, x[:, 1:]])): the prefix is 1 + 2, not the cls counted twice.
    from vitcompress.loading.hf import HFImageClassifier

    torch.manual_seed(0)
    config = transformers.Dinov2WithRegistersConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=2, intermediate_size=128,
        image_size=56, patch_size=7, num_register_tokens=2, num_labels=10,
    )  # fmt: skip
    hf = transformers.Dinov2WithRegistersForImageClassification(config)
    with torch.no_grad():  # sharper attention: a token out of place shows in the logits
        for name, weight in hf.named_parameters():
            if name.endswith(("query.weight", "key.weight", "q_proj.weight", "k_proj.weight")):
                weight.mul_(4.0)
    model = HFImageClassifier(hf, (3, 56, 56)).eval()
    stage = vitcompress.map_model(model, (3, 56, 56)).stages[0]
    assert (stage.prefix_tokens, tuple(stage.grid)) == (3, (8, 8))
    x = torch.randn(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))
    exact = vitcompress.compress(model, variant, keep=1.0, locs=[1], input_size=(3, 56, 56))
    reduced = vitcompress.compress(model, variant, keep=0.7, locs=[1], input_size=(3, 56, 56))
    with torch.no_grad():
        torch.testing.assert_close(exact.eval()(x), model(x), rtol=1e-4, atol=1e-5)
        assert reduced.eval()(x).shape == (2, 10)


def test_labels_for_a_backbone_without_a_head_are_refused(tmp_path):
    """transformers takes num_labels for any model; a ViTModel has no head, so the classes a
    user asked for would silently not exist."""
    import transformers

    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    transformers.ViTModel(config).save_pretrained(tmp_path / "vit")
    with pytest.raises(ModelLoadError, match=r"^--model-arg num_labels: .* ViTModel without a"):
        load_base_model(str(tmp_path / "vit"), {"num_labels": 10})
    assert load_base_model(str(tmp_path / "vit")).input_size == (3, 32, 32)


def test_entry_forward_features_compresses_a_directorys_tokens(tmp_path):
    """A Dinov2Model directory's last_hidden_state through --entry forward_features: exact at
    keep 1 on sharpened attention, the base's shape at keep 0.7, saved and reloaded."""
    import transformers

    from vitcompress.api import compress, load, load_model

    torch.manual_seed(0)
    config = transformers.Dinov2Config(
        image_size=28, patch_size=4, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
        intermediate_size=128,
    )  # fmt: skip
    backbone = transformers.Dinov2Model(config).eval()
    with torch.no_grad():
        for name, weight in backbone.named_parameters():
            if name.endswith(("query.weight", "key.weight")):
                weight.mul_(5)  # peaked attention: a token in the wrong place shows
    backbone.save_pretrained(tmp_path / "dinov2")
    features = load_model(str(tmp_path / "dinov2"), entry="forward_features").model
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        tokens = backbone(pixel_values=x).last_hidden_state
        assert torch.equal(features(x), tokens)
        exact = compress(features, "dtps", keep=1.0)(x)
        assert (exact - tokens).abs().max() < 1e-5
    result = CliRunner().invoke(
        cli,
        ["apply", "--model", str(tmp_path / "dinov2"), "--entry", "forward_features",
         "--variant", "etps", "--keep", "0.7", "--no-throughput", "--out", str(tmp_path / "small")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    small = load(tmp_path / "small")
    with torch.no_grad():
        assert small(x).shape == tokens.shape
