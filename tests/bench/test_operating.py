"""The fixed-length operating point on simulated cost curves (no clock: the curves are
functions of the length): a slow and a fast machine choose different lengths, each where the
baseline's full pass takes the stated share of the SLO; the bounds; the plan's account of it."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from relaygr.bench.benchmark import run_benchmark
from relaygr.bench.config import BenchConfig, SweepConfig, ThroughputConfig
from relaygr.bench.cost_curve import LengthSearch, find_operating_length
from relaygr.bench.decision import Verdict
from relaygr.bench.layout import Layout
from relaygr.bench.operating import CostProbe, operating_point
from relaygr.bench.protocol import SystemContext
from relaygr.bench.report import BenchReport
from relaygr.bench.search import LengthSweep, LengthSweepResult, Outcome
from relaygr.bench.suite import BenchSuite, baseline_length_cap
from relaygr.errors import ConfigError
from tests.bench.fakes import SimulatedServer
from tests.bench.simulated_plan import (
    CONFIG,
    SERVICE,
    CurveProbe,
    LayoutCurveProbe,
    factory,
    simulated_baseline_ms,
)
from tests.virtual_time import run_virtual

SLO_MS, SHARE = 50.0, 0.5
SEARCH = LengthSearch(start_tokens=256, min_tokens=32, max_tokens=16384)


def slow_ms(tokens: int) -> float:
    """A slow CPU: a fixed cost plus linear and quadratic (attention) terms."""
    return 4.0 + 0.03 * tokens + 4e-6 * tokens ** 2


def fast_ms(tokens: int) -> float:
    """The same model on a machine ten times faster."""
    return slow_ms(tokens) / 10


def test_a_slow_and_a_fast_machine_choose_different_lengths_at_the_same_share() -> None:
    points = {name: operating_point(CurveProbe(curve), SLO_MS, SHARE, 16, 256, SEARCH,
                                    {"instances": 2})
              for name, curve in (("slow", slow_ms), ("fast", fast_ms))}
    slow, fast = points["slow"], points["fast"]
    assert slow.prefix_len < fast.prefix_len
    for point, curve in ((slow, slow_ms), (fast, fast_ms)):
        assert point.bound == "bracketed" and point.target_ms == SHARE * SLO_MS
        assert point.prefix_len % SEARCH.quantum_tokens == 0
        # the stated share, within the search's tolerance
        assert point.cost_ms == curve(point.prefix_len)
        assert abs(point.cost_ms - point.target_ms) <= SEARCH.tolerance * point.target_ms
        assert point.share == pytest.approx(point.cost_ms / SLO_MS)
        assert point.curve[0].prefix_tokens == 256
        assert len(point.curve) <= 1 + 7 + SEARCH.max_refinements
        assert point.serving == {"instances": 2}
        assert f"{point.prefix_len} prefix tokens" in point.reason
    # the exact roots: 4 + 0.03 L + 4e-6 L^2 = 25 at L = 644.6 (slow), = 250 at 4,942.7 (fast);
    # a cost within 5% of the target is within 5% / (d log cost / d log L >= 1) of the root
    assert slow.prefix_len == pytest.approx(644.6, rel=SEARCH.tolerance)
    assert fast.prefix_len == pytest.approx(4942.7, rel=SEARCH.tolerance)


def test_the_ends_of_the_curve() -> None:
    """Under the target up to the longest length: the longest; over it at the shortest: the
    shortest; the bound says which."""
    chosen, bound, curve = find_operating_length(lambda t: 1.0, 25.0, SEARCH)
    assert (chosen.prefix_tokens, bound) == (16384, "longest")
    assert [s.prefix_tokens for s in curve] == [256, 512, 1024, 2048, 4096, 8192, 16384]
    chosen, bound, _ = find_operating_length(lambda t: 100.0, 25.0, SEARCH)
    assert (chosen.prefix_tokens, bound) == (32, "shortest")
    point = operating_point(CurveProbe(lambda t: 1.0), SLO_MS, SHARE, 16, 256, SEARCH)
    assert "under the target up to the longest length" in point.reason


def test_the_length_is_read_off_the_passs_p99_not_its_median() -> None:
    """The SLO bounds a P99, so the share is of the pass's P99: where the slowest 20 % of
    passes cost 1.6x the rest, the length is where 1.6x the pass takes the target, shorter
    than without a tail; the median is kept beside it (the batch curve's first call)."""
    steady = operating_point(CurveProbe(slow_ms), SLO_MS, SHARE, 16, 256, SEARCH)
    probe = CurveProbe(slow_ms, tail_ratio=1.6, tail_share=0.2)
    tailed = operating_point(probe, SLO_MS, SHARE, 16, 256, SEARCH)
    assert tailed.prefix_len < steady.prefix_len
    assert tailed.cost_ms == pytest.approx(1.6 * slow_ms(tailed.prefix_len))
    assert abs(tailed.cost_ms - tailed.target_ms) <= SEARCH.tolerance * tailed.target_ms
    assert tailed.median_ms == pytest.approx(slow_ms(tailed.prefix_len))
    assert probe.sample_runs == [100] * len(tailed.curve)      # every length: 100 passes
    assert tailed.quantile == 0.99 and tailed.statistic == "P99"
    assert "P99 of the baseline's full ranking pass" in tailed.reason
    assert f"median {tailed.median_ms:.1f} ms" in tailed.reason
    # the median as the statistic: 2 of its 9 passes are slow, and the length does not move
    median = operating_point(probe, SLO_MS, SHARE, 16, 256, replace(SEARCH, quantile=0.5))
    assert probe.sample_runs[-1] == 9
    assert median.prefix_len == steady.prefix_len and median.statistic == "P50"


def test_the_length_goes_no_longer_than_the_baselines_length_cap() -> None:
    """A cap under the curve's answer holds the walk to it (``capped``, said in the reason);
    a cap above it changes nothing; the cap the suite passes is the longest grid length the
    baseline's sweep did not fail at, none when it failed nothing above its answer or passed
    nothing."""
    free = operating_point(CurveProbe(slow_ms), SLO_MS, SHARE, 16, 256, SEARCH)
    assert free.bound == "bracketed" and free.cap_tokens is None
    held = operating_point(CurveProbe(slow_ms), SLO_MS, SHARE, 16, 256, SEARCH, cap_tokens=500)
    assert (held.prefix_len, held.bound, held.cap_tokens) == (496, "capped", 500)
    assert max(s.prefix_tokens for s in held.curve) == 496 and held.cost_ms < held.target_ms
    assert "under the target up to 500 tokens, the baseline's length cap" in held.reason
    above = operating_point(CurveProbe(slow_ms), SLO_MS, SHARE, 16, 256, SEARCH,
                            cap_tokens=4096)
    assert (above.prefix_len, above.bound) == (free.prefix_len, "bracketed")
    low = operating_point(CurveProbe(slow_ms), SLO_MS, SHARE, 16, 256, SEARCH, cap_tokens=128)
    assert low.curve[0].prefix_tokens == 128 and low.bound == "capped"

    grid = (384, 512, 768, 1024, 1536)

    def swept(*trials: tuple[int, Verdict]) -> dict[str, LengthSweepResult]:
        sweep = LengthSweep(grid, start=trials[0][0])
        for length, verdict in trials:
            sweep.record(length, Outcome(1.0, verdict))
        return {"baseline": sweep.result()}

    assert baseline_length_cap(swept((768, Verdict.PASS), (1024, Verdict.UNDECIDED),
                                     (1536, Verdict.FAIL), (1536, Verdict.FAIL))) == 1024
    assert baseline_length_cap(swept((768, Verdict.PASS), (1024, Verdict.FAIL),
                                     (1024, Verdict.FAIL))) == 768
    assert baseline_length_cap(swept((768, Verdict.PASS), (1024, Verdict.PASS))) is None
    assert baseline_length_cap(swept((384, Verdict.FAIL))) is None
    assert baseline_length_cap(None) is None and baseline_length_cap({}) is None


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError):
        LengthSearch(start_tokens=16, min_tokens=32)
    with pytest.raises(ConfigError):
        LengthSearch(growth=1.0)
    with pytest.raises(ConfigError):
        ThroughputConfig(slo_share=1.0)
    with pytest.raises(ConfigError):
        operating_point(CurveProbe(slow_ms), SLO_MS, 0.0, 16, 256, SEARCH)
    config = BenchConfig.from_dict({"throughput": {"slo_share": 0.4,
                                                   "lengths": {"start_tokens": 128}}})
    assert config.throughput is not None and config.throughput.slo_share == 0.4
    assert config.throughput.lengths.start_tokens == 128


def test_the_suite_measures_the_curve_with_the_workloads_suffix_and_candidates() -> None:
    """The probe is asked at the population's mean suffix and candidate count; a configured
    length, or no probe, measures no curve."""
    probe = CurveProbe(lambda t: SERVICE["baseline"](t) * 1e3)
    config = replace(CONFIG, serving={"instances": 1, "batch_max_requests": 4})
    suite = BenchSuite({"baseline": factory("baseline")}, config, cost_probe=probe)
    point = suite.operating_point()
    assert point is not None and point.prefix_len == 576
    assert {(s, c) for _, s, c in probe.full_calls} == {(2, 4)}
    assert point.serving == {"instances": 1, "batch_max_requests": 4}
    assert suite.throughput_prefix_len(None, point)[0] == 576
    assert CONFIG.throughput is not None
    fixed = replace(CONFIG, throughput=replace(CONFIG.throughput, prefix_len=300))
    assert BenchSuite({"baseline": factory("baseline")}, fixed,
                      cost_probe=probe).operating_point() is None
    assert BenchSuite({"baseline": factory("baseline")}, CONFIG).operating_point() is None


def test_json_and_console_state_the_length_and_why(tmp_path: Path) -> None:
    probe = CurveProbe(lambda t: SERVICE["baseline"](t) * 1e3)
    config = replace(CONFIG, sweep=None, mixed=None, limit=None, exactness=None,
                     serving={"instances": 1})
    buffer = io.StringIO()
    report = run_benchmark({"baseline": factory("baseline")}, config, tmp_path,
                           console=Console(file=buffer, width=160), cost_probe=probe)
    data = json.loads((tmp_path / "bench.json").read_text())["workload"]["throughput"]
    assert data["prefix_len"] == 576 and data["chosen_by"].startswith("operating point")
    point = data["operating_point"]
    assert point["slo_share"] == 0.25 and point["cost_ms"] == pytest.approx(0.2504)
    assert point["curve"][0] == {"prefix_tokens": 256, "cost_ms": pytest.approx(0.1224)}
    assert point["serving"] == {"instances": 1} and "25% of the 1 ms SLO" in point["reason"]
    assert point["calibration_ms"] > 0     # the host's noise while the curve was measured
    printed = buffer.getvalue()
    assert "fixed-length operating point: 576 tokens" in printed and "chosen" in printed
    assert "baseline's batch cap" in printed
    assert report.modes["baseline"].throughput is not None
    assert all(p.prefix_len == 576 for p in report.points if p.phase == "throughput")


def gpu_batch(batch: int) -> float:
    """A call over B users costs 1 + 0.1 (B - 1) passes: batching nearly free."""
    return 1 + 0.1 * (batch - 1)


def test_the_baselines_batch_cap_follows_what_batching_costs_on_the_machine() -> None:
    """Where a batch of B costs B passes (a CPU) the cap is 1: batching serves no more requests
    per second and delays the first; where it is nearly free, the largest batch within the
    SLO; a batch whose call passes the SLO is never chosen, however cheap per request."""
    cpu = operating_point(CurveProbe(slow_ms), SLO_MS, SHARE, 16, 256, SEARCH)
    assert cpu.baseline_batch == 1
    assert [b.batch for b in cpu.batch_curve] == [1, 2, 4]   # 4 users: twice the SLO, stop
    assert cpu.batch_curve[1].cost_ms == 2 * cpu.cost_ms
    gpu = operating_point(CurveProbe(slow_ms, batch_cost=gpu_batch), SLO_MS, SHARE, 16, 256,
                          SEARCH)
    assert [b.batch for b in gpu.batch_curve] == [1, 2, 4, 8] and gpu.baseline_batch == 8
    assert gpu.batch_curve[-1].cost_ms == pytest.approx(1.7 * gpu.cost_ms)
    assert "batch cap there: up to 8 requests a call" in gpu.reason
    assert "batch cap there: one request a call" in cpu.reason
    # 8 users would cost 1.7 x 25 x 1.25 > 50 ms at a 25 % wider share: 4 is the cap
    wider = operating_point(CurveProbe(slow_ms, batch_cost=gpu_batch), SLO_MS, 0.625, 16, 256,
                            SEARCH)
    assert wider.baseline_batch == 4 and wider.batch_curve[-1].cost_ms > SLO_MS
    single = operating_point(CurveProbe(slow_ms, batch_cost=gpu_batch), SLO_MS, SHARE, 16, 256,
                             replace(SEARCH, max_batch=1))
    assert single.baseline_batch == 1 and len(single.batch_curve) == 1


def _contexts_seen(cost_probe: CostProbe, field: str
                   ) -> tuple[BenchReport, set[tuple[str, int, object]]]:
    """Run a sweep at 128 tokens and the fixed-length search of baseline and relay on simulated
    servers; the report, and every (mode, prefix tokens, ``SystemContext.<field>``) a system
    was built with."""
    seen: set[tuple[str, int, object]] = set()

    def capture(mode: str) -> Callable[[SystemContext], SimulatedServer]:
        def build(ctx: SystemContext) -> SimulatedServer:
            lengths = {len(h) for h in ctx.workload.histories.values()}
            seen.update((mode, n, getattr(ctx, field)) for n in lengths)
            return factory(mode)(ctx)
        return build

    assert CONFIG.sweep is not None
    config = replace(CONFIG, sweep=SweepConfig(lengths=(128,), qps=CONFIG.sweep.qps),
                     mixed=None, limit=None, exactness=None)
    suite = BenchSuite({m: capture(m) for m in ("baseline", "relay")}, config,
                       cost_probe=cost_probe)
    return run_virtual(suite.run()), seen


def test_the_baseline_is_capped_in_the_throughput_search_only() -> None:
    """The cap reaches the baseline's systems through their context in the fixed-length
    search; the sweep's baseline and every other mode keep their own batching."""
    report, seen = _contexts_seen(CurveProbe(lambda t: SERVICE["baseline"](t) * 1e3,
                                             batch_cost=gpu_batch), "batch_max_requests")
    assert report.operating_point is not None and report.operating_point.baseline_batch == 8
    assert seen == {("baseline", 128, None), ("relay", 128, None),      # the sweep
                    ("baseline", 576, 8), ("relay", 576, None)}         # the throughput search


def test_the_baselines_layout_reaches_its_throughput_search_only() -> None:
    """A layout that serves more requests a second than the serving one reaches the
    baseline's systems in the fixed-length search; the sweep and the other modes keep the
    system's own; where the serving layout wins, no mode is given one."""
    def run(speedup_at_2: float) -> set[tuple[str, int, object]]:
        probe = LayoutCurveProbe(lambda t: SERVICE["baseline"](t) * 1e3, Layout(2, 1),
                                 contention=lambda k: 1.0,
                                 speedup=lambda t: speedup_at_2 if t == 2 else 1.0)
        report, seen = _contexts_seen(probe, "layout")
        assert report.operating_point is not None
        return seen

    # a second thread 2.5x faster: a pass whose working set fits the two cores' caches only
    # together (simulated)
    assert run(speedup_at_2=2.5) == {("baseline", 128, None), ("relay", 128, None),
                                     ("baseline", 576, Layout(1, 2)), ("relay", 576, None)}
    assert run(speedup_at_2=1.5) == {("baseline", 128, None), ("relay", 128, None),
                                     ("baseline", 576, None), ("relay", 576, None)}


def test_the_throughput_searches_start_near_the_baselines_capacity() -> None:
    """The simulated baseline's pass costs about a quarter of the SLO at the operating point
    (0.02 + 0.0004 x 576 = 0.2504 ms): 3,994 requests a second, 60 % of which is 2,396 QPS;
    the grid from the plan's 1,000 has 2,000 below it. Every mode's throughput search starts
    there, and the JSON says so."""
    assert CONFIG.throughput is not None and CONFIG.sweep is not None
    config = replace(CONFIG, sweep=SweepConfig(lengths=(128,), qps=CONFIG.sweep.qps),
                     throughput=replace(CONFIG.throughput, start_capacity_share=0.6),
                     mixed=None, limit=None, exactness=None)
    probe = CurveProbe(lambda t: SERVICE["baseline"](t) * 1e3)
    report = run_virtual(BenchSuite({m: factory(m) for m in ("baseline", "relay")}, config,
                                    cost_probe=probe).run())
    point = report.operating_point
    assert point is not None and point.prefix_len == 576
    capacity = 1e3 / simulated_baseline_ms(576)
    assert point.baseline_requests_per_s == pytest.approx(capacity)
    for mode in ("baseline", "relay"):
        found = report.modes[mode].throughput
        assert found is not None and found.trials[0].point == 2000.0
    written = json.loads(json.dumps(report.to_json_dict()))["workload"]["throughput"]
    assert written["search"]["start_qps"] == 2000.0
    assert written["start_capacity_share"] == 0.6
    assert written["operating_point"]["baseline_requests_per_s"] == pytest.approx(capacity)
