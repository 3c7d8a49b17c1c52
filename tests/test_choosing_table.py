"""The seeded comparison's statistics (benchmarks/seed_stats.py) and its table's grouping and
verdicts (benchmarks/choosing_table.py), on runs written here."""

from __future__ import annotations

import importlib
import json
import math
import statistics
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


sys.path.insert(0, str(BENCHMARKS))  # the scripts import their neighbours by name
stats = importlib.import_module("seed_stats")
table = importlib.import_module("choosing_table")


@pytest.mark.parametrize(
    "df, expected",
    # Student's t, 0.975 quantile, from printed tables.
    [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423), (1000, 1.9623)],
)
def test_t_quantile_matches_the_printed_table(df, expected):
    assert stats.t_quantile(0.975, df) == pytest.approx(expected, abs=1e-4)


def test_t_quantile_at_fractional_df_lies_between_its_integer_neighbours():
    q = stats.t_quantile(0.975, 2.5)
    assert stats.t_quantile(0.975, 3) < q < stats.t_quantile(0.975, 2)
    # And the CDF inverts it.
    assert stats.t_cdf(q, 2.5) == pytest.approx(0.975, abs=1e-12)


def test_mean_interval_is_the_student_interval():
    estimate = stats.mean_interval([1.0, 2.0, 3.0])
    half = 4.302653 * 1.0 / math.sqrt(3)
    assert estimate.mean == pytest.approx(2.0)
    assert (estimate.low, estimate.high) == pytest.approx((2.0 - half, 2.0 + half), abs=1e-5)
    one = stats.mean_interval([5.0])
    assert (one.low, one.high, one.n) == (5.0, 5.0, 1)


def test_a_difference_of_two_groups_is_welchs():
    a, b = [88.1, 88.6, 88.9, 88.4], [87.2, 88.0, 88.5]
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    df = (va + vb) ** 2 / (va**2 / 3 + vb**2 / 2)  # Welch-Satterthwaite
    half = stats.t_quantile(0.975, df) * math.sqrt(va + vb)
    estimate = stats.combination_interval([(1.0, a), (-1.0, b)])  # Welch's a - b
    mean = statistics.fmean(a) - statistics.fmean(b)
    assert (estimate.mean, estimate.low, estimate.high) == pytest.approx(
        (mean, mean - half, mean + half)
    )
    scipy_stats = pytest.importorskip("scipy.stats")
    reference = scipy_stats.ttest_ind(a, b, equal_var=False).confidence_interval()
    assert (estimate.low, estimate.high) == pytest.approx((reference.low, reference.high))


def _write_runs(runs_dir: Path, values: dict[tuple[str, float], list[tuple[float, float]]]):
    """One JSON per seed: (top-1 after fine-tuning, top-1 under a random policy)."""
    runs_dir.mkdir(parents=True, exist_ok=True)
    for (method, keep), seeds in values.items():
        for seed, (top1, random_top1) in enumerate(seeds):
            run = {
                "method": method,
                "keep": keep,
                "seed": seed,
                "top1_before": 70.0,
                "top1": top1,
                "top1_random": random_top1,
                "macs": 100,
                "params": 10,
                "base_sha256": "abc",
            }
            (runs_dir / f"{method}_keep{keep}_seed{seed}.json").write_text(json.dumps(run))


def test_verdicts_follow_the_intervals(tmp_path):
    runs = tmp_path / "runs"
    _write_runs(
        runs,
        {
            # dTPS clearly ahead at 0.7, ahead by more at 0.5; its random drop smaller.
            ("dtps", 0.7): [(88.0, 87.0), (88.1, 87.1), (88.2, 87.2)],
            ("dynamicvit", 0.7): [(87.0, 83.0), (87.1, 83.1), (87.2, 83.2)],
            ("dtps", 0.5): [(86.0, 84.0), (86.1, 84.1), (86.2, 84.2)],
            ("dynamicvit", 0.5): [(84.0, 75.0), (84.1, 75.1), (84.2, 75.2)],
            # eTPS clearly behind at 0.7; a tie at 0.5.
            ("etps", 0.7): [(86.0, 85.0), (86.1, 85.1), (86.2, 85.2)],
            ("evit", 0.7): [(87.0, 86.0), (87.1, 86.1), (87.2, 86.2)],
            ("etps", 0.5): [(85.0, 84.0), (86.0, 84.0), (87.0, 85.0)],
            ("evit", 0.5): [(86.1, 85.0), (85.0, 84.0), (86.9, 84.0)],
        },
    )
    # Another base's run and a run with extra settings are not grouped with these.
    (runs / "dtps_keep0.7_seed3.json").write_text(
        json.dumps(
            {
                **json.loads((runs / "dtps_keep0.7_seed0.json").read_text()),
                "seed": 3,
                "top1": 10.0,
                "base_sha256": "other",
            }
        )
    )
    (runs / "dtps_keep0.7_window_sizesTrue_seed0.json").write_text("{}")
    groups = table.collect_runs(runs, "abc")
    assert [run["seed"] for run in groups[("dtps", 0.7)]] == [0, 1, 2]

    verdicts = {(c["claim"], c["keep"]): c for c in table.claims(groups)}
    assert verdicts[("dtps > dynamicvit, top-1 after fine-tuning", 0.7)]["verdict"] == "held"
    widening = verdicts[("dtps - dynamicvit widens from keep 0.7 to 0.5", "0.5 vs 0.7")]
    assert widening["difference"].mean == pytest.approx(1.0)
    assert widening["verdict"] == "held"
    smaller_drop = verdicts[("dtps drops less than dynamicvit under a random policy", 0.5)]
    assert smaller_drop["difference"].mean == pytest.approx(2.0 - 9.0)
    assert smaller_drop["verdict"] == "held"
    assert verdicts[("etps > evit, top-1 after fine-tuning", 0.7)]["verdict"] == "contradicted"
    assert verdicts[("etps > evit, top-1 after fine-tuning", 0.5)]["verdict"] == "not shown"
    # The widening is the paper's claim for dTPS only.
    assert not any("etps - evit widens" in claim for claim, _ in verdicts)


def test_one_seed_is_not_judged(tmp_path):
    _write_runs(
        tmp_path / "runs",
        {("etps", 0.7): [(89.0, 88.0)], ("evit", 0.7): [(80.0, 79.0)]},
    )
    groups = table.collect_runs(tmp_path / "runs", "abc")
    (claim,) = [c for c in table.claims(groups) if c["claim"].startswith("etps > evit")]
    assert claim["verdict"] == "one seed: not judged"
    rows = table.summarise(groups)
    assert [row["method"] for row in rows] == ["evit", "etps"]
    assert rows[1]["random_drop"].mean == pytest.approx(1.0)
