"""A rewritten model that cannot run is refused in one line when it is made, not at the user's
first call: an attention that lays out its windows with a fixed token count cannot take the
fewer tokens a predictor hands it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from tests.test_per_token_after import SIZE, WindowBlock, WithTails
from vitcompress import compress
from vitcompress.compilation.naming import RewrittenModelError


class FixedTokens(WindowBlock):
    """The window's 16 tokens written into its reshapes as a number."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, _, dim = x.shape
        side, w, cut = self.side, self.window, self.side // self.window
        h = self.norm1(x).reshape(batch, cut, w, cut, w, dim).permute(0, 1, 3, 2, 4, 5)
        h = h.reshape(-1, 16, dim)
        q, k, v = self.qkv(h).reshape(-1, 16, 3, 2, dim // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(-1, 16, dim)
        a = self.proj(a).reshape(batch, cut, cut, w, w, dim).permute(0, 1, 3, 2, 4, 5)
        x = x + a.reshape(batch, side * side, dim)
        return x + self.mlp(self.norm2(x))


def fixed_tokens_model() -> WithTails:
    torch.manual_seed(0)
    model = WithTails(("mlp",))
    model.block0 = FixedTokens()
    return model.eval()


def test_a_predictor_on_an_attention_with_a_fixed_token_count_is_refused_in_one_line(capfd):
    model = fixed_tokens_model()
    with pytest.raises(RewrittenModelError) as refused:
        compress(model, "dtps", keep=[0.7], locs=[0], input_size=SIZE)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("the rewritten model fails on one example image")
    assert message.endswith("so dtps is refused here")
    assert "is invalid for input of size" in message
    assert capfd.readouterr().err == ""  # fx's generated-code dump is not printed
    # eTPS runs the attention on every token: the same model compresses, and runs.
    compressed = compress(model, "etps", keep=[0.7], locs=[0], input_size=SIZE)
    assert compressed(torch.randn(2, *SIZE)).shape == (2, 10)


def test_the_cli_says_it_in_one_line_and_exits_non_zero(tmp_path):
    from vitcompress.cli.main import cli

    source = tmp_path / "fixed.py"
    source.write_text(
        "from tests.test_rewritten_model_runs import fixed_tokens_model as build\n", "utf-8"
    )
    result = CliRunner().invoke(
        cli,
        [
            "apply",
            *("--model", f"{source}:build", "--input-size", "3,32,32"),
            *("--variant", "dtps", "--keep", "0.7", "--locs", "0"),
        ],
    )
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "fails on one example image" in lines[0], result.output
