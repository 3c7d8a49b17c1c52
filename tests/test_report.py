"""`vitcompress report`: the JSON of real apply, bench, eval and finetune runs in one table."""

import hashlib
import json

import pytest
import torch
from click.testing import CliRunner

import vitcompress.cli.report_command  # noqa: F401 - registers report and visualize
from tests.models import FIXTURES
from tests.test_data import write_image_folder
from vitcompress.cli.main import cli
from vitcompress.workflows.report import MARKDOWN_COLUMNS, ReportRow, merge_rows

# The first-check subset (pytest -m quick, README): the CLI, bad input and measurement.
pytestmark = pytest.mark.quick

MHA = f"{FIXTURES}:mha_vit"
# The data's two classes: eval refuses a model whose head predicts another number of them.
TWO_CLASSES = ("--model-arg", "num_classes=2")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def run_json(*args) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # notes and warnings go to stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """apply (writes an artifact), bench of the artifact, eval of it against its base."""
    root = tmp_path_factory.mktemp("report")
    art = root / "mha_dtps"
    data = write_image_folder(root / "imgs", per_class=2)
    outputs = {
        "apply": run_json(
            "apply",
            "--model",
            MHA,
            *TWO_CLASSES,
            "--variant",
            "dtps",
            "--keep",
            "0.5",
            "--locs",
            "1,2",
            "--out",
            art,
            "--no-throughput",
        ),
        "bench": run_json(
            "bench", "--model", art, "--batch-size", "2", "--runs", "1", "--warmup", "0"
        ),
        "eval": run_json(
            "eval",
            "--model",
            art,
            "--base",
            MHA,
            "--base-model-arg",
            "num_classes=2",
            "--data",
            data,
            "--batch-size",
            "4",
            "--no-throughput",
        ),
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
    rows = [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[2:]
    ]
    return {row["name"]: row for row in rows}


def test_report_merges_apply_bench_and_eval(runs, tmp_path):
    root, art, outputs, paths = runs
    # Both outputs into folders not made yet: each makes its own.
    md, png = tmp_path / "md" / "report.md", tmp_path / "png" / "report.png"
    result = run(
        "report", paths["apply"], paths["bench"], paths["eval"], "--out-md", md, "--out-png", png
    )
    assert result.exit_code == 0, result.output
    table = parse_markdown(md.read_text())
    assert set(table) == {"mha_dtps", "inhouse.py:mha_vit"}  # one row per model, not per file
    apply, bench, evaluation = outputs["apply"], outputs["bench"], outputs["eval"]
    small = table["mha_dtps"]
    assert (small["variant"], small["keep"]) == ("dtps", "0.5")
    assert float(small["params (M)"]) == pytest.approx(
        apply["compressed"]["params"] / 1e6, abs=1e-4
    )
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
    finetuned.write_text(
        json.dumps(
            {
                "epochs": 1,
                "steps": 3,
                "history": [{"epoch": 0, "step": 3, "train_loss": 1.0, "val_top1": 0.75}],
                "val_top1": 0.75,
                "variant": "dtps",
                "keep": [0.5, 0.5],
                "locs": [1, 2],
                "out": str(tmp_path / "mha_dtps_ft"),
            }
        )
    )
    data = run_json("report", paths["apply"], art / "vitcompress.json", finetuned)
    rows = {row["name"]: row for row in data["rows"]}
    assert set(rows) == {"inhouse.py:mha_vit", "mha_dtps", "mha_dtps_ft"}
    assert rows["mha_dtps"]["macs"] == outputs["apply"]["compressed"]["macs"]
    assert len(rows["mha_dtps"]["sources"]) == 2  # apply and the artifact's own JSON
    assert rows["mha_dtps_ft"]["top1"] == pytest.approx(75.0)
    assert rows["mha_dtps_ft"]["keep"] == "0.5" and rows["mha_dtps_ft"]["gmacs"] is None


def test_rows_join_on_identity_never_on_equal_cost():
    same = {
        "kind": "timm",
        "source": "deit_tiny_patch16_224",
        "model_args": {},
        "weights": "random",
        "input_size": [3, 224, 224],
    }
    a = ReportRow(name="a", variant="dtps", keep="0.7", params=10, macs=20, top1=50.0)
    b = ReportRow(name="b", params=10, macs=20, throughput=5.0)  # no identity: joins nothing
    c = ReportRow(name="c", params=10, macs=20, identity=same | {"spec": "x"}, throughput=7.0)
    d = ReportRow(name="d", params=10, macs=20, identity=same | {"spec": "y"}, top1=60.0)
    e = ReportRow(name="e", params=10, macs=20, identity=same, top1=61.0)  # other data
    merged = merge_rows([a, b, c, d, e])
    assert [r.name for r in merged] == ["a", "b", "c", "e"]
    assert merged[0].throughput is None and (merged[2].throughput, merged[2].top1) == (7.0, 60.0)


def _apply(model_args: tuple[str, ...], out, timing=("--no-throughput",)) -> dict:
    return run_json(
        "apply",
        "--model",
        MHA,
        *TWO_CLASSES,
        *model_args,
        "--variant",
        "dtps",
        "--keep",
        "0.5",
        "--locs",
        "1,2",
        "--out",
        out,
        *timing,
    )


def test_every_result_names_its_model(runs):
    root, art, outputs, paths = runs
    weights = hashlib.sha256((art / "model.safetensors").read_bytes()).hexdigest()
    for identity in (outputs["bench"]["identity"], outputs["apply"]["compressed"]["identity"]):
        assert identity["kind"] == "artifact" and identity["path"] == str(art.resolve())
        assert identity["weights_sha256"] == weights
    base = outputs["apply"]["base"]["identity"]
    assert base["kind"] == "file" and base["path"] == str(FIXTURES.resolve())
    assert base["weights"] == "random" and base["input_size"] == [3, 32, 32]
    assert outputs["bench"]["model"] == str(art)


def test_throughput_goes_to_its_own_model_not_to_one_of_equal_cost(tmp_path):
    """Two dTPS artifacts of one base: equal params and MACs, different predictor weights."""
    first, second = tmp_path / "first", tmp_path / "second"
    files = {
        "first": _apply((), first),
        "second": _apply((), second),
        "bench": run_json(
            "bench", "--model", second, "--batch-size", "2", "--runs", "1", "--warmup", "0"
        ),
    }
    assert files["first"]["compressed"]["macs"] == files["second"]["compressed"]["macs"]
    assert (
        files["first"]["compressed"]["identity"]["weights_sha256"]
        != files["second"]["compressed"]["identity"]["weights_sha256"]
    )
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    data = run_json("report", *(tmp_path / f"{name}.json" for name in files))
    rows = {row["name"]: row for row in data["rows"]}
    assert set(rows) == {"inhouse.py:mha_vit", "first", "second"}
    assert rows["first"]["throughput"] is None
    assert rows["second"]["throughput"] == pytest.approx(files["bench"]["throughput"])


def test_one_artifact_by_relative_and_absolute_path_is_one_row(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    (tmp_path / "json").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    applied = _apply((), "art")  # relative --out
    data = write_image_folder(tmp_path / "imgs", per_class=2)
    evaluated = run_json(
        "eval",
        "--model",
        tmp_path / "work" / "art",
        "--data",
        data,
        "--batch-size",
        "4",
        "--no-throughput",
    )
    (tmp_path / "json" / "apply.json").write_text(json.dumps(applied))
    (tmp_path / "json" / "eval.json").write_text(json.dumps(evaluated))
    monkeypatch.chdir(tmp_path)  # the report is made from elsewhere
    rows = run_json("report", "json/apply.json", "json/eval.json")["rows"]
    assert [row["name"] for row in rows] == ["inhouse.py:mha_vit", "art"]
    assert rows[1]["top1"] == pytest.approx(evaluated["top1"])
    assert rows[1]["macs"] == applied["compressed"]["macs"]


def test_models_of_one_name_and_plan_get_unique_names_and_plot_labels(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    labels: list[str] = []
    annotate = matplotlib.axes.Axes.annotate
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "annotate",
        lambda self, text, *a, **k: labels.append(text) or annotate(self, text, *a, **k),
    )
    files = []
    for folder, args in (("a", ()), ("b", ("--model-arg", "depth=3"))):
        path = tmp_path / f"{folder}.json"
        timing = ("--batch-size", "2", "--runs", "1", "--warmup", "0")
        path.write_text(json.dumps(_apply(args, tmp_path / folder / "dtps", timing)))
        files.append(path)
    result = run(
        "report", *files, "--out-png", tmp_path / "plot.png", "--out-md", tmp_path / "t.md"
    )
    assert result.exit_code == 0, result.output
    names = list(parse_markdown((tmp_path / "t.md").read_text()))
    assert len(names) == len(set(names)) == 4  # two bases (depth 4 and 3), two artifacts
    assert {"a/dtps", "b/dtps"} <= set(names)
    assert len(labels) == 4 and len(set(labels)) == 4  # the throughput panel: every model once
    assert {"a/dtps (dtps 0.5)", "b/dtps (dtps 0.5)"} <= set(labels)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"hello": 1}', "not the JSON of apply, bench, eval or finetune"),
        ('{"plan": {}, "base": {}, "compressed": {}}', "malformed apply output"),
    ],
)
def test_bad_json_is_one_line_and_exit_2(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    result = run("report", path)
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_missing_file_is_exit_2(tmp_path):
    result = run("report", tmp_path / "nope.json")
    assert result.exit_code == 2 and "cannot read" in result.output


@pytest.mark.parametrize("name", ["plot", "plot.xyz"])
def test_a_plot_named_without_its_format_is_refused_before_anything_is_written(
    runs, tmp_path, name
):
    """matplotlib wrote ``plot`` as plot.png (while "wrote plot" was said), and failed on
    ``.xyz`` after the Markdown was written, exit 1."""
    result = run(
        "report", runs[3]["apply"], "--out-md", tmp_path / "t.md", "--out-png", tmp_path / name
    )
    assert result.exit_code == 2
    assert result.stderr.strip().startswith(f"error: --out-png {tmp_path / name}: name the file")
    assert list(tmp_path.iterdir()) == []


def test_png_without_matplotlib_is_one_clear_line(runs, tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    result = run("report", runs[3]["apply"], "--out-png", tmp_path / "x.png")
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "error: plots need matplotlib: pip install 'vitcompress[plots]'"
    )
    assert "GMACs" in result.stdout  # the table is shown all the same


def test_apply_of_an_artifact_names_the_base_it_measured(tmp_path):
    from tests.fixtures.inhouse import mha_vit

    checkpoint = tmp_path / "base.pt"
    torch.save(mha_vit().state_dict(), checkpoint)
    first = run_json(
        "apply",
        "--model",
        MHA,
        "--checkpoint",
        checkpoint,
        "--variant",
        "dtps",
        "--keep",
        "0.5",
        "--locs",
        "1,2",
        "--out",
        tmp_path / "art",
        "--no-throughput",
    )
    base = first["base"]["identity"]
    assert base["checkpoint_sha256"] == hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    again = run_json(
        "apply",
        "--model",
        tmp_path / "art",
        "--variant",
        "etps",
        "--keep",
        "0.7",
        "--no-throughput",
    )
    # The artifact's recorded base was compressed again: that base, not the artifact, is "base".
    assert again["base"]["identity"] == base
    assert again["base"]["macs"] == first["base"]["macs"]


def test_a_base_method_other_than_forward_is_another_model(tmp_path):
    # --entry forward_features runs another function of the same weights: its cost is not the
    # forward's, so its rows must not merge; eTPS adds no weights, so two artifacts of one base
    # and plan differ only by their entry.
    model = ["--model", "deit_tiny_patch16_224", "--model-arg", "depth=2"]
    model += ["--model-arg", "img_size=32", "--model-arg", "patch_size=8"]
    files = {}
    for entry in ("forward", "forward_features"):
        files[f"bench_{entry}"] = run_json("bench", *model, "--entry", entry, "--no-throughput")
        files[f"apply_{entry}"] = run_json(
            "apply", *model, "--entry", entry, "--variant", "etps", "--keep", "0.5",
            "--no-throughput", "--out", tmp_path / entry,
        )  # fmt: skip
    assert "entry" not in files["bench_forward"]["identity"]
    assert files["bench_forward_features"]["identity"]["entry"] == "forward_features"
    for name, data in files.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    data = run_json("report", *(tmp_path / f"{name}.json" for name in files))
    macs = sorted(round(row["macs"]) for row in data["rows"])
    assert len(data["rows"]) == 4, [row["name"] for row in data["rows"]]
    assert len(set(macs)) == 4
