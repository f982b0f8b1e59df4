"""The length sweep against oracles with known answers, and lock-step alternation of modes
(the QPS search: ``test_qps_search.py``)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest

from relaygr.bench.alternate import Measure, interleave, rotated, run_lockstep
from relaygr.bench.config import SweepConfig
from relaygr.bench.decision import Verdict
from relaygr.bench.qps_search import QpsSearch
from relaygr.bench.search import LengthSweep, Outcome
from relaygr.bench.verdict import ratio_interval
from relaygr.errors import ConfigError


def judged(p99_ms: float, slo_ms: float = 50.0) -> Outcome:
    """An oracle's outcome: pass iff the P99 is within the SLO."""
    return Outcome(p99_ms, Verdict.PASS if p99_ms <= slo_ms else Verdict.FAIL)


def test_length_sweep_stops_at_a_fail_above_a_pass_measured_twice() -> None:
    sweep = LengthSweep((256, 512, 1024, 2048, 4096))
    p99 = {256: 10.0, 512: 20.0, 1024: 60.0, 2048: 200.0, 4096: 900.0}
    while (length := sweep.next_point()) is not None:
        sweep.record(length, judged(p99[length]))
    result = sweep.result()
    assert result.max_seq_len == 512 and result.first_failing_len == 1024
    # the fail that decides the answer is measured again, afresh; the pass below it stands
    assert [(t.point, t.round) for t in result.trials] == [(256, 1), (512, 1), (1024, 1),
                                                           (1024, 2)]


def test_length_sweep_from_a_start_walks_up_or_down() -> None:
    grid = (256, 384, 512, 768, 1024, 1536)
    p99 = {256: 10.0, 384: 20.0, 512: 30.0, 768: 45.0, 1024: 70.0, 1536: 120.0}
    up = LengthSweep(grid, start=512)
    while (length := up.next_point()) is not None:
        up.record(length, judged(p99[length]))
    assert [t.point for t in up.result().trials] == [512, 768, 1024, 1024]
    assert up.result().max_seq_len == 768

    down = LengthSweep(grid, start=512)   # the start fails: walk down until a length passes
    while (length := down.next_point()) is not None:
        down.record(length, judged(p99[length], 25.0))
    # 512 failed before anything passed; once 384 passes it is the deciding fail: again
    assert [t.point for t in down.result().trials] == [512, 384, 512]
    assert down.result().max_seq_len == 384 and down.result().first_failing_len == 512

    nothing = LengthSweep(grid, start=384)   # no pass: no fail decides anything, none again
    while (length := nothing.next_point()) is not None:
        nothing.record(length, Outcome(p99[length], Verdict.FAIL))
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


def run_oracle(sweep: LengthSweep, limit_len: int) -> None:
    """Measure ``sweep`` against a system that meets a 50 ms SLO up to ``limit_len`` tokens."""
    while (length := sweep.next_point()) is not None:
        sweep.record(length, judged(50.0 * length / limit_len))


def test_a_sweep_with_a_tolerance_narrows_its_grid_bracket_by_midpoints() -> None:
    grid = (384, 768, 1536, 3072)
    sweep = LengthSweep(grid, start=768, rel_tol=0.25, quantum_tokens=16)
    run_oracle(sweep, 1100)
    result = sweep.result()
    # the grid's bracket [768, 1536), then its geometric midpoints on multiples of 16:
    # sqrt(768 * 1536) = 1086 -> 1088 passes; sqrt(1088 * 1536) = 1293 -> 1296 fails (twice)
    assert [(t.point, t.round) for t in result.trials] == [
        (768, 1), (1536, 1), (1536, 2), (1088, 1), (1296, 1), (1296, 2)]
    assert result.bracket == (1088.0, 1296.0) and 1296 / 1088 < 1.25
    assert result.stopped_by == "answer" and result.lengths == (384, 768, 1088, 1296, 1536,
                                                                3072)
    assert result.answer_interval == (1088.0, 1088.0)
    # without a tolerance the grid's bracket is the answer, as before
    plain = LengthSweep(grid, start=768)
    run_oracle(plain, 1100)
    assert plain.result().bracket == (768.0, 1536.0) and plain.result().lengths == grid


def test_narrowed_brackets_decide_a_2x_bar_that_grid_brackets_cannot() -> None:
    """Relay 2.4x the baseline (2,640 against 1,100 tokens): on a 2x grid both brackets are a
    factor 2 wide, so their ratio lies within [1, 4] and a 2x bar stays undecided."""
    grid = (384, 768, 1536, 3072, 6144)
    brackets: dict[tuple[str, float | None], tuple[float, float]] = {}
    for tol in (None, 0.25):
        for name, limit_len in (("baseline", 1100), ("relay", 2640)):
            sweep = LengthSweep(grid, start=768, rel_tol=tol)
            run_oracle(sweep, limit_len)
            brackets[name, tol] = sweep.result().bracket
    assert ratio_interval(brackets["relay", None], brackets["baseline", None]) == (1.0, 4.0)
    narrowed = ratio_interval(brackets["relay", 0.25], brackets["baseline", 0.25])
    assert narrowed is not None and 2.0 <= narrowed[0] <= 2.4 <= narrowed[1]


def test_narrowing_steers_round_undecided_and_re_measured_midpoints() -> None:
    grid = (384, 768, 1536, 3072)
    # an undecided midpoint bounds nothing: the lower gap, from the pass to it, is halved next
    sweep = LengthSweep(grid, start=768, rel_tol=0.25)
    for length, verdict in [(768, Verdict.PASS), (1536, Verdict.FAIL), (1536, Verdict.FAIL),
                            (1088, Verdict.UNDECIDED), (912, Verdict.PASS),
                            (1296, Verdict.FAIL), (1296, Verdict.PASS)]:
        assert sweep.next_point() == length
        sweep.record(length, Outcome(1.0, verdict))
    # 1296 failed, then passed afresh: it stands as a pass, 1536 (failed twice) bounds it
    result = sweep.result()
    assert result.bracket == (1296.0, 1536.0) and result.undecided_lens == (1088,)
    assert sweep.next_point() is None     # 1536 / 1296 < 1.25
    # a gap with no multiple of the quantum inside ends the narrowing
    tight = LengthSweep((96, 112), rel_tol=0.01, quantum_tokens=16)
    for length, verdict in [(96, Verdict.PASS), (112, Verdict.FAIL), (112, Verdict.FAIL)]:
        assert tight.next_point() == length
        tight.record(length, Outcome(1.0, verdict))
    assert tight.next_point() is None and tight.result().stopped_by == "answer"


def test_sweep_config_narrows_the_modes_with_a_bar_on_length_only() -> None:
    cfg = SweepConfig(lengths=(384, 768, 1536, 3072), start=768, rel_tol=0.25,
                      coarse_modes=("reactive",), coarse_stride=1)
    narrowed, coarse = cfg.search("relay"), cfg.search("reactive")
    run_oracle(narrowed, 1100)
    run_oracle(coarse, 1100)
    assert narrowed.result().bracket == (1088.0, 1296.0)
    assert coarse.result().bracket == (768.0, 1536.0)
    # the modes swept at all, in the run's order
    assert cfg.swept(("relay", "reactive")) == ("relay", "reactive")
    assert replace(cfg, modes=("baseline", "relay")).swept(("relay", "reactive")) == ("relay",)
    for bad in ({"rel_tol": 0.0}, {"quantum_tokens": 0}):
        with pytest.raises(ConfigError):
            SweepConfig(lengths=(384, 768), **bad)
        with pytest.raises(ConfigError):
            LengthSweep((384, 768), **bad)


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


def searches_against_capacities(capacities: dict[str, float], rel_tol: float
                                ) -> tuple[dict[str, QpsSearch], Measure[float],
                                           list[tuple[str, float]]]:
    """A QPS search per mode from 5 QPS, an oracle measuring each mode as passing up to its
    capacity, and the (mode, QPS) of every point measured."""
    searches = {m: QpsSearch(5.0, rel_tol=rel_tol) for m in capacities}
    calls: list[tuple[str, float]] = []

    async def measure(mode: str, qps: float) -> Outcome:
        calls.append((mode, qps))
        return judged(1.0 if qps <= capacities[mode] else 99.0)

    return searches, measure, calls


def test_lockstep_advances_every_search_one_trial_per_round() -> None:
    capacities = {"baseline": 10.0, "relay": 100.0}
    searches, measure, calls = searches_against_capacities(capacities, rel_tol=0.2)

    trials = asyncio.run(run_lockstep(searches, measure))
    assert trials == len(calls) == sum(len(s.result().trials) for s in searches.values())
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
        sweep.record(length, judged(p99, slo_ms))


def test_a_sweep_stops_when_its_budget_is_spent_and_says_so() -> None:
    """Each point's cost counts against the budget; the point that crosses it still counts,
    nothing more is proposed, and the result keeps what was decided with an open bracket."""
    grid = (256, 512, 1024, 2048, 4096)
    sweep = LengthSweep(grid, start=512, budget_s=30.0)
    for length, seconds in [(512, 17.0), (1024, 17.0)]:
        assert sweep.next_point() == length
        sweep.record(length, Outcome(20.0, Verdict.PASS, seconds))
    assert sweep.next_point() is None
    result = sweep.result()
    assert (result.stopped_by, result.spent_s) == ("budget", 34.0)
    assert result.max_seq_len == 1024 and result.answer_interval == (1024.0, float("inf"))
    done = LengthSweep(grid, start=4096, budget_s=30.0)   # the walk ends on the point that
    done.record(4096, Outcome(20.0, Verdict.PASS, 40.0))   # overspends: the answer stopped it
    assert done.next_point() is None
    assert (done.result().stopped_by, done.result().spent_s) == ("answer", 40.0)
    # the budget runs out between a fail and its re-measure: that fail is not believed yet,
    # so it bounds nothing (the bracket stays open above)
    cut = LengthSweep(grid, start=256, budget_s=30.0)
    cut.record(256, Outcome(20.0, Verdict.PASS, 17.0))
    cut.record(512, Outcome(90.0, Verdict.FAIL, 14.0))
    assert cut.next_point() is None
    result = cut.result()
    assert (result.stopped_by, result.failing_above_len) == ("budget", None)
    assert result.answer_interval == (256.0, float("inf"))
    with pytest.raises(ConfigError):
        LengthSweep(grid, budget_s=0.0)


def test_a_miss_that_does_not_repeat_lets_the_sweep_walk_on() -> None:
    """The fifth full run's case: relay's 1,024-token point missed once at P99 96 ms while the
    same point measured alone gave 26.5 and 42.2 ms. Measured again, it passes, and the sweep
    walks on up to the next fail, which is measured twice in turn."""
    grid = (256, 512, 1024, 2048, 4096)
    sweep = LengthSweep(grid, start=512)
    drive(sweep, {512: [20.0], 1024: [96.0, 40.0], 2048: [70.0, 75.0]})
    assert [(t.point, t.round) for t in sweep.result().trials] == [
        (512, 1), (1024, 1), (1024, 2), (2048, 1), (2048, 2)]
    result = sweep.result()
    assert result.max_seq_len == 1024 and result.failing_above_len == 2048
    assert [t.p99_ms for t in result.latest()] == [20.0, 40.0, 75.0]   # the standing verdicts
    # a re-measure that cannot tell (undecided) bounds nothing either: the sweep walks on
    undecided = LengthSweep(grid)
    for length, verdict in [(256, Verdict.PASS), (512, Verdict.FAIL),
                            (512, Verdict.UNDECIDED), (1024, Verdict.PASS),
                            (2048, Verdict.FAIL), (2048, Verdict.FAIL)]:
        assert undecided.next_point() == length
        undecided.record(length, Outcome(1.0, verdict))
    assert undecided.next_point() is None and undecided.result().max_seq_len == 1024


def test_the_sweep_walks_past_undecided_lengths_and_reports_them() -> None:
    grid = (256, 512, 1024, 2048, 4096)
    sweep = LengthSweep(grid)
    verdicts = {256: Verdict.PASS, 512: Verdict.PASS, 1024: Verdict.UNDECIDED,
                2048: Verdict.FAIL}
    while (length := sweep.next_point()) is not None:
        sweep.record(length, Outcome(float(length) / 40, verdicts[length]))
    result = sweep.result()
    assert [t.point for t in result.trials] == [256, 512, 1024, 2048, 2048]
    assert result.max_seq_len == 512 and result.failing_above_len == 2048
    assert result.undecided_lens == (1024,)
    assert result.answer_interval == (512.0, 1024.0)   # the grid answer is 512 or 1024
    # a start that is undecided walks down until a length passes; nothing failed above it
    down = LengthSweep(grid, start=1024)
    down.record(1024, Outcome(40.0, Verdict.UNDECIDED))
    assert down.next_point() == 512
    down.record(512, Outcome(30.0, Verdict.PASS))
    assert down.next_point() == 2048        # above the highest measured
    down.record(2048, Outcome(45.0, Verdict.UNDECIDED))
    down.record(4096, Outcome(49.0, Verdict.UNDECIDED))
    assert down.next_point() is None and down.result().answer_interval == (512.0, math.inf)


def test_a_halted_search_proposes_nothing_and_says_the_deadline_stopped_it() -> None:
    """The run's deadline halts a search from outside: what it decided stands, its result says
    ``deadline``; a search whose walk was already done keeps its own reason."""
    sweep = LengthSweep((256, 512, 1024), start=256)
    sweep.record(256, Outcome(20.0, Verdict.PASS, 17.0))
    sweep.halt()
    assert sweep.next_point() is None
    result = sweep.result()
    assert (result.stopped_by, result.max_seq_len) == ("deadline", 256)
    assert result.answer_interval == (256.0, float("inf"))
    search = QpsSearch(8.0)
    search.record(8.0, Outcome(20.0, Verdict.PASS, 16.0))
    search.halt()
    assert search.next_point() is None
    assert (search.result().stopped_by, search.result().best_qps) == ("deadline", 8.0)
    done = LengthSweep((256,))
    done.record(256, Outcome(20.0, Verdict.PASS, 17.0))
    done.halt()
    assert done.result().stopped_by == "answer"
    # halted after one fail, nothing passed and nothing below it measured: the fail may be a
    # hiccup, so it bounds nothing; walked down to the bottom, every length failing, it does
    cut = LengthSweep((256, 512, 1024), start=1024)
    cut.record(1024, Outcome(90.0, Verdict.FAIL, 17.0))
    cut.halt()
    assert cut.result().failing_above_len is None and cut.result().bracket == (0.0, math.inf)
    bottom = LengthSweep((256, 512), start=512)
    for length in (512, 256):
        bottom.record(length, Outcome(90.0, Verdict.FAIL, 17.0))
    assert bottom.next_point() is None and bottom.result().bracket == (0.0, 256.0)
    rates = QpsSearch(32.0)
    rates.record(32.0, Outcome(90.0, Verdict.FAIL, 16.0))
    rates.halt()
    assert rates.result().lowest_failing_qps is None
    assert rates.result().interval == (0.0, math.inf)


def test_lockstep_halts_every_search_at_the_first_point_that_does_not_fit() -> None:
    """``fits`` is asked before each point: the relay's search climbs past 40 QPS, where no
    point fits any more; that halts both searches in the same round, so neither mode is
    measured a round more than the other, and both results say ``deadline``."""
    capacities = {"baseline": 30.0, "relay": 100.0}
    searches, measure, measured = searches_against_capacities(capacities, rel_tol=0.01)

    asyncio.run(run_lockstep(searches, measure, fits=lambda qps: qps <= 40.0))
    assert max(q for _, q in measured) <= 40.0
    rounds = {m: sum(1 for n, _ in measured if n == m) for m in capacities}
    assert abs(rounds["baseline"] - rounds["relay"]) <= 1
    assert {m: s.result().stopped_by for m, s in searches.items()} == \
        {"baseline": "deadline", "relay": "deadline"}
    assert searches["relay"].result().best_qps == 40.0


def test_a_midpoint_failed_once_when_time_ran_out_leaves_the_re_measured_fail_as_the_bound(
        ) -> None:
    """Narrowing: 1,536 failed twice above 768's pass, then the midpoint 1,088 failed once and
    the run's deadline came before its re-measure. The bracket's upper end is 1,536 (believed),
    not open: a fail measured once is no bound, but the one above it was measured twice."""
    sweep = LengthSweep((384, 768, 1536, 3072), start=768, rel_tol=0.25)
    for length, verdict in [(768, Verdict.PASS), (1536, Verdict.FAIL), (1536, Verdict.FAIL),
                            (1088, Verdict.FAIL)]:
        assert sweep.next_point() == length
        sweep.record(length, Outcome(1.0, verdict))
    assert sweep.next_point() == 1088          # its re-measure, next
    sweep.halt()
    result = sweep.result()
    assert result.stopped_by == "deadline" and result.bracket == (768.0, 1536.0)
    # the same in the QPS search: 64 failed twice above 32, 48 failed once, then the deadline
    search = QpsSearch(32.0, rel_tol=0.1)
    for qps, verdict in [(32.0, Verdict.PASS), (64.0, Verdict.FAIL), (64.0, Verdict.FAIL),
                         (48.0, Verdict.FAIL)]:
        assert search.next_point() == qps
        search.record(qps, Outcome(1.0, verdict))
    search.halt()
    assert search.result().interval == (32.0, 64.0)
