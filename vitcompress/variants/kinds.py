"""The two kinds of variant the TPS paper builds on, shared by their registered instances.

- :class:`PredictorVariant`: a learned predictor BEFORE a block (DynamicViT, dTPS); in training
  every token stays under a straight-through keep mask, at inference ``int(N0 * rho**s)`` are kept.
- :class:`AttentionScoredVariant`: scored by the block's own attention, INSIDE the block after the
  attention residual add (EViT, eTPS); ``ceil(rho * n)`` of the tokens present are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from vitcompress.modules.reducers import AttentionReducer, PredictorReducer
from vitcompress.variants.base import (
    AFTER_ATTENTION,
    ATTENTION_GIVES_NOTHING,
    ATTENTION_GIVES_SCORE,
    BEFORE_BLOCK,
    COUNT_OF_INITIAL,
    COUNT_OF_PRESENT,
    Block,
    Location,
    Plan,
    Variant,
)


@dataclass(frozen=True, kw_only=True)
class PredictorVariant(Variant):
    placement: str = BEFORE_BLOCK
    scorer: str = "predictor"
    learned: bool = True
    keep_count: str = COUNT_OF_INITIAL
    resorts_tokens: bool = True  # sorted by predicted score even when all are kept
    attention_gives: str = ATTENTION_GIVES_NOTHING

    def build_reducer(self, block: Block, location: Location, plan: Plan) -> nn.Module:
        return PredictorReducer(
            dim=block.dim,
            prefix_tokens=block.prefix_tokens,
            keep_tokens=location.keep_tokens,
            keep_ratio=location.cumulative_keep,
            squeeze=self.fuse == "squeeze",
            policy=plan.policy,
        )


@dataclass(frozen=True, kw_only=True)
class AttentionScoredVariant(Variant):
    placement: str = AFTER_ATTENTION
    scorer: str = "attention"
    learned: bool = False
    keep_count: str = COUNT_OF_PRESENT
    resorts_tokens: bool = False  # keep 1 returns the tokens as they came
    attention_gives: str = ATTENTION_GIVES_SCORE

    def build_reducer(self, block: Block, location: Location, plan: Plan) -> nn.Module:
        return AttentionReducer(
            prefix_tokens=block.prefix_tokens,
            keep_ratio=location.keep,
            fuse=self.fuse,
            policy=plan.policy,
        )
