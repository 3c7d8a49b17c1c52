"""Honest measurement of models: parameters, MACs in the papers' convention, and throughput."""

from .cuda_graphs import CudaGraphed, GraphCaptureError, replay_agrees
from .macs import SDPA_OPS_REGISTERED, count_macs, macs_by_module
from .paired import PairedRatio, bootstrap_median_ci, paired_ratio, paired_ratios, verdict
from .params import count_params
from .throughput import (
    ModelThroughput,
    RoundProgress,
    ThroughputReport,
    environment,
    load_average,
    measure_callables,
    measure_throughput,
)

__all__ = [
    "SDPA_OPS_REGISTERED",
    "CudaGraphed",
    "GraphCaptureError",
    "ModelThroughput",
    "PairedRatio",
    "RoundProgress",
    "ThroughputReport",
    "bootstrap_median_ci",
    "count_macs",
    "count_params",
    "environment",
    "load_average",
    "macs_by_module",
    "measure_callables",
    "measure_throughput",
    "paired_ratio",
    "paired_ratios",
    "replay_agrees",
    "verdict",
]
