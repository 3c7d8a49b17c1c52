"""Predictor warm-up for the learned variants (dTPS, DynamicViT), cheap enough to search with.

A fresh predictor selects at random, so a learned variant cannot be scored as it comes. Training
it through the frozen backbone with the fine-tune's losses costs a forward and backward of the
whole model per step (minutes per candidate for DeiT-S on a CPU, hours for a search). Instead each
predictor is distilled locally, the backbone frozen: at its block it learns to keep the tokens
that block's own class-token attention ranks highest (the tokens eTPS keeps), from the block's
input tokens. Both come from two passes of the base over the calibration images, made once per
search (the block inputs are read by dTPS reducers at keep 1, the attention by eTPS reducers at
keep 1: each of those models computes exactly the base). Later locations of a stage see the
tokens the earlier ones kept (teacher-forced), scored among those.

Steps: ``WARMUP_STEPS`` of ``WARMUP_BATCH`` images (200 x 8 = 1600 images, three passes over 512
calibration images: 200 x 8 x 196 = 314k keep/drop decisions per location on DeiT-S, for a
predictor of C^2 + C^2/4 + C^2/8 + C/2 weights; the predictor is a per-token classifier, so
every token of a batch is a sample). A step on DeiT-S's 384 channels costs about 0.1 s on one
core of an idle CPU, seconds per location in all (see
docs/search.md). The block inputs at later locations come from the base, not from the reduced
model: an approximation the proxy benchmark (benchmarks/search_proxy.py) measures.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitcompress.compilation.rewrite import REDUCER_PREFIX
from vitcompress.method import keep_count
from vitcompress.modules.predictor import ScorePredictor
from vitcompress.search.score import CandidateBuilder

WARMUP_STEPS = 200
WARMUP_BATCH = 8
WARMUP_LR = 1e-3


@dataclass
class BlockSignals:
    """At one block, over the calibration images: its input patch tokens (float16, to halve the
    memory) and the class-token attention each patch token gets (at a windowed block: each
    window's tokens and the attention each gets within its window, a row per window)."""

    tokens: Tensor  # (images, N0, C); (images x windows, window tokens, C) in windows
    attention: Tensor  # (images, N0); (images x windows, window tokens)


def _reducers(model: nn.Module) -> list[nn.Module]:
    return list(getattr(model, REDUCER_PREFIX).children())


@torch.no_grad()
def block_signals(
    builder: CandidateBuilder, images: Tensor, blocks: list[int], batch_size: int
) -> dict[int, BlockSignals]:
    """The inputs and attention scores at ``blocks`` (two passes over ``images``)."""
    tokens: dict[int, list[Tensor]] = {b: [] for b in blocks}
    scores: dict[int, list[Tensor]] = {b: [] for b in blocks}
    reader = builder.build("dtps", [1.0], blocks)  # keeps every token: the base's stream
    scorer = builder.build("etps", [1.0], blocks)
    handles = []
    for block, reducer in zip(blocks, _reducers(reader), strict=True):
        prefix = reducer.prefix_tokens

        def read(module, inputs, output, block=block, prefix=prefix):
            patches = inputs[0][:, prefix:]
            positions = inputs[2] if len(inputs) > 2 else None
            if positions is not None:  # an earlier reducer reordered them: back to grid order
                index = positions.unsqueeze(-1).expand(-1, -1, patches.shape[-1])
                patches = torch.empty_like(patches).scatter(1, index, patches)
            tokens[block].append(patches.to(torch.float16).cpu())

        handles.append(reducer.register_forward_hook(read))
    for block, reducer in zip(blocks, _reducers(scorer), strict=True):

        def score(module, inputs, output, block=block):
            scores[block].append(inputs[1].float().cpu())

        handles.append(reducer.register_forward_hook(score))
    try:
        for model in (reader, scorer):
            device = next(iter(model.parameters())).device
            for i in range(0, len(images), batch_size):
                model(images[i : i + batch_size].to(device))
    finally:
        for handle in handles:
            handle.remove()
    return {
        b: BlockSignals(tokens=torch.cat(tokens[b]), attention=torch.cat(scores[b])) for b in blocks
    }


def warm_predictors(
    model: nn.Module,
    signals: dict[int, BlockSignals],
    locs: list[int],
    steps: int = WARMUP_STEPS,
    batch: int = WARMUP_BATCH,
    seed: int = 0,
    windowed: Collection[int] = (),
) -> list[float]:
    """Train the predictors of ``model`` (a dTPS/DynamicViT plan at ``locs``) in place; returns
    each one's final loss. Only the predictors' weights change.

    At a ``windowed`` block the signals' rows are its windows (images x windows), the
    attention a token gets within its window, and the predictor learns each window's top
    tokens; every token is present there, since each windowed block gives its tokens back."""
    generator = torch.Generator().manual_seed(seed)
    losses = []
    previous_keep: Tensor | None = None  # (images, N0) bool, per stage
    previous_stage_grid: int | None = None
    previous_windowed = False
    for block, reducer in zip(locs, _reducers(model), strict=True):
        signal = signals[block]
        patches = signal.tokens.shape[1]
        # A windowed block, or one after it, starts afresh: a windowed block gives every token
        # back (and its rows are windows, not images: Hiera's windows of 16 tokens before a
        # plain stage of 16).
        fresh = block in windowed or previous_windowed
        previous_windowed = block in windowed
        if previous_keep is None or previous_stage_grid != patches or fresh:
            previous_keep = torch.ones(signal.attention.shape, dtype=torch.bool)
        target = _top_tokens(signal.attention, previous_keep, reducer.keep_tokens)
        losses.append(
            _fit(reducer.predictor, signal.tokens, previous_keep, target, steps, batch, generator)
        )
        previous_keep, previous_stage_grid = target, patches
    return losses


def _top_tokens(attention: Tensor, present: Tensor, keep_tokens: int) -> Tensor:
    """The ``keep_tokens`` best-attended of the tokens present, per image."""
    masked = attention.masked_fill(~present, float("-inf"))
    k = min(keep_tokens, int(present.sum(dim=1).min()))
    index = masked.topk(max(1, k), dim=1).indices
    return torch.zeros_like(present).scatter(1, index, True)


def _fit(
    predictor: ScorePredictor,
    tokens: Tensor,
    present: Tensor,
    target: Tensor,
    steps: int,
    batch: int,
    generator: torch.Generator,
) -> float:
    device = next(predictor.parameters()).device
    was_training = predictor.training
    predictor.train()
    optimizer = torch.optim.Adam(predictor.parameters(), lr=WARMUP_LR)
    loss = torch.zeros(())
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # Ops this small spend their time synchronising threads, badly so on a busy machine
        # (measured: 0.4 s a step on two threads under load, 0.01 s on one).
        torch.set_num_threads(1)
    try:
        for _ in range(steps):
            index = torch.randint(len(tokens), (min(batch, len(tokens)),), generator=generator)
            x = tokens[index].to(device, torch.float32)
            mask = present[index].to(device)
            log_probs = predictor(x, mask.float())  # (B, N0, 2); column 0: keep
            labels = (~target[index]).long().to(device)  # 0 keep, 1 drop
            per_token = F.nll_loss(log_probs.transpose(1, 2), labels, reduction="none")
            loss = (per_token * mask).sum() / mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
        predictor.train(was_training)
    return float(loss.detach())


def predictor_state(model: nn.Module) -> dict[str, Tensor]:
    """The predictors' weights, keyed by reducer index (what the warm-up cache stores)."""
    return {
        f"{i}.{name}": value.detach().cpu().clone()
        for i, reducer in enumerate(_reducers(model))
        for name, value in reducer.predictor.state_dict().items()
    }


def load_predictor_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    for i, reducer in enumerate(_reducers(model)):
        prefix = f"{i}."
        reducer.predictor.load_state_dict(
            {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        )


__all__ = [
    "WARMUP_BATCH",
    "WARMUP_STEPS",
    "BlockSignals",
    "block_signals",
    "keep_count",
    "load_predictor_state",
    "predictor_state",
    "warm_predictors",
]
