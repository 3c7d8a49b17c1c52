"""The two kinds of variant the TPS paper builds on, shared by their registered instances.

- :class:`PredictorVariant`: a learned predictor BEFORE a block (DynamicViT, dTPS); in training
  every token stays under a straight-through keep mask, at inference ``int(N0 * rho**s)`` are kept.
- :class:`AttentionScoredVariant`: scored by the block's own attention, INSIDE the block after the
  attention residual add (EViT, eTPS); ``ceil(rho * n)`` of the tokens present are kept.

Each takes its fuse (``variants/fuses.py``): squeezed into hosts (TPS), dropped, or one token.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from vitcompress.modules.reducers import AttentionReducer, PredictorReducer
from vitcompress.variants.base import Block, Location, Plan, Variant
from vitcompress.variants.scorers import AttentionScorer, PredictorScorer, Scorer


@dataclass(frozen=True, kw_only=True)
class PredictorVariant(Variant):
    scorer: Scorer = PredictorScorer()
    resorts_tokens: bool = True  # sorted by predicted score even when all are kept

    def build_reducer(self, block: Block, location: Location, plan: Plan) -> nn.Module:
        # The static count kept, and the cumulative fraction of N0 the ratio loss aims at.
        counts = (location.keep_tokens, location.cumulative_keep)
        # Padded windows are reduced group by group, each keeping its share of its tokens.
        padded = block.windows is not None and block.windows.padded
        share = location.keep if padded else None
        return PredictorReducer(
            block.dim, block.prefix_tokens, *counts, self.fuse, plan.policy, window_share=share
        )


@dataclass(frozen=True, kw_only=True)
class AttentionScoredVariant(Variant):
    scorer: Scorer = AttentionScorer()
    resorts_tokens: bool = False  # keep 1 returns the tokens as they came

    def build_reducer(self, block: Block, location: Location, plan: Plan) -> nn.Module:
        # ceil(keep * n) of the tokens present at run time.
        return AttentionReducer(block.prefix_tokens, location.keep, self.fuse, plan.policy)
