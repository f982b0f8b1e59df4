"""The two searches of the benchmark, as step-by-step state machines.

A search proposes the next point (``next_point``), is told whether it met the SLO (``record``),
and says when it is done. Measuring is someone else's job, which is what lets several modes'
searches advance in lock-step (``relaygr.bench.alternate``).

- ``LengthSweep``: over an ascending length grid at fixed QPS, the longest length whose ranking
  P99 <= SLO. It starts at ``start`` (default: the shortest length) and walks up the grid; when
  the start itself fails it walks down until a length passes. Going up, it stops after the first
  failing length only while the P99 curve measured so far (ordered by length) is monotone
  non-decreasing (each P99 >= the previous one x (1 - ``monotone_tolerance``)): then every
  longer length would fail too. A curve that dips keeps the sweep going over the whole grid, and
  the answer is the longest passing length, flagged ``monotone=False``. Starting above the
  shortest length skips points every mode passes (the full run's budget goes to the knee).
  With ``confirm``, the answer rests on a second round of the two points that decide it (the
  knee: the longest passing length and the failing length above it): the sweep proposes each of
  them once more, the measurer pools the rounds (``relaygr.bench.suite``), and the pooled
  verdict replaces the first. A knee point that flips moves the knee (the sweep walks on up, or
  the passing length below is confirmed next) until both points of the knee are confirmed. The
  second round takes the place of the dip rule: a confirmed sweep stops above its knee whatever
  the shape of the curve below it (a dip between two passing lengths far under the SLO is noise
  of the same kind, and walking the rest of the grid for it cost whole minutes).
- ``QpsSearch``: the highest Poisson QPS whose ranking P99 <= SLO, as MLPerf's server-scenario
  search does: an exponential ramp from ``start_qps`` (x ``growth`` while passing, / ``growth``
  while failing) until the answer is bracketed, then bisection until the bracket is within
  ``rel_tol`` or ``max_trials`` trials are spent. The answer is the highest passing QPS measured
  (0 when none passed).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from relaygr.errors import ConfigError

P = TypeVar("P")


@dataclass(frozen=True)
class Trial(Generic[P]):
    """One measured point of a search."""

    point: P
    p99_ms: float
    passed: bool
    round: int = 1      # 2: the verdict of this point pooled over two rounds


class Search(Protocol[P]):
    """A search driven from outside: ask for a point, measure it, record the verdict."""

    def next_point(self) -> P | None: ...

    def record(self, point: P, p99_ms: float, passed: bool) -> None: ...


@dataclass(frozen=True)
class LengthSweepResult:
    max_seq_len: int            # 0 when no length passed
    first_failing_len: int | None
    monotone: bool
    trials: tuple[Trial[int], ...]      # in the order measured, second rounds included

    def latest(self) -> tuple[Trial[int], ...]:
        """The verdict standing for each length measured, by length."""
        return tuple(sorted({t.point: t for t in self.trials}.values(), key=lambda t: t.point))


class LengthSweep:
    """Longest passing length of an ascending grid (see the module docstring)."""

    def __init__(self, lengths: tuple[int, ...], monotone_tolerance: float = 0.05,
                 start: int | None = None, confirm: bool = False) -> None:
        if not lengths or list(lengths) != sorted(set(lengths)) or lengths[0] < 1:
            raise ConfigError(f"length grid must be ascending, distinct and >= 1: {lengths}")
        if start is not None and start not in lengths:
            raise ConfigError(f"sweep start {start} is not on the length grid {lengths}")
        self._lengths, self._tolerance = lengths, monotone_tolerance
        self._start = 0 if start is None else lengths.index(start)
        self._confirm = confirm
        self._trials: list[Trial[int]] = []
        self._verdicts: dict[int, Trial[int]] = {}    # length -> its standing verdict

    def next_point(self) -> int | None:
        explore = self._explore()
        if explore is not None or not self._confirm:
            return explore
        return next((n for n in self._knee() if self._verdicts[n].round < 2), None)

    def _explore(self) -> int | None:
        if not self._verdicts:
            return self._lengths[self._start]
        measured = sorted(self._lengths.index(n) for n in self._verdicts)
        if not self._passing():   # walking down from a failing start
            return self._lengths[measured[0] - 1] if measured[0] > 0 else None
        if len(self._knee()) == 2 and (self._confirm or self.monotone):   # failed above a pass
            return None
        above = measured[-1] + 1
        return self._lengths[above] if above < len(self._lengths) else None

    def _passing(self) -> list[int]:
        return [n for n, t in self._verdicts.items() if t.passed]

    def _knee(self) -> list[int]:
        """The longest passing length and the shortest failing length above it (each if any)."""
        highest = max(self._passing(), default=None)
        above = [n for n, t in self._verdicts.items()
                 if not t.passed and n > (highest or 0)]
        return [n for n in (highest, min(above, default=None)) if n is not None]

    def record(self, point: int, p99_ms: float, passed: bool) -> None:
        assert point == self.next_point(), "LengthSweep records the point it proposed"
        previous = self._verdicts.get(point)
        trial = Trial(point, p99_ms, passed, 1 if previous is None else previous.round + 1)
        self._trials.append(trial)
        self._verdicts[point] = trial

    @property
    def monotone(self) -> bool:
        p99 = [self._verdicts[n].p99_ms for n in sorted(self._verdicts)]
        return all(b >= a * (1 - self._tolerance) for a, b in itertools.pairwise(p99))

    def result(self) -> LengthSweepResult:
        failing = [n for n, t in self._verdicts.items() if not t.passed]
        return LengthSweepResult(max(self._passing(), default=0), min(failing, default=None),
                                 self.monotone, tuple(self._trials))


@dataclass(frozen=True)
class QpsSearchResult:
    best_qps: float             # 0 when no QPS passed
    lowest_failing_qps: float | None
    converged: bool             # bracket within rel_tol (or a bound reached)
    trials: tuple[Trial[float], ...]


class QpsSearch:
    """Highest passing QPS by exponential ramp then bisection (see the module docstring)."""

    def __init__(self, start_qps: float, growth: float = 2.0, rel_tol: float = 0.05,
                 max_trials: int = 10, min_qps: float = 0.1, max_qps: float = 1e6) -> None:
        if not (0 < min_qps <= start_qps <= max_qps and growth > 1 and rel_tol > 0):
            raise ConfigError("QpsSearch needs 0 < min_qps <= start_qps <= max_qps, "
                              "growth > 1 and rel_tol > 0")
        if max_trials < 1:
            raise ConfigError("QpsSearch needs max_trials >= 1")
        self._start, self._growth, self._tol = start_qps, growth, rel_tol
        self._max_trials, self._min, self._max = max_trials, min_qps, max_qps
        self._trials: list[Trial[float]] = []
        self._pass: float | None = None   # highest passing QPS
        self._fail: float | None = None   # lowest failing QPS

    def next_point(self) -> float | None:
        if len(self._trials) >= self._max_trials or self._converged():
            return None
        if not self._trials:
            return self._start
        if self._fail is None:
            assert self._pass is not None
            return min(self._pass * self._growth, self._max)
        if self._pass is None:
            return max(self._fail / self._growth, self._min)
        return (self._pass + self._fail) / 2

    def _converged(self) -> bool:
        if self._pass is not None and self._fail is not None:
            return self._fail <= self._pass * (1 + self._tol)
        if self._pass is not None and self._pass >= self._max:
            return True
        return self._fail is not None and self._fail <= self._min

    def record(self, point: float, p99_ms: float, passed: bool) -> None:
        self._trials.append(Trial(point, p99_ms, passed))
        if passed:
            self._pass = point if self._pass is None else max(self._pass, point)
        else:
            self._fail = point if self._fail is None else min(self._fail, point)

    def result(self) -> QpsSearchResult:
        return QpsSearchResult(self._pass or 0.0, self._fail, self._converged(),
                               tuple(self._trials))


def bracket_width(result: QpsSearchResult) -> float:
    """Relative width of the final bracket (inf when unbracketed)."""
    if not result.best_qps or result.lowest_failing_qps is None:
        return math.inf
    return result.lowest_failing_qps / result.best_qps - 1
