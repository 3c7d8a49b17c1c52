"""An exported ONNX file records the preprocessing its model states, so that ``eval`` of the file
alone feeds it what the model expects; a model that states none gets no record."""

from __future__ import annotations

import json

import onnx
import pytest
import timm
from torch import nn

from vitcompress.data.config import resolve_data_config
from vitcompress.measure.onnx_eval import PREPROCESSING_KEY
from vitcompress.workflows.export import export_model


def _props(path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}


def test_timm_model_records_its_own_config(tmp_path) -> None:
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=10)
    # Not ImageNet's defaults, so a writer that ignored the model would be caught.
    model.pretrained_cfg = {**model.pretrained_cfg, "mean": (0.1, 0.2, 0.3), "crop_pct": 0.75}
    export_model(model, (3, 32, 32), "onnx", tmp_path / "a.onnx", batch_size=2)
    recorded = json.loads(_props(tmp_path / "a.onnx")[PREPROCESSING_KEY])
    expected = resolve_data_config(model, channels=3).to_json()
    assert recorded == json.loads(json.dumps(expected))
    assert recorded["mean"] == pytest.approx([0.1, 0.2, 0.3])
    assert recorded["crop_pct"] == 0.75


def test_model_stating_nothing_gets_no_record(tmp_path) -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 4, 4), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))
    export_model(model, (3, 32, 32), "onnx", tmp_path / "b.onnx", batch_size=2)
    assert PREPROCESSING_KEY not in _props(tmp_path / "b.onnx")


def test_only_the_fields_a_model_states_are_recorded(tmp_path) -> None:
    # mean and std stated, crop_pct not: eval lets the images choose it (1.0 for images no
    # larger than the input), so a recorded default 0.875 would crop where the model does not.
    model = nn.Sequential(nn.Conv2d(3, 4, 4, 4), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))
    model.data_config = {"mean": (0.2, 0.2, 0.2), "std": (0.3, 0.3, 0.3)}
    export_model(model, (3, 32, 32), "onnx", tmp_path / "c.onnx", batch_size=2)
    recorded = json.loads(_props(tmp_path / "c.onnx")[PREPROCESSING_KEY])
    assert recorded == {"mean": pytest.approx([0.2] * 3), "std": pytest.approx([0.3] * 3)}
