"""The compatibility matrix script (benchmarks/compat_matrix.py): its row function gives the right
columns for a working family, a refused one and a hybrid, catches a silently wrong model, and
bounds each cell in time. The full matrix is a slow test."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from vitcompress.compilation.rewrite import _Rewriter

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "compat_matrix.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("compat_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


matrix = _load_script()


def test_a_working_vit_is_exact_at_keep_one_and_cheaper_trains_and_exports():
    row = matrix.matrix_row("deit", "deit_tiny_patch16_224", variants=("dtps", "evit"))
    assert row["build"]["kwargs"] == matrix.SMALL_VIT and row["build"]["input_size"] == [3, 32, 32]
    assert row["maps"]["status"] == "ok" and row["maps"]["blocks"] == 4
    for variant in ("dtps", "evit"):
        cell = row["variants"][variant]
        assert cell["status"] == "ok", cell
        assert (
            cell["exact"] and cell["keep1_max_diff"] < 1e-4 and cell["keep1_relative_diff"] < 1e-4
        )
        assert 0.5 < cell["gmac_ratio"] < 1.0
        assert cell["train"]["ok"] and cell["train"]["params_with_grad"].split("/")[0] != "0"
        assert cell["onnx"]["ok"] and cell["onnx"]["max_abs_diff"] < 1e-4


def test_a_relative_position_family_is_exact_at_keep_one_and_cheaper_trains_and_exports():
    """BEiT's bias follows the kept tokens: every column passes, with the sharpened weights."""
    row = matrix.matrix_row("beit", "beit_base_patch16_224", variants=("dtps", "evit"))
    assert row["maps"]["status"] == "ok"
    for variant in ("dtps", "evit"):
        cell = row["variants"][variant]
        assert cell["status"] == "ok", cell
        assert cell["exact"] and cell["gmac_ratio"] < 1.0
        assert cell["train"]["ok"] and cell["onnx"]["ok"]


def test_a_position_table_refusal_is_grouped_under_its_reason():
    line = (
        "block 2 (blocks.2.attn.after) applies the position table blocks.2.attn.after.mix to its "
        "tokens after the token reduction at block 1, and it cannot follow the kept tokens: ..."
    )
    assert matrix.refusal_reason(line) == "position table after the reduction"


def test_the_matrix_catches_a_silently_wrong_model(monkeypatch):
    """Without the position-table gather, dTPS at keep 1 re-sorts BEiT's tokens under a bias
    table indexed by position: the sharpened weights make the change visible and the cell says
    WRONG, never ok."""
    monkeypatch.setattr(_Rewriter, "_gather_position_tables", lambda self, *args: None)
    cell = matrix.matrix_row("beit", "beit_base_patch16_224", variants=("dtps",))["variants"][
        "dtps"
    ]
    assert cell["status"] == "wrong" and not cell["exact"] and cell["keep1_relative_diff"] > 1e-3
    summary = matrix.summarise(
        [
            {
                "family": "beit",
                "model": "beit_base_patch16_224",
                "variants": {v: cell for v in matrix.VARIANTS},
            }
        ]
    )
    assert summary["wrong_logits"] == ["beit"] and summary["failing_families"] == ["beit"]
    assert "**WRONG**" in matrix.cell_text(cell)


def test_a_hybrid_pyramid_maps_its_stages_and_compresses():
    row = matrix.matrix_row("pvt_v2", "pvt_v2_b0", variants=("etps",))
    assert row["build"]["input_size"] == [3, 64, 64]
    assert row["maps"]["status"] == "ok" and row["maps"]["stages"] == 4
    cell = row["variants"]["etps"]
    assert cell["status"] == "ok", cell
    assert cell["keep1_max_diff"] < 1e-4 and cell["gmac_ratio"] < 1.0


def test_a_windowed_model_compresses_within_its_windows():
    """Swin's row: every variant exact at keep 1 (sharpened weights), under 0.85 of the GMACs at
    keep 0.7, trains and exports; the search's analytic check does not apply (it refuses
    windowed models)."""
    row = matrix.matrix_row("swin", "swin_tiny_patch4_window7_224")
    assert row["maps"]["status"] == "ok"
    for variant, cell in row["variants"].items():
        assert cell["status"] == "ok", (variant, cell)
        assert cell["exact"] and cell["gmac_ratio"] < 0.85, (variant, cell)
        assert cell["analytic_error"] is None


def _hang(*args, **kwargs):
    """A step that never ends on its own: only the cell's timer can stop it. (Bounded, so that a
    broken timer fails the test instead of hanging the suite.)"""
    time.sleep(600)
    return "finished"


@pytest.fixture
def no_build_limit(monkeypatch):
    """The build is timed too: on a loaded machine it may take long, which is not the cell's
    timeout under test."""
    monkeypatch.setattr(matrix, "BUILD_SECONDS", 3600.0)


def test_a_map_past_its_time_is_a_timeout_not_a_hang(monkeypatch, no_build_limit):
    monkeypatch.setattr(matrix.vitcompress, "map_model", _hang)
    row = matrix.matrix_row("deit", "deit_tiny_patch16_224", cell_seconds=0.2)
    assert row["build"]["status"] == "ok"
    assert row["maps"]["status"] == "timeout"
    assert {cell["status"] for cell in row["variants"].values()} == {"timeout"}


def test_a_variant_past_its_time_is_a_timeout_not_a_hang(monkeypatch, no_build_limit):
    """The map and the MAC count return at once (stand-ins), so only the variant cell can run
    past its time, however slow the machine."""

    class Map:
        blocks = []  # no windowed block: the search's cost model is profiled (and fails here)

        def to_json(self):
            return {"capture": "fx", "blocks": [0] * 4, "stages": [0], "prefix_tokens": 1}

    monkeypatch.setattr(matrix.vitcompress, "map_model", lambda *args: Map())
    monkeypatch.setattr(matrix, "count_macs", lambda *args: 1)
    monkeypatch.setattr(matrix, "variant_cell", _hang)
    row = matrix.matrix_row("deit", "deit_tiny_patch16_224", cell_seconds=0.2, variants=("etps",))
    assert row["maps"]["status"] == "ok"
    assert row["variants"] == {"etps": {"status": "timeout", "line": "timeout after 0.2 s"}}


def test_every_family_the_matrix_promises_has_its_smallest_model():
    chosen = dict(matrix.family_models())
    for family in (
        "vit",
        "deit",
        "deit3",
        "beit",
        "beitv2",
        "eva02",
        "vit_relpos",
        "vit_rope",
        "cait",
        "xcit",
        "levit",
        "efficientformer",
        "pvt_v2",
        "twins_svt",
        "swin",
        "maxvit",
        "hiera",
        "samvit",
        "flexivit",
        "vit_reg",
        "vit_pwee",
        "naflexvit",
        "mvitv2",
        "crossvit",
        "tnt",
        "volo",
        "coat",
        "convit",
        "sequencer",
    ):
        assert chosen.get(family), family
    assert chosen["deit"] == "deit_tiny_patch16_224"
    assert chosen["levit"] == "levit_128s"
    assert chosen["pvt_v2"] == "pvt_v2_b0"
    assert chosen["pvt (zoo)"] == "pvt_tiny" and chosen["cvt (zoo)"] == "cvt_13"
    # A model is in one family only (the dense rows rebuild some on purpose: tokens out).
    models = [m for f, m in chosen.items() if m and f not in matrix.DENSE]
    assert len(models) == len(set(models))


@pytest.mark.slow
def test_the_full_matrix_has_no_silently_wrong_family(tmp_path):
    out_json, out_doc = tmp_path / "matrix.json", tmp_path / "compatibility.md"
    assert matrix.main(["--json", str(out_json), "--doc", str(out_doc)]) == 0
    result = json.loads(out_json.read_text())
    summary = result["meta"]["summary"]
    assert summary["wrong_logits"] == []
    assert summary["families"] >= 60
    statuses = {
        cell["status"]
        for row in result["rows"]
        if row.get("model")
        for cell in row["variants"].values()
    }
    assert statuses <= {"ok", "refused", "error", "timeout"}
    doc = out_doc.read_text()
    assert "## Summary" in doc and "benchmarks/compat_matrix.py" in doc


def test_an_export_the_base_fails_too_is_the_familys_not_a_bug(monkeypatch):
    """A compressed model whose ONNX export fails is a bug, unless the uncompressed model fails to
    export as well (vit_rope_mixed in torch 2.14): then the cell stays ok, marked "no ONNX"."""
    import torch

    base, compressed = torch.nn.Linear(2, 2), torch.nn.Linear(2, 3)
    exporting = {"fails": {id(compressed)}}

    def fake_export(model, input_size, fmt, out, **kwargs):
        if id(model) in exporting["fails"]:
            raise RuntimeError("Expand: Incompatible dimensions")
        return {"max_abs_diff": 0.0}

    monkeypatch.setattr(matrix, "export_model", fake_export)
    assert matrix._onnx(compressed, (3, 32, 32), base=base) == {
        "ok": False,
        "line": "RuntimeError: Expand: Incompatible dimensions",
    }
    exporting["fails"].add(id(base))
    result = matrix._onnx(compressed, (3, 32, 32), base=base)
    assert result["ok"] is None and "the base model does not export either" in result["line"]
    cell = {"status": "ok", "gmac_ratio": 0.7, "onnx": result}
    assert matrix.cell_text(cell) == "ok 0.70 (no ONNX)"


def test_a_dense_output_row_compares_whole_outputs_shape_and_token_cosine():
    """dense_vit (a timm ViT without head or pooling: the tokens are the output), one variant:
    keep 1 is exact on the whole output, keep 0.7 gives the base's shape back with a median
    per-token cosine, trains on a loss of the output and exports."""
    row = matrix.matrix_row("dense_vit", matrix.DENSE["dense_vit"], variants=("etps",))
    assert row["build"]["input_size"] == [3, 32, 32]
    assert row["build"]["output_shape"] == [[2, 65, 64]]  # cls + 8x8 tokens, width 64
    assert row["maps"]["status"] == "ok" and row["maps"]["blocks"] == 4
    cell = row["variants"]["etps"]
    assert cell["status"] == "ok", cell
    assert cell["exact"] and cell["keep1_relative_diff"] < 1e-4
    assert cell["output_shape"] == [[2, 65, 64]]
    assert 0.0 < cell["token_cosine_min"] <= cell["token_cosine"] <= 1.0
    assert cell["gmac_ratio"] < 1.0 and cell["train"]["ok"] and cell["onnx"]["ok"]
    assert matrix.cell_text(cell) == f"ok {cell['gmac_ratio']:.2f} cos {cell['token_cosine']:.3f}"


class _Tokens(torch.nn.Module):
    """A stand-in "compressed" model: its input's first ``keep`` tokens, the features negated
    after the first half (so that the cosine to the input is about 0 for each token)."""

    def __init__(self, keep: int | None = None, flip: bool = False) -> None:
        super().__init__()
        self.keep, self.flip = keep, flip
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        x = x[:, : self.keep] * self.scale
        if self.flip:
            half = x.shape[-1] // 2
            x = torch.cat([x[..., :half], -x[..., half:]], dim=-1)
        return x


def test_the_dense_cell_gives_an_error_for_a_dropped_token_and_a_cosine_per_token(monkeypatch):
    """Keep 0.7 must give the base's output shape (a model that drops tokens from its output is
    an error in the output step); the cosine is per token (per pixel of a (B, C, H, W) map)."""
    x = torch.randn(2, 10, 8)
    base = matrix._outputs(x)
    assert matrix._dense_output(_Tokens(), x, base)["token_cosine"] == 1.0
    flipped = matrix._dense_output(_Tokens(flip=True), x, base)
    assert abs(flipped["token_cosine"]) < 0.5 and flipped["output_shape"] == [[2, 10, 8]]
    # A (B, C, H, W) map: cosines over C, one per pixel; negating it everywhere gives -1.
    image = torch.randn(2, 3, 4, 4)
    assert matrix._token_vectors(image).shape == (32, 3)
    negate = _Tokens()
    negate.scale.data.fill_(-1.0)
    negated = matrix._dense_output(negate, image, [image])
    assert negated["token_cosine"] == negated["token_cosine_min"] == -1.0

    compressed = {1.0: _Tokens(), matrix.REDUCED_KEEP: _Tokens(keep=7)}
    monkeypatch.setattr(
        matrix.vitcompress, "compress", lambda model, variant, keep, **kw: compressed[keep]
    )
    monkeypatch.setattr(matrix, "count_macs", lambda *args: 70)
    monkeypatch.setattr(matrix, "_onnx", lambda *args, **kw: {"ok": True, "max_abs_diff": 0.0})
    cell = matrix.variant_cell(_Tokens(), (10, 8), "etps", base, 100, x, dense=True)
    assert cell["exact"] and cell["keep1_max_diff"] == 0.0
    assert cell["status"] == "error" and cell["line"] == (
        "output: ValueError: keep 0.7 gives outputs of shape [[2, 7, 8]], the base [[2, 10, 8]]"
    )
    assert matrix.cell_text(cell) == "**error** (output)"
    assert cell["gmac_ratio"] == 0.7 and cell["train"]["ok"]  # the other steps still ran


def test_merging_adds_new_families_in_the_matrix_order(tmp_path):
    old = {"family": "deit", "model": "deit_tiny_patch16_224", "variants": {}}
    old["variants"] = {v: {"status": "ok", "gmac_ratio": 0.7} for v in matrix.VARIANTS}
    path = tmp_path / "matrix.json"
    path.write_text(json.dumps({"meta": {"command": "full"}, "rows": [old]}))
    cell = {"status": "ok", "gmac_ratio": 0.7, "token_cosine": 0.99}
    new = {"family": "dense_vit", "model": "vit_tiny_patch16_224", "variants": {}}
    new["variants"] = {v: dict(cell) for v in matrix.VARIANTS}
    order = [family for family, _ in matrix.family_models()]
    merged = matrix.merge_rows(path, [new], order, "nice -n 10 python ... --merge")
    assert [row["family"] for row in merged["rows"]] == ["deit", "dense_vit"]
    assert merged["meta"]["summary"]["families"] == 2
    assert merged["meta"]["merged"][0]["families"] == ["dense_vit"]
