"""``kept_multiple`` (``--kept-multiple 8``): the tokens after each location, prefix tokens
included, rounded to the nearest multiple the method can keep, never to no patch token and never
to all of those present; recorded with the plan, so a saved model reloads with the same counts;
the MACs follow the rounded counts."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import vitcompress
from tests.models import timm_small
from tests.test_windowed import SIZE as SWIN_SIZE
from tests.test_windowed import swin
from vitcompress.cli.main import cli
from vitcompress.compilation.metadata import compression_info
from vitcompress.compilation.plan import VARIANTS, Plan
from vitcompress.errors import UserError
from vitcompress.measure import count_macs
from vitcompress.measure.models import tokens_per_block

SIZE = (3, 32, 32)  # 64 patch tokens and a class token
MULTIPLE = 8


def _base(**extra):
    torch.manual_seed(0)
    return timm_small("vit_small_patch16_224", **extra)


def _compress(variant: str, multiple: int | None, keep=0.7, locs=(1, 2, 3), **extra):
    args = {"kept_multiple": multiple} if multiple else None
    return vitcompress.compress(
        _base(**extra), variant, keep=keep, locs=list(locs), input_size=SIZE, variant_args=args
    )


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_reduced_count_is_the_nearest_multiple_of_eight(variant: str) -> None:
    plain = _compress(variant, None)
    rounded = _compress(variant, MULTIPLE)
    base_tokens = 65
    plain_tokens = tokens_per_block(plain, SIZE)
    rounded_tokens = tokens_per_block(rounded, SIZE)
    reduced = [n for n in rounded_tokens if n != base_tokens]
    assert reduced, rounded_tokens
    # What the blocks run on, read off a run of the model: multiples of 8, cls token included.
    assert all(n % MULTIPLE == 0 for n in reduced), rounded_tokens
    assert any(n % MULTIPLE for n in plain_tokens if n != base_tokens), plain_tokens
    plan = compression_info(rounded).plan
    assert plan.rounded_from
    for before, after in plan.rounded_from.values():
        assert (after + 1) % MULTIPLE == 0
        assert abs(after - before) <= MULTIPLE // 2  # the nearest one
        assert 0 < after


def test_ties_round_down_and_counts_stay_within_the_tokens_present() -> None:
    # dTPS at one location: int(64 * 0.55) = 35 patch tokens, 36 with the class token, as far
    # from 32 as from 40: the smaller.
    plan = compression_info(_compress("dtps", MULTIPLE, keep=0.55, locs=[1])).plan
    assert plan.rounded_from == {1: (35, 31)}
    assert plan.locations[0].keep_tokens == 31
    # 4 patch tokens (an 8 x 8 image in patches of 4): no multiple of 8 lies between one patch
    # token and all of them, so the count is left as the keep gives it.
    tiny = vitcompress.compress(
        _base(img_size=8),
        "etps",
        keep=0.7,
        locs=[1],
        input_size=(3, 8, 8),
        variant_args={"kept_multiple": MULTIPLE},
    )
    plan = compression_info(tiny).plan
    assert plan.rounded_from == {}
    assert tokens_per_block(tiny, (3, 8, 8))[2] == 4  # ceil(0.7 * 4) = 3 and the class token


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_macs_follow_the_rounded_counts(variant: str) -> None:
    # One location whose count rounds up (keep 0.7) and one whose count rounds down (keep 0.5).
    for keep in (0.7, 0.5):
        plain = _compress(variant, None, keep=keep, locs=[1])
        rounded = _compress(variant, MULTIPLE, keep=keep, locs=[1])
        more_tokens = sum(tokens_per_block(rounded, SIZE)) - sum(tokens_per_block(plain, SIZE))
        more_macs = count_macs(rounded, SIZE) - count_macs(plain, SIZE)
        assert more_tokens != 0 or not compression_info(rounded).plan.rounded_from
        assert (more_macs > 0) == (more_tokens > 0) and (more_macs < 0) == (more_tokens < 0)


def test_a_rounded_ratio_given_as_the_keep_is_the_same_model() -> None:
    # eTPS counts ceil(rho * n) of the tokens present: the rounding replaces rho by the exact
    # ratio of the rounded count, so the plan it makes is the plan those ratios make.
    rounded = _compress("etps", MULTIPLE)
    plan = compression_info(rounded).plan
    again = _compress("etps", None, keep=plan.keep)
    assert tokens_per_block(again, SIZE) == tokens_per_block(rounded, SIZE)
    assert count_macs(again, SIZE) == count_macs(rounded, SIZE)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_plan_json_and_a_saved_model_give_the_same_counts(variant: str, tmp_path) -> None:
    model = _compress(variant, MULTIPLE)
    plan = compression_info(model).plan
    data = json.loads(json.dumps(plan.to_json()))
    assert data["kept_multiple"] == MULTIPLE and data["variant_args"]["kept_multiple"] == MULTIPLE
    again = Plan.from_json(data)
    assert again == plan and again.rounded_from == plan.rounded_from
    vitcompress.save(model, tmp_path / "m")
    loaded = vitcompress.load(tmp_path / "m")
    assert compression_info(loaded).plan == plan
    x = torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(x), model.eval()(x))


@pytest.mark.parametrize("variant", ["dtps", "etps", "tome"])
def test_windowed_blocks_round_each_windows_count(variant: str) -> None:
    model = vitcompress.compress(
        swin(), variant, keep=0.7, input_size=SWIN_SIZE, variant_args={"kept_multiple": MULTIPLE}
    )
    plan = compression_info(model).plan
    kept = [plan.method.tokens_after(loc.patch_tokens, loc) for loc in plan.locations]
    assert kept and all(n % MULTIPLE == 0 for n in kept), kept  # of a window's 49 tokens


def test_tomes_own_r_and_a_bad_multiple_are_refused_in_one_line() -> None:
    with pytest.raises(UserError, match="kept_multiple rounds the counts keep ratios give"):
        vitcompress.compress(
            _base(), "tome", locs=[1], input_size=SIZE, variant_args={"r": 4, "kept_multiple": 8}
        )
    with pytest.raises(UserError, match="kept_multiple: must be a whole number"):
        vitcompress.compress(
            _base(), "etps", locs=[1], input_size=SIZE, variant_args={"kept_multiple": 0}
        )


def test_apply_says_what_it_rounded() -> None:
    args = [
        f"--model-arg={k}={v}"
        for k, v in dict(img_size=32, patch_size=4, depth=4, embed_dim=64, num_heads=2).items()
    ]
    command = [
        "apply",
        "--model",
        "vit_small_patch16_224",
        *args,
        "--variant",
        "dtps",
        "--locs",
        "1",
        "--kept-multiple",
        "8",
        "--no-throughput",
    ]
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 0, result.output
    assert "rounded to multiples of 8 (prefix tokens included): block 1 44→47" in result.stdout
    data = json.loads(CliRunner().invoke(cli, [*command, "--json"]).stdout)
    assert data["plan"]["rounded_from"] == {"1": [44, 47]}
    clash = CliRunner().invoke(cli, [*command, "--variant-arg", "kept_multiple=16"])
    assert clash.exit_code != 0
    assert "--kept-multiple 8 and --variant-arg kept_multiple=16 differ" in clash.stderr
