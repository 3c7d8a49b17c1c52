"""The GPU ladder script (benchmarks/gpu_ladder.py) and its renderer (gpu_ladder_report.py), on
the CPU: ideal slicing runs the compressed model's token counts, the cells come in priority
order, records combine as medians of the processes, a tiny two-process run writes the records
the docs read, and the renderer puts them in a doc between its markers."""

from __future__ import annotations

import json

import pytest
import torch

import vitcompress
from tests.benchmark_scripts import benchmark_script

FIELDS = {
    "model", "method", "dtype", "batch", "mode", "img_per_s", "base_img_per_s",
    "speedup_vs_base", "of_ideal", "kernels",
}  # fmt: skip


@pytest.fixture(scope="module")
def ladder():
    return benchmark_script("gpu_ladder")


@pytest.fixture(scope="module")
def report():
    return benchmark_script("gpu_ladder_report")


@pytest.mark.parametrize("method", ["dtps", "evit", "tome"])
def test_ideal_slicing_runs_the_compressed_models_token_counts(ladder, method: str) -> None:
    base, size = ladder.build_base("deit_small", tiny=True)
    compressed = vitcompress.compress(base, method, keep=0.7, locs=[1, 2], input_size=size)
    counts = ladder.attention_and_mlp_tokens(compressed.eval(), base, size)
    assert counts != ladder.attention_and_mlp_tokens(base, base, size)  # something was reduced
    ideal = ladder.ideal_slicing(base, counts)
    assert ladder.attention_and_mlp_tokens(ideal, base, size) == counts
    with torch.no_grad():  # the base itself is left whole
        assert ladder.attention_and_mlp_tokens(base, base, size)[-1][0] == 65


def test_cells_come_eager_first_then_bf16_then_the_batches_in_question(ladder) -> None:
    args = ladder.parse_args(["--models", "deit_tiny,vit_large", "--batches", "1,8,64,256"])
    cells = ladder.ladder_cells(args)
    assert len(cells) == 2 * 2 * 4 * 2
    assert [c["mode"] for c in cells[:16]] == ["eager"] * 16
    assert [c["dtype"] for c in cells[:8]] == ["bf16"] * 8
    assert [c["batch"] for c in cells[:8:2]] == [64, 256, 8, 1]
    assert [c["model"] for c in cells[:2]] == ["deit_tiny", "vit_large"]
    # The cheap modes side by side for each model, compiled after them all.
    args = ladder.parse_args(
        ["--models", "deit_tiny,vit_large", "--modes", "compiled,eager,graphed"]
    )
    cells = ladder.ladder_cells(args)
    assert [(c["model"], c["mode"]) for c in cells[:4]] == [
        ("deit_tiny", "eager"), ("deit_tiny", "graphed"), ("vit_large", "eager"), ("vit_large", "graphed"),
    ]  # fmt: skip
    assert {c["mode"] for c in cells[: 2 * 2 * 4 * 2]} == {"eager", "graphed"}
    assert {c["mode"] for c in cells[2 * 2 * 4 * 2 :]} == {"compiled"}
    # On a CPU there is no bf16 autocast to time.
    assert ladder.parse_args(["--device", "cpu"]).dtypes == "fp32"


def test_records_combine_as_the_median_of_the_processes(ladder) -> None:
    def record(speedup: float, ideal: float | None, host_share: float | None = None) -> dict:
        return {
            "model": "m", "method": "dtps", "dtype": "bf16", "batch": 8, "mode": "eager",
            "img_per_s": 100 * speedup, "base_img_per_s": 100.0, "speedup_vs_base": speedup,
            "of_ideal": ideal, "ideal_img_per_s": None if ideal is None else 120.0,
            "host_share": host_share, "base_host_share": None if host_share is None else 0.5,
            "warnings": [],
        }  # fmt: skip

    combined = ladder.combine(
        [[record(0.8, 0.9, 0.95)], [record(1.0, 0.95, 0.4)], [record(1.3, 0.7, 0.3)]]
    )
    assert len(combined) == 1
    assert combined[0]["speedup_vs_base"] == 1.0
    assert combined[0]["speedup_vs_base_processes"] == [0.8, 1.0, 1.3]
    assert combined[0]["of_ideal"] == 0.9 and combined[0]["processes"] == 3
    assert combined[0]["host_share"] == 0.4
    assert combined[0]["host_share_processes"] == [0.95, 0.4, 0.3]
    (no_ideal,) = ladder.combine([[record(0.8, None)], [record(1.0, None)]])
    assert no_ideal["of_ideal"] is None and no_ideal["speedup_vs_base"] == pytest.approx(0.9)


def test_a_tiny_ladder_in_two_processes_writes_the_records(ladder, report, tmp_path) -> None:
    out = tmp_path / "ladder-test.json"
    code = ladder.main(
        [
            "--device", "cpu", "--tiny", "--models", "deit_tiny,swin_tiny",
            "--methods", "etps,tome", "--batches", "2", "--modes", "eager", "--runs", "2",
            "--warmup", "0", "--run", "test", "--json-out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    records = json.loads(out.read_text())
    assert isinstance(records, list) and len(records) == 2 * 2
    for r in records:
        assert FIELDS <= set(r)
        assert r["processes"] == 2 and len(r["img_per_s_processes"]) == 2
        assert r["mode"] == "eager" and r["dtype"] == "fp32" and r["batch"] == 2
        assert r["kernels"] == "default"
        assert r["speedup_vs_base"] > 0 and r["img_per_s"] > 0
        assert r["host_share"] is None  # the CPU returns with the work done: no launch share
        # Swin has no ideal model; a plain ViT has.
        assert (r["of_ideal"] is None) == (r["model"] == "swin_tiny")
    tome = next(r for r in records if r["model"] == "deit_tiny" and r["method"] == "tome")
    etps = next(r for r in records if r["model"] == "deit_tiny" and r["method"] == "etps")
    assert tome["gmacs"] < tome["base_gmacs"] and etps["gmacs"] < etps["base_gmacs"]

    doc = tmp_path / "serving.md"
    doc.write_text("# Serving\n\ntext before\n")
    plot = tmp_path / "img" / "ladder.png"
    report.main([str(out), "--doc", str(doc), "--plot", str(plot)])
    report.main([str(out), "--doc", str(doc), "--plot", str(plot)])  # replaced, not added twice
    text = doc.read_text()
    assert text.startswith("# Serving\n\ntext before\n")
    assert text.count("<!-- ladder:test:start -->") == 1
    assert "| deit_tiny | fp32 | eager | tome |" in text and "](img/ladder.png)" in text
    # Every process's value is printed beside the median (two rows per method: medians, values).
    first, second = tome["speedup_vs_base_processes"]
    assert text.count("| deit_tiny | fp32 | eager | tome |") == 2
    assert f"| {first:.2f} / {second:.2f} |" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_modes_are_checked_and_graphed_needs_cuda(ladder) -> None:
    with pytest.raises(SystemExit):
        ladder.parse_args(["--device", "cpu", "--modes", "graphed"])
    with pytest.raises(SystemExit):
        ladder.parse_args(["--modes", "eager,fast"])
    assert ladder.parse_args(["--device", "cuda", "--modes", "graphed"]).modes == "graphed"


def test_compiled_cells_time_each_method_with_the_base_and_its_ideal_alone(ladder) -> None:
    base, dtps, tome, ideal = (torch.nn.Identity() for _ in range(4))
    built = {
        "models": {"base": base, "dtps": dtps, "tome": tome, "dtps-ideal": ideal},
        "ideals": {"dtps": "dtps-ideal"},
    }
    eager = ladder.groups_of({"mode": "eager"}, built)
    assert [list(g) for g in eager] == [["base", "dtps", "tome", "dtps-ideal"]]
    for mode in ("compiled", "graphed"):
        groups = ladder.groups_of({"mode": mode}, built)
        assert [list(g) for g in groups] == [["base", "dtps", "dtps-ideal"], ["base", "tome"]]
        assert groups[0]["dtps-ideal"] is ideal and groups[1]["base"] is base


def test_a_ladder_past_its_deadline_still_writes_its_json(ladder, tmp_path, capsys) -> None:
    out = tmp_path / "ladder-deadline.json"
    code = ladder.main(
        [
            "--device", "cpu", "--tiny", "--models", "deit_tiny", "--methods", "evit",
            "--batches", "2", "--modes", "eager", "--runs", "2", "--warmup", "0",
            "--run", "deadline", "--json-out", str(out), "--deadline-seconds", "0.01",
        ]
    )  # fmt: skip
    assert code == 0
    assert json.loads(out.read_text()) == []  # stopped before a cell: nothing timed, a JSON
    printed = capsys.readouterr().out
    assert "process 1: stopped at the deadline" in printed
    assert "process 2: not started, past the deadline" in printed


def test_tomes_fit_is_done_once_and_read_by_later_processes(ladder, tmp_path, monkeypatch) -> None:
    fits = tmp_path / "fits.json"
    args = ladder.parse_args(
        ["--device", "cpu", "--tiny", "--methods", "tome", "--fits", str(fits)]
    )
    first = ladder.build_models("deit_tiny", ["tome"], args)
    keep = json.loads(fits.read_text())["deit_tiny"]
    assert 0 < keep < 1

    def refit(*_args, **_kwargs):
        raise AssertionError("a later process fitted ToMe's keep again")

    monkeypatch.setattr(ladder, "compress_within_gmacs", refit)
    second = ladder.build_models("deit_tiny", ["tome"], args)
    assert second["gmacs"]["tome"] == first["gmacs"]["tome"] < first["gmacs"]["base"]


def test_the_kernel_path_is_chosen_for_every_method_and_recorded(ladder) -> None:
    """``--method-ops`` switches every compressed model's reducers to the method's ops and
    ``--fused`` to the kernels (the default leaves each at its own default); both at once is
    refused."""
    with pytest.raises(SystemExit):
        ladder.parse_args(["--fused", "--method-ops"])
    switches = {}
    for flags in ([], ["--method-ops"], ["--fused"]):
        args = ladder.parse_args(["--device", "cpu", "--tiny", *flags])
        built = ladder.build_models("deit_tiny", ["dtps", "tome"], args)
        switches[tuple(flags)] = {
            m.fused_kernel
            for method in ("dtps", "tome")
            for m in built["models"][method].modules()
            if getattr(m, "supports_fused_kernel", False)
        }
    assert switches == {(): {None}, ("--method-ops",): {False}, ("--fused",): {True}}


def test_a_method_without_a_kernel_is_recorded_on_the_methods_ops_under_fused(ladder) -> None:
    """``--fused`` switches on the kernel of every method that has one: EViT has none, so its
    record says ``method`` (the path it ran), not ``fused``, and agrees with its ``fused``."""
    args = ladder.parse_args(["--device", "cpu", "--tiny", "--fused", "--warmup", "0"])
    args.runs = 1
    built = ladder.build_models("deit_tiny", ["dtps", "evit"], args)
    cell = {"model": "deit_tiny", "dtype": "fp32", "batch": 1, "mode": "eager"}
    records, _ = ladder.time_group(cell, built["models"], built, args)
    paths = {r["method"]: (r["kernels"], r["fused"]) for r in records}
    assert paths == {"dtps": ("fused", True), "evit": ("method", False)}
    plain = ladder.parse_args(["--device", "cpu", "--tiny"])
    assert ladder.kernel_path("evit", {"fused": {}}, plain) == "default"
