"""The SLO-throughput search against oracles with known capacities, undecided bands, spikes
and time budgets."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.bench.config import PointBudget, QpsSearchConfig, ThroughputConfig
from relaygr.bench.decision import P99Rule, Verdict
from relaygr.bench.qps_search import QpsSearch, bracket_width
from relaygr.bench.search import Outcome
from relaygr.errors import ConfigError

Oracle = Callable[[float, int], Verdict]     # (rate, how many times measured before) -> verdict


def capacity_oracle(capacity: float, undecided_below: float = 0.0) -> Oracle:
    """Fails above ``capacity``; passes at or below it, except undecided in
    (``undecided_below``, capacity]: too close to the SLO for a point's sample to tell."""
    def verdict(qps: float, _seen: int) -> Verdict:
        if qps > capacity:
            return Verdict.FAIL
        return Verdict.UNDECIDED if qps > undecided_below > 0 else Verdict.PASS
    return verdict


def drive(search: QpsSearch, oracle: Oracle, cost_s: float = 1.0) -> list[tuple[float, str]]:
    """Run the search to its end; each point costs ``cost_s``. Returns (rate, verdict)s."""
    seen: dict[float, int] = {}
    while (qps := search.next_point()) is not None:
        verdict = oracle(qps, seen.get(qps, 0))
        seen[qps] = seen.get(qps, 0) + 1
        search.record(qps, Outcome(10.0 if verdict is Verdict.PASS else 99.0, verdict, cost_s))
    return [(t.point, t.verdict.value) for t in search.result().trials]


@settings(max_examples=100, deadline=None)
@given(st.floats(1.0, 5000.0), st.floats(0.5, 50.0))
def test_brackets_any_capacity(capacity: float, start: float) -> None:
    search = QpsSearch(start, growth=2.0, rel_tol=0.05, min_qps=0.1, max_qps=1e5)
    drive(search, capacity_oracle(capacity))
    result = search.result()
    assert result.converged and result.stopped_by == "resolution"
    assert capacity / 1.05 <= result.best_qps <= capacity
    assert result.lowest_failing_qps is not None and result.lowest_failing_qps > capacity
    assert bracket_width(result) <= 0.05 + 1e-12
    assert all(t.passed == (t.point <= capacity) for t in result.trials)


def test_ramp_remeasure_then_bisection_sequence() -> None:
    search = QpsSearch(10.0, growth=2.0, rel_tol=0.1)
    trials = drive(search, capacity_oracle(55.0))
    # 80 fails above a pass: measured again before it is believed; so is 60
    assert trials == [(10.0, "pass"), (20.0, "pass"), (40.0, "pass"), (80.0, "fail"),
                      (80.0, "fail"), (60.0, "fail"), (60.0, "fail"), (50.0, "pass"),
                      (55.0, "pass")]                              # 60 <= 55 x 1.1: done
    assert search.result().best_qps == 55.0 and search.result().lowest_failing_qps == 60.0
    assert [t.round for t in search.result().trials][3:5] == [1, 2]


def test_a_capacity_above_the_old_trial_cap_is_found() -> None:
    """The quick plan stopped after 3 trials (4, 8, 16 QPS) with P99 far under the SLO; the
    search climbs until a rate fails, however many steps."""
    search = QpsSearch(4.0, growth=2.0, rel_tol=0.2)
    trials = drive(search, capacity_oracle(100.0))
    assert [q for q, _ in trials[:6]] == [4.0, 8.0, 16.0, 32.0, 64.0, 128.0]
    result = search.result()
    assert 100.0 / 1.2 <= result.best_qps <= 100.0 < result.interval[1] <= 128.0
    assert len(trials) > 3 and result.converged


def test_a_single_spike_is_measured_again_and_the_climb_goes_on() -> None:
    """A spike fails 16 QPS once (the motivating run's failure); the re-measure passes, so the
    search climbs on instead of going down."""
    def spiky(qps: float, seen: int) -> Verdict:
        if qps == 16.0 and seen == 0:
            return Verdict.FAIL
        return capacity_oracle(40.0)(qps, seen)

    search = QpsSearch(4.0, rel_tol=0.3)
    trials = drive(search, spiky)
    assert trials[:5] == [(4.0, "pass"), (8.0, "pass"), (16.0, "fail"), (16.0, "pass"),
                          (32.0, "pass")]
    assert 40.0 / 1.3 <= search.result().best_qps <= 40.0


def test_undecided_rates_bound_nothing_and_are_probed_around() -> None:
    # passes up to 30, undecided in (30, 40], fails above 40
    search = QpsSearch(10.0, rel_tol=0.1)
    trials = drive(search, capacity_oracle(40.0, undecided_below=30.0))
    result = search.result()
    assert 30.0 / 1.1 <= result.best_qps <= 30.0
    assert result.lowest_failing_qps is not None and result.lowest_failing_qps > 40.0
    assert result.undecided_qps and all(30.0 < q <= 40.0 for q in result.undecided_qps)
    assert result.converged and not any(v == "fail" and q <= 40.0 for q, v in trials)
    # everything undecided on the way up: it climbs until a fail, then descends to a pass;
    # the fail at 32, above a pass from then on, is measured again before it is believed
    search = QpsSearch(8.0, rel_tol=0.3, min_qps=1.0)
    trials = drive(search, capacity_oracle(20.0, undecided_below=3.0))
    assert trials[:6] == [(8.0, "undecided"), (16.0, "undecided"), (32.0, "fail"),
                          (4.0, "undecided"), (2.0, "pass"), (32.0, "fail")]
    result = search.result()
    assert result.interval == (3.0, 24.0) and result.converged
    # the ends closed in from both sides; nothing was probed between two undecided rates
    assert set(result.undecided_qps) == {3.5, 4.0, 8.0, 16.0, 20.0} and len(trials) == 11


def test_the_time_budget_ends_the_search_and_says_so() -> None:
    search = QpsSearch(4.0, rel_tol=0.01, budget_s=5.0)
    trials = drive(search, capacity_oracle(1000.0), cost_s=2.0)
    result = search.result()
    assert len(trials) == 3 and result.spent_s == 6.0      # the third started within budget
    assert result.stopped_by == "budget" and not result.converged
    assert result.best_qps == 16.0 and math.isinf(result.interval[1])
    # spent between a fail and its re-measure: that fail bounds nothing until it is believed
    cut = QpsSearch(4.0, budget_s=5.0)
    cut.record(4.0, Outcome(10.0, Verdict.PASS, 3.0))
    cut.record(8.0, Outcome(90.0, Verdict.FAIL, 3.0))
    assert cut.next_point() is None and cut.result().interval == (4.0, math.inf)


def test_bounds_end_the_search() -> None:
    down = QpsSearch(100.0, min_qps=1.0)
    drive(down, capacity_oracle(0.5))    # nothing passes
    assert down.result().best_qps == 0.0 and down.result().stopped_by == "min_qps"
    assert down.result().trials[-1].point == 1.0 and down.result().interval == (0.0, 1.0)
    up = QpsSearch(100.0, max_qps=300.0)
    drive(up, capacity_oracle(1e9))
    assert up.result().best_qps == 300.0 and up.result().stopped_by == "max_qps"
    with pytest.raises(ConfigError):
        QpsSearch(0.0)
    with pytest.raises(ConfigError):
        QpsSearch(1.0, budget_s=0.0)


def test_a_search_starts_on_its_grid_near_a_share_of_the_baselines_capacity() -> None:
    cfg = QpsSearchConfig(start_qps=16.0, growth=2.0, max_qps=2000.0)
    # the grid's 16, 32, 64, ...: its highest rate at or below the one asked
    assert cfg.started_near(39.0).start_qps == 32.0
    assert cfg.started_near(32.0).start_qps == 32.0       # exactly on the grid: that rate
    assert cfg.started_near(31.9).start_qps == 16.0
    assert cfg.started_near(12.0) is cfg                  # never below start_qps
    assert cfg.started_near(1e9).start_qps == 1024.0      # on the grid below max_qps
    for rate in (math.inf, math.nan, 0.0, -5.0):
        assert cfg.started_near(rate) is cfg
    assert cfg.started_near(39.0).min_qps == cfg.min_qps
    with pytest.raises(ConfigError, match="growth"):
        QpsSearchConfig(growth=1.0)
    # the throughput phase asks for a share of the baseline's capacity (None: not measured)
    phase = ThroughputConfig(search=cfg, start_capacity_share=0.2)
    assert phase.search_near(195.0).start_qps == 32.0     # 0.2 x 195 = 39
    assert phase.search_near(None) is cfg
    assert ThroughputConfig(search=cfg).search_near(1e4) is cfg     # no share: start_qps
    for share in (0.0, 1.5):
        with pytest.raises(ConfigError, match="start_capacity_share"):
            ThroughputConfig(start_capacity_share=share)


def test_a_point_is_never_sized_where_its_p99_rule_cannot_pass() -> None:
    """The sequential rule is computed per power of two: 257 to 269 requests at 90 % take the
    rule of 512, which passes a clean point at 270 only; such a point is sized 256."""
    budget = PointBudget(measured_requests=512, min_measured_requests=230, max_point_s=16.0,
                         confidence=0.9)
    sizes = {qps: budget.measured_at(qps) for qps in (14.0, 16.0, 16.1, 16.8, 16.9, 32.0)}
    assert sizes == {14.0: 230, 16.0: 256, 16.1: 256, 16.8: 256, 16.9: 270, 32.0: 512}
    for tenth in range(140, 330):
        n = budget.measured_at(tenth / 10)
        assert P99Rule(0.9).sequential(n).min_samples_to_pass() <= n, (tenth, n)
