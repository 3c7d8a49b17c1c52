"""`vitcompress report`: the JSON of real apply, bench, eval and finetune runs in one table."""

import json

import pytest
from click.testing import CliRunner

import vitcompress.cli.report_command  # noqa: F401 - registers report and visualize
from tests.models import FIXTURES
from tests.test_data import write_image_folder
from vitcompress.cli.main import cli
from vitcompress.workflows.report import MARKDOWN_COLUMNS, ReportRow, merge_rows

MHA = f"{FIXTURES}:mha_vit"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def run_json(*args) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """apply (writes an artifact), bench of the artifact, eval of it against its base."""
    root = tmp_path_factory.mktemp("report")
    art = root / "mha_dtps"
    data = write_image_folder(root / "imgs", per_class=2)
    outputs = {
        "apply": run_json("apply", "--model", MHA, "--variant", "dtps", "--keep", "0.5",
                          "--locs", "1,2", "--out", art, "--no-throughput"),
        "bench": run_json("bench", "--model", art, "--batch-size", "2", "--runs", "1",
                          "--warmup", "0"),
        "eval": run_json("eval", "--model", art, "--base", MHA, "--data", data,
                         "--batch-size", "4", "--no-throughput"),
    }
    paths = {}
    for name, output in outputs.items():
        paths[name] = root / f"{name}.json"
        paths[name].write_text(json.dumps(output))
    return root, art, outputs, paths


def parse_markdown(text: str) -> dict[str, dict[str, str]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert tuple(header) == MARKDOWN_COLUMNS
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
            for line in lines[2:]]
    return {row["name"]: row for row in rows}


def test_report_merges_apply_bench_and_eval(runs, tmp_path):
    root, art, outputs, paths = runs
    md, png = tmp_path / "report.md", tmp_path / "report.png"
    result = run("report", paths["apply"], paths["bench"], paths["eval"], "--out-md", md,
                 "--out-png", png)
    assert result.exit_code == 0, result.output
    table = parse_markdown(md.read_text())
    assert set(table) == {"mha_dtps", "inhouse.py:mha_vit"}  # one row per model, not per file
    apply, bench, evaluation = outputs["apply"], outputs["bench"], outputs["eval"]
    small = table["mha_dtps"]
    assert (small["variant"], small["keep"]) == ("dtps", "0.5")
    assert float(small["params (M)"]) == pytest.approx(apply["compressed"]["params"] / 1e6,
                                                       abs=1e-4)
    assert float(small["GMACs"]) == pytest.approx(apply["compressed"]["gmacs"], abs=1e-4)
    assert bench["macs"] == apply["compressed"]["macs"]
    assert float(small["throughput (img/s)"]) == pytest.approx(bench["throughput"], abs=0.05)
    assert float(small["top-1 (%)"]) == pytest.approx(evaluation["top1"], abs=0.005)
    base = table["inhouse.py:mha_vit"]
    assert (base["variant"], base["keep"]) == ("none", "1")
    assert float(base["GMACs"]) == pytest.approx(apply["base"]["gmacs"], abs=1e-4)
    assert float(base["top-1 (%)"]) == pytest.approx(evaluation["base"]["top1"], abs=0.005)
    assert base["throughput (img/s)"] == "-"  # nothing timed the base
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 1000
    assert "mha_dtps" in result.output and "wrote" in result.output


def test_report_json_with_the_artifact_and_a_finetune_summary(runs, tmp_path):
    root, art, outputs, paths = runs
    # The shape of `finetune --json` (its summary; top-1 as a fraction), for a fine-tuned copy.
    finetuned = tmp_path / "ft.json"
    finetuned.write_text(json.dumps({
        "epochs": 1, "steps": 3, "history": [{"epoch": 0, "step": 3, "train_loss": 1.0,
                                              "val_top1": 0.75}],
        "val_top1": 0.75, "variant": "dtps", "keep": [0.5, 0.5], "locs": [1, 2],
        "out": str(tmp_path / "mha_dtps_ft")}))
    data = run_json("report", paths["apply"], art / "vitcompress.json", finetuned)
    rows = {row["name"]: row for row in data["rows"]}
    assert set(rows) == {"apply (base)", "mha_dtps", "mha_dtps_ft"}
    assert rows["mha_dtps"]["macs"] == outputs["apply"]["compressed"]["macs"]
    assert len(rows["mha_dtps"]["sources"]) == 2  # apply and the artifact's own JSON
    assert rows["mha_dtps_ft"]["top1"] == pytest.approx(75.0)
    assert rows["mha_dtps_ft"]["keep"] == "0.5" and rows["mha_dtps_ft"]["gmacs"] is None


def test_rows_with_equal_cost_but_different_accuracy_stay_apart():
    a = ReportRow(name="a", variant="dtps", keep="0.7", params=10, macs=20, top1=50.0)
    b = ReportRow(name="b", params=10, macs=20, top1=60.0)
    c = ReportRow(name="c", params=10, macs=20, throughput=5.0)
    merged = merge_rows([a, b, c])
    assert [r.name for r in merged] == ["a", "b"] and merged[0].throughput == 5.0


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"hello": 1}', "not the JSON of apply, bench, eval or finetune"),
    ('{"plan": {}, "base": {}, "compressed": {}}', "malformed apply output"),
])
def test_bad_json_is_one_line_and_exit_2(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    result = run("report", path)
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_missing_file_is_exit_2(tmp_path):
    result = run("report", tmp_path / "nope.json")
    assert result.exit_code == 2 and "cannot read" in result.output


def test_png_without_matplotlib_is_one_clear_line(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    result = run("report", runs[3]["apply"], "--out-png", tmp_path / "x.png")
    assert result.exit_code == 2
    assert result.output.strip() == ("error: plots need matplotlib: pip install "
                                     "'vitcompress[plots]'")
