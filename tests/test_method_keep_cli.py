"""``--keep-cumulative`` on the commands that take ``--keep``, and ``keep_cumulative=`` in the API."""

from __future__ import annotations

import json
import textwrap

import click
import pytest
import timm
import torch
from click.testing import CliRunner
from PIL import Image

import vitcompress
from tests.models import FIXTURES
from vitcompress.cli.main import cli
from vitcompress.cli.plan_options import keep_cumulative_option
from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.plan import PlanError
from vitcompress.modules.reducers import PredictorReducer

MHA = f"{FIXTURES}:mha_vit"  # 8 x 8 patch tokens and a cls token, 4 blocks


def apply_json(*args: str) -> dict:
    result = CliRunner().invoke(cli, ["apply", "--model", MHA, *args, "--no-throughput", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_apply_keeps_the_fractions_of_the_initial_count():
    # 0.75, 0.5, 0.25 of 64 are 48, 32 and 16 exactly: a ratio product one ulp low loses a token.
    data = apply_json("--variant", "dtps", "--locs", "1,2,3", "--keep-cumulative", "0.75,0.5,0.25")
    assert data["tokens_per_block"] == [65, 49, 33, 17]
    same = apply_json("--variant", "dtps", "--locs", "1,2,3", "--keep", "0.75,0.666666666667,0.5")
    assert same["tokens_per_block"] == data["tokens_per_block"]
    assert same["compressed"]["macs"] == data["compressed"]["macs"]


def test_official_deit_small_list_through_the_api():
    base = timm.create_model("deit_small_patch16_224")
    model = vitcompress.compress(base, "dtps", keep_cumulative=[0.7, 0.49, 0.343])
    counts = [m.keep_tokens for m in model.modules() if isinstance(m, PredictorReducer)]
    assert counts == [137, 96, 67]  # int(196 * c), the official num_keep_node
    plan = compression_info(model).plan
    assert plan.locs == [3, 6, 9] and plan.keep == [0.7, 0.7, 0.7]
    with pytest.raises(PlanError, match="exclude each other"):
        vitcompress.compress(base, "dtps", keep=0.7, keep_cumulative=[0.7, 0.49, 0.343])


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--variant", "dtps", "--keep", "0.7", "--keep-cumulative", "0.7,0.49,0.343"],
            "--keep and --keep-cumulative exclude each other",
        ),
        (
            ["--variant", "dtps", "--keep-cumulative", "0.7,0.8,0.5"],
            "--keep-cumulative must not increase",
        ),
        (
            ["--variant", "dtps", "--keep-cumulative", "0.7,0.49"],
            "--keep-cumulative has 2 values for 3 locations",
        ),
        (
            ["--variant", "dtps", "--keep-cumulative", "0.7,0.49,1.5"],
            "--keep-cumulative must be in (0, 1], got 1.5",
        ),
        (
            ["--variant", "dtps", "--keep-cumulative", "0.7,0.49,0"],
            "--keep-cumulative must be in (0, 1], got 0.0",
        ),
        (
            ["--variant", "dtps", "--keep-cumulative", "0.7,half"],
            "--keep-cumulative must be a comma list of numbers",
        ),
        (
            ["--variant", "etps", "--keep-cumulative", "0.7,0.49,0.343"],
            "--keep-cumulative is for dtps and dynamicvit",
        ),
    ],
)
def test_bad_cumulative_lists_are_one_line_and_exit_2(args, message):
    result = CliRunner().invoke(cli, ["apply", "--model", MHA, *args, "--no-throughput"])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert message in lines[0]


@click.command()
@click.option("--keep", default=None)
@keep_cumulative_option
def _show_keep(keep) -> None:
    click.echo(repr(keep))


@pytest.mark.parametrize(
    "args, recipe, shown",
    [
        (["--keep", "0.5"], {"keep_cumulative": "0.7,0.49"}, "'0.5'"),
        (
            ["--keep-cumulative", "0.7,0.49"],
            {"keep": "0.5"},
            "CumulativeKeep(fractions=(0.7, 0.49))",
        ),
        ([], {"keep_cumulative": "0.7,0.49"}, "CumulativeKeep(fractions=(0.7, 0.49))"),
    ],
)
def test_the_command_line_wins_over_a_recipe(args, recipe, shown):
    result = CliRunner().invoke(_show_keep, args, default_map=recipe)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == shown


def test_both_in_one_recipe_is_a_conflict():
    result = CliRunner().invoke(
        _show_keep, [], default_map={"keep": "0.5", "keep_cumulative": "0.7,0.49"}
    )
    assert isinstance(result.exception, PlanError)


def test_finetune_recipe_takes_a_cumulative_list(tmp_path):
    data = tmp_path / "data"
    generator = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for label in ("a", "b"):
            folder = data / split / label
            folder.mkdir(parents=True)
            for i in range(2):
                pixels = (torch.rand(32, 32, 3, generator=generator) * 255).to(torch.uint8)
                Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        textwrap.dedent(f"""\
        model: vit_small_patch16_224
        model_arg: {{img_size: 32, patch_size: 4, depth: 4, embed_dim: 32, num_heads: 2,
                    num_classes: 2}}
        variant: dtps
        keep_cumulative: [0.75, 0.5]
        locs: [1, 2]
        data: {data}
        augment: none
        epochs: 1
        batch_size: 4
        warmup_epochs: 0
        """)
    )
    out = tmp_path / "run"
    result = CliRunner().invoke(
        cli, ["finetune", "--recipe", str(recipe), "--out", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    model = vitcompress.load(out)
    counts = [m.keep_tokens for m in model.modules() if isinstance(m, PredictorReducer)]
    assert counts == [48, 32]  # of 64 patch tokens
