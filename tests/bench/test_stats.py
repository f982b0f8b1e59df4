"""Percentile math against numpy, the P99 confidence interval, and point statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.bench.decision import Verdict
from relaygr.bench.protocol import LatencyParts, RequestRecord, SystemSnapshot
from relaygr.bench.runner import RunResult
from relaygr.bench.stats import (
    LatencySummary,
    latency_parts,
    percentile,
    point_stats,
    quantile_ci_ranks,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=300),
       st.sampled_from([50.0, 90.0, 99.0, 99.9]))
def test_percentile_is_numpy_nearest_rank(values: list[float], q: float) -> None:
    arr = np.array(values)
    expected = np.percentile(arr, q, method="inverted_cdf")
    assert percentile(arr, q) == expected
    # nearest rank: the ceil(q n / 100)-th smallest sample
    assert expected == np.sort(arr)[math.ceil(q * len(arr) / 100) - 1]


def test_summary_counts_unserved_as_infinite() -> None:
    served = np.arange(1, 98) / 1e3  # 1..97 ms
    summary = LatencySummary.of(served, unserved=3)
    assert summary.count == 100 and summary.unserved == 3
    assert summary.p50_ms == pytest.approx(50.0)
    assert summary.p90_ms == pytest.approx(90.0)
    assert math.isinf(summary.p99_ms) and math.isinf(summary.max_ms)
    assert summary.mean_ms == pytest.approx(49.0)


def test_p99_interval_ranks() -> None:
    lo, hi = quantile_ci_ranks(2000, 0.99)
    assert (lo, hi) == (1971, 1989)  # sample percentiles 98.55 .. 99.45
    assert quantile_ci_ranks(300, 0.99)[1] is None  # too few to bound P99 from above
    assert quantile_ci_ranks(1000, 0.99) == (983, 997)
    for n in (100, 500, 1000, 5000):
        lo, hi = quantile_ci_ranks(n, 0.99)
        assert lo is not None and lo <= math.ceil(0.99 * n) <= (hi or n + 1)


def test_a_median_from_five_or_fewer_samples_has_no_bound() -> None:
    """The smallest of n samples lies above the median with probability 0.5^n: over 0.025
    up to n = 5, so no order statistic bounds it at 95 %; from n = 6 the extremes do."""
    for n in range(6):
        assert quantile_ci_ranks(n, 0.5) == (None, None)
    assert quantile_ci_ranks(6, 0.5) == (1, 6)
    assert quantile_ci_ranks(20, 0.5) == (6, 15)


def test_p99_interval_covers_the_true_quantile() -> None:
    rng = np.random.default_rng(0)
    n, trials = 2000, 400
    lo, hi = quantile_ci_ranks(n, 0.99)
    assert lo is not None and hi is not None
    samples = np.sort(rng.exponential(1.0, (trials, n)), axis=1)
    truth = -math.log(0.01)  # the exponential's 99th percentile
    covered = np.mean((samples[:, lo - 1] <= truth) & (truth <= samples[:, hi - 1]))
    assert 0.92 <= covered <= 0.99


def _record(i: int, path: str, latency_s: float, reason: str | None) -> RequestRecord:
    due = i + 0.05
    return RequestRecord(i, 100 + i, due, due + latency_s, due + latency_s + 0.001, path,
                         prefix_tokens=1000 + i, suffix_tokens=10, candidates=200,
                         preinfer_tokens=1000 if path != "full" else 0, trigger_reason=reason)


def test_point_stats_exact() -> None:
    paths = ["device_hit", "device_hit", "pending_wait", "host_hit", "full"]
    reasons = ["admitted", "admitted", "admitted", "host_hit", None]
    records = tuple(_record(i, p, 0.001 * (i + 1), r)
                    for i, (p, r) in enumerate(zip(paths, reasons, strict=True)))
    snaps = (SystemSnapshot(100, 5, {}), SystemSnapshot(300, 50, {}),
             SystemSnapshot(200, 40, {"hits": 3.0}))
    result = RunResult(records=records, measured=6, completed=5, dropped=1, failed=0,
                       timed_out=0, not_sent=0, errors={}, dispatch_lag_s=(0.0, 0.002),
                       snapshots=snaps, duration_s=5.0, stopped_early=False,
                       send_s={i: float(i) for i in range(6)})
    stats = point_stats(result, "relay", "sweep", qps=1.0, prefix_len=1000)
    assert stats.path_counts == {"device_hit": 2, "full": 1, "host_hit": 1, "pending_wait": 1}
    assert stats.trigger_reasons == {"admitted": 3, "host_hit": 1, "none": 1}
    assert stats.hit_rate_device == pytest.approx(3 / 5)
    assert stats.hit_rate_host == pytest.approx(1 / 5)
    assert stats.preinfer_tokens_per_request == pytest.approx(4000 / 5)
    assert stats.prefix_tokens_mean == pytest.approx(1002.0)
    assert (stats.device_bytes_peak, stats.host_bytes_peak) == (300, 50)
    assert (stats.device_bytes_end, stats.host_bytes_end) == (200, 40)
    assert stats.counters_end == {"hits": 3.0}
    assert stats.ranking.count == 6 and stats.ranking.unserved == 1
    assert stats.ranking.p50_ms == pytest.approx(3.0)
    # e2e from the scheduled send (i): 0.05 + latency + 0.001
    assert stats.e2e.p50_ms == pytest.approx(54.0)
    assert stats.dispatch_lag_max_ms == pytest.approx(2.0)
    assert math.isinf(stats.ranking.p99_ms)  # the dropped request is an infinite latency
    assert stats.decision is None and stats.verdict is Verdict.UNDECIDED   # judged by no SLO


def test_latency_parts_take_the_ranking_latency_apart() -> None:
    # 99 requests of 10 ms (1 lookup, 2 queue, 5 compute, 1 transport, 1 other) and one of
    # 100 ms that queued for 80: the slowest 1% of 100 is that one.
    def rec(i: int, latency_s: float, queue_s: float) -> RequestRecord:
        return RequestRecord(i, i, 0.0, latency_s, latency_s, "device_hit", 100, 4, 8, 0, None,
                             parts=LatencyParts(0.001, queue_s, 0.005, 0.001))

    records = [rec(i, 0.010, 0.002) for i in range(99)] + [rec(99, 0.100, 0.080)]
    records.append(RequestRecord(101, 101, 0.0, 0.5, 0.5, "full", 100, 4, 8, 0, None))  # no parts
    out = latency_parts(records)
    assert out["requests"] == 100 and out["tail_requests"] == 1
    assert out["tail_latency_mean_ms"] == pytest.approx(100.0)
    parts = out["parts"]
    assert isinstance(parts, dict)
    assert parts["queue"]["p50_ms"] == pytest.approx(2.0)
    assert parts["queue"]["tail_mean_ms"] == pytest.approx(80.0)
    assert parts["compute"]["mean_ms"] == pytest.approx(5.0)
    assert parts["other"]["p50_ms"] == pytest.approx(1.0)
    assert parts["other"]["tail_mean_ms"] == pytest.approx(13.0)
    assert parts["transport"]["p99_ms"] == pytest.approx(1.0)
    assert latency_parts(records[-1:]) == {}
