"""The search-proxy benchmark's statistics (benchmarks/search_proxy.py): Spearman's rank
correlation and its bootstrap interval over the fine-tuned configurations."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load_script():
    sys.path.insert(0, str(BENCHMARKS))  # it imports fashion_mnist_repro beside it
    spec = importlib.util.spec_from_file_location("search_proxy", BENCHMARKS / "search_proxy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


proxy = _load_script()


def test_spearman_is_one_for_any_monotone_map_and_minus_one_reversed():
    x = [0.3, -1.0, 2.5, 0.9, 4.0]
    assert proxy.spearman(x, [v**3 + 7 for v in x]) == pytest.approx(1.0)
    assert proxy.spearman(x, [-v for v in x]) == pytest.approx(-1.0)


def test_the_interval_holds_the_estimate_and_narrows_with_more_configurations():
    generator = random.Random(0)

    def sample(n):
        x = [generator.random() for _ in range(n)]
        return x, [v + 0.3 * generator.random() for v in x]

    few, many = sample(10), sample(200)
    low, high = proxy.spearman_interval(*few, draws=2000)
    assert low <= proxy.spearman(*few) <= high and -1.0 - 1e-9 <= low and high <= 1.0 + 1e-9
    low_many, high_many = proxy.spearman_interval(*many, draws=2000)
    assert high_many - low_many < high - low


def test_summarise_reads_a_finished_run_per_variant(tmp_path):
    rows = [
        {"variant": "etps", "score": s, "top1": t}
        for s, t in [(-0.1, 87.0), (-0.2, 86.0), (-0.3, 85.5), (-0.4, 85.0)]
    ] + [
        {"variant": "dtps", "score": s, "top1": t}
        for s, t in [(-0.1, 85.0), (-0.2, 86.0), (-0.3, 86.5), (-0.4, 87.0)]
    ]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"results": rows}))
    summary = proxy.summarise(path)
    assert summary["etps"]["spearman"] == pytest.approx(1.0)
    assert summary["dtps"]["spearman"] == pytest.approx(-1.0)
    assert summary["all"]["configs"] == 8 and len(summary["all"]["ci95"]) == 2


def test_spearman_interval_of_tied_accuracies_is_undefined_not_endless():
    # A short fine-tune on random images can leave every proxy accuracy equal: no resampled
    # draw has a correlation, and the interval must say so rather than draw for ever.
    low, high = proxy.spearman_interval([0.1, 0.4, 0.2, 0.9], [50.0] * 4)
    assert math.isnan(low) and math.isnan(high)
