"""A base whose residual branches are scaled near zero (LayerScale at its init, as DINOv2 and CaiT
are built with random weights) passes tokens on unchanged, so a compressed model's outputs match
it whatever the method: ``apply`` says so, reading the scales off the model, not its name."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from tests.models import FIXTURES
from vitcompress.cli.main import cli
from vitcompress.measure.residual_scale import NEAR_ZERO_SCALE, near_zero_residuals

# The first-check subset (pytest -m quick, README): the CLI, bad input and measurement.
pytestmark = pytest.mark.quick

SMALL_DINOV2 = [
    "--model",
    "vit_small_patch14_dinov2",
    *("--model-arg", "img_size=28", "--model-arg", "depth=2"),
    *("--model-arg", "embed_dim=64", "--model-arg", "num_heads=2"),
]


class Scaled(nn.Module):
    """Two residual branches, each scaled per channel; a norm whose weight starts at 1."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)
        self.gamma_1 = nn.Parameter(torch.full((8,), scale))
        self.lambda1 = nn.Parameter(torch.full((8,), scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.gamma_1 * self.fc(self.norm(x))
        return x + self.lambda1 * self.fc(self.norm(x))


def test_scales_near_zero_are_found_whatever_their_names() -> None:
    found = near_zero_residuals(Scaled(1e-5))
    assert found is not None and found.count == 2 and found.first == "gamma_1"
    assert found.largest == pytest.approx(1e-5)
    assert "at most 1e-05" in found.text() and "--pretrained" in found.text()


def test_trained_scales_norms_and_biases_are_not_near_zero() -> None:
    assert near_zero_residuals(Scaled(0.1)) is None  # trained LayerScale values
    one_large = Scaled(1e-5)
    with torch.no_grad():
        one_large.lambda1[3] = 10 * NEAR_ZERO_SCALE  # one branch that does move the tokens
    assert near_zero_residuals(one_large) is None
    # No scales at all: the norm's weight (1) and the biases (0, in_proj_bias included) are not
    # residual scales.
    plain = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.MultiheadAttention(8, 2))
    assert near_zero_residuals(plain) is None


def test_apply_says_when_the_base_barely_moves_its_tokens() -> None:
    runner = CliRunner()
    args = ["apply", *SMALL_DINOV2, "--keep", "0.7", "--no-throughput"]
    built_random = runner.invoke(cli, args)
    assert built_random.exit_code == 0, built_random.output
    assert "residual-branch scales (blocks.0.ls1.gamma, ...) are at most 1e-05" in (
        built_random.stderr
    )
    # The same model with its LayerScale at 1 (as trained ones are of that order): no note.
    scaled = runner.invoke(cli, [*args, "--model-arg", "init_values=1.0"])
    assert scaled.exit_code == 0, scaled.output
    assert "residual-branch scales" not in scaled.output
    # A model without LayerScale: none either.
    plain = runner.invoke(cli, ["apply", "--model", f"{FIXTURES}:mha_vit", "--no-throughput"])
    assert plain.exit_code == 0, plain.output
    assert "residual-branch scales" not in plain.output
