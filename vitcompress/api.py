"""The Python API: ``compress``, ``save``, ``load``."""

from __future__ import annotations

import torch
from torch import nn

from vitcompress.graph.analyse import analyse
from vitcompress.graph.capture import capture
from vitcompress.graph.model_map import ModelMap
from vitcompress.graph.rewrite import rewrite
from vitcompress.plan import Plan, make_plan

EXAMPLE_BATCH = 2  # batch 1 would hide which dimension is the batch


def example_input(input_size: tuple[int, int, int]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(EXAMPLE_BATCH, *input_size, generator=generator)


def resolve_input_size(model: nn.Module,
                       input_size: tuple[int, int, int] | None) -> tuple[int, int, int]:
    if input_size is not None:
        return tuple(input_size)
    from vitcompress.loading import default_input_size

    size = default_input_size(model)
    if size is None:
        raise ValueError("the model does not say its input size; pass input_size=(C, H, W)")
    return size


def map_model(model: nn.Module, input_size: tuple[int, int, int] | None = None) -> ModelMap:
    """Capture ``model`` and return its model map (blocks, attention, prefix tokens, grid ops)."""
    return analyse(capture(model, example_input(resolve_input_size(model, input_size))))


def compress(model: nn.Module, variant: str = "etps", keep: float | list[float] = 0.7,
             locs: list[int] | None = None, input_size: tuple[int, int, int] | None = None,
             policy: str = "score") -> nn.Module:
    """Return a compressed copy of ``model`` (left unchanged): an ordinary ``nn.Module`` whose
    ``.eval()`` drops tokens physically and whose ``.train()`` runs its variant's training path.

    The result carries ``vitcompress_plan`` and ``vitcompress_map`` (plain dicts) for reports.
    """
    size = resolve_input_size(model, input_size)
    captured = capture(model, example_input(size))
    model_map = analyse(captured)
    plan = make_plan(model_map, variant, keep, locs, policy)
    compressed = apply_plan(captured.module, model_map, plan)
    compressed.train(model.training)
    return compressed


def apply_plan(gm, model_map: ModelMap, plan: Plan) -> nn.Module:
    compressed = rewrite(gm, model_map, plan)
    compressed.vitcompress_plan = plan.to_json()
    compressed.vitcompress_map = model_map.to_json()
    return compressed
