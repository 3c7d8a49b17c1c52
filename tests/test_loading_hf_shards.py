"""A HuggingFace directory whose weights save_pretrained sharded (an index naming the shard of
each weight, safetensors or .bin) loads as transformers loads it, with exactly the saved
weights; a shard that is not there, or that does not hold exactly the weights the index maps to
it, is refused in one line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from vitcompress.cli.main import cli  # noqa: E402
from vitcompress.loading import ModelLoadError, load_base_model  # noqa: E402
from vitcompress.loading.shards import weights_sha256  # noqa: E402

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=8, num_labels=5,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config).eval()


def _index(directory: Path, name: str) -> dict[str, str]:
    return json.loads((directory / name).read_text())["weight_map"]


def _save_sharded(directory: Path, model: torch.nn.Module, form: str) -> Path:
    """``model`` saved in shards of 20 KB: its index."""
    if form == "safetensors":
        model.save_pretrained(directory, max_shard_size="20KB")
        index = directory / SAFE_INDEX
    else:
        model.save_pretrained(directory, max_shard_size="20KB", safe_serialization=False)
        index = directory / BIN_INDEX
        if not index.is_file():  # transformers 5 writes safetensors shards whatever it is told
            _to_bin_shards(directory)
    assert index.is_file() and not (directory / "model.safetensors").exists()
    assert len(set(_index(directory, index.name).values())) > 1  # really sharded
    return index


def _to_bin_shards(directory: Path) -> None:
    """The safetensors shards of ``directory`` rewritten as transformers 4 wrote .bin ones."""
    names = sorted(set(_index(directory, SAFE_INDEX).values()))
    weight_map = {}
    for i, name in enumerate(names, start=1):
        state = load_file(str(directory / name))
        shard = f"pytorch_model-{i:05d}-of-{len(names):05d}.bin"
        torch.save(state, directory / shard)
        weight_map.update(dict.fromkeys(state, shard))
        (directory / name).unlink()
    (directory / SAFE_INDEX).unlink()
    (directory / BIN_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(params=["safetensors", "bin"])
def sharded(request, tmp_path):
    model = _model()
    directory = tmp_path / "hf-vit"
    return directory, _save_sharded(directory, model, request.param), model


def test_a_sharded_directory_loads_exactly_the_saved_weights(sharded):
    directory, index, original = sharded
    loaded = load_base_model(str(directory))
    assert loaded.source.checkpoint == str(index.resolve())
    assert loaded.input_size == (3, 32, 32)
    ours = loaded.model.model.state_dict()
    saved = original.state_dict()
    assert ours.keys() == saved.keys()
    assert all(torch.equal(ours[k], saved[k]) for k in saved)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.model(x), original(pixel_values=x).logits)


def test_the_cli_takes_a_sharded_directory_as_model(sharded):
    directory, _, _ = sharded
    result = CliRunner().invoke(cli, ["inspect", "--model", str(directory), "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.output)["blocks"]) == 2


def test_a_shard_index_as_checkpoint_loads_its_shards(sharded, tmp_path):
    directory, index, original = sharded
    other = tmp_path / "other"
    _model(seed=1).save_pretrained(other)  # the same architecture, other weights, one file
    loaded = load_base_model(str(other), checkpoint=index)
    assert loaded.source.checkpoint == str(index.resolve())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.model(x), original(pixel_values=x).logits)


def _read(shard: Path) -> dict[str, torch.Tensor]:
    if shard.suffix == ".safetensors":
        return load_file(str(shard))
    return torch.load(shard, weights_only=True)


def _rewrite(shard: Path, edit) -> None:
    if shard.suffix == ".safetensors":
        save_file(edit(_read(shard)), str(shard), metadata={"format": "pt"})
    else:
        torch.save(edit(_read(shard)), shard)


def _largest_shard(directory: Path, index: Path) -> Path:
    names = list(_index(directory, index.name).values())
    return directory / max(sorted(set(names)), key=names.count)


def _one_line_refusal(directory: Path, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        load_base_model(str(directory))
    result = CliRunner().invoke(cli, ["inspect", "--model", str(directory)])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


def test_a_missing_shard_is_refused_naming_it(sharded):
    directory, index, _ = sharded
    shard = _largest_shard(directory, index)
    shard.unlink()
    _one_line_refusal(directory, rf"shard {shard.name} named by {index.name} is not in ")


def test_a_weight_the_index_maps_to_a_shard_that_lacks_it_is_refused(sharded):
    directory, index, _ = sharded
    shard = _largest_shard(directory, index)
    dropped = sorted(k for k, v in _index(directory, index.name).items() if v == shard.name)[0]
    _rewrite(shard, lambda state: {k: v for k, v in state.items() if k != dropped})
    _one_line_refusal(
        directory, rf"{shard.name} lacks 1 weights {index.name} maps to it \({dropped}\)"
    )


def test_a_weight_the_index_does_not_map_to_its_shard_is_refused(sharded):
    # A second copy of a weight the index routes to another shard: transformers would load
    # both, one silently deciding the weight's value.
    directory, index, _ = sharded
    mapping = _index(directory, index.name)
    shard = _largest_shard(directory, index)
    key = sorted(k for k, v in mapping.items() if v != shard.name)[0]
    copy = _read(directory / mapping[key])[key] + 1
    _rewrite(shard, lambda state: {**state, key: copy})
    _one_line_refusal(
        directory, rf"{shard.name} holds 1 weights {index.name} does not map to it \({key}\)"
    )


def test_a_shard_holding_a_weight_the_index_does_not_list_is_refused(sharded):
    directory, index, _ = sharded
    shard = _largest_shard(directory, index)
    _rewrite(shard, lambda state: {**state, "vit.extra.weight": torch.zeros(3)})
    _one_line_refusal(directory, rf"{shard.name} holds 1 weights .* \(vit.extra.weight\)")


@pytest.mark.parametrize("text", ["not json", '{"metadata": {}}', '{"weight_map": {"a": 1}}'])
def test_an_index_that_is_not_one_is_refused_in_one_line(tmp_path, text):
    directory = tmp_path / "hf-vit"
    _save_sharded(directory, _model(), "safetensors")
    (directory / SAFE_INDEX).write_text(text)
    _one_line_refusal(directory, rf"shard index {directory.resolve() / SAFE_INDEX}")


def test_the_digest_of_an_index_covers_its_shards(tmp_path):
    directory = tmp_path / "hf-vit"
    index = _save_sharded(directory, _model(), "safetensors")
    before = weights_sha256(index)
    assert weights_sha256(index) == before
    shard = _largest_shard(directory, index)
    _rewrite(shard, lambda state: {k: v + 1 for k, v in state.items()})  # index unchanged
    assert weights_sha256(index) != before
    single = tmp_path / "single"
    _model().save_pretrained(single)
    weights = single / "model.safetensors"
    assert weights_sha256(weights) == hashlib.sha256(weights.read_bytes()).hexdigest()


def test_an_artifact_of_a_sharded_directory_records_its_index_and_rebuilds_its_base(tmp_path):
    import vitcompress
    from vitcompress.api import compress_loaded
    from vitcompress.artifacts.artifact import ArtifactError
    from vitcompress.artifacts.base import load_artifact_base

    directory = tmp_path / "hf-vit"
    index = _save_sharded(directory, _model(), "safetensors")
    out = tmp_path / "compressed"
    vitcompress.save(compress_loaded(load_base_model(str(directory)), "etps", keep=0.7).model, out)
    meta = json.loads((out / "vitcompress.json").read_text())
    assert meta["base_weights"] == str(index.resolve())
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(load_artifact_base(out).model(x), _model()(pixel_values=x).logits)
    assert meta["base_weights_sha256"] == weights_sha256(index)
    # A shard rewritten after the save (the index unchanged) gives another base.
    _rewrite(_largest_shard(directory, index), lambda state: {k: v + 1 for k, v in state.items()})
    with pytest.raises(ArtifactError, match="changed since the artifact was saved"):
        load_artifact_base(out)


@pytest.mark.parametrize(("key", "value"), [("use_safetensors", False), ("variant", "fp16")])
def test_a_model_arg_choosing_another_weights_file_is_refused(tmp_path, key, value):
    # With use_safetensors=False transformers would read pytorch_model.bin, while the source
    # records (and an artifact checks) model.safetensors as the model's weights.
    directory = tmp_path / "hf-vit"
    _model().save_pretrained(directory)
    torch.save(_model(seed=1).state_dict(), directory / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=rf"--model-arg {key}: .* --checkpoint FILE"):
        load_base_model(str(directory), {key: value})
    arg = f"{key}={value!r}"
    result = CliRunner().invoke(cli, ["inspect", "--model", str(directory), "--model-arg", arg])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    loaded = load_base_model(str(directory), checkpoint=directory / "pytorch_model.bin")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.model(x), _model(seed=1)(pixel_values=x).logits)
