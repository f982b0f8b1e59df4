"""What a point's records say: a request's ranking due from its schedule (the cascade under
test), and how two runs' records are compared for exactness."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from relaygr.bench.exactness import compare_records
from relaygr.bench.protocol import RequestRecord, RunClock
from relaygr.bench.stats import latency_parts
from relaygr.bench.systems import CascadeUnderTest
from relaygr.cascade.config import StagesConfig
from relaygr.cascade.stages import StageTiming
from relaygr.cascade.visit import Visit
from relaygr.engine.types import RankPath, RankTiming
from relaygr.errors import BenchProtocolError
from tests.bench.fakes import requests_at


def rec(i: int, scores: tuple[float, ...] | None, path: str = "full") -> RequestRecord:
    return RequestRecord(i, i, 0.0, 0.001, 0.002, path, 10, 2, len(scores or ()), 0, None,
                         scores)


def test_compare_records() -> None:
    ref = (rec(0, (1.0, 2.0)), rec(1, (0.5,)), rec(2, None), rec(3, (0.0,)))
    cand = (rec(0, (1.0, 2.25), "device_hit"), rec(1, (0.4,), "host_hit"), rec(2, (1.0,)))
    report = compare_records(ref, cand, "baseline", "relay")
    assert (report.requests_compared, report.scores_compared) == (2, 3)
    assert report.max_abs_score_diff == pytest.approx(0.25)
    assert report.candidate_paths == {"device_hit": 1, "host_hit": 1}
    with pytest.raises(BenchProtocolError):
        compare_records((rec(0, (1.0,)),), (rec(0, (1.0, 2.0)),), "baseline", "relay")
    # a request whose ranked prefix differs between the runs (its earlier visit appended before
    # it arrived in one run only) is not the same input: skipped; a request one run did not
    # answer is counted, not silently dropped
    grown = replace(rec(0, (1.0, 2.5)), prefix_tokens=101)
    odd = compare_records((rec(0, (1.0, 2.0)), rec(1, (0.5,)), rec(2, (3.0,))),
                          (grown, rec(1, (0.5,))), "baseline", "relay")
    assert (odd.requests_compared, odd.requests_skipped, odd.requests_unanswered) == (1, 1, 1)
    assert odd.max_abs_score_diff == 0.0
    # a NaN score agrees with nothing (a maximum that skipped it would report 0, "exact")
    for bad in ((0.1, math.nan, 0.3), (math.nan, math.nan, math.nan), (math.inf, 0.2, 0.3)):
        odd = compare_records((rec(0, (0.1, 0.2, 0.3)), rec(1, (1.0,))),
                              (rec(0, bad), rec(1, (1.0,))), "baseline", "relay")
        assert odd.requests_compared == 2 and math.isinf(odd.max_abs_score_diff)


def test_requests_after_a_user_request_only_one_run_answered_are_not_compared() -> None:
    """User 7's request 10 failed in the candidate run, so its events never reached that
    run's history: requests 11 and 12 then rank a different input and are skipped (counted),
    while another user's requests are still compared."""
    def visit(i: int, user: int, scores: tuple[float, ...]) -> RequestRecord:
        return replace(rec(i, scores), user_id=user)

    ref = (visit(10, 7, (1.0,)), visit(11, 7, (2.0,)), visit(12, 7, (3.0,)), visit(13, 8, (4.0,)))
    cand = (visit(11, 7, (2.8,)), visit(12, 7, (3.0,)), visit(13, 8, (4.0,)))
    report = compare_records(ref, cand, "baseline", "relay")
    assert (report.requests_compared, report.requests_skipped) == (1, 2)
    assert report.max_abs_score_diff == 0.0


def test_ranking_is_due_when_the_earlier_stages_would_have_ended_had_the_request_started_on_time(
        ) -> None:
    """A request the event loop started 0.3 s late (or handed over late) is charged that lag
    in its ranking latency, the SLO metric, not only end to end: due is its scheduled send plus
    the earlier stages' own time (their configured delays, or measured retrieval where that
    took longer), never the moment ranking happened to start."""
    stages = StagesConfig(retrieval_delay_ms=40.0, preprocess_delay_ms=30.0)

    class System:
        config = SimpleNamespace(stages=stages)

        def __init__(self, timing: StageTiming | None) -> None:
            self.timing = timing

        async def recommend(self, visit: Visit) -> SimpleNamespace:
            now = time.perf_counter()
            return SimpleNamespace(
                ranking_due_s=now - 0.010, ranking_done_s=now, path=RankPath.FULL,
                preinfer=None, prefix_tokens=3, suffix_tokens=0,
                candidates=torch.arange(1, 3), scores=torch.zeros(2), timing=None,
                stages=self.timing)

    async def record(timing: StageTiming | None) -> tuple[RequestRecord, float]:
        clock = RunClock()
        clock.start()
        send_s = clock.now_s() - 0.5                  # sent half a second ago: started late
        request = requests_at([send_s])[0]
        got = await CascadeUnderTest(System(timing), clock, False).handle(request)  # type: ignore[arg-type]
        return got, send_s

    replayed, send_s = asyncio.run(record(StageTiming(0.0, 0.07, replayed=True)))
    assert replayed.ranking_due_s == pytest.approx(send_s + 0.07, abs=1e-9)
    live, send_s = asyncio.run(record(StageTiming(0.12, 0.0)))          # retrieval took longer
    assert live.ranking_due_s == pytest.approx(send_s + 0.12, abs=1e-9)
    no_stages, _ = asyncio.run(record(None))                  # given candidates: as measured
    assert no_stages.ranking_done_s - no_stages.ranking_due_s == pytest.approx(0.010, abs=1e-6)


def test_the_hand_over_lag_is_its_own_part_of_the_ranking_latency() -> None:
    """A request sent 0.5 s late, stages of 70 ms: the cascade called ranking at least 0.42 s
    after the request was due, then ranking took 10 ms (4 of them compute, 1 the hop). The lag
    is the ``handoff`` part, apart from the routing and hand-offs after the call (``other``)."""
    stages = StagesConfig(retrieval_delay_ms=40.0, preprocess_delay_ms=30.0)

    class System:
        config = SimpleNamespace(stages=stages)

        async def recommend(self, visit: Visit) -> SimpleNamespace:
            now = time.perf_counter()
            return SimpleNamespace(
                ranking_due_s=now - 0.010, ranking_done_s=now, path=RankPath.DEVICE_HIT,
                preinfer=None, prefix_tokens=3, suffix_tokens=0,
                candidates=torch.arange(1, 3), scores=torch.zeros(2),
                timing=RankTiming(0.0, 0.0, 0.004, 1, 0.004, 0.001),
                stages=StageTiming(0.0, 0.07, replayed=True))

    async def record() -> RequestRecord:
        clock = RunClock()
        clock.start()
        request = requests_at([clock.now_s() - 0.5])[0]
        return await CascadeUnderTest(System(), clock, False).handle(request)  # type: ignore[arg-type]

    got = asyncio.run(record())
    assert got.parts is not None
    assert got.parts.handoff_s >= 0.42
    assert got.ranking_latency_s - got.parts.handoff_s == pytest.approx(0.010, abs=1e-6)
    parts = latency_parts([got])["parts"]
    assert isinstance(parts, dict)
    assert parts["handoff"]["mean_ms"] == pytest.approx(got.parts.handoff_s * 1e3)
    assert parts["other"]["mean_ms"] == pytest.approx(5.0, abs=1e-3)   # 10 ms less 4 and 1
