"""The modules a compression plan inserts into a captured graph."""

from vitcompress.modules.attention import MHAHook, SDPAHook, SoftmaxHook
from vitcompress.modules.predictor import ScorePredictor
from vitcompress.modules.reducers import AttentionReducer, MergeReducer, PredictorReducer

__all__ = [
    "AttentionReducer",
    "MHAHook",
    "MergeReducer",
    "PredictorReducer",
    "SDPAHook",
    "ScorePredictor",
    "SoftmaxHook",
]
