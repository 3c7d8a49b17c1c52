"""Artifacts through the command line: ``apply --model ARTIFACT``, user errors that exit 2, and
the permissions of the files the tool writes."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import timm
import torch
from click.testing import CliRunner, Result
from safetensors.torch import load_file, save_file

import vitcompress
from vitcompress.artifacts.artifact import read_meta
from vitcompress.cli.main import cli

NAME = "vit_tiny_patch16_224"
TINY = {
    "img_size": 32,
    "patch_size": 8,
    "depth": 2,
    "embed_dim": 64,
    "num_heads": 2,
    "num_classes": 10,
}
TINY_ARGS = [arg for key, value in TINY.items() for arg in ("--model-arg", f"{key}={value}")]


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def one_error_line(result: Result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture
def base_weights(tmp_path: Path) -> Path:
    torch.manual_seed(1)
    path = tmp_path / "base.safetensors"
    save_file(timm.create_model(NAME, **TINY).state_dict(), str(path))
    return path


def apply_to(model: str, out: Path, *plan: str, extra: tuple[str, ...] = ()) -> Result:
    return run(
        "apply", "--model", model, *extra, *plan, "--out", str(out), "--no-throughput", "--json"
    )


# --------------------------------------------------------------------------------------------------
# apply --model ARTIFACT
# --------------------------------------------------------------------------------------------------


# The second plan is parameter-free, so the result can be compared with compressing the base.
@pytest.mark.parametrize("first, second", [("dtps", "etps"), ("evit", "etps"), ("etps", "evit")])
def test_apply_to_an_artifact_compresses_its_base_again(
    tmp_path: Path, base_weights: Path, first: str, second: str, caplog: pytest.LogCaptureFixture
) -> None:
    plan = ("--keep", "0.5", "--locs", "1")
    made = apply_to(
        NAME,
        tmp_path / "first",
        "--variant",
        first,
        *plan,
        extra=(*TINY_ARGS, "--checkpoint", str(base_weights)),
    )
    assert made.exit_code == 0, made.output
    again = apply_to(str(tmp_path / "first"), tmp_path / "second", "--variant", second, *plan)
    assert again.exit_code == 0, again.output
    # A warning on the logger, which the command line prints on stderr (pytest captures it).
    note = caplog.text
    assert f"{tmp_path / 'first'} is a compressed model: compressing its base" in note
    assert str(base_weights) in note
    assert json.loads(again.stdout)["plan"]["variant"] == second
    meta = read_meta(tmp_path / "second")
    assert meta["plan"]["variant"] == second and meta["base_weights"] == str(base_weights)

    base = timm.create_model(NAME, **TINY)
    base.load_state_dict(load_file(str(base_weights)))
    direct = vitcompress.compress(base.eval(), second, keep=0.5, locs=[1]).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(vitcompress.load(tmp_path / "second")(x), direct(x))


def test_apply_to_an_artifact_without_base_weights_says_what_to_pass(tmp_path: Path) -> None:
    made = apply_to(
        NAME,
        tmp_path / "first",
        "--variant",
        "etps",
        "--keep",
        "0.5",
        "--locs",
        "1",
        extra=tuple(TINY_ARGS),
    )
    assert made.exit_code == 0, made.output
    again = apply_to(str(tmp_path / "first"), tmp_path / "second", "--variant", "dtps")
    assert again.exit_code == 2
    line = one_error_line(again)
    assert "records no base weights" in line and "pass its base model instead" in line
    assert not (tmp_path / "second").exists()


# --------------------------------------------------------------------------------------------------
# The user's errors exit 2 with one line
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["inspect", "bench", "apply"])
def test_a_wrong_input_size_exits_2(command: str) -> None:
    extra = ["--no-throughput"] if command != "inspect" else []
    result = run(command, "--model", NAME, *TINY_ARGS, "--input-size", "3,48,48", *extra)
    assert result.exit_code == 2, result.output
    line = one_error_line(result)
    assert "does not run on --input-size 3,48,48" in line and "3,32,32" in line


def test_a_factory_that_returns_no_vit_exits_2(tmp_path: Path) -> None:
    factory = tmp_path / "not_vit.py"
    factory.write_text(
        "from torch import nn\n\ndef build():\n    m = nn.Linear(10, 10)\n"
        "    m.default_input_size = (3, 32, 32)\n    return m\n"
    )
    result = run("inspect", "--model", f"{factory}:build")
    assert result.exit_code == 2, result.output
    assert "does not run on its input size 3,32,32" in one_error_line(result)


def test_a_refused_save_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    # A factory that builds another model on its second call (state kept in a file beside it,
    # since each load imports the file afresh): what apply saves cannot be rebuilt.
    factory = tmp_path / "my_vit.py"
    factory.write_text(
        "from pathlib import Path\nimport timm\n\n"
        "def build():\n"
        "    calls = Path(__file__).with_suffix('.calls')\n"
        "    act = 'relu' if calls.exists() else 'gelu'\n"
        "    calls.write_text('called')\n"
        "    return timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, depth=2,\n"
        "                             embed_dim=64, num_heads=2, num_classes=10, act_layer=act)\n"
    )
    result = apply_to(f"{factory}:build", tmp_path / "art", "--variant", "etps")
    assert result.exit_code == 2, result.output
    assert "differs from the one being saved" in one_error_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my_vit.calls", "my_vit.py"]


# --------------------------------------------------------------------------------------------------
# Files follow the umask
# --------------------------------------------------------------------------------------------------


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002], ids=["022", "027", "002"])
def test_artifacts_follow_the_umask(tmp_path: Path, mask: int) -> None:
    compressed = vitcompress.compress(timm.create_model(NAME, **TINY), "etps", keep=0.5, locs=[1])
    with umask(mask):
        art = vitcompress.save(compressed, tmp_path / "art")
        assert mode(art) == 0o777 & ~mask
        assert mode(art / "model.safetensors") == 0o666 & ~mask
        assert mode(art / "vitcompress.json") == 0o666 & ~mask
        vitcompress.save(compressed, art)  # replacing an artifact, too
        assert mode(art / "model.safetensors") == 0o666 & ~mask


def test_exports_follow_the_umask(tmp_path: Path) -> None:
    from vitcompress.workflows.export import export_model

    model = timm.create_model(NAME, **TINY)
    with umask(0o027):
        export_model(model, (3, 32, 32), "torchscript", tmp_path / "out" / "m.pt")
    assert mode(tmp_path / "out" / "m.pt") == 0o640
    assert mode(tmp_path / "out") == 0o750


def test_inspect_of_a_compressed_model_shows_its_bases_map(tmp_path: Path) -> None:
    # Not a map of the compressed graph, whose inserted modules the analysis would read as the
    # model's (one block fewer, a reader by position at a reducer's hook).
    out = tmp_path / "dtps"
    assert apply_to(NAME, out, "--variant", "dtps", "--keep", "0.5", "--locs", "1",
                    extra=tuple(TINY_ARGS)).exit_code == 0  # fmt: skip
    base = run("inspect", "--model", NAME, *TINY_ARGS, "--json")
    compressed = run("inspect", "--model", str(out), "--json")
    assert base.exit_code == compressed.exit_code == 0, compressed.output
    assert json.loads(compressed.stdout) == json.loads(base.stdout)
