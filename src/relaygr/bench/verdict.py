"""Headline figures derived from the measured points: reference points, ratios, the bar.

The bar (issue 5, on one machine in one full run): relay vs baseline >= 2x max sequence length
and >= 4x SLO-compliant throughput; relay ahead of ``reactive`` and not behind any ablation
(``relay-*`` modes) on throughput; relay's low-load overhead within 1.15x of the isolated cached
ranking latency; exactness within 1e-4.

Each target gets a ``TargetVerdict``: its figure, the interval the figure is known within, and
``met`` / ``missed`` / ``undecided`` / ``not measured``. A mode's answer is known within the
bracket its search left: the longest passing length up to the first failing length above it,
and the highest passing QPS up to the lowest failing QPS above it (exclusive; unbounded where
nothing failed, and where the fail was not believed: ``search.Standing.believed_fail``). The
ratio of two answers is then known within [low_a / high_b, high_a / low_b], and a target is met
only when the whole interval meets it, missed when none of it does. The overhead is known
within the interval ``bench.limit`` gives it (both medians' order-statistic intervals); without
one (too few relayed requests or passes) it is undecided, and without relayed requests not
measured. ``checks`` keeps the same names: true (met), false (missed), null.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from relaygr.bench.exactness import ExactnessReport
from relaygr.bench.report import LimitReport, ModeReport, TargetVerdict, ratio
from relaygr.bench.stats import PointStats

SEQ_LEN_TARGET, THROUGHPUT_TARGET = 2.0, 4.0
OVERHEAD_TARGET, EXACTNESS_TARGET = 1.15, 1e-4
# Requests compared before agreement counts as shown (the "at least 50 replayed").
EXACTNESS_MIN_REQUESTS = 50


def reference_point(mode: str, points: Sequence[PointStats], slo_ms: float) -> PointStats | None:
    """The point a mode's headline latency/hit/byte figures come from (see ``report``)."""
    mine = [p for p in points if p.mode == mode]
    for phase in ("throughput", "mixed"):
        passing = [p for p in mine if p.phase == phase and p.passed]
        if passing:
            return max(passing, key=lambda p: p.qps)
    standing = {p.prefix_len: p for p in mine if p.phase == "sweep"}   # the last round of each
    swept = [p for p in standing.values() if p.passed]
    if swept:
        return max(swept, key=lambda p: p.prefix_len or 0)
    return mine[0] if mine else None


def _figure(modes: Mapping[str, ModeReport], mode: str, attr: str) -> float | None:
    value = getattr(modes[mode], attr) if mode in modes else None
    return None if value is None else float(value)


def compute_ratios(modes: Mapping[str, ModeReport]) -> dict[str, float | None]:
    """relay over baseline / reactive for the headline figures (None when undefined)."""
    def r(attr: str, other: str) -> float | None:
        return ratio(_figure(modes, "relay", attr), _figure(modes, other, attr))

    return {"relay_vs_baseline_seq_len": r("max_seq_len_under_slo", "baseline"),
            "relay_vs_baseline_throughput": r("slo_throughput_qps", "baseline"),
            "relay_vs_reactive_throughput": r("slo_throughput_qps", "reactive"),
            "relay_vs_baseline_throughput_mixed": r("slo_throughput_qps_mixed", "baseline")}


Interval = tuple[float, float]


def _answer(modes: Mapping[str, ModeReport], mode: str, attr: str) -> Interval | None:
    """[low, high] of ``mode``'s answer for ``attr`` (high inf: unbounded), None: not run."""
    report = modes.get(mode)
    if report is None:
        return None
    if attr == "max_seq_len_under_slo":
        return None if report.sweep is None else report.sweep.bracket
    search = report.throughput if attr == "slo_throughput_qps" else report.mixed
    return None if search is None else search.interval


def ratio_interval(a: Interval | None, b: Interval | None) -> Interval | None:
    """Where a / b lies when a lies in ``a`` and b in ``b`` (0 / 0 is unknown: [0, inf])."""
    if a is None or b is None:
        return None
    low = a[0] / b[1] if b[1] > 0 else 0.0
    high = a[1] / b[0] if b[0] > 0 else math.inf
    return low, high


def _versus(name: str, value: float | None, interval: Interval | None,
            target: float) -> TargetVerdict:
    """A ratio of two answers that must reach ``target`` (or exceed it: the same rule). Each
    answer's bracket is half-open, [highest pass, lowest believed fail), so the ratio lies
    strictly above ``low`` (where ``low`` > 0) and strictly below ``high``: an end that
    touches the target decides it (a relay passing the rate a reactive failed is ahead of it)."""
    if interval is None:
        return TargetVerdict(name, value, None, None, target, "not measured")
    low, high = interval
    met = low >= target
    missed = high <= target
    status = "met" if met else "missed" if missed else "undecided"
    return TargetVerdict(name, value, low, high, target, status)


def _at_most(name: str, value: float | None, target: float,
             interval: Interval | None = None, exact: bool = False) -> TargetVerdict:
    """A figure that must not exceed ``target``, known within ``interval``; without one it
    is known exactly when ``exact`` (a computed figure), else not known well enough for a
    verdict (an estimate from too few samples)."""
    if value is None:
        return TargetVerdict(name, None, None, None, target, "not measured")
    if interval is None and not exact:
        return TargetVerdict(name, value, None, None, target, "undecided")
    low, high = (value, value) if interval is None else interval
    status = "met" if high <= target else "missed" if low > target else "undecided"
    return TargetVerdict(name, value, low, high, target, status)


def compute_verdicts(modes: Mapping[str, ModeReport], ratios: Mapping[str, float | None],
                     limit: LimitReport | None,
                     exactness: ExactnessReport | None) -> tuple[TargetVerdict, ...]:
    """Every target of the bar with its interval and status (see the module docstring)."""
    def interval(attr: str, other: str) -> Interval | None:
        return ratio_interval(_answer(modes, "relay", attr), _answer(modes, other, attr))

    rows = [
        _versus("relay_vs_baseline_seq_len_ge_2x", ratios.get("relay_vs_baseline_seq_len"),
                interval("max_seq_len_under_slo", "baseline"), SEQ_LEN_TARGET),
        _versus("relay_vs_baseline_throughput_ge_4x",
                ratios.get("relay_vs_baseline_throughput"),
                interval("slo_throughput_qps", "baseline"), THROUGHPUT_TARGET),
        _versus("relay_ahead_of_reactive", ratios.get("relay_vs_reactive_throughput"),
                interval("slo_throughput_qps", "reactive"), 1.0)]
    ablations = [m for m in modes if m.startswith("relay-")]
    behind = [_versus(m, None, interval("slo_throughput_qps", m), 1.0) for m in ablations]
    measured = [v for v in behind if v.status != "not measured"]
    status = ("not measured" if not measured else "missed" if any(
        v.status == "missed" for v in measured) else "met" if all(
        v.status == "met" for v in measured) else "undecided")
    lows = [v.low for v in measured if v.low is not None]
    highs = [v.high for v in measured if v.high is not None]
    rows.append(TargetVerdict("relay_not_behind_ablations", None, min(lows, default=None),
                              min(highs, default=None), 1.0, status))
    overhead = None if limit is None else limit.relay_overhead_ratio
    known = (None if limit is None or limit.relay_overhead_low is None
             or limit.relay_overhead_high is None
             else (limit.relay_overhead_low, limit.relay_overhead_high))
    rows.append(_at_most("relay_overhead_within_1_15x", overhead, OVERHEAD_TARGET, known))
    exact = (None if exactness is None or not exactness.requests_compared
             else exactness.max_abs_score_diff)
    row = _at_most("exactness_within_1e-4", exact, EXACTNESS_TARGET, exact=True)
    if row.status == "met" and exactness is not None \
            and exactness.requests_compared < EXACTNESS_MIN_REQUESTS:
        row = replace(row, status="undecided")   # agreement on too few requests to show it
    rows.append(row)
    return tuple(rows)


def compute_checks(verdicts: Sequence[TargetVerdict]) -> dict[str, bool | None]:
    """The verdicts as the bar's checks: met true, missed false, anything else null."""
    return {v.name: {"met": True, "missed": False}.get(v.status) for v in verdicts}
