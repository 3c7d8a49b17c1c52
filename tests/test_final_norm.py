"""The final norm comes from the analysis (the norm on the token stream after the last block),
not from a module's name or class; token distillation watches it in both models."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitcompress
from tests.fixtures.inhouse import MHALayer
from tests.models import VANILLA
from vitcompress.compilation.metadata import compression_info
from vitcompress.training.losses import DistillationTaps

SIZE = (3, 32, 32)
DIM = 32


class Finish(nn.LayerNorm):
    """A final norm by another name and class."""


class OddNormViT(nn.Module):
    """Its final norm is ``tail`` (a ``Finish``); the module called ``norm`` normalises the patch
    embedding before the blocks. ``ending`` picks what the head reads: ``tail`` on all tokens,
    a pooled stream normalised after pooling (no final norm on the tokens), or a functional
    norm in this ``forward`` (no module whose output it is)."""

    def __init__(self, ending: str = "tail") -> None:
        super().__init__()
        self.ending = ending
        self.stem = nn.Conv2d(3, DIM, 4, 4)
        self.norm = nn.LayerNorm(DIM)
        self.lead = nn.Parameter(torch.randn(1, 1, DIM) * 0.02)
        self.where = nn.Parameter(torch.randn(1, 65, DIM) * 0.02)
        self.layers = nn.ModuleList([MHALayer(DIM, 2) for _ in range(3)])
        self.tail = Finish(DIM)
        self.pooled_norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 10)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.stem(image).flatten(2).transpose(1, 2))
        x = torch.cat([self.lead.expand(x.shape[0], -1, -1), x], dim=1) + self.where
        for layer in self.layers:
            x = layer(x)
        if self.ending == "pooled":
            return self.head(self.pooled_norm(x.mean(dim=1)))
        if self.ending == "functional":
            return self.head(F.layer_norm(x, (DIM,))[:, 0])
        return self.head(self.tail(x)[:, 0])


@pytest.mark.parametrize(
    "ending, final_norm", [("tail", "tail"), ("pooled", None), ("functional", None)]
)
def test_the_analysis_finds_the_final_norm_by_the_graph(ending, final_norm) -> None:
    model_map = vitcompress.map_model(OddNormViT(ending).eval(), SIZE)
    assert model_map.final_norm == final_norm
    assert model_map.to_json()["final_norm"] == final_norm


@pytest.mark.parametrize(
    "name, final_norm",
    [
        ("vit", "norm"),
        ("inhouse_mha", "final_ln"),
        ("inhouse_registers", "out_norm"),
        ("vit_registers", None),  # global pooling, then fc_norm: no norm on the token stream
    ],
)
def test_the_final_norm_of_the_families(name, final_norm) -> None:
    factory, size, _, _ = VANILLA[name]
    assert vitcompress.map_model(factory().eval(), size).final_norm == final_norm


def test_token_distillation_watches_the_final_norm_of_both_models() -> None:
    torch.manual_seed(0)
    teacher = OddNormViT().eval()
    student = vitcompress.compress(teacher, "dtps", keep=0.5, locs=[1], input_size=SIZE).train()
    seen: list[torch.Tensor] = []
    teacher.tail.register_forward_hook(lambda module, args, output: seen.append(output))
    taps = DistillationTaps(student, teacher, token_distill=True)
    try:
        assert taps.token_distill and taps.norm_path == "tail"
        images = torch.randn(2, *SIZE)
        student(images)
        with torch.no_grad():
            teacher(images)
        assert taps.captured.teacher_tokens is seen[-1]
        tokens = taps.captured.student_tokens.detach()
        assert tokens.shape == (2, 65, DIM)  # training keeps every token (masked)
        # The output of the student's ``tail`` (weight 1, bias 0): each token normalised.
        assert torch.allclose(tokens.mean(-1), torch.zeros(2, 65), atol=1e-5)
        assert torch.allclose(tokens.var(-1, unbiased=False), torch.ones(2, 65), atol=1e-3)
    finally:
        taps.remove()


def test_without_a_final_norm_token_distillation_is_disabled_with_a_warning(caplog) -> None:
    teacher = OddNormViT("pooled").eval()
    student = vitcompress.compress(teacher, "dtps", keep=0.5, locs=[1], input_size=SIZE).train()
    assert compression_info(student).model_map.final_norm is None
    with caplog.at_level(logging.WARNING, logger="vitcompress.training.losses"):
        taps = DistillationTaps(student, teacher, token_distill=True)
    taps.remove()
    assert not taps.token_distill and taps.norm_path is None
    assert "token distillation disabled" in caplog.text
