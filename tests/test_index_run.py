"""The index run passes token indices only through ops that keep every token at its place: a
parameterless module is read as an identity only where it gives back its input's shape. CSATv2's
spatial attention pools its grid to 7 x 7 with an adaptive pool: at 512 pixels (an 8 x 8 grid)
the pool was probed at its 7 x 7 output, taken for an identity, and the analysis ended in a raw
``RuntimeError`` (an expand of 8 tokens to 7); it is now a refusal in one line."""

from __future__ import annotations

import pytest
import timm
import torch
import torch.fx as fx
from torch import nn

from vitcompress import map_model
from vitcompress.analysis.analyse import MappingError
from vitcompress.analysis.capture import annotate_shapes
from vitcompress.analysis.index_run import grid_index, run_indices


class PoolOnGrid(nn.Module):
    """(B, N, C) tokens laid out on their grid, pooled to ``size`` there, flattened back."""

    def __init__(self, side: int, size: int) -> None:
        super().__init__()
        self.side = side
        self.pool = nn.AdaptiveAvgPool2d(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], self.side, self.side)
        return self.pool(grid).flatten(2).transpose(1, 2)


def _pool_run(side: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pool's value in an index run seeded at the tokens, the pool of the seed's grid
    computed directly, and that grid."""
    gm = fx.symbolic_trace(PoolOnGrid(side, size).eval())
    example = torch.randn(2, side * side, 4)
    annotate_shapes(gm, example)
    nodes = {n.name: n for n in gm.graph.nodes}
    tokens, pool = nodes["x"], nodes["pool"]
    seed = grid_index((2, side * side, 4))
    run = run_indices(gm, example, {tokens: seed}, [pool])
    grid = seed.transpose(1, 2).reshape(2, 4, side, side)
    return run.found[pool], nn.AdaptiveAvgPool2d(size)(grid), grid


def test_a_pool_that_shrinks_the_grid_runs_as_it_is() -> None:
    found, pooled, _ = _pool_run(side=8, size=7)
    assert found.shape == (2, 4, 7, 7)
    assert torch.equal(found, pooled)


def test_a_pool_to_its_own_size_passes_the_indices_on() -> None:
    found, _, grid = _pool_run(side=7, size=7)
    # Read as an identity: the index of its input's last dim, passed on as a per-token op's.
    assert torch.equal(found, grid[..., :1].expand_as(grid))


@pytest.mark.parametrize("side", [224, 512])
def test_csatv2_is_refused_in_one_line(side: int) -> None:
    torch.manual_seed(0)
    model = timm.create_model(
        "csatv2",
        num_classes=10,
        depths=(1, 1, 2, 2),
        transformer_depths=(0, 0, 1, 1),
        dims=(16, 24, 32, 48),
    ).eval()
    with pytest.raises(MappingError) as refused:
        map_model(model, (3, side, side))
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("attention over its whole grid at stages.2.2.attn")
    assert "pos_embed.proj mixes tokens" in line
