"""The verdict table: ratio intervals from the searches' brackets, and each target's status."""

from __future__ import annotations

import math

from relaygr.bench.decision import Verdict
from relaygr.bench.exactness import ExactnessReport
from relaygr.bench.qps_search import QpsSearchResult
from relaygr.bench.report import LimitReport, ModeReport
from relaygr.bench.search import LengthSweepResult, Trial
from relaygr.bench.verdict import compute_checks, compute_ratios, compute_verdicts, ratio_interval

GRID = (256, 512, 1024, 2048, 4096)


def mode(name: str, max_len: int, fail_len: int | None, qps: float,
         fail_qps: float | None) -> ModeReport:
    sweep = LengthSweepResult(max_len, fail_len, (Trial(max_len, 1.0, Verdict.PASS),),
                              fail_len, (), GRID)
    search = QpsSearchResult(qps, fail_qps, True, (Trial(qps, 1.0, Verdict.PASS),))
    return ModeReport(name, max_len, qps, None, None, sweep, search, None)


def verdicts(modes: dict[str, ModeReport]) -> dict[str, tuple[float | None, float | None, str]]:
    rows = compute_verdicts(modes, compute_ratios(modes), None, None)
    return {v.name: (v.low, v.high, v.status) for v in rows}


def test_ratio_interval_divides_the_ends_crosswise() -> None:
    assert ratio_interval((30.0, 40.0), (6.0, 8.0)) == (30.0 / 8.0, 40.0 / 6.0)
    assert ratio_interval((30.0, math.inf), (6.0, 8.0)) == (3.75, math.inf)
    assert ratio_interval((30.0, 40.0), (0.0, 4.0)) == (7.5, math.inf)   # nothing passed
    assert ratio_interval(None, (1.0, 2.0)) is None


def test_targets_are_met_missed_or_undecided_by_their_whole_interval() -> None:
    # lengths: relay in [2048, 4096), baseline in [512, 1024): the ratio in [2, 8): met (the
    # grid answers' 4x is one point of it)
    # throughput: relay in [40, 48), baseline in [8, 9.6): ratio in [4.17, 6.0): met
    modes = {"baseline": mode("baseline", 512, 1024, 8.0, 9.6),
             "reactive": mode("reactive", 512, 2048, 30.0, 60.0),
             "relay": mode("relay", 2048, 4096, 40.0, 48.0)}
    rows = verdicts(modes)
    assert rows["relay_vs_baseline_seq_len_ge_2x"] == (2.0, 8.0, "met")
    low, high, status = rows["relay_vs_baseline_throughput_ge_4x"]
    assert (low, high, status) == (40.0 / 9.6, 48.0 / 8.0, "met")
    # reactive in [30, 60): relay 40-48 may be behind it: undecided, not a miss
    assert rows["relay_ahead_of_reactive"] == (40.0 / 60.0, 48.0 / 30.0, "undecided")
    assert rows["relay_not_behind_ablations"][2] == "not measured"
    assert rows["relay_overhead_within_1_15x"][2] == "not measured"
    # an undecided length between the baseline's pass and fail widens its interval
    modes["baseline"] = mode("baseline", 512, 2048, 8.0, 9.6)
    assert verdicts(modes)["relay_vs_baseline_seq_len_ge_2x"] == (1.0, 8.0, "undecided")
    # grid answers 2x apart with adjacent fails (relay 2048 <= x < 4096, baseline 1024 <= y <
    # 2048): the lengths themselves may be anywhere from 1x to 4x apart
    modes["baseline"] = mode("baseline", 1024, 2048, 8.0, 9.6)
    assert verdicts(modes)["relay_vs_baseline_seq_len_ge_2x"] == (1.0, 4.0, "undecided")
    # a baseline that failed even the shortest length: known below it, so the ratio from below
    modes["baseline"] = mode("baseline", 0, 256, 8.0, 9.6)
    assert verdicts(modes)["relay_vs_baseline_seq_len_ge_2x"] == (8.0, math.inf, "met")
    modes["baseline"] = mode("baseline", 512, 4096, 8.0, 9.6)
    assert verdicts(modes)["relay_vs_baseline_seq_len_ge_2x"] == (0.5, 8.0, "undecided")
    # a relay that nothing failed above is known only from below
    modes["relay"] = mode("relay", 2048, None, 20.0, 30.0)
    rows = verdicts(modes)
    assert rows["relay_vs_baseline_seq_len_ge_2x"] == (0.5, math.inf, "undecided")
    assert rows["relay_vs_baseline_throughput_ge_4x"] == (20.0 / 9.6, 30.0 / 8.0, "missed")
    checks = compute_checks(compute_verdicts(modes, compute_ratios(modes), None, None))
    assert checks["relay_vs_baseline_throughput_ge_4x"] is False
    assert checks["relay_vs_baseline_seq_len_ge_2x"] is None


def test_the_overhead_is_met_missed_or_undecided_by_its_interval() -> None:
    def status(low: float | None, high: float | None, value: float = 1.1) -> tuple:
        limit = LimitReport("relay", 1.0, 100, 4, 8, 8.0, 8.8, 12.0, 1.0, value, None, None,
                            None, relay_overhead_low=low, relay_overhead_high=high)
        rows = compute_verdicts({}, {}, limit, None)
        row = next(v for v in rows if v.name == "relay_overhead_within_1_15x")
        return row.low, row.high, row.status

    assert status(1.02, 1.14) == (1.02, 1.14, "met")
    assert status(1.16, 1.30, 1.2) == (1.16, 1.30, "missed")
    assert status(1.05, 1.25) == (1.05, 1.25, "undecided")
    # no interval (too few relayed requests or passes): an estimate, not a verdict
    assert status(None, None) == (None, None, "undecided")


def test_exactness_is_shown_on_enough_requests_only() -> None:
    """The issue's bar: agreement on at least 50 replayed requests; on fewer (say most of them
    failed in one run) it is not shown, whatever their scores; a difference above the target
    is a miss however few."""
    def status(compared: int, diff: float) -> str:
        report = ExactnessReport("baseline", "relay", compared, compared * 8, diff, {},
                                 requests_unanswered=60 - compared)
        rows = compute_verdicts({}, {}, None, report)
        return next(v.status for v in rows if v.name == "exactness_within_1e-4")

    assert status(60, 3e-7) == "met" and status(50, 3e-7) == "met"
    assert status(1, 0.0) == "undecided" and status(49, 3e-7) == "undecided"
    assert status(1, 0.5) == "missed"


def test_an_interval_end_that_touches_the_target_decides_it() -> None:
    """Brackets are half-open, [pass, fail): a ratio's interval excludes both its ends."""
    # relay passed 64 QPS, reactive failed it: relay in [64, 128), reactive in [32, 64): ahead
    modes = {"baseline": mode("baseline", 768, 1536, 8.0, 16.0),
             "reactive": mode("reactive", 768, 1536, 32.0, 64.0),
             "relay": mode("relay", 1536, None, 64.0, 128.0)}
    assert verdicts(modes)["relay_ahead_of_reactive"] == (1.0, 4.0, "met")
    # relay failed 1,536 tokens, the baseline passed 768: the ratio is under 2
    modes["relay"] = mode("relay", 768, 1536, 64.0, 128.0)
    assert verdicts(modes)["relay_vs_baseline_seq_len_ge_2x"] == (0.5, 2.0, "missed")
    # relay failed 64 QPS where an ablation passed it: behind it
    modes["relay"] = mode("relay", 768, None, 32.0, 64.0)
    modes["relay-no-trigger"] = mode("relay-no-trigger", 768, None, 64.0, 128.0)
    assert verdicts(modes)["relay_not_behind_ablations"][2] == "missed"
