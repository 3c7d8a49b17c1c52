"""A new windowed family is one entry in the slot finders' registry (``SLOT_FINDERS``): a toy
window attention that adds to its logits a term made from its queries and a learned key per
window slot (``q @ slot_keys.T``, read through a plain matmul, which no finder of the package
knows) runs whole under a predictor without its entry, and with the entry alone (registered
here, nothing else edited) runs on each window's kept tokens, exactly: keep 1 equals the base,
and at keep 0.7 inference (the kept tokens, the term made at the full window and gathered)
equals training with the same choice (every token, the removed keys masked)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from tests.test_windowed_families import one_choice_both_ways
from vitcompress import compress, map_model
from vitcompress.analysis import windows as window_analysis
from vitcompress.analysis.window_map import (
    QueryTermInput,
    ReducedAttention,
    SlotInput,
    SlotKind,
    WholeAttention,
    WindowLayout,
)
from vitcompress.analysis.windows import slots
from vitcompress.analysis.windows.checks import WindowFacts

GRID, WINDOW, DIM, HEADS = 8, 4, 32, 2
TOKENS = WINDOW * WINDOW  # per window
SIZE = (3, 32, 32)  # 4 x 4 patches: an 8 x 8 grid in 4 windows of 4 x 4


class SlotKeyAttention(nn.Module):
    """Attention within a window whose logits get a term made from the queries and one learned
    key per window slot: row i depends on query i alone, column j on slot j alone."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.slot_keys = nn.Parameter(torch.randn(TOKENS, DIM // HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        windows, tokens, channels = x.shape
        qkv = self.qkv(x).reshape(windows, tokens, 3, HEADS, channels // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        logits = q @ k.transpose(-2, -1) + q @ self.slot_keys.transpose(0, 1)
        attention = (logits * 0.5).softmax(-1)
        return self.proj((attention @ v).transpose(1, 2).reshape(windows, tokens, channels))


class ToyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = SlotKeyAttention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, channels = x.shape
        side = GRID // WINDOW
        h = self.norm1(x).reshape(batch, side, WINDOW, side, WINDOW, channels)
        h = self.attn(h.permute(0, 1, 3, 2, 4, 5).reshape(-1, TOKENS, channels))
        h = h.reshape(batch, side, side, WINDOW, WINDOW, channels).permute(0, 1, 3, 2, 4, 5)
        x = x + h.reshape(batch, length, channels)
        return x + self.mlp(self.norm2(x))


class ToyWindowedViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, DIM, 4, 4)
        self.blocks = nn.Sequential(ToyBlock(), ToyBlock())
        self.head = nn.Linear(DIM, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(images).flatten(2).transpose(1, 2)
        return self.head(self.blocks(tokens).mean(1))


def toy_model() -> ToyWindowedViT:
    """Sharpened: queries and keys x3 and slot keys from N(0, 2), so that which slot a token
    sits in changes the logits well above rounding."""
    torch.manual_seed(0)
    model = ToyWindowedViT()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("qkv.weight"):
                param[: 2 * DIM] *= 3.0
            elif name.endswith("slot_keys"):
                param.normal_(0.0, 2.0)
    return model.eval()


def _slot_key_term(f: WindowFacts) -> list[SlotInput]:
    """The toy family's finder: a matmul of the queries with a transposed parameter of one row
    per window slot, added to the query-key logits."""
    for node in f.anc.by_name.values():
        if node.op != "call_function" or node.target.__name__ != "matmul":
            continue
        queries, keys = node.args
        table = keys.args[0] if isinstance(keys, fx.Node) and keys.target == "transpose" else None
        if table is None or table.op != "get_attr" or not str(table.target).endswith("slot_keys"):
            continue
        if not f.anc.is_ancestor(f.entering, queries) or len(node.users) != 1:
            continue
        (add,) = node.users
        return [
            QueryTermInput(
                what=str(table.target),
                gather_dims=slots.last_two_dims(node),
                reader=add.name,
                source=node.name,
                queries=queries.name,
                makers=(node.name,),
            )
        ]
    return []


SLOT_KEY_FINDER = window_analysis.SlotFinder(
    "slot keys",
    "a toy attention (this test)",
    "a term from the queries and a learned key per window slot: made at the full window",
    _slot_key_term,
)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy family's one entry, for this test only."""
    monkeypatch.setattr(slots, "SLOT_FINDERS", (*slots.SLOT_FINDERS, SLOT_KEY_FINDER))


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(2, *SIZE, generator=torch.Generator().manual_seed(1))


def test_every_slot_finder_names_its_family_and_why() -> None:
    names = [finder.name for finder in slots.SLOT_FINDERS]
    assert len(set(names)) == len(names)
    assert all(finder.family and finder.why for finder in slots.SLOT_FINDERS)


def test_without_its_entry_the_toy_attention_runs_whole() -> None:
    """No finder of the package accounts for the slot keys: the table check refuses to reduce
    the windows before the attention (rather than reduce them silently wrong)."""
    blocks = map_model(toy_model(), SIZE).blocks
    assert all(isinstance(b.windows.attention, WholeAttention) for b in blocks)
    assert "slot_keys" in blocks[0].windows.attention.reason


def test_with_its_one_entry_the_toy_attention_reads_its_term_by_slot(registered) -> None:
    blocks = map_model(toy_model(), SIZE).blocks
    for block in blocks:
        attention = block.windows.attention
        assert isinstance(attention, ReducedAttention)
        assert attention.layout is WindowLayout.BATCH
        assert [(s.kind, s.what, s.gather_dims) for s in attention.slot_inputs] == [
            (SlotKind.QUERY_TERM, f"{block.path}.attn.slot_keys", (2, 3))
        ]


@pytest.mark.parametrize("method", ("dtps", "dynamicvit"))
def test_with_its_one_entry_a_predictor_compresses_the_toy_exactly(
    registered, images, monkeypatch, method
) -> None:
    model = toy_model()
    with torch.no_grad():
        base = model(images)
        same = compress(model, method, keep=[1.0], input_size=SIZE)(images)
    assert (same - base).abs().max() <= 1e-5 * base.abs().max()
    compressed = compress(model, method, keep=[0.7], locs=[0], input_size=SIZE)
    seen: list[tuple[int, ...]] = []
    qkv = dict(compressed.named_modules())["blocks.0.attn.qkv"]
    qkv.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    kept = int(0.7 * TOKENS)
    inferred, trained, other = one_choice_both_ways(
        compressed, images, monkeypatch, lambda tokens: kept
    )
    assert seen[0] == (2 * 4, kept, DIM)  # the attention runs on each window's kept tokens
    assert torch.allclose(inferred, trained, atol=1e-5 * inferred.abs().max().item())
    assert not torch.allclose(trained, other, atol=1e-3 * trained.abs().max().item())
