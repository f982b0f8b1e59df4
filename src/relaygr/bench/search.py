"""The two searches of the benchmark, as step-by-step state machines, and the one rule they
share for believing a miss.

A search proposes the next point (``next_point``), is told whether it met the SLO (``record``),
and says when it is done. Measuring is someone else's job, which is what lets several modes'
searches advance in lock-step (``relaygr.bench.alternate``).

Noise on a shared machine only slows a system down: it can turn a pass into a miss, never a
miss into a pass. So a pass stands, and two things stand between a miss and the answer: the
measurer re-measures a point that did not pass while the host was measured noisy
(``relaygr.bench.noise``, in ``relaygr.bench.meter``), and the searches re-measure the fail
that decides their answer. That fail is the lowest failing point above the highest passing one
(``Standing.deciding_fail``): measured once, it is proposed once more, afresh, and the second
verdict stands (``Standing.recheck``). A hiccup the noise readings missed fails one round,
seldom two in a row; a real limit fails both.

- ``LengthSweep``: over an ascending length grid at fixed QPS, the longest length whose ranking
  P99 verdict is a pass. It starts at ``start`` (default: the shortest length) and walks up the
  grid, past undecided lengths (they bound nothing); when the start does not pass it walks down
  until a length passes. It stops at a fail above a pass once that fail has been re-measured
  and failed again; a re-measure that passes (or is undecided) lets it walk on up. Like the
  QPS search, it proposes nothing once ``budget_s`` seconds of measuring are spent, nor once
  halted (the run's deadline, ``relaygr.bench.suite``), and the result then says which
  (``stopped_by``): what it has decided stands, the rest is an open bracket. With ``rel_tol``
  it then narrows the bracket the grid left, as the QPS search does: the geometric midpoint of
  the gap above the highest pass (else of the gap below the believed fail), rounded to
  ``quantum_tokens``, until each gap is within ``rel_tol`` of its lower end or no multiple of
  the quantum lies inside it. A fail there is re-measured like any deciding fail. On a grid of
  2x steps two systems' brackets otherwise leave their ratio within a factor of 4 whatever it
  is; one step each can decide a 2x bar.
- ``QpsSearch`` (``relaygr.bench.qps_search``): the highest SLO-compliant Poisson QPS, by the
  same rule.

Verdicts are ``Verdict``s (``relaygr.bench.decision``): an undecided point is neither a pass
nor a fail.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from relaygr.bench.decision import Verdict
from relaygr.errors import ConfigError

P = TypeVar("P")
Q = TypeVar("Q", int, float)   # a point of a search: a length or a rate


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
    round: int = 1      # 2: measured a second time, afresh (``Standing.recheck``)

    @property
    def passed(self) -> bool:
        return self.verdict is Verdict.PASS


class Search(Protocol[P]):
    """A search driven from outside: ask for a point, measure it, record the outcome; ``halt``
    when the run's time is up (it proposes nothing more and its result says ``deadline``)."""

    def next_point(self) -> P | None: ...

    def record(self, point: P, outcome: Outcome) -> None: ...

    def halt(self) -> None: ...


class Standing(Generic[Q]):
    """Each measured point's standing verdict (its latest trial), and the rule both searches
    share for believing a miss (module docstring)."""

    def __init__(self) -> None:
        self.trials: list[Trial[Q]] = []       # in the order measured, second rounds included
        self.latest: dict[Q, Trial[Q]] = {}
        self.spent_s = 0.0                      # seconds of measuring, every outcome's cost

    def record(self, point: Q, outcome: Outcome) -> None:
        previous = self.latest.get(point)
        trial = Trial(point, outcome.p99_ms, outcome.verdict,
                      1 if previous is None else previous.round + 1)
        self.trials.append(trial)
        self.latest[point] = trial
        self.spent_s += outcome.duration_s

    def points(self, verdict: Verdict | None = None) -> list[Q]:
        """The points measured (with ``verdict``, if given), ascending."""
        return sorted(p for p, t in self.latest.items() if verdict is None or t.verdict is verdict)

    def highest_pass(self) -> Q | None:
        return max(self.points(Verdict.PASS), default=None)

    def deciding_fail(self) -> Q | None:
        """The lowest failing point above the highest passing one (the lowest failing point
        when nothing passed): the upper end of the answer's bracket."""
        highest = self.highest_pass()
        return min((p for p in self.points(Verdict.FAIL) if highest is None or p > highest),
                   default=None)

    def believed_fail(self, walk_done: bool) -> Q | None:
        """The deciding fail once the rule believes it: what a result may bound its answer
        with. With a pass below it, once re-measured; with none, once the search's walk is done
        (it walked down to the bottom failing, or stopped at a bound). A search stopped by its
        budget or the deadline before either leaves its bracket open above: a fail measured
        once, nothing passed below it, may be a hiccup. A deciding fail still to be re-measured
        leaves the bound to the lowest fail above it that was (None: none was)."""
        fail = self.deciding_fail()
        if fail is None:
            return None
        if self.recheck() is not None:
            # it waits for its re-measure; a fail above it already re-measured still bounds
            # (a narrowing's midpoint measured once when the time ran out, say)
            return min((p for p in self.points(Verdict.FAIL)
                        if p > fail and self.latest[p].round > 1), default=None)
        return fail if walk_done or self.highest_pass() is not None else None

    def gaps(self, lo: Q, hi: Q) -> tuple[tuple[Q, Q], tuple[Q, Q]]:
        """The bracket [``lo``, ``hi``)'s two gaps a search narrows: from its pass ``lo`` to the
        next point measured above it, and from the highest point measured below its fail ``hi``
        to ``hi`` (the same gap when nothing undecided lies between)."""
        points = self.points()
        return ((lo, min(p for p in points if p > lo)), (max(p for p in points if p < hi), hi))

    def recheck(self) -> Q | None:
        """The deciding fail, when a pass lies below it and it was measured once: to be
        measured again, afresh, its second verdict standing."""
        fail = self.deciding_fail()
        if fail is None or self.highest_pass() is None or self.latest[fail].round > 1:
            return None
        return fail


@dataclass(frozen=True)
class LengthSweepResult:
    max_seq_len: int            # 0 when no length passed
    first_failing_len: int | None
    trials: tuple[Trial[int], ...]      # in the order measured, second rounds included
    # The shortest length that failed above ``max_seq_len`` (None: none did, so the answer is
    # only a lower bound) and the lengths whose standing verdict is undecided.
    failing_above_len: int | None = None
    undecided_lens: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()       # the grid swept, with the lengths narrowing added
    # or "budget": the sweep's measuring time ran out first; "deadline": the run's did
    stopped_by: str = "answer"
    spent_s: float = 0.0

    @property
    def answer_interval(self) -> tuple[float, float]:
        """[low, high] of the grid answer: the longest passing length, up to the longest grid
        length below the first failing one above it (inf: nothing failed above it)."""
        if self.failing_above_len is None:
            return float(self.max_seq_len), math.inf
        below = [n for n in self.lengths if n < self.failing_above_len]
        return float(self.max_seq_len), float(max(below, default=self.max_seq_len))

    @property
    def bracket(self) -> tuple[float, float]:
        """[low, high) of the length itself, not of its grid answer: at least the longest
        passing length, below the first failing one above it (inf: nothing failed above it; 0
        when nothing passed). What a ratio of two lengths is known within: on a grid of 2x
        steps the grid answers of two systems differ by a power of two whatever their true
        ratio is."""
        high = math.inf if self.failing_above_len is None else float(self.failing_above_len)
        return float(self.max_seq_len), high

    def latest(self) -> tuple[Trial[int], ...]:
        """The verdict standing for each length measured, by length."""
        return tuple(sorted({t.point: t for t in self.trials}.values(), key=lambda t: t.point))


class LengthSweep:
    """Longest passing length of an ascending grid (see the module docstring)."""

    def __init__(self, lengths: tuple[int, ...], start: int | None = None,
                 budget_s: float = math.inf, rel_tol: float | None = None,
                 quantum_tokens: int = 16) -> None:
        if not lengths or list(lengths) != sorted(set(lengths)) or lengths[0] < 1:
            raise ConfigError(f"length grid must be ascending, distinct and >= 1: {lengths}")
        if start is not None and start not in lengths:
            raise ConfigError(f"sweep start {start} is not on the length grid {lengths}")
        if not budget_s > 0:
            raise ConfigError(f"LengthSweep needs budget_s > 0, got {budget_s}")
        if (rel_tol is not None and not rel_tol > 0) or quantum_tokens < 1:
            raise ConfigError(f"LengthSweep needs rel_tol > 0 (or None) and quantum_tokens >= 1,"
                              f" got {rel_tol} and {quantum_tokens}")
        self._lengths = lengths
        self._tol, self._quantum = rel_tol, quantum_tokens
        self._start = 0 if start is None else lengths.index(start)
        self._standing: Standing[int] = Standing()
        self._budget_s = budget_s
        self._halted = False

    @property
    def rel_tol(self) -> float | None:
        """How narrow it makes the grid's bracket (None: not past the grid)."""
        return self._tol

    def next_point(self) -> int | None:
        if self._halted or self._standing.spent_s >= self._budget_s:
            return None
        return self._plan()

    def halt(self) -> None:
        self._halted = True

    def _plan(self) -> int | None:
        """The next length by the walk alone (the budget aside); None: the walk is done."""
        standing = self._standing
        if not standing.latest:
            return self._lengths[self._start]
        again = standing.recheck()
        if again is not None:
            return again
        lo, hi = standing.highest_pass(), standing.deciding_fail()
        if lo is not None and hi is not None:   # failed twice above a pass: the bracket
            return self._narrow(lo, hi)
        # the grid walk: every length measured so far is on the grid
        measured = [self._lengths.index(n) for n in standing.points()]
        if lo is None:   # walking down from a start that did not pass
            return self._lengths[measured[0] - 1] if measured[0] > 0 else None
        above = measured[-1] + 1
        return self._lengths[above] if above < len(self._lengths) else None

    def _narrow(self, lo: int, hi: int) -> int | None:
        """The midpoint of the bracket's gap above ``lo`` (to the next length measured) or else
        of its gap below ``hi``, whichever is wider than ``rel_tol`` first; None when neither
        is, or no multiple of the quantum lies strictly inside it. Undecided lengths between
        the two gaps bound nothing and are not probed among (as in ``QpsSearch``)."""
        if self._tol is None:
            return None
        for a, b in self._standing.gaps(lo, hi):
            middle = self._quantum * round(math.sqrt(a * b) / self._quantum)
            if b > a * (1 + self._tol) and a < middle < b:
                return middle
        return None

    def record(self, point: int, outcome: Outcome) -> None:
        assert point == self.next_point(), "LengthSweep records the point it proposed"
        self._standing.record(point, outcome)

    def result(self) -> LengthSweepResult:
        standing = self._standing
        done = self._plan() is None
        return LengthSweepResult(standing.highest_pass() or 0,
                                 min(standing.points(Verdict.FAIL), default=None),
                                 tuple(standing.trials), standing.believed_fail(done),
                                 tuple(standing.points(Verdict.UNDECIDED)),
                                 tuple(sorted({*self._lengths, *standing.points()})),
                                 stop_reason(done, self._halted), standing.spent_s)


def stop_reason(done: bool, halted: bool, finished: str = "answer") -> str:
    """Why a search stopped: its walk was ``done`` (``finished``), else the run's deadline
    halted it, else its own budget ran out."""
    return finished if done else "deadline" if halted else "budget"
