"""Smaller parts: the limit probe and report, config parsing, the candidate book, layouts and
JSON values."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from relaygr import timing
from relaygr.bench.config import BenchConfig, PointBudget, QpsSearchConfig, WorkloadPhaseConfig
from relaygr.bench.decision import P99Rule
from relaygr.bench.layout import Layout
from relaygr.bench.limit import (
    LIMIT_PACE_S,
    MIN_ISOLATED_PASSES,
    ModelLimitProbe,
    describe_overhead,
    isolated_passes,
    limit_report,
    median_interval,
)
from relaygr.bench.protocol import LatencyParts, RequestRecord, SystemSnapshot
from relaygr.bench.report import jsonable
from relaygr.bench.runner import RunResult
from relaygr.bench.stats import compute_by_path, latency_parts, point_stats
from relaygr.bench.systems import SharedParts
from relaygr.bench.workload import FixedLength, SyntheticConfig, SyntheticWorkload
from relaygr.cascade.config import StagesConfig, SystemConfig
from relaygr.cascade.instances import build_instance
from relaygr.cascade.proposals import EmbeddingRetrieval
from relaygr.cascade.stages import EarlierStages
from relaygr.engine.transport.processes import InstanceProcesses
from relaygr.errors import ConfigError
from relaygr.model import HSTU, HSTUConfig
from relaygr.model.flops import rank_flops
from tests.engine.helpers import flops_cost_model
from tests.model.helpers import make_model


def _assert_same(found: tuple[torch.Tensor, torch.Tensor] | None,
                 expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A book entry holds exactly the live stages' candidates and scores."""
    assert found is not None
    assert torch.equal(found[0], expected[0]) and torch.equal(found[1], expected[1])


def test_model_probe_times_cached_and_full_ranking() -> None:
    cfg = HSTUConfig(num_items=100, dim=16, num_layers=1, num_heads=2, max_seq_len=256)
    torch.manual_seed(0)
    probe = ModelLimitProbe(HSTU(cfg).eval(), full_repeats=2)
    cached = probe.cached_rank_samples_ms(prefix_tokens=64, suffix_tokens=4, candidates=8,
                                          passes=2)
    assert len(cached) == 2
    curve = probe.full_rank_samples_ms(prefix_tokens=64, suffix_tokens=4, candidates=8,
                                       passes=3)
    assert len(curve) == 3
    for ms in (*cached, *curve,
               probe.full_rank_ms(prefix_tokens=64, suffix_tokens=4, candidates=8),
               probe.full_rank_ms(prefix_tokens=64, suffix_tokens=0, candidates=8)):
        assert ms > 0 and math.isfinite(ms)  # a timing; how fast is this machine's business


def test_the_limit_probe_times_each_cached_pass_after_an_idle_gap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(timing.time, "sleep", slept.append)   # recorded, not waited
    cfg = HSTUConfig(num_items=100, dim=16, num_layers=1, num_heads=2, max_seq_len=256)
    model = HSTU(cfg).eval()
    ModelLimitProbe(model).cached_rank_samples_ms(prefix_tokens=32, suffix_tokens=2,
                                                  candidates=8, passes=3)
    assert slept == [LIMIT_PACE_S] * 3             # before each timed pass, none in warm-up
    slept.clear()
    probe = ModelLimitProbe(model, full_repeats=2, pace_s=0.0)
    probe.cached_rank_samples_ms(prefix_tokens=32, suffix_tokens=2, candidates=8, passes=3)
    probe.full_rank_ms(prefix_tokens=32, suffix_tokens=2, candidates=8)
    probe.full_rank_samples_ms(prefix_tokens=32, suffix_tokens=2, candidates=8, passes=2)
    assert slept == []                              # back to back, and the cost curve always


def _low_load_point() -> RunResult:
    records = tuple(RequestRecord(i, i, 0.0, 0.002 + 0.001 * i, 0.01, "device_hit", 100, 4, 8,
                                  100, "admitted") for i in range(5))
    return RunResult(records, 5, 5, 0, 0, 0, 0, {}, (0.0,), (SystemSnapshot(),), 1.0, False,
                     {i: 0.0 for i in range(5)})


class Probe:
    def cached_rank_samples_ms(self, prefix_tokens: int, suffix_tokens: int, candidates: int,
                               passes: int) -> list[float]:
        return [2.0] * 5


def test_limit_report_math() -> None:
    stats = point_stats(_low_load_point(), "relay", "limit", 1.0, 100)
    cfg = HSTUConfig(num_items=100, dim=16, num_layers=1, num_heads=2)
    report = limit_report(stats, Probe(), cfg, peak_gflops=50.0, prefix_len=100,
                          suffix_tokens=4, candidates=8)
    assert report.low_load_p50_ms == pytest.approx(4.0)  # median of 2..6 ms
    assert report.relay_overhead_ratio == pytest.approx(2.0)
    flops = rank_flops(cfg, 8, 100, 4, cached=True)
    assert report.achieved_gflops == pytest.approx(flops / 2e-3 / 1e9)
    assert report.achieved_gflops is not None
    assert report.achieved_fraction_of_peak == pytest.approx(report.achieved_gflops / 50.0)
    bare = limit_report(stats, None, None, None, 100, 4, 8)
    assert bare.cached_rank_ms_isolated is None and bare.relay_overhead_ratio is None
    # no request took the relay path: full passes say nothing of the relay's overhead
    full = RunResult(tuple(replace(r, path="full") for r in _low_load_point().records),
                     5, 5, 0, 0, 0, 0, {}, (0.0,), (SystemSnapshot(),), 1.0, False,
                     {i: 0.0 for i in range(5)})
    unrelayed = limit_report(point_stats(full, "relay", "limit", 1.0, 100), Probe(), cfg,
                             peak_gflops=50.0, prefix_len=100, suffix_tokens=4, candidates=8)
    assert unrelayed.low_load_p50_ms == pytest.approx(4.0)
    assert unrelayed.relay_overhead_ratio is None and unrelayed.relay_overhead_low is None
    assert describe_overhead(report) is None          # the system reported no parts


def test_the_overhead_is_taken_apart_over_the_relayed_requests() -> None:
    """Each relayed request: lookup 0.5, queue 1, compute 2.5, transport 1 ms, 6 ms in all
    (1 ms other); the request that took the full pass is not in the account."""
    parts = LatencyParts(0.5e-3, 1e-3, 2.5e-3, 1e-3)
    records = tuple(RequestRecord(i, i, 0.0, 0.006, 0.01, "device_hit" if i else "full", 100,
                                  4, 8, 100, "admitted", parts=parts) for i in range(5))
    run = RunResult(records, 5, 5, 0, 0, 0, 0, {}, (0.0,),
                    (SystemSnapshot(counters={"reload_copies": 2.0}),), 1.0, False,
                    {i: 0.0 for i in range(5)})
    stats = point_stats(run, "relay", "limit", 1.0, 100)
    relayed = latency_parts([r for r in records if r.path != "full"])
    report = limit_report(stats, Probe(), None, None, 100, 4, 8, relayed)
    assert report.ranking_parts["requests"] == 4
    assert report.path_counts == {"device_hit": 4, "full": 1} and report.reload_copies == 2.0
    text = describe_overhead(report)
    assert text is not None
    assert text.startswith("overhead taken apart (means over 4 relayed requests, ms): "
                           "latency 6.00 = compute 2.50 (the pass alone 2.00, +0.50) + "
                           "hand-over to ranking (late send, stage timer, front end) 0.00 + hop "
                           "to the instance and back 1.00 + lookup (waiting for a pre-infer or "
                           "reload still running) 0.50 + queueing 1.00 + routing and hand-offs "
                           "1.00")
    assert text.endswith("paths: device_hit 4, full 1; reloads from host 2")


def test_the_compute_is_split_by_path() -> None:
    """Where an overhead inside the instance comes from: a prefix reloaded from host memory
    ranked at 4 ms against 2 ms for one resident since its pre-inference."""
    def record(i: int, path: str, compute_s: float) -> RequestRecord:
        parts = LatencyParts(0.0, 0.0, compute_s, 0.0)
        return RequestRecord(i, i, 0.0, 0.006, 0.01, path, 100, 4, 8, 100, "admitted",
                             parts=parts)

    records = [record(0, "device_hit", 2e-3), record(1, "device_hit", 2e-3),
               record(2, "device_hit", 5e-3), record(3, "host_hit", 4e-3),
               RequestRecord(4, 4, 0.0, 0.006, 0.01, "host_hit", 100, 4, 8, 100, "admitted")]
    split = compute_by_path(records)      # the record without parts is not counted
    assert split == {"device_hit": {"requests": 3.0, "p50_ms": pytest.approx(2.0),
                                    "mean_ms": pytest.approx(3.0)},
                     "host_hit": {"requests": 1.0, "p50_ms": pytest.approx(4.0),
                                  "mean_ms": pytest.approx(4.0)}}
    run = RunResult(tuple(records), 5, 5, 0, 0, 0, 0, {}, (0.0,), (), 1.0, False,
                    {i: 0.0 for i in range(5)})
    stats = point_stats(run, "relay", "limit", 1.0, 100)
    report = limit_report(stats, Probe(), None, None, 100, 4, 8, latency_parts(records),
                          split)
    text = describe_overhead(report)
    assert text is not None and text.endswith(
        "compute P50 / mean by path: device_hit 2.00 / 3.00 (3); host_hit 4.00 / 4.00 (1)")


def test_bench_config_parsing() -> None:
    cfg = BenchConfig.from_dict({
        "slo_ms": 80.0, "budget": {"measured_requests": 500, "min_measured_requests": 100},
        "sweep": {"lengths": [256, 512], "qps": 3.0},
        "throughput": {"prefix_len": 1024, "search": {"start_qps": 4.0}},
        "mixed": {"source": "dlrmv3", "params": {"scale": 0.125}},
        "population": {"num_users": 100}, "exactness": None,
        "model": {"num_items": 10, "dim": 8, "num_layers": 1, "num_heads": 2}})
    assert cfg.sweep is not None and cfg.sweep.lengths == (256, 512)
    assert cfg.throughput is not None and cfg.throughput.search == QpsSearchConfig(start_qps=4.0)
    assert cfg.exactness is None and cfg.population.num_users == 100
    assert cfg.model is not None and cfg.model.dim == 8
    for bad, says in (
            ({"slo": 1.0}, "unknown BenchConfig keys: ['slo']"),
            ({"sweep": {"length": [1]}}, "unknown BenchConfig.sweep keys: ['length']"),
            ({"slo_ms": -1.0}, "slo_ms must be > 0"),
            ({"throughput": {"search": {"start": 1.0}}},
             "unknown BenchConfig.throughput.search keys: ['start']"),
            ({"throughput": {"lengths": {"growth": 0.5}}},
             "BenchConfig.throughput.lengths: LengthSearch needs growth > 1"),
            ({"workloads": [{"name": "w", "source": "ml1m", "mode": ["relay"]}]},
             "unknown BenchConfig.workloads.0 keys: ['mode']"),
            ({"population": {"prefix_len": {"kind": "fixed", "tokens": "many"}}},
             "BenchConfig.population.prefix_len.tokens: Input should be a valid integer")):
        with pytest.raises(ConfigError) as caught:
            BenchConfig.from_dict(bad)
        assert says in str(caught.value)
    phases = BenchConfig.from_dict({"workloads": [{"name": "w", "source": "ml1m",
                                                   "modes": ["relay"]}]}).workloads
    assert phases == (WorkloadPhaseConfig("w", "ml1m", modes=("relay",)),)
    with pytest.raises(ConfigError):
        PointBudget(measured_requests=10, min_measured_requests=20)


def test_point_budget_scales_with_qps() -> None:
    budget = PointBudget()  # 1,000..2,000 measured, 60 s per point
    assert [budget.measured_at(q) for q in (1.0, 20.0, 100.0)] == [1000, 1200, 2000]
    quick = BenchConfig.quick().budget
    assert [quick.measured_at(q) for q in (1.0, 20.0, 100.0)] == [230, 230, 256]
    # both can pass a point: enough requests for the sequential rule at their confidence
    for b in (budget, quick):
        rule = P99Rule(b.confidence).sequential(b.measured_requests)
        assert rule.min_samples_to_pass() <= b.min_measured_requests
    # warm-up: at least 25 requests and at least 2 s of the schedule
    timed = PointBudget(warmup_requests=25, warmup_s=2.0)
    assert [timed.warmup_at(q) for q in (4.0, 12.5, 48.0, 48.1)] == [25, 25, 96, 97]
    with pytest.raises(ConfigError, match="warmup_s"):
        PointBudget(warmup_s=-1.0)
    with pytest.raises(ConfigError, match="confidence"):
        PointBudget(confidence=1.0)
    with pytest.raises(ConfigError, match="remeasure_slowdown"):
        PointBudget(remeasure_slowdown=0.9)


def test_jsonable() -> None:
    value = {"a": (1, math.inf, float("nan")), 2: SystemSnapshot(1, 2, {"x": 1.0})}
    assert jsonable(value) == {"a": [1, None, None],
                               "2": {"device_bytes_in_use": 1, "host_bytes_in_use": 2,
                                     "counters": {"x": 1.0}}}


def test_the_book_holds_every_visit_as_the_cascade_will_see_it() -> None:
    num_items = 300
    model = make_model(0, num_items=num_items)
    parts = SharedParts(model, flops_cost_model(model.cfg),
                        EmbeddingRetrieval.of(model, 8, recency=1.0))
    population = SyntheticConfig(num_users=20, num_items=num_items, num_candidates=16,
                                 prefix_len=FixedLength(40), short_gap_share=1.0,
                                 short_gap_mean_s=0.5)
    workload = SyntheticWorkload(population, seed=3).build(qps=20.0, num_requests=60)
    system = SystemConfig(stages=StagesConfig(num_candidates=16, retrieval_k=48,
                                               retrieval_history=8))
    book = parts.book_for(workload, system)
    assert parts.book_for(workload, system) is book          # once per workload
    stages = EarlierStages(parts.retrieval, 48, 0.0, 0.0)
    grown = {u: h.items for u, h in workload.histories.items()}
    previous: dict[int, tuple[float, np.ndarray]] = {}   # user -> (send, history before it)
    races = 0
    for r in workload.requests:
        recent = np.asarray(r.recent_items, dtype=np.int64)
        seen = np.concatenate([grown[r.user_id], recent])
        _assert_same(book.get(r.user_id, seen, 16), stages.candidates(seen, 16))
        last = previous.get(r.user_id)
        if last is not None and r.send_s - last[0] < 2.0:   # may overtake the last append
            races += 1
            early = np.concatenate([last[1], recent])
            _assert_same(book.get(r.user_id, early, 16), stages.candidates(early, 16))
        previous[r.user_id] = (r.send_s, grown[r.user_id])
        grown[r.user_id] = seen
    stages.shutdown()
    assert races > 0


def test_the_parts_place_instances_on_a_layout() -> None:
    """The serving layout is the parts' own processes; another gets processes of its own (not
    started until an instance opens on them), kept for the run and ended by ``close``;
    instances on threads of this process have no layout to choose."""
    model = make_model(0, num_items=50)
    cost_model = flops_cost_model(model.cfg)
    retrieval = EmbeddingRetrieval.of(model, 8, recency=1.0)
    with pytest.raises(ConfigError):
        SharedParts(model, cost_model, retrieval).processes_on(Layout(1, 2))
    own = InstanceProcesses.for_model(model, cost_model, 2, torch_threads=1,
                                      build=build_instance)
    parts = SharedParts(model, cost_model, retrieval, own)
    assert parts.processes_on(Layout(2, 1)) is own
    other = parts.processes_on(Layout(1, 2))
    assert (other.num_processes, other.spec.torch_threads) == (1, 2)
    assert parts.processes_on(Layout(1, 2)) is other and other.pids() == [None]
    parts.close()
    assert parts.processes_on(Layout(1, 2)) is not other    # ended: a new one on next use
    parts.close()


def test_the_overhead_ratio_comes_with_its_medians_order_statistic_interval() -> None:
    # 20 relayed latencies 10.0..10.95 ms and 25 isolated passes 8.0..9.2 ms: each median's 95%
    # interval is its 6th-15th (of 20) and 8th-18th (of 25) smallest samples, and the ratio's
    # ends divide them crosswise.
    lat = [10.0 + 0.05 * i for i in range(20)]
    passes = [8.0 + 0.05 * i for i in range(25)]
    assert median_interval(lat) == (lat[5], lat[14])
    assert median_interval(passes) == (passes[7], passes[17])
    assert median_interval([]) is None
    two = median_interval([1.0, 2.0])
    assert two is not None and two[1] == math.inf            # two samples bound nothing above

    class Passes:
        def cached_rank_samples_ms(self, prefix_tokens: int, suffix_tokens: int,
                                   candidates: int, count: int) -> list[float]:
            assert count == len(passes)
            return list(reversed(passes))

    stats = point_stats(_low_load_point(), "relay", "limit", 1.0, 100)
    report = limit_report(stats, Passes(), None, None, 100, 4, 8, relayed_latencies_ms=lat)
    assert report.cached_rank_ms_isolated == pytest.approx(8.6)
    assert report.isolated_passes == 25
    assert report.relay_overhead_low == pytest.approx(lat[5] / passes[17])
    assert report.relay_overhead_high == pytest.approx(lat[14] / passes[7])
    no_latencies = limit_report(stats, Passes(), None, None, 100, 4, 8)
    assert no_latencies.relay_overhead_low is None and no_latencies.relay_overhead_high is None


def test_the_pass_alone_is_timed_as_often_as_the_limit_point_has_relayed_requests() -> None:
    """The quick plan's 20 relayed requests meet the floor of 25 passes; the full plan's 100
    are met by 100, and over the same spread of pass times the interval then narrows."""
    assert isolated_passes(20) == MIN_ISOLATED_PASSES == 25
    assert isolated_passes(100) == 100
    lat = [10.0 + 0.01 * i for i in range(100)]

    class Passes:                # as many passes as asked for, spread evenly over 8..10 ms
        def cached_rank_samples_ms(self, prefix_tokens: int, suffix_tokens: int,
                                   candidates: int, passes: int) -> list[float]:
            return [8.0 + 2.0 * i / (passes - 1) for i in range(passes)]

    def interval(count: int) -> tuple[float, float]:
        stats = point_stats(_low_load_point(), "relay", "limit", 1.0, 100)
        report = limit_report(stats, Passes(), None, None, 100, 4, 8, relayed_latencies_ms=lat,
                              passes=count)
        assert report.isolated_passes == count
        assert report.relay_overhead_low is not None and report.relay_overhead_high is not None
        return report.relay_overhead_low, report.relay_overhead_high

    low25, high25 = interval(isolated_passes(20))
    low100, high100 = interval(isolated_passes(100))
    assert low25 < low100 < high100 < high25
