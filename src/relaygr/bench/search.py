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
- ``QpsSearch`` (``relaygr.bench.qps_search``): the highest SLO-compliant Poisson QPS.

Verdicts are ``Verdict``s (``relaygr.bench.decision``): an undecided point is neither a pass
nor a fail. The sweep walks on up past an undecided length (it bounds nothing), and walks down
from a start that did not pass.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from relaygr.bench.decision import Verdict
from relaygr.errors import ConfigError

P = TypeVar("P")


@dataclass(frozen=True)
class Outcome:
    """What measuring one point told a search: its P99 estimate, verdict and cost (seconds
    of the run clock, re-measures included)."""

    p99_ms: float
    verdict: Verdict
    duration_s: float = 0.0


@dataclass(frozen=True)
class Trial(Generic[P]):
    """One measured point of a search."""

    point: P
    p99_ms: float
    verdict: Verdict
    round: int = 1      # 2: measured a second time (pooled in the sweep, afresh in the search)

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.PASS


class Search(Protocol[P]):
    """A search driven from outside: ask for a point, measure it, record the outcome."""

    def next_point(self) -> P | None: ...

    def record(self, point: P, outcome: Outcome) -> None: ...


@dataclass(frozen=True)
class LengthSweepResult:
    max_seq_len: int            # 0 when no length passed
    first_failing_len: int | None
    monotone: bool
    trials: tuple[Trial[int], ...]      # in the order measured, second rounds included
    # The shortest length that failed above ``max_seq_len`` (None: none did, so the answer is
    # only a lower bound) and the lengths whose standing verdict is undecided.
    failing_above_len: int | None = None
    undecided_lens: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()       # the grid swept

    @property
    def answer_interval(self) -> tuple[float, float]:
        """[low, high] of the grid answer: the longest passing length, up to the longest grid
        length below the first failing one above it (inf: nothing failed above it)."""
        if self.failing_above_len is None:
            return float(self.max_seq_len), math.inf
        below = [n for n in self.lengths if n < self.failing_above_len]
        return float(self.max_seq_len), float(max(below, default=self.max_seq_len))

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
        if not self._passing():   # walking down from a start that did not pass
            return self._lengths[measured[0] - 1] if measured[0] > 0 else None
        if len(self._knee()) == 2 and (self._confirm or self.monotone):   # failed above a pass
            return None
        above = measured[-1] + 1
        return self._lengths[above] if above < len(self._lengths) else None

    def _passing(self) -> list[int]:
        return [n for n, t in self._verdicts.items() if t.passed]

    def _failing_above(self) -> list[int]:
        highest = max(self._passing(), default=0)
        return [n for n, t in self._verdicts.items()
                if t.verdict is Verdict.FAIL and n > highest]

    def _knee(self) -> list[int]:
        """The longest passing length and the shortest failing length above it (each if any)."""
        highest = max(self._passing(), default=None)
        return [n for n in (highest, min(self._failing_above(), default=None)) if n is not None]

    def record(self, point: int, outcome: Outcome) -> None:
        assert point == self.next_point(), "LengthSweep records the point it proposed"
        previous = self._verdicts.get(point)
        trial = Trial(point, outcome.p99_ms, outcome.verdict,
                      1 if previous is None else previous.round + 1)
        self._trials.append(trial)
        self._verdicts[point] = trial

    @property
    def monotone(self) -> bool:
        p99 = [self._verdicts[n].p99_ms for n in sorted(self._verdicts)]
        return all(b >= a * (1 - self._tolerance) for a, b in itertools.pairwise(p99))

    def result(self) -> LengthSweepResult:
        failing = [n for n, t in self._verdicts.items() if t.verdict is Verdict.FAIL]
        undecided = sorted(n for n, t in self._verdicts.items()
                           if t.verdict is Verdict.UNDECIDED)
        return LengthSweepResult(max(self._passing(), default=0), min(failing, default=None),
                                 self.monotone, tuple(self._trials),
                                 min(self._failing_above(), default=None), tuple(undecided),
                                 self._lengths)
