"""``carry_windows`` on a model with no windowed block is refused in one line (it would do
nothing), by every method, through ``compress`` and the command line; a model saved with it
before (it then did nothing) still loads. Windowed models taking it: tests/test_window_carry.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
from click.testing import CliRunner

import vitcompress
from vitcompress.cli.main import cli
from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.plan import PlanError
from vitcompress.loading import ModelSource
from vitcompress.variants import variant_names

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE = (3, 32, 32)
REFUSAL = (
    "carry_windows: no block of this model attends within windows and reduces tokens, so "
    "there is no windowed location's choice to carry; leave it off"
)
MODEL_ARGS = ("--model-arg", "img_size=32", "--model-arg", "depth=4")


DEIT = ("deit_tiny_patch16_224", {"img_size": 32, "depth": 4})


def _deit() -> torch.nn.Module:
    return timm.create_model(DEIT[0], **DEIT[1]).eval()


@pytest.mark.parametrize("method", variant_names())
def test_every_method_refuses_carry_windows_without_windowed_blocks(method: str) -> None:
    with pytest.raises(PlanError) as refused:
        vitcompress.compress(
            _deit(), method, keep=[0.7], input_size=SIZE, variant_args={"carry_windows": True}
        )
    assert str(refused.value) == f"variant_args {REFUSAL}"


def test_the_command_line_refuses_it_in_one_line() -> None:
    result = CliRunner().invoke(
        cli,
        [
            *("apply", "--model", "deit_tiny_patch16_224", *MODEL_ARGS, "--variant", "etps"),
            *("--keep", "0.7", "--variant-arg", "carry_windows=True", "--no-throughput"),
        ],
    )
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: --variant-arg {REFUSAL}\n"
    assert result.stdout == ""


def test_a_model_saved_with_it_before_still_loads(tmp_path: Path) -> None:
    """The plan an earlier version saved: the setting recorded, no location windowed."""
    model = vitcompress.compress(_deit(), "etps", keep=[0.7], input_size=SIZE)
    source = ModelSource(DEIT[0], model_args=DEIT[1])
    directory = vitcompress.save(model, tmp_path / "saved", source=source)
    meta_path = directory / "vitcompress.json"
    meta = json.loads(meta_path.read_text())
    meta["plan"]["variant_args"] = {"carry_windows": True}
    meta_path.write_text(json.dumps(meta))

    loaded = vitcompress.load(directory)
    x = torch.randn(2, *SIZE)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    assert compression_info(loaded).plan.method.carry_windows is False
