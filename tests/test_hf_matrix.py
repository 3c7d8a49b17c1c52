"""The compatibility matrix's HF rows and ``--merge``: a subset run replaces its families' rows in
the stored matrix, keeps the others and recomputes the summary."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "compat_matrix.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("compat_matrix_hf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


matrix = _load_script()


def _row(family: str, status: str) -> dict:
    cell = {"status": status, "line": None if status == "ok" else f"{family} is refused"}
    if status == "ok":
        cell["gmac_ratio"] = 0.7
    return {
        "family": family,
        "model": f"{family}_model",
        "build": {"status": "ok", "input_size": [3, 32, 32]},
        "maps": {"status": "ok", "blocks": 4},
        "variants": {v: dict(cell) for v in matrix.VARIANTS},
    }


def test_merge_replaces_the_rows_run_keeps_the_rest_and_recomputes_the_summary(tmp_path):
    old_rows = [_row("deit", "ok"), _row("hf_vit", "refused"), _row("swin", "refused")]
    meta = {"summary": matrix.summarise(old_rows), "command": "full", "date": "2026-01-01"}
    stored = tmp_path / "matrix.json"
    stored.write_text(json.dumps({"meta": meta, "rows": old_rows}))

    order = ["deit", "swin", "hf_vit", "hf_cvt"]
    merged = matrix.merge_rows(
        stored, [_row("hf_cvt", "ok"), _row("hf_vit", "ok")], order, "cmd --merge"
    )
    assert [r["family"] for r in merged["rows"]] == order
    summary = merged["meta"]["summary"]
    assert summary["working_all_variants"] == ["deit", "hf_vit", "hf_cvt"]
    assert list(summary["refused"]) == ["swin"]
    assert merged["meta"]["merged"][-1]["families"] == ["hf_cvt", "hf_vit"]
    assert merged["meta"]["date"] == "2026-01-01"  # the full run's own record is kept


def test_the_hf_classes_are_rows_of_the_matrix_where_transformers_is_installed():
    families = dict(matrix.family_models())
    if importlib.util.find_spec("transformers") is None:
        assert not set(matrix.HF_CLASSES) & set(families)
    else:
        for family, cls in matrix.HF_CLASSES.items():
            assert families[family] == cls
