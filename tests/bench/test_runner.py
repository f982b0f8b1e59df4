"""The open-loop runner: schedule held under overload, latency from the scheduled send time,
warm-up exclusion, drops at the in-flight cap, failures, early stop, protocol checks.

Every run here is on virtual time (``tests/virtual_time.py``): the fakes serve in simulated time,
so each send time, lateness and latency is an exact function of the schedule, whatever the
machine's speed or load."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from relaygr.bench.decision import P99Decision, P99Rule, Verdict
from relaygr.bench.protocol import BenchRequest, RequestRecord, RunClock, SystemContext
from relaygr.bench.runner import (
    RunOptions,
    check_record,
    run_open_loop,
    run_point,
)
from relaygr.bench.stats import point_stats
from relaygr.bench.workload import StageDelays
from relaygr.errors import BenchProtocolError, ConfigError
from tests.bench.fakes import (
    HoldingServer,
    LoopBlockingServer,
    SimulatedServer,
    SpikyServer,
    requests_at,
    service_time,
    tiny_workload,
)
from tests.virtual_time import run_virtual


def assert_on_schedule(arrivals_s: dict[int, float], requests: tuple[BenchRequest, ...]) -> None:
    # on virtual time an open-loop sender is exactly on time (a closed loop would be late by
    # the backlog: hundreds of ms in the tests below)
    assert [arrivals_s[r.request_id] for r in requests] == pytest.approx(
        [r.send_s for r in requests], abs=1e-9)


def run(coro):  # type: ignore[no-untyped-def]
    return run_virtual(coro)


def test_overload_keeps_the_schedule_and_latency_grows_from_scheduled_time() -> None:
    # Service 20 ms, a request every 10 ms: the queue grows by 10 ms per request.
    gap_s, service_s, n = 0.010, 0.020, 40  # closed loop would end 390 ms late
    workload = tiny_workload([gap_s * (i + 1) for i in range(n)])
    servers: list[SimulatedServer] = []

    def factory(ctx: SystemContext) -> SimulatedServer:
        servers.append(SimulatedServer(ctx, service_time(service_s, 0.0)))
        return servers[-1]

    result = run(run_point(factory, workload, RunOptions()))
    server = servers[0]
    assert server.started and server.stopped
    assert_on_schedule(server.arrivals_s, workload.requests)  # despite the backlog
    latencies = [r.ranking_latency_s for r in result.records]
    expected = [service_s + i * (service_s - gap_s) for i in range(n)]
    assert latencies == pytest.approx(expected, abs=1e-9)
    assert result.completed == n and result.dropped == 0


def test_a_stalled_server_charges_the_stall_to_every_queued_request() -> None:
    # The first request stalls the server 300 ms; the rest (1 ms each) queue behind it.
    workload = tiny_workload([0.01 * i for i in range(20)])
    costs = iter([0.3] + [0.001] * 19)
    servers: list[SimulatedServer] = []

    def factory(ctx: SystemContext) -> SimulatedServer:
        servers.append(SimulatedServer(ctx, lambda _tokens: next(costs)))
        return servers[-1]

    result = run(run_point(factory, workload, RunOptions()))
    assert_on_schedule(servers[0].arrivals_s, workload.requests)
    latencies = [r.ranking_latency_s for r in result.records]
    expected = [0.3 + 0.001 * i - 0.01 * i for i in range(20)]  # done_i = 0.3 + 1 ms x i
    assert latencies == pytest.approx(expected, abs=1e-9)


def test_latency_counts_from_the_scheduled_send_when_the_loop_is_blocked() -> None:
    # Request 0 (sent at 0) blocks the loop for 150 ms: requests 1-14 (due every 10 ms) are all
    # sent at 150 ms, and each is charged from its own scheduled time.
    block_s = 0.15
    workload = tiny_workload([0.01 * i for i in range(16)])
    result = run(run_point(lambda ctx: LoopBlockingServer(ctx, block_s), workload,
                           RunOptions()))
    stats = point_stats(result, "blocking", "test", qps=100.0)
    for record in result.records:
        send_s = workload.requests[record.request_id].send_s
        assert record.e2e_done_s == pytest.approx(max(send_s, block_s), abs=1e-9)
    # request 0 went out on time; each later one waited for the block to end
    assert result.dispatch_lag_s == pytest.approx(
        [0.0] + [max(0.0, block_s - r.send_s) for r in workload.requests[1:]], abs=1e-9)
    assert stats.dispatch_lag_max_ms == pytest.approx(140.0)  # request 1, due at 10 ms
    assert stats.e2e.max_ms == pytest.approx(150.0)           # request 0 itself


def test_warmup_requests_are_sent_but_excluded() -> None:
    workload = tiny_workload([0.002 * i for i in range(20)])
    servers: list[SimulatedServer] = []

    def factory(ctx: SystemContext) -> SimulatedServer:
        servers.append(SimulatedServer(ctx, service_time(0.001, 0.0)))
        return servers[-1]

    result = run(run_point(factory, workload, RunOptions(warmup_requests=5)))
    assert sorted(servers[0].arrivals_s) == list(range(20))
    assert [r.request_id for r in result.records] == list(range(5, 20))
    assert result.measured == 15 and set(result.send_s) == set(range(5, 20))
    assert len(result.dispatch_lag_s) == 15
    # a loop blocked during the warm-up: its late sends are the warm-up's, not the point's
    blocked = run(run_point(lambda ctx: LoopBlockingServer(ctx, 0.15),
                            tiny_workload([0.01 * i for i in range(40)]),
                            RunOptions(warmup_requests=20)))
    assert len(blocked.dispatch_lag_s) == 20 and max(blocked.dispatch_lag_s) == 0.0


def test_in_flight_cap_drops_instead_of_blocking_the_schedule() -> None:
    workload = tiny_workload([0.01 * i for i in range(10)])
    servers: list[HoldingServer] = []

    def factory(ctx: SystemContext) -> HoldingServer:
        servers.append(HoldingServer(ctx, hold_s=0.3))
        return servers[-1]

    result = run(run_point(factory, workload, RunOptions(max_in_flight=3)))
    assert servers[0].calls == [0, 1, 2]
    assert (result.completed, result.dropped) == (3, 7)
    assert max(result.dispatch_lag_s) == 0.0  # drops happened on schedule, not after 0.3 s
    stats = point_stats(result, "hold", "test", qps=100.0)
    assert stats.ranking.unserved == 7 and math.isinf(stats.ranking.p99_ms)


def test_failures_are_counted_and_cost_infinite_latency() -> None:
    workload = tiny_workload([0.002 * i for i in range(10)])
    result = run(run_point(lambda ctx: HoldingServer(ctx, 0.001, fail=lambda i: i % 2 == 0),
                           workload, RunOptions()))
    assert (result.completed, result.failed) == (5, 5)
    assert result.errors == {"RuntimeError": 5}
    stats = point_stats(result, "flaky", "test", qps=500.0)
    assert stats.ranking.count == 10 and stats.ranking.unserved == 5
    assert math.isinf(stats.ranking.p50_ms) is False and math.isinf(stats.ranking.p90_ms)


def test_drain_timeout_cancels_and_counts_stragglers() -> None:
    workload = tiny_workload([0.0, 0.001])
    result = run(run_point(lambda ctx: HoldingServer(ctx, 5.0), workload,
                           RunOptions(drain_timeout_s=0.05)))
    assert (result.completed, result.timed_out) == (0, 2)
    assert result.duration_s == pytest.approx(0.001 + 0.05)  # the last send, then the drain


def judged(slo_ms: float, confidence: float = 0.99, **changes: int) -> RunOptions:
    return RunOptions(slo_ms=slo_ms, rule=P99Rule(confidence), stop_when_decided=True,
                      **changes)


def test_one_spike_in_a_forty_request_point_leaves_it_undecided_not_failed() -> None:
    """The motivating run: 40 requests at 4 QPS, P50 ~4 ms, one 60 ms spike. P99 over 40
    samples is their maximum, over the 50 ms SLO, yet the sample cannot say P99 > SLO."""
    workload = tiny_workload([0.25 * (i + 1) for i in range(40)])
    result = run(run_point(lambda ctx: SpikyServer(ctx, 0.004, {17}, 0.060), workload,
                           judged(50.0)))
    stats = point_stats(result, "relay", "throughput", 4.0)
    assert stats.ranking.p99_ms == pytest.approx(60.0) and stats.ranking.p50_ms == \
        pytest.approx(4.0)
    assert stats.decision == P99Decision(Verdict.UNDECIDED, 40, 1, 0.99)
    assert stats.verdict is Verdict.UNDECIDED and not stats.passed
    assert not result.stopped_early and result.sent == 40


def test_a_decided_fail_stops_the_point() -> None:
    # every request takes 5 ms against a 1 ms SLO: a fail after a few misses
    workload = tiny_workload([0.001 * i for i in range(200)])
    result = run(run_point(lambda ctx: SimulatedServer(ctx, service_time(0.005, 0.0)),
                           workload, judged(1.0)))
    assert result.stopped_early and result.not_sent > 150
    # those in flight at the stop are the runner's cancellations, not the system's timeouts:
    # their latency is unknown, so the point's P99 is of what completed, not infinite
    assert result.timed_out == 0 and result.cancelled > 0
    assert result.completed + result.cancelled + result.not_sent == 200
    stats = point_stats(result, "slow", "test", 1000.0)
    slowest = max(r.ranking_latency_s for r in result.records) * 1e3
    assert stats.ranking.unserved == 0 and stats.ranking.p99_ms == pytest.approx(slowest)
    assert stats.cancelled == result.cancelled
    decision = result.decision
    assert decision is not None and decision.verdict is Verdict.FAIL
    rule = P99Rule(0.99).sequential(200)
    assert decision.overages >= rule.boundaries(256)[1][decision.samples]
    assert point_stats(result, "slow", "test", 1000.0).verdict is Verdict.FAIL


def test_a_decided_pass_stops_the_point() -> None:
    # 0.1 ms a request, one every ms, 3 ms SLO: no overage. At 90% confidence and up to 300
    # requests (the 512 bucket) a pass takes 270 requests without an overage.
    workload = tiny_workload([0.001 * i for i in range(300)])
    fast = lambda ctx: SimulatedServer(ctx, service_time(0.0001, 0.0))  # noqa: E731
    rule = P99Rule(0.9).sequential(300)
    assert rule.min_samples_to_pass() == 270
    result = run(run_point(fast, workload, judged(3.0, 0.9)))
    assert result.stopped_early and (result.sent, result.not_sent) == (270, 30)
    assert result.decision == P99Decision(Verdict.PASS, 270, 0, 0.9)


def test_a_pass_is_judged_on_the_known_run_from_the_first_request() -> None:
    """A pass counts only requests whose outcomes, and all their predecessors', are known: a
    slow request holds it however many requests after it are done; once it is done, the pass
    stands at the first n that decides it and the requests still in flight are drained outside
    that sample."""
    workload = tiny_workload([0.001 * i for i in range(300)])
    # request 250 stalls 30 ms (within the 50 ms SLO): at 280 ms, when it is done, 251-280
    # wait behind it and then take 0.1 ms each, so the known run from the first reaches 270
    # (a pass: 270 requests without overage) just after 280 ms, with 281 already sent.
    result = run(run_point(lambda ctx: SpikyServer(ctx, 0.0001, {250}, 0.030), workload,
                           judged(50.0, 0.9)))
    assert result.decision == P99Decision(Verdict.PASS, 270, 0, 0.9)
    assert result.sent > 270 and result.completed == result.sent   # drained, not cancelled


def test_a_slow_request_still_out_holds_the_pass_however_many_after_it_are_done() -> None:
    """Requests served in parallel (no queue), request 100 taking 200 ms against a 50 ms SLO:
    the 270 after it are done long before it, but a pass counted over all the finished ones
    would ignore a certain miss; judged on the run from the first, the point cannot pass."""

    class Parallel(SimulatedServer):
        async def handle(self, request: BenchRequest) -> RequestRecord:
            self.free_at_s = 0.0
            cost = 0.200 if request.request_id == 100 else 0.0001
            self.service_s = service_time(cost, 0.0)
            return await super().handle(request)

    workload = tiny_workload([0.001 * i for i in range(400)])
    result = run(run_point(lambda ctx: Parallel(ctx, service_time(0.0001, 0.0)), workload,
                           judged(50.0, 0.9)))
    assert result.decision == P99Decision(Verdict.UNDECIDED, 400, 1, 0.9)
    assert not result.stopped_early and result.misses(50.0) == 1


def test_a_pass_does_not_wait_for_a_lull_in_the_stages_before_ranking() -> None:
    """Requests spend 200 ms in the stages before ranking, so at 100 QPS about 20 are always
    in flight; a pass must not wait for none to be (it would run the whole point)."""
    workload = tiny_workload([0.01 * i for i in range(400)])
    workload = replace(workload, stage_delays=StageDelays(0.12, 0.08))
    result = run(run_point(lambda ctx: SimulatedServer(ctx, service_time(0.001, 0.0)),
                           workload, judged(50.0, 0.9)))
    assert result.decision == P99Decision(Verdict.PASS, 270, 0, 0.9)
    assert result.stopped_early and result.not_sent > 100


def test_a_miss_after_a_decided_pass_does_not_undo_it() -> None:
    """The pass is decided on a prefix of the schedule; a request in flight then is recorded
    but is not part of that sample. Request 269 stalls 30 ms (done at 299 ms), 270 and 271
    queue behind it, and 272 then takes 60 ms: the first 270 decide a pass at 299 ms, and 272,
    done at 359 ms (87 ms after its send), and those queued behind it miss outside the
    sample."""
    workload = tiny_workload([0.001 * i for i in range(300)])

    class Stalls(SimulatedServer):
        async def handle(self, request: BenchRequest) -> RequestRecord:
            cost = {269: 0.030, 272: 0.060}.get(request.request_id, 0.0001)
            self.service_s = service_time(cost, 0.0)
            return await super().handle(request)

    result = run(run_point(lambda ctx: Stalls(ctx, service_time(0.0001, 0.0)), workload,
                           judged(50.0, 0.9)))
    assert result.decision == P99Decision(Verdict.PASS, 270, 0, 0.9)
    late = [r.request_id for r in result.records if r.ranking_latency_s > 0.050]
    assert late and min(late) == 272 and result.completed == result.sent   # 273-: behind it


def test_inconsistent_records_raise() -> None:
    request = requests_at([0.5])[0]
    good = RequestRecord(0, 1, 0.6, 0.7, 0.8, "full", 1, 1, 4, 0, None)
    assert check_record(request, good) is None
    assert check_record(request, replace(good, ranking_due_s=0.4)) is not None
    assert check_record(request, replace(good, e2e_done_s=0.65)) is not None
    assert check_record(request, replace(good, request_id=3)) is not None

    class Liar:
        def __init__(self, clock: RunClock) -> None:
            self.clock = clock

        async def handle(self, request):  # type: ignore[no-untyped-def]
            return RequestRecord(request.request_id, request.user_id, request.send_s,
                                 request.send_s - 1.0, request.send_s, "full", 0, 0, 0, 0, None)

    clock = RunClock()
    with pytest.raises(BenchProtocolError):
        run(run_open_loop(Liar(clock), requests_at([0.0, 0.001]), clock, RunOptions()))


def test_options_are_validated() -> None:
    with pytest.raises(ConfigError):
        RunOptions(max_in_flight=0)
    with pytest.raises(ConfigError):
        RunOptions(stop_when_decided=True)
    with pytest.raises(ConfigError):
        RunOptions(slo_ms=1.0)          # an SLO needs a rule to judge it


def test_snapshots_are_sampled() -> None:
    workload = tiny_workload([0.01 * i for i in range(10)])
    result = run(run_point(
        lambda ctx: SimulatedServer(ctx, service_time(0.001, 0.0), bytes_per_token=4),
        workload, RunOptions(snapshot_interval_s=0.02)))
    stats = point_stats(result, "sim", "test", 100.0)
    assert len(result.snapshots) >= 2  # sampled at the start and taken at the end, at least
    # 10 users x 10 tokens, each grown by one appended event, 4 bytes per token
    assert stats.device_bytes_end == 10 * 11 * 4 == stats.device_bytes_peak
    assert stats.counters_end == {"served": 10.0}
