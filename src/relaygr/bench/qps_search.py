"""The SLO-throughput search: bracket the highest passing Poisson QPS, then narrow the bracket.

``QpsSearch`` is a strategy object driven from outside (``relaygr.bench.search.Search``): it
proposes a rate, is told the outcome (P99, ``Verdict``, seconds spent), and says when it is done.
Every mode's throughput goes through the same procedure:

1. **Up.** From ``start_qps``, x ``growth`` above the highest rate measured, for as long as no
   rate has failed above the highest passing one, however many steps that takes: neither a
   trial count nor an undecided point stops the climb (an undecided point bounds nothing).
2. **Re-measure before believing.** The fail that decides the answer (the lowest failing
   rate above the highest passing one) is measured once more, afresh, and the second verdict
   stands: the rule the length sweep shares (``relaygr.bench.search.Standing``).
3. **Down.** When nothing has passed below the lowest fail, / ``growth`` below the lowest rate
   measured, down to ``min_qps``.
4. **Narrow.** With a pass ``lo`` and a believed fail ``hi`` above it, the answer lies in
   [lo, hi). The search bisects the gap from ``lo`` to the next rate measured above it, then
   the gap from the highest rate measured below ``hi`` to ``hi``, until both are within
   ``rel_tol`` (relative to their lower ends). Without undecided rates the two gaps are one
   (plain bisection); undecided rates between them bound nothing, so the bracket stays as
   wide as they make it, and the result lists them.

All of it within ``budget_s`` seconds of measuring (the outcomes' ``duration_s``): the search
proposes nothing once its budget is spent, nor once halted (the run's deadline), and the result
then says which (``stopped_by``). The
answer is the highest passing rate (0 when none passed), with the bracket it is known within.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from relaygr.bench.decision import Verdict
from relaygr.bench.search import Outcome, Standing, Trial, stop_reason
from relaygr.errors import ConfigError


@dataclass(frozen=True)
class QpsSearchResult:
    """The answer and how far it is known.

    ``best_qps`` (0: none passed) <= the true SLO throughput < ``lowest_failing_qps`` (None:
    nothing failed above it, the answer is a lower bound). ``undecided_qps`` lie in the
    bracket's range or beyond and bound nothing. ``stopped_by``: ``resolution`` (every gap of
    the bracket within ``rel_tol``), ``max_qps`` / ``min_qps`` (a bound reached),
    ``budget`` (its time spent first) or ``deadline`` (the run's time up first).
    """

    best_qps: float
    lowest_failing_qps: float | None
    converged: bool
    trials: tuple[Trial[float], ...]
    stopped_by: str = "resolution"
    spent_s: float = 0.0
    undecided_qps: tuple[float, ...] = ()

    @property
    def interval(self) -> tuple[float, float]:
        """[lower, upper) bounds of the SLO throughput (upper inf when unbounded)."""
        return self.best_qps, (math.inf if self.lowest_failing_qps is None
                               else self.lowest_failing_qps)


def bracket_width(result: QpsSearchResult) -> float:
    """Relative width of the final bracket (inf when unbracketed)."""
    low, high = result.interval
    return math.inf if not low or math.isinf(high) else high / low - 1


class QpsSearch:
    """Highest passing QPS: up until a fail, re-measure it, then narrow (module docstring)."""

    def __init__(self, start_qps: float, growth: float = 2.0, rel_tol: float = 0.05,
                 budget_s: float = math.inf, min_qps: float = 0.1,
                 max_qps: float = 1e6) -> None:
        if not (0 < min_qps <= start_qps <= max_qps and growth > 1 and rel_tol > 0):
            raise ConfigError("QpsSearch needs 0 < min_qps <= start_qps <= max_qps, "
                              "growth > 1 and rel_tol > 0")
        if not budget_s > 0:
            raise ConfigError(f"QpsSearch needs budget_s > 0, got {budget_s}")
        self._start, self._growth, self._tol = start_qps, growth, rel_tol
        self._budget_s, self._min, self._max = budget_s, min_qps, max_qps
        self._halted = False
        self._standing: Standing[float] = Standing()

    def _open_gap(self, lo: float, hi: float) -> float | None:
        """Midpoint of the bracket's lower gap (``lo`` to the next rate measured above it) or
        else its upper gap (the highest rate measured below ``hi`` to ``hi``), whichever is
        wider than ``rel_tol`` first; None when neither is. Undecided rates between the two
        gaps are not probed among: the sample there cannot tell, and ends move only by
        decided verdicts."""
        return next(((a + b) / 2 for a, b in self._standing.gaps(lo, hi)
                     if b > a * (1 + self._tol)), None)

    def _plan(self) -> tuple[float | None, str]:
        """The next rate, or None and why the search is done."""
        standing = self._standing
        if not standing.latest:
            return self._start, ""
        again = standing.recheck()
        if again is not None:
            return again, ""
        lo, hi = standing.highest_pass(), standing.deciding_fail()
        rates = standing.points()
        if hi is None:       # nothing failed above the highest pass: climb
            top = rates[-1]
            return (None, "max_qps") if top >= self._max else (min(top * self._growth,
                                                                    self._max), "")
        if lo is None:       # nothing passed below the lowest fail: descend
            bottom = rates[0]
            return (None, "min_qps") if bottom <= self._min else (max(bottom / self._growth,
                                                                       self._min), "")
        gap = self._open_gap(lo, hi)
        return (gap, "") if gap is not None else (None, "resolution")

    def next_point(self) -> float | None:
        if self._halted or self._standing.spent_s >= self._budget_s:
            return None
        return self._plan()[0]

    def halt(self) -> None:
        self._halted = True

    def record(self, point: float, outcome: Outcome) -> None:
        self._standing.record(point, outcome)

    def result(self) -> QpsSearchResult:
        point, why = self._plan()
        standing = self._standing
        return QpsSearchResult(
            best_qps=standing.highest_pass() or 0.0,
            lowest_failing_qps=standing.believed_fail(point is None), converged=point is None,
            trials=tuple(standing.trials),
            stopped_by=stop_reason(point is None, self._halted, why),
            spent_s=standing.spent_s, undecided_qps=tuple(standing.points(Verdict.UNDECIDED)))
