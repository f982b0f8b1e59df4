"""The searches against oracles with known answers, and lock-step alternation of modes."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relaygr.bench.alternate import interleave, rotated, run_lockstep
from relaygr.bench.config import SweepConfig
from relaygr.bench.search import LengthSweep, QpsSearch, bracket_width
from relaygr.errors import ConfigError


def drive_qps(search: QpsSearch, capacity: float) -> None:
    """Oracle: P99 explodes past ``capacity``; passes iff qps <= capacity."""
    while (qps := search.next_point()) is not None:
        search.record(qps, 10.0 if qps <= capacity else 1e9, qps <= capacity)


@settings(max_examples=100, deadline=None)
@given(st.floats(1.0, 5000.0), st.floats(0.5, 50.0))
def test_qps_search_brackets_any_capacity(capacity: float, start: float) -> None:
    search = QpsSearch(start, growth=2.0, rel_tol=0.05, max_trials=30, min_qps=0.1,
                       max_qps=1e5)
    drive_qps(search, capacity)
    result = search.result()
    assert result.converged
    assert capacity / 1.05 <= result.best_qps <= capacity
    assert result.lowest_failing_qps is not None and result.lowest_failing_qps > capacity
    assert bracket_width(result) <= 0.05 + 1e-12
    assert all(t.passed == (t.point <= capacity) for t in result.trials)


def test_qps_search_ramp_then_bisection_sequence() -> None:
    search = QpsSearch(10.0, growth=2.0, rel_tol=0.1, max_trials=20)
    drive_qps(search, capacity=55.0)
    points = [t.point for t in search.result().trials]
    assert points == [10.0, 20.0, 40.0, 80.0, 60.0, 50.0, 55.0]  # 60 <= 55 x 1.1: done
    assert search.result().best_qps == 55.0


def test_qps_search_ramps_down_and_respects_bounds() -> None:
    down = QpsSearch(100.0, max_trials=20, min_qps=1.0)
    drive_qps(down, capacity=0.5)  # nothing passes
    assert down.result().best_qps == 0.0 and down.result().converged
    assert [t.point for t in down.result().trials][-1] == 1.0
    up = QpsSearch(100.0, max_trials=20, max_qps=300.0)
    drive_qps(up, capacity=1e9)
    assert up.result().best_qps == 300.0 and up.result().converged
    capped = QpsSearch(1.0, max_trials=3)
    drive_qps(capped, capacity=1e9)
    assert len(capped.result().trials) == 3 and not capped.result().converged
    with pytest.raises(ConfigError):
        QpsSearch(0.0)


def test_length_sweep_stops_after_first_failure_on_a_monotone_curve() -> None:
    sweep = LengthSweep((256, 512, 1024, 2048, 4096))
    p99 = {256: 10.0, 512: 20.0, 1024: 60.0, 2048: 200.0, 4096: 900.0}
    while (length := sweep.next_point()) is not None:
        sweep.record(length, p99[length], p99[length] <= 50.0)
    result = sweep.result()
    assert result.max_seq_len == 512 and result.first_failing_len == 1024
    assert result.monotone and [t.point for t in result.trials] == [256, 512, 1024]


def test_length_sweep_keeps_going_when_the_curve_dips() -> None:
    sweep = LengthSweep((256, 512, 1024, 2048))
    p99 = {256: 10.0, 512: 60.0, 1024: 40.0, 2048: 45.0}  # a noisy spike at 512
    while (length := sweep.next_point()) is not None:
        sweep.record(length, p99[length], p99[length] <= 50.0)
    result = sweep.result()
    # 512 failed on a curve that was still rising (monotone so far) -> stop there
    assert [t.point for t in result.trials] == [256, 512] and result.max_seq_len == 256

    sweep = LengthSweep((256, 512, 1024, 2048))
    p99 = {256: 30.0, 512: 20.0, 1024: 60.0, 2048: 45.0}  # dips before the first failure
    while (length := sweep.next_point()) is not None:
        sweep.record(length, p99[length], p99[length] <= 50.0)
    result = sweep.result()
    assert [t.point for t in result.trials] == [256, 512, 1024, 2048]
    assert result.max_seq_len == 2048 and not result.monotone
    assert result.first_failing_len == 1024


def test_length_sweep_from_a_start_walks_up_or_down() -> None:
    grid = (256, 384, 512, 768, 1024, 1536)
    p99 = {256: 10.0, 384: 20.0, 512: 30.0, 768: 45.0, 1024: 70.0, 1536: 120.0}
    up = LengthSweep(grid, start=512)
    while (length := up.next_point()) is not None:
        up.record(length, p99[length], p99[length] <= 50.0)
    assert [t.point for t in up.result().trials] == [512, 768, 1024]
    assert up.result().max_seq_len == 768

    down = LengthSweep(grid, start=512)   # the start fails: walk down until a length passes
    while (length := down.next_point()) is not None:
        down.record(length, p99[length], p99[length] <= 25.0)
    assert [t.point for t in down.result().trials] == [512, 384]
    assert down.result().max_seq_len == 384 and down.result().first_failing_len == 512

    nothing = LengthSweep(grid, start=384)
    while (length := nothing.next_point()) is not None:
        nothing.record(length, p99[length], False)
    assert [t.point for t in nothing.result().trials] == [384, 256]
    assert nothing.result().max_seq_len == 0
    with pytest.raises(ConfigError):
        LengthSweep(grid, start=300)


def test_sweep_config_gives_coarse_modes_every_other_length_through_the_start() -> None:
    grid = (256, 384, 512, 768, 1024, 1536, 2048)
    cfg = SweepConfig(lengths=grid, start=512, coarse_modes=("relay-no-expander",))
    assert cfg.grid("relay") == grid
    assert cfg.grid("relay-no-expander") == (256, 512, 1024, 2048)
    assert SweepConfig(lengths=grid, start=384, coarse_modes=("x",)).grid("x") == (384, 768,
                                                                                   1536)
    with pytest.raises(ConfigError):
        SweepConfig(lengths=grid, start=300)


def test_length_sweep_validates_grid() -> None:
    with pytest.raises(ConfigError):
        LengthSweep((512, 256))
    with pytest.raises(ConfigError):
        LengthSweep(())


def test_interleave_rotates_modes_point_by_point() -> None:
    pairs = list(interleave(["a", "b", "c"], [1, 2, 3, 4]))
    assert pairs == [(1, "a"), (1, "b"), (1, "c"), (2, "b"), (2, "c"), (2, "a"),
                     (3, "c"), (3, "a"), (3, "b"), (4, "a"), (4, "b"), (4, "c")]
    assert list(interleave(["a", "b"], [1, 2], rotate=False)) == [
        (1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert rotated([], 3) == []


def test_lockstep_advances_every_search_one_trial_per_round() -> None:
    capacities = {"baseline": 10.0, "relay": 100.0}
    searches = {m: QpsSearch(5.0, rel_tol=0.2, max_trials=6) for m in capacities}
    calls: list[tuple[str, float]] = []

    async def measure(mode: str, qps: float) -> tuple[float, bool]:
        calls.append((mode, qps))
        ok = qps <= capacities[mode]
        return (1.0 if ok else 99.0), ok

    trials = asyncio.run(run_lockstep(searches, measure))
    assert trials == len(calls) == 12
    # round k: both modes, the first mode alternating
    assert [m for m, _ in calls[:4]] == ["baseline", "relay", "relay", "baseline"]
    assert calls[0] == ("baseline", 5.0) and calls[1] == ("relay", 5.0)
    assert searches["baseline"].result().best_qps <= 10.0 < searches["relay"].result().best_qps


def drive(sweep: LengthSweep, rounds: dict[int, list[float]], slo_ms: float = 50.0) -> None:
    """Feed ``sweep`` the P99 of each round of each length it proposes."""
    seen: dict[int, int] = {}
    while (length := sweep.next_point()) is not None:
        k = seen[length] = seen.get(length, 0) + 1
        p99 = rounds[length][k - 1]
        sweep.record(length, p99, p99 <= slo_ms)


def test_confirmed_sweep_measures_both_knee_points_twice() -> None:
    grid = (256, 512, 1024, 2048)
    sweep = LengthSweep(grid, confirm=True)
    drive(sweep, {256: [10.0], 512: [30.0, 32.0], 1024: [60.0, 58.0]})
    result = sweep.result()
    assert [(t.point, t.round) for t in result.trials] == [(256, 1), (512, 1), (1024, 1),
                                                           (512, 2), (1024, 2)]
    assert result.max_seq_len == 512 and result.first_failing_len == 1024
    assert [t.p99_ms for t in result.latest()] == [10.0, 32.0, 58.0]
    plain = LengthSweep(grid)       # without confirm: the first verdicts stand
    drive(plain, {256: [10.0], 512: [30.0], 1024: [60.0]})
    assert [t.point for t in plain.result().trials] == [256, 512, 1024]
    # a dip below the knee: the plain sweep walks the rest of the grid, a confirmed one stops
    dips = {256: [30.0, 30.0], 512: [20.0, 22.0], 1024: [60.0, 61.0], 2048: [70.0]}
    plain = LengthSweep(grid)
    drive(plain, dips)
    assert [t.point for t in plain.result().trials] == [256, 512, 1024, 2048]
    confirmed = LengthSweep(grid, confirm=True)
    drive(confirmed, dips)
    assert [t.point for t in confirmed.result().trials] == [256, 512, 1024, 512, 1024]
    assert not confirmed.result().monotone and confirmed.result().max_seq_len == 512


def test_a_knee_point_that_flips_moves_the_knee() -> None:
    grid = (256, 512, 1024, 2048, 4096)
    # 1024 missed once (a hiccup); pooled with its second round it passes, so the sweep walks
    # on up to 2048, which fails twice
    up = LengthSweep(grid, start=512, confirm=True)
    drive(up, {512: [20.0, 22.0], 1024: [96.0, 40.0], 2048: [70.0, 75.0]})
    assert [(t.point, t.round) for t in up.result().trials] == [
        (512, 1), (1024, 1), (512, 2), (1024, 2), (2048, 1), (2048, 2)]
    assert up.result().max_seq_len == 1024
    # 512 passed once by luck; pooled it fails, so the knee is 256 / 512 and 256 is confirmed
    # (1024 is no longer at the knee and keeps its single round)
    down = LengthSweep(grid, confirm=True)
    drive(down, {256: [30.0, 31.0], 512: [48.0, 55.0], 1024: [80.0]})
    assert [(t.point, t.round) for t in down.result().trials] == [
        (256, 1), (512, 1), (1024, 1), (512, 2), (256, 2)]
    assert down.result().max_seq_len == 256 and down.result().first_failing_len == 512
    # nothing passes: the shortest failing length is confirmed, then the answer is 0
    none = LengthSweep(grid, start=512, confirm=True)
    drive(none, {512: [90.0], 256: [70.0, 60.0]})
    assert [(t.point, t.round) for t in none.result().trials] == [(512, 1), (256, 1), (256, 2)]
    assert none.result().max_seq_len == 0
