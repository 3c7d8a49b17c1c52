"""--model DIR for a HuggingFace save_pretrained directory: the one-line errors (no transformers
installed, no weights file), which need no transformers to check."""

import json
import sys

import pytest
from click.testing import CliRunner

from vitcompress.cli.main import cli
from vitcompress.loading import ModelLoadError, load_base_model


def _directory(tmp_path, weights: bool = True):
    directory = tmp_path / "hf-model"
    directory.mkdir()
    config = {"model_type": "vit", "architectures": ["ViTForImageClassification"]}
    (directory / "config.json").write_text(json.dumps(config))
    if weights:
        (directory / "model.safetensors").write_bytes(b"")
    return directory


def test_without_transformers_the_directory_is_refused_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    directory = _directory(tmp_path)
    with pytest.raises(ModelLoadError, match=r"pip install 'vitcompress\[hf\]'"):
        load_base_model(str(directory))
    result = CliRunner().invoke(cli, ["inspect", "--model", str(directory)])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "transformers" in result.output


def test_a_directory_without_weights_is_one_line(tmp_path):
    pytest.importorskip("transformers")
    directory = _directory(tmp_path, weights=False)
    with pytest.raises(ModelLoadError, match="holds no weights file"):
        load_base_model(str(directory))


def test_a_plain_directory_names_both_kinds_of_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match=r"vitcompress.json .* or config.json"):
        load_base_model(str(tmp_path))
