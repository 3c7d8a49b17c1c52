"""Honest measurement of models: parameters, MACs in the papers' convention, and throughput."""

from .macs import SDPA_OPS_REGISTERED, count_macs, macs_by_module
from .params import count_params
from .throughput import ModelThroughput, ThroughputReport, environment, measure_throughput

__all__ = [
    "SDPA_OPS_REGISTERED",
    "ModelThroughput",
    "ThroughputReport",
    "count_macs",
    "count_params",
    "environment",
    "macs_by_module",
    "measure_throughput",
]
