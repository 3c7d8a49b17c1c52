"""``search --kept-multiple N``: every candidate's counts rounded as apply rounds them, costed and
scored rounded, recorded in the results and in plan.yaml (tiny ViT: 64 patch tokens + cls)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

import vitcompress
from tests.test_search import calibration_set, config, loaded_tiny, tiny_vit
from vitcompress.api import capture_and_map
from vitcompress.compilation.plan import make_plan
from vitcompress.search.driver import SearchError, search
from vitcompress.variants import get_variant

SIZE = (3, 32, 32)


pytestmark = pytest.mark.usefixtures("one_thread")


def _tokens_after_each_reducer(model: torch.nn.Module) -> list[int]:
    counts: list[int] = []
    hooks = [
        module.register_forward_hook(lambda m, args, out: counts.append(out[0].shape[1]))
        for module in model.modules()
        if hasattr(module, "restore_rule")
    ]
    with torch.inference_mode():
        model(torch.randn(1, *SIZE))
    for hook in hooks:
        hook.remove()
    return counts


def test_candidates_are_rounded_as_apply_rounds_them(tmp_path) -> None:
    data = search(
        loaded_tiny(),
        calibration_set(),
        config(tmp_path, variants=["etps", "evit"], kept_multiple=8, max_candidates=8),
    ).data
    assert data["space"]["kept_multiple"] == 8
    _, model_map = capture_and_map(tiny_vit(), SIZE)
    rows = data["candidates"]
    assert rows and any(row["rounded_from"] for row in rows)  # the grid's counts are not all 8k
    for row in rows:
        method = get_variant(row["variant"], {"kept_multiple": 8})
        plan = make_plan(model_map, method, row["keep"], row["locs"])
        assert row["kept_multiple"] == 8
        assert row["rounded_from"] == {str(b): list(n) for b, n in plan.rounded_from.items()}
    best = data["best"]
    recipe = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert recipe["variant_args"] == {"kept_multiple": 8} and recipe["keep"] == best["keep"]
    # What apply builds from the recipe keeps multiples of 8 tokens (cls included) after each
    # location, and its MACs are the ones the search costed.
    model = vitcompress.compress(
        tiny_vit(),
        recipe["variant"],
        keep=recipe["keep"],
        locs=recipe["locs"],
        variant_args={"kept_multiple": 8},
        input_size=SIZE,
    ).eval()
    counts = _tokens_after_each_reducer(model)
    assert counts and all(count % 8 == 0 and count < 65 for count in counts)
    assert best["counted_macs"] == pytest.approx(best["macs"], rel=0.01)


def test_rounding_changes_what_is_costed(tmp_path) -> None:
    """The same candidates without the multiple: other MACs where a count was rounded."""
    rounded = search(
        loaded_tiny(),
        calibration_set(),
        config(tmp_path / "a", variants=["etps"], kept_multiple=8, max_candidates=20),
    ).data
    plain = search(
        loaded_tiny(),
        calibration_set(),
        config(tmp_path / "b", variants=["etps"], max_candidates=20),
    ).data
    assert "kept_multiple" not in plain["space"] and "rounded_from" not in plain["candidates"][0]
    _, model_map = capture_and_map(tiny_vit(), SIZE)
    changed = [row for row in rounded["candidates"] if row["rounded_from"]]
    assert changed
    for row in changed:
        assert row["macs"] == _macs(row["keep"], row["locs"], model_map, 8)
        assert row["macs"] != _macs(row["keep"], row["locs"], model_map, None)


def _macs(keep: list[float], locs: list[int], model_map, multiple: int | None) -> float:
    """The analytic MACs of eTPS at ``keep``, ``locs``, its counts rounded to ``multiple``."""
    from vitcompress.search.cost import profile

    method = get_variant("etps", None if multiple is None else {"kept_multiple": multiple})
    return profile(tiny_vit(), model_map).macs(make_plan(model_map, method, keep, locs))


def test_a_cache_scored_with_another_multiple_is_refused(tmp_path) -> None:
    search(loaded_tiny(), calibration_set(), config(tmp_path, kept_multiple=8, max_candidates=2))
    with pytest.raises(SearchError, match="kept_multiple"):
        search(loaded_tiny(), calibration_set(), config(tmp_path, kept_multiple=4))


def test_the_command_line_search_and_apply_of_its_plan_round_alike(tmp_path) -> None:
    from tests.test_search_cli import MODEL, image_folder, run

    data = image_folder(tmp_path / "data")
    out = tmp_path / "out"
    searched = run(
        "search",
        *MODEL,
        *("--data", str(data), "--max-gmacs-ratio", "0.7", "--variants", "etps"),
        *("--calib-images", "8", "--max-candidates", "3", "--batch-size", "4"),
        *("--kept-multiple", "8", "--out", str(out), "--json"),
    )
    assert searched.exit_code == 0, searched.output
    best = json.loads(searched.stdout)["best"]
    assert best["kept_multiple"] == 8
    applied = run("apply", *MODEL, "--plan", str(out / "plan.yaml"), "--no-throughput", "--json")
    assert applied.exit_code == 0, applied.output
    plan = json.loads(applied.stdout)["plan"]
    # The plan file has the grid's keeps; apply rounds them again, to the same counts.
    assert plan["kept_multiple"] == 8 and plan["locs"] == best["locs"]
    assert plan.get("rounded_from", {}) == best["rounded_from"]
    assert json.loads(applied.stdout)["compressed"]["macs"] == best["counted_macs"]
    # An option typed on the command line overrides the plan file's (docs/search.md).
    typed = run(
        "apply", *MODEL, "--plan", str(out / "plan.yaml"), "--kept-multiple", "4",
        "--no-throughput", "--json",
    )  # fmt: skip
    assert typed.exit_code == 0, typed.output
    assert json.loads(typed.stdout)["plan"]["kept_multiple"] == 4


def test_a_kept_multiple_below_1_is_one_line(tmp_path) -> None:
    from tests.test_search_cli import MODEL, one_line_error, run

    result = run("search", *MODEL, "--max-gmacs-ratio", "0.7", "--kept-multiple", "0")
    assert "--kept-multiple" in one_line_error(result)
