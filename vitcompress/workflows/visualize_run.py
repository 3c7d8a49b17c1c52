"""``vitcompress visualize`` as one workflow: feed one image to a compressed model as ``eval``
feeds it, record each location, and draw the kept tokens and their hosts
(:mod:`vitcompress.workflows.visualize`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vitcompress.compilation.metadata import compression_info
from vitcompress.data import resolve_data_config
from vitcompress.workflows.inputs import ModelRequest
from vitcompress.workflows.visualize import (
    LocationRecord,
    VisualizeError,
    draw_locations,
    load_image,
    record_locations,
)


@dataclass
class VisualizeResult:
    spec: str
    image: str
    out: str
    records: list[LocationRecord]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.spec,
            "image": self.image,
            "out": self.out,
            "locations": [r.to_json() for r in self.records],
        }


def visualize_model(request: ModelRequest, image: str, out: str) -> VisualizeResult:
    loaded = request.load()
    if len(loaded.input_size) != 3:
        raise VisualizeError(
            f"visualize feeds one image (C, H, W); {request.spec} takes input "
            f"{','.join(map(str, loaded.input_size))} (a video model's grid is not drawn)"
        )
    # Fed as eval feeds it: the model's own normalisation and resize interpolation.
    data_config = resolve_data_config(loaded.model, loaded.input_size[0])
    picture, tensor = load_image(image, loaded.input_size, data_config)
    records, logits = record_locations(loaded.model, tensor)
    info = compression_info(loaded.model)
    assert info is not None  # record_locations refuses an uncompressed model
    title = f"{request.spec}: {info.plan.variant}"
    if isinstance(logits, torch.Tensor) and logits.dim() == 2:  # a classifier's (1, classes)
        title += f", predicted class {int(logits.argmax(-1)[0])}"
    draw_locations(picture, records, out, title=title)
    return VisualizeResult(request.spec, image, out, records)
