"""A switch setting (``carry_windows``, ``carry_branches``, dTPS's ``window_sizes``) written as a
word on the command line (``--variant-arg carry_windows=true``: values are Python literals, so
``true`` is the string) is refused in one line that says how to write it, not only that it
"must be true or false"."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from vitcompress.cli.main import cli
from vitcompress.variants import VariantRefusal, get_variant


@pytest.mark.parametrize(
    ("name", "key", "word", "literal"),
    [
        ("etps", "carry_windows", "true", "True"),
        ("tome", "carry_branches", "false", "False"),
        ("dtps", "window_sizes", "TRUE", "True"),
    ],
)
def test_a_switch_given_as_a_word_says_how_to_write_it(
    name: str, key: str, word: str, literal: str
) -> None:
    with pytest.raises(VariantRefusal) as refused:
        get_variant(name, {key: word})
    assert f"must be true or false, got {word!r} (write {literal}:" in str(refused.value)
    assert get_variant(name, {key: literal == "True"}).settings == {key: literal == "True"}


@pytest.mark.parametrize("value", [1, "yes", [True]])
def test_other_values_are_refused_as_before(value: object) -> None:
    with pytest.raises(VariantRefusal) as refused:
        get_variant("etps", {"carry_windows": value})
    assert str(refused.value) == f"variant_args carry_windows: must be true or false, got {value!r}"


def test_the_command_line_says_it_in_one_line() -> None:
    result = CliRunner().invoke(
        cli,
        ["apply", "--model", "vit_tiny_patch16_224", "--variant", "etps"]
        + ["--variant-arg", "carry_windows=true"],
    )
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines == [
        "error: --variant-arg carry_windows: must be true or false, got 'true' "
        "(write True: values are Python literals)"
    ]
