"""An in-house model that declares no input size: read from its patch embedding and position
table, or 224 tried, with one line on stderr saying which, instead of a refusal."""

from __future__ import annotations

from tests.fixtures import edge_case_vits
from vitcompress.loading import default_input_size, load_base_model

FIXTURE = "tests/fixtures/edge_case_vits.py"


def test_size_read_from_patch_stride_and_position_table(capsys) -> None:
    # 8 x 8 patch rows (+1 cls row) in the table, stride 4: a 32-px image.
    assert default_input_size(edge_case_vits.unsized_vit()) == (3, 32, 32)
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and "declares no input size" in note
    assert "3,32,32" in note and "stride 4" in note and "pos (1, 65, 32)" in note


def test_load_model_runs_the_inferred_size(capsys) -> None:
    loaded = load_base_model(f"{FIXTURE}:unsized_vit")
    assert loaded.input_size == (3, 32, 32)
    assert "3,32,32" in capsys.readouterr().err


def test_without_a_position_table_224_is_tried_and_said(capsys) -> None:
    loaded = load_base_model(f"{FIXTURE}:unsized_vit_without_table")
    assert loaded.input_size == (3, 224, 224)
    note = capsys.readouterr().err
    assert "trying 3,224,224" in note and "--input-size" in note


def test_a_declared_size_wins_and_says_nothing(capsys) -> None:
    assert default_input_size(edge_case_vits.flatten_head_vit()) == (3, 32, 32)
    assert capsys.readouterr().err == ""


def test_a_table_whose_patch_rows_are_no_square_says_the_grid_is_a_guess(capsys) -> None:
    """97 rows with one cls token: 8 x 12 patches, no square. The square 9 x 9 found by taking
    16 rows for prefix tokens is tried, and the note says that is what it took."""
    import torch
    from torch import nn

    model = nn.Module()
    model.patch_embed = nn.Conv2d(1, 8, kernel_size=4, stride=4)
    model.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
    model.pos_embed = nn.Parameter(torch.zeros(1, 97, 8))
    assert default_input_size(model) == (1, 36, 36)
    note = capsys.readouterr().err
    assert "the side of the 81 patch rows of position table pos_embed (1, 97, 8), taking its " in (
        note
    )
    assert "first 16 rows for prefix tokens: the model's 1 leave 96 rows, no square" in note
