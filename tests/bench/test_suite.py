"""``run_benchmark`` end to end over simulated servers whose answers are known offline.

Each mode is a single FIFO server (``SimulatedServer``) with service time a + b x prefix tokens,
so every point's ranking P99 is Lindley's recursion over the workload's schedule. The searches
run through the real runner must reach exactly the answers the same searches reach offline, and
stay below each server's M/D/1 capacity 1 / service time.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from relaygr.bench.benchmark import run_benchmark
from relaygr.bench.config import (
    QpsSearchConfig,
)
from relaygr.bench.decision import P99Rule, Verdict
from relaygr.bench.journal import JOURNAL_NAME, read_journal
from relaygr.bench.limit import isolated_passes
from relaygr.bench.protocol import SystemContext
from relaygr.bench.qps_search import QpsSearch
from relaygr.bench.report import BenchReport
from relaygr.bench.search import LengthSweep, Outcome, Trial
from relaygr.bench.workload import SyntheticWorkload, WorkloadBuilder, workload_builder
from tests.bench.fakes import SimulatedServer, lindley_latencies_ms
from tests.bench.simulated_plan import (
    CONFIG,
    MIXED,
    POPULATION,
    SEARCH,
    SERVICE,
    SLO_MS,
    CurveProbe,
    factory,
    fake_steal,
    simulated_baseline_ms,
)

Bench = tuple[BenchReport, Path, CurveProbe, str]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Bench:
    out = tmp_path_factory.mktemp("bench")
    probe = CurveProbe(simulated_baseline_ms)   # the machine the simulated baseline runs on
    buffer = io.StringIO()
    console = Console(file=buffer, width=140)
    report = run_benchmark({m: factory(m) for m in SERVICE}, CONFIG, out, probe,
                           console=console, cost_probe=probe)
    return report, out, probe, buffer.getvalue()


def oracle(mode: str, builder: WorkloadBuilder, qps: float) -> Outcome:
    """The point's P99 and verdict, offline: the sequential rule over all its requests."""
    budget = CONFIG.budget
    workload = builder.build(qps, budget.warmup_requests + budget.measured_at(qps))
    latencies = lindley_latencies_ms(workload, budget.warmup_requests, SERVICE[mode])
    p99 = float(np.percentile(latencies, 99, method="inverted_cdf"))
    rule = P99Rule(budget.confidence).sequential(len(latencies))
    return Outcome(p99, rule.verdict(len(latencies), int((latencies > SLO_MS).sum())))


def offline_sweep(mode: str) -> LengthSweep:
    assert CONFIG.sweep is not None
    sweep = LengthSweep(CONFIG.sweep.lengths)
    while (length := sweep.next_point()) is not None:
        builder = SyntheticWorkload(POPULATION.with_fixed_length(length), CONFIG.seed)
        sweep.record(length, oracle(mode, builder, CONFIG.sweep.qps))
    return sweep


def offline_qps(mode: str, builder: SyntheticWorkload) -> QpsSearch:
    search = QpsSearch(SEARCH.start_qps, SEARCH.growth, SEARCH.rel_tol, SEARCH.budget_s,
                       SEARCH.min_qps, SEARCH.max_qps)
    while (qps := search.next_point()) is not None:
        search.record(qps, oracle(mode, builder, qps))
    return search


def verdicts(trials: Sequence[Trial[float]] | Sequence[Trial[int]]) -> list[tuple[float, str]]:
    return [(t.point, t.verdict.value) for t in trials]


def test_sweep_finds_the_known_max_length(bench: Bench) -> None:
    report = bench[0]
    for mode in SERVICE:
        expected = offline_sweep(mode).result()
        got = report.modes[mode].sweep
        assert got is not None
        assert verdicts(got.trials) == verdicts(expected.trials)
        assert report.modes[mode].max_seq_len_under_slo == expected.max_seq_len
    lens = [report.modes[m].max_seq_len_under_slo or 0 for m in ("baseline", "reactive", "relay")]
    assert 0 < lens[0] < lens[1] <= lens[2] == 2048


def test_throughput_search_finds_the_known_capacity(bench: Bench) -> None:
    report = bench[0]
    prefix_len = report.workload["throughput"]["prefix_len"]
    # the operating point: the simulated baseline costs 0.02 + 0.0004 x tokens ms a request,
    # a quarter of the 1 ms SLO at 576 tokens (simulated_plan); but its sweep, at 2,000 QPS,
    # passed 256, could not tell at 512 and failed 1,024 twice, so its length cap (the longest
    # length it did not fail at), and the length, is 512
    sweep = report.modes["baseline"].sweep
    assert sweep is not None and (sweep.max_seq_len, sweep.failing_above_len) == (256, 1024)
    assert sweep.undecided_lens == (512,)
    point = report.operating_point
    assert point is not None and prefix_len == 512
    assert (point.bound, point.cap_tokens) == ("capped", 512)
    assert point.cost_ms == pytest.approx(simulated_baseline_ms(512))
    assert max(s.prefix_tokens for s in point.curve) == 512
    assert "512 tokens, the baseline's length cap" in " ".join(bench[3].split())
    builder = SyntheticWorkload(POPULATION.with_fixed_length(prefix_len), CONFIG.seed)
    for mode in SERVICE:
        expected = offline_qps(mode, builder).result()
        got = report.modes[mode].throughput
        assert got is not None and verdicts(got.trials) == verdicts(expected.trials)
        assert report.modes[mode].slo_throughput_qps == expected.best_qps
        # M/D/1 capacity 1 / service: a point of 256 requests lasts only a few ms, so a rate
        # somewhat above it passes while its queue is still short; never far above it
        capacity = 1 / SERVICE[mode](prefix_len)
        assert 0.2 * capacity < expected.best_qps < 1.25 * capacity
    mixed = workload_builder("synthetic", MIXED, CONFIG.seed)
    assert isinstance(mixed, SyntheticWorkload)
    for mode in SERVICE:
        expected = offline_qps(mode, mixed).result()
        assert report.modes[mode].slo_throughput_qps_mixed == expected.best_qps
    relay, baseline = (report.modes[m].slo_throughput_qps for m in ("relay", "baseline"))
    assert relay is not None and baseline is not None
    assert report.ratios["relay_vs_baseline_throughput"] == pytest.approx(relay / baseline)


def test_reference_point_limit_and_exactness(bench: Bench) -> None:
    report, _, probe, _ = bench
    relay = report.modes["relay"]
    assert relay.reference is not None and relay.reference.phase == "throughput"
    assert relay.reference.qps == relay.slo_throughput_qps
    assert relay.reference.hit_rate_device == 1.0 and relay.reference.hit_rate_host == 0.0
    reactive = report.modes["reactive"].reference
    assert reactive is not None and reactive.hit_rate_host == 1.0
    assert relay.reference.device_bytes_peak > 0
    limit = report.limit
    assert limit is not None and len(probe.calls) == 1
    # the pass alone timed as often as the limit point has requests, 25 at the least
    assert CONFIG.limit is not None
    assert probe.calls[0] == (limit.prefix_len, limit.suffix_tokens, limit.candidates,
                              isolated_passes(CONFIG.limit.requests))
    assert limit.isolated_passes == isolated_passes(CONFIG.limit.requests)
    assert limit.relay_overhead_ratio == pytest.approx(limit.low_load_p50_ms / 0.05)
    assert limit.low_load_p50_ms == pytest.approx(SERVICE["relay"](limit.prefix_len) * 1e3,
                                                  rel=0.1)
    assert limit.achieved_gflops is not None and limit.achieved_gflops > 0
    ex = report.exactness
    assert ex is not None and ex.requests_compared == 12 and ex.scores_compared == 48
    assert ex.max_abs_score_diff == pytest.approx(1e-7, rel=1e-3)
    assert ex.candidate_paths == {"device_hit": 12}
    # agreement on 12 requests, fewer than the 50 the bar asks: not shown either way
    assert report.checks["exactness_within_1e-4"] is None
    assert report.checks["relay_ahead_of_reactive"] is True


REQUIRED = {
    "slo_ms", "device", "model", "workload", "modes", "ratios", "limit", "exactness",
    "slo_throughput_qps_mixed"}
MODE_KEYS = {"max_seq_len_under_slo", "slo_throughput_qps", "slo_throughput_qps_mixed",
             "p99_ms", "hit_rate_device", "hit_rate_host", "latency_ms", "path_counts",
             "trigger_reasons", "preinfer_tokens_per_request", "device_bytes_in_use_peak",
             "host_bytes_in_use_peak", "reference_point", "sweep", "throughput_search",
             "mixed_search"}


def test_json_has_every_required_key(bench: Bench) -> None:
    report, out, _, _ = bench
    data = json.loads((out / "bench.json").read_text())
    assert set(data) >= REQUIRED
    assert data["slo_ms"] == SLO_MS and isinstance(data["device"], str)
    assert data["model"]["dim"] == 32
    assert set(data["modes"]) == set(SERVICE)
    for mode, entry in data["modes"].items():
        assert set(entry) >= MODE_KEYS
        assert isinstance(entry["max_seq_len_under_slo"], int)
        assert isinstance(entry["slo_throughput_qps"], float)
        assert set(entry["p99_ms"]) == {"ranking", "e2e"}
        assert entry["p99_ms"]["ranking"] <= SLO_MS
        assert data["slo_throughput_qps_mixed"][mode] == entry["slo_throughput_qps_mixed"]
    assert {"relay_vs_baseline_seq_len", "relay_vs_baseline_throughput",
            "relay_vs_reactive_throughput"} <= set(data["ratios"])
    assert {"cached_rank_ms_isolated", "relay_overhead_ratio",
            "matmul_peak_gflops"} <= set(data["limit"])
    assert {"requests_compared", "max_abs_score_diff"} <= set(data["exactness"])
    assert data["limit"]["cached_rank_ms_isolated"] == 0.05
    assert data["limit"]["matmul_peak_gflops"] is None  # not measured in this test
    assert len(data["points"]) == len(report.points) > 20
    assert data["workload"]["summaries"]["sweep"]["requests"] == 266
    for point in data["points"]:      # each judged point's verdict and its evidence
        decision = point["decision"]
        if point["phase"] == "limit":
            assert decision is None      # the low-load point is not judged against the SLO
            continue
        assert decision["verdict"] in ("pass", "fail", "undecided")
        assert 0 <= decision["overages"] <= decision["samples"] == point["measured"]
        assert decision["confidence"] == 0.9 and "calibration_ms" in point
    rows = {row["name"]: row for row in data["verdicts"]}
    assert set(rows) == set(data["checks"])
    throughput = rows["relay_vs_baseline_throughput_ge_4x"]
    assert throughput["low"] <= throughput["value"] <= throughput["high"]
    assert throughput["value"] == data["ratios"]["relay_vs_baseline_throughput"]


def test_plots_and_console(bench: Bench) -> None:
    _, out, _, printed = bench
    for name in ("p99_vs_prefix_len.png", "p99_vs_qps.png", "hit_rates.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    for mode in SERVICE:
        assert mode in printed
    assert "ratios:" in printed and "exactness: 12 requests" in printed


def test_the_journal_holds_every_point_and_phase_as_they_finished(bench: Bench) -> None:
    """``points.jsonl``: the start with the config, then every point of ``bench.json`` in the
    order measured, each phase's answer after its last point, the clock never going back."""
    _, out, _, _ = bench
    events = read_journal(out / JOURNAL_NAME)
    assert events[0]["event"] == "start" and events[0]["config"]["seed"] == CONFIG.seed
    data = json.loads((out / "bench.json").read_text())
    points = [e["point"] for e in events if e["event"] == "point"]
    assert points == data["points"]
    phases = [e["phase"] for e in events if e["event"] == "phase"]
    assert phases == ["sweep", "operating_point", "throughput", "mixed", "limit", "exactness"]
    # each phase line comes after the last point it covers
    last_seen: dict[str, int] = {}
    for i, e in enumerate(events):
        if e["event"] == "point":
            last_seen[e["point"]["phase"]] = i
    for i, e in enumerate(events):
        if e["event"] == "phase" and e["phase"] in last_seen:
            assert i > last_seen[e["phase"]]
    sweep = next(e["result"] for e in events if e.get("phase") == "sweep")
    for mode in SERVICE:
        assert sweep[mode]["max_seq_len"] == data["modes"][mode]["max_seq_len_under_slo"]
    times = [e["at_s"] for e in events]
    assert times == sorted(times)


def test_a_journal_cut_off_mid_line_reads_up_to_its_last_whole_event(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL_NAME
    path.write_text('{"event": "start", "at_s": 0.0}\n{"event": "point", "at_s": 1.5}\n'
                    '{"event": "poi')
    assert [e["at_s"] for e in read_journal(path)] == [0.0, 1.5]
    path.write_text('{"event": "start"}\n{"eve\n{"event": "point"}\n')
    with pytest.raises(json.JSONDecodeError):      # damage before the end is not a cut-off
        read_journal(path)


def test_extra_workload_phase_measures_named_systems(tmp_path: Path) -> None:
    """An extra workload phase searches SLO throughput for the systems it names, including
    systems given only for it; its answers match the offline search over the same workload."""
    from dataclasses import replace

    from relaygr.bench.config import WorkloadPhaseConfig
    from relaygr.errors import ConfigError

    phase = WorkloadPhaseConfig("replay", "synthetic", MIXED, ("baseline", "relay-closed"),
                                SEARCH)
    config = replace(CONFIG, sweep=None, throughput=None, mixed=None, limit=None,
                     exactness=None, workloads=(phase,))
    report = run_benchmark({"baseline": factory("baseline")}, config, tmp_path,
                           console=Console(file=io.StringIO()),
                           extra_systems={"relay-closed": factory("relay")})
    builder = workload_builder("synthetic", MIXED, CONFIG.seed)
    got = report.workloads["replay"]["slo_throughput_qps"]
    assert set(got) == {"baseline", "relay-closed"}
    for system, mode in (("baseline", "baseline"), ("relay-closed", "relay")):
        search = QpsSearch(SEARCH.start_qps, SEARCH.growth, SEARCH.rel_tol, SEARCH.budget_s,
                           SEARCH.min_qps, SEARCH.max_qps)
        while (qps := search.next_point()) is not None:
            search.record(qps, oracle(mode, builder, qps))
        assert got[system] == search.result().best_qps
    assert "relay-closed" not in report.modes                  # not a mode of the headline
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["workloads"]["replay"]["slo_throughput_qps"]["baseline"] == got["baseline"]
    with pytest.raises(ConfigError, match="unknown systems"):
        run_benchmark({"baseline": factory("baseline")},
                      replace(config, workloads=(replace(phase, modes=("relay-x",)),)),
                      tmp_path, console=Console(file=io.StringIO()))


def test_the_sweep_measures_its_deciding_fail_again_on_a_fresh_system(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fail that decides the sweep's answer is measured a second time, afresh, on a fresh
    system, and recorded as the point's second round; on a deterministic server it fails
    again, so the sweep reaches the offline answer. The host's steal is read as none (a miss
    under steal would be re-measured as noise first, and a shared machine's real steal made
    this test flaky)."""
    import asyncio
    from dataclasses import replace

    from relaygr.bench.suite import BenchSuite

    fake_steal(monkeypatch, 0.0)
    assert CONFIG.sweep is not None
    config = replace(CONFIG, budget=replace(CONFIG.budget, max_remeasures=0))
    assert config.sweep is not None
    built: list[int] = []

    def counting(ctx: SystemContext) -> SimulatedServer:
        built.append(1)
        return factory("baseline")(ctx)

    suite = BenchSuite({"baseline": counting}, config)
    result = asyncio.run(suite.sweep())["baseline"]
    offline = LengthSweep(config.sweep.lengths)
    while (length := offline.next_point()) is not None:
        builder = SyntheticWorkload(POPULATION.with_fixed_length(length), CONFIG.seed)
        offline.record(length, oracle("baseline", builder, CONFIG.sweep.qps))
    assert verdicts(result.trials) == verdicts(offline.result().trials)
    assert result.max_seq_len == offline.result().max_seq_len > 0
    again = [p for p in suite.points if p.round == 2]
    assert [p.prefix_len for p in again] == [result.first_failing_len]
    first = next(p for p in suite.points if p.prefix_len == again[0].prefix_len)
    assert first.verdict is again[0].verdict is Verdict.FAIL
    assert len(built) == len(suite.points)      # every round on a system of its own


def test_a_single_spike_leaves_a_point_undecided_and_the_search_climbs_past_it() -> None:
    """The motivating run, on virtual time: every request takes 4 ms against a 50 ms SLO, but
    one request of the first 16-QPS point takes 60 ms. That point cannot pass (at 90% and up to
    256 requests a pass allows no overage) but is not failed either: it is undecided, and the
    search climbs on past it to its ceiling instead of going down."""
    from dataclasses import replace

    from relaygr.bench.suite import BenchSuite
    from tests.bench.fakes import SpikyServer
    from tests.virtual_time import run_virtual

    built: list[float] = []

    def spiky(ctx: SystemContext) -> SpikyServer:
        built.append(ctx.workload.qps)
        spikes = {100} if built.count(16.0) == 1 and ctx.workload.qps == 16.0 else set()
        return SpikyServer(ctx, 0.004, spikes, 0.060)

    search = QpsSearchConfig(start_qps=4.0, rel_tol=0.3, min_qps=2.0, max_qps=64.0)
    config = replace(CONFIG, slo_ms=50.0, budget=replace(
        CONFIG.budget, stop_when_decided=True, max_point_s=1000.0, remeasure_steal=1.0))
    suite = BenchSuite({"relay": spiky}, config)
    builder = SyntheticWorkload(POPULATION.with_fixed_length(128), CONFIG.seed)
    result = run_virtual(suite.qps_search("throughput", builder, search, 128))["relay"]
    assert verdicts(result.trials) == [(4.0, "pass"), (8.0, "pass"), (16.0, "undecided"),
                                       (32.0, "pass"), (64.0, "pass")]
    spiked = suite.points[2]
    assert spiked.ranking.max_ms == pytest.approx(60.0) and spiked.decision is not None
    assert (spiked.decision.overages, spiked.decision.samples) == (1, 256)
    assert result.best_qps == 64.0 and result.stopped_by == "max_qps"
    assert result.undecided_qps == (16.0,)


def test_a_mode_the_sweep_leaves_out_has_no_length_figure_and_the_report_says_so(
        tmp_path: Path) -> None:
    """The quick plan sweeps only the modes whose bar is on length: a mode left out is in the
    report with no sweep (not a missing key, not a zero), the JSON names the modes swept, and
    the swept mode's answer is the offline one."""
    from dataclasses import replace

    assert CONFIG.sweep is not None
    config = replace(CONFIG, sweep=replace(CONFIG.sweep, modes=("baseline",)), throughput=None,
                     mixed=None, limit=None, exactness=None)
    buffer = io.StringIO()
    report = run_benchmark({m: factory(m) for m in ("baseline", "relay")}, config, tmp_path,
                           console=Console(file=buffer, width=140))
    assert report.modes["relay"].sweep is None
    assert report.modes["relay"].max_seq_len_under_slo is None
    assert report.modes["baseline"].max_seq_len_under_slo == \
        offline_sweep("baseline").result().max_seq_len
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["workload"]["sweep"]["modes"] == ["baseline"]
    assert data["modes"]["relay"]["max_seq_len_under_slo"] is None
    assert "relay_vs_baseline_seq_len_ge_2x" in buffer.getvalue()
